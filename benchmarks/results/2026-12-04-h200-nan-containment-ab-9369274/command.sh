set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 NEMO_MSA_COMMIT=$(cat .run/commit)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/environment.txt
PYTHONPATH=/tmp/site:$PWD timeout 140 python3 -m pytest -q -rs -p no:cacheprovider -W ignore::UserWarning tests/core/test_nonfinite_containment.py tests/msa_kernels/test_triton_nonfinite.py > $OUT/gpu_tests_nan.log 2>&1; echo "rc $?" >> $OUT/gpu_tests_nan.log; tail -4 $OUT/gpu_tests_nan.log
(cd .run/base && PYTHONPATH=/tmp/site:$PWD NEMO_MSA_COMMIT=bd69294 timeout 75 python3 scripts/bench_msa.py --sizes 131072 --packed 0 --no-dense --json $OUT/msa_before.json > $OUT/msa_before.log 2>&1; echo "rc $?" >> $OUT/msa_before.log); tail -8 $OUT/msa_before.log
PYTHONPATH=/tmp/site:$PWD timeout 75 python3 scripts/bench_msa.py --sizes 131072 --packed 0 --no-dense --json $OUT/msa_after.json > $OUT/msa_after.log 2>&1; echo "rc $?" >> $OUT/msa_after.log; tail -8 $OUT/msa_after.log
