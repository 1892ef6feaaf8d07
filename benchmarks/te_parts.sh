#!/usr/bin/env bash
# Transformer Engine for the GPU machine, in parts small enough for one device call each.
#
# The GPU image has torch 2.11.0+cu130 and no Transformer Engine; TE's core wheel (276.5 MB) is
# larger than one call may carry (64 MiB with the working tree). This script, run here from the
# repository root, downloads it (or takes the file given as $1), checks its SHA-256 against
# ../shared/te/SHA256SUMS, and writes, git-ignored:
#   .te/part0 .. .te/part4   one 54 MiB part each (the last one smaller): one part and the
#                            working tree (about 7 MiB) fit a call; .whl goes with the last
#   .te/kit                  ../shared/te: the torch extension built for torch 2.11.0+cu130, the
#                            meta wheel, the small dependencies and install_te.sh
# Then, on a warm machine, five device calls back to back (each within 30 s of the last):
#   carry [".te/part0"]  python3 -m benchmarks.device te_part
#   ... part1, part2, part3 the same ...
#   carry [".te/part4", ".te/kit", ".whl"]
#       python3 -m benchmarks.device te_part; python3 -m benchmarks.device te
# te_part copies the carried part to /tmp/te (kept while the machine is warm); te joins and
# installs them (.te/kit/install_te.sh) before its tests. Later calls on the same warm machine
# find TE installed. benchmarks/README.md says how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED_TE:-../shared/te}
CORE=transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ $# -ge 1 ]]; then
  cp "$1" "$work/$CORE"
else
  python3 -m pip download -q --no-deps transformer-engine-cu13==2.20.2 -d "$work"
fi
(cd "$work" && sha256sum -c --ignore-missing "$OLDPWD/$SHARED/SHA256SUMS" | grep -q "$CORE: OK") \
  || { echo "te_parts.sh: $CORE does not match $SHARED/SHA256SUMS" >&2; exit 1; }
rm -rf .te
mkdir -p .te/kit
split -b 54M -d -a 2 "$work/$CORE" "$work/$CORE.part"
i=0
for part in "$work/$CORE".part*; do
  mkdir -p ".te/part$i"
  mv "$part" ".te/part$i/"
  i=$((i + 1))
done
cp "$SHARED"/* .te/kit/
du -sh .te/* | sed 's/^/te_parts.sh: /'
