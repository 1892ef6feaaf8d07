"""The two-rank worker of test_save_failures.py, in a module of its own: a spawned rank imports
the module of its target, and this one needs only torch and ``save_failures`` (the test module
would bring Megatron and the trainer into every rank, seconds each)."""

from __future__ import annotations

import errno
from pathlib import Path


def agree_in_two_ranks(rank: int, rendezvous: str, results) -> None:
    import torch.distributed as dist

    from nemo_msa.training.save_failures import agreed_save_step

    dist.init_process_group("gloo", store=dist.FileStore(rendezvous, 2), rank=rank, world_size=2)
    try:
        def rank0_bug():
            raise RuntimeError("not a file-system error")

        # A rank-0-only step (as publishing is) that fails for another reason on rank 0.
        failure, error = agreed_save_step(rank0_bug, Path("/nowhere"), [], rank == 0)

        # Then a step on every rank whose file-system failure is on rank 1 only.
        def rank1_full():
            if rank == 1:
                raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/shard_1")

        second, second_error = agreed_save_step(rank1_full, Path("/ckpt"), [], True)
        results.put((rank, failure, type(error).__name__ if error else None, second,
                     second_error))
    finally:
        dist.destroy_process_group()
