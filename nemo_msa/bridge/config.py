"""MSA model configs for Megatron-Bridge's ModelConfig + ModelBuilder API (ADR 0055).

Bridge builds a model from a ``ModelConfig`` whose ``builder`` class makes the model
(``ConfigContainer.model``; Bridge's ``ModelProviderMixin`` is deprecated). Megatron-LM's
``GPTModelConfig`` + ``GPTModelBuilder`` (re-exported by ``megatron.bridge.models.gpt``) hold
the ``TransformerConfig`` as a member and call the layer spec as ``spec(model_config,
vp_stage=...)``; the model receives the member config itself (ADR 0039).

- :class:`MSABridgeTransformerConfig` is :class:`nemo_msa.megatron.MSATransformerConfig` with
  Bridge's deferred post-init: a recipe sets fields after construction, then ``finalize()`` runs
  Bridge's finalize (string fields, derived defaults, Megatron's post-init) and MSA's
  (:meth:`~nemo_msa.megatron.MSATransformerConfig.finalize_msa_fields`: the index heads' default,
  the ``msa_*`` checks, the indexer-loss scale hook). Bridge's finalize calls Megatron's
  post-init by name, which skips MSA's; this class runs it.
- :class:`MSAGPTModelConfig` is ``GPTModelConfig`` with MSA's decoder spec and RoPE as defaults
  and MSA's checks in ``finalize()``: the member must carry the ``msa_*`` fields, the position
  embedding must be one the layers run, and MTP layers are refused (Bridge's ``mtp_block_spec``
  builds standard attention layers, which would read the document map as a mask).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.bridge.models.gpt.gpt_builder import GPTModelConfig
from megatron.bridge.models.transformer_config import TransformerConfig as BridgeTransformerConfig

from nemo_msa.megatron.config import MSATransformerConfig
from nemo_msa.megatron.layer_specs import get_msa_decoder_block_spec
from nemo_msa.training.recipe import POSITION_EMBEDDINGS, Recipe, load_recipe
from nemo_msa.training.recipe_schema import config_values

__all__ = ["MSABridgeTransformerConfig", "MSAGPTModelConfig", "model_config_from_recipe"]


@dataclass
class MSABridgeTransformerConfig(BridgeTransformerConfig, MSATransformerConfig):
    """MSATransformerConfig whose post-init waits for ``finalize()``, as Bridge's configs do.

    The MRO puts Bridge's no-op ``__post_init__`` first, so construction checks nothing; a recipe
    overrides fields, then Bridge (or the user) calls :meth:`finalize`.
    """

    def finalize(self) -> None:
        """Bridge's finalize (Megatron's post-init included), then MSA's post-init.

        Raises:
            ValueError: a field Megatron or MSA refuses, named with its value.
        """
        super().finalize()
        self.finalize_msa_fields()


def _msa_decoder_block_spec(config, vp_stage: int | None = None):
    """The MSA decoder block spec of a :class:`MSAGPTModelConfig` (GPTModelBuilder passes the
    model config, which forwards the transformer fields)."""
    return get_msa_decoder_block_spec(config.transformer, vp_stage=vp_stage)


@dataclass(kw_only=True)
class MSAGPTModelConfig(GPTModelConfig):
    """Megatron-LM's ``GPTModelConfig`` for a GPT model with MSA layers.

    Attributes:
        transformer: an :class:`MSABridgeTransformerConfig` (or an eager
            :class:`~nemo_msa.megatron.MSATransformerConfig`, re-checked by :meth:`finalize`).
        transformer_layer_spec: the decoder spec callable (default: MSA's decoder block spec).
        position_embedding_type: default ``"rope"`` (per-document positions in MSA layers).
    """

    transformer: MSATransformerConfig
    transformer_layer_spec: Callable[..., Any] | Any = _msa_decoder_block_spec
    position_embedding_type: str = "rope"

    def finalize(self) -> None:
        """Megatron-LM's finalize (the member's ``finalize()`` where it has one), then MSA's.

        Raises:
            TypeError: ``transformer`` without the ``msa_*`` fields.
            ValueError: a position embedding MSA layers do not run, MTP layers, or a field the
                member config refuses.
        """
        if not isinstance(self.transformer, MSATransformerConfig):
            raise TypeError(
                f"MSAGPTModelConfig.transformer is a {type(self.transformer).__name__}; expected "
                "an MSABridgeTransformerConfig (the msa_* fields)"
            )
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding_type={self.position_embedding_type!r}; expected one of "
                f"{POSITION_EMBEDDINGS} (MSA layers apply RoPE at document positions)"
            )
        if self.transformer.mtp_num_layers:
            raise ValueError(
                f"mtp_num_layers={self.transformer.mtp_num_layers!r}: MTP layers are not built "
                "with MSA through Megatron-Bridge (its mtp_block_spec builds standard attention "
                "layers, which would read the document ids as a mask); expected None"
            )
        super().finalize()
        if not isinstance(self.transformer, MSABridgeTransformerConfig):
            # An eager config checked itself when made; recipes may have changed fields since.
            MSATransformerConfig.__post_init__(self.transformer)


def model_config_from_recipe(recipe: Recipe | str | os.PathLike,
                             overrides: list[str] | None = None) -> MSAGPTModelConfig:
    """A YAML recipe's model section as Bridge's model config (not finalized).

    Args:
        recipe: a loaded YAML recipe (:func:`nemo_msa.training.recipe.load_recipe`), or its path.
        overrides: ``model.key=value`` overrides of a recipe given by path.

    Returns:
        An :class:`MSAGPTModelConfig` around an :class:`MSABridgeTransformerConfig`; params and
        pipeline dtypes follow ``model.bf16`` / ``model.fp16`` as in ``scripts/pretrain.py``.
    """
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides or [])
    fields = config_values("model", recipe.model)
    dtype = (torch.bfloat16 if fields.get("bf16") else
             torch.float16 if fields.get("fp16") else torch.float32)
    fields.setdefault("params_dtype", dtype)
    fields.setdefault("pipeline_dtype", dtype)
    gpt = dataclasses.asdict(recipe.gpt)
    return MSAGPTModelConfig(transformer=MSABridgeTransformerConfig(**fields), **gpt)
