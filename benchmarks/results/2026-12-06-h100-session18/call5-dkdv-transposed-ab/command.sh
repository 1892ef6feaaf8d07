# session 18 call 5, tree 5c40d00 + working-tree change (dk/dv transposed)
bash .run/s18call5.sh
# Session 18 call 5 (working tree on .run/commit = 5c40d00 + the transposed dk/dv step, defaults
# kv_bn 128 / kv_rows 32 / kv_warps 8): A/B on whole training steps against 5c40d00 (.base),
# coherent and fresh selections, then the compiled GPU tests of the backward.
set -uo pipefail
export PYTHONUNBUFFERED=1 NEMO_MSA_COMMIT="$(cat .run/commit)+dkdv-transposed"
{ echo "# session 18 call 5, tree $(cat .run/commit) + working-tree change (dk/dv transposed)"; echo "bash .run/s18call5.sh"; cat .run/s18call5.sh; } > $OUT/command.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
root=$OUT
for index in coherent fresh; do
  mkdir -p $root/$index
  OUT=$root/$index STAGES=sweep SWEEP_ROWS=8192,32768 SWEEP_S=110 SWEEP_ARGS="--steps 5 --index $index" \
    SWEEP_SETS="tree=.base;;bwd.kv_bn=64" \
    bash benchmarks/device_validation.sh | grep -v "^|--" | cut -c1-200 | tail -n 40
done
PYTHONPATH=/tmp/site:$PWD timeout -s INT -k 20 170 python3 -m pytest -q -p no:cacheprovider \
  tests/core/test_gpu_core.py tests/msa_kernels/test_triton_attention.py \
  tests/msa_kernels/test_triton_nonfinite.py tests/msa_kernels/test_triton_query_subset.py \
  > $root/gpu_tests.log 2>&1
echo "pytest rc $?" >> $root/gpu_tests.log
tail -n 15 $root/gpu_tests.log
echo "total ${SECONDS}s"
cd $root && tar czf results.tgz --remove-files $(ls | grep -v '^command.sh$')
