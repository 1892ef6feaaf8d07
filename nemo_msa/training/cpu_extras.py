"""CUDA calls on the training path that nemo_msa.megatron.cpu_shim does not cover (yet).

Megatron's DDP asks ``torch.cuda.current_stream()`` in every grad sync, only to wait on CUDA-graph
events that never exist on the CPU. The shim covers the model and the schedules; this adds the
rest of the training path, only while the shim is installed and only for what is missing.
"""

from __future__ import annotations

import torch


class _NullStream:
    """Stands in for a CUDA stream on the CPU, where work is synchronous."""

    def wait_event(self, event) -> None:  # noqa: D102 - nothing to wait for on the CPU
        del event

    def wait_stream(self, stream) -> None:  # noqa: D102
        del stream

    def synchronize(self) -> None:  # noqa: D102
        return None


_NULL_STREAM = _NullStream()
_saved: list = []


def _null_current_stream(device=None) -> _NullStream:
    del device
    return _NULL_STREAM


def install() -> None:
    """Patch the CUDA stream query the DDP grad sync makes (idempotent, process-wide)."""
    if _saved:
        return
    _saved.append(torch.cuda.current_stream)
    torch.cuda.current_stream = _null_current_stream


def uninstall() -> None:
    """Restore what :func:`install` replaced."""
    if _saved:
        torch.cuda.current_stream = _saved.pop()
