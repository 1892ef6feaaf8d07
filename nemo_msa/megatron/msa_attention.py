"""MSA self-attention as a Megatron-Core attention module.

:class:`MSASelfAttention` is Megatron's ``SelfAttention`` (same ``linear_qkv``, optional
``q_layernorm``/``k_layernorm``, ``linear_proj``, same parameter names and sharded state dict)
with a forward for packed documents:

1. the layout of the microbatch from ``attention_mask`` (the loader's packed_seq_ids, see
   nemo_msa.megatron.microbatch) or from THD ``packed_seq_params``, built once per microbatch
   and shared by every layer;
2. q/k/v from ``linear_qkv`` (+ q/k norms), gathered to compact tokens [T, heads, dim];
3. RoPE at *document* positions (packed documents restart at 0): the rotary table GPTModel
   passes in is indexed per token, so partial RoPE (``rotary_percent``), the base and
   interleaving are Megatron's own;
3b. context parallelism (docs/adr/0020-context-parallelism.md): the rank's queries stay local
   ([Tq, ...]); K, V and index_k are all-gathered over ``pg_collection.cp`` into the global
   compact order (backward: reduce-scatter), and every op takes the layout with the local
   queries' global rows (the context-parallel layout's ``view``);
4. MSA layers: the indexer (index_q/index_k on the detached input), block selection, and block-
   sparse core attention; dense layers of a mixed pattern (no indexer) and the dense warm-up:
   document-causal dense attention;
5. the indexer loss (training, coefficient > 0; its route is the plan's, its per-step part
   :class:`nemo_msa.megatron.indexer_step.IndexerStep`), attached to the core output by the
   autograd scaler;
6. scatter back to [s, b, heads * dim] and ``linear_proj``; returns ``(output, bias)``.

Construction refuses what MSA cannot run and resolves what runs (the layer's
:class:`nemo_msa.plan.MSAPlan`: backend, capability check, the kernels of the attention and of
each helper, the indexer loss's route; plus the Megatron-side checks here), never the first
step; the forward passes the plan to the ops and helpers, which read their field of it (the
norms' is given to them when they are built).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

from nemo_msa.layout import query_rows
from nemo_msa.megatron.indexer_loss import MSAIndexerLossAutoScaler, MSAIndexerMetrics
from nemo_msa.megatron.indexer_step import IndexerStep, indexer_loss
from nemo_msa.megatron.microbatch import context_parallel_layout_for_layer, full_rotary_table
from nemo_msa.megatron.norms import planned_norm
from nemo_msa.megatron.rope import apply_rope, check_rope_fusion, rope_factors
from nemo_msa.megatron.selection_replay import (
    RECORD,
    REPLAY,
    ReplayEntry,
    SelectionReplay,
    document_map_anchor,
    recompute_phase,
)
from nemo_msa.ops import select
from nemo_msa.plan import MSAPlan
from nemo_msa.support import check_runtime_arguments

__all__ = ["MSASelfAttention", "MSASelfAttentionSubmodules", "check_msa_layer_config"]


@dataclass
class MSASelfAttentionSubmodules(SelfAttentionSubmodules):
    """Megatron's self-attention submodules plus the indexer.

    Attributes:
        indexer: the :class:`nemo_msa.megatron.indexer.MSAIndexer` spec for an MSA layer; None
            for a dense (document-causal) layer of a mixed pattern.
    """

    indexer: ModuleSpec | type | None = None


def check_msa_layer_config(config: TransformerConfig, tp_size: int, cp_size: int) -> MSAPlan:
    """The construction gate of MSA and dense-document layers (Megatron side).

    Returns:
        The layer's plan (:meth:`nemo_msa.plan.MSAPlan.build`), for the device the layer runs
        on (the current CUDA device where there is one) and the parameters' dtype.

    Raises:
        NotImplementedError: FP8/FP4, fused RoPE, context parallelism with a named backend
            that has no query-subset mode, output gate, MLA,
            sliding windows, CUDA graphs.
        ValueError: a topology/score type MSA cannot run, TP that splits a KV head from its
            index head, a config without the msa_* fields, ``deterministic_mode=True`` while
            ``torch.use_deterministic_algorithms(True)`` is off (or warn-only).
    """
    if not hasattr(config, "msa_block_size"):
        raise ValueError(
            f"config is a {type(config).__name__} without the msa_* fields; build MSA layers "
            "from nemo_msa.megatron.MSATransformerConfig"
        )
    # FP8/FP4, fused single-QKV RoPE, CP (the layer's process group), topology, score type,
    # and the backend that will run: on the GPU where there is one, in the parameters' dtype.
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    plan = MSAPlan.build(config, device, cp_size=cp_size)
    check_rope_fusion(config, device)  # TE's fused RoPE at document positions (ADR 0054)
    if getattr(config, "attention_output_gate", False):
        raise NotImplementedError("MSA attention does not support attention_output_gate=True")
    if getattr(config, "multi_latent_attention", False):
        raise NotImplementedError(
            "MSA attention is GQA self-attention; multi_latent_attention=True is not supported"
        )
    graph_impl = getattr(config, "cuda_graph_impl", "none")
    if graph_impl not in (None, "none") or getattr(config, "enable_cuda_graph", False):
        raise NotImplementedError(
            f"MSA layers cannot be captured in CUDA graphs (cuda_graph_impl={graph_impl!r}, "
            f"enable_cuda_graph={getattr(config, 'enable_cuda_graph', False)}): the layout needs "
            "one host synchronization per microbatch; set cuda_graph_impl='none'"
        )
    if getattr(config, "window_size", None) is not None:
        raise NotImplementedError(
            f"MSA attention does not support sliding windows (window_size={config.window_size})"
        )
    groups = config.num_query_groups or config.num_attention_heads
    if tp_size > groups or groups % tp_size != 0:
        raise ValueError(
            f"tensor parallel size {tp_size} with num_query_groups={groups}: MSA needs every "
            "rank to hold whole KV heads with their index heads (num_query_groups divisible by "
            "the TP size, TP <= num_query_groups)"
        )
    if getattr(config, "deterministic_mode", False) and (
            not torch.are_deterministic_algorithms_enabled()
            or torch.is_deterministic_algorithms_warn_only_enabled()):
        # The layer's non-Triton ops (flash/memory-efficient SDPA backward, index_add_ of the
        # reference backend, the backward of its gathers) take their deterministic CUDA form
        # only under torch's global switch, which a config field cannot turn on (ADR 0050).
        raise ValueError(
            "deterministic_mode=True needs torch.use_deterministic_algorithms(True) (not "
            "warn_only) before the layer is built, with CUBLAS_WORKSPACE_CONFIG=:4096:8 set "
            "before CUDA starts: the dense attention's and the reference backend's backward "
            "are deterministic only then (scripts/pretrain.py sets both for "
            "model.deterministic_mode=true, as Megatron-LM's --deterministic-mode does)")
    # Index heads == KV heads is the topology's check (MSATopology.validate, run by the plan).
    return plan


class MSASelfAttention(SelfAttention):
    """MSA block-sparse self-attention (MiniMax-M3 style), or its dense-document sibling.

    Args:
        config: an MSATransformerConfig.
        submodules: linear_qkv, core_attention (MSACoreAttention), linear_proj, optional
            q_layernorm/k_layernorm, and ``indexer`` (None for a dense layer).
        layer_number: global 1-based layer number.
        attn_mask_type: causal (MSA is causal; the document map comes in ``attention_mask``).
        cp_comm_type: unused (MSA's context parallelism all-gathers K/V and index_k).
        pg_collection: process groups (``tp``, ``cp``).
        pp_layer_offset: Megatron's pipeline layer offset.
        name: module name.
        mtp_layer: the attention of a multi-token-prediction layer, whose ``layer_number`` is
            its depth (1, 2, ...): its indexer metrics are logged as layer
            ``num_layers + depth``, after the decoder's (Megatron's router numbers MTP layers
            so too).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MSASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
        mtp_layer: bool = False,
    ) -> None:
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        sparse = submodules.indexer is not None
        plan = check_msa_layer_config(
            config, get_pg_size(pg_collection.tp), get_pg_size(pg_collection.cp)
        )
        # The plan decides for the layer's own norms (q/k here, index q/k in the indexer) as for
        # its other helpers, when they are built.
        submodules = dataclasses.replace(
            submodules,
            q_layernorm=planned_norm(submodules.q_layernorm, plan.kernels.rms_norm),
            k_layernorm=planned_norm(submodules.k_layernorm, plan.kernels.rms_norm),
        )
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
            name=name,
        )
        self.is_msa_layer = sparse
        #: The layer number the indexer metrics are recorded under (MTP layers after the decoder).
        self.metrics_layer_number = layer_number + (config.num_layers if mtp_layer else 0)
        #: What this layer runs, resolved once (backend, kernels, indexer-loss route, topology);
        #: read per step.
        self.msa_plan = plan
        self.indexer = (
            build_module(
                submodules.indexer,
                config=config,
                layer_number=layer_number,
                pg_collection=pg_collection,
                fused_norms=plan.kernels.rms_norm,
            )
            if sparse
            else None
        )
        #: Under full recompute: the first forward's layout and selection, for the recompute.
        self.selection_replay = SelectionReplay()

    # ------------------------------------------------------------------ helpers
    def _token_rotary_freqs(
        self, rotary_pos_emb, msa, cp=None, sliced: bool = True
    ) -> torch.Tensor | None:
        """Per-token RoPE angles [Tq, 1, rot_dim] at the document positions of this rank's
        tokens (every token's without context parallelism), or None. ``sliced``: under CP a
        table of this rank's S / N rows is GPTModel's load-balanced slice (BSHD input; THD
        input gets the whole table)."""
        if rotary_pos_emb is None:
            return None
        if isinstance(rotary_pos_emb, tuple):
            q_emb, k_emb = rotary_pos_emb
            if q_emb is not k_emb:
                raise NotImplementedError(
                    "MSA attention needs one rotary table for queries and keys"
                )
            rotary_pos_emb = q_emb
        table = rotary_pos_emb.reshape(rotary_pos_emb.shape[0], rotary_pos_emb.shape[-1])
        if sliced and cp is not None and cp.cp_size > 1 and table.shape[0] == cp.seq_len_local:
            table = full_rotary_table(table, cp)
        if table.shape[0] < msa.max_seqlen:
            raise ValueError(
                f"the rotary table covers {table.shape[0]} positions but a document has "
                f"{msa.max_seqlen} tokens"
            )
        positions = query_rows(msa.document_positions, None if cp is None else cp.queries)
        return table[positions.long()].unsqueeze(1)

    def _compact_qkv(self, hidden_states: torch.Tensor, cp):
        query, key, value = self.get_query_key_value_tensors(hidden_states, None)
        # [s, b, heads, dim] -> compact [T, heads, dim] (this rank's tokens under CP)
        return tuple(cp.pack_local(x) for x in (query, key, value))

    def _core_attention(self, query, key, value, view, selection, byproducts: bool):
        """The core attention on the plan's kernels: ``(output, block mass or None)``; the mass
        (the sparse loss's target) only with ``byproducts``. Under selective recompute
        ("core_attn" in recompute_modules) only q/k/v are kept and the attention is redone in
        the backward, with the layout and the selection reused, not redone."""
        found = {}

        def run(q, k, v):
            out = self.core_attention(
                q, k, v, view, q2k=selection, plan=self.msa_plan, return_block_mass=byproducts,
            )
            if byproducts:
                # A recompute in the backward finds the same mass; the loss keeps the first.
                out, mass = out
                found.setdefault("block_mass", mass)
            return out

        if self.checkpoint_core_attention and self.training:
            core = tensor_parallel.checkpoint(run, False, query, key, value)
        else:
            core = run(query, key, value)
        return core, found.get("block_mass")

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        inference_context=None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        rotary_pos_cos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        sequence_len_offset: int | None = None,
        *,
        inference_params=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MSA (or dense-document) self-attention of one microbatch.

        Args:
            hidden_states: [s_local, b, hidden] (s_local = s / tp under sequence parallelism).
            attention_mask: the document map: int [b, s] document ids (0 = padding), bool
                [b, 1, s, s] block-causal (True = keep), or None (one document per row).
            key_value_states, inference_context, rotary_pos_cos, rotary_pos_sin,
            rotary_pos_cos_sin, attention_bias, packed_seq_params, sequence_len_offset,
            inference_params: Megatron's arguments; MSA refuses all but None.
            packed_seq_params: THD input (qkv_format "thd": hidden_states [t, 1, hidden], the
                document map from ``cu_seqlens_q`` / ``cu_seqlens_q_padded``), or None.
            rotary_pos_emb: GPTModel's rotary table [S, 1, 1, rot_dim] (or None); under context
                parallelism with BSHD input GPTModel hands this rank's [S / N, ...] slice, which
                is all-gathered once (cached on the table).

        Returns:
            ``(output [s_local, b, hidden], bias or None)`` as Megatron's attention.
        """
        check_runtime_arguments(
            inference_context=inference_context,
            inference_params=inference_params,
            key_value_states=key_value_states,
            packed_seq_params=packed_seq_params,
            attn_mask_type=self.attn_mask_type,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
        )
        if attention_bias is not None or rotary_pos_cos is not None or rotary_pos_sin is not None:
            raise NotImplementedError(
                "MSA attention does not take attention_bias or precomputed rotary cos/sin"
            )
        plan = self.msa_plan
        seq_local, batch = hidden_states.shape[0], hidden_states.shape[1]
        seq = seq_local * self.world_size if self.config.sequence_parallel else seq_local
        # Full recompute (ADR 0028): the first forward records its layout and selection, the
        # recompute takes them back instead of building and scoring again.
        replay = recompute_phase(self.config, self.training)
        anchor = document_map_anchor(attention_mask, packed_seq_params)
        entry = self.selection_replay.take(anchor, seq, batch) if replay == REPLAY else None
        cp = entry.layout if entry is not None else context_parallel_layout_for_layer(
            attention_mask, packed_seq_params, batch, seq, hidden_states.device, plan.topology,
            self.pg_collection.cp,
        )
        view = cp.view  # the layout with this rank's queries: what the ops take
        msa = view.msa

        query, key, value = self._compact_qkv(hidden_states, cp)
        freqs = self._token_rotary_freqs(
            rotary_pos_emb, msa, cp, sliced=packed_seq_params is None
        )
        # cos/sin of the angles once for q, k, index_q and index_k (same bits as Megatron's).
        rope = rope_factors(freqs, self.config, fused=plan.kernels.rope,
                            te_fused=plan.kernels.te_rope)
        if rope is not None:
            query = apply_rope(query, rope, self.config, self.pg_collection.cp)
            key = apply_rope(key, rope, self.config, self.pg_collection.cp)
        # Queries stay local; every rank's keys and values (global compact order) travel.
        key, value = cp.gather(key), cp.gather(value)

        step = IndexerStep.of(plan, self.config, is_msa_layer=self.is_msa_layer,
                              training=self.training, recording=replay == RECORD)
        replayed = entry.selection if entry is not None and step.sparse else None
        selected = index_q = index_k = None
        if step.indexes:
            if replayed is None or step.need_loss:
                index_q, index_k = self.indexer(hidden_states, cp, freqs, rope=rope)
            if step.selects:
                selected = replayed if replayed is not None else select(
                    index_q.detach(), index_k.detach(), view, top_k=plan.topology.top_k,
                    score=plan.topology.score_type, plan=plan,
                )
        if replay == RECORD:
            self.selection_replay.record(
                anchor, ReplayEntry(cp, selected if step.sparse else None, seq, batch)
            )
        core, block_mass = self._core_attention(
            query, key, value, view, selected if step.sparse else None, step.byproducts
        )
        if step.need_loss:
            loss, stats = indexer_loss(
                plan, step, self.config, index_q=index_q, index_k=index_k, query=query,
                key=key, selection=selected, block_mass=block_mass, view=view,
                softmax_scale=self.core_attention.softmax_scale,
            )
            MSAIndexerMetrics.record(self.metrics_layer_number, stats)
            core = MSAIndexerLossAutoScaler.apply(core, loss)

        # compact [T, heads, dim] -> [s, b, heads * dim], zeros at padding
        context = cp.unpack_local(core.reshape(core.shape[0], -1))
        output, bias = self.linear_proj(context)
        return output, bias
