"""``python -m benchmarks.device sweep`` on the CPU (bench_layer.py --tiny --cpu): the launch
variants run in turn, each round in its own process, dense only in the first (or the cases
--cases names in every process), and every process's rows land in one JSON keyed by round and
variant."""

from __future__ import annotations

import json

import pytest
from _device import run_stage

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

TINY = "--tiny --cpu --steps 1 --warmup 1"


def test_sweep_stage_runs_every_variant_each_round(tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert run_stage(monkeypatch, "sweep", "--out", out, "--rows", "64,128:32", "--variant",
                     "defaults", "--variant", "bwd.dq_tile_grid_tiles=1 fwd.union_max=8",
                     "--rounds", "2", "--args", TINY, "--seconds", "300") == 0
    log = (out / "sweep.log").read_text()
    assert log.count("== sweep ") == 4 and "== sweep 2 1: bwd.dq_tile_grid_tiles=1" in log, log
    assert "rc 124" not in log and log.count("rc 0") == 4, log
    runs = json.loads((out / "sweep.json").read_text())
    assert sorted(runs) == ["1/0", "1/1", "2/0", "2/1"]
    for key, run in runs.items():
        cases = {row["case"] for row in run["rows"]}
        assert cases == ({"dense", "msa_sparse_loss"} if key == "1/0" else {"msa_sparse_loss"})
        assert {(row["tokens"], row["doc_mean"]) for row in run["rows"]} == {(64, 0), (128, 32)}
        assert all(row["status"] == "ok" for row in run["rows"]), run["rows"]
        settings = run["launch_settings"]
        if key.endswith("/1"):
            assert settings == {"bwd.dq_tile_grid_tiles": 1, "fwd.union_max": 8}, settings
        else:
            assert not settings, settings
    assert not (out / "sweep_json").exists() and not (out / "sweep_run.log").exists()


_STUB_BENCH = '''
import json, os, sys
args = sys.argv[1:]
path = args[args.index("--json") + 1]
json.dump({"stub_tree": True, "argv": args, "rows": [],
           "commit": os.environ.get("NEMO_MSA_COMMIT")}, open(path, "w"))
print("|   64 | stub row")
'''


def _stub_tree(tmp_path):
    """A base tree (commit abc1234) whose bench_layer.py only records how it was called."""
    base = tmp_path / "base"
    (base / "benchmarks").mkdir(parents=True)
    (base / "benchmarks" / "bench_layer.py").write_text(_STUB_BENCH)
    (base / ".commit").write_text("abc1234\n")
    return base


def test_sweep_stage_runs_a_variant_in_another_tree(tmp_path, monkeypatch):
    # The variant naming the stub tree must run its script (from its own directory), the other
    # one this tree's.
    base = _stub_tree(tmp_path)
    out = tmp_path / "out"
    assert run_stage(monkeypatch, "sweep", "--out", out, "--rows", "64", "--variant", "",
                     "--variant", f"tree={base} fwd.union_max=8", "--rounds", "1", "--args",
                     TINY, "--seconds", "300") == 0
    log = (out / "sweep.log").read_text()
    assert log.count("rc 0") == 2 and "stub row" in log, log
    runs = json.loads((out / "sweep.json").read_text())
    here = runs["1/0"]
    assert "stub_tree" not in here
    assert {row["case"] for row in here["rows"]} == {"dense", "msa_sparse_loss"}
    assert all(row["status"] == "ok" for row in here["rows"]), here["rows"]
    assert runs["1/1"]["stub_tree"] is True and runs["1/1"]["commit"] == "abc1234"
    argv = runs["1/1"]["argv"]
    assert argv[argv.index("--set") + 1] == "fwd.union_max=8" and "tree=" not in " ".join(argv)
    assert argv[argv.index("--cases") + 1] == "msa_sparse_loss"


def test_sweep_cases_run_in_every_process(tmp_path, monkeypatch):
    # A dense-layer change against a base tree: every process runs --cases, not MSA.
    base = _stub_tree(tmp_path)
    out = tmp_path / "out"
    assert run_stage(monkeypatch, "sweep", "--out", out, "--rows", "64", "--variant", "defaults",
                     "--variant", f"tree={base}", "--cases", "dense", "--rounds", "2", "--args",
                     TINY, "--seconds", "300") == 0
    runs = json.loads((out / "sweep.json").read_text())
    assert sorted(runs) == ["1/0", "1/1", "2/0", "2/1"]
    for key in ("1/0", "2/0"):
        assert {row["case"] for row in runs[key]["rows"]} == {"dense"}, runs[key]["rows"]
    for key in ("1/1", "2/1"):
        argv = runs[key]["argv"]
        assert argv[argv.index("--cases") + 1] == "dense", argv
