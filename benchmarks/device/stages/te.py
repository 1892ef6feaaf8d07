"""Installs Transformer Engine from the parts gathered in /tmp/te (te_part) with
.te/kit/install_te.sh, where it does not import yet (later calls on the same warm machine find it
installed), then runs tests/megatron/test_te_spec.py: the TE spec against the local one,
checkpoints across the specs, pretraining in bf16 and with FP8 GEMMs.

Writes te_install.log (where it installed: the install's output and its seconds), te_tests.log
(with "rc N": 124 where the bound stopped pytest) and fp8_curves.json (the FP8 and bf16 loss
curves); prints the install's end, the counts, each test's status and the relative errors.
"""

from __future__ import annotations

import re
import subprocess
import time

from .. import options
from ..runner import PYTHON, Command, write
from .tests import pytest

NAME = "te"
HELP = "install Transformer Engine from /tmp/te where needed, then test the TE spec"

_LINES = re.compile(r"^(=+ )?[0-9]+ (passed|failed|skipped|error)|^(FAILED|ERROR) |^rc |"
                    r"(PASSED|FAILED|ERROR)$|rel_errors|max_relative_gap")


def add_arguments(group) -> None:
    group.add_argument("--parts-dir", type=options.path, default="/tmp/te",
                       help="where te_part gathered the core wheel's parts")
    group.add_argument("--kit", type=options.path, default=".te/kit",
                       help="the carried kit: install_te.sh, the extension and meta wheels")
    options.add_bound(group, 420.0, "the tests' bound")
    group.add_argument("--pytest-args", type=options.words, default="",
                       help=f"more pytest arguments {options.WORDS_HELP}")


def _te_imports(env) -> bool:
    """Whether Transformer Engine's PyTorch part imports (torch first: it loads the NCCL that
    TE's core library needs)."""
    probe = [PYTHON, "-c", "import torch, transformer_engine.pytorch"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=600).returncode == 0


def run(args, ctx) -> dict | None:
    installed = None
    if ctx.when("transformer_engine does not import yet", lambda: not _te_imports(ctx.env)):
        log, started = ctx.out / "te_install.log", time.monotonic()
        rc = ctx.run(Command(("bash", str(args.kit / "install_te.sh"), str(args.parts_dir),
                              PYTHON), log=log))
        if not ctx.dry:
            installed = {"rc": rc, "seconds": round(time.monotonic() - started)}
            write(log, f"te install: {installed['seconds']} s\n")
            print("\n".join(log.read_text(errors="replace").splitlines()[-4:]))
    log = ctx.out / "te_tests.log"
    ctx.note("", log, new=True)
    rc = ctx.run(pytest("-v", "-s", "tests/megatron/test_te_spec.py", "-W",
                        "ignore::DeprecationWarning", *args.pytest_args, log=log,
                        seconds=args.seconds, interrupt=True,
                        env={"FP8_CURVES_OUT": str(ctx.out / "fp8_curves.json")}))
    ctx.note(f"\nrc {rc}", log)
    if ctx.dry:
        return None
    lines = log.read_text(errors="replace").splitlines()
    print("\n".join(line[:400] for line in lines if _LINES.search(line)))
    return {"install": installed, "rc": rc}
