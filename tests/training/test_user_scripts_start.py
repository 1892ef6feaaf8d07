"""Every user entry point in scripts/ starts from a checkout in a fresh process: ``--help`` exits
0 with its usage. The in-process tests put benchmarks/ on ``sys.path`` themselves, so an entry
point that imported the benchmark tooling passed them and failed for users (quality_bench.py did,
after the tooling moved to benchmarks/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py"))


def test_scripts_holds_the_user_entry_points_only():
    assert SCRIPTS == ["prepare_corpus.py", "pretrain.py", "quality_bench.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_user_script_starts_in_a_fresh_process(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout, proc.stdout[-2000:]
