"""The public MSA ops: block selection and block-sparse attention, their validation and autograd.

- :func:`select_blocks`: index scorer + top-k block selection (no gradient);
- :func:`sparse_attention`: differentiable attention over the selected key blocks;
- :func:`select`: the same, as a :class:`~nemo_msa.q2k.Selection` (the q2k with its canonical
  flag and the kernels' state of it);
- :func:`document_attention`: a layer's core attention on compact tokens, sparse over the
  selected blocks or dense within documents (what ``MSACoreAttention`` runs).

Each op checks its arguments, rejects CUDA-graph capture and calls a backend: a layer passes its
plan (nemo_msa.plan: the backend resolved and checked against its capability record once, at
construction, and the kernels it runs), whose fields the ops hand to the backend; a direct
user names a backend (or passes a resolved :class:`~nemo_msa.backends.spec.MSABackend`), which
the registry resolves for this call and shape, and the backend then chooses its kernels per
call. The layout may come with a query subset, as a :class:`~nemo_msa.query_view.QueryView`
(the layer's) or as ``queries=`` (a direct user's). The layer below (ADR 0017) is the layout,
the kernels and the references; nothing here is imported by them.
"""

from __future__ import annotations

import math

import torch

from nemo_msa.attention.dense import dense_document_attention, validate_qkv
from nemo_msa.backends.registry import MSABackend, resolve_backend
from nemo_msa.layout import MSAMicrobatch, query_rows, validate_queries
from nemo_msa.limits import SUPPORTED_SCORE_TYPES, require_float_tensor, require_integer
from nemo_msa.plan import MSAPlan
from nemo_msa.q2k import Selection, canonical_q2k
from nemo_msa.query_view import QueryView
from nemo_msa.support import reject_cuda_graph_capture

__all__ = [
    "document_attention",
    "select",
    "select_blocks",
    "sparse_attention",
    "validate_attention_inputs",
    "validate_q2k",
    "validate_selection_inputs",
]


def validate_selection_inputs(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    msa: MSAMicrobatch,
    top_k: int,
    score: str,
    queries: torch.Tensor | None = None,
) -> None:
    """Checks selection inputs before dispatch (``queries``: an optional query subset).

    Raises:
        TypeError: index_q or index_k is not a tensor.
        ValueError: names the argument, its value and what was expected.
    """
    require_float_tensor("index_q", index_q, "[tokens, index_heads, dim]")
    require_float_tensor("index_k", index_k, "[tokens, dim]")
    if index_q.dim() != 3:
        raise ValueError(
            f"index_q must be a float tensor [tokens, index_heads, dim]; got {index_q.dtype} "
            f"{tuple(index_q.shape)}"
        )
    if index_k.dtype != index_q.dtype or index_k.dim() != 2:
        raise ValueError(
            f"index_k must be [tokens, dim] with index_q's dtype {index_q.dtype}; got "
            f"{index_k.dtype} {tuple(index_k.shape)}"
        )
    num_queries = msa.num_tokens if queries is None else queries.shape[0]
    if index_q.shape[0] != num_queries or index_k.shape[0] != msa.num_tokens:
        raise ValueError(
            f"index_q {tuple(index_q.shape)} and index_k {tuple(index_k.shape)} must have "
            f"{num_queries} and tokens={msa.num_tokens} rows (the query subset's and the "
            "layout's num_tokens)"
        )
    validate_queries(queries, msa, index_q.shape[0])
    if index_k.shape[1] != index_q.shape[2]:
        raise ValueError(
            f"index_k dim {index_k.shape[1]} != index_q dim {index_q.shape[2]}"
        )
    if index_q.device != msa.device or index_k.device != msa.device:
        raise ValueError(
            f"index_q ({index_q.device}), index_k ({index_k.device}) and the layout "
            f"({msa.device}) must share one device"
        )
    require_integer("top_k", top_k)
    if top_k < 1:
        raise ValueError(f"top_k={top_k}; expected top_k >= 1")
    if score not in SUPPORTED_SCORE_TYPES:
        raise ValueError(f"score={score!r}; expected one of {SUPPORTED_SCORE_TYPES}")
    init_blocks, local_blocks = msa.forced_blocks
    if init_blocks + local_blocks > top_k:
        raise ValueError(
            f"init_blocks + local_blocks = {init_blocks} + {local_blocks} exceeds top_k={top_k}; "
            "forced blocks count inside the top-k"
        )


def _backend_for(backend: str | MSABackend | None, plan: MSAPlan | None, device: torch.device,
                 **shape) -> MSABackend:
    """The plan's backend (resolved and checked at construction), a resolved backend as it is,
    else the registry's choice for this call (a name, ``"auto"`` or None), asked for ``shape``."""
    if plan is not None:
        if backend is not None and backend is not plan.backend:
            raise ValueError(f"backend={getattr(backend, 'name', backend)!r} and plan= were "
                             "both given; the plan names the backend (pass one of them)")
        return plan.backend
    if isinstance(backend, MSABackend):
        return backend
    return resolve_backend(backend, device, **shape)


@torch.no_grad()
def select(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    msa: MSAMicrobatch | QueryView,
    *,
    top_k: int = 16,
    score: str = "max",
    backend: str | MSABackend | None = None,
    queries: torch.Tensor | None = None,
    plan: MSAPlan | None = None,
) -> Selection:
    """:func:`select_blocks` as a :class:`~nemo_msa.q2k.Selection`: the q2k marked canonical,
    which :func:`sparse_attention` takes without bringing it to the canonical form again, and
    which carries the forward's union lists to the backward. Arguments as
    :func:`select_blocks`'s."""
    view = QueryView.of(msa, queries)
    validate_selection_inputs(index_q, index_k, view.msa, top_k, score, view.queries)
    reject_cuda_graph_capture("select_blocks")
    chosen = _backend_for(
        backend, plan, index_q.device, score_type=score, index_head_dim=index_q.shape[-1],
        block_size=view.msa.block_size, top_k=top_k, dtype=index_q.dtype,
    )
    if view.queries is not None:
        _require_query_subset(chosen, "select_blocks")
    init_blocks, local_blocks = view.msa.forced_blocks
    q2k = chosen.select_blocks(
        index_q.contiguous(), index_k.contiguous(), view, top_k=top_k,
        init_blocks=init_blocks, local_blocks=local_blocks, score=score,
    )
    # Canonical by construction: sparse_attention takes it as it is.
    return Selection(q2k, view.msa.block_size, canonical=True)


def select_blocks(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    msa: MSAMicrobatch | QueryView,
    *,
    top_k: int = 16,
    score: str = "max",
    backend: str | MSABackend | None = None,
    queries: torch.Tensor | None = None,
    plan: MSAPlan | None = None,
) -> torch.Tensor:
    """Chooses top_k key blocks per index head and query token, inside the query's document.

    Forced blocks (``msa.forced_blocks`` = (init_blocks, local_blocks)) are always chosen and
    count inside top_k; the rest go by the block score (max of q.k over the block's causally
    visible keys), ties to the lower block id, NaN last.

    Args:
        index_q: [T, H, d] float (bf16 in production) index queries; head h serves KV head h
            ([Tq, H, d] with a query subset).
        index_k: [T, d] the one shared index key head, index_q's dtype (every token).
        msa: the batch layout, or a :class:`~nemo_msa.query_view.QueryView` (a layout with a
            query subset).
        top_k: blocks per query, within the backend's range (1..32).
        score: ``"max"`` or ``"lse"``.
        backend: a resolved backend, or a name or "auto"/None resolved for this call.
        queries: optional int64 [Tq], the global compact rows of index_q's tokens (a query
            subset, ascending and unique: context parallelism's local queries); the outputs
            then have Tq token rows. None = every token (unchanged). A backend without the
            query-subset mode refuses it (NotImplementedError naming the backend).
        plan: a layer's :class:`~nemo_msa.plan.MSAPlan` (its backend), instead of ``backend``.

    Returns:
        int32 [H, T, top_k]: ascending document-local block ids, padded with -1 at the tail when
        fewer than top_k blocks exist. Canonical: equal across correct implementations on inputs
        without ties. :func:`select` returns it as a :class:`~nemo_msa.q2k.Selection`, which
        :func:`sparse_attention` need not bring to the canonical form.

    Raises:
        ValueError: a bad argument (named).
    """
    return select(index_q, index_k, msa, top_k=top_k, score=score, backend=backend,
                  queries=queries, plan=plan).q2k


def validate_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q2k: torch.Tensor,
    msa: MSAMicrobatch,
    *,
    queries: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> None:
    """Checks arguments and shapes before any kernel runs (the dtypes a backend reads are its
    capability record's, checked where the backend is resolved). ``queries``: an optional query
    subset: q and q2k then have its Tq token rows, k and v every token's. The checks of q, k, v
    and the softmax scale are :func:`nemo_msa.attention.dense.validate_qkv`'s, shared with the
    dense path.

    Raises:
        TypeError: a tensor argument that is not a tensor, a softmax scale that is not a number.
        ValueError: shapes, dtypes or devices that disagree, a non-float q/k/v, a zero-sized
            head count or head dim, a non-finite or non-positive softmax scale; the message
            names the argument and its value or shape.
    """
    validate_qkv(q, k, v, msa, queries, softmax_scale)
    if not isinstance(q2k, torch.Tensor):
        raise TypeError(f"q2k must be an int32 torch.Tensor [kv_heads, tokens, top_k]; got "
                        f"{type(q2k).__name__}")
    if q2k.dtype != torch.int32 or q2k.dim() != 3:
        raise ValueError(
            f"q2k must be int32 [kv_heads, tokens, top_k]; got {q2k.dtype} {tuple(q2k.shape)}"
        )
    if q2k.shape[0] != k.shape[1] or q2k.shape[1] != q.shape[0]:
        raise ValueError(
            f"q2k {tuple(q2k.shape)} must be [kv_heads={k.shape[1]}, tokens={q.shape[0]}, top_k]"
        )
    devices = {x.device for x in (q, k, v, q2k)} | {msa.device}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, q2k and the layout must share one device; got {devices}")


def validate_q2k(
    q2k: torch.Tensor, msa: MSAMicrobatch, queries: torch.Tensor | None = None
) -> None:
    """Reject a q2k that is not in the canonical form ``select_blocks`` returns.

    Canonical: per (KV head, token), document-local block ids in ``0..own block`` (the token's
    own block), strictly ascending, then -1 padding. Every backend gives a non-canonical q2k its
    set meaning (MSA_SPEC.md); this opt-in check (``sparse_attention(validate=True)``) finds
    hand-made or transformed q2k that was not meant to be non-canonical. Costs a few passes
    over q2k and one host synchronization.

    Raises:
        ValueError: naming the first bad (head, token, slot) in row-major order, its value and
            the rule it breaks.
    """
    own = (query_rows(msa.document_positions, queries).long() // msa.block_size)[None, :, None]
    ids = q2k.long()
    prev = torch.full_like(ids, -1)
    prev[..., 1:] = ids[..., :-1]
    real = ids != -1
    out_of_range = real & ((ids < 0) | (ids > own))
    after_padding = real & (prev == -1) & (torch.arange(ids.shape[-1], device=ids.device) > 0)
    not_ascending = real & (prev != -1) & (ids <= prev)
    bad = out_of_range | after_padding | not_ascending
    first = bad.flatten().nonzero()
    if first.numel() == 0:
        return
    h, t, slot = (int(i) for i in torch.unravel_index(first[0, 0], bad.shape))
    value, own_block = int(ids[h, t, slot]), int(own[0, t, 0])
    if out_of_range[h, t, slot]:
        reason = f"outside 0..{own_block} (the token's own block)"
    elif after_padding[h, t, slot]:
        reason = "a block id after -1 padding (-1 belongs only at the tail)"
    elif value == int(ids[h, t, slot - 1]):
        reason = f"a duplicate of slot {slot - 1}"
    else:
        reason = f"not above slot {slot - 1} ({int(ids[h, t, slot - 1])}): ids must ascend"
    raise ValueError(
        f"q2k[{h}, {t}, {slot}] = {value} (head {h}, token {t}, slot {slot}) is {reason}; "
        "expected select_blocks's canonical form: block ids in 0..own block, strictly "
        "ascending, then -1"
    )


def _require_query_subset(backend: MSABackend, op: str) -> None:
    """Refuses ``queries`` on a backend without the query-subset mode."""
    if not backend.capabilities.query_subset:
        raise NotImplementedError(
            f"{op}(queries=...): the {backend.name!r} backend has no query-subset mode (context "
            "parallelism's local queries against every token's keys); use backend='reference'"
        )


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, selection: Selection, view: QueryView, softmax_scale,
                backend: MSABackend, kernels, block_mass: bool):
        # The plan's kernels (a layer's); None: the backend chooses per call (a direct user).
        forward = None if kernels is None else (
            kernels.mass_forward if block_mass else kernels.forward)
        result = backend.attention_forward(q, k, v, selection, view, softmax_scale,
                                           return_block_mass=block_mass, kernel=forward)
        out, lse = result[:2]
        mass = result[2].float() if block_mass else lse.new_empty(0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.selection = selection
        ctx.view = view
        ctx.softmax_scale = softmax_scale
        ctx.backend = backend
        ctx.dkdv = None if kernels is None else kernels.dkdv
        ctx.mark_non_differentiable(lse, mass)
        return out, lse, mass

    @staticmethod
    def backward(ctx, dout, _dlse, _dmass):
        q, k, v, out, lse = ctx.saved_tensors
        ctx.selection.check_intact()
        dq, dk, dv = ctx.backend.attention_backward(
            dout.contiguous(), q, k, v, out, lse, ctx.selection, ctx.view, ctx.softmax_scale,
            dkdv=ctx.dkdv,
        )
        return dq, dk, dv, None, None, None, None, None, None


def _canonical_selection(q2k: torch.Tensor | Selection, view: QueryView,
                         validated: bool) -> Selection:
    """The selection the backends read: canonical and contiguous. A canonical
    :class:`Selection` as it is; any other q2k brought to the canonical form (one meaning for
    every backend, MSA_SPEC.md), except one ``validate`` found canonical already."""
    msa = view.msa
    if isinstance(q2k, Selection):
        q2k.check_intact()
        if q2k.block_size != msa.block_size:
            raise ValueError(
                f"q2k holds ids of {q2k.block_size}-token blocks (from select_blocks with that "
                f"layout) but the layout's block_size is {msa.block_size}; select with the same "
                "layout"
            )
        if q2k.canonical and q2k.q2k.is_contiguous():
            return q2k
        validated = validated or q2k.canonical
        q2k = q2k.q2k
    if validated:
        return Selection(q2k.contiguous(), msa.block_size, canonical=True)
    return Selection(canonical_q2k(q2k, msa, view.queries), msa.block_size, canonical=True)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q2k: torch.Tensor | Selection,
    msa: MSAMicrobatch | QueryView,
    *,
    softmax_scale: float | None = None,
    backend: str | MSABackend | None = None,
    return_lse: bool = False,
    return_block_mass: bool = False,
    validate: bool = False,
    queries: torch.Tensor | None = None,
    plan: MSAPlan | None = None,
):
    """Block-sparse causal attention within documents (differentiable in q, k, v).

    Args:
        q: [T, Hq, d] compact queries, a dtype of the backend's record (bf16 for the kernels;
            the reference also fp16, fp32, fp64).
        k: [T, Hkv, d] compact keys, q's dtype; Hq is a multiple of Hkv.
        v: [T, Hkv, d] compact values, q's dtype.
        q2k: int32 [Hkv, T, top_k] document-local block ids per KV head and query, -1 unused
            (from :func:`select_blocks`), or a :class:`~nemo_msa.q2k.Selection` (from
            :func:`select`: taken without a canonical pass).
        msa: the batch layout, or a :class:`~nemo_msa.query_view.QueryView` (with a query
            subset).
        softmax_scale: defaults to 1 / sqrt(d).
        backend: a resolved backend, or a name or "auto"/None resolved for this call (see
            nemo_msa.backends.registry); the backend then chooses its kernels per call.
        return_lse: also return the fp32 [Hq, T] log-sum-exp.
        return_block_mass: also return the attention mass per selected slot, fp32
            [Hkv, T, top_k] (no gradient): the softmax probability of the slot's keys summed,
            averaged over the group's query heads, 0 at -1 slots; accumulated in the forward's
            pass over K/V (the target of the sparse indexer loss).
        validate: reject a q2k that is not in select_blocks's canonical form (see
            :func:`validate_q2k`; one host synchronization). Without it any q2k means its set:
            per (KV head, token) the distinct ids in 0..own block (MSA_SPEC.md).
        queries: optional int64 [Tq], the global compact rows of q's tokens (a query subset,
            ascending and unique: context parallelism's local queries); q, q2k, the output,
            LSE and mass then have Tq token rows, k and v every token's (dk/dv hold the local
            queries' share). None = every token (unchanged). A backend without the
            query-subset mode refuses it (NotImplementedError naming the backend).
        plan: a layer's :class:`~nemo_msa.plan.MSAPlan`, instead of ``backend``: its backend
            runs the kernels it names (:class:`~nemo_msa.plan.MSAKernels`), and a call they do
            not take is refused, naming the field.

    Returns:
        [T, Hq, d] output in q's dtype, then the LSE and the block mass when asked (in that
        order).

    Raises:
        TypeError: a tensor argument that is not a tensor, or a softmax_scale that is not a
            real number (e.g. a string).
        ValueError: a dtype or shape the named backend cannot run (naming the field),
            disagreeing shapes, dtypes or devices, an integer or bool q/k/v, a zero-sized head
            count or head dim, a non-finite or non-positive softmax_scale; with ``validate``, a
            non-canonical q2k (naming the first bad head, token and slot).
        RuntimeError: called during CUDA-graph capture.
    """
    view = QueryView.of(msa, queries)
    ids = q2k.q2k if isinstance(q2k, Selection) else q2k
    validate_attention_inputs(q, k, v, ids, view.msa, queries=view.queries,
                              softmax_scale=softmax_scale)
    if validate:
        validate_q2k(ids, view.msa, view.queries)
    selection = _canonical_selection(q2k, view, validate)
    reject_cuda_graph_capture("sparse_attention")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    chosen = _backend_for(
        backend, plan, q.device, head_dim=q.shape[-1], block_size=view.msa.block_size,
        top_k=ids.shape[-1], dtype=q.dtype,
    )
    if view.queries is not None:
        _require_query_subset(chosen, "sparse_attention")
    out, lse, mass = _SparseAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), selection, view, scale, chosen,
        None if plan is None else plan.kernels, return_block_mass,
    )
    extra = ((lse,) if return_lse else ()) + ((mass,) if return_block_mass else ())
    return (out, *extra) if extra else out


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    msa: MSAMicrobatch | QueryView,
    *,
    softmax_scale: float,
    q2k: torch.Tensor | Selection | None = None,
    backend: str | MSABackend | None = None,
    return_block_mass: bool = False,
    queries: torch.Tensor | None = None,
    plan: MSAPlan | None = None,
):
    """Causal attention within documents on compact tokens: a layer's core attention.

    - ``q2k`` given: attends the selected key blocks, :func:`sparse_attention` on the backend
      (whose capability record holds the dtypes it reads: the reference runs fp32/fp64 too);
    - ``q2k`` None (dense layers, the dense warm-up): dense within documents,
      :func:`nemo_msa.attention.dense.dense_document_attention` (ADR 0012), on the plan's
      path (:attr:`~nemo_msa.plan.MSAKernels.dense_attention`; without a plan chosen per call).

    Args:
        query: [T, Hq, d].
        key: [T, Hkv, d].
        value: [T, Hkv, d].
        msa: the batch layout, or a :class:`~nemo_msa.query_view.QueryView` (the layer's).
        softmax_scale: the softmax scale.
        q2k: int32 [Hkv, T, top_k] selected document-local blocks or a
            :class:`~nemo_msa.q2k.Selection`, or None for dense attention.
        backend: the sparse path's backend: resolved, or a name or "auto"/None resolved for
            this call (without ``plan``).
        return_block_mass: with ``q2k``, also return the attention mass per selected slot, fp32
            [Hkv, T, top_k] (no gradient; the sparse indexer loss's target).
        queries: optional int64 [Tq] global compact rows of query's tokens (a query subset:
            context parallelism); query and q2k then have Tq rows, key and value every token's.
        plan: the layer's :class:`~nemo_msa.plan.MSAPlan`: the backend and the kernels, sparse
            and dense, it names.

    Returns:
        [T, Hq, d] ([Tq, Hq, d]) in query's dtype; with ``return_block_mass`` the pair
        ``(output, mass)``.

    Raises:
        ValueError: ``return_block_mass`` without ``q2k``, or what the chosen path raises.
    """
    view = QueryView.of(msa, queries)
    if q2k is None:
        if return_block_mass:
            raise ValueError("return_block_mass=True needs q2k (the selected blocks)")
        return dense_document_attention(
            query, key, value, view.msa, softmax_scale, queries=view.queries,
            path=None if plan is None else plan.kernels.dense_attention,
        )
    return sparse_attention(
        query, key, value, q2k, view, softmax_scale=softmax_scale, backend=backend,
        return_block_mass=return_block_mass, plan=plan,
    )
