"""benchmarks/bench_msa.py's ``--set KERNEL.KEY=VALUE`` overrides: the hook every launch variant
of the device benchmarks goes through, so a typo must fail before any GPU time is spent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_msa", ROOT / "benchmarks" / "bench_msa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overrides_set_json_values_and_plain_strings():
    from nemo_msa.triton.launch import ForwardLaunch, current_launch

    with _bench().apply_overrides(["fwd.union_max=48", "bwd.kv_warps=8", "bwd.dq_union_tma=false",
                                   "sel.tma=false", "fwd.union_maxnreg=null"]) as launches:
        assert launches["fwd"].union_max == 48 and launches["fwd"].union_maxnreg is None
        assert launches["bwd"].kv_warps == 8 and launches["bwd"].dq_union_tma is False
        assert current_launch("sel").tma is False
    assert current_launch("fwd") == ForwardLaunch()


@pytest.mark.parametrize("item", ["fwd.no_such_key=1", "attn.union_max=1", "fwd.union_max=",
                                  "fwd.union_max=4.5", "fwd.union_build=triton", "bwd.skip=dq",
                                  "fwd.union_flat=false"])
def test_overrides_reject_unknown_kernels_keys_and_bad_values(item):
    with pytest.raises(SystemExit, match="expected KERNEL.KEY=VALUE"):
        _bench().apply_overrides([item])


def test_table_prints_speedups_to_two_decimals():
    """A ratio just under a target must not print as the target (14.95x as "15.0x")."""
    row = {"case": "doc131072", "tokens": 131072, "sel_ms": 16.48, "scores_ms": 17.93,
           "fwd_ms": 27.66,
           "fwd_mass_ms": 31.02, "bwd_ms": 76.86, "bwd_det_ms": 78.04, "msa_fwd_ms": 44.84,
           "msa_fwdbwd_ms": 122.39,
           "dense_fwd_ms": 506.99, "dense_fwdbwd_ms": 1830.01, "speedup_fwd": 506.99 / 44.84,
           "speedup_fwdbwd": 1830.01 / 122.39, "fwd_tflops": 306.0, "bwd_tflops": 275.0,
           "sel_tflops": 534.0, "sel_extra_mib": 0.0, "fwd_extra_mib": 34.8,
           "bwd_extra_mib": 330.5, "sel_match_subset": 1.0, "out_err_subset": 2.2e-3,
           "dq_err_subset": 2.4e-3}
    table = _bench().fmt_table([row], [])
    assert "| 11.31x | 14.95x |" in table, table
    # The loss's block scores follow the selection, the forward with the block mass the
    # forward.
    assert "| sel ms | scores ms | fwd ms | fwd+mass ms | bwd ms |" in table, table
    assert "| 16.48 | 17.93 | 27.66 | 31.02 | 76.86 |" in table, table
