"""Dense causal attention within documents on compact tokens (dense layers, the dense warm-up).

Two paths compute one function, ``out(p, hq) = sum over keys j <= p of p's document of
softmax_j(q(p, hq) . k(j, g) * scale) v(j, g)`` with ``g = hq // (Hq / Hkv)``:

- :func:`dense_document_attention_per_document` (CUDA, fp16/bf16): one
  ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` per run of consecutive
  documents of one length, on [n, H, length, d] views of the compact tensors (documents are
  contiguous in the compact order, so a run of n equal-length documents is a free view). cuDNN
  is preferred, then flash, then memory-efficient, whichever accepts the shape; under
  ``torch.use_deterministic_algorithms(True)`` flash, then memory-efficient (cuDNN's backward
  is not deterministic; :func:`gpu_sdpa_backends`, ADR 0050). No [s, s] mask,
  no copy of K/V per query head; the plan comes from the layout's host-side document lengths
  (read in the layout's one synchronization), so nothing here waits on the device.
- :func:`dense_document_attention_rows` (CPU, fp32/fp64, tests): SDPA per [b, s] row with a
  document-causal mask that the layout caches once per microbatch, K/V repeated per head.

:func:`dense_document_attention` picks between them. With a query subset (``queries``, context
parallelism: local queries against the gathered keys) both devices take
:func:`dense_document_attention_queries`: one SDPA per run of consecutive local queries of one
document, against that document's keys up to the run's last query, with the causal diagonal
aligned to the lower right (``causal_lower_right``), so no [s, s] mask either.
Every path runs the SDPA kernels on finite K and V and sets to NaN afterwards the rows that
attend a non-finite key or value (:mod:`nemo_msa.attention.finite`): the kernels multiply
masked zero probabilities with values the query does not see, so a NaN would otherwise reach
other rows and documents (ADR 0025).
See docs/adr/0012-dense-document-attention.md and 0020-context-parallelism.md.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from nemo_msa import unplanned
from nemo_msa.attention.finite import finite_keys_and_values, mark_attending_rows
from nemo_msa.layout import MSAMicrobatch, validate_queries
from nemo_msa.limits import require_float_tensor, require_softmax_scale
from nemo_msa.tensor_memo import TensorMemo

__all__ = [
    "DETERMINISTIC_SDPA_BACKENDS",
    "GPU_SDPA_BACKENDS",
    "DocumentRun",
    "QueryRun",
    "dense_attention_runs",
    "dense_document_attention",
    "dense_document_attention_per_document",
    "dense_document_attention_queries",
    "dense_document_attention_rows",
    "document_causal_row_mask",
    "gpu_sdpa_backends",
    "document_runs",
    "query_runs",
    "padded_length",
    "validate_qkv",
]

# The SDPA kernels of the GPU path, in order of preference (cuDNN was about 1.65x faster than
# flash for causal GQA 64/4 heads d128 on the H200, torch 2.11).
GPU_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
)

# The GPU path's SDPA kernels under torch.use_deterministic_algorithms(True): torch then runs
# flash's and memory-efficient's backward in their deterministic form (one key split, no atomic
# dq accumulation) and refuses cuDNN's, which has none. Flash takes head dims up to 256 and
# memory-efficient any multiple of 8, so every shape cuDNN accepts still has a kernel.
DETERMINISTIC_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
)

# torch >= 2.6 takes set_priority (try the backends in the order given); older releases try
# them in torch's own order.
_HAS_SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def gpu_sdpa_backends() -> tuple[SDPBackend, ...]:
    """The SDPA kernels of the GPU path now: :data:`DETERMINISTIC_SDPA_BACKENDS` while
    ``torch.use_deterministic_algorithms`` is on (``model.deterministic_mode``), else
    :data:`GPU_SDPA_BACKENDS`."""
    if torch.are_deterministic_algorithms_enabled():
        return DETERMINISTIC_SDPA_BACKENDS
    return GPU_SDPA_BACKENDS


@dataclass(frozen=True)
class DocumentRun:
    """Consecutive documents of one length: one batched SDPA call.

    Attributes:
        start: compact row of the run's first token.
        count: documents in the run.
        length: tokens per document.
    """

    start: int
    count: int
    length: int


def document_runs(msa: MSAMicrobatch) -> tuple[DocumentRun, ...]:
    """Groups the layout's documents into runs of consecutive documents of one length.

    Host-only (it reads ``msa.document_lengths``), cached on the layout so every layer of the
    microbatch shares one plan. One document per row with rows of one length is one run; many
    short documents of one length packed back to back are one run.

    Args:
        msa: the microbatch layout.

    Returns:
        The runs in compact order; their tokens cover [0, T) exactly.

    Raises:
        ValueError: a layout without host document lengths (built by hand, not by
            :meth:`MSAMicrobatch.build`), or lengths that do not add up to ``num_tokens``.
    """

    def make() -> tuple[DocumentRun, ...]:
        lengths = msa.checked_document_lengths()
        runs: list[DocumentRun] = []
        start = 0
        for length in lengths:
            last = runs[-1] if runs else None
            if last is not None and last.length == length:
                runs[-1] = DocumentRun(last.start, last.count + 1, length)
            else:
                runs.append(DocumentRun(start, 1, length))
            start += length
        return tuple(runs)

    return msa.cached("nemo_msa.attention.dense.document_runs", make)


#: Padded lengths per doubling of the document length (see :func:`padded_length`).
PADDED_LENGTHS_PER_OCTAVE = 8


def padded_length(length: int) -> int:
    """The length a document is padded to for the GPU's SDPA call: the next multiple of
    ``max(64, 2**floor(log2(length)) / 8)``, so at most 8 lengths per doubling.

    Why: cuDNN plans one graph per shape, and a new shape costs about 120 ms on the H200 (torch
    2.11; ADR 0012), more than the attention of a document of 16k tokens.
    Packed batches bring new document lengths every step; rounded up to a few lengths, every
    shape is planned once per process. Causal attention is unchanged by keys appended after a
    document's last query, so the padded tail only costs its compute: at most (1 + 1/8)^2 - 1 =
    27% for a document just past a boundary, none for lengths on one (4096, 32768, 131072).

    Args:
        length: tokens of the document (>= 1).

    Returns:
        The padded length, >= ``length``.
    """
    step = max(64, (1 << (max(1, length).bit_length() - 1)) // PADDED_LENGTHS_PER_OCTAVE)
    return -(-length // step) * step


def _backend_preference(backends: Sequence[SDPBackend] | None):
    """The ``sdpa_kernel`` context that tries ``backends`` in the order given (None:
    :func:`gpu_sdpa_backends`)."""
    if backends is None:
        backends = gpu_sdpa_backends()
    if _HAS_SET_PRIORITY:
        return sdpa_kernel(list(backends), set_priority=True)
    return sdpa_kernel(list(backends))


def _causal_gqa_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Causal SDPA with GQA (query head h reads KV head h // (Hq / Hkv)).

    Args:
        q: [n, Hq, L, d] queries (any strides with the last dim contiguous).
        k: [n, Hkv, L, d] keys in q's dtype.
        v: [n, Hkv, L, d] values in q's dtype.
        softmax_scale: multiplies q.k.

    Returns:
        [n, Hq, L, d] in q's dtype.
    """
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def dense_document_attention_per_document(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    msa: MSAMicrobatch,
    softmax_scale: float,
    backends: Sequence[SDPBackend] | None = None,
    pad_to: Callable[[int], int] | None = padded_length,
) -> torch.Tensor:
    """Dense causal attention within documents, one SDPA call per run of equal-length documents.

    Each run of ``n`` consecutive documents of ``L`` tokens is a [n, H, L, d] view of the compact
    tensors (no copy of q, k, v), attended with ``is_causal=True, enable_gqa=True``: no mask and
    no K/V repeated per query head. Where ``pad_to(L) > L`` the run's tokens are copied into
    [n, H, pad_to(L), d] with zero rows after each document (causal attention of the real
    queries is unchanged; their outputs are sliced back), so that packed batches of ever new
    document lengths reuse a few planned shapes (:func:`padded_length`). Runs the same on the
    CPU (torch's CPU flash kernel, any float dtype), which is how the tests exercise it.

    Args:
        q: [T, Hq, d] compact queries (bf16/fp16 on CUDA; any float dtype on the CPU).
        k: [T, Hkv, d] compact keys in q's dtype, Hq a multiple of Hkv.
        v: [T, Hkv, d] compact values in q's dtype.
        msa: the microbatch layout (its host ``document_lengths`` give the plan).
        softmax_scale: multiplies q.k.
        backends: SDPA backends in order of preference (None: :func:`gpu_sdpa_backends`).
        pad_to: the padded length of a document of a given length, or None for none.

    Returns:
        [T, Hq, d] in q's dtype.

    Raises:
        ValueError: shapes that disagree with each other or with the layout.
    """
    validate_qkv(q, k, v, msa, softmax_scale=softmax_scale)
    # SDPA runs on finite K and V; the rows that attend a non-finite one are marked after.
    k, v, reached = finite_keys_and_values(k, v, msa)
    out = dense_attention_runs(q, k, v, document_runs(msa), softmax_scale, backends, pad_to)
    return mark_attending_rows(out, reached)


def dense_attention_runs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    runs: Sequence[DocumentRun],
    softmax_scale: float,
    backends: Sequence[SDPBackend] | None = None,
    pad_to: Callable[[int], int] | None = padded_length,
) -> torch.Tensor:
    """Causal attention within each document of ``runs`` (which cover q's rows in order): the
    body of :func:`dense_document_attention_per_document`, for any host plan of documents.

    Args:
        q: [T, Hq, d] queries, documents contiguous.
        k: [T, Hkv, d] keys in q's dtype, Hq a multiple of Hkv.
        v: [T, Hkv, d] values in q's dtype.
        runs: runs of equal-length documents covering [0, T) in order.
        softmax_scale: multiplies q.k.
        backends: SDPA backends in order of preference (None: :func:`gpu_sdpa_backends`).
        pad_to: the padded length of a document of a given length, or None for none.

    Returns:
        [T, Hq, d] in q's dtype. K and V must be finite (callers contain non-finite ones
        with :mod:`nemo_msa.attention.finite`): SDPA multiplies masked probabilities with them.

    Raises:
        ValueError: runs that do not cover q's rows in order, back to back.
    """
    heads_q, heads_kv, dim = q.shape[1], k.shape[1], q.shape[2]
    # One split per tensor, not a slice per run: a slice's backward writes a gradient of the
    # whole tensor (zeros around the run) and autograd adds them up, a pass over all of q, k
    # and v per run (7.4 ms of a 188 ms packed 32768-token step on an H100); a split's backward
    # is one concatenation.
    sizes = [run.count * run.length for run in runs]
    starts = [0, *itertools.accumulate(sizes)]
    if [run.start for run in runs] != starts[:-1] or starts[-1] != q.shape[0]:
        raise ValueError(
            f"runs={tuple(runs)}; expected runs covering q's rows [0, {q.shape[0]}) in order, "
            f"back to back (each run.start the previous run's start + count * length)"
        )
    parts = zip(*(x.split(sizes) if len(runs) > 1 else (x,) for x in (q, k, v)), strict=True)
    outputs = []
    with _backend_preference(backends):
        for run, (q_run, k_run, v_run) in zip(runs, parts, strict=True):
            tail = (pad_to(run.length) if pad_to is not None else run.length) - run.length

            def view(part: torch.Tensor, heads: int, run=run, tail=tail):
                # [n * L, H, d] -> [n, H, L (+ tail), d]: a strided view of contiguous compact
                # tensors (SDPA takes any strides with the last dim contiguous), or a copy with
                # zero rows appended to each document when it is padded.
                part = part.reshape(run.count, run.length, heads, dim)
                if tail:
                    part = F.pad(part, (0, 0, 0, 0, 0, tail))
                return part.transpose(1, 2)

            out = _causal_gqa_sdpa(
                view(q_run, heads_q), view(k_run, heads_kv), view(v_run, heads_kv), softmax_scale
            )
            out = out.transpose(1, 2)[:, : run.length]
            outputs.append(out.reshape(run.count * run.length, heads_q, dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def document_causal_row_mask(msa: MSAMicrobatch) -> torch.Tensor:
    """bool [b, 1, s, s]: query i of a row keeps key j when both are in one document, j <= i.

    Padding queries keep only themselves (their output is dropped later), so that no softmax row
    is empty: an all-masked row makes SDPA return NaN, and NaN would leak into dk/dv.
    Cached on the layout, so every layer of the microbatch shares one mask.

    Args:
        msa: the microbatch layout.

    Returns:
        bool [b, 1, s, s] on the layout's device.
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

    return msa.cached("nemo_msa.attention.dense.document_causal_row_mask", make)


def dense_document_attention_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, msa: MSAMicrobatch, softmax_scale: float
) -> torch.Tensor:
    """Dense causal attention within documents, per [b, s] row (SDPA with a document mask).

    O(b s^2) mask memory and K/V repeated per query head: the CPU / fp32 path.

    Args:
        q: [T, Hq, d] compact queries, any float dtype.
        k: [T, Hkv, d] compact keys in q's dtype, Hq a multiple of Hkv.
        v: [T, Hkv, d] compact values in q's dtype.
        msa: the microbatch layout.
        softmax_scale: multiplies q.k.

    Returns:
        [T, Hq, d] in q's dtype.

    Raises:
        ValueError: shapes that disagree with each other or with the layout.
    """
    validate_qkv(q, k, v, msa, softmax_scale=softmax_scale)
    k, v, reached = finite_keys_and_values(k, v, msa)
    group = q.shape[1] // k.shape[1]
    # [T, H, d] -> [b, H, s, d]; query head hq reads KV head hq // group (Megatron's order).
    qb = msa.unpack(q).permute(0, 2, 1, 3)
    kb = msa.unpack(k).repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    vb = msa.unpack(v).repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    out = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=document_causal_row_mask(msa), scale=softmax_scale
    )
    return mark_attending_rows(msa.pack(out.permute(0, 2, 1, 3)), reached)


def dense_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    msa: MSAMicrobatch,
    softmax_scale: float,
    queries: torch.Tensor | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """Dense causal attention within documents on compact tokens (dense layers, warm-up).

    Three paths compute the same function and gradients: ``"per_document"``
    (:func:`dense_document_attention_per_document`: cuDNN SDPA per run of equal-length
    documents, GQA without copies, no mask; CUDA, fp16/bf16), ``"rows"``
    (:func:`dense_document_attention_rows`: per-row SDPA with the cached document mask; any
    device and dtype) and ``"queries"`` (:func:`dense_document_attention_queries`: a query
    subset, context parallelism).

    Args:
        q: [T, Hq, d] compact queries ([Tq, Hq, d] with ``queries``).
        k: [T, Hkv, d] compact keys in q's dtype, Hq a multiple of Hkv.
        v: [T, Hkv, d] compact values in q's dtype.
        msa: the microbatch layout.
        softmax_scale: multiplies q.k.
        queries: optional int64 [Tq] global compact rows of q's tokens (ascending); None =
            every token.
        path: the path (a layer passes its plan's
            :attr:`~nemo_msa.plan.MSAKernels.dense_attention`); None chooses per call: the
            query subset's with ``queries``, else per document on CUDA in fp16/bf16, else per
            row (a direct caller; counted by :mod:`nemo_msa.unplanned`).

    Returns:
        [T, Hq, d] ([Tq, Hq, d]) in q's dtype.

    Raises:
        ValueError: shapes that disagree with each other or with the layout, or a call that
            ``path`` does not take (naming ``MSAKernels.dense_attention``).
    """
    half = q.dtype in (torch.float16, torch.bfloat16)
    if path is None:
        unplanned.record("dense_attention")
        path = ("queries" if queries is not None
                else "per_document" if q.is_cuda and half else "rows")
    if path == "queries" and queries is not None:
        validate_qkv(q, k, v, msa, queries, softmax_scale)
        return dense_document_attention_queries(q, k, v, msa, softmax_scale, queries)
    if path == "per_document" and queries is None and q.is_cuda and half:
        return dense_document_attention_per_document(q, k, v, msa, softmax_scale)
    if path == "rows" and queries is None:
        return dense_document_attention_rows(q, k, v, msa, softmax_scale)
    raise ValueError(
        f"MSAKernels.dense_attention={path!r} does not take this call ({q.dtype} on "
        f"{q.device}, {'a query subset' if queries is not None else 'every token a query'}); "
        "the layer's plan did not foresee it"
    )


@dataclass(frozen=True)
class QueryRun:
    """Consecutive local queries of one document: one SDPA call.

    Attributes:
        query_start: first row of the run in the query subset (rows of q).
        count: queries in the run.
        key_start: compact row of the document's first token (first key).
        key_stop: compact row after the run's last query (last key + 1).
    """

    query_start: int
    count: int
    key_start: int
    key_stop: int


def query_runs(msa: MSAMicrobatch, queries: torch.Tensor) -> tuple[QueryRun, ...]:
    """Runs of consecutive global rows of one document in a query subset (host plan).

    One host synchronization per (layout, queries) pair, cached on the layout: every layer of the
    microbatch shares it. Under the load-balanced split a document has at most two runs per
    batch row on a rank.

    Args:
        msa: the global layout.
        queries: int64 [Tq] global compact rows, ascending.

    Returns:
        The runs in query order; their counts add up to Tq.
    """
    memo = msa.cached("nemo_msa.attention.dense.query_runs", TensorMemo)
    plan = memo.get(queries)
    if plan is not None:
        return plan
    documents = msa.token_documents[queries].long()
    # A run starts where the global rows jump or the document changes.
    first = torch.ones(queries.shape[0], dtype=torch.bool, device=queries.device)
    first[1:] = (queries[1:] != queries[:-1] + 1) | (documents[1:] != documents[:-1])
    run_starts = torch.nonzero(first).squeeze(1)
    bounds = torch.cat([run_starts, run_starts.new_full((1,), queries.shape[0])])
    table = torch.stack([
        bounds[:-1], bounds[1:] - bounds[:-1],
        msa.cu_seqlens.long()[documents[run_starts]], queries[bounds[1:] - 1] + 1,
    ], dim=1).tolist()  # the one host synchronization
    plan = tuple(QueryRun(*(int(x) for x in row)) for row in table)
    memo.put(queries, None, plan)
    return plan


def dense_document_attention_queries(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    msa: MSAMicrobatch,
    softmax_scale: float,
    queries: torch.Tensor,
    backends: Sequence[SDPBackend] | None = None,
) -> torch.Tensor:
    """Dense causal attention within documents for a query subset (context parallelism).

    Query p (document position) sees the keys of its document at positions <= p. Per run of
    consecutive queries of one document (:func:`query_runs`) one SDPA call of the run's [n, d]
    queries against the document's keys up to the run's last query, with a lower-right causal
    alignment: query i of the run sees keys ``j <= i + (keys - n)``. GQA without copies.

    Args:
        q: [Tq, Hq, d] local queries.
        k: [T, Hkv, d] every token's keys in q's dtype, Hq a multiple of Hkv.
        v: [T, Hkv, d] values.
        msa: the global layout.
        softmax_scale: multiplies q.k.
        queries: int64 [Tq] global compact rows of q's tokens, ascending.
        backends: SDPA backends in order of preference (CUDA; None:
            :func:`gpu_sdpa_backends`).

    Returns:
        [Tq, Hq, d] in q's dtype.
    """
    heads_q, heads_kv = q.shape[1], k.shape[1]
    k, v, reached = finite_keys_and_values(k, v, msa, queries)
    outputs = []
    runs = query_runs(msa, queries)
    # One split of q rather than a slice per run (see dense_attention_runs); the key ranges of
    # two runs can overlap, so k and v stay sliced (Hkv heads, Hq / Hkv times smaller).
    q_runs = q.split([run.count for run in runs]) if len(runs) > 1 else (q,) * len(runs)
    with _backend_preference(backends):
        for run, q_run in zip(runs, q_runs, strict=True):
            qs = q_run.transpose(0, 1)[None]
            ks = k[run.key_start : run.key_stop].transpose(0, 1)[None]
            vs = v[run.key_start : run.key_stop].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=causal_lower_right(run.count, ks.shape[2]),
                scale=softmax_scale, enable_gqa=heads_q != heads_kv,
            )
            outputs.append(out[0].transpose(0, 1))
    if not outputs:
        return q.new_zeros(q.shape)
    return mark_attending_rows(
        outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0), reached
    )


def validate_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    msa: MSAMicrobatch,
    queries: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> None:
    """The checks every attention entry makes of q [T, Hq, d] ([Tq, Hq, d] with a query subset
    ``queries``), k and v [T, Hkv, d] against each other and the layout, and of the softmax
    scale (dense here; :func:`nemo_msa.ops.validate_attention_inputs` adds the sparse op's q2k
    checks).

    Raises:
        TypeError: q, k or v not a tensor, or a softmax scale that is not a real number.
        ValueError: a dtype that is not floating point, a zero-sized head count or head dim, a
            rank other than 3, shapes that disagree, a head count that is not a multiple, tokens
            other than the layout's, dtypes that differ, devices that differ, or a softmax
            scale that is not finite and positive; names the tensors.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        require_float_tensor(name, x, "[tokens, heads, dim]")
    require_softmax_scale(softmax_scale)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, dim]; got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    if q.shape[2] != k.shape[2] or (queries is None and q.shape[0] != k.shape[0]):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head dim"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})"
        )
    for name, x in (("q", q), ("k", k)) if queries is None else (("k", k),):
        if x.shape[0] != msa.num_tokens:
            raise ValueError(
                f"{name} has {x.shape[0]} tokens but the layout has num_tokens={msa.num_tokens}"
            )
    validate_queries(queries, msa, q.shape[0])
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == msa.device):
        raise ValueError(f"q ({q.device}), k ({k.device}), v ({v.device}) and the layout "
                         f"({msa.device}) must share one device")
