"""Where a result came from: the commit of the checkout that produced it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["commit_id"]


def commit_id(root: Path | None = None) -> str:
    """``NEMO_MSA_COMMIT`` where set (tests, copies without .git), else the short HEAD of the
    checkout at ``root`` (default: this one), with ``-dirty`` where tracked files differ from it
    (a copy whose git metadata is older than its files says so rather than naming a commit it
    is not; ``-unchecked`` where git could not compare them), else ``"unknown"``."""
    if os.environ.get("NEMO_MSA_COMMIT"):
        return os.environ["NEMO_MSA_COMMIT"]
    root = Path(__file__).resolve().parents[2] if root is None else root
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=root, timeout=10).stdout.strip()
        if not head:
            return "unknown"
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, cwd=root, timeout=60)
        if status.returncode:
            return f"{head}-unchecked"
        return f"{head}-dirty" if status.stdout.strip() else head
    except (OSError, subprocess.SubprocessError):
        return "unknown"
