"""Runs a stage of ``python -m benchmarks.device`` in this process, for the tests of the stages.
The environment probe (a child process importing torch, for the card) is replaced by a record
of this machine's CPU and a fixed commit: test_device_entry.py tests the probe itself."""

from __future__ import annotations

from benchmarks.device import cli

COMMIT = "abc1234"


#: Wheels and site folders that do not exist: a test's stage installs nothing (a checkout may
#: hold .whl/) and no earlier install on the machine changes its commands' PYTHONPATH.
NO_WHEELS = ("--wheels", "/nonexistent/nemo-msa-test-wheels", "--site",
             "/nonexistent/nemo-msa-test-site")


def run_stage(monkeypatch, *argv: str) -> int:
    """``python -m benchmarks.device *argv``'s exit status (:data:`NO_WHEELS` unless ``argv``
    names its own)."""
    monkeypatch.setattr(cli, "probe_environment", lambda env: {"commit": COMMIT, "card": "cpu"})
    argv = [str(a) for a in argv]
    extra = [] if "--wheels" in argv or "--site" in argv else list(NO_WHEELS)
    return cli.main(argv[:1] + extra + argv[1:])
