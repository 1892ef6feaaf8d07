"""Megatron-Bridge support: MSA model configs and MiniMax-M3's Hugging Face mapping with the
index branch; recipes (:mod:`nemo_msa.bridge.recipes`) and the forward step
(:mod:`nemo_msa.bridge.step`) for Bridge's ``pretrain`` (ADR 0055).

Importing this package imports Megatron-Bridge (and through it Transformer Engine, which Bridge
imports eagerly; ADR 0039); neither is a dependency of nemo-msa. The recipes and the step import
Bridge's training configs, which need more (ADR 0055), so they are their own modules::

    from megatron.bridge.training.pretrain import pretrain
    from nemo_msa.bridge.recipes import msa_tiny_pretrain_config
    from nemo_msa.bridge.step import forward_step

    pretrain(msa_tiny_pretrain_config(), forward_step)
"""

from nemo_msa.bridge.config import (
    MSABridgeTransformerConfig,
    MSAGPTModelConfig,
    model_config_from_recipe,
)
from nemo_msa.bridge.minimax_m3 import (
    HFCheckpoint,
    MSAMiniMaxM3Bridge,
    export_minimax_m3_hf,
    load_minimax_m3_hf,
)

__all__ = [
    "HFCheckpoint",
    "MSABridgeTransformerConfig",
    "MSAGPTModelConfig",
    "MSAMiniMaxM3Bridge",
    "export_minimax_m3_hf",
    "load_minimax_m3_hf",
    "model_config_from_recipe",
]
