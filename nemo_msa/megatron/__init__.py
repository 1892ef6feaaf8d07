"""MSA block-sparse attention as Megatron-Core modules.

- :class:`MSATransformerConfig`: TransformerConfig + the ``msa_*`` fields.
- :class:`MSASelfAttention` / :class:`MSASelfAttentionSubmodules`: the attention module.
- :class:`MSAIndexer` / :class:`MSAIndexerSubmodules`: index_q/index_k branch.
- :class:`MSACoreAttention`: block-sparse / dense-document core attention on compact tokens.
- indexer loss (computed by :mod:`nemo_msa.indexer_loss`): :class:`MSAIndexerLossAutoScaler`,
  :class:`MSAIndexerMetrics` (logging of indexer loss and selection recall).
- training phase: :func:`set_training_iteration` (dense warm-up), parameter helpers.
- data side: :class:`SharedMicrobatchIterators` (one layout per microbatch across VPP chunks).
- full activation recompute: :class:`SelectionReplay` (the recompute reuses the first forward's
  layout and block selection), :func:`clear_selection_replay`.

Layer specs live in the top-level ``layer_specs`` package.
"""

from nemo_msa.megatron.config import MSATransformerConfig, normalize_layer_pattern
from nemo_msa.megatron.core_attention import MSACoreAttention
from nemo_msa.megatron.indexer import (
    GemmaRMSNorm,
    MSAIndexer,
    MSAIndexerSubmodules,
    ReplicatedLinear,
)
from nemo_msa.megatron.indexer_loss import MSAIndexerLossAutoScaler, MSAIndexerMetrics
from nemo_msa.megatron.microbatch import (
    SharedMicrobatchIterators,
    layout_for_layer,
    move_to_device,
)
from nemo_msa.megatron.msa_attention import (
    MSASelfAttention,
    MSASelfAttentionSubmodules,
    check_msa_layer_config,
)
from nemo_msa.megatron.phase import (
    dense_warmup_active,
    get_training_iteration,
    get_training_step_count,
    indexer_parameters,
    non_indexer_parameters,
    set_main_parameters_trainable,
    set_training_iteration,
)
from nemo_msa.megatron.selection_replay import SelectionReplay, clear_selection_replay

__all__ = [
    "GemmaRMSNorm",
    "MSACoreAttention",
    "MSAIndexer",
    "MSAIndexerLossAutoScaler",
    "MSAIndexerMetrics",
    "MSAIndexerSubmodules",
    "MSASelfAttention",
    "MSASelfAttentionSubmodules",
    "MSATransformerConfig",
    "ReplicatedLinear",
    "SelectionReplay",
    "SharedMicrobatchIterators",
    "check_msa_layer_config",
    "clear_selection_replay",
    "dense_warmup_active",
    "get_training_iteration",
    "get_training_step_count",
    "indexer_parameters",
    "layout_for_layer",
    "move_to_device",
    "non_indexer_parameters",
    "normalize_layer_pattern",
    "set_main_parameters_trainable",
    "set_training_iteration",
]
