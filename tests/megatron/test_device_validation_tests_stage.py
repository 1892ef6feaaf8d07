"""scripts/device_validation.sh's "tests" stage on the CPU: each of its two pytest calls runs
under its own bound, and a call the bound stops says so in the log and the call's output
(pytest itself prints no summary then, so a partial run cannot pass for a finished one)."""

from __future__ import annotations

import shutil

import pytest
from _device_validation import run_stages


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_tests_stage_says_where_a_bound_stopped_pytest(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_probe():\n    assert 1 + 1 == 2\n")
    out = tmp_path / "out"
    proc = run_stages(out, STAGES="tests", GPU_TEST_PATHS=str(probe), GPU_TESTS_S="120",
                      GPU_MARKED_S="1")
    log = (out / "gpu_tests.log").read_text()
    # The first call finished inside its bound; the second (Megatron's tests) cannot in 1 s.
    assert "1 passed" in log, log
    assert log.count("== stopped at its") == 1, log
    assert "== stopped at its 1 s bound: python3 -m pytest -q -m gpu tests/megatron" in log, log
    assert "== stopped at its 1 s bound" in proc.stdout, proc.stdout
