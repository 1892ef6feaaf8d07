"""scripts/bench_msa.py's ``--set KERNEL.KEY=VALUE`` overrides: the hook every launch variant
of the device benchmarks goes through, so a typo must fail before any GPU time is spent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_msa", ROOT / "scripts" / "bench_msa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overrides_set_json_values_and_plain_strings(monkeypatch):
    import nemo_msa.attention.triton_bwd as tb
    import nemo_msa.attention.triton_fwd as tf
    import nemo_msa.selection.triton_select as ts

    for mod, key in ((tf, "union_max"), (tf, "union_build"), (tb, "dq_tile_grid"), (ts, "tma")):
        monkeypatch.setitem(mod.CONFIG, key, mod.CONFIG[key])
    _bench().apply_overrides(["fwd.union_max=48", "fwd.union_build=torch",
                              "bwd.dq_tile_grid=false", "sel.tma=false"])
    assert tf.CONFIG["union_max"] == 48 and tf.CONFIG["union_build"] == "torch"
    assert tb.CONFIG["dq_tile_grid"] is False and ts.CONFIG["tma"] is False


@pytest.mark.parametrize("item", ["fwd.no_such_key=1", "attn.union_max=1", "fwd.union_max="])
def test_overrides_reject_unknown_kernels_keys_and_empty_values(item):
    with pytest.raises(SystemExit, match="expected KERNEL.KEY=VALUE"):
        _bench().apply_overrides([item])
