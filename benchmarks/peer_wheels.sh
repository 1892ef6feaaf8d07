#!/usr/bin/env bash
# The block-sparse peers' wheels for the GPU machine (bench_sparse_peers.py, ADR 0056), in two
# parts small enough for one device call each (64 MiB with the working tree and .whl: part0
# 48.2 MB, part1 36.3 MB as made on 2026-12-07).
#
# The GPU image has torch 2.11.0+cu130 (with cuda-bindings) and no network. The peers need
# (pip download --no-deps, their SHA-256 checked below):
#   flash-attn-4 4.0.0b40            0.57 MB  FlashAttention-4 (CuTe DSL)
#   nvidia-cudnn-frontend 1.32.0    11.6 MB  cudnn.flex_attention (CuTe DSL) and BSA
#   nvidia-cutlass-dsl 4.8.1         0.01 MB  and its libs-base (3.1 MB), libs-core (1.6 MB)
#   nvidia-cutlass-dsl-libs-cu13     92.0 MB  the CUDA 13 compiler library: over one call, so
#                                             its installed tree travels xz-compressed and split
#   quack-kernels 0.6.5 (0.73 MB), apache-tvm-ffi 0.1.15.post2 (3.3 MB), einops 0.8.2
#   protobuf (cutlass-dsl's import; the GPU image has it: flash-msa's FA4 imported there with
#   the same set in 2026-12-04's calls, ADR 0029)
# torch-c-dlpack-ext is not needed (torch 2.11 has the DLPack exchange API, ADR 0029).
#
# Run here from the repository root (or give a directory that already holds the nine wheels as
# $1); xz -9 of the 237 MB tree takes minutes. Writes, git-ignored:
#   .peers/part0   the first 46 MiB of the xz'd libs-cu13 tree
#   .peers/part1   the rest of it and the other wheels
# Then device runs on one warm machine, back to back (it keeps /tmp while warm), one part each;
# `python3 -m benchmarks.device peer_part --help` gives the sequence (part0's run measures ours
# and cuDNN alone, part1's and the next the peers). The parts install once both have come.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# SHA-256 of each wheel, as downloaded on 2026-12-07.
sums="$work/SHA256SUMS"
cat > "$sums" <<'EOF'
7c7a374397808dfbb47620066db2ce152b8e2bb86e8b05c8876f4608b5f65152  flash_attn_4-4.0.0b40-py3-none-any.whl
8b354a8e550c083eb247f1eb39a7d69a4a269075f5a01e4fcbd2531680b17239  nvidia_cudnn_frontend-1.32.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
43ed46b21d151aa643c6765457c7310827b938c1cf45d5109a0152de4ef06227  nvidia_cutlass_dsl-4.8.1-py3-none-any.whl
ac2fd8c7fa3d6ded00917fa7cba8686061005da8c4703c6a29e03c1504543909  nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
bacc6760e3286db447d45720d32ae58ac2e6cecade1152345ef784b2d5e44431  nvidia_cutlass_dsl_libs_core-4.8.1-py3-none-any.whl
50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90  nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
df1ddd31366c82eb9692fe087c671209189dcbde53c909c81a865d4ee66b158d  quack_kernels-0.6.5-py3-none-any.whl
059eed9bfc94bcd41650fb8eefde74040a1bc7e7b1a6f0a8ff897b02b118875b  apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
54058201ac7087911181bfec4af6091bb59380360f069276601256a76af08193  einops-0.8.2-py3-none-any.whl
EOF
mkdir -p "$work/wheels"
if [[ $# -ge 1 ]]; then
  cp "$1"/*.whl "$work/wheels/"  # a directory that already holds the nine wheels
else
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 -d "$work/wheels" \
    flash-attn-4==4.0.0b40 nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1 \
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
    nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 \
    einops==0.8.2
fi
(cd "$work/wheels" && sha256sum -c --quiet "$sums" && [[ $(ls | wc -l) -eq 9 ]]) || {
  echo "peer_wheels.sh: the wheels are not the nine of SHA256SUMS above" >&2; exit 1; }
cu13=$(ls "$work"/wheels/nvidia_cutlass_dsl_libs_cu13-*.whl)
# The tree as pip installs it for the device's Python 3.12, whatever this python3 is.
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: \
  --python-version 3.12 --platform manylinux_2_28_x86_64 --target "$work/cu13" "$cu13"
tar -C "$work/cu13" -cf - . | xz -9 -T2 > "$work/cu13.tar.xz"
rm "$cu13"
rm -rf .peers
mkdir -p .peers/part0 .peers/part1
split -b 46M -d -a 2 "$work/cu13.tar.xz" "$work/cu13.tar.xz.part"
mv "$work/cu13.tar.xz.part00" .peers/part0/
mv "$work"/cu13.tar.xz.part0[1-9] .peers/part1/
mv "$work"/wheels/*.whl .peers/part1/
(cd "$work" && sha256sum cu13.tar.xz) > .peers/part1/cu13.tar.xz.sha256
du -sh .peers/* | sed 's/^/peer_wheels.sh: /'
