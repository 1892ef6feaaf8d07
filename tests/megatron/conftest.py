"""Fixtures of the Megatron integration tests (CPU with gloo; one GPU with NCCL)."""

from __future__ import annotations

import contextlib

import pytest
import torch


@contextlib.contextmanager
def _megatron_parallel_state(owns_group: bool):
    """Megatron's one-rank parallel state on the initialized group; afterwards the state, the
    group where ``owns_group``, and the MSA layers' process-wide state are undone."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_msa.megatron import (
        MSAIndexerLossAutoScaler,
        MSAIndexerMetrics,
        set_training_iteration,
    )

    try:
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)
        yield
    finally:
        ps.destroy_model_parallel()
        if owns_group:
            torch.distributed.destroy_process_group()
        MSAIndexerLossAutoScaler.reset()
        MSAIndexerMetrics.reset()
        set_training_iteration(None)


@pytest.fixture(scope="module")
def single_rank():
    """This process as a one-rank gloo world with Megatron's parallel state, under the CPU shim.

    Module-scoped and fully undone afterwards (shim, parallel state, process group), so tests
    outside this package never see the shim.
    """
    from nemo_msa.megatron import cpu_shim

    # Reuse a one-rank group another test module left behind; never tear down what we did not
    # create.
    owns_group = not torch.distributed.is_initialized()
    if not owns_group and torch.distributed.get_world_size() != 1:
        pytest.fail("single_rank needs a one-rank process group; another one is initialized")
    with cpu_shim.enabled():
        if owns_group:
            cpu_shim.init_gloo_process_group(0, 1)
        with _megatron_parallel_state(owns_group):
            yield


@pytest.fixture(scope="module")
def cuda_single_rank():
    """This process as a one-rank NCCL world with Megatron's parallel state (no CPU shim), for
    the GPU tests; module-scoped and undone afterwards like :func:`single_rank`."""
    owns_group = not torch.distributed.is_initialized()
    if owns_group:
        torch.cuda.set_device(0)
        torch.distributed.init_process_group(
            "nccl", store=torch.distributed.HashStore(), rank=0, world_size=1)
    with _megatron_parallel_state(owns_group):
        yield
