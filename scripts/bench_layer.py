#!/usr/bin/env python
"""Times the training step of a one-layer MiniMax-M3-shaped GPTModel: dense vs MSA (issue 15).

The model is a Megatron-Core ``GPTModel`` with ONE transformer layer built from this project's
spec (``layer_specs.get_msa_decoder_block_spec``, local backend, ``MSATransformerConfig``):
hidden 6144, SwiGLU FFN 16384, 64 query / 4 KV heads of 128, RMSNorm, no biases, partial RoPE
(``rotary_percent`` 0.5, base 5e6), index heads 4 x 128, blocks of 128, top-16, bf16 parameters
under Megatron's ``Float16Module``, vocabulary ``--vocab`` (default 8192, so that the LM head is
a small part of the step). One document per row, one row of ``--tokens`` tokens.

A step is the forward and backward of the mean LM loss (and of the indexer loss where the case
has one), with fresh random tokens and a fresh document map per step (so the layout is built
inside the step, as in training). The optimizer step is EXCLUDED: gradients land in bf16
``param.grad`` through autograd (no DDP buffers, no clipping, no Adam).

Cases (``--cases``):

- ``dense``: ``msa_layer_pattern="D"``: dense causal attention within documents
  (``nemo_msa.attention.dense_document_attention``, cuDNN SDPA on the GPU).
- ``msa_loss_off``: MSA layer, ``msa_indexer_loss_coeff=0`` (selection + sparse attention only).
- ``msa_sparse_loss``: MSA layer, indexer loss on, ``msa_indexer_loss_type="sparse"`` (the
  production setting after the warm-up).
- ``msa_dense_loss``: MSA layer, indexer loss on, ``msa_indexer_loss_type="dense"``.
- ``msa_warmup``: MSA layer inside its dense warm-up (``msa_dense_warmup_steps`` huge,
  iteration 0): dense attention plus the dense indexer loss (and the recall selection).

Two attention-only rows per size time the forward+backward of the attention alone on the same
tokens (bf16 q [T, 64, 128], k/v [T, 4, 128]): ``dense_attention`` (this project's
``dense_document_attention`` on the one-document layout) and ``cudnn_attention`` (cuDNN SDPA,
causal, ``enable_gqa=True``, on [1, H, T, 128]). ``--packed-docs MIN:MAX`` adds
``dense_attention_packed``: the same function on one row packed with documents of random
lengths MIN..MAX (drawn once per size), and ``cudnn_attention_packed``: cuDNN SDPA called per
document at its exact length on the same row (plans cached after the warm-up: cuDNN's best
case), the baseline of the packed rows; ``dense_attention_packed_fresh``: new lengths every
step, as packed training batches bring them.

Per row: ``step_ms`` (median of ``--steps`` steps after ``--warmup``, CUDA events), tokens/s,
``peak_gib`` (``torch.cuda.max_memory_allocated`` since the row started, model, gradients and
inputs included) or ``fwdbwd_ms`` for the attention rows; with ``--profile`` the top kernels by
CUDA time of one more step. A row that runs out of memory or one of whose warm-up steps exceeds
``--max-step-s`` is reported as ``oom`` / ``too_slow`` and the run continues (larger sizes of
that case are then skipped and reported as such).

Usage::

    python scripts/bench_layer.py --tokens 8192,32768,131072 --json layer.json [--profile]
    python scripts/bench_layer.py --tiny --json /tmp/layer.json   # CPU, gloo, seconds

``--tiny`` builds a tiny model (hidden 128, 4/2 heads of 32, blocks of 16, top-4, vocab 256,
fp32 on the CPU through ``nemo_msa.megatron.cpu_shim``) so the whole script runs end to end
without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

# Runs from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
warnings.filterwarnings("ignore", category=FutureWarning)
logging.getLogger("megatron").setLevel(logging.ERROR)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from layer_specs import get_msa_decoder_block_spec  # noqa: E402
from nemo_msa import MSAMicrobatch  # noqa: E402
from nemo_msa.attention import dense_document_attention  # noqa: E402
from nemo_msa.megatron import (  # noqa: E402
    MSAIndexerLossAutoScaler,
    MSAIndexerMetrics,
    MSATransformerConfig,
    cpu_shim,  # noqa: E402
    set_training_iteration,
)

CASES = ("dense", "msa_loss_off", "msa_sparse_loss", "msa_dense_loss", "msa_warmup")
ATTENTION_ROWS = ("dense_attention", "cudnn_attention")


@dataclass(frozen=True)
class Shape:
    """Model shape of the benchmark.

    Attributes:
        hidden: hidden size.
        ffn: FFN hidden size (SwiGLU: fc1 is 2 * ffn wide).
        heads: query heads.
        groups: KV heads.
        head_dim: channels per head (kv_channels).
        index_heads: indexer heads.
        index_dim: indexer head dim.
        block: MSA block size.
        topk: MSA blocks per query.
        vocab: vocabulary size.
    """

    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    index_heads: int
    index_dim: int
    block: int
    topk: int
    vocab: int


M3 = Shape(6144, 16384, 64, 4, 128, 4, 128, 128, 16, 8192)
TINY = Shape(128, 256, 4, 2, 32, 2, 32, 16, 4, 256)


def _log(*parts) -> None:
    print(*parts, flush=True)


# ----------------------------------------------------------------------------- set-up


def init_single_rank(on_gpu: bool) -> None:
    """A one-rank process group (NCCL on the GPU, gloo + the CPU shim on the CPU), TP = PP = 1."""
    if not on_gpu:
        cpu_shim.install()
    if not torch.distributed.is_initialized():
        if on_gpu:
            torch.cuda.set_device(0)
        torch.distributed.init_process_group(
            backend="nccl" if on_gpu else "gloo",
            store=torch.distributed.HashStore(),
            rank=0,
            world_size=1,
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)


def case_config(case: str, shape: Shape, on_gpu: bool) -> MSATransformerConfig:
    """The MSATransformerConfig of one case.

    Args:
        case: one of :data:`CASES`.
        shape: the model shape.
        on_gpu: bf16 on the GPU; fp32 with the CPU shim's overrides otherwise.

    Returns:
        The config (one layer).

    Raises:
        ValueError: an unknown case.
    """
    if case not in CASES:
        raise ValueError(f"case={case!r}; expected one of {CASES}")
    msa = {
        "dense": {"msa_layer_pattern": "D"},
        "msa_loss_off": {"msa_indexer_loss_coeff": 0.0},
        "msa_sparse_loss": {"msa_indexer_loss_coeff": 1.0, "msa_indexer_loss_type": "sparse"},
        "msa_dense_loss": {"msa_indexer_loss_coeff": 1.0, "msa_indexer_loss_type": "dense"},
        "msa_warmup": {"msa_indexer_loss_coeff": 1.0, "msa_dense_warmup_steps": 10**9},
    }[case]
    precision = (
        {"bf16": True, "params_dtype": torch.bfloat16}
        if on_gpu
        else dict(cpu_shim.cpu_config_overrides())
    )
    return MSATransformerConfig(
        num_layers=1,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads,
        num_query_groups=shape.groups,
        kv_channels=shape.head_dim,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        transformer_impl="local",
        msa_num_index_heads=shape.index_heads,
        msa_index_head_dim=shape.index_dim,
        msa_block_size=shape.block,
        msa_topk=shape.topk,
        msa_layer_pattern=msa.pop("msa_layer_pattern", "S"),
        **msa,
        **precision,
    )


def build_model(config: MSATransformerConfig, shape: Shape, max_tokens: int, on_gpu: bool):
    """GPTModel (one layer, this project's spec), wrapped in Float16Module for bf16 on the GPU."""
    model = GPTModel(
        config,
        get_msa_decoder_block_spec(config),
        vocab_size=shape.vocab,
        max_sequence_length=max_tokens,
        position_embedding_type="rope",
        rotary_percent=0.5,
        rotary_base=5_000_000,
        share_embeddings_and_output_weights=False,
    )
    if on_gpu:
        model = Float16Module(config, model.cuda())
    return model.train()


# ----------------------------------------------------------------------------- timing


class Timer:
    """Wall time of a region: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, on_gpu: bool) -> None:
        self.on_gpu = on_gpu

    @contextlib.contextmanager
    def region(self, out: list[float]):
        if self.on_gpu:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            yield
            out.append((time.perf_counter() - t0) * 1e3)


def peak_gib(on_gpu: bool) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None


def reset_peak(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def free_memory(on_gpu: bool) -> None:
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def profile_top(fn, on_gpu: bool, top: int) -> list[dict]:
    """The ``top`` kernels of one call of ``fn`` by device time (CPU ops by CPU time on CPU).

    Returns:
        ``[{"name", "ms", "calls"}]``, largest first.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if on_gpu:
            torch.cuda.synchronize()
    events = list(prof.key_averages())
    if on_gpu:
        kernels = [e for e in events
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        # Where the averages do not keep the device type, the ops' self device time is the
        # time of the kernels they launched.
        events = kernels or events
    rows = []
    for event in events:
        us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if us > 0:
            rows.append({"name": event.key[:90], "ms": us / 1e3, "calls": event.count})
    rows.sort(key=lambda row: -row["ms"])
    return rows[:top]


def run_row(bench, args, on_gpu: bool, row: dict, key: str) -> bool:
    """:func:`run_timed`, with a failure recorded in ``row`` instead of raised (``status``
    ``oom`` or ``error`` and a ``note``) and the memory freed, so the run goes on.

    Returns:
        True when the row failed.
    """
    try:
        run_timed(bench, args, on_gpu, row, key)
        return False
    except Exception as error:  # OOM is reported; anything else too, and the run goes on
        row.update(status="oom" if is_oom(error) else "error",
                   note=f"{type(error).__name__}: {str(error)[:300]}")
        free_memory(on_gpu)
        return True


def run_timed(bench, args, on_gpu: bool, row: dict, key: str) -> None:
    """Warm-up, the too-slow check, timed steps (median), peak memory and the optional profile.

    Fills ``row`` in place: ``status`` and ``key`` (ms), ``peak_gib``, ``warmup_ms``,
    ``kernels``. ``bench`` is ``(prepare, run)``: ``prepare()`` makes fresh random inputs
    (untimed), ``run(inputs)`` is the timed work.
    """
    prepare, run = bench
    timer = Timer(on_gpu)
    reset_peak(on_gpu)
    warm: list[float] = []
    for _ in range(max(1, args.warmup)):
        inputs = prepare()
        with timer.region(warm):
            run(inputs)
        del inputs
        row["warmup_ms"] = [round(t, 3) for t in warm]
        if warm[-1] > args.max_step_s * 1e3:
            # Checked after every warm-up step: one slow step is all a too-slow row costs.
            row.update(status="too_slow", peak_gib=peak_gib(on_gpu))
            row["note"] = f"a warm-up step took {warm[-1] / 1e3:.1f} s > --max-step-s"
            return
    times: list[float] = []
    for _ in range(args.steps):
        inputs = prepare()
        with timer.region(times):
            run(inputs)
        del inputs
    row[key] = statistics.median(times)
    row["peak_gib"] = peak_gib(on_gpu)
    row["status"] = "ok"
    if args.profile:
        inputs = prepare()
        row["kernels"] = profile_top(lambda: run(inputs), on_gpu, args.profile_top)


# ----------------------------------------------------------------------------- rows


def layer_step(model, shape: Shape, tokens: int, device: torch.device):
    """``(prepare, run)`` of one training step: fresh random tokens and document map, then the
    forward and backward of the mean LM loss (the layout is built inside, as in training)."""

    def prepare() -> dict:
        text = torch.randint(1, shape.vocab, (1, tokens), device=device)
        return {
            "ids": torch.ones(1, tokens, dtype=torch.int64, device=device),  # one document
            "text": text,
            "labels": text.roll(-1, dims=1),
            "positions": torch.arange(tokens, device=device).unsqueeze(0),
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
            backends = [SDPBackend.CUDNN_ATTENTION] if device.type == "cuda" else [SDPBackend.MATH]
            with sdpa_kernel(backends):
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
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def prepare() -> dict:
        nonlocal sizes, starts
        if fresh:
            sizes = draw()
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
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
            backends = [SDPBackend.CUDNN_ATTENTION] if device.type == "cuda" else [SDPBackend.MATH]
            parts = []
            with sdpa_kernel(backends):
                for start, n in zip(starts, sizes, strict=True):
                    q, k, v = (x[name][start:start + n].transpose(0, 1).unsqueeze(0)
                               for name in ("q", "k", "v"))
                    parts.append(F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1))
            out = torch.cat(parts)
        out.backward(x["dout"])

    return prepare, run


# ----------------------------------------------------------------------------- report


def fmt_table(rows: list[dict]) -> str:
    dense_ms = {r["tokens"]: r["step_ms"] for r in rows
                if r["case"] == "dense" and r.get("status") == "ok"}
    # Each attention row against cuDNN on the same tokens: single documents against
    # cudnn_attention, packed rows against cudnn_attention_packed.
    cudnn_ms = {(r["tokens"], "_packed" in r["case"]): r["fwdbwd_ms"] for r in rows
                if r["case"].startswith("cudnn_attention") and r.get("status") == "ok"}
    head = (f"| {'tokens':>7} | {'case':<28} | {'status':<8} | {'step_ms':>9} | {'tok/s':>10} "
            f"| {'x dense':>7} | {'fwdbwd_ms':>9} | {'x cudnn':>7} | {'peak_gib':>8} |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]

    def num(value, width, digits=1):
        return f"{value:>{width}.{digits}f}" if isinstance(value, (int, float)) else " " * width

    for r in rows:
        step, fb = r.get("step_ms"), r.get("fwdbwd_ms")
        x_dense = dense_ms[r["tokens"]] / step if step and r["tokens"] in dense_ms else None
        base = cudnn_ms.get((r["tokens"], "_packed" in r["case"]))
        x_cudnn = fb / base if fb and base else None
        lines.append(
            f"| {r['tokens']:>7} | {r['case']:<28} | {r['status']:<8} | {num(step, 9)} "
            f"| {num(r.get('tokens_per_s'), 10, 0)} | {num(x_dense, 7, 2)} | {num(fb, 9)} "
            f"| {num(x_cudnn, 7, 2)} | {num(r.get('peak_gib'), 8, 2)} |"
        )
    return "\n".join(lines)


def commit_id() -> str:
    if os.environ.get("NEMO_MSA_COMMIT"):
        return os.environ["NEMO_MSA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parents[1], timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse_list(text: str, allowed: tuple[str, ...] | None, name: str) -> list:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise SystemExit(f"{name}={text!r}: expected a comma-separated list")
    if allowed is not None:
        bad = [item for item in items if item not in allowed]
        if bad:
            raise SystemExit(f"{name}={text!r}: unknown {bad}; expected some of {allowed}")
        return items
    try:
        values = [int(item) for item in items]
    except ValueError:
        raise SystemExit(f"{name}={text!r}: expected positive integers") from None
    if any(v <= 0 for v in values):
        raise SystemExit(f"{name}={text!r}: expected positive integers")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    ap.add_argument("--tokens", default=None,
                    help="comma-separated sizes (default 8192,32768,131072; --tiny: 128,256)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    ap.add_argument("--max-step-s", type=float, default=30.0,
                    help="a row with a warm-up step longer than this is reported too_slow")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8192; tiny 256)")
    ap.add_argument("--no-attention-rows", action="store_true",
                    help="skip the dense_attention / cudnn_attention rows")
    ap.add_argument("--packed-docs", default=None, metavar="MIN:MAX",
                    help="also time dense attention on one row packed with documents of random "
                    "lengths MIN..MAX, drawn once per size (rows dense_attention_packed and "
                    "cudnn_attention_packed)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel table (torch.profiler) of one more step per row")
    ap.add_argument("--profile-top", type=int, default=12)
    ap.add_argument("--tiny", action="store_true", help="tiny model (runs on the CPU in seconds)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA exists")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit(f"--steps={args.steps} --warmup={args.warmup}: expected both >= 1")
    cases = parse_list(args.cases, CASES, "--cases")
    sizes = parse_list(args.tokens or ("128,256" if args.tiny else "8192,32768,131072"), None,
                       "--tokens")
    packed = None
    if args.packed_docs is not None:
        try:
            low, high = (int(x) for x in args.packed_docs.split(":"))
        except ValueError:
            raise SystemExit(f"--packed-docs={args.packed_docs!r}: expected MIN:MAX") from None
        if not 1 <= low <= high:
            raise SystemExit(f"--packed-docs={args.packed_docs!r}: expected 1 <= MIN <= MAX")
        packed = (low, high)
    shape = TINY if args.tiny else M3
    if args.vocab is not None:
        shape = Shape(**{**shape.__dict__, "vocab": args.vocab})
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu and not args.tiny:
        raise SystemExit("the MiniMax-M3 shape needs a CUDA GPU; on the CPU run with --tiny")
    bad = [n for n in sizes if n % shape.block]
    if bad:
        raise SystemExit(f"--tokens {bad}: expected multiples of the block size {shape.block}")

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    init_single_rank(on_gpu)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    gpu = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    _log(f"bench_layer: {gpu}, torch {torch.__version__}, triton {triton_version}, shape "
         f"{shape}, dtype {dtype}, steps {args.steps} after {args.warmup} warm-up")

    rows: list[dict] = []
    result = {
        "gpu": gpu,
        "commit": commit_id(),
        "torch": torch.__version__,
        "triton": triton_version,
        "command": " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "shape": shape.__dict__,
        "dtype": str(dtype),
        "step": "forward + backward of the mean LM loss (+ indexer loss where on); optimizer "
        "step excluded",
        "rows": rows,
    }

    def report(row: dict) -> None:
        # Written after every row, so a run stopped by a time limit keeps what it measured.
        rows.append(row)
        _log(json.dumps(row))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1))

    for case in cases:
        config = case_config(case, shape, on_gpu)
        set_training_iteration(0)
        model = build_model(config, shape, max(sizes), on_gpu)
        blocked = None
        for tokens in sizes:
            row = {"tokens": tokens, "case": case, "step_ms": None, "peak_gib": None}
            if blocked is not None:
                row.update(status="skipped", note=f"{blocked} at a smaller size")
                report(row)
                continue
            if run_row(layer_step(model, shape, tokens, device), args, on_gpu, row, "step_ms"):
                row["peak_gib"] = peak_gib(on_gpu)
                model.zero_grad(set_to_none=True)
                free_memory(on_gpu)
            if row["status"] in ("oom", "too_slow"):
                blocked = row["status"]
            if row["status"] == "ok":
                row["tokens_per_s"] = tokens / (row["step_ms"] / 1e3)
            report(row)
        del model
        MSAIndexerLossAutoScaler.reset()
        free_memory(on_gpu)

    if not args.no_attention_rows:
        for tokens in sizes:
            for name in ATTENTION_ROWS:
                row = {"tokens": tokens, "case": name, "fwdbwd_ms": None, "peak_gib": None,
                       "kernel": ("nemo_msa dense_document_attention" if name == "dense_attention"
                                  else "SDPA cuDNN" if on_gpu else "SDPA math (CPU)")}
                run_row(attention_step(name, shape, tokens, device, dtype), args, on_gpu, row,
                        "fwdbwd_ms")
                report(row)
            if packed is None:
                continue
            for case, kernel in (("dense_attention_packed", "nemo"),
                                 ("cudnn_attention_packed", "cudnn"),
                                 ("dense_attention_packed_fresh", "nemo")):
                row = {"tokens": tokens, "case": case, "fwdbwd_ms": None, "peak_gib": None,
                       "kernel": ("nemo_msa dense_document_attention" if kernel == "nemo"
                                  else "SDPA cuDNN per document"),
                       "document_lengths": list(packed)}
                stats: dict = {}
                run_row(packed_attention_step(shape, tokens, packed, device, dtype, stats,
                                              kernel, case.endswith("_fresh")),
                        args, on_gpu, row, "fwdbwd_ms")
                if stats:
                    row["documents_mean"] = statistics.mean(stats["documents"])
                    row["causal_pairs_vs_one_document"] = statistics.mean(stats["pairs"])
                report(row)

    for row in rows:
        if row.get("kernels"):
            _log(f"\ntop kernels, {row['case']} at {row['tokens']} tokens (ms in one step):")
            for kernel in row["kernels"]:
                _log(f"  {kernel['ms']:10.3f}  {kernel['calls']:6d}  {kernel['name']}")
    _log("\n" + fmt_table(rows))
    _log("step_ms: median of one training step's forward+backward (optimizer excluded); "
         "x dense: dense step / this step; fwdbwd_ms: attention alone; x cudnn: this / cuDNN; "
         "peak_gib: max allocated during the row (model, grads and inputs included).")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0 if all(r["status"] in ("ok", "oom", "too_slow", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
