"""``nemo_msa.training.provenance.commit_id``, which every benchmark JSON and quality report
records: the caller's NEMO_MSA_COMMIT first, else the checkout's HEAD, marked ``-dirty`` where
tracked files differ from it (a device copy whose git metadata is older than its files once
recorded a commit it was not running)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nemo_msa.training.provenance import commit_id


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_id_marks_a_tree_that_differs_from_its_head(tmp_path, monkeypatch):
    monkeypatch.delenv("NEMO_MSA_COMMIT", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "tracked.py").write_text("x = 1\n")
    _git(repo, "add", "tracked.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert commit_id(repo) == head
    (repo / "untracked.txt").write_text("results\n")  # untracked files do not count
    assert commit_id(repo) == head
    (repo / "tracked.py").write_text("x = 2\n")
    assert commit_id(repo) == f"{head}-dirty"
    monkeypatch.setenv("NEMO_MSA_COMMIT", "given")
    assert commit_id(repo) == "given"


def test_commit_id_outside_a_checkout_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("NEMO_MSA_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert commit_id(tmp_path) == "unknown"
