"""Process-level set-up of a training run, and the teardown that undoes it.

:func:`init_distributed` starts the process group (NCCL on GPUs; gloo plus the project's CPU
shim on the CPU), :func:`init_model_parallel` checks the parallel layout against the world size
and creates Megatron's model-parallel groups, :func:`set_seeds` seeds every generator as
Megatron-LM does. :func:`teardown` undoes what these set up in this process, and nothing that
existed before.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from nemo_msa.megatron import cpu_shim
from nemo_msa.training import cpu_extras, determinism
from nemo_msa.training.recipe import Recipe, RecipeError, check_parallel_layout

#: What this module set up in this process, so that teardown() undoes exactly that.
_OWNED: dict[str, bool] = {"process_group": False, "cpu_shim": False}

#: The rendezvous store of the process group started here (None: none started here), where the
#: ranks note the errors they reported (:func:`first_to_report`).
_ERROR_STORE: list = [None]

#: torch's intra-op thread count before :func:`init_distributed` chose one (None: not chosen).
_THREADS_BEFORE: list = [None]

#: What ``model.deterministic_mode`` changed in this process (None: nothing).
_DETERMINISM: list = [None]


#: torch threads per process of a CPU run without OMP_NUM_THREADS. One: torch's default (one per
#: core) oversubscribes a shared machine, where the default recipe ran 5x slower with 2 threads
#: than with 1 on the 2-core machine (170-190 against 870-900 tokens/s at load 4-6), and a count
#: read from the load average would make a run's speed, and its thread count, depend on what
#: else ran when it started. The tiny CPU models gain little from a second intra-op thread.
CPU_THREADS_PER_RANK = 1


@dataclass
class RunContext:
    """Process-level facts of this run."""

    rank: int
    world_size: int
    device: torch.device
    on_cpu: bool
    owns_process_group: bool


def init_distributed(recipe: Recipe) -> RunContext:
    """Initialise torch.distributed (torchrun env or a 1-rank group) and the CPU shim.

    Under torchrun the rendezvous comes from the environment (RANK, WORLD_SIZE, MASTER_ADDR...);
    a plain ``python scripts/pretrain.py`` gets a 1-rank group on an in-memory store. On the
    CPU, without ``OMP_NUM_THREADS``, torch gets :data:`CPU_THREADS_PER_RANK` threads instead of
    one per core, which oversubscribes a busy machine.

    With ``model.deterministic_mode`` it first sets the mode's environment and
    ``torch.use_deterministic_algorithms(True)`` (:mod:`nemo_msa.training.determinism`): before
    CUDA and NCCL start, which read them once.

    Raises:
        RecipeError: ``dist.backend`` is nccl on a run without CUDA; with
            ``model.deterministic_mode``, a determinism variable set to another value or CUDA
            already initialised without ``CUBLAS_WORKSPACE_CONFIG``.
    """
    if recipe.model.get("deterministic_mode") and _DETERMINISM[0] is None:
        _DETERMINISM[0] = determinism.enable()
    dist = recipe.dist
    on_cpu = dist.force_cpu or not torch.cuda.is_available()
    backend = dist.backend if dist.backend != "auto" else ("gloo" if on_cpu else "nccl")
    if on_cpu and backend == "nccl":
        raise RecipeError("recipe key 'dist.backend' = 'nccl': expected 'gloo' or 'auto' on a "
                          "machine without CUDA (or with dist.force_cpu=true)")
    owns = False
    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(minutes=dist.timeout_minutes)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if not on_cpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # The env:// rendezvous init_process_group would make, done here to keep its store.
            store, rank, world_size = next(torch.distributed.rendezvous("env://",
                                                                        timeout=timeout))
            store.set_timeout(timeout)
            torch.distributed.init_process_group(
                backend=backend, store=torch.distributed.PrefixStore("default_pg", store),
                rank=rank, world_size=world_size, timeout=timeout)
        else:
            if not on_cpu:
                torch.cuda.set_device(0)
            store = torch.distributed.HashStore()
            torch.distributed.init_process_group(backend=backend, store=store, rank=0,
                                                 world_size=1, timeout=timeout)
        _ERROR_STORE[0] = torch.distributed.PrefixStore("nemo_msa/reported", store)
        owns = True
        _OWNED["process_group"] = True
    if on_cpu and "OMP_NUM_THREADS" not in os.environ and _THREADS_BEFORE[0] is None:
        # torchrun sets OMP_NUM_THREADS=1 for several processes; a user's value is kept too.
        _THREADS_BEFORE[0] = torch.get_num_threads()
        torch.set_num_threads(CPU_THREADS_PER_RANK)
    if on_cpu and not _OWNED["cpu_shim"]:
        cpu_shim.install()
        cpu_extras.install()
        _OWNED["cpu_shim"] = True
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    return RunContext(torch.distributed.get_rank(), torch.distributed.get_world_size(), device,
                      on_cpu, owns)


def init_model_parallel(recipe: Recipe, ctx: RunContext) -> int:
    """Check the parallel layout and create Megatron's model-parallel groups; return DP size.

    Groups that already exist (a caller set them up) are kept as they are.

    Raises:
        RecipeError: the layout does not fit the world size, the layers or the batch.
    """
    model = recipe.model
    dp = check_parallel_layout(model, ctx.world_size, recipe.train.global_batch_size,
                               recipe.train.micro_batch_size, int(model.get("num_layers", 1)))
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=int(model.get("tensor_model_parallel_size", 1)),
            pipeline_model_parallel_size=int(model.get("pipeline_model_parallel_size", 1)),
            virtual_pipeline_model_parallel_size=model.get(
                "virtual_pipeline_model_parallel_size"),
            context_parallel_size=int(model.get("context_parallel_size", 1)),
            distributed_timeout_minutes=recipe.dist.timeout_minutes,
        )
    return dp


def set_seeds(seed: int) -> None:
    """Seed like Megatron-LM: a different stream per pipeline stage, the TP tracker from seed."""
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def first_to_report(text: str) -> bool:
    """Whether this rank is the first of the job to report ``text`` (an ``error:`` line).

    Every rank that stops on an error asks; the ranks that reach the same verdict (a recipe
    error, a checkpoint that cannot be resumed, a non-finite loss) print it once, and an error
    that only some ranks meet (a file missing on one node, memory) is still printed where it
    happens. Decided in the rendezvous store of the process group started here, which needs no
    collective (the other ranks may be anywhere); without one (no group started here, or its
    store gone with rank 0), by the launcher's ``RANK``: every rank parses the same command line.
    """
    store = _ERROR_STORE[0]
    if store is not None:
        try:
            # The run is ending: a store that stopped answering must not hold the exit up for
            # the process group's timeout.
            store.set_timeout(datetime.timedelta(seconds=30))
            return store.add(hashlib.sha256(text.encode()).hexdigest(), 1) == 1
        except (RuntimeError, OSError):  # DistStoreError and timeouts are RuntimeErrors
            pass
    return os.environ.get("RANK", "0") == "0"


def teardown() -> None:
    """Undo what :func:`init_distributed` and :func:`init_model_parallel` set up here.

    A process group or shim that existed before the run is left alone.
    """
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if _OWNED["process_group"] and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if _OWNED["cpu_shim"]:
        cpu_shim.uninstall()
        cpu_extras.uninstall()
    _OWNED.update(process_group=False, cpu_shim=False)
    _ERROR_STORE[0] = None
    if _DETERMINISM[0] is not None:
        determinism.restore(_DETERMINISM[0])
        _DETERMINISM[0] = None
    if _THREADS_BEFORE[0] is not None:
        torch.set_num_threads(_THREADS_BEFORE[0])
        _THREADS_BEFORE[0] = None


__all__ = ["CPU_THREADS_PER_RANK", "RunContext", "first_to_report", "init_distributed",
           "init_model_parallel", "set_seeds", "teardown"]
