"""Runs a stage of ``python -m benchmarks.device`` in this process, for the tests of the stages.
The environment probe (a child process importing torch, for the card) is replaced by a record
of this machine's CPU and a fixed commit: test_device_entry.py tests the probe itself."""

from __future__ import annotations

from benchmarks.device import cli

COMMIT = "abc1234"


def run_stage(monkeypatch, *argv: str) -> int:
    """``python -m benchmarks.device *argv``'s exit status."""
    monkeypatch.setattr(cli, "probe_environment", lambda env: {"commit": COMMIT, "card": "cpu"})
    return cli.main([str(a) for a in argv])
