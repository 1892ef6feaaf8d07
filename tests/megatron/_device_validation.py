"""Runs benchmarks/device_validation.sh's stages on the CPU for the tests of its stages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_stages(out: Path, **settings: str) -> subprocess.CompletedProcess:
    """benchmarks/device_validation.sh with ``OUT=out`` and ``settings`` (STAGES and the stages'
    variables) in its environment; its ``python3`` is the interpreter running the tests, which
    has the package. Fails the calling test where the script exits non-zero."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OUT": str(out),
        **settings,
    }
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_validation.sh")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
