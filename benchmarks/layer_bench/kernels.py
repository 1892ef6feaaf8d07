"""Where a row's step spends its GPU time, by part: each of this project's kernels by name and
the rest by kind (issue #60: every MSA row states the time of each sparse kernel).

One more step of the row runs under ``torch.profiler``; its CUDA kernels are summed by name.
A kernel of this package (a Triton or Gluon ``@jit`` function of a ``nemo_msa`` module) is put
in the part its module and name say (:func:`project_kernel_parts`); any other kernel is a GEMM,
cuDNN/flash attention or other device work (elementwise, reductions, copies) by its name.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import nemo_msa

#: The parts of a step, in report order.
PARTS = ("selection", "sparse forward", "sparse dq", "sparse dk/dv", "indexer loss", "recall",
         "norm/rope", "layout", "dense attention", "gemm", "other")

# Substrings of the names of library GEMM and attention kernels (cuBLAS, cuBLASLt's nvjet,
# CUTLASS, TE's, cuDNN's and FlashAttention's).
_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "matmul")
_ATTENTION = ("cudnn", "flash", "fmha", "attn", "sdpa")


def _part_of(module: str, name: str) -> str:
    """The part of a ``nemo_msa`` kernel ``name`` defined in ``module``."""
    if module.startswith("nemo_msa.selection"):
        return "selection"
    if module.startswith("nemo_msa.indexer_loss"):
        return "recall" if "recall" in module else "indexer loss"
    if module.startswith("nemo_msa.attention"):
        if "dkdv" in name or "dkdv" in module:
            return "sparse dk/dv"
        if "dq" in name or "delta" in name:
            return "sparse dq"
        if "dense" in module:
            return "dense attention"
        return "sparse forward"
    if "rms_norm" in module or "rope" in module:
        return "norm/rope"
    return "layout"


def project_kernel_parts() -> dict[str, str]:
    """Every Triton/Gluon kernel defined in a ``nemo_msa`` module, by function name, with its
    part (:data:`PARTS`). Modules that fail to import (an optional backend's) are passed over.

    Raises:
        ValueError: two kernels of one name in different parts: the profiler names a kernel by
            its function alone, so their times could not be told apart.
    """
    parts: dict[str, str] = {}
    homes: dict[str, str] = {}
    for info in pkgutil.walk_packages(nemo_msa.__path__, "nemo_msa."):
        if ".training" in info.name or ".megatron" in info.name:
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # an optional backend's module (flashinfer) where it is missing
            continue
        for attr, value in vars(module).items():
            fn = getattr(value, "fn", None)
            # triton.jit and gluon.jit return JITFunction-like objects holding the Python
            # function as ``fn``, defined in this module.
            if callable(fn) and getattr(fn, "__module__", None) == info.name:
                name, part = getattr(fn, "__name__", attr), _part_of(info.name, attr)
                if parts.get(name, part) != part:
                    raise ValueError(f"kernel {name!r} is defined in {homes[name]} ({parts[name]}) "
                                     f"and in {info.name} ({part}): rename one")
                parts[name], homes[name] = part, info.name
    return parts


def kernel_part(name: str, parts: dict[str, str]) -> str:
    """The part of a profiled kernel ``name`` (a Triton kernel's CUDA name is its function's)."""
    if name in parts:
        return parts[name]
    lower = name.lower()
    if any(key in lower for key in _ATTENTION):
        return "dense attention"
    if any(key in lower for key in _GEMM):
        return "gemm"
    return "other"


def split_by_part(kernels: list[tuple[str, float, int]], parts: dict[str, str]) -> dict:
    """Kernel times summed by part, and this project's kernels one by one.

    Args:
        kernels: ``(name, ms, calls)`` per profiled kernel.
        parts: :func:`project_kernel_parts`.

    Returns:
        ``{"step_kernel_ms": {part: ms} (parts with time only, in :data:`PARTS` order),
        "project_kernels": [{"name", "part", "ms", "calls"}] largest first}``.
    """
    by_part: dict[str, float] = defaultdict(float)
    own = []
    for name, ms, calls in kernels:
        part = kernel_part(name, parts)
        by_part[part] += ms
        if name in parts:
            own.append({"name": name, "part": part, "ms": ms, "calls": calls})
    own.sort(key=lambda k: -k["ms"])
    return {"step_kernel_ms": {p: by_part[p] for p in PARTS if by_part.get(p)},
            "project_kernels": own}


def profile_step_parts(bench, parts: dict[str, str] | None = None) -> dict:
    """One more step of ``bench`` (its ``(prepare, run)``) under the profiler, split by part
    (:func:`split_by_part`). GPU only: on the CPU there are no kernels to time, and ``{}``
    comes back."""
    if not torch.cuda.is_available():
        return {}
    prepare, run = bench
    inputs = prepare()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(inputs)
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
               and e.self_device_time_total > 0]
    return split_by_part(kernels, parts if parts is not None else project_kernel_parts())
