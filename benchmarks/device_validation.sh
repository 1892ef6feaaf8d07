#!/usr/bin/env bash
# Device calls that check the GPU paths end to end (run from the repo root on the H200); the
# first stage fills one call, the other two make a second:
#   1. every test of tests/core and tests/msa_kernels compiled on the GPU, plus the gpu-marked ones;
#   2. a few hundred steps of single-GPU pretraining, bf16, Triton backend (issue 5, item 9);
#   3. the pipeline integration recipe collapsed to TP=1/PP=1 on one GPU (issue 6, what one GPU
#      allows).
# Needs the megatron-core and omegaconf wheels in .whl/ (`pip download`, as the device tool's
# README says; carried with `carry`); writes to $OUT.
# PRETRAIN_ARGS adds recipe overrides to stage 2 (e.g. model.msa_indexer_loss_type=sparse).
# STAGES picks the parts to run (default "tests": its two pytest calls, bounded by GPU_TESTS_S
# (400 s) and GPU_MARKED_S (120 s), fill one call, but the first does not finish in it: on an
# H100, 367 of its 531 tests ran in 230 s and 101 of the rest in 290 s, and the second 9-17 s;
# "pretrain pp1" is a second call; GPU_TEST_PATHS narrows the first pytest call, e.g. to
# tests/core/test_dense_attention.py, or to the files from where a bound stopped the last call;
# the log gives each pytest call's exit status, 124 where its bound stopped it, and the bound
# interrupts pytest, which still prints its counts; the output names the last test the first
# call finished); "bench" adds
# benchmarks/bench_msa.py runs, one per ';'-separated argument list in BENCH_RUNS, all logged to
# $OUT/bench.log under "== bench <n>" headers (one file: the device tool returns only a few).
# "rows" runs issue #28's five bench_layer.py rows (ROWS_TOKENS) twice, dense and MSA each time:
# with the untrained indexer's selections, and with coherent, trained-like ones (--index coherent),
# writing $OUT/rows_fresh.json and rows_coherent.json (each process bounded by ROWS_S, 270 s).
# "layer" adds benchmarks/bench_layer.py (one-layer MiniMax-M3 GPTModel training step, dense vs MSA,
# plus the dense_attention / cudnn_attention rows) with the arguments in LAYER_ARGS, writing
# $OUT/layer.json and $OUT/layer.log and printing its table; LAYER_S bounds it (default 540 s).
# "peer" runs benchmarks/bench_flash_msa_peer.py (poolside's flash-msa beside our MSA op and cuDNN,
# same inputs; docs/adr/0029) within PEER_S seconds (default 520), writing $OUT/peer.log and
# $OUT/peer.json; flash-msa and its wheels must already be installed with pip --target in
# PEER_SITE (default /tmp/fm_site; /tmp/site is tried too); PEER_ARGS adds arguments.
# "fla_peer" runs benchmarks/bench_fla_nsa_peer.py (fla-core's NSA selected-block attention beside
# ours on the same q2k, and cuDNN; one document and packed documents of 8192/32768/131072 tokens,
# coherent and random selections; docs/adr/0029) within FLA_PEER_S seconds (default 540), writing
# $OUT/fla_peer.log and $OUT/fla_peer.json; fla-core and einops come from their wheels in .whl/
# (fla_core-0.6.0-py3-none-any.whl, einops-0.8.2-py3-none-any.whl: installed into /tmp/site with
# the others above; FLA_SITE names another --target directory); FLA_PEER_ARGS adds arguments
# (e.g. "--sizes 8192,32768 --inputs coherent").
# "ab" times kernels before and after a change in one call: for each ';'-separated argument list
# in AB_RUNS, benchmarks/bench_msa.py runs first in the tree under .base/ (carried: e.g. `git
# archive BASE_COMMIT | tar -x -C .base`), then in this tree, both logged to $OUT/ab.log under
# "== ab <n> base|head" headers; AB_S bounds each run (default 200 s).
# "sweep" times launch variants on whole training steps: for each ';'-separated entry of
# SWEEP_SETS (space-separated KERNEL.KEY=VALUE settings; an empty entry is the defaults),
# benchmarks/bench_layer.py runs the MSA rows SWEEP_ROWS (default 8192,32768:4096) in its own
# process, the variants in turn, SWEEP_ROUNDS times (default 2, so drift between processes shows
# as the spread of a variant's rounds); the first process also runs dense. Each row goes to
# $OUT/sweep.log under "== sweep <round> <variant>: ..." headers, every process's JSON into
# $OUT/sweep.json (keyed "<round>/<variant>"); SWEEP_S bounds each process (default 90 s),
# SWEEP_ARGS adds arguments (e.g. "--steps 5"). A variant's token "tree=DIR" runs it in the tree
# DIR instead of this one (its own scripts and package): SWEEP_SETS=";tree=.base" times a change
# on whole training steps, this tree and the base commit's (carried as .base, as for "ab")
# alternating in each round (a trailing empty entry is dropped: the defaults go first); the JSON
# records the tree's commit from its .commit file. SWEEP_CASES gives every process the same
# bench_layer.py cases instead (e.g. "dense": a change to the dense layers, timed against
# ";tree=.base"); SWEEP_ARGS="--profile --profile-top 60" adds each row's kernel times to the
# JSON, which resolves a kernel's change that whole steps do not.
# "profile" runs PROFILE_ROWS (default issue #28's five rows) dense and MSA in one
# benchmarks/bench_layer.py process (PROFILE_S, default 420 s) with --profile and each step's Chrome
# trace (in PROFILE_TRACE_DIR, default /tmp/msa_profile_traces), writing $OUT/profile.log and
# $OUT/profile.json; then benchmarks/layer_bench/trace_attribution.py attributes every MSA trace by
# site, and the GPU's idle time by the kernel it waited for, each also minus the dense trace of
# its row (what the MSA step adds), into $OUT/attribution.txt; the traces of the rows of up to
# 32768 tokens come back gzipped in $OUT/traces_short.tgz. PROFILE_ARGS adds arguments.
# "te_part" copies the Transformer Engine core-wheel part carried in .te/part* to /tmp/te (kept
# while the machine is warm; benchmarks/te_parts.sh makes the parts and says the call sequence).
# "te" installs TE from /tmp/te with .te/kit/install_te.sh where it does not import yet, then runs
# tests/megatron/test_te_spec.py (TE spec against the local one, checkpoints across the specs,
# pretraining in bf16 and with FP8 GEMMs; bounded by TE_TESTS_S, default 420 s) into
# $OUT/te_tests.log, the FP8 and bf16 loss curves into $OUT/fp8_curves.json.
# "te_rows" runs bench_layer.py with the TE spec, bf16 and then FP8 GEMMs (TE_ROWS_FP8, default
# hybrid), dense and MSA (sparse loss) at TE_ROWS_TOKENS (default the three one-document rows and
# the two packed ones) in one process per precision (TE_ROWS_S each, default 270 s), writing
# $OUT/te_rows_bf16.json / te_rows_fp8.json and their logs; TE_ROWS_ARGS adds arguments (e.g.
# "--m3-block --experts 16").
# "quality_runs" continues issue #49's quality arms across the calls of one warm machine. The
# corpus (QR_CORPUS_ARGS, default ADR 0040's "--copy-fraction 0.05 --passkey-fraction 0.05
# --mqar-fraction 0.05") is built once into QR_CORPUS_DIR (default /tmp/corpus_qr). Each arm of
# QR_ARMS (default "dense control msa") then trains in its own process, all at once on the one
# GPU (each with its own dataset cache, so their index builds do not race):
# scripts/quality_bench.py with QR_ARGS (default "--probes passkey,mqar --steps 2000
# --seq-lengths 8192 train.eval_interval=250") into QR_DIR (default /tmp/quality_runs, kept while
# the machine is warm), each bounded by QR_S seconds (default 420); an arm resumes from its newest
# checkpoint. Once every arm has its steps, benchmarks/indexer_regime.py runs, for each "S:L" of
# QR_REGIME, on the MSA arm trained at S, at L tokens, with QR_PROBE_ROWS (default 8) passkey
# rows per depth for its needle diagnosis (into QR_DIR); then one process adds QR_FINAL (default
# "--extrapolate-to 32768 --final-probe-rows 32") and summarizes (quality.md holds the regimes).
# The reports come back in $OUT/quality_runs, and in its runs.tgz the logs, the regime JSONs and
# each run's metrics.jsonl (not the checkpoints). Throughput columns of arms that ran at once are
# not a single arm's.
set -uo pipefail
# table_or_tail LOG HEADER FALLBACK: LOG from the line matching HEADER (a basic regex) on, or,
# where the run printed no table, LOG's lines matching FALLBACK (extended) and its last 15.
table_or_tail() {
  if grep -q "$2" "$1"; then
    sed -n "/$2/,\$p" "$1"
  else
    grep -E "$3" "$1" | cut -c1-300
    tail -n 15 "$1"
  fi
}
# bench_msa_logged HEADER DIR SECONDS ALL_LOG ARGS...: one benchmarks/bench_msa.py run of the tree
# in DIR (on PYTHONPATH), bounded by SECONDS, its output appended to ALL_LOG under HEADER, its
# table rows (or its end) echoed.
bench_msa_logged() {
  local header=$1 dir=$2 seconds=$3 all=$4 log="$OUT/bench_run.log"
  shift 4
  echo "$header" | tee "$log"
  (cd "$dir" && PYTHONPATH="/tmp/site:$PWD" timeout "$seconds" python3 benchmarks/bench_msa.py \
    "$@") >> "$log" 2>&1
  echo "rc $?" >> "$log"
  grep -E "^\| (doc|packed)|^rc |Error" "$log" || tail -n 5 "$log"
  cat "$log" >> "$all"
  rm -f "$log"
}
OUT="${OUT:-runs/device}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: a stage may run a script from another tree (.base)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONUNBUFFERED=1
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/environment.txt"

# The gpu-marked tests everywhere, plus every core and kernel test: the interpreter-sized checks
# also run compiled on the GPU. The whole log is kept (a failure's traceback included).
STAGES="${STAGES:-tests}"
if [[ " $STAGES " == *" tests "* ]]; then
# The benchmark tooling's tests (marked bench, left out of the default run: ADR 0038) run here
# too: the device is where the benchmarks run.
export NEMO_MSA_BENCH_TESTS=1
# Each pytest call's exit status follows its output, as in the other stages ("rc 124" where its
# bound stopped it). The bound interrupts pytest (SIGINT; a kill 30 s later if that does not end
# it), so a stopped call still prints its counts and skip reasons; the first call names each test
# as it ends (-v), so the log shows where its bound stopped it and the next call can start there.
# shellcheck disable=SC2086  # GPU_TEST_PATHS (default: tests/core tests/msa_kernels) is a list
timeout -s INT -k 30 "${GPU_TESTS_S:-400}" python3 -m pytest -v -m "gpu or not slow" \
  ${GPU_TEST_PATHS:-tests/core tests/msa_kernels} -rs -p no:cacheprovider -W ignore::UserWarning \
  > "$OUT/gpu_tests.log" 2>&1
echo -e "\nrc $?" >> "$OUT/gpu_tests.log"
timeout -s INT -k 30 "${GPU_MARKED_S:-120}" python3 -m pytest -q -m gpu tests/megatron \
  tests/training -rs -p no:cacheprovider -W ignore::UserWarning >> "$OUT/gpu_tests.log" 2>&1
echo -e "\nrc $?" >> "$OUT/gpu_tests.log"
# The summaries, failures and statuses, and the last test the first call finished.
grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|error)|^(FAILED|ERROR) |^rc " "$OUT/gpu_tests.log"
grep -E "::.* (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)" "$OUT/gpu_tests.log" | tail -n 1 \
  | sed 's/^/last test: /'
fi

if [[ " $STAGES " == *" te_part "* ]]; then
mkdir -p /tmp/te
cp .te/part*/* /tmp/te/ && ls -la /tmp/te | tail -n +2
fi

if [[ " $STAGES " == *" te "* ]]; then
if ! python3 -c "import torch, transformer_engine.pytorch" >/dev/null 2>&1; then
  start=$(date +%s)
  bash .te/kit/install_te.sh /tmp/te python3 2>&1 | tail -n 3 | tee "$OUT/te_install.log"
  echo "te install: $(( $(date +%s) - start )) s" | tee -a "$OUT/te_install.log"
fi
FP8_CURVES_OUT="$OUT/fp8_curves.json" timeout -s INT -k 30 "${TE_TESTS_S:-420}" \
  python3 -m pytest -v -s tests/megatron/test_te_spec.py -rs -p no:cacheprovider \
  -W ignore::UserWarning -W ignore::DeprecationWarning ${TE_TESTS_ARGS:-} > "$OUT/te_tests.log" 2>&1
echo -e "\nrc $?" >> "$OUT/te_tests.log"
grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|error)|^(FAILED|ERROR) |^rc |(PASSED|FAILED|ERROR)$|rel_errors|max_relative_gap" \
  "$OUT/te_tests.log" | cut -c1-400
fi

if [[ " $STAGES " == *" te_rows "* ]]; then
for precision in bf16 fp8; do
  fp8=()
  [[ $precision == fp8 ]] && fp8=(--fp8 "${TE_ROWS_FP8:-hybrid}")
  echo "== te_rows ($precision): benchmarks/bench_layer.py --transformer-impl transformer_engine" \
    "${fp8[*]}" | tee "$OUT/te_rows_$precision.log"
  # shellcheck disable=SC2086  # TE_ROWS_ARGS is a list
  timeout "${TE_ROWS_S:-270}" python3 benchmarks/bench_layer.py --transformer-impl transformer_engine \
    ${fp8[@]+"${fp8[@]}"} --tokens "${TE_ROWS_TOKENS:-8192,32768,131072,32768:4096,131072:16384}" \
    --cases dense,msa_sparse_loss --no-attention-rows --steps 3 --warmup 2 \
    --json "$OUT/te_rows_$precision.json" ${TE_ROWS_ARGS:-} >> "$OUT/te_rows_$precision.log" 2>&1
  echo "rc $?" >> "$OUT/te_rows_$precision.log"
  table_or_tail "$OUT/te_rows_$precision.log" '^|  tokens |' '^\{"tokens"|Error'
done
fi

if [[ " $STAGES " == *" pretrain "* ]]; then
timeout "${PRETRAIN_S:-240}" python3 scripts/pretrain.py \
  model.bf16=true optimizer.clip_grad=1.0 model.msa_backend=triton \
  model.seq_length=2048 model.msa_block_size=64 model.msa_topk=8 model.kv_channels=64 \
  model.msa_index_head_dim=64 model.msa_dense_warmup_steps=50 \
  train.train_iters="${PRETRAIN_STEPS:-300}" train.global_batch_size=8 train.micro_batch_size=4 \
  logger.progress_bar=false logger.log_interval=25 logger.output_dir="$OUT/pretrain" \
  ${PRETRAIN_ARGS:-} 2>&1 | tail -60 | tee "$OUT/pretrain.log"
fi

if [[ " $STAGES " == *" pp1 "* ]]; then
timeout "${PP1_S:-90}" python3 scripts/pretrain.py --recipe recipes/msa_pp2_vpp2_tp2.yaml \
  model.tensor_model_parallel_size=1 model.pipeline_model_parallel_size=1 \
  model.virtual_pipeline_model_parallel_size=null model.bf16=true optimizer.clip_grad=1.0 \
  model.msa_backend=triton checkpoint.save=/tmp/pp1_checkpoints logger.progress_bar=false \
  2>&1 | tail -30 | tee "$OUT/pp1.log"
# The checkpoint stays on the machine (only 8 files come back); its metrics and plot travel.
mkdir -p "$OUT/pp1"
cp /tmp/pp1_checkpoints/metrics.jsonl /tmp/pp1_checkpoints/loss_curve.png "$OUT/pp1/" 2>/dev/null
ls /tmp/pp1_checkpoints | tee -a "$OUT/pp1.log"
fi

if [[ " $STAGES " == *" bench "* ]]; then
IFS=';' read -ra runs <<< "${BENCH_RUNS:---sizes 131072 --packed 0}"
n=0
for args in "${runs[@]}"; do
  n=$((n + 1))
  # shellcheck disable=SC2086  # the argument list is split on purpose
  bench_msa_logged "== bench $n: benchmarks/bench_msa.py $args" . "${BENCH_S:-300}" \
    "$OUT/bench.log" $args
done
fi

if [[ " $STAGES " == *" ab "* ]]; then
if [[ ! -f .base/benchmarks/bench_msa.py ]]; then
  echo "== ab: no .base/benchmarks/bench_msa.py (carry .base with the base commit's tree)" \
    | tee "$OUT/ab.log"
else
IFS=';' read -ra runs <<< "${AB_RUNS:---sizes 8192,32768 --packed 32768 --no-dense}"
n=0
for args in "${runs[@]}"; do
  n=$((n + 1))
  for side in base head; do
    dir=.
    [[ $side == base ]] && dir=.base
    # shellcheck disable=SC2086  # the argument list is split on purpose
    bench_msa_logged "== ab $n $side: benchmarks/bench_msa.py $args" "$dir" "${AB_S:-200}" \
      "$OUT/ab.log" $args
  done
done
fi
fi

if [[ " $STAGES " == *" sweep "* ]]; then
IFS=';' read -ra variants <<< "${SWEEP_SETS-;}"
: > "$OUT/sweep.log"
mkdir -p "$OUT/sweep_json"
cases=${SWEEP_CASES:-dense,msa_sparse_loss}
for round in $(seq 1 "${SWEEP_ROUNDS:-2}"); do
  for v in "${!variants[@]}"; do
    sets=()
    tree=.
    commit=${NEMO_MSA_COMMIT:-}
    for setting in ${variants[$v]}; do
      if [[ $setting == tree=* ]]; then
        tree=${setting#tree=}
        # The JSON's commit: the tree's .commit file (a carried tree has no .git of its own).
        commit=$(cat "$tree/.commit" 2>/dev/null || echo "tree $tree")
      else
        sets+=(--set "$setting")
      fi
    done
    echo "== sweep $round $v: ${variants[$v]:-defaults}" | tee -a "$OUT/sweep.log"
    # shellcheck disable=SC2086  # SWEEP_ARGS is a list
    (cd "$tree" && NEMO_MSA_COMMIT=$commit PYTHONPATH="/tmp/site:$PWD" \
      timeout "${SWEEP_S:-90}" python3 benchmarks/bench_layer.py \
      --tokens "${SWEEP_ROWS:-8192,32768:4096}" --cases "$cases" \
      --no-attention-rows ${SWEEP_ARGS:-} ${sets[@]+"${sets[@]}"} \
      --json "$OUT/sweep_json/$round-$v.json") > "$OUT/sweep_run.log" 2>&1
    echo "rc $?" >> "$OUT/sweep_run.log"
    grep -E '^\|  +[0-9]|^rc ' "$OUT/sweep_run.log" | tee -a "$OUT/sweep.log"
    cases=${SWEEP_CASES:-msa_sparse_loss}
  done
done
rm -f "$OUT/sweep_run.log"
python3 - "$OUT/sweep_json" "$OUT/sweep.json" <<'PY'
import json, pathlib, sys
runs = {p.stem.replace("-", "/", 1): json.loads(p.read_text())
        for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
PY
rm -rf "$OUT/sweep_json"
fi

if [[ " $STAGES " == *" profile "* ]]; then
rows="${PROFILE_ROWS:-8192,32768,32768:4096,131072:16384,131072}"
traces="${PROFILE_TRACE_DIR:-/tmp/msa_profile_traces}"
rm -rf "$traces"
echo "== profile: benchmarks/bench_layer.py --tokens $rows --cases dense,msa_sparse_loss" \
  | tee "$OUT/profile.log"
# shellcheck disable=SC2086  # PROFILE_ARGS is a list
timeout "${PROFILE_S:-420}" python3 benchmarks/bench_layer.py --tokens "$rows" \
  --cases dense,msa_sparse_loss --no-attention-rows --steps 3 --warmup 2 --profile \
  --profile-top 30 --trace "$traces" --json "$OUT/profile.json" ${PROFILE_ARGS:-} \
  >> "$OUT/profile.log" 2>&1
echo "rc $?" >> "$OUT/profile.log"
table_or_tail "$OUT/profile.log" '^|  tokens |' '^\{"tokens"'
: > "$OUT/attribution.txt"
for msa in "$traces"/msa_sparse_loss_*.json; do
  [[ -e $msa ]] || continue
  dense="$traces/dense_${msa##*/msa_sparse_loss_}"
  against=()
  [[ -e $dense ]] && against=(--against "$dense")
  python3 benchmarks/layer_bench/trace_attribution.py "$msa" --top 45 \
    ${against[@]+"${against[@]}"} >> "$OUT/attribution.txt" 2>&1
done
grep -E '^== |minus|by kind' "$OUT/attribution.txt"
# The short rows' traces (about 0.3 MB gzipped) for reading their idle gaps here.
short=()
for t in "$traces"/*.json; do
  [[ ${t##*/} =~ _([0-9]+)(_mean[0-9]+)?\.json$ ]] && ((BASH_REMATCH[1] <= 32768)) \
    && short+=("${t##*/}")
done
[[ ${#short[@]} -gt 0 ]] && tar -C "$traces" -czf "$OUT/traces_short.tgz" "${short[@]}"
fi

if [[ " $STAGES " == *" layer "* ]]; then
echo "== layer: benchmarks/bench_layer.py ${LAYER_ARGS:-}" | tee "$OUT/layer.log"
# shellcheck disable=SC2086  # the argument list is split on purpose
timeout "${LAYER_S:-540}" python3 benchmarks/bench_layer.py ${LAYER_ARGS:-} --json "$OUT/layer.json" \
  >> "$OUT/layer.log" 2>&1
echo "rc $?" >> "$OUT/layer.log"
# The table (every case row and the two attention rows), or the rows and the log's end.
table_or_tail "$OUT/layer.log" '^|  tokens |' '^\{"tokens"'
fi

if [[ " $STAGES " == *" rows "* ]]; then
# Issue #28's rows, dense and MSA in one process with the untrained indexer's (random)
# selections, then both again with coherent, trained-like ones (ADR 0031); ROWS_ARGS adds options.
rows="${ROWS_TOKENS:-8192,32768,32768:4096,131072:16384,131072}"
for index in fresh coherent; do
  # Dense in both processes: each ratio is against the dense step of its own run.
  cases=dense,msa_sparse_loss
  echo "== rows ($index): benchmarks/bench_layer.py --tokens $rows --cases $cases" \
    | tee "$OUT/rows_$index.log"
  # shellcheck disable=SC2086  # the argument list is split on purpose
  timeout "${ROWS_S:-270}" python3 benchmarks/bench_layer.py --tokens "$rows" --cases "$cases" \
    --index "$index" --no-attention-rows --steps 3 --warmup 2 --json "$OUT/rows_$index.json" \
    ${ROWS_ARGS:-} >> "$OUT/rows_$index.log" 2>&1
  echo "rc $?" >> "$OUT/rows_$index.log"
  table_or_tail "$OUT/rows_$index.log" '^|  tokens |' '^\{"tokens"'
done
fi


if [[ " $STAGES " == *" quality_runs "* ]]; then
qr_dir="${QR_DIR:-/tmp/quality_runs}"
corpus="${QR_CORPUS_DIR:-/tmp/corpus_qr}"
qr_corpus_args="${QR_CORPUS_ARGS:---copy-fraction 0.05 --passkey-fraction 0.05 --mqar-fraction 0.05}"
qr_args="${QR_ARGS:---probes passkey,mqar --steps 2000 --seq-lengths 8192 train.eval_interval=250}"
mkdir -p "$OUT/quality_runs" "$qr_dir"
if [[ "$(cat "$corpus/args" 2>/dev/null)" != "$qr_corpus_args" ]]; then
  rm -rf "$corpus"
  # shellcheck disable=SC2086  # the corpus options are a list
  python3 scripts/prepare_corpus.py --out "$corpus" $qr_corpus_args 2>&1 | tail -2 \
    | tee "$OUT/quality_runs/corpus.log" && echo "$qr_corpus_args" > "$corpus/args"
fi
qr=(--corpus "$corpus/pycode_text_document" --copy-marker 0 --out "$qr_dir")
pids=()
for arm in ${QR_ARMS:-dense control msa}; do
  # shellcheck disable=SC2086  # QR_ARGS is a list
  timeout $(( ${QR_S:-420} + 60 )) python3 scripts/quality_bench.py "${qr[@]}" --arms "$arm" \
    --time-budget-s "${QR_S:-420}" $qr_args "dataset.path_to_cache=/tmp/qr_cache_$arm" \
    >> "$OUT/quality_runs/arm_$arm.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; echo "arm process $pid: rc $?"; done
grep -hE "^== " "$OUT"/quality_runs/arm_*.log
# Every arm at its step count: the summary (and QR_FINAL's evaluations) in one process.
arms_csv=$(echo ${QR_ARMS:-dense control msa} | tr ' ' ',')
# shellcheck disable=SC2086  # QR_ARGS is a list
if python3 scripts/quality_bench.py "${qr[@]}" --arms "$arms_csv" $qr_args --finished; then
  # The trained MSA arms' selections first, so the summary's report holds them.
  for regime in ${QR_REGIME:-}; do
    timeout 200 python3 benchmarks/indexer_regime.py --recipe recipes/quality_bench.yaml \
      --rows 2 --probe-rows "${QR_PROBE_ROWS:-8}" \
      --out "$qr_dir/regime_${regime%%:*}_at_${regime#*:}.json" \
      "dataset.data_path=[$corpus/pycode_text_document]" \
      "model.seq_length=${regime#*:}" train.global_batch_size=1 train.micro_batch_size=1 \
      "checkpoint.load=$qr_dir/seq${regime%%:*}/msa" >> "$OUT/quality_runs/regime.log" 2>&1
    echo "regime $regime rc $?"
  done
  # shellcheck disable=SC2086  # QR_ARGS and QR_FINAL are lists
  timeout 400 python3 scripts/quality_bench.py "${qr[@]}" --arms "$arms_csv" --time-budget-s 60 \
    $qr_args ${QR_FINAL---extrapolate-to 32768 --final-probe-rows 32} \
    > "$OUT/quality_runs/summary.log" 2>&1
  echo "summary rc $?"
  sed -n '/^# MSA vs dense/,$p' "$OUT/quality_runs/summary.log"
fi
# The reports and every run's metrics (no checkpoints: they stay on the machine).
# One archive: the device returns only a few files.
(cd "$qr_dir" && cp quality.md quality.json quality.png "$OUT/quality_runs/" 2>/dev/null; \
  tar -czf "$OUT/runs.tgz" -C "$OUT/quality_runs" --exclude quality.md \
  --exclude quality.json --exclude quality.png . \
  -C "$qr_dir" $(ls -d regime_*.json seq*/*/metrics.jsonl 2>/dev/null) \
  && mv "$OUT/runs.tgz" "$OUT/quality_runs/runs.tgz")
fi

if [[ " $STAGES " == *" peer "* ]]; then
peer_s="${PEER_S:-520}"
echo "== peer: benchmarks/bench_flash_msa_peer.py ${PEER_ARGS:-}" | tee "$OUT/peer.log"
# shellcheck disable=SC2086  # the argument list is split on purpose
timeout "$peer_s" python3 benchmarks/bench_flash_msa_peer.py --site "${PEER_SITE:-/tmp/fm_site}" \
  --site /tmp/site --budget-s $(( peer_s - 90 )) --json "$OUT/peer.json" ${PEER_ARGS:-} \
  >> "$OUT/peer.log" 2>&1
echo "rc $?" >> "$OUT/peer.log"
# The table and its notes, or what says why and the log's end.
table_or_tail "$OUT/peer.log" '^| case | tokens | sel agree' 'FAILED|cannot import|^rc '
fi

if [[ " $STAGES " == *" fla_peer "* ]]; then
fla_s="${FLA_PEER_S:-540}"
echo "== fla_peer: benchmarks/bench_fla_nsa_peer.py ${FLA_PEER_ARGS:-}" | tee "$OUT/fla_peer.log"
# shellcheck disable=SC2086  # the argument list is split on purpose
timeout "$fla_s" python3 benchmarks/bench_fla_nsa_peer.py --site "${FLA_SITE:-/tmp/site}" \
  --budget-s $(( fla_s - 60 )) --json "$OUT/fla_peer.json" ${FLA_PEER_ARGS:-} \
  >> "$OUT/fla_peer.log" 2>&1
echo "rc $?" >> "$OUT/fla_peer.log"
# The table and its notes, or what says why and the log's end.
table_or_tail "$OUT/fla_peer.log" '^| case | tokens | docs' 'FAILED|cannot import|^rc '
fi
