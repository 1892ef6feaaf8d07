"""Core attention of MSA layers (and of the dense layers of a mixed pattern), on compact tokens.

Built by Megatron's ``Attention`` with the core-attention builder signature
(``config, layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale,
pg_collection``). Its forward takes compact tensors ([T, heads, dim], see ADR 0001) and the
microbatch layout, and either

- attends the selected key blocks (``q2k`` given): :func:`nemo_msa.sparse_attention` for bf16
  (the kernels' dtype); for other dtypes (fp32 CPU tests, fp64 checks) the reference masked
  dense path restricted to the same blocks, which computes the same function; or
- attends densely within documents (``q2k`` None: dense layers, the dense warm-up): torch's
  flash varlen kernel on CUDA in fp16/bf16 (the compact layout is its input format), else
  ``torch.nn.functional.scaled_dot_product_attention`` on [b, s] rows with a document-causal
  mask that the layout caches once per microbatch for all layers.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

__all__ = [
    "MSACoreAttention",
    "dense_document_attention",
    "dense_document_attention_rows",
    "document_causal_row_mask",
]


def document_causal_row_mask(msa) -> torch.Tensor:
    """bool [b, 1, s, s]: query i of a row keeps key j when both are in one document, j <= i.

    Padding queries keep only themselves (their output is zeroed later), so that no softmax row
    is empty: an all-masked row makes SDPA return NaN, and NaN would leak into dk/dv.
    Cached on the layout, so every layer of the microbatch shares one mask.
    """

    def make() -> torch.Tensor:
        b, s = msa.batch_size, msa.seq_len
        documents = msa.unpack(msa.token_documents.long() + 1)  # [b, s], 0 = padding
        same = documents[:, :, None] == documents[:, None, :]
        causal = torch.ones(s, s, dtype=torch.bool, device=msa.device).tril()
        eye = torch.eye(s, dtype=torch.bool, device=msa.device)
        real = documents[:, :, None] > 0
        keep = (same & causal & real) | (eye & ~real)
        return keep.view(b, 1, s, s)

    return msa.cached("nemo_msa.megatron.document_causal_row_mask", make)


def _varlen_attn():
    """torch's Flash-Attention varlen entry (CUDA, fp16/bf16), or None where torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    # Older torch releases ship varlen_attn without causal windows or GQA; use SDPA there.
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" not in parameters or "enable_gqa" not in parameters:
        return None
    return varlen_attn


def dense_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, msa, softmax_scale: float
) -> torch.Tensor:
    """Dense causal attention within documents on compact tokens (dense layers, warm-up).

    On CUDA with fp16/bf16 and a torch that has ``torch.nn.attention.varlen.varlen_attn``, the
    compact tokens are already the varlen layout (documents contiguous, ``msa.cu_seqlens``), so
    the flash kernel runs with causal windows and no mask; elsewhere (CPU, fp32 tests) the
    per-row SDPA path with a cached document-causal mask (O(b s^2) mask memory).

    Args:
        q: [T, Hq, d] compact queries.
        k: [T, Hkv, d] compact keys, Hq a multiple of Hkv.
        v: [T, Hkv, d] compact values.
        msa: the microbatch layout.
        softmax_scale: multiplies q.k.

    Returns:
        [T, Hq, d] in q's dtype.
    """
    varlen = _varlen_attn()
    if varlen is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return varlen(
            q,
            k,
            v,
            msa.cu_seqlens,
            msa.cu_seqlens,
            msa.max_seqlen,
            msa.max_seqlen,
            scale=softmax_scale,
            window_size=(-1, 0),
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return dense_document_attention_rows(q, k, v, msa, softmax_scale)


def dense_document_attention_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, msa, softmax_scale: float
) -> torch.Tensor:
    """Dense causal attention within documents, per [b, s] row (SDPA with a document mask).

    Args:
        q: [T, Hq, d] compact queries.
        k: [T, Hkv, d] compact keys, Hq a multiple of Hkv.
        v: [T, Hkv, d] compact values.
        msa: the microbatch layout.
        softmax_scale: multiplies q.k.

    Returns:
        [T, Hq, d] in q's dtype.
    """
    group = q.shape[1] // k.shape[1]
    # [T, H, d] -> [b, H, s, d]; query head hq reads KV head hq // group (Megatron's order).
    qb = msa.unpack(q).permute(0, 2, 1, 3)
    kb = msa.unpack(k).repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    vb = msa.unpack(v).repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    out = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=document_causal_row_mask(msa), scale=softmax_scale
    )
    return msa.pack(out.permute(0, 2, 1, 3))


class MSACoreAttention(MegatronModule):
    """Block-sparse (or dense, document-causal) core attention on compact tokens.

    Args:
        config: an MSATransformerConfig (msa_backend; attention_dropout must be 0).
        layer_number: the layer's number.
        attn_mask_type: causal or padding_causal (MSA is causal).
        attention_type: "self".
        cp_comm_type: unused (context parallelism is refused).
        softmax_scale: defaults to 1 / sqrt(kv_channels).
        pg_collection: process groups (``cp`` must have size 1).
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
        del cp_comm_type
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
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp is not None and get_pg_size(cp) > 1:
            raise NotImplementedError(
                f"MSA attention does not support context parallelism (cp size {get_pg_size(cp)})"
            )
        self.layer_number = layer_number
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.backend = getattr(config, "msa_backend", None)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        msa,
        q2k: torch.Tensor | None = None,
        return_block_mass: bool = False,
    ):
        """Attention over compact tokens.

        Args:
            query: [T, Hq_local, d].
            key: [T, Hkv_local, d].
            value: [T, Hkv_local, d].
            msa: the microbatch layout (:class:`nemo_msa.MSAMicrobatch`).
            q2k: int32 [Hkv_local, T, top_k] selected document-local blocks, or None for dense
                document-causal attention.
            return_block_mass: with ``q2k``, also return the attention mass per selected slot,
                fp32 [Hkv_local, T, top_k] (no gradient; the sparse indexer loss's target).

        Returns:
            [T, Hq_local, d] in query's dtype; with ``return_block_mass`` the pair
            ``(output, block_mass)``.
        """
        if q2k is None:
            if return_block_mass:
                raise ValueError("return_block_mass=True needs q2k (the selected blocks)")
            return dense_document_attention(query, key, value, msa, self.softmax_scale)
        if query.dtype == torch.bfloat16:
            from nemo_msa import sparse_attention

            return sparse_attention(
                query, key, value, q2k, msa, softmax_scale=self.softmax_scale,
                backend=self.backend, return_block_mass=return_block_mass,
            )
        # The kernels read bf16 only; other dtypes take the reference masked path, which is the
        # same function (keys restricted to the selected blocks), O(T^2) memory: tests only.
        from nemo_msa.attention import naive

        out = naive.dense_document_attention(
            query, key, value, msa, softmax_scale=self.softmax_scale, q2k=q2k
        )
        if not return_block_mass:
            return out
        with torch.no_grad():
            mass = naive.sparse_attention_forward_reference(
                query.detach(), key.detach(), value.detach(), q2k, msa, self.softmax_scale,
                return_block_mass=True,
            )[2]
        return out, mass.float()
