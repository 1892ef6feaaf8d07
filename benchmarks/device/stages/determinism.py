"""Bitwise-repeatable pretraining under model.deterministic_mode on one GPU, and its cost
(benchmarks/determinism_check.py, ADR 0050): two runs of scripts/pretrain.py with the mode, the
Triton backend and bf16, and one stopped at --interrupt-at and resumed; their per-step metrics
and checkpoint content digests compared, PASS or FAIL with the first difference. With
--cost-tokens, bench_layer.py's one-layer rows with and without --deterministic (--skip-checks:
those alone; the checks and the cost fit one 10-minute call each on an H100).

Writes determinism/ (determinism.json: the verdicts, every run's per-step metrics, the digests
and the cost rows; determinism.log; with --cost-tokens the two bench_layer JSONs) and
determinism.log beside it (the script's own lines), and prints the verdict lines.
"""

from __future__ import annotations

from .. import options
from ..runner import python

NAME = "determinism"
HELP = "two deterministic pretraining runs and a resumed one compared bit for bit; the cost"


def add_arguments(group) -> None:
    group.add_argument("--steps", type=options.count, default=40, help="steps of every run")
    group.add_argument("--interrupt-at", type=options.count, default=20,
                       help="where the third run stops and is resumed")
    group.add_argument("--cost-tokens", default=None, metavar="N,N",
                       help="also time bench_layer.py's rows of these sizes with and without "
                       "the mode")
    group.add_argument("--skip-checks", action="store_true", help="only the cost rows")
    options.add_bound(group, 540.0)
    group.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="more recipe overrides for every run")


def run(args, ctx) -> None:
    log = ctx.out / "determinism.log"
    ctx.note("", log, new=True)
    argv = ["benchmarks/determinism_check.py", "--out", ctx.out / "determinism",
            "--steps", str(args.steps), "--interrupt-at", str(args.interrupt_at)]
    if args.cost_tokens:
        argv += ["--cost-tokens", args.cost_tokens]
    if args.skip_checks:
        argv.append("--skip-checks")
    ctx.run(python(*argv, "--", *args.overrides, log=log, seconds=args.seconds))
    if not ctx.dry:
        lines = log.read_text(errors="replace").splitlines()
        # The verdicts and the cost table (its rows start with spaces), else the log's end.
        shown = [line for line in lines if "PASS" in line or "FAIL" in line
                 or line.startswith(("error:", " "))]
        print("\n".join(shown or lines[-30:]))
