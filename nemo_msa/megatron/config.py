"""MSA fields on Megatron-Core's TransformerConfig.

:class:`MSATransformerConfig` is a ``TransformerConfig`` with the ``msa_*`` knobs of MSA
block-sparse attention (MiniMax-M3 style). Every knob is validated in ``__post_init__`` so that a
configuration MSA cannot run fails when the config is made, and again (with the parallel groups
at hand) when an MSA layer is built (:func:`nemo_msa.support.require_msa_support`).

The production topology (MiniMax-M3, :data:`nemo_msa.support.DEFAULT_TOPOLOGY`) is the default of
the MSA fields: 4 index heads of dim 128 serving the 4 KV heads, blocks of 128 tokens, 16 blocks
per query, no sink block, one local block, block score ``"max"``. The model-side fields of that
topology are Megatron's own: ``num_attention_heads=64``, ``num_query_groups=4``,
``kv_channels=128``, and GPTModel's
``rotary_percent=0.5`` (64 of 128 channels rotated) and ``rotary_base=5_000_000``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_msa.megatron.indexer_loss import MSAIndexerLossAutoScaler
from nemo_msa.support import (
    DEFAULT_INDEXER_LOSS_COEFF,
    DEFAULT_INDEXER_LOSS_TYPE,
    DEFAULT_TOPOLOGY,
    MSATopology,
)

__all__ = ["MSATransformerConfig", "normalize_layer_pattern", "normalize_moe_layer_freq"]

_SPARSE_CHARS = "S"
_DENSE_CHARS = "D"


def normalize_layer_pattern(
    pattern: str | Sequence[int] | Sequence[bool] | None, num_layers: int
) -> tuple[bool, ...]:
    """Turns a per-layer MSA pattern into one bool per layer (True = MSA layer).

    Args:
        pattern: ``None`` (every layer is MSA); a string of ``num_layers`` characters, ``"S"``
            for an MSA (sparse) layer and ``"D"`` for a dense layer (e.g. ``"DSSSDSSS"``), where
            ``"|"`` and spaces are ignored so that long patterns can be grouped; or a sequence of
            ``num_layers`` 0/1 (or bool) values, 1 = MSA layer.
        num_layers: the model's ``num_layers``.

    Returns:
        Tuple of ``num_layers`` bools, index i describing layer i + 1 (Megatron layer numbers
        start at 1).

    Raises:
        ValueError: naming ``msa_layer_pattern``, its value and what was expected.
    """
    if pattern is None:
        return (True,) * num_layers
    if isinstance(pattern, str):
        chars = [c for c in pattern.upper() if c not in "| "]
        bad = sorted({c for c in chars if c not in _SPARSE_CHARS + _DENSE_CHARS})
        if bad:
            raise ValueError(
                f"msa_layer_pattern={pattern!r} has characters {bad}; expected only 'S' (MSA "
                "layer) and 'D' (dense layer), '|' and spaces ignored"
            )
        flags = tuple(c == _SPARSE_CHARS for c in chars)
    else:
        values = list(pattern)
        if any(v not in (0, 1) for v in values):
            raise ValueError(
                f"msa_layer_pattern={pattern!r}; expected a sequence of 0/1 per layer "
                "(1 = MSA layer)"
            )
        flags = tuple(bool(v) for v in values)
    if len(flags) != num_layers:
        raise ValueError(
            f"msa_layer_pattern={pattern!r} describes {len(flags)} layers; expected "
            f"num_layers={num_layers}"
        )
    return flags


def normalize_moe_layer_freq(
    freq: int | Sequence[int], num_layers: int, num_moe_experts: int | None
) -> tuple[bool, ...]:
    """Which layers have an MoE MLP, as Megatron reads ``moe_layer_freq``.

    Args:
        freq: a positive int N (an MoE MLP on layers 0, N, 2N, ..., Megatron's
            ``get_gpt_decoder_layer_specs``) or ``num_layers`` values 0 (dense MLP) / 1 (MoE),
            e.g. ``[0, 0, 0] + [1] * 57`` for MiniMax-M3.
        num_layers: the model's ``num_layers``.
        num_moe_experts: None makes every layer dense whatever ``freq`` says.

    Returns:
        Tuple of ``num_layers`` bools, index i describing layer i + 1.

    Raises:
        ValueError: naming ``moe_layer_freq``, its value and what was expected.
    """
    if num_moe_experts is None:
        return (False,) * num_layers
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return tuple(i % freq == 0 for i in range(num_layers))
    if (isinstance(freq, (list, tuple)) and len(freq) == num_layers
            and all(type(v) is int and v in (0, 1) for v in freq)):
        return tuple(bool(v) for v in freq)
    raise ValueError(
        f"moe_layer_freq={freq!r}; expected a positive int (an MoE layer every N layers) or a "
        f"list of num_layers={num_layers} values 0 (dense MLP) / 1 (MoE MLP)"
    )


@dataclass
class MSATransformerConfig(TransformerConfig):
    """TransformerConfig with MSA block-sparse attention.

    The MSA layers read only the ``msa_*`` fields below; everything else is Megatron's.
    """

    msa_num_index_heads: int | None = None
    """Indexer query heads; index head h serves KV head h, so it must equal num_query_groups
    (None = num_query_groups)."""

    msa_index_head_dim: int = DEFAULT_TOPOLOGY.index_head_dim
    """Channels per index head (and of the one shared index key head)."""

    msa_block_size: int = DEFAULT_TOPOLOGY.block_size
    """Tokens per key block."""

    msa_topk: int = DEFAULT_TOPOLOGY.top_k
    """Key blocks attended per query token and KV head (forced blocks count inside)."""

    msa_init_blocks: int = DEFAULT_TOPOLOGY.init_blocks
    """Blocks at the start of each document every query always selects (attention sinks)."""

    msa_local_blocks: int = DEFAULT_TOPOLOGY.local_blocks
    """Blocks ending at the query's own block that every query always selects."""

    msa_score_type: str = DEFAULT_TOPOLOGY.score_type
    """Block score of the indexer: "max" (max of q.k over the block's visible keys, the
    MiniMax-M3 contract) or "lse" (log-sum-exp)."""

    msa_backend: str | None = None
    """MSA kernel backend (see nemo_msa.backends); None or "auto" picks by device; the
    NEMO_MSA_BACKEND environment variable overrides it."""

    msa_indexer_loss_coeff: float = DEFAULT_INDEXER_LOSS_COEFF
    """Coefficient of the indexer KL-distillation loss; 0 disables it (the indexer then never
    learns). With 0 the loss is not computed at all, so the indexer KL and the selection
    recall metrics are not logged either: both need the dense target the loss computes."""

    msa_indexer_loss_type: str = DEFAULT_INDEXER_LOSS_TYPE
    """"dense": KL over all candidate blocks of the query's document (O(T^2) target, Megatron
    DSA's default); "sparse": KL over the selected blocks only (O(T x top_k x block)); the dense
    warm-up always uses "dense"."""

    msa_indexer_loss_query_chunk: int = 1024
    """Query tokens per chunk when the indexer loss computes the main attention's block mass
    (bounds its memory to about num_heads * chunk * tokens floats)."""

    msa_dense_warmup_steps: int = 0
    """Training iterations at the start during which MSA layers attend densely and only the
    indexer is trained by the indexer loss (see nemo_msa.megatron.phase)."""

    msa_layer_pattern: str | list[int] | None = None
    """Which layers are MSA: None = every layer; "S"/"D" per layer (e.g. "DSSS" * 4); or 0/1 per
    layer. Dense layers keep document-causal attention and per-document RoPE."""

    msa_log_selection_recall: bool = True
    """Whether the indexer loss also records the selection recall (share of the main attention's
    block mass that the selected blocks cover) for logging."""

    msa_recall_sample_rows: int = 256
    """Query tokens per microbatch on which the sparse loss measures the selection recall
    exactly (evenly spaced over the microbatch's tokens; every token when it has fewer): the
    sparse phase computes no dense target, so recall costs one small dense pass over these rows
    (see nemo_msa.indexer_loss.sampled_selection_recall)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.finalize_msa_fields()

    def finalize_msa_fields(self) -> None:
        """MSA's part of the post-init, after Megatron's: the indexer-loss scale hook, the index
        heads' default, the field checks and the per-layer checkpoint flag. Config classes that
        defer Megatron's post-init (Megatron-Bridge's, nemo_msa.bridge) call it after theirs."""
        # The one place the indexer-loss scale hook is installed (a config's own hook wins).
        if self.experimental_attention_variant_loss_scale_func is None:
            # Megatron's schedules call this hook with (loss scale / num_microbatches) after each
            # forward step, so the indexer loss is scaled like the main loss (as DSA's is).
            self.experimental_attention_variant_loss_scale_func = (
                MSAIndexerLossAutoScaler.set_loss_scale
            )
        if self.msa_num_index_heads is None:
            self.msa_num_index_heads = self.num_query_groups
        self._validate_msa_fields()
        moe_flags = normalize_moe_layer_freq(self.moe_layer_freq, self.num_layers,
                                             self.num_moe_experts)
        if len(set(self.msa_layer_flags)) > 1 or len(set(moe_flags)) > 1:
            # MSA and dense layers have different parameters (dense ones have no indexer, dense
            # MLPs no router), so the layers cannot be stacked into one [num_layers, ...] tensor
            # per key in a distributed checkpoint; save them per layer (decoder.layers.<i>.*).
            self.hetereogenous_dist_checkpoint = True

    # ------------------------------------------------------------------ validation
    def _validate_msa_fields(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}; expected a positive int")

        def non_negative_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}; expected an int >= 0")

        for name in (
            "msa_num_index_heads",
            "msa_index_head_dim",
            "msa_block_size",
            "msa_topk",
            "msa_indexer_loss_query_chunk",
            "msa_recall_sample_rows",
        ):
            positive_int(name)
        for name in ("msa_init_blocks", "msa_local_blocks", "msa_dense_warmup_steps"):
            non_negative_int(name)
        coeff = self.msa_indexer_loss_coeff
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0:
            raise ValueError(f"msa_indexer_loss_coeff={coeff!r}; expected a float >= 0")
        if self.msa_indexer_loss_type not in ("dense", "sparse"):
            raise ValueError(
                f"msa_indexer_loss_type={self.msa_indexer_loss_type!r}; expected 'dense' or "
                "'sparse'"
            )
        if self.msa_backend is not None and not isinstance(self.msa_backend, str):
            raise ValueError(f"msa_backend={self.msa_backend!r}; expected a backend name or None")
        normalize_layer_pattern(self.msa_layer_pattern, self.num_layers)
        normalize_moe_layer_freq(self.moe_layer_freq, self.num_layers, self.num_moe_experts)

        # Topology and score type: the same check the layers run when they are built.
        MSATopology.from_config(self).validate()

        # Tensor parallelism (whole KV heads with their index heads per rank) is the layer's to
        # check, with its process group: nemo_msa.megatron.msa_attention.check_msa_layer_config.

    # ------------------------------------------------------------------ helpers
    @property
    def msa_layer_flags(self) -> tuple[bool, ...]:
        """One bool per layer (index = layer_number - 1), True = MSA layer."""
        return normalize_layer_pattern(self.msa_layer_pattern, self.num_layers)

    def is_msa_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (1-based, Megatron's numbering) is MSA."""
        if not 1 <= layer_number <= self.num_layers:
            raise ValueError(
                f"layer_number={layer_number}; expected 1..num_layers={self.num_layers}"
            )
        return self.msa_layer_flags[layer_number - 1]
