"""Model FLOPs of a training step, counted from the model and the step's document map; MFU.

The count is Megatron's convention (2 FLOPs per multiply-add, backward = 2x forward, no
recompute counted) with attention counted as attended (ADR 0023):

- per token and layer: the QKV and output projections and the MLP (3 GEMMs when gated), x3;
- the output layer (hidden x padded vocabulary), x3; embeddings are lookups (0);
- attention of a query at document position ``p`` (0-based, within its packed document):
  ``4 * heads * head_dim * keys`` x3, with ``keys = p + 1`` for dense layers and the dense
  warm-up, and for MSA layers in the sparse phase the keys of the selected blocks:
  ``p + 1`` while the query sees at most ``top_k`` blocks, else ``(top_k - 1) * block`` full
  blocks plus the ``p % block + 1`` keys of its own block;
- MSA layers: the indexer projections (x3); the block selection, which scores every visible key
  (``2 * index_heads * index_dim * (p + 1)``, forward only) in the sparse phase and in the
  warm-up when recall is logged; and the indexer loss when it is on: the dense loss (type
  ``dense`` or the warm-up) recomputes the main attention's logits over every visible key
  (``2 * heads * head_dim * (p + 1)``, no backward: the target is detached) and the index scores
  over them (forward + backward, x3), the sparse loss only the index scores over the selected
  keys (x3; the target is a by-product of the sparse forward). The recall sample rows are not
  counted.

Padding tokens (document id 0) go through the GEMMs but attend nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nemo_msa.support import DEFAULT_TOPOLOGY
from nemo_msa.training.data import positions_from_document_ids

#: Dense bf16 tensor-core peaks (FLOP/s) from the vendors' spec sheets, by a name fragment of
#: ``torch.cuda.get_device_name()``; the SXM figures, without sparsity. MFU uses these.
BF16_PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B300": 2250e12,
    "A100": 312e12,
}


def device_peak_flops(device: torch.device) -> tuple[str, float] | None:
    """The device's name and dense bf16 peak (FLOP/s), or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment in sorted(BF16_PEAK_FLOPS, key=len, reverse=True):
        if fragment in name:
            return name, BF16_PEAK_FLOPS[fragment]
    return None


@dataclass(frozen=True)
class FlopsModel:
    """The shape facts of a GPT model that its FLOPs depend on (one model replica)."""

    hidden: int
    ffn_hidden: int
    gated: bool
    heads: int
    kv_heads: int
    head_dim: int
    padded_vocab: int
    #: One bool per layer, True = MSA layer.
    msa_layers: tuple[bool, ...]
    block_size: int = 128
    top_k: int = 16
    index_heads: int = 0
    index_dim: int = 0
    #: The indexer loss runs in training (coefficient > 0).
    indexer_loss: bool = False
    #: "dense" or "sparse" (the warm-up always counts the dense loss).
    indexer_loss_type: str = "dense"
    #: The selection runs in the warm-up too (for the recall metric).
    log_recall: bool = True

    @classmethod
    def from_config(cls, config, padded_vocab: int) -> FlopsModel:
        """Read the fields from a (MSA) TransformerConfig; a plain one gives all-dense layers."""
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        flags = tuple(getattr(config, "msa_layer_flags", None) or (False,) * config.num_layers)
        return cls(
            hidden=config.hidden_size,
            ffn_hidden=config.ffn_hidden_size,
            gated=bool(config.gated_linear_unit),
            heads=config.num_attention_heads,
            kv_heads=config.num_query_groups or config.num_attention_heads,
            head_dim=head_dim,
            padded_vocab=padded_vocab,
            msa_layers=flags,
            block_size=getattr(config, "msa_block_size", DEFAULT_TOPOLOGY.block_size),
            top_k=getattr(config, "msa_topk", DEFAULT_TOPOLOGY.top_k),
            index_heads=getattr(config, "msa_num_index_heads", 0) or 0,
            index_dim=getattr(config, "msa_index_head_dim", 0) or 0,
            indexer_loss=float(getattr(config, "msa_indexer_loss_coeff", 0.0) or 0.0) > 0,
            indexer_loss_type=getattr(config, "msa_indexer_loss_type", "dense"),
            log_recall=bool(getattr(config, "msa_log_selection_recall", False)),
        )

    def step_flops(self, packed_seq_ids: list[torch.Tensor], warmup: bool) -> float:
        """FLOPs of one training step (forward + backward) over these microbatches.

        Args:
            packed_seq_ids: one int [b, s] document map per microbatch (0 = padding), as the
                loader gives them (any device).
            warmup: whether the MSA layers are in the dense warm-up.

        Returns:
            The model FLOPs of the step on this model replica (all its TP/PP ranks together).
        """
        tokens = 0
        keys_dense = keys_sel = 0.0
        for ids in packed_seq_ids:
            tokens += ids.numel()
            pos = positions_from_document_ids(ids).to(torch.float64)
            real = ids != 0
            dense = torch.where(real, pos + 1, torch.zeros_like(pos))
            blk = self.block_size
            far = (pos // blk) >= self.top_k
            sel = torch.where(far, (self.top_k - 1) * blk + torch.remainder(pos, blk) + 1, pos + 1)
            sel = torch.where(real, sel, torch.zeros_like(sel))
            # One host read per microbatch: these sums are exact in float64 (< 2**53).
            sums = torch.stack([dense.sum(), sel.sum()]).tolist()
            keys_dense += sums[0]
            keys_sel += sums[1]
        return self.flops(tokens, keys_dense, keys_sel, warmup)

    def flops(self, tokens: int, keys_dense: float, keys_sel: float, warmup: bool) -> float:
        """FLOPs from token and key counts (see the module docstring for every term).

        Args:
            tokens: tokens of the step, padding included (the GEMMs run on them).
            keys_dense: sum over real tokens of the keys a dense causal query sees (p + 1).
            keys_sel: sum over real tokens of the keys of the selected blocks.
            warmup: the MSA layers attend densely (dense warm-up).
        """
        h, hd = self.hidden, self.head_dim
        qkv = 2 * h * (self.heads + 2 * self.kv_heads) * hd
        proj = 2 * self.heads * hd * h
        mlp = (6 if self.gated else 4) * h * self.ffn_hidden
        per_layer_gemm = (qkv + proj + mlp) * tokens
        attn = 4 * self.heads * hd
        idx = self.index_heads * self.index_dim
        total = 3.0 * 2 * h * self.padded_vocab * tokens
        for is_msa in self.msa_layers:
            total += 3.0 * per_layer_gemm
            if not is_msa:
                total += 3.0 * attn * keys_dense
                continue
            total += 3.0 * attn * (keys_dense if warmup else keys_sel)
            uses_indexer = not warmup or self.indexer_loss
            if uses_indexer:
                total += 3.0 * 2 * h * (idx + self.index_dim) * tokens
            if not warmup or (self.indexer_loss and self.log_recall):
                total += 2.0 * idx * keys_dense
            if self.indexer_loss:
                if warmup or self.indexer_loss_type == "dense":
                    total += 2.0 * self.heads * hd * keys_dense + 3.0 * 2 * idx * keys_dense
                else:
                    total += 3.0 * 2 * idx * keys_sel
        return total


def throughput(flops: float, seconds: float, gpus: int,
               peak: tuple[str, float] | None) -> dict[str, float]:
    """TFLOP/s per GPU (or per process on the CPU) and, with a known peak, MFU.

    Args:
        flops: model FLOPs of the step over all ranks of the replicas that ran it.
        seconds: the step's wall time.
        gpus: processes (GPUs) that shared those FLOPs.
        peak: :func:`device_peak_flops`'s answer; None leaves MFU out.
    """
    per_gpu = flops / max(seconds, 1e-12) / max(gpus, 1)
    out = {"model_tflops_per_step": flops / 1e12, "tflops_per_gpu": per_gpu / 1e12}
    if peak is not None and math.isfinite(per_gpu):
        out["mfu"] = per_gpu / peak[1]
    return out


__all__ = ["BF16_PEAK_FLOPS", "FlopsModel", "device_peak_flops", "throughput"]
