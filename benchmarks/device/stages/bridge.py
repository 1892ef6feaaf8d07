"""nemo_msa.bridge on the GPU (ADR 0055): installs the carried Megatron-Bridge wheels, then runs
tests/megatron/test_bridge.py and benchmarks/bridge_msa.py's two checks (the tiny recipe through
Bridge's training loop; the MiniMax-M3 Hugging Face round trip with the TE spec).

Needs Transformer Engine installed first (te_part + te). benchmarks/bridge_wheels.sh downloads
Bridge and what it imports into four folders of .whl_bridge/, each small enough for one call;
each call installs what it carries into /tmp/bsite (kept while the machine is warm) and only
the last runs the checks:

  carry [".whl_bridge/pyarrow"]:        python3 -m benchmarks.device bridge --install-only
  carry [".whl_bridge/scipy"]:          python3 -m benchmarks.device bridge --install-only
  carry [".whl_bridge/train"]:          python3 -m benchmarks.device bridge --install-only
  carry [".whl_bridge/import", ".whl"]: python3 -m benchmarks.device bridge

Writes bridge.log (pytest's output and each check's, with "rc N") and prints the counts and the
checks' RESULT lines (``"ok": true`` where a check passed).
"""

from __future__ import annotations

import re

from .. import options
from ..runner import PYTHON, Command, python
from .tests import pytest

NAME = "bridge"
HELP = "install the carried Megatron-Bridge wheels; test nemo_msa.bridge and train through it"

_LINES = re.compile(r"^(=+ )?[0-9]+ (passed|failed|skipped|error)|^(FAILED|ERROR) |^rc |"
                    r"^RESULT |^== ")


def add_arguments(group) -> None:
    group.add_argument("--bridge-wheels", type=options.path, default=".whl_bridge",
                       help="the carried wheels (in it or its folders)")
    group.add_argument("--bridge-site", type=options.path, default="/tmp/bsite",
                       help="where they are installed, first on PYTHONPATH")
    group.add_argument("--install-only", action="store_true",
                       help="install the carried wheels, run nothing")
    group.add_argument("--iters", type=options.count, default=40,
                       help="training iterations of the tiny recipe")
    options.add_bound(group, 240.0, "each command's bound")


def run(args, ctx) -> dict | None:
    wheels = ctx.glob(args.bridge_wheels, "*.whl") + ctx.glob(args.bridge_wheels, "*/*.whl")
    if wheels:
        ctx.run(Command((PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                         "--no-compile", "--no-cache-dir", "--upgrade", "--target",
                         str(args.bridge_site), *map(str, wheels))))
    if args.install_only:
        return {"installed": len(wheels)}
    env = {"PYTHONPATH": f"{args.bridge_site}:{ctx.env.get('PYTHONPATH', '')}".rstrip(":")}
    log = ctx.out / "bridge.log"
    ctx.note("== pytest tests/megatron/test_bridge.py", log, new=True)
    rcs = {"tests": ctx.run(pytest("-q", "tests/megatron/test_bridge.py", log=log,
                                   seconds=args.seconds, interrupt=True, env=env))}
    ctx.note(f"rc {rcs['tests']}", log)
    for check in ("pretrain", "roundtrip"):
        ctx.note(f"== benchmarks/bridge_msa.py {check}", log)
        rcs[check] = ctx.run(python(
            "-m", "torch.distributed.run", "--nproc-per-node", "1", "benchmarks/bridge_msa.py",
            check, "--iters", str(args.iters), "--out", str(ctx.out / f"bridge_{check}"),
            log=log, seconds=args.seconds, env=env))
        ctx.note(f"rc {rcs[check]}", log)
    if ctx.dry:
        return None
    lines = log.read_text(errors="replace").splitlines()
    print("\n".join(line[:600] for line in lines if _LINES.search(line)))
    return {"installed": len(wheels), "rc": rcs}
