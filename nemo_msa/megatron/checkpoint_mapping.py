"""Names of the MSA index branch: Megatron-Core state dict <-> the public MiniMax-M3 checkpoint.

Megatron-Core name (this project) -> MiniMax-M3 public name:

- ``decoder.layers.<i>.self_attention.indexer.index_q_proj.weight``
  -> ``model.layers.<i>.self_attn.index_q_proj.weight``
- ``decoder.layers.<i>.self_attention.indexer.index_k_proj.weight``
  -> ``model.layers.<i>.self_attn.index_k_proj.weight``
- ``decoder.layers.<i>.self_attention.indexer.index_q_norm.weight``
  -> ``model.layers.<i>.self_attn.index_q_norm.weight``
- ``decoder.layers.<i>.self_attention.indexer.index_k_norm.weight``
  -> ``model.layers.<i>.self_attn.index_k_norm.weight``

``<i>`` is the 0-based global layer index on both sides. The tensors copy unchanged
(docs/adr/0006-msa-checkpoint-mapping.md):

- ``index_q_proj.weight`` [num_index_heads * index_head_dim, hidden], head-major rows (index head
  h = rows ``[h * d, (h + 1) * d)``, serving KV head h); Megatron's tensor-parallel split of this
  column-parallel weight along dim 0 keeps whole heads per rank;
- ``index_k_proj.weight`` [index_head_dim, hidden], replicated on every TP rank;
- ``index_q_norm.weight`` / ``index_k_norm.weight`` [index_head_dim]: Gemma-style RMSNorm weights
  applied as ``1 + weight`` on both sides, so no offset is added or removed;
- RoPE is not a weight: the first ``rotary_percent * head_dim`` channels rotate in the
  non-interleaved (rotate-half) layout, Megatron's ``rotary_interleaved=False``.

Functions take full (TP=1, unsharded) state dicts, e.g. a ``model.state_dict()`` at TP=1 or a
distributed checkpoint loaded at TP=1 (dist-checkpointing reshards from any TP size).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = [
    "INDEX_BRANCH_PARAMETERS",
    "hf_to_megatron_name",
    "indexer_state_dict_from_hf",
    "indexer_state_dict_to_hf",
    "megatron_to_hf_name",
]

INDEX_BRANCH_PARAMETERS = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")

_MEGATRON = re.compile(
    r"^(?P<prefix>.*?)decoder\.layers\.(?P<layer>\d+)\.self_attention\.indexer\."
    r"(?P<param>index_[qk]_(?:proj|norm))\.weight$"
)
_HF = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.self_attn\."
    r"(?P<param>index_[qk]_(?:proj|norm))\.weight$"
)


def megatron_to_hf_name(name: str, hf_prefix: str = "model.") -> str | None:
    """The MiniMax-M3 name of a Megatron index-branch parameter, or None for other parameters.

    Args:
        name: a Megatron state-dict key (a ``module.`` or other wrapper prefix is allowed).
        hf_prefix: the public checkpoint's prefix before ``layers.``.
    """
    match = _MEGATRON.match(name)
    if match is None:
        return None
    return f"{hf_prefix}layers.{match['layer']}.self_attn.{match['param']}.weight"


def hf_to_megatron_name(name: str, megatron_prefix: str = "") -> str | None:
    """The Megatron name of a MiniMax-M3 index-branch parameter, or None for other parameters.

    Args:
        name: a public-checkpoint key such as ``model.layers.3.self_attn.index_q_proj.weight``.
        megatron_prefix: prefix of the Megatron state dict (e.g. ``"module."`` under DDP).
    """
    match = _HF.match(name)
    if match is None:
        return None
    return (
        f"{megatron_prefix}decoder.layers.{match['layer']}.self_attention.indexer."
        f"{match['param']}.weight"
    )


def indexer_state_dict_to_hf(
    state_dict: Mapping[str, torch.Tensor], hf_prefix: str = "model."
) -> dict[str, torch.Tensor]:
    """The index-branch tensors of a full Megatron state dict under their public names."""
    out = {}
    for name, tensor in state_dict.items():
        target = megatron_to_hf_name(name, hf_prefix)
        if target is not None:
            out[target] = tensor
    return out


def indexer_state_dict_from_hf(
    hf_state_dict: Mapping[str, torch.Tensor],
    megatron_prefix: str = "",
    num_index_heads: int | None = None,
    index_head_dim: int | None = None,
) -> dict[str, torch.Tensor]:
    """The index-branch tensors of a public checkpoint under Megatron names (TP=1).

    Args:
        hf_state_dict: public-checkpoint tensors (other keys are ignored).
        megatron_prefix: prefix of the Megatron state dict.
        num_index_heads, index_head_dim: when given, shapes are checked against them.

    Raises:
        ValueError: a tensor whose shape disagrees with the index topology (names it).
    """
    out = {}
    for name, tensor in hf_state_dict.items():
        target = hf_to_megatron_name(name, megatron_prefix)
        if target is None:
            continue
        if index_head_dim is not None:
            rows = {"index_q_proj": (num_index_heads or 1) * index_head_dim}.get(
                target.split(".")[-2], index_head_dim
            )
            if tensor.shape[0] != rows or (target.endswith("norm.weight") and tensor.dim() != 1):
                raise ValueError(
                    f"{name} has shape {tuple(tensor.shape)}; expected {rows} rows for "
                    f"num_index_heads={num_index_heads}, index_head_dim={index_head_dim}"
                )
        out[target] = tensor
    return out
