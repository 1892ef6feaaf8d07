"""scripts/kernel_report.py compiles the hot kernels for sm_90a without a GPU and reads their
registers, spills and MMA loops from ptxas and the disassembly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kernel_report.py"


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
