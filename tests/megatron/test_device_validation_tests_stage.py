"""benchmarks/device_validation.sh's "tests" stage on the CPU: each of its two pytest calls runs
under its own bound, and the log and the call's output give each one's exit status (a partial
run's counts read like a finished run's without it); a call the bound stops still prints its
counts, and the output names the last test it finished."""

from __future__ import annotations

import shutil

import pytest
from _device_validation import run_stages


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_tests_stage_gives_each_pytest_calls_exit_status(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_probe():\n    assert 1 + 1 == 2\n")
    out = tmp_path / "out"
    proc = run_stages(out, STAGES="tests", GPU_TEST_PATHS=str(probe), GPU_TESTS_S="120",
                      GPU_MARKED_S="1")
    log = (out / "gpu_tests.log").read_text()
    # The first call finished inside its bound; the second (Megatron's tests) cannot in 1 s.
    assert "1 passed" in log, log
    statuses = [line for line in log.splitlines() if line.startswith("rc ")]
    assert statuses == ["rc 0", "rc 124"], log
    assert "rc 124" in proc.stdout.splitlines(), proc.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_stopped_call_still_counts_and_names_the_last_test(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("import time\n\n\ndef test_fast():\n    assert 1 + 1 == 2\n\n\n"
                     "def test_slow():\n    time.sleep(120)\n")
    out = tmp_path / "out"
    proc = run_stages(out, STAGES="tests", GPU_TEST_PATHS=str(probe), GPU_TESTS_S="20",
                      GPU_MARKED_S="1")
    log = (out / "gpu_tests.log").read_text()
    # The bound interrupts the first call in test_slow: pytest still prints its count.
    assert "1 passed" in log and "KeyboardInterrupt" in log, log
    statuses = [line for line in log.splitlines() if line.startswith("rc ")]
    assert statuses == ["rc 124", "rc 124"], log
    last = [line for line in proc.stdout.splitlines() if line.startswith("last test: ")]
    assert len(last) == 1 and "test_probe.py::test_fast PASSED" in last[0], proc.stdout
