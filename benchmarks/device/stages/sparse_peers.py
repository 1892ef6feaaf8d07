"""benchmarks/bench_sparse_peers.py: FlashAttention-4's SM90 block-sparse attention (the
128-token tiles' unions with a per-token membership mask_mod) and cuDNN-FE's flex attention
(per-token interval masks), both MSA's function, beside this project's op and cuDNN dense on
fresh, coherent and trained selections; FA4 without the mask and cuDNN-FE's block-sparse
attention as union bounds (docs/adr/0056). Once both parts are in --parts-dir (peer_part), the
peers are installed into --peer-site, once per machine: the wheels with pip --target, then the
xz'd nvidia-cutlass-dsl-libs-cu13 tree over them, its SHA-256 checked. The script's own budget is
--seconds minus 60.

Writes sparse_peers.json and sparse_peers.log (with "rc N"; the install's output first, where it
installed) and prints the table and its notes, or what says why and the log's end.
"""

from __future__ import annotations

import tarfile

from .. import options
from ..runner import Command, python
from ..tools import peer_table

NAME = "sparse_peers"
HELP = "FA4's and cuDNN-FE's block-sparse attention beside this op and cuDNN (ADR 0056)"
#: Seconds of the bound left to the script after its budget.
MARGIN_S = 60.0
#: The libs-cu13 tree's archive and its checksum, as peer_wheels.sh names them.
ARCHIVE, CHECKSUM = "cu13.tar.xz", "cu13.tar.xz.sha256"


def add_arguments(group) -> None:
    group.add_argument("--parts-dir", type=options.path, default="/tmp/peer_parts",
                       help="where peer_part gathered the peers' wheels and archive parts")
    group.add_argument("--peer-site", type=options.path, default="/tmp/peer_site",
                       help="the --target folder the peers are installed into (and read from)")
    options.add_bound(group, 500.0, f"the bound (more than {MARGIN_S:g})", above=MARGIN_S)
    options.add_args(group, "bench_sparse_peers.py", "--tokens 131072")


def _install(args, ctx, log) -> dict | None:
    """The peers into --peer-site where not yet there and both parts have come."""
    marker = args.peer_site / ".installed"
    ready = (args.parts_dir / CHECKSUM).exists
    if not ctx.when(f"{marker} is missing and {args.parts_dir}/{CHECKSUM} has come",
                    lambda: not marker.exists() and ready()):
        return None
    rc = ctx.run(python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", args.peer_site, *ctx.glob(args.parts_dir, "*.whl"), log=log))
    joined = args.parts_dir / ARCHIVE

    def join() -> None:
        with open(joined, "wb") as out:
            for part in sorted(args.parts_dir.glob(f"{ARCHIVE}.part*")):
                out.write(part.read_bytes())

    ctx.do(f"join {args.parts_dir}/{ARCHIVE}.part* into {joined}", join)
    rc = rc or ctx.run(Command(("sha256sum", "-c", CHECKSUM), log=log, cwd=args.parts_dir))
    if rc == 0:
        # The tree goes over the wheels' install: pip --target would skip or replace the
        # nvidia_cutlass_dsl folder it adds to.
        ctx.do(f"extract {joined} into {args.peer_site}", lambda: tarfile.open(joined, "r:xz")
               .extractall(args.peer_site, filter="data"))
        ctx.do(f"mark {marker}", marker.touch)
    ctx.do(f"remove {joined}", lambda: joined.unlink(missing_ok=True))
    return {"rc": rc}


def run(args, ctx) -> dict | None:
    log = ctx.out / "sparse_peers.log"
    ctx.say(f"== sparse_peers: benchmarks/bench_sparse_peers.py {' '.join(args.args)}", log,
            new=True)
    installed = _install(args, ctx, log)
    rc = ctx.run(python("benchmarks/bench_sparse_peers.py", "--site", args.peer_site,
                        "--budget-s", f"{args.seconds - MARGIN_S:g}", "--json",
                        ctx.out / "sparse_peers.json", *args.args, log=log,
                        seconds=args.seconds))
    ctx.note(f"rc {rc}", log)
    if ctx.dry:
        return None
    print(peer_table(log, "| case | tokens | fwd ms"))
    return {"install": installed, "rc": rc}
