"""MiniMax-M3's Hugging Face checkpoints into MSA layers through Megatron-Bridge (ADR 0055).

Bridge's ``MiniMaxM3Bridge`` maps M3's text backbone into a GPT model that runs full attention;
its lightning-indexer tensors are kept as frozen state. :class:`MSAMiniMaxM3Bridge` takes
Bridge's text mappings as they are (read from ``MiniMaxM3Bridge.mapping_registry()``; the
Megatron names lose the vision-language wrapper's ``language_model.`` prefix, the Hugging Face
names keep the checkpoint's root) and adds the MSA model's own names:

- the index branch (ADR 0006): ``decoder.layers.<i>.self_attention.indexer.index_q_proj.weight``
  (column-parallel over the index heads, ADR 0004) and the replicated ``index_k_proj``,
  ``index_q_norm`` and ``index_k_norm``, from ``<root>model.layers.<i>.self_attn.<same>``;
- the experts of Megatron's SequentialMLP (the local spec's
  ``mlp.experts.local_experts.<e>.linear_fc{1,2}``), beside Bridge's grouped-GEMM names.

So an M3 checkpoint imported with Bridge's conversion machinery (the same
``load_weights_hf_to_megatron`` / ``stream_weights_megatron_to_hf`` that ``AutoBridge`` runs,
with TP/PP/EP handled by Bridge) lands in MSA layers whose indexers select and are trained.
:func:`load_minimax_m3_hf` and :func:`export_minimax_m3_hf` are the two directions over a
directory of safetensors; they read no ``config.json`` (the model's config is this project's
recipe), so no ``trust_remote_code`` model class is needed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping,
    ColumnParallelMapping,
    GatedMLPMapping,
    MegatronParamMapping,
    ReplicatedMapping,
)
from megatron.bridge.models.hf_pretrained.state import SafeTensorsStateSource, StateDict
from megatron.bridge.models.minimax_m3.minimax_m3_bridge import MiniMaxM3Bridge

__all__ = ["HFCheckpoint", "MSAMiniMaxM3Bridge", "export_minimax_m3_hf", "load_minimax_m3_hf"]

#: Megatron-side prefix of Bridge's M3 (vision-language) model's text backbone.
_BRIDGE_TEXT_PREFIX = "language_model."
#: Root of the text tensors in the released (vision-language) checkpoint.
RELEASED_ROOT = "language_model."


class HFCheckpoint:
    """What Bridge's conversion reads of a Hugging Face model (its ``PreTrainedCausalLM``): the
    tensors by name, lazily (``state``), a name, and a config.

    Args:
        tensors: a directory of ``*.safetensors`` (with or without an index file), or a mapping
            of tensors.
        config: the Hugging Face config (Bridge's mappings used here do not read it).
    """

    def __init__(self, tensors: str | os.PathLike | Mapping[str, torch.Tensor],
                 config: Any = None) -> None:
        if isinstance(tensors, Mapping):
            self.state = StateDict(dict(tensors))
            self.model_name_or_path = "<tensors>"
        else:
            self.state = StateDict(SafeTensorsStateSource(Path(tensors)))
            self.model_name_or_path = str(tensors)
        self.config = config


def _renamed(mapping: MegatronParamMapping, hf_root: str) -> MegatronParamMapping | None:
    """Bridge's M3 mapping on this model's names: Megatron's ``language_model.`` prefix dropped,
    the Hugging Face root ``language_model.`` replaced by ``hf_root``; None for the mappings
    outside the text backbone (vision tower, projectors, Bridge's frozen indexers)."""
    megatron = mapping.megatron_param
    if not megatron.startswith(_BRIDGE_TEXT_PREFIX):
        return None
    megatron = megatron[len(_BRIDGE_TEXT_PREFIX):]

    def hf(name: str) -> str:
        return hf_root + name[len(RELEASED_ROOT):]

    if isinstance(mapping.hf_param, str):
        return type(mapping)(megatron_param=megatron, hf_param=hf(mapping.hf_param))
    return type(mapping)(megatron_param=megatron,
                         **{part: hf(name) for part, name in mapping.hf_param.items()})


def _msa_mappings(hf_root: str) -> list[MegatronParamMapping]:
    """The MSA model's names that Bridge's M3 mapping lacks: the index branch (ADR 0006) and the
    local spec's SequentialMLP experts."""
    mg, layer = "decoder.layers.*.", f"{hf_root}model.layers.*."
    index = "self_attention.indexer."
    moe = f"{layer}block_sparse_moe.experts.*."
    return [
        # index_q_proj splits its heads over TP as the KV heads are split (ADR 0004).
        ColumnParallelMapping(megatron_param=f"{mg}{index}index_q_proj.weight",
                              hf_param=f"{layer}self_attn.index_q_proj.weight"),
        *[ReplicatedMapping(megatron_param=f"{mg}{index}{name}.weight",
                            hf_param=f"{layer}self_attn.{name}.weight")
          for name in ("index_k_proj", "index_q_norm", "index_k_norm")],
        GatedMLPMapping(megatron_param=f"{mg}mlp.experts.local_experts.*.linear_fc1.weight",
                        gate=f"{moe}w1.weight", up=f"{moe}w3.weight"),
        AutoMapping(megatron_param=f"{mg}mlp.experts.local_experts.*.linear_fc2.weight",
                    hf_param=f"{moe}w2.weight"),
    ]


class MSAMiniMaxM3Bridge(MegatronModelBridge):
    """Bridge's MiniMax-M3 text mapping plus MSA's index branch, for this project's GPTModel.

    Args:
        hf_root: the checkpoint's root of the text tensors: ``"language_model."`` for the
            released vision-language checkpoint, ``""`` for a text-only one.
    """

    def __init__(self, hf_root: str = RELEASED_ROOT) -> None:
        super().__init__()
        self.hf_root = hf_root

    def provider_bridge(self, hf_pretrained):
        """Not used: the model config is this project's recipe (nemo_msa.bridge.recipes)."""
        raise NotImplementedError(
            "MSAMiniMaxM3Bridge maps weights only; build the model from "
            "nemo_msa.bridge.minimax_m3_msa_pretrain_config()")

    def mapping_registry(self) -> MegatronMappingRegistry:
        """Bridge's M3 text mappings on this model's names, plus the index branch."""
        text = [m for m in (_renamed(m, self.hf_root)
                            for m in MiniMaxM3Bridge().mapping_registry().mappings)
                if m is not None]
        return MegatronMappingRegistry(*text, *_msa_mappings(self.hf_root))


def load_minimax_m3_hf(model: Any, checkpoint: str | os.PathLike | Mapping[str, torch.Tensor],
                       *, hf_root: str = RELEASED_ROOT) -> list:
    """Loads an M3 checkpoint's text tensors (index branch included) into an MSA GPT model.

    Args:
        model: the model or its list of chunks (Bridge's TP/PP/EP placement applies).
        checkpoint: a directory of safetensors, or the tensors by name.
        hf_root: the checkpoint's root (``"language_model."`` released, ``""`` text-only).

    Returns:
        The model chunks, loaded.
    """
    bridge = MSAMiniMaxM3Bridge(hf_root)
    return bridge.load_weights_hf_to_megatron(HFCheckpoint(checkpoint), model)


def export_minimax_m3_hf(model: Any, reference: str | os.PathLike | Mapping[str, torch.Tensor],
                         *, hf_root: str = RELEASED_ROOT) -> Iterator[tuple[str, torch.Tensor]]:
    """This model's weights under M3's Hugging Face names, as Bridge streams them.

    Args:
        model: the model or its list of chunks.
        reference: the checkpoint whose names the export follows (Bridge's export reads its
            keys), as a directory or the tensors by name.
        hf_root: the checkpoint's root.

    Yields:
        ``(hf name, tensor)`` on the CPU, gathered over the model's parallel ranks.
    """
    bridge = MSAMiniMaxM3Bridge(hf_root)
    yield from bridge.stream_weights_megatron_to_hf(
        model, HFCheckpoint(reference), cpu=True, show_progress=False)
