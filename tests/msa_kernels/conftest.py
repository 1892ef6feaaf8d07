"""Runs the Triton kernel tests under the interpreter on machines without CUDA.

Triton decides between compiling and interpreting when a kernel is *decorated*, i.e. when its
module is imported, so the variable is set here before the test modules import the kernels; if
another test already imported them compiled-for-nothing, they are reloaded.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

import pytest
import torch

KERNEL_MODULES = (
    "nemo_msa.triton.kernel_layout",
    "nemo_msa.triton.guards",
    "nemo_msa.selection.triton_select",
    "nemo_msa.attention.triton_union",
    "nemo_msa.attention.triton_fwd",
    "nemo_msa.attention.triton_bwd",
)

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for name in KERNEL_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


@pytest.fixture
def set_launch():
    """``set_launch({"fwd.union_qt": 0, ...})``: launch parameters for the rest of the test
    (``launch_overrides`` blocks entered in order and left when the test ends)."""
    from nemo_msa.triton.launch import launch_overrides

    with contextlib.ExitStack() as stack:
        yield lambda settings: stack.enter_context(launch_overrides(settings))


@pytest.fixture
def call_once_timing(monkeypatch):
    """``calls = call_once_timing(cli)``: a peer benchmark module ``cli`` whose timing calls
    each function once on its first input set (reporting 1.0 ms over one run) and whose memory
    probe reads 0, so that its case logic runs on the CPU; ``calls`` collects the functions
    it timed."""

    def install(cli):
        calls = []

        def once(fn, sets, **_):
            calls.append(fn)
            fn(sets[0])
            return 1.0, 1

        monkeypatch.setattr(cli, "time_fn", once)
        monkeypatch.setattr(cli, "peak_extra", lambda fn, inputs, out_bytes=0: 0.0)
        return calls

    return install
