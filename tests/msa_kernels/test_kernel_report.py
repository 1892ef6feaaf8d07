"""benchmarks/kernel_report.py compiles the hot kernels for sm_90a without a GPU and reads their
registers, spills and MMA loops from ptxas and the disassembly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_report.py"


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_kernel_report_reads_registers_and_the_mma_loop_of_a_variant():
    res = _run("--kernel", "sel", "--set", "sel.num_warps=8")
    assert res.returncode == 0, res.stderr[-2000:]
    head = re.match(r"sel: (\d+) registers, spills (\d+) B stored / (\d+) B loaded, shared (\d+) B,"
                    r" \{'num_warps': 8, 'num_stages': 2\}", res.stdout)
    assert head, res.stdout
    assert 32 <= int(head.group(1)) <= 255
    # 128 x 128 x 128 per key tile: 8 wgmma steps of k = 16 per warpgroup row slice.
    loops = re.findall(r"loop at 0x[0-9a-f]+: (\d+) instructions, (\d+) BAR.SYNC, (\d+) HGMMA",
                       res.stdout)
    assert loops and any(int(mma) >= 8 for _, _, mma in loops), res.stdout


def test_kernel_report_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(SCRIPT), "--kernel", "sel"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode != 0 and "unset TRITON_INTERPRET" in res.stderr


def _shared_and_loops(res, kernel):
    assert res.returncode == 0, res.stderr[-2000:]
    head = re.match(kernel + r": \d+ registers, spills \d+ B stored / \d+ B loaded, shared (\d+) B",
                    res.stdout)
    assert head, res.stdout
    loops = re.findall(r"loop at 0x[0-9a-f]+: \d+ instructions, \d+ BAR.SYNC, (\d+) HGMMA",
                       res.stdout)
    return int(head.group(1)), sorted(int(m) for m in loops)


def test_kernel_report_shows_the_forward_and_dq_union_loops():
    """The union forward's flat whole-block loop and the dq union kernel (always unrolled) both
    report their MMA loops."""
    _, flat_loops = _shared_and_loops(_run("--kernel", "fwd_union"), "fwd_union")
    assert flat_loops, flat_loops
    _, dq_loops = _shared_and_loops(_run("--kernel", "dq_union"), "dq_union")
    assert 40 in dq_loops, dq_loops


def test_kernel_report_compiles_the_union_build():
    """The union-list build (sort, predecessor scan, place scan) compiles for sm_90a without
    spills."""
    res = _run("--kernel", "union_build")
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.match(r"union_build: (\d+) registers, spills 0 B stored", res.stdout), res.stdout


def test_kernel_report_shows_the_per_token_kernels_hmma_loops():
    """The per-token forward and dq (16-row tiles: Ampere-style HMMA, not wgmma) compile in
    their hybrid grid and report their slot loops; a launch variant changes the program."""
    pattern = r"loop at 0x[0-9a-f]+: \d+ instructions, \d+ BAR.SYNC, (\d+) HMMA"
    for kernel, variant in (("fwd_token", "fwd.num_warps=8"), ("dq_token", "bwd.dq_bn=32")):
        res = _run("--kernel", kernel)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.startswith(f"{kernel}: "), res.stdout
        assert [int(m) for m in re.findall(pattern, res.stdout)], res.stdout
        other = _run("--kernel", kernel, "--set", variant)
        assert other.returncode == 0, other.stderr[-2000:]
        assert other.stdout.splitlines()[0] != res.stdout.splitlines()[0], other.stdout


def test_kernel_report_compiles_the_dkdv_kernel_at_its_launch():
    """The KV-outer dk/dv kernel compiles with wgmma loops at the launch's rows per query tile,
    and a variant of its warps is another program."""
    _, loops = _shared_and_loops(_run("--kernel", "dkdv"), "dkdv")
    assert loops and loops[-1] >= 8, loops
    res = _run("--kernel", "dkdv", "--set", "bwd.kv_warps=8")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "'num_warps': 8" in res.stdout.splitlines()[0], res.stdout


def test_kernel_report_compiles_the_gluon_dkdv_kernel_without_spills():
    """The SM90 Gluon dk/dv kernel (ADR 0042) compiles from the launcher's descriptor layouts:
    its consumers' loop holds the four products of a step (24 wgmma instructions at 128 keys x
    64 rows x d 128), nothing spills under the warp-specialized register cap, and ptxas keeps
    the products asynchronous (no C7512: ADR 0045 measured the serialized loop 2-5% slower)."""
    res = _run("--kernel", "dkdv_gluon")
    assert res.returncode == 0, res.stderr[-2000:]
    head = re.match(r"dkdv_gluon: (\d+) registers, spills (\d+) B stored / (\d+) B loaded",
                    res.stdout)
    assert head and head.group(2) == head.group(3) == "0", res.stdout
    mmas = [int(m) for m in re.findall(r"(\d+) HGMMA", res.stdout)]
    assert mmas and max(mmas) == 24, res.stdout
    # Each loop line counts its wgmma waits (WARPGROUP.DEPBAR): at most one per HGMMA.
    waits = re.findall(r"(\d+) HGMMA, (\d+) wgmma waits", res.stdout)
    assert waits and all(0 < int(w) <= int(m) for m, w in waits), res.stdout
    assert "C7512" not in res.stdout and all(int(w) < int(m) for m, w in waits), res.stdout


def test_mma_loops_count_each_loops_wgmma_waits():
    """A loop whose every HGMMA is followed by a ``WARPGROUP.DEPBAR`` (what ptxas emits when it
    serializes them, C7512) reports as many waits as HGMMAs; a pipelined one reports fewer."""
    import kernel_report as kr

    def sass(body):
        lines = [f"        /*{0x100 + 16 * i:04x}*/   {op} ;" for i, op in enumerate(body)]
        lines.append(f"        /*{0x100 + 16 * len(body):04x}*/   BRA 0x100 ;")
        return "\n".join(lines)

    serial = ["WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0, gsb0",
              "WARPGROUP.DEPBAR.LE gsb0, 0x0"] * 3
    pipelined = ["WARPGROUP.ARRIVE", *["HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0"] * 2,
                 "HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0, gsb0",
                 "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert [loop[3:6] for loop in kr._mma_loops(sass(serial))] == [(3, "HGMMA", 3)]
    assert [loop[3:6] for loop in kr._mma_loops(sass(pipelined))] == [(3, "HGMMA", 1)]


_SOURCE_OF_SEL = """
import json, sys
sys.path.insert(0, sys.argv[1])
import kernel_report as kr
from bench_msa import apply_overrides
import nemo_msa.selection.triton_select as ts

with apply_overrides([]) as launches:
    _, src, _ = kr.KERNELS["sel"][1](launches["sel"], False, False)
names = ts._select_kernel.arg_names
try:
    kr._signature(ts._select_kernel, {"BS": 128}, {}, set(), {})
    missing = None
except ValueError as err:
    missing = str(err)
print(json.dumps({
    "local_blocks": [src.signature["local_blocks"], src.constexprs.get("local_blocks")],
    "attrs": {names[k[0]]: v for k, v in src.attrs.items()},
    "subset": src.constexprs.get("SUBSET"),
    "missing": missing,
}))
"""


def test_kernel_report_compiles_what_the_jit_launches():
    """The report's source is specialized by the JIT's own rule at the production shape: an
    integer 1 (local_blocks) becomes a constant, aligned pointers and strides and integers
    divisible by 16 get tt.divisibility, and every constexpr has a value; without that the
    compiled code is not the launched code (unvectorized loads, and spills it does not have)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SOURCE_OF_SEL, str(SCRIPT.parent)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["local_blocks"] == ["constexpr", 1]
    hint = [["tt.divisibility", 16]]
    for name in ("q_ptr", "k_ptr", "out_ptr", "stride_qt", "stride_kt", "top_k", "init_blocks",
                 "num_blocks_bound"):
        assert out["attrs"].get(name) == hint, (name, out["attrs"])
    assert out["subset"] is False
    assert out["missing"] and "constexpr arguments without a value" in out["missing"]
