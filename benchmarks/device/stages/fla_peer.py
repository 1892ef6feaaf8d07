"""benchmarks/bench_fla_nsa_peer.py: fla-core's NSA selected-block attention beside this
project's attention kernels on the same q2k, and cuDNN; one document and packed documents of
8192/32768/131072 tokens, coherent and random selections (docs/adr/0029). fla-core and einops
come from their wheels in --wheels (fla_core-0.6.0-py3-none-any.whl,
einops-0.8.2-py3-none-any.whl), installed into --site with the others. The script's own budget
is --seconds minus 60.

Writes fla_peer.json and fla_peer.log (with "rc N") and prints the table and its notes, or what
says why and the log's end.
"""

from __future__ import annotations

from .. import options
from ..runner import python
from ..tools import peer_table

NAME = "fla_peer"
HELP = "fla-core's NSA selected-block attention beside this op's kernels (ADR 0029)"
#: Seconds of the bound left to the script after its budget.
MARGIN_S = 60.0


def add_arguments(group) -> None:
    group.add_argument("--fla-site", type=options.path, default=None,
                       help="the --target folder holding fla-core and einops (default: --site)")
    options.add_bound(group, 540.0, f"the bound (more than {MARGIN_S:g})", above=MARGIN_S)
    options.add_args(group, "bench_fla_nsa_peer.py", "--sizes 8192,32768 --inputs coherent")


def run(args, ctx) -> None:
    log = ctx.out / "fla_peer.log"
    ctx.say(f"== fla_peer: benchmarks/bench_fla_nsa_peer.py {' '.join(args.args)}", log,
            new=True)
    rc = ctx.run(python("benchmarks/bench_fla_nsa_peer.py", "--site", args.fla_site or args.site,
                        "--budget-s", f"{args.seconds - MARGIN_S:g}", "--json",
                        ctx.out / "fla_peer.json", *args.args, log=log, seconds=args.seconds))
    ctx.note(f"rc {rc}", log)
    if not ctx.dry:
        print(peer_table(log, "| case | tokens | docs"))
