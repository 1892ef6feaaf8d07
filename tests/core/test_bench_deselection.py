"""The default run leaves out the tests marked ``bench`` (the benchmark tooling under
benchmarks/, ADR 0038); ``--run-bench``, ``NEMO_MSA_BENCH_TESTS=1`` or ``-m`` naming ``bench``
bring them back, and ``-m gpu`` still selects by its own marker."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The suite's conftest (tests/conftest.py) by path: ``import conftest`` finds tests/core's.
_SPEC = importlib.util.spec_from_file_location("suite_conftest", ROOT / "tests" / "conftest.py")
conftest = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(conftest)


class _Config:
    def __init__(self, run_bench: bool = False, markexpr: str = "") -> None:
        self.options = {"--run-bench": run_bench, "markexpr": markexpr}
        self.deselected: list = []
        self.hook = SimpleNamespace(pytest_deselected=lambda items: self.deselected.extend(items))

    def getoption(self, name):
        return self.options[name]


class _Item:
    def __init__(self, name: str, *markers: str) -> None:
        self.name, self.markers, self.keywords = name, set(markers), set(markers)
        self.added = []  # the skip marks the hook adds (gpu, te)

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, marker):
        self.added.append(marker)


def _selected(config) -> list[str]:
    items = [_Item("product"), _Item("tool", "bench"), _Item("tool_on_gpu", "bench", "gpu")]
    conftest.pytest_collection_modifyitems(config, items)
    return [item.name for item in items]


@pytest.mark.parametrize(("config", "env", "expected"), [
    (_Config(), None, ["product"]),
    (_Config(run_bench=True), None, ["product", "tool", "tool_on_gpu"]),
    (_Config(), "1", ["product", "tool", "tool_on_gpu"]),
    (_Config(), "0", ["product"]),
    (_Config(markexpr="bench"), None, ["product", "tool", "tool_on_gpu"]),
    (_Config(markexpr="gpu"), None, ["product"]),
], ids=["default", "--run-bench", "env", "env-0", "-m bench", "-m gpu"])
def test_the_hook_deselects_bench_tests_unless_asked(monkeypatch, config, env, expected):
    if env is None:
        monkeypatch.delenv(conftest.BENCH_ENV, raising=False)
    else:
        monkeypatch.setenv(conftest.BENCH_ENV, env)
    assert _selected(config) == expected
    assert [item.name for item in config.deselected] == [
        name for name in ("tool", "tool_on_gpu") if name not in expected]


def test_pytest_runs_the_hook_and_knows_the_option():
    """One collection in a subprocess: the bench module is deselected, the product one kept."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/megatron/test_bench_timing.py", "tests/core/test_document_map.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != conftest.BENCH_ENV},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "test_bench_timing.py" not in proc.stdout, proc.stdout
    assert re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", proc.stdout), proc.stdout
