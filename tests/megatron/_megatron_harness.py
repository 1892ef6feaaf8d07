"""Shared pieces of the Megatron tests: tiny MSA GPT models, packed batches, gloo workers.

Multi-rank tests start ``world_size`` processes (forked from a server that imported torch and
Megatron once: tests/_rank_processes.py) on localhost with gloo; each installs
nemo_msa.megatron.cpu_shim, initializes Megatron's parallel state, runs a function of this module
and returns a picklable result through a queue.
"""

from __future__ import annotations

import io
import os
import tempfile
import traceback
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from _rank_processes import rank_context

VOCAB = 96
SEQ = 128
MICRO_BATCH = 2
#: Full activation recompute, one layer per checkpoint (ADR 0028: selection replay).
FULL_RECOMPUTE = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
)


def tiny_config(**overrides):
    """A tiny MSA GPT config (fp32, local backend, CPU) with a mixed S/D pattern."""
    from nemo_msa.megatron import MSATransformerConfig, cpu_shim

    fields = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        transformer_impl="local",
        attention_dropout=0.0,
        hidden_dropout=0.0,
        pipeline_dtype=torch.float32,
        msa_index_head_dim=32,
        msa_block_size=16,
        msa_topk=3,
        msa_layer_pattern="SDSS",
        msa_indexer_loss_query_chunk=64,
        **cpu_shim.cpu_config_overrides(),
    )
    fields.update(overrides)
    return MSATransformerConfig(**fields)


def build_model_chunks(config, seed: int = 1234) -> list:
    """The GPTModel chunks of this rank (one per virtual stage), seeded identically everywhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from layer_specs import get_msa_decoder_block_spec

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    torch.manual_seed(seed)
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunks.append(
            GPTModel(
                config,
                get_msa_decoder_block_spec(config, vp_stage=stage),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                pre_process=pre,
                post_process=post,
                position_embedding_type="rope",
                rotary_percent=0.5,
                rotary_base=5_000_000,
                share_embeddings_and_output_weights=False,
                vp_stage=stage,
            )
        )
    return chunks


def packed_batches(count: int, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """Microbatches of packed documents with random boundaries and some tail padding."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
        ids = torch.zeros(MICRO_BATCH, SEQ, dtype=torch.int64)
        for row in range(MICRO_BATCH):
            cuts = sorted(torch.randint(8, SEQ - 8, (2,), generator=generator).tolist())
            pad = int(torch.randint(0, 12, (1,), generator=generator))
            bounds = [0, cuts[0], max(cuts[1], cuts[0] + 1), SEQ - pad]
            for doc in range(3):
                ids[row, bounds[doc] : bounds[doc + 1]] = row * 3 + doc + 1
        labels = torch.roll(tokens, -1, dims=1)
        loss_mask = (ids > 0).float()
        batches.append(
            {"tokens": tokens, "labels": labels, "packed_seq_ids": ids, "loss_mask": loss_mask}
        )
    return batches


def forward_step(data_iterator, model):
    """Megatron forward_step_func: document map in attention_mask, masked mean LM loss."""
    batch = next(data_iterator)
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    output = model(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"]
        loss = (output_tensor.float() * mask).sum() / mask.sum()
        # clone: the schedule divides the returned loss in place by the microbatch count.
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def run_schedule(chunks: list, batches: list, shared: bool = True) -> list[float]:
    """Forward+backward of all microbatches through Megatron's schedule; returns the losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nemo_msa.megatron import SharedMicrobatchIterators

    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    if shared:
        iterators = SharedMicrobatchIterators(iter(batches), num_chunks=len(chunks)).iterators()
    else:
        # Negative control: every chunk reads its own copy of each batch.
        iterators = [iter([{k: v.clone() for k, v in b.items()} for b in batches]) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    return [float(item["lm loss"]) for item in losses]


def global_parameter_name(chunk, name: str) -> str:
    """Renames ``decoder.layers.<local>.`` to the global layer index (pipeline-independent)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = chunk.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
    return ".".join(parts)


def deterministic_init(chunks: list) -> None:
    """Re-initializes every parameter from a generator seeded by its global name.

    Pipeline stages build different subsets of the model, so the default generator would give
    them different weights; this makes every parallel layout hold the same full model (each
    tensor-parallel rank keeps its contiguous slice along the partition dim, as Megatron's
    use_cpu_initialization does).
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                key = global_parameter_name(chunk, name)
                generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                shape = list(param.shape)
                sharded = tp > 1 and getattr(param, "tensor_model_parallel", False)
                if sharded:
                    shape[param.partition_dim] *= tp
                full = torch.randn(shape, generator=generator, dtype=torch.float32)
                scale = 0.02 if param.dim() > 1 else 0.1
                full = full * scale
                if param.dim() == 1 and "norm" in key and "index_" not in key:
                    full = full + 1.0  # torch RMSNorm weight: around 1
                if sharded:
                    full = full.chunk(tp, dim=param.partition_dim)[tp_rank]
                param.copy_(full.to(param.dtype))


def full_gradients(chunks: list) -> dict[str, torch.Tensor]:
    """Gradients by global name, TP shards all-gathered along their partition dim."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(tp_group)
    out = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            grad = param.grad
            if grad is None:
                grad = torch.zeros_like(param)
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(grad) for _ in range(tp)]
                torch.distributed.all_gather(parts, grad.contiguous(), group=tp_group)
                grad = torch.cat(parts, dim=param.partition_dim)
            out[global_parameter_name(chunk, name)] = grad.detach().clone()
    return out


def _worker(
    rank: int, world_size: int, rendezvous: str, fn_name: str, kwargs: dict, queue
) -> None:
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        from nemo_msa.megatron import cpu_shim

        cpu_shim.install()
        cpu_shim.init_gloo_process_group(rank, world_size, rendezvous)
        result = globals()[fn_name](rank=rank, world_size=world_size, **kwargs)
        # As bytes: a tensor sent as is travels as a shared-memory handle that its sender must
        # outlive, and a rank that finishes first exits before the parent reads it.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report every failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        except Exception:
            pass
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def several_workers(rank: int, world_size: int, jobs: dict[str, tuple[str, dict]]) -> dict:
    """``{key: worker(rank=, world_size=, **kwargs)}`` for ``jobs = {key: (worker name,
    kwargs)}``, one after another in the same ranks: one start of the ranks (a process group
    and its rendezvous) serves several workers. Every worker sets its parallel state up and
    destroys it again."""
    return {key: globals()[name](rank=rank, world_size=world_size, **kwargs)
            for key, (name, kwargs) in jobs.items()}


def spawn(fn: Callable, world_size: int, timeout: float = 240.0, **kwargs) -> dict[int, Any]:
    """Runs ``fn(rank=, world_size=, **kwargs)`` on ``world_size`` gloo ranks; rank -> result.

    Raises:
        RuntimeError: with the failing rank's traceback.
    """
    context = rank_context()
    queue = context.Queue()
    scratch = tempfile.TemporaryDirectory(prefix="gloo-rendezvous-")
    rendezvous = os.path.join(scratch.name, "store")
    processes = [
        context.Process(
            target=_worker, args=(rank, world_size, rendezvous, fn.__name__, kwargs, queue)
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    try:
        for _ in processes:
            rank, status, payload = queue.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        scratch.cleanup()
    return results


@contextmanager
def count_selections() -> Iterator[dict]:
    """Counts the block selections (scoring passes) of MSA layers inside the block, and the most
    selection-replay entries one layer held at once (> 1: microbatches interleaved on it)."""
    from nemo_msa.megatron import msa_attention
    from nemo_msa.megatron.selection_replay import SelectionReplay

    counts = {"selections": 0, "max_in_flight": 0}
    select, record = msa_attention.select, SelectionReplay.record

    def counting_select(*args, **kwargs):
        counts["selections"] += 1
        return select(*args, **kwargs)

    def counting_record(store, anchor, entry):
        record(store, anchor, entry)
        counts["max_in_flight"] = max(counts["max_in_flight"], len(store))

    msa_attention.select, SelectionReplay.record = counting_select, counting_record
    try:
        yield counts
    finally:
        msa_attention.select, SelectionReplay.record = select, record


def pending_replay_entries(chunks: list) -> int:
    """Selection-replay entries still held by the chunks' MSA layers."""
    from nemo_msa.megatron import SelectionReplay

    return sum(len(m) for c in chunks for m in c.modules() if isinstance(m, SelectionReplay))


# ---------------------------------------------------------------------- rank functions
def train_step_worker(
    rank: int,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    num_microbatches: int = 4,
    shared: bool = True,
    config_overrides: dict | None = None,
) -> dict:
    """One forward/backward of ``num_microbatches`` at (TP, PP, VPP); losses, grads, counts."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_msa import MSAMicrobatch
    from nemo_msa.megatron import MSAIndexerLossAutoScaler, MSAIndexerMetrics

    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(0)
    config = tiny_config(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        **(config_overrides or {}),
    )
    chunks = build_model_chunks(config)
    deterministic_init(chunks)
    batches = packed_batches(num_microbatches)
    MSAIndexerLossAutoScaler.reset()
    MSAIndexerMetrics.reset()
    builds_before = MSAMicrobatch.num_builds()
    with count_selections() as counts:
        losses = run_schedule(chunks, batches, shared=shared)
    builds = MSAMicrobatch.num_builds() - builds_before
    metrics = MSAIndexerMetrics.pop(num_layers=config.num_layers)
    grads = full_gradients(chunks)
    return {
        "losses": losses,
        "builds": builds,
        **counts,
        "pending_replay": pending_replay_entries(chunks),
        "metrics": metrics,
        "grads": grads if ps.get_tensor_model_parallel_rank() == 0 else {},
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
    }


PARALLEL_LAYOUTS = {
    # name: (tp, pp, vpp, shared data iterators, config overrides)
    "tp1": (1, 1, None, True, {}),
    "tp2": (2, 1, None, True, {}),
    "pp2": (1, 2, None, True, {}),
    "pp2_vpp2": (1, 2, 2, True, {}),
    "pp2_vpp2_unshared": (1, 2, 2, False, {}),
    "pp2_vpp2_full_recompute": (1, 2, 2, True, FULL_RECOMPUTE),
    "tp1_sparse_loss": (1, 1, None, True, {"msa_indexer_loss_type": "sparse"}),
    "tp2_sparse_loss": (2, 1, None, True, {"msa_indexer_loss_type": "sparse"}),
}


def parallel_suite_worker(rank: int, world_size: int, names: list[str]) -> dict:
    """Runs several parallel layouts one after the other in one set of processes.

    The model-parallel state is re-initialized per layout; ranks not used by a layout's TP x PP
    act as data-parallel replicas (no gradient reduction, so they compute the same thing).
    """
    from megatron.core import parallel_state as ps

    results = {"sequence_parallel": sequence_parallel_worker(rank, world_size)}
    ps.destroy_model_parallel()
    for name in names:
        tp, pp, vpp, shared, overrides = PARALLEL_LAYOUTS[name]
        results[name] = train_step_worker(
            rank, world_size, tp=tp, pp=pp, vpp=vpp, shared=shared, config_overrides=overrides
        )
        ps.destroy_model_parallel()
    return results


def full_parameters(chunks: list) -> dict[str, torch.Tensor]:
    """Parameters by global name, TP shards all-gathered along their partition dim."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(tp_group)
    out = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            value = param.detach()
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(value) for _ in range(tp)]
                torch.distributed.all_gather(parts, value.contiguous(), group=tp_group)
                value = torch.cat(parts, dim=param.partition_dim)
            out[global_parameter_name(chunk, name)] = value.clone()
    return out


def checkpoint_worker(
    rank: int, world_size: int, directions: list[tuple[int, int]], path: str
) -> dict:
    """For each (save_tp, load_tp): save an MSA GPT at TP=save_tp with dist-checkpointing,
    reload it into a differently seeded model at TP=load_tp, compare parameters and losses."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    batches = packed_batches(2, seed=11)

    def evaluate(chunk) -> list[float]:
        chunk.eval()
        with torch.no_grad():
            losses = []
            for batch in batches:
                out = chunk(
                    batch["tokens"],
                    torch.arange(SEQ).expand(MICRO_BATCH, SEQ),
                    batch["packed_seq_ids"],
                    labels=batch["labels"],
                )
                mask = batch["loss_mask"]
                losses.append(float((out.float() * mask).sum() / mask.sum()))
        return losses

    results = {}
    for index, (save_tp, load_tp) in enumerate(directions):
        directory = os.path.join(path, f"{index}_tp{save_tp}_to_tp{load_tp}")
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
        torch.distributed.barrier()
        ps.initialize_model_parallel(save_tp, 1)
        model_parallel_cuda_manual_seed(1234)
        (model,) = build_model_chunks(tiny_config(tensor_model_parallel_size=save_tp), seed=5)
        deterministic_init([model])
        saved_losses = evaluate(model)
        saved = full_parameters([model])
        dist_checkpointing.save(model.sharded_state_dict(), directory)
        torch.distributed.barrier()
        ps.destroy_model_parallel()

        ps.initialize_model_parallel(load_tp, 1)
        model_parallel_cuda_manual_seed(4321)
        (fresh,) = build_model_chunks(tiny_config(tensor_model_parallel_size=load_tp), seed=99)
        before = full_parameters([fresh])
        state = dist_checkpointing.load(fresh.sharded_state_dict(), directory)
        fresh.load_state_dict(state)
        loaded = full_parameters([fresh])
        results[(save_tp, load_tp)] = {
            "saved": saved_losses,
            "loaded": evaluate(fresh),
            "param_diff": max(float((loaded[k] - saved[k]).abs().max()) for k in saved),
            "param_names": sorted(saved) == sorted(loaded),
            "before_diff": min(
                float((before[k] - saved[k]).abs().max()) for k in saved if ".indexer." in k
            ),
            "indexer_params": len([k for k in saved if ".indexer." in k]),
        }
        ps.destroy_model_parallel()
    return results


def sequence_parallel_worker(rank: int, world_size: int) -> dict:
    """One MSA attention layer at TP=2 with and without sequence parallelism, same weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from layer_specs import get_msa_self_attention_spec

    ps.initialize_model_parallel(world_size, 1)
    model_parallel_cuda_manual_seed(1234)
    batch = packed_batches(1, seed=21)[0]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(SEQ, MICRO_BATCH, 64, generator=generator)
    rotary = torch.randn(SEQ, 1, 1, 16, generator=generator)
    outputs = {}
    for sp in (False, True):
        config = tiny_config(tensor_model_parallel_size=world_size, sequence_parallel=sp)
        spec = get_msa_self_attention_spec(config, sparse=True, transformer_impl="local")
        layer = build_module(spec, config=config, layer_number=1)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                full_shape = list(param.shape)
                sharded = getattr(param, "tensor_model_parallel", False)
                if sharded:
                    full_shape[param.partition_dim] *= world_size
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                full = torch.randn(full_shape, generator=gen) * 0.05
                if sharded:
                    full = full.chunk(world_size, dim=param.partition_dim)[rank]
                param.copy_(full)
        x = hidden.clone()
        if sp:
            x = x.chunk(world_size, dim=0)[rank].contiguous()
        x.requires_grad_(True)
        out, bias = layer(x, batch["packed_seq_ids"], rotary_pos_emb=rotary)
        if bias is not None:
            out = out + bias
        full_out = out
        if sp:
            parts = [torch.empty_like(out) for _ in range(world_size)]
            torch.distributed.all_gather(parts, out.contiguous())
            full_out = torch.cat(parts, dim=0)
        # With SP each rank back-propagates its own rows; without, every rank the whole output.
        (out.square().sum() if sp else full_out.square().sum()).backward()
        grads = {}
        for name, param in layer.named_parameters():
            grad = param.grad.clone()
            if sp and getattr(param, "sequence_parallel", False):
                # What Megatron's finalize_model_grads does for SP-replicated parameters.
                torch.distributed.all_reduce(grad)
            grads[name] = grad
        outputs[sp] = {"out": full_out.detach(), "grads": grads}
    return {
        "out_diff": float((outputs[True]["out"] - outputs[False]["out"]).abs().max()),
        "out_scale": float(outputs[False]["out"].abs().max()),
        "indexer_grad_diff": max(
            float((outputs[True]["grads"][n] - g).abs().max())
            for n, g in outputs[False]["grads"].items()
            if n.startswith("indexer.")
        ),
        "grad_diff": max(
            float((outputs[True]["grads"][n] - g).abs().max())
            for n, g in outputs[False]["grads"].items()
        ),
        "grad_scale": max(float(g.abs().max()) for g in outputs[False]["grads"].values()),
        "indexer_grads": len([n for n in outputs[True]["grads"] if n.startswith("indexer.")]),
    }


# ---------------------------------------------------------------------- context parallelism
CP_VARIANTS = {
    # name: config overrides (every variant logs the exact recall: sample rows >= tokens)
    "dense_loss": {},
    "sparse_loss": {"msa_indexer_loss_type": "sparse"},
    "warmup": {"msa_dense_warmup_steps": 100},
    "sparse_loss_full_recompute": {"msa_indexer_loss_type": "sparse", **FULL_RECOMPUTE},
}


def _cp_step(chunk, batch: dict, cp_size: int, cp_rank: int, local_ids: bool) -> dict:
    """One forward/backward of ``chunk`` on this rank's share of ``batch``: the LM loss summed
    over local tokens divided by the GLOBAL token count (so the ranks' losses add up to the
    unsplit mean), the indexer loss attached by the layers."""
    from nemo_msa import MSAMicrobatch
    from nemo_msa.context_parallel import split_for_context_parallel

    builds = MSAMicrobatch.num_builds()

    def split(x):
        return split_for_context_parallel(x, 1, cp_size, cp_rank)

    ids = split(batch["packed_seq_ids"]) if local_ids else batch["packed_seq_ids"]
    tokens, labels, mask = split(batch["tokens"]), split(batch["labels"]), split(batch["loss_mask"])
    positions = split(torch.arange(SEQ).expand(MICRO_BATCH, SEQ))
    out = chunk(tokens, positions, ids, labels=labels)  # [b, s_local] per-token LM loss
    loss = (out.float() * mask).sum() / batch["loss_mask"].sum()
    loss.backward()
    return {"loss": float(loss.detach()), "per_token": out.detach(),
            "builds": MSAMicrobatch.num_builds() - builds}


def context_parallel_worker(
    rank: int, world_size: int, variants: list[str], tp: int = 1, sequence_parallel: bool = False
) -> dict:
    """Every variant at TP = tp x CP = world_size / tp, then at TP = CP = 1 (data-parallel
    replicas): losses, per-token LM losses, gradients (TP shards gathered, summed over the CP
    group as Megatron's gradient all-reduce over the data x context group does), indexer
    metrics, layout builds, this rank's CP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_msa.megatron import MSAIndexerLossAutoScaler, MSAIndexerMetrics
    from nemo_msa.megatron.phase import set_training_iteration

    results = {}
    for name in variants:
        batches = packed_batches(2, seed=5)  # new tensors: no layout memoized on them yet
        for cp in (world_size // tp, 1):
            tp_size = tp if cp > 1 else 1
            ps.initialize_model_parallel(tp_size, 1, context_parallel_size=cp)
            model_parallel_cuda_manual_seed(1234)
            config = tiny_config(context_parallel_size=cp, msa_recall_sample_rows=4096,
                                 tensor_model_parallel_size=tp_size,
                                 sequence_parallel=sequence_parallel and tp_size > 1,
                                 **CP_VARIANTS[name])
            set_training_iteration(1)
            (chunk,) = build_model_chunks(config)
            deterministic_init([chunk])
            chunk.zero_grad(set_to_none=True)
            MSAIndexerLossAutoScaler.reset()
            MSAIndexerMetrics.reset()
            cp_rank = ps.get_context_parallel_rank()
            with count_selections() as counts:
                steps = [_cp_step(chunk, batch, cp, cp_rank, local_ids=index == 1)
                         for index, batch in enumerate(batches)]
            grads = full_gradients([chunk])
            if cp > 1:
                for grad in grads.values():
                    torch.distributed.all_reduce(grad, group=ps.get_context_parallel_group())
                losses = torch.tensor([s["loss"] for s in steps], dtype=torch.float64)
                torch.distributed.all_reduce(losses, group=ps.get_context_parallel_group())
            else:
                losses = torch.tensor([s["loss"] for s in steps], dtype=torch.float64)
            results[(name, cp)] = {
                "losses": losses.tolist(),
                "per_token": [s["per_token"] for s in steps],
                "builds": [s["builds"] for s in steps],
                "grads": grads,
                "metrics": MSAIndexerMetrics.pop(num_layers=config.num_layers),
                "cp_rank": cp_rank,
                **counts,
                "pending_replay": pending_replay_entries([chunk]),
            }
            set_training_iteration(None)
            ps.destroy_model_parallel()
    return results


THD_LENGTHS = (37, 50, 30)  # padded to multiples of 4 (2 x CP) in the THD pack


def _thd_step(chunk, tokens_row: torch.Tensor, cp_size: int, cp_rank: int, cp_group) -> dict:
    """One forward/backward of a one-row pack of THD_LENGTHS as THD input (Megatron's
    PackedSeqParams, sequences padded to multiples of 2 x CP, split per sequence); returns the
    per-token LM loss of every real token in document order and the summed loss."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from nemo_msa.context_parallel import thd_load_balanced_indices

    lengths = torch.tensor(THD_LENGTHS)
    padded = (lengths + 3) // 4 * 4
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    cu_padded = torch.cat([torch.zeros(1, dtype=torch.int64), padded.cumsum(0)]).to(torch.int32)
    total = int(cu_padded[-1])
    tokens = torch.zeros(total, dtype=torch.int64)
    labels = torch.zeros(total, dtype=torch.int64)
    real = torch.zeros(total, dtype=torch.bool)
    for i, n in enumerate(THD_LENGTHS):
        start, src = int(cu_padded[i]), int(cu[i])
        tokens[start:start + n] = tokens_row[src:src + n]
        labels[start:start + n] = torch.roll(tokens_row, -1)[src:src + n]
        real[start:start + n] = True
    index = thd_load_balanced_indices(cu_padded, cp_size, cp_rank)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=int(padded.max()),
        max_seqlen_kv=int(padded.max()),
    )
    out = chunk(tokens[index][None], index[None], None, labels=labels[index][None],
                packed_seq_params=params)[0]
    mask = real[index].float()
    loss = (out.float() * mask).sum() / float(sum(THD_LENGTHS))
    loss.backward()
    full = torch.zeros(total)
    full[index] = out.detach().float()
    if cp_size > 1:
        torch.distributed.all_reduce(full, group=cp_group)
    return {"per_token": full[real], "loss": float(loss.detach())}


def thd_worker(rank: int, world_size: int) -> dict:
    """BSHD at CP=1 (one row, the documents back to back, padding at the end) against THD input
    at CP=1 and CP=world_size: per-token LM losses of the real tokens and gradients."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_msa.megatron import MSAIndexerLossAutoScaler, MSAIndexerMetrics

    generator = torch.Generator().manual_seed(3)
    tokens_row = torch.randint(0, VOCAB, (SEQ,), generator=generator)
    results = {"gather": _gather_check(rank, world_size)}
    for kind, cp in (("bshd", 1), ("thd", 1), ("thd", world_size)):
        ps.initialize_model_parallel(1, 1, context_parallel_size=cp)
        model_parallel_cuda_manual_seed(1234)
        (chunk,) = build_model_chunks(tiny_config(context_parallel_size=cp))
        deterministic_init([chunk])
        chunk.zero_grad(set_to_none=True)
        MSAIndexerLossAutoScaler.reset()
        MSAIndexerMetrics.reset()
        group = ps.get_context_parallel_group()
        if kind == "bshd":
            ids = torch.zeros(1, SEQ, dtype=torch.int64)
            start = 0
            for i, n in enumerate(THD_LENGTHS):
                ids[0, start:start + n] = i + 1
                start += n
            labels = torch.roll(tokens_row, -1)[None]
            out = chunk(tokens_row[None], torch.arange(SEQ)[None], ids, labels=labels)[0]
            loss = (out.float() * (ids[0] > 0)).sum() / float(sum(THD_LENGTHS))
            loss.backward()
            step = {"per_token": out.detach().float()[: sum(THD_LENGTHS)],
                    "loss": float(loss.detach())}
        else:
            step = _thd_step(chunk, tokens_row, cp, ps.get_context_parallel_rank(), group)
        grads = full_gradients([chunk])
        if cp > 1:
            for grad in grads.values():
                torch.distributed.all_reduce(grad, group=group)
        step["grads"] = grads
        results[(kind, cp)] = step
        ps.destroy_model_parallel()
    return results


def _gather_check(rank: int, world_size: int) -> dict:
    """gather_from_context_parallel on the world group: the forward's global tensor, and the
    gradient each rank's local rows receive when rank r back-propagates (r + 1) * weight."""
    from nemo_msa.context_parallel import (
        gather_from_context_parallel,
        gather_order,
        load_balanced_indices,
    )

    seq = 4 * world_size
    x = torch.randn(2, seq, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    local_index = load_balanced_indices(seq, world_size, rank)
    order = gather_order([load_balanced_indices(seq, world_size, r) for r in range(world_size)])
    local = x[:, local_index].clone().requires_grad_()
    gathered = gather_from_context_parallel(local, 1, torch.distributed.group.WORLD, order)
    (gathered * weight * (rank + 1)).sum().backward()
    total = sum(range(1, world_size + 1))
    return {
        "forward_error": float((gathered.detach() - x).abs().max()),
        "grad_error": float((local.grad - total * weight[:, local_index]).abs().max()),
    }
