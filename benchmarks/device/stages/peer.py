"""benchmarks/bench_flash_msa_peer.py: poolside's flash-msa beside this project's MSA op and
cuDNN, on the same inputs, each with its indexer loss (docs/adr/0029). flash-msa and its wheels
must already be installed with pip --target in --peer-site; --site is searched too. The script's
own budget is --seconds minus 90, so that it ends its cases and writes its JSON inside the bound.

Writes peer.json and peer.log (with "rc N") and prints the table and its notes, or what says why
and the log's end.
"""

from __future__ import annotations

from .. import options
from ..runner import python
from ..tools import peer_table

NAME = "peer"
HELP = "poolside's flash-msa beside this MSA op and cuDNN, same inputs (ADR 0029)"
#: Seconds of the bound left to the script after its budget.
MARGIN_S = 90.0


def add_arguments(group) -> None:
    group.add_argument("--peer-site", type=options.path, default="/tmp/fm_site",
                       help="the --target folder holding flash-msa and its wheels")
    options.add_bound(group, 520.0, f"the bound (more than {MARGIN_S:g})", above=MARGIN_S)
    options.add_args(group, "bench_flash_msa_peer.py")


def run(args, ctx) -> None:
    log = ctx.out / "peer.log"
    ctx.say(f"== peer: benchmarks/bench_flash_msa_peer.py {' '.join(args.args)}", log, new=True)
    rc = ctx.run(python("benchmarks/bench_flash_msa_peer.py", "--site", args.peer_site,
                        "--site", args.site, "--budget-s", f"{args.seconds - MARGIN_S:g}",
                        "--json", ctx.out / "peer.json", *args.args, log=log,
                        seconds=args.seconds))
    ctx.note(f"rc {rc}", log)
    if not ctx.dry:
        print(peer_table(log, "| case | tokens | sel agree"))
