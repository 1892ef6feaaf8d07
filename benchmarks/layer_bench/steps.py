"""The timed work of each row, as ``(prepare, run)`` pairs: ``prepare()`` makes fresh random
inputs (untimed), ``run(inputs)`` is the work the row times. One training step of the model,
the attention alone on one document, and the attention alone on one packed row; and cuDNN's
attention per document (:func:`cudnn_document_attention`), the packed rows' and the pair rate's
baseline."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layer_bench.model import Shape
from torch.nn.attention import SDPBackend, sdpa_kernel

from nemo_msa import MSAMicrobatch
from nemo_msa.attention import dense_document_attention
from nemo_msa.megatron import MSAIndexerMetrics


def packed_lengths(tokens: int, mean: int, minimum: int, generator: torch.Generator) -> list[int]:
    """Document lengths of one packed row: ``minimum + Exponential(mean - minimum)`` tokens each
    (rounded; so the mean length is ``mean`` and none is shorter than ``minimum``), drawn until
    the row is full; the last document is cut to fit, and merged into the one before it where
    the cut would leave it shorter than ``minimum``. ``mean`` 0: one document of ``tokens``.

    Args:
        tokens: the row's length.
        mean: mean document length (0: one document per row).
        minimum: shortest document (``mean`` >= ``minimum`` >= 1 where ``mean`` > 0).
        generator: the seeded CPU generator the lengths come from.

    Returns:
        The lengths in row order; they add up to ``tokens``.
    """
    if mean <= 0 or mean >= tokens:
        return [tokens]
    sizes: list[int] = []
    left = tokens
    scale = float(mean - minimum)
    while left > 0:
        extra = torch.empty(1).exponential_(1.0, generator=generator).item() * scale
        n = min(left, minimum + int(round(extra)))
        if n < minimum and sizes:
            sizes[-1] += n
        else:
            sizes.append(n)
        left -= n
    return sizes


def sdpa_backends(device: torch.device) -> list[SDPBackend]:
    """The SDPA kernels the cuDNN rows may use: cuDNN alone on the GPU (so that a fallback to
    another kernel fails instead of timing something else), the math kernel on the CPU."""
    return [SDPBackend.CUDNN_ATTENTION] if device.type == "cuda" else [SDPBackend.MATH]


def cudnn_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             lengths: list[int] | tuple[int, ...], scale: float) -> torch.Tensor:
    """Dense causal GQA attention within documents by cuDNN SDPA, one call per document at its
    exact length (the baseline of the packed rows and of the MSA rows' pair rate).

    Args:
        q: [T, Hq, d] compact queries; k, v: [T, Hkv, d].
        lengths: the documents' lengths in compact order (they add up to T).
        scale: the softmax scale.

    Returns:
        [T, Hq, d], the documents' outputs in compact order.
    """
    parts, start = [], 0
    with sdpa_kernel(sdpa_backends(q.device)):
        for n in lengths:
            # [n, H, d] -> [1, H, n, d] views of the compact rows; no copy of the inputs.
            qd, kd, vd = (x[start:start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            parts.append(F.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1))
            start += n
    return torch.cat(parts)


def layer_step(model, shape: Shape, tokens: int, device: torch.device, doc_mean: int = 0,
               doc_min: int = 1, seed: int = 0, stats: dict | None = None, doc_maps: int = 4):
    """``(prepare, run)`` of one training step: fresh random tokens and document map, then the
    forward and backward of the mean LM loss (the layout is built inside, as in training).

    ``doc_mean`` > 0: the row is packed with documents of :func:`packed_lengths` (mean
    ``doc_mean``, at least ``doc_min`` tokens): ``doc_maps`` length lists drawn from a generator
    seeded with ``seed`` (every case of a run sees the same ones), used in turn, one per step,
    each as a new document-map tensor (so the layout is rebuilt every step, as in training).
    Cycling a few maps measures the steady state of training, where every padded document
    length has been planned by cuDNN once (a first plan costs about 120 ms on the H200); the
    caller warms up at least ``doc_maps`` steps. ``stats["documents"]`` collects the documents
    per step.
    """
    generator = torch.Generator().manual_seed(seed)
    maps = [packed_lengths(tokens, doc_mean, doc_min, generator) for _ in range(doc_maps)]
    step = 0

    def prepare() -> dict:
        nonlocal step
        text = torch.randint(1, shape.vocab, (1, tokens), device=device)
        sizes = maps[step % len(maps)]
        step += 1
        if stats is not None:
            stats.setdefault("documents", []).append(len(sizes))
        lengths = torch.tensor(sizes)
        ids = torch.repeat_interleave(torch.arange(1, len(sizes) + 1), lengths)
        starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        return {
            "ids": ids.view(1, tokens).to(device),
            "text": text,
            "labels": text.roll(-1, dims=1),
            "positions": (torch.arange(tokens) - starts).view(1, tokens).to(device),
        }

    def run(x: dict) -> None:
        model.zero_grad(set_to_none=True)
        loss = model(x["text"], x["positions"], x["ids"], labels=x["labels"])
        loss.float().mean().backward()
        MSAIndexerMetrics.reset()

    return prepare, run


def attention_step(name: str, shape: Shape, tokens: int, device: torch.device, dtype):
    """``(prepare, run)`` of the attention alone: fresh random q, k, v, dout; forward+backward.

    ``dense_attention`` is :func:`nemo_msa.attention.dense_document_attention` on compact
    [T, H, d] tensors and the one-document layout; ``cudnn_attention`` is SDPA causal GQA on
    [1, H, T, d] restricted to cuDNN (the math kernel on the CPU).
    """
    scale = shape.head_dim**-0.5
    msa = MSAMicrobatch.build(
        packed_seq_ids=torch.ones(1, tokens, dtype=torch.int64, device=device),
        block_size=shape.block,
    )
    heads = (shape.heads, shape.groups, shape.groups)

    def rand(*size) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=dtype)

    def prepare() -> dict:
        if name == "dense_attention":
            q, k, v = (rand(tokens, h, shape.head_dim).requires_grad_() for h in heads)
        else:
            q, k, v = (rand(1, h, tokens, shape.head_dim).requires_grad_() for h in heads)
        return {"q": q, "k": k, "v": v, "dout": torch.randn_like(q)}

    def run(x: dict) -> None:
        if name == "dense_attention":
            out = dense_document_attention(x["q"], x["k"], x["v"], msa, scale)
        else:
            with sdpa_kernel(sdpa_backends(device)):
                out = F.scaled_dot_product_attention(
                    x["q"], x["k"], x["v"], is_causal=True, scale=scale, enable_gqa=True
                )
        out.backward(x["dout"])

    return prepare, run


def packed_attention_step(shape: Shape, tokens: int, lengths: tuple[int, int],
                          device: torch.device, dtype, stats: dict, kernel: str,
                          fresh: bool = False):
    """``(prepare, run)`` of dense attention on one row packed with documents of random lengths
    in ``lengths`` (drawn once per size, the last document cut to fill the row; fresh inputs per
    step).

    ``kernel`` ``"nemo"``: :func:`dense_document_attention` (row ``dense_attention_packed``);
    ``"cudnn"``: cuDNN SDPA causal GQA called per document at its exact length (row
    ``cudnn_attention_packed``, the issue's baseline; its plans are cached after the warm-up
    because the lengths repeat, the best case for cuDNN). With ``fresh`` (row
    ``dense_attention_packed_fresh``) the lengths are drawn anew every step, as packed training
    batches bring them. The layout is built in ``prepare``
    (untimed: training builds it once per microbatch for all layers). ``stats`` collects the
    documents per step and the causal (query, key) pairs relative to one document of
    ``tokens``.
    """
    scale = shape.head_dim**-0.5
    generator = torch.Generator().manual_seed(tokens)
    heads = (shape.heads, shape.groups, shape.groups)

    def draw() -> list[int]:
        sizes, left = [], tokens
        while left > 0:
            n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=generator))
            sizes.append(min(n, left))
            left -= sizes[-1]
        return sizes

    sizes = draw()

    def prepare() -> dict:
        nonlocal sizes
        if fresh:
            sizes = draw()
        ids = torch.repeat_interleave(torch.arange(1, len(sizes) + 1), torch.tensor(sizes))
        msa = MSAMicrobatch.build(packed_seq_ids=ids.view(1, tokens).to(device),
                                  block_size=shape.block)
        stats.setdefault("documents", []).append(len(sizes))
        stats.setdefault("pairs", []).append(
            sum(n * (n + 1) for n in sizes) / (tokens * (tokens + 1)))
        q, k, v = (torch.randn(tokens, h, shape.head_dim, device=device, dtype=dtype)
                   .requires_grad_() for h in heads)
        return {"msa": msa, "q": q, "k": k, "v": v, "dout": torch.randn_like(q)}

    def run(x: dict) -> None:
        if kernel == "nemo":
            out = dense_document_attention(x["q"], x["k"], x["v"], x["msa"], scale)
        else:
            out = cudnn_document_attention(x["q"], x["k"], x["v"], sizes, scale)
        out.backward(x["dout"])

    return prepare, run

