"""The record every stage writes to ``<out>/<stage>.run.json``: the exact command line, the
commit, the card, the date, the options with their defaults resolved, and each command the stage
ran with its exit status and duration. It is written when the stage starts (so a stage the
device stops still leaves one) and again when it ends.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from .runner import ROOT

#: Run in a child process, so that this one never opens a CUDA context: the stage's own processes
#: (three training arms at once, for one) share the GPU. The commit comes from the package's
#: provenance (NEMO_MSA_COMMIT, else git), loaded by its file: the package's __init__ would
#: import the kernels, seconds the commit does not need.
_PROBE = """
import importlib.util, json
found = {}
try:
    import torch
    found["torch"] = torch.__version__
    found["cuda"] = torch.version.cuda
    found["card"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA)"
except Exception as e:
    found["card"] = f"unknown ({type(e).__name__}: {e})"
try:
    import triton
    found["triton"] = triton.__version__
except Exception as e:
    found["triton"] = f"unknown ({type(e).__name__})"
try:
    spec = importlib.util.spec_from_file_location("provenance", "nemo_msa/training/provenance.py")
    provenance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(provenance)
    found["commit"] = provenance.commit_id()
except Exception as e:
    found["commit"] = f"unknown ({type(e).__name__}: {e})"
print(json.dumps(found))
"""


def probe_environment(env: Mapping[str, str], root: Path = ROOT) -> dict:
    """The card (``torch.cuda.get_device_name``), the torch, CUDA and Triton versions and the
    commit of ``root``, each ``"unknown (why)"`` where it could not be read; the driver where
    ``nvidia-smi`` exists. A copy of the tree without git metadata names its commit in a
    ``.commit`` file (as ``ab`` and ``sweep`` read a carried base tree's)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=root,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        found = {"card": f"unknown (probe exited {proc.returncode}: {proc.stderr[-300:]})"}
    if str(found.get("commit", "unknown")).startswith("unknown"):
        found["commit"] = tree_commit(root, found.get("commit", "unknown"))
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        found["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else None
    return found


def tree_commit(tree: Path, default: str) -> str:
    """The commit named in ``tree/.commit`` (a carried copy has no git metadata), else
    ``default``."""
    marker = tree / ".commit"
    return marker.read_text().strip() if marker.is_file() else default


def utc_now() -> str:
    """The date and time in UTC, ISO 8601 to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_record(path: Path, record: dict) -> None:
    """Writes ``record`` as indented JSON (paths as strings)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
