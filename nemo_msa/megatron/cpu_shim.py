"""Run Megatron-Core 0.19 models and pipeline schedules on the CPU with the gloo backend.

Megatron-Core hard-codes CUDA in a few places that a CPU test or a CPU smoke run reaches:
``torch.cuda.current_device()`` as a tensor device (p2p, mappings, utils), ``device="cuda"`` in the
schedules, ``torch.cuda.synchronize()`` after batched p2p, and the CUDA RNG tracker (tensor
parallel dropout / init forks) which reads and writes the CUDA generator. This module patches
exactly those, and nothing else:

- ``torch.cuda.current_device`` returns ``torch.device("cpu")``;
- a :class:`torch.overrides.TorchFunctionMode` rewrites ``device="cuda"`` (and ``"cuda:N"``)
  keyword arguments, ``Tensor.cuda()`` and ``Tensor.to("cuda")`` to the CPU, and drops
  ``pin_memory=True`` (pinning needs a GPU; context parallelism's
  ``get_pos_emb_on_this_cp_rank`` pins its index tensor);
- ``torch.cuda.synchronize`` / ``empty_cache`` become no-ops;
- ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` / ``manual_seed_all`` and
  Megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` use the CPU default generator, so
  ``get_cuda_rng_tracker().fork()`` forks the CPU generator and restores it afterwards.

Two configuration facts are not patches but must hold on gloo (see ``PLATFORM.md``):
``batch_p2p_sync=False`` (there is nothing to synchronize) and ``batch_p2p_comm=False`` (with
``True``, PP=2 + VPP=2 produced silently wrong gradients on gloo). :func:`cpu_config_overrides`
returns them, together with ``use_cpu_initialization=True``; :func:`check_cpu_config` refuses a
config that violates them.

Usage::

    from nemo_msa.megatron import cpu_shim

    with cpu_shim.enabled():          # scoped: patches are undone on exit
        ...

    cpu_shim.install()                # process-wide (e.g. at the top of a spawned worker)
    ...
    cpu_shim.uninstall()

The function mode is thread-local (PyTorch keeps one mode stack per thread); enter the shim in
the thread that builds and runs the model. On a machine with CUDA the shim is not needed and
should not be installed: it would silently move everything to the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mcore_random
from torch.overrides import TorchFunctionMode

__all__ = [
    "CPUShim",
    "check_cpu_config",
    "cpu_config_overrides",
    "enabled",
    "init_gloo_process_group",
    "install",
    "is_installed",
    "uninstall",
]

_CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    # A bare int is a CUDA ordinal for most torch factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            # Tensor.cuda(device=None, non_blocking=False, ...): a CPU tensor stays where it is,
            # returning self as Tensor.cuda() does for a tensor already on the device.
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    del device, graph_safe
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    del device, graph_safe
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _cpu_current_device() -> torch.device:
    return _CPU


class _DropForkWarning(logging.Filter):
    """Drops the tracker's "CPU RNG state changed" warning, which is expected under the shim.

    With the shim the "CUDA" generator *is* the CPU generator, so a dropout inside
    ``get_cuda_rng_tracker().fork()`` advances the CPU state by design; the fork still restores
    it on exit.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_FORK_WARNING_FILTER = _DropForkWarning()


def _noop(*args, **kwargs) -> None:
    del args, kwargs


class CPUShim:
    """The set of patches; enter/exit it as a context manager or via install()/uninstall().

    Entering is re-entrant: nested entries count, and only the outermost exit restores the
    original attributes.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _CudaToCpuMode | None = None
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether the patches are in place."""
        return self._depth > 0

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> CPUShim:
        with self._lock:
            self._depth += 1
            if self._depth > 1:
                return self
            self._patch(torch.cuda, "current_device", _cpu_current_device)
            self._patch(torch.cuda, "synchronize", _noop)
            self._patch(torch.cuda, "empty_cache", _noop)
            self._patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
            self._patch(torch.cuda, "set_rng_state", _cpu_set_rng_state)
            # torch.manual_seed itself calls torch.cuda.manual_seed_all (a lazy no-op without a
            # driver), so only manual_seed is redirected, straight to the CPU generator.
            self._patch(torch.cuda, "manual_seed", _cpu_manual_seed)
            self._patch(torch.cuda.random, "get_rng_state", torch.cuda.get_rng_state)
            self._patch(torch.cuda.random, "set_rng_state", _cpu_set_rng_state)
            self._patch(mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state)
            self._patch(mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state)
            logging.getLogger(mcore_random.__name__).addFilter(_FORK_WARNING_FILTER)
            self._mode = _CudaToCpuMode()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth > 0:
                return
            assert self._mode is not None
            self._mode.__exit__(None, None, None)
            self._mode = None
            logging.getLogger(mcore_random.__name__).removeFilter(_FORK_WARNING_FILTER)
            for owner, name, value in reversed(self._saved):
                setattr(owner, name, value)
            self._saved.clear()


_SHIM = CPUShim()


def install() -> CPUShim:
    """Install the shim process-wide (in the calling thread's function-mode stack).

    Returns:
        The process's :class:`CPUShim`; idempotent (a second call only deepens the count).
    """
    return _SHIM.__enter__()


def uninstall() -> None:
    """Undo one :func:`install`; the patches go away when the count reaches zero."""
    _SHIM.__exit__(None, None, None)


def is_installed() -> bool:
    """Whether the process-wide shim is active."""
    return _SHIM.active


@contextlib.contextmanager
def enabled() -> Iterator[CPUShim]:
    """Scoped shim: ``with cpu_shim.enabled(): ...``."""
    install()
    try:
        yield _SHIM
    finally:
        uninstall()


def cpu_config_overrides() -> dict[str, Any]:
    """Config fields a Megatron ``TransformerConfig`` must carry to run on the CPU with gloo.

    Returns:
        ``{"use_cpu_initialization": True, "batch_p2p_comm": False, "batch_p2p_sync": False}``.
    """
    return {"use_cpu_initialization": True, "batch_p2p_comm": False, "batch_p2p_sync": False}


def check_cpu_config(config: Any) -> None:
    """Refuse a config that is known to misbehave on the CPU/gloo.

    Args:
        config: a ``ModelParallelConfig`` / ``TransformerConfig``.

    Raises:
        ValueError: naming the field and its value when it differs from
            :func:`cpu_config_overrides` (``batch_p2p_comm=True`` gives wrong gradients with
            interleaved pipelining on gloo, silently), or an MoE model whose token dispatcher
            is not ``"allgather"``.
    """
    for name, expected in cpu_config_overrides().items():
        value = getattr(config, name, expected)
        if value != expected:
            raise ValueError(
                f"config.{name}={value!r} is not supported on the CPU/gloo; expected {expected!r} "
                "(see nemo_msa.megatron.cpu_shim.cpu_config_overrides)"
            )
    dispatcher = getattr(config, "moe_token_dispatcher_type", "allgather")
    if getattr(config, "num_moe_experts", None) is not None and dispatcher != "allgather":
        # The all-to-all dispatcher makes a torch.cuda.Stream at construction; flex needs DeepEP.
        raise ValueError(
            f"config.moe_token_dispatcher_type={dispatcher!r} is not supported on the CPU/gloo; "
            "expected 'allgather' (the alltoall dispatcher creates a CUDA stream)"
        )


def init_gloo_process_group(
    rank: int = 0, world_size: int = 1, rendezvous_file: str | os.PathLike | None = None
) -> None:
    """Initialise ``torch.distributed`` with gloo on this host.

    The ranks meet through a file, not a TCP port: a port picked free can be taken by another
    process on the host before the first rank binds it.

    Args:
        rank: this process's global rank.
        world_size: number of processes.
        rendezvous_file: a path every rank opens, absent or empty before the first rank starts;
            needed when ``world_size`` > 1 (one rank keeps its store in memory).

    Raises:
        ValueError: ``world_size`` > 1 without ``rendezvous_file``.
    """
    if world_size == 1:
        store = torch.distributed.HashStore()
    elif rendezvous_file is None:
        raise ValueError(
            f"rendezvous_file=None with world_size={world_size}: expected a path every rank "
            "opens (absent or empty before the first rank starts)"
        )
    else:
        store = torch.distributed.FileStore(os.fspath(rendezvous_file), world_size)
    torch.distributed.init_process_group(
        backend="gloo", store=store, rank=rank, world_size=world_size
    )
