"""Launch variants timed on whole training steps: for each variant in turn,
benchmarks/bench_layer.py runs the MSA rows in its own process, and the whole turn repeats
--rounds times (drift between processes shows as the spread of a variant's rounds); the first
process also runs dense.

A variant is space-separated KERNEL.KEY=VALUE settings (the fields of nemo_msa/triton/launch.py;
'defaults' or '' for none) and may name tree=DIR: it then runs in the tree DIR instead of this
one (its own scripts and package), and its JSON names that tree's commit from its .commit file.
Timing a change on whole steps: carry the base commit's tree as .base (git archive BASE | tar -x
-C .base; echo BASE > .base/.commit) and give --variant defaults --variant tree=.base. --cases
dense gives every process the dense case instead (a change to the dense layers, timed the same
way); --args "--profile --profile-top 60" adds each row's kernel times to the JSON, which
resolve a kernel's change that whole steps do not.

Writes sweep.log ("== sweep <round> <variant>: <settings>" headers, each process's rows and
"rc N") and sweep.json (every process's JSON, keyed "<round>/<variant>").
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from .. import options
from ..record import tree_commit
from ..runner import ROOT
from ..tools import bench_layer

NAME = "sweep"
HELP = "launch variants (or another tree's code) timed on whole layer steps, several rounds"

#: A table row of bench_layer.py (it starts with the tokens) or a status line.
_ROW_OR_STATUS = re.compile(r"^\|  +[0-9]|^rc ")


def add_arguments(group) -> None:
    group.add_argument("--variant", action="append", default=None, metavar="SETTINGS",
                       help="one variant (repeat the option for more): KERNEL.KEY=VALUE "
                            "settings and/or tree=DIR; 'defaults' or '' for this tree's "
                            "defaults (default: one variant, the defaults)")
    options.add_rows(group, "8192,32768:4096", flag="--rows")
    group.add_argument("--rounds", type=options.count, default=2, help="turns over the variants")
    group.add_argument("--cases", default=None,
                       help="every process's cases (default: dense,msa_sparse_loss in the "
                            "first, msa_sparse_loss after)")
    options.add_bound(group, 90.0, "each process's bound")
    options.add_args(group, "bench_layer.py", "--steps 5")


def _variant(text: str) -> tuple[Path, str | None, list[str]]:
    """A variant's tree, its commit (None: this tree's) and its ``--set`` arguments."""
    tree, commit, sets = ROOT, None, []
    for setting in text.split():
        if setting.startswith("tree="):
            tree = options.path(setting.removeprefix("tree="))
            commit = tree_commit(tree, f"tree {tree}")  # a carried tree has no .git of its own
        elif setting != "defaults":
            sets += ["--set", setting]
    return tree, commit, sets


def run(args, ctx) -> None:
    variants = args.variant or [""]
    log, run_log, parts = ctx.out / "sweep.log", ctx.out / "sweep_run.log", ctx.out / "sweep_json"
    ctx.note("", log, new=True)
    ctx.do(f"create {parts}", lambda: parts.mkdir(parents=True, exist_ok=True))
    cases = args.cases or "dense,msa_sparse_loss"
    for round_ in range(1, args.rounds + 1):
        for v, text in enumerate(variants):
            tree, commit, sets = _variant(text)
            ctx.say(f"== sweep {round_} {v}: {text or 'defaults'}", log)
            ctx.note("", run_log, new=True)
            rc = ctx.run(bench_layer(
                "--tokens", args.rows, "--cases", cases, "--no-attention-rows", *args.args, *sets,
                "--json", parts / f"{round_}-{v}.json", tree=tree, log=run_log,
                seconds=args.seconds, env={} if tree == ROOT else ctx.tree_env(tree, commit)))
            ctx.note(f"rc {rc}", run_log)
            if not ctx.dry:
                lines = run_log.read_text(errors="replace").splitlines()
                ctx.say("\n".join(line for line in lines if _ROW_OR_STATUS.match(line)), log)
            cases = args.cases or "msa_sparse_loss"
    ctx.do(f"merge {parts}/<round>-<variant>.json into {ctx.out / 'sweep.json'}, keyed "
           "'<round>/<variant>'; remove them and the run log", lambda: _merge(parts, ctx.out))


def _merge(parts: Path, out: Path) -> None:
    runs = {p.stem.replace("-", "/", 1): json.loads(p.read_text())
            for p in sorted(parts.glob("*.json"))}
    (out / "sweep.json").write_text(json.dumps(runs, indent=1))
    shutil.rmtree(parts, ignore_errors=True)
    (out / "sweep_run.log").unlink(missing_ok=True)
