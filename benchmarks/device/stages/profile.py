"""The rows dense and MSA in one benchmarks/bench_layer.py process with --profile and each step's
Chrome trace, then benchmarks/layer_bench/trace_attribution.py on every MSA trace: its kernels by
site and the GPU's idle time by the kernel it waited for, each also minus the dense trace of its
row (what the MSA step adds).

Writes profile.json and profile.log (with "rc N"), attribution.txt, and traces_short.tgz (the
traces of the rows of up to 32768 tokens, gzipped, for reading their idle gaps elsewhere).
"""

from __future__ import annotations

import re
import shutil
import tarfile
from pathlib import Path

from .. import options
from ..runner import python
from ..tools import ISSUE_ROWS, ROW_TIMING, bench_layer, layer_table

NAME = "profile"
HELP = "profile the layer rows and attribute each MSA step's kernels and idle gaps by site"

#: A trace's row: its tokens, and the packed documents' mean where packed.
_TRACE_ROW = re.compile(r"_([0-9]+)(_mean[0-9]+)?\.json$")
#: The traces of rows up to this many tokens come back (about 0.3 MB gzipped).
SHORT_TOKENS = 32768


def add_arguments(group) -> None:
    options.add_rows(group, ISSUE_ROWS, flag="--rows")
    group.add_argument("--trace-dir", type=options.path, default="/tmp/msa_profile_traces",
                       help="where the traces go (emptied first)")
    options.add_bound(group, 420.0)
    options.add_args(group, "bench_layer.py")


def run(args, ctx) -> None:
    traces, log, attribution = args.trace_dir, ctx.out / "profile.log", ctx.out / "attribution.txt"
    ctx.do(f"remove {traces}", lambda: shutil.rmtree(traces, ignore_errors=True))
    ctx.say(f"== profile: benchmarks/bench_layer.py --tokens {args.rows} --cases "
            "dense,msa_sparse_loss", log, new=True)
    rc = ctx.run(bench_layer("--tokens", args.rows, "--cases", "dense,msa_sparse_loss",
                             *ROW_TIMING, "--profile", "--profile-top", "30", "--trace", traces,
                             "--json", ctx.out / "profile.json", *args.args, log=log,
                             seconds=args.seconds))
    ctx.note(f"rc {rc}", log)
    if not ctx.dry:
        print(layer_table(log))
    ctx.note("", attribution, new=True)
    for msa in ctx.glob(traces, "msa_sparse_loss_*.json"):
        dense = traces / ("dense_" + msa.name.removeprefix("msa_sparse_loss_"))
        against = ("--against", dense) if ctx.dry or dense.exists() else ()
        ctx.run(python("benchmarks/layer_bench/trace_attribution.py", msa, "--top", "45",
                       *against, log=attribution))
    ctx.do(f"gzip the traces of the rows of up to {SHORT_TOKENS} tokens into "
           f"{ctx.out / 'traces_short.tgz'}", lambda: _pack_short(traces, ctx.out))
    if not ctx.dry:
        lines = attribution.read_text(errors="replace").splitlines()
        print("\n".join(line for line in lines
                        if line.startswith("== ") or "minus" in line or "by kind" in line))


def _pack_short(traces: Path, out: Path) -> None:
    short = [t for t in sorted(traces.glob("*.json"))
             if (row := _TRACE_ROW.search(t.name)) and int(row.group(1)) <= SHORT_TOKENS]
    if short:
        with tarfile.open(out / "traces_short.tgz", "w:gz") as tar:
            for trace in short:
                tar.add(trace, arcname=trace.name)
