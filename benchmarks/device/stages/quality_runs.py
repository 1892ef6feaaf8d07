"""Issue #49's quality arms, continued across the calls of one warm machine (docs/training.md).

The corpus (copy, passkey and MQAR documents; ADR 0040) is built once into --corpus-dir, again
only where --corpus-args change. Each arm then trains in its own process, all at once on the one
GPU (each with its own dataset cache in --dir, so that their index builds do not race):
scripts/quality_bench.py with --qb-args into --dir (kept while the machine is warm), with
--seconds as its time budget (the process's bound is 60 s more); an arm resumes from its newest
checkpoint on the next call. Once every arm has its steps, benchmarks/indexer_regime.py runs for
each --regime S:L on the MSA arm trained at S, at L tokens, with --probe-rows passkey rows per
depth for its needle diagnosis; then one process adds --final and writes the summary
(quality.md holds the regimes). Throughput columns of arms that ran at once are not a single
arm's.

Writes quality_runs/: quality.md, quality.json and quality.png, and runs.tgz with the logs (each
arm's, the corpus's, the regimes', the summary's), the regime JSONs and each run's metrics.jsonl
(not the checkpoints: the device returns only a few files); prints each arm's status and "== "
lines, the steps done, and the summary's report.
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

from .. import options
from ..runner import python, write

NAME = "quality_runs"
HELP = "the quality bench's arms trained at once on one GPU, resumed across warm calls"

#: The reports copied back beside runs.tgz.
REPORTS = ("quality.md", "quality.json", "quality.png")
#: The summary's own time budget (it only evaluates).
SUMMARY_BUDGET_S = 60


def add_arguments(group) -> None:
    group.add_argument("--dir", type=options.path, default="/tmp/quality_runs",
                       help="the runs, their checkpoints, caches and reports (kept while warm)")
    group.add_argument("--corpus-dir", type=options.path, default="/tmp/corpus_qr",
                       help="the corpus, built once per machine")
    group.add_argument("--corpus-args", type=options.words,
                       default="--copy-fraction 0.05 --passkey-fraction 0.05 --mqar-fraction 0.05",
                       help=f"scripts/prepare_corpus.py's options {options.WORDS_HELP}")
    group.add_argument("--arms", nargs="+", default=["dense", "control", "msa"],
                       help="the arms, one process each")
    group.add_argument("--qb-args", type=options.words,
                       default="--probes passkey,mqar --steps 2000 --seq-lengths 8192 "
                               "train.eval_interval=250",
                       help="scripts/quality_bench.py's options and overrides for every arm "
                            f"{options.WORDS_HELP}")
    options.add_bound(group, 420.0, "each arm's time budget")
    group.add_argument("--regime", type=options.regime, nargs="*", default=[], metavar="S:L",
                       help="indexer_regime.py on the MSA arm trained at S, at L tokens, once "
                            "every arm has its steps")
    group.add_argument("--probe-rows", type=options.count, default=8,
                       help="passkey rows per depth for the regime's needle diagnosis")
    group.add_argument("--regime-seconds", type=options.seconds, default=200.0,
                       help="each regime's bound")
    group.add_argument("--final", type=options.words,
                       default="--extrapolate-to 32768 --final-probe-rows 32",
                       help=f"the summary's final evaluations {options.WORDS_HELP}")
    group.add_argument("--summary-seconds", type=options.seconds, default=400.0,
                       help="the summary's bound")


def _corpus(args, ctx, out: Path) -> None:
    """Builds the corpus where it is missing or was built with other options."""
    corpus, stamp, wanted = args.corpus_dir, args.corpus_dir / "args", " ".join(args.corpus_args)
    if not ctx.when(f"{stamp} does not hold the corpus options",
                    lambda: not stamp.is_file() or stamp.read_text().strip() != wanted):
        return
    ctx.do(f"remove {corpus}", lambda: shutil.rmtree(corpus, ignore_errors=True))
    log = out / "corpus.log"
    if ctx.run(python("scripts/prepare_corpus.py", "--out", corpus, *args.corpus_args,
                      log=log)) == 0:
        ctx.do(f"write the corpus options to {stamp}", lambda: write(stamp, wanted, new=True))
    if not ctx.dry:
        print("\n".join(log.read_text(errors="replace").splitlines()[-2:]))


def _regimes_and_summary(args, ctx, out: Path, common: tuple) -> int:
    """The regimes, then the summary with --final's evaluations; the summary's status."""
    runs, data = args.dir, args.corpus_dir / "pycode_text_document"
    for spec in args.regime:
        trained, length = spec.split(":")
        rc = ctx.run(python(
            "benchmarks/indexer_regime.py", "--recipe", "recipes/quality_bench.yaml", "--rows",
            "2", "--probe-rows", str(args.probe_rows), "--out",
            runs / f"regime_{trained}_at_{length}.json", f"dataset.data_path=[{data}]",
            f"model.seq_length={length}", "train.global_batch_size=1",
            "train.micro_batch_size=1", f"checkpoint.load={runs / f'seq{trained}' / 'msa'}",
            log=out / "regime.log", seconds=args.regime_seconds))
        ctx.say(f"regime {spec} rc {rc}")
    log = out / "summary.log"
    ctx.note("", log, new=True)
    rc = ctx.run(python("scripts/quality_bench.py", *common, "--arms", ",".join(args.arms),
                        "--time-budget-s", str(SUMMARY_BUDGET_S), *args.qb_args, *args.final,
                        log=log, seconds=args.summary_seconds))
    ctx.say(f"summary rc {rc}")
    if not ctx.dry:
        text = log.read_text(errors="replace")
        print(text[text.find("# MSA vs dense"):] if "# MSA vs dense" in text else "")
    return rc


def run(args, ctx) -> dict:
    out, runs = ctx.out / "quality_runs", args.dir
    _corpus(args, ctx, out)
    common = ("--corpus", args.corpus_dir / "pycode_text_document", "--copy-marker", "0",
              "--out", runs)
    started = [ctx.start(python(
        "scripts/quality_bench.py", *common, "--arms", arm, "--time-budget-s",
        f"{args.seconds:g}", *args.qb_args, f"dataset.path_to_cache={runs / f'cache_{arm}'}",
        log=out / f"arm_{arm}.log", seconds=args.seconds + 60)) for arm in args.arms]
    statuses = dict(zip(args.arms, ctx.wait(started), strict=True))
    for arm, rc in statuses.items():
        ctx.say(f"arm {arm}: rc {rc}")
        if not ctx.dry:
            lines = (out / f"arm_{arm}.log").read_text(errors="replace").splitlines()
            print("\n".join(line for line in lines if line.startswith("== ")), flush=True)
    # Every arm at its step count? (A non-zero status is an answer, not a failure.)
    finished = ctx.run(python("scripts/quality_bench.py", *common, "--arms", ",".join(args.arms),
                              *args.qb_args, "--finished", question=True))
    summary_rc = None
    if ctx.when("every arm has its steps (that exits 0)", lambda: finished == 0):
        summary_rc = _regimes_and_summary(args, ctx, out, common)
    ctx.do(f"copy {', '.join(REPORTS)} from {runs} to {out}; archive the logs, "
           f"{runs}/regime_*.json and {runs}/seq*/*/metrics.jsonl into {out / 'runs.tgz'}",
           lambda: _pack(runs, out))
    return {"arms": statuses, "finished": finished == 0, "summary_rc": summary_rc}


def _pack(runs: Path, out: Path) -> None:
    """The reports beside one archive of the logs and the runs' metrics (the logs then leave
    the folder: the device returns only a few files)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in REPORTS:
        if (runs / name).is_file():
            shutil.copy(runs / name, out / name)
    logs = sorted(out.glob("*.log"))
    with tarfile.open(out / "runs.tgz", "w:gz") as tar:
        for log in logs:
            tar.add(log, arcname=f"./{log.name}")
        for path in sorted([*runs.glob("regime_*.json"), *runs.glob("seq*/*/metrics.jsonl")]):
            tar.add(path, arcname=str(path.relative_to(runs)))
    for log in logs:
        log.unlink()
