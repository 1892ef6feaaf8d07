"""Evaluation on the validation split, Megatron-style, plus the loop's per-step extras.

:class:`Evaluator` runs ``train.eval_iters`` global batches of the validation split of
``dataset.split`` every ``train.eval_interval`` steps and after the last step of the run, through
the same ``get_forward_backward_func()`` schedule as training with ``forward_only=True`` under
``torch.no_grad()`` (so every parallel layout evaluates as it trains), the chunks in eval mode.
It reports ``val_loss``, ``val_ppl`` and the validation loss per position bucket within the
document (``val_loss/pos_<lo>-<hi>``): positions come from the document map, so a token's
bucket is how much of its document precedes it in the row, which is where long-range use of
attention shows. With ``train.eval_copy_marker`` it also reports ``val_loss/copy``: the loss
of the tokens after their document's second marker (the second copy of a copy document), the
long-range recall a model can only do by attending back to the first copy. Every evaluation
reads the same first ``eval_iters * global_batch_size`` validation samples, so values at
different steps (and of different runs) are comparable. With ``train.eval_probes`` it also runs
the retrieval probes of :mod:`nemo_msa.training.probes` (passkey per depth, MQAR per distance;
rows built once from the validation split) and reports ``probe/<kind>_acc/<bucket>`` and
``probe/<kind>_loss/<bucket>``; they are split over data-parallel ranks and context-parallel
ranks (each CP rank scores the positions it holds) like the validation rows.

:class:`StepFlops` counts each step's model FLOPs (:mod:`nemo_msa.training.flops`) and turns
them into TFLOP/s per GPU and MFU. :func:`should_exit` is the ``train.exit_duration_in_mins``
check. The loop calls these three; they hold no other loop state.
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from nemo_msa.context_parallel import split_for_context_parallel
from nemo_msa.megatron.microbatch import SharedMicrobatchIterators
from nemo_msa.training.data import (
    Microbatch,
    MicrobatchSource,
    build_gpt_datasets,
    collate,
    eod_token_id,
    positions_from_document_ids,
    schedule_shape,
)
from nemo_msa.training.flops import FlopsModel, device_peak_flops, throughput
from nemo_msa.training.msa_hooks import TrainingHooks
from nemo_msa.training.probes import (
    ProbeSet,
    ProbeSettings,
    build_probes,
    probe_metrics,
    score_positions,
)
from nemo_msa.training.recipe import Recipe, RecipeError


def position_bucket_edges(seq_length: int) -> list[int]:
    """Lower edges of the position buckets: 0, b, 4b, 16b, ... below ``seq_length``.

    ``b`` is 1024 for rows of 4096 tokens or more (buckets [0, 1k), [1k, 4k), [4k, 16k), ...);
    shorter rows get ``b`` = the power of two at or below ``seq_length / 16`` so that tiny runs
    still have three or more buckets.
    """
    base = 1024 if seq_length >= 4096 else 1 << max(0, int(math.log2(max(seq_length // 16, 1))))
    edges, edge = [0], base
    while edge < seq_length:
        edges.append(edge)
        edge *= 4
    return edges


def _label(value: int) -> str:
    return f"{value // 1024}k" if value and value % 1024 == 0 else str(value)


def bucket_names(edges: list[int], seq_length: int) -> list[str]:
    """``pos_<lo>-<hi>`` per bucket (k = 1024)."""
    highs = [*edges[1:], seq_length]
    return [f"pos_{_label(lo)}-{_label(hi)}" for lo, hi in zip(edges, highs, strict=True)]


def after_second_marker(tokens: torch.Tensor, positions: torch.Tensor,
                        marker: int) -> torch.Tensor:
    """Which tokens lie at or after the second ``marker`` of their document, within the row.

    Args:
        tokens: ``[b, S]`` int64, the row's input tokens.
        positions: ``[b, S]`` int64, each token's position in its document within the row
            (0 where a document starts or a row cuts it).
        marker: the marker token id.

    Returns:
        ``[b, S]`` bool. The loss at such a position predicts the next token of a second copy.
    """
    counts = torch.cumsum((tokens == marker).to(torch.int64), dim=1)
    # Markers before the document's first token in the row: counts one column left of it.
    before = torch.nn.functional.pad(counts, (1, 0))
    start = torch.arange(tokens.shape[1], device=tokens.device) - positions
    return counts - torch.gather(before, 1, start) >= 2


def _eval_loss_func(loss_mask, bucket, num_buckets, copies, output_tensor):
    """LM loss sum and tokens, plus [2, buckets + 1] sums and counts (the last column: the
    second-copy tokens, zero without a marker), in Megatron's 3-tuple form."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    per = torch.zeros(2, num_buckets + 1, dtype=torch.float32, device=losses.device)
    per[0, :num_buckets].scatter_add_(0, bucket, (losses * mask).detach())
    per[1, :num_buckets].scatter_add_(0, bucket, mask)
    if copies is not None:
        per[0, num_buckets] = torch.sum(losses.detach() * mask * copies)
        per[1, num_buckets] = torch.sum(mask * copies)
    report = torch.cat([torch.stack([loss.detach(), num_tokens.detach().float()]),
                        per.view(-1)])
    return loss, num_tokens, {"val": report}


def _eval_forward_step(hooks: TrainingHooks, edges, marker, data_iterator, model):
    mb = next(data_iterator)
    output = model(**hooks.forward_arguments(mb))
    pos = positions_from_document_ids(mb.packed_seq_ids)  # global [b, S]
    # The second-copy group needs the whole row's tokens (the recipe allows it only with CP = 1).
    copies = (None if marker is None
              else after_second_marker(mb.tokens, pos, marker).reshape(-1).float())
    if mb.cp_size > 1:  # this CP rank's columns, as its tokens and losses
        pos = split_for_context_parallel(pos, 1, mb.cp_size, ps.get_context_parallel_rank())
    pos = pos.reshape(-1)
    bucket = torch.bucketize(pos, edges, right=True) - 1
    return output, partial(_eval_loss_func, mb.loss_mask, bucket, edges.numel(), copies)


def _probe_loss_func(labels, group, num_groups, vocab_size, output_tensor):
    """Probe sums of one microbatch from its logits, in Megatron's 3-tuple form.

    ``output_tensor`` is the model's logits [b, s, V / TP] (this CP rank's columns); only the
    scored positions are gathered over the tensor-parallel ranks and scored.
    """
    sel = group >= 0
    picked = output_tensor[sel]
    if ps.get_tensor_model_parallel_world_size() > 1:
        picked = gather_from_tensor_model_parallel_region(picked)
    report = score_positions(picked, labels[sel], group[sel], num_groups, vocab_size)
    zero = torch.zeros((), dtype=torch.float32, device=output_tensor.device)
    return zero, torch.ones((), dtype=torch.int, device=output_tensor.device), \
        {"probe": report.view(-1)}


def _probe_forward_step(hooks: TrainingHooks, num_groups, vocab_size, data_iterator, model):
    mb, group = next(data_iterator)
    output = model(**hooks.forward_arguments(mb, labels=False))
    return output, partial(_probe_loss_func, mb.labels, group, num_groups, vocab_size)


def probe_microbatches(probes: ProbeSet, *, micro_batch_size: int, dp_size: int, dp_rank: int,
                       cp_size: int, cp_rank: int, pp_size: int, eod_id: int,
                       device: torch.device) -> list[tuple[Microbatch, torch.Tensor]]:
    """This rank's probe microbatches, built once.

    The rows are padded (with copies of row 0 that score nothing) to a multiple of
    ``micro_batch_size * dp_size * pp_size`` so that every rank runs the same number of
    microbatches (interleaved pipelines need a multiple of the pipeline size); microbatch ``m``
    of data-parallel rank ``r`` holds rows ``(m * dp + r) * mbs`` onward, as the training
    sampler. Under context parallelism the rows and the bucket map are split into this rank's
    load-balanced columns, as :func:`nemo_msa.training.data.collate` splits tokens.

    Returns:
        ``(microbatch, group)`` per microbatch: the Microbatch of ``mbs`` rows and the int64
        ``[mbs, S / CP]`` bucket map of its labels (-1: not scored), on ``device``.
    """
    n, step = probes.rows, micro_batch_size * dp_size * pp_size
    pad = -n % step
    idx = torch.cat([torch.arange(n), torch.zeros(pad, dtype=torch.int64)])
    group = probes.group.clone()
    group = torch.cat([group, torch.full((pad, group.shape[1]), -1, dtype=torch.int64)])
    out = []
    for m in range((n + pad) // (micro_batch_size * dp_size)):
        start = (m * dp_size + dp_rank) * micro_batch_size
        rows = range(start, start + micro_batch_size)
        samples = [{"tokens": probes.tokens[idx[i]], "labels": probes.labels[idx[i]],
                    "loss_mask": torch.ones(probes.tokens.shape[1])} for i in rows]
        mb = collate(samples, eod_id, device, True, cp_size, cp_rank)
        g = split_for_context_parallel(group[start:start + micro_batch_size], 1, cp_size,
                                       cp_rank)
        out.append((mb, g.to(device)))
    return out


class Evaluator:
    """Validation-loss evaluation of the model chunks (collective: every rank calls it).

    Args:
        recipe: the validated recipe (train.eval_interval / eval_iters, dataset, model).
        ctx: the run context (device).
        hooks: the loop's MSA or dense-GPT hooks (the model's forward arguments).
        chunks: this rank's DDP-wrapped model chunks.
        forward_backward: Megatron's schedule function.
        dp: data-parallel size.
    """

    def __init__(self, recipe: Recipe, ctx, hooks: TrainingHooks, chunks: list, forward_backward,
                 dp: int):
        train = recipe.train
        self.recipe, self.hooks, self.chunks = recipe, hooks, chunks
        self.forward_backward = forward_backward
        self.device = ctx.device
        self.interval = train.eval_interval
        self.iters = train.eval_iters
        self.edges_list = position_bucket_edges(recipe.gpt.seq_length)
        self.names = bucket_names(self.edges_list, recipe.gpt.seq_length)
        self.edges = torch.tensor(self.edges_list, dtype=torch.int64, device=ctx.device)
        self.dataset = None
        self.dp = dp
        self.last_evaluated: int | None = None
        self.seconds = 0.0
        self.probes: ProbeSet | None = None
        self.probe_batches: list = []
        if self.interval:
            _, self.dataset = build_gpt_datasets(
                recipe.dataset, recipe.gpt, train.seed, train.train_iters * train.global_batch_size,
                self.iters * train.global_batch_size)
            if self.dataset is None:
                raise RecipeError(
                    f"recipe key 'dataset.split' = {recipe.dataset.split!r}: the validation split "
                    f"is empty, but train.eval_interval = {self.interval} asks for evaluation "
                    "(expected a non-zero second weight, e.g. '98,2,0', or "
                    "train.eval_interval=null)")
            if train.eval_probes:
                eod = eod_token_id(recipe.dataset, recipe.gpt)
                seq = recipe.gpt.seq_length
                self.probes = build_probes(self.dataset, ProbeSettings.from_train(train, seq),
                                           seq, eod)
                vpp = recipe.model.get("virtual_pipeline_model_parallel_size")
                self.probe_batches = probe_microbatches(
                    self.probes, micro_batch_size=train.micro_batch_size, dp_size=dp,
                    dp_rank=ps.get_data_parallel_rank(),
                    cp_size=ps.get_context_parallel_world_size(),
                    cp_rank=ps.get_context_parallel_rank(),
                    pp_size=ps.get_pipeline_model_parallel_world_size() if vpp else 1,
                    eod_id=eod, device=self.device)

    @property
    def enabled(self) -> bool:
        """Whether this run evaluates (an interval set and a non-empty validation split)."""
        return self.dataset is not None

    def due(self, iteration: int) -> bool:
        """Whether the step just finished is an evaluation step."""
        return self.enabled and iteration % self.interval == 0

    def final_due(self, iteration: int) -> bool:
        """Whether the run's end still needs its final evaluation."""
        return self.enabled and self.last_evaluated != iteration and iteration > 0

    def run(self, iteration: int) -> dict[str, float]:
        """Evaluate now; return ``val_loss``, ``val_ppl``, ``val_loss/pos_*``, with a copy
        marker ``val_loss/copy`` and with probes ``probe/*`` (all ranks)."""
        t0 = time.perf_counter()
        train = self.recipe.train
        source = MicrobatchSource(
            self.dataset, micro_batch_size=train.micro_batch_size,
            global_batch_size=train.global_batch_size, dp_size=self.dp,
            dp_rank=ps.get_data_parallel_rank(),
            eod_id=eod_token_id(self.recipe.dataset, self.recipe.gpt), device=self.device,
            reset_position_ids=self.recipe.dataset.reset_position_ids,
            cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
            packed_format=self.recipe.dataset.packed_format)
        nb = len(self.edges_list)
        buf = torch.zeros(2 + 2 * (nb + 1), dtype=torch.float64, device=self.device)
        owner = (ps.is_pipeline_last_stage(ignore_virtual=True)
                 and ps.get_tensor_model_parallel_rank() == 0)
        for m in self.chunks:
            m.eval()
        try:
            with torch.no_grad():
                for _ in range(self.iters):
                    shared = SharedMicrobatchIterators(iter(source.step_microbatches()),
                                                       len(self.chunks))
                    iterators = shared.iterators()
                    seq, mbs = schedule_shape(self.recipe.gpt.seq_length, train.micro_batch_size,
                                              self.recipe.dataset.packed_format)
                    reports = self.forward_backward(
                        forward_step_func=partial(_eval_forward_step, self.hooks, self.edges,
                                                  train.eval_copy_marker),
                        data_iterator=iterators if len(self.chunks) > 1 else iterators[0],
                        model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                        num_microbatches=source.num_microbatches, seq_length=seq,
                        micro_batch_size=mbs, decoder_seq_length=seq, forward_only=True)
                    if owner:
                        for r in reports:
                            buf += r["val"].to(buf)
                probe_sums = self._run_probes(owner)
        finally:
            for m in self.chunks:
                m.train()
        torch.distributed.all_reduce(buf)
        values = buf.tolist()
        loss = values[0] / max(values[1], 1.0)
        out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
        sums, counts = values[2:3 + nb], values[3 + nb:]
        for name, total, count in zip([*self.names, "copy"], sums, counts, strict=True):
            if count > 0:
                out[f"val_loss/{name}"] = total / count
        if probe_sums is not None:
            torch.distributed.all_reduce(probe_sums)
            out.update(probe_metrics(probe_sums.tolist(), self.probes.names))
        self.last_evaluated = iteration
        self.seconds += time.perf_counter() - t0
        return out


    def _run_probes(self, owner: bool) -> torch.Tensor | None:
        """This rank's probe sums, float64 [3 * G] (zeros off the owner ranks); None: no probes.

        Called inside :meth:`run` (eval mode, no_grad); collective over the model-parallel group.
        """
        if self.probes is None:
            return None
        g = len(self.probes.names)
        sums = torch.zeros(3 * g, dtype=torch.float64, device=self.device)
        train, seq = self.recipe.train, self.recipe.gpt.seq_length
        shared = SharedMicrobatchIterators(iter(self.probe_batches), len(self.chunks))
        iterators = shared.iterators()
        reports = self.forward_backward(
            forward_step_func=partial(_probe_forward_step, self.hooks, g,
                                      self.recipe.gpt.vocab_size),
            data_iterator=iterators if len(self.chunks) > 1 else iterators[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(self.probe_batches), seq_length=seq,
            micro_batch_size=train.micro_batch_size, decoder_seq_length=seq,
            forward_only=True)
        if owner:
            for r in reports:
                sums += r["probe"].to(sums)
        return sums


class StepFlops:
    """Model FLOPs per step and TFLOP/s per GPU (MFU on a GPU with a known bf16 peak).

    Every rank of a model replica sees the same microbatches; each counts its replica's FLOPs
    from the document map and divides by the model-parallel size (TP x PP x CP), so the figure
    is this GPU's share of its replica's work.
    """

    def __init__(self, recipe: Recipe, config, device: torch.device):
        tp = ps.get_tensor_model_parallel_world_size()
        divisor = recipe.gpt.make_vocab_size_divisible_by * tp
        padded = int(math.ceil(recipe.gpt.vocab_size / divisor) * divisor)
        self.model = FlopsModel.from_config(config, padded)
        self.gpus = (tp * ps.get_pipeline_model_parallel_world_size()
                     * ps.get_context_parallel_world_size())
        self.peak = device_peak_flops(device)
        self.total_flops = 0.0

    def count(self, microbatches: list, phase: str) -> float:
        """This replica's FLOPs of the step whose microbatches these are."""
        flops = self.model.step_flops([mb.packed_seq_ids for mb in microbatches],
                                      warmup=phase == "dense-warmup")
        self.total_flops += flops
        return flops

    def metrics(self, flops: float, seconds: float) -> dict[str, float]:
        """``model_tflops_per_step``, ``tflops_per_gpu`` and ``mfu`` (GPU with a known peak)."""
        return throughput(flops, seconds, self.gpus, self.peak)

    def summary(self, seconds: float) -> dict[str, str | float]:
        """Mean TFLOP/s per GPU (and MFU, naming the peak used) over the run's steps."""
        out: dict[str, str | float] = {}
        if seconds <= 0:
            return out
        t = self.metrics(self.total_flops, seconds)
        out["TFLOP/s per GPU"] = t["tflops_per_gpu"]
        if "mfu" in t:
            out["MFU"] = f"{t['mfu']:.4f} of {self.peak[1] / 1e12:.0f} TFLOP/s dense bf16 " \
                         f"({self.peak[0]})"
        return out


def should_exit(started: float, minutes: float | None, device: torch.device) -> bool:
    """``train.exit_duration_in_mins``: rank 0's clock decides for every rank (collective)."""
    if not minutes:
        return False
    flag = torch.tensor([float(time.perf_counter() - started >= minutes * 60.0)],
                        device=device)
    torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())


__all__ = ["Evaluator", "StepFlops", "bucket_names", "position_bucket_edges", "should_exit"]
