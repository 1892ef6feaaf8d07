"""``python -m benchmarks.device tests`` on the CPU: each of its two pytest calls runs under its
own bound, and the log and the output give each one's exit status (a partial run's counts read
like a finished run's without it); a call the bound stops still prints its counts, and the
output names the last test it finished."""

from __future__ import annotations

import json
import signal

from _device import run_stage

PROBE = "import time\n\n\ndef test_fast():\n    assert 1 + 1 == 2\n\n\ndef test_slow():\n" \
        "    time.sleep(120)\n"
MARKED = "import pytest\n\n\n@pytest.mark.gpu\ndef test_marked():\n    assert 2 * 2 == 4\n"


def test_each_call_has_its_bound_status_counts_and_last_test(tmp_path, monkeypatch, capfd):
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "test_marked.py").write_text(MARKED)
    out = tmp_path / "out"
    # The bound interrupts the first call in test_slow; the second ends inside its own. No
    # wheels to install (a checkout may hold .whl/), so the two pytest calls are the only steps.
    # This process ignores SIGINT, as a background job of a non-interactive shell does: the
    # bound's SIGINT must still stop pytest with its counts (the runner restores its default).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        status = run_stage(monkeypatch, "tests", "--out", out, "--wheels",
                           tmp_path / "no_wheels", "--paths", tmp_path / "test_probe.py",
                           "--seconds", "10", "--marked-paths", tmp_path / "test_marked.py",
                           "--marked-seconds", "120")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status == 1  # a call ended non-zero (its bound stopped it)
    log = (out / "gpu_tests.log").read_text()
    first, second = log.split("\nrc 124\n")
    assert "KeyboardInterrupt" in first and "1 passed" in first, log  # counted all the same
    assert "1 passed" in second, log
    statuses = [line for line in log.splitlines() if line.startswith("rc ")]
    assert statuses == ["rc 124", "rc 0"], log
    printed = capfd.readouterr().out.splitlines()
    assert [line for line in printed if line.startswith("rc ")] == ["rc 124", "rc 0"], printed
    last = [line for line in printed if line.startswith("last test: ")]
    assert len(last) == 1 and "test_probe.py::test_fast PASSED" in last[0], printed
    record = json.loads((out / "tests.run.json").read_text())
    assert record["summary"]["statuses"] == [124, 0]
    assert [step["rc"] for step in record["steps"]] == [124, 0]
