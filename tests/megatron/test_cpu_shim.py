"""nemo_msa.megatron.cpu_shim: Megatron's CUDA assumptions mapped to the CPU, and undone afterwards.

A module of its own: the other modules of this package hold the shim for their whole duration
(the single_rank fixture), and here it must start uninstalled.
"""

from __future__ import annotations

import pytest
import torch
from _megatron_harness import tiny_config

from nemo_msa.megatron import cpu_shim


def test_cpu_shim_maps_cuda_and_restores_everything():
    original = torch.cuda.current_device
    assert not cpu_shim.is_installed()
    with cpu_shim.enabled():
        assert cpu_shim.is_installed()
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.ones(1).to("cuda:0").device.type == "cpu"
        assert torch.cuda.current_device() == torch.device("cpu")
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        tracker = CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 5)
        before = torch.get_rng_state()
        with tracker.fork("model-parallel-rng"):
            inside = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before), "fork must restore the CPU state"
        with tracker.fork("model-parallel-rng"):
            again = torch.rand(3)
        assert not torch.equal(inside, again), "the tracker state must advance"
    assert torch.cuda.current_device is original
    assert not cpu_shim.is_installed()


def test_cpu_config_check_names_the_field():
    config = tiny_config()
    cpu_shim.check_cpu_config(config)
    config.batch_p2p_comm = True
    with pytest.raises(ValueError, match="config.batch_p2p_comm=True"):
        cpu_shim.check_cpu_config(config)


def test_several_ranks_need_a_rendezvous_file():
    """Ranks meet through a file (a TCP port picked free could be taken before it is bound);
    without one, several ranks are refused before any process group starts."""
    with pytest.raises(ValueError, match=r"rendezvous_file=None with world_size=2: expected"):
        cpu_shim.init_gloo_process_group(rank=0, world_size=2)
    assert not torch.distributed.is_initialized()
