"""Processes for the tests' gloo ranks, forked from a server that imported torch, Megatron-Core
and nemo_msa once.

A spawned rank starts a fresh interpreter and imports them again (about 9 s of CPU per rank on 2
cores). Here each pytest worker starts one fork server (multiprocessing's ``forkserver``), which
imports ``PRELOAD`` and forks every rank the worker's tests start; a rank has set nothing up when
it is forked (no process group, no Megatron state: the server only imported). A rank gets the
parent's ``sys.path`` and working directory at its start, and the environment the server started
with.
"""

from __future__ import annotations

import torch.multiprocessing

#: What the fork server imports before it forks a rank.
PRELOAD = [
    "torch",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing",
    "nemo_msa.megatron",
    "nemo_msa.training.save_failures",
    "nemo_msa.training.trainer",
]


def rank_context():
    """The multiprocessing context whose processes the fork server forks."""
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
