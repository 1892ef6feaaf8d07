"""Core attention of MSA layers (and of the dense layers of a mixed pattern): the Megatron module.

Built by Megatron's ``Attention`` with the core-attention builder signature
(``config, layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale,
pg_collection``), it checks what Megatron hands it and holds the softmax scale (and the backend
name, for use on its own; ``MSASelfAttention`` passes its plan). Its forward
takes compact tensors ([T, heads, dim], see ADR 0001) and the microbatch layout and runs
:func:`nemo_msa.ops.document_attention`: the selected key blocks when ``q2k`` is given
(:func:`nemo_msa.sparse_attention` on the backend), else dense within documents
(:func:`nemo_msa.attention.dense.dense_document_attention`, ADR 0012).
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_msa.backends.spec import MSABackend
from nemo_msa.layout import MSAMicrobatch
from nemo_msa.limits import require_softmax_scale
from nemo_msa.ops import document_attention
from nemo_msa.plan import MSAPlan
from nemo_msa.q2k import Selection
from nemo_msa.query_view import QueryView

__all__ = ["MSACoreAttention"]


class MSACoreAttention(MegatronModule):
    """Block-sparse (or dense, document-causal) core attention on compact tokens.

    Args:
        config: an MSATransformerConfig (msa_backend; attention_dropout must be 0).
        layer_number: the layer's number.
        attn_mask_type: causal or padding_causal (MSA is causal).
        attention_type: "self".
        cp_comm_type: unused (MSA's context parallelism all-gathers K/V in the layer, whatever
            Megatron's comm type).
        softmax_scale: defaults to 1 / sqrt(kv_channels).
        pg_collection: unused (the layer's plan checks the process groups; the layer gathers
            K/V over ``cp``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        del cp_comm_type, pg_collection
        if attention_type != "self":
            raise NotImplementedError(
                f"MSA core attention is self-attention only; attention_type={attention_type!r}"
            )
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(
                f"MSA core attention is causal; attn_mask_type={attn_mask_type.name} is not "
                "supported"
            )
        if config.attention_dropout:
            raise ValueError(
                f"attention_dropout={config.attention_dropout}: MSA core attention has no "
                "attention dropout; set attention_dropout=0.0"
            )
        require_softmax_scale(softmax_scale)  # at construction, not at the first forward
        self.layer_number = layer_number
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.backend = getattr(config, "msa_backend", None)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        msa: MSAMicrobatch | QueryView,
        q2k: torch.Tensor | Selection | None = None,
        plan: MSAPlan | None = None,
        return_block_mass: bool = False,
        backend: MSABackend | str | None = None,
    ):
        """Attention over compact tokens (this rank's queries against every token's keys under
        context parallelism).

        Args:
            query: [T, Hq_local, d] ([Tq, ...] with a query subset).
            key: [T, Hkv_local, d] (every token's).
            value: [T, Hkv_local, d].
            msa: the microbatch layout (:class:`nemo_msa.MSAMicrobatch`), or its
                :class:`nemo_msa.QueryView` (``MSASelfAttention`` passes the context-parallel
                layout's: the layout with this rank's queries).
            q2k: the selected document-local blocks, a :class:`nemo_msa.Selection` (the
                layer's) or an int32 [Hkv_local, Tq, top_k] tensor; None for dense
                document-causal attention.
            plan: the layer's :class:`nemo_msa.plan.MSAPlan` (``MSASelfAttention`` passes
                ``msa_plan``): its backend and the kernels it names, sparse and dense.
            return_block_mass: with ``q2k``, also return the attention mass per selected slot,
                fp32 [Hkv_local, Tq, top_k] (no gradient; the sparse indexer loss's target).
            backend: without ``plan``, the backend (None: ``config.msa_backend``, resolved per
                call; a core attention used on its own).

        Returns:
            [T, Hq_local, d] in query's dtype; with ``return_block_mass`` the pair
            ``(output, block_mass)``.
        """
        if plan is None and backend is None:
            backend = self.backend
        return document_attention(
            query, key, value, msa, softmax_scale=self.softmax_scale, q2k=q2k,
            backend=backend, return_block_mass=return_block_mass, plan=plan,
        )
