#!/usr/bin/env bash
# Megatron-Bridge 0.6.2 and the wheels it imports, for the GPU machine (ADR 0055), in folders
# small enough for one device call each (64 MiB a call with the working tree, about 8 MiB).
#
# Run here from the repository root; writes, git-ignored:
#   .whl_bridge/import/   19.8 MB: Bridge and what `import megatron.bridge` needs beyond TE (ADR
#                         0039's list plus regex): nemo_msa.bridge (configs, M3 mapping), tests
#   .whl_bridge/train/    33.5 MB: what Bridge's training stack imports (training.config,
#                         gpt_step, setup, train), except pyarrow and scipy
#   .whl_bridge/pyarrow/  55.0 MB: pyarrow (HF datasets)
#   .whl_bridge/scipy/    35.3 MB: scipy (nvidia-modelopt, which gpt_step imports)
# Then, on a warm machine that has TE (benchmarks/te_parts.sh), one call per folder:
#   carry [".whl_bridge/pyarrow"]          python3 -m benchmarks.device bridge --install-only
#   carry [".whl_bridge/scipy"]            python3 -m benchmarks.device bridge --install-only
#   carry [".whl_bridge/train"]            python3 -m benchmarks.device bridge --install-only
#   carry [".whl_bridge/import", ".whl"]   python3 -m benchmarks.device bridge
# Each wheel is pinned to the version measured on the CPU (2026-12-07); all install with
# --no-deps. The GPU image may already hold some of them (it has the onnx packages, and
# transformers 5.17.0, which Bridge's pin refuses: ADR 0039).
set -euo pipefail
cd "$(dirname "$0")/.."
# A Python 3.12 on x86-64 Linux picks the GPU image's wheels (CPython 3.12, manylinux).
PY=${PYTHON:-.venv/bin/python}

IMPORT=(
  megatron-bridge==0.6.2 transformers==5.12.1 tokenizers==0.22.2 huggingface_hub==1.33.0
  safetensors==0.8.0 rich==15.0.0 anyio==4.16.0 certifi==2026.10.19.post1 markdown-it-py==4.3.0
  httpcore==1.0.9 httpx==0.29.0 idna==3.21 h11==0.16.0 sniffio==1.3.1 mdurl==0.1.2
  regex==2026.12.2
)
TRAIN=(
  datasets==5.2.0 multiprocess==0.70.19 pandas==3.1.1 dill==0.4.1 xxhash==4.1.0
  ipython==9.19.1 traitlets==5.16.1 megatron-energon==7.4.1 multi-storage-client==1.3.1
  xattr==1.3.1 cffi==2.1.1 lark==1.3.1 wcmatch==12.0.4 bracex==3.2.4 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 attrs==26.1.0 referencing==0.37.0 rpds-py==2026.9.1
  opentelemetry-api==1.45.3 braceexpand==0.1.7 rapidyaml==0.15.2 deprecation==2.1.0
  filetype==1.2.0 webdataset==1.0.2 nvidia-modelopt==0.47.0 requests==2.34.2 urllib3==2.8.0
  pulp==4.2.0 orloge==1.0.0 cpsat_logutils==1.0.0 tensorboard==2.21.0 absl-py==2.5.1
)
# Not nvidia-resiliency-ext: its PyPI release (0.4.1) has no __version__, which megatron-core
# 0.19.2 reads at import (it wants >= 0.6.0), so installing it breaks `import megatron.core`;
# without it only megatron.bridge.training.pretrain (in-process restart) does not import, and
# benchmarks/bridge_msa.py runs Bridge's setup + train, as pretrain does (ADR 0055).
PYARROW=(pyarrow==26.0.1)
SCIPY=(scipy==1.18.1)

fetch() {  # fetch DIR WHEEL...
  local dir=$1
  shift
  rm -rf "$dir"
  mkdir -p "$dir"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$dir" "$@"
  du -sh "$dir" | sed 's/^/bridge_wheels.sh: /'
}
fetch .whl_bridge/import "${IMPORT[@]}"
fetch .whl_bridge/train "${TRAIN[@]}"
fetch .whl_bridge/pyarrow "${PYARROW[@]}"
fetch .whl_bridge/scipy "${SCIPY[@]}"
