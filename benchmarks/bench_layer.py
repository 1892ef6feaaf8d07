#!/usr/bin/env python
"""Times the training step of a one-layer MiniMax-M3-shaped GPTModel: dense vs MSA (issue 15).

The model is a Megatron-Core ``GPTModel`` with ONE transformer layer built from this project's
spec (``layer_specs.get_msa_decoder_block_spec``, local backend, ``MSATransformerConfig``):
hidden 6144, SwiGLU FFN 16384, 64 query / 4 KV heads of 128, RMSNorm, no biases, partial RoPE
(``rotary_percent`` 0.5, base 5e6), index heads 4 x 128, blocks of 128, top-16, bf16 parameters
under Megatron's ``Float16Module``, vocabulary ``--vocab`` (default 8192, so that the LM head is
a small part of the step). One row of ``--tokens`` tokens: one document, or packed documents.

Rows (``--tokens``): each entry is ``N`` (one document of N tokens; with ``--doc-mean M1,M2``
one row per mean, 0 = one document) or ``N:MEAN`` (that row only): N tokens packed with
documents of ``--doc-min`` + Exponential(MEAN - ``--doc-min``) tokens (mean MEAN), the last
cut to fill the row: ``--doc-maps`` maps drawn from a generator seeded with ``--seed`` (every
case sees the same ones), used in turn, a new map tensor every step (the layout is rebuilt as
in training); the warm-up covers every map, so the timed steps see the steady state in which
cuDNN has planned every padded document length. The issue's five rows, dense and MSA in one run::

    --tokens 8192,32768,32768:4096,131072:16384,131072 --cases dense,msa_sparse_loss

``--layers L`` builds L transformer layers of the case's kind (one by default).

``--grow-to MAX`` searches, per case after its ``--tokens`` rows, the longest one-document row
that fits (issue 63): it doubles the longest row that ran, up to MAX tokens, until a row runs out
of memory (or time, ``--max-step-s``), then halves the gap down to ``--grow-step`` tokens. Every
row tried is a row of the table; the JSON's ``longest`` gives per case the longest that ran with
its ``peak_gib`` and step time, and the shortest that failed. Long rows, on one GPU::

    --tokens 262144 --cases msa_sparse_loss --no-attention-rows --no-pair-rate \
        --grow-to 1048576 --steps 2 --warmup 1

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

Per row: ``docs`` (mean documents per step), ``doc_mean`` (0 for one document per row),
``layers``, ``step_ms`` (median of ``--steps`` steps after ``--warmup``, CUDA events), tokens/s,
``peak_gib`` (``torch.cuda.max_memory_allocated`` since the row started, model, gradients and
inputs included) or ``fwdbwd_ms`` for the attention rows; with ``--profile`` the top kernels by
CUDA time of one more step. MSA rows also say how one more step's selections (first MSA layer)
split between the Triton kernels (``benchmarks/msa_bench/unions.py``): ``union_mean`` (blocks in
the union of a ``union_qt``-token tile), ``union_kernel_share`` (the share of the exact
(token, block) work on the union kernel at the launch's ``union_max``) and
``union_inflation`` (the union kernel's work over that exact work). MSA rows also time that
layer's sparse attention alone (``layer_bench/pairs.py``): its captured core-attention call,
forward + backward as training makes it, and cuDNN SDPA per document on the same q/k/v
(``--warmup`` calls, median of ``--steps``): ``pairs_dense`` / ``pairs_msa`` (causal (query,
key) pairs per query head: every one in the documents, and exactly those of the selected
blocks), ``msa_attention_ms`` / ``cudnn_attention_ms``, ``pair_rate_vs_cudnn`` (MSA pairs per
ms over cuDNN's; the table's ``pair rate``) and ``msa_attention_tflops`` /
``cudnn_attention_tflops`` (14 * heads * head_dim FLOPs per pair); where the first tokens of
the documents select every visible block (MSA is exactly dense there) the same split in two
query subsets: ``prefix_tokens``, ``msa_prefix_ms`` / ``msa_rest_ms``, ``cudnn_prefix_ms`` and
``prefix_pair_rate_vs_cudnn`` / ``rest_pair_rate_vs_cudnn`` (what cuDNN serving those rows
could save; issue #50). ``--no-pair-rate`` skips them. ``--index coherent`` makes the MSA
layers' index queries coherent within each 128-token block (``layer_bench/selection.py``);
``--index trained`` keeps a calibrated share of each token's own index query beside its block's,
so that the first MSA layer's 8-token tiles have the mean union a trained indexer's have
(``benchmarks/indexer_regime.py``'s measurement scaled to the top-k; the row's ``trained_*``
fields); the default, ``fresh``, keeps the untrained indexer's random ones. On a GPU every MSA
row also profiles one more step: ``step_kernel_ms`` sums its kernels by part (selection, sparse
forward, dq, dk/dv, indexer loss, recall, norm/rope, layout, dense attention, GEMMs, other) and
``project_kernels`` lists this project's kernels one by one (``layer_bench/kernels.py``). A
row that runs out of memory or one of whose warm-up steps after the first (which compiles the
kernels; the only one with ``--warmup 1``) exceeds ``--max-step-s`` is reported as ``oom`` /
``too_slow`` and the run continues (larger sizes of that case are then skipped and reported as
such).

Usage::

    python benchmarks/bench_layer.py --tokens 8192,32768,131072 --json layer.json [--profile]
    python benchmarks/bench_layer.py --tokens 8192,32768,32768:4096,131072:16384,131072 \
        --cases dense,msa_sparse_loss --json layer.json
    python benchmarks/bench_layer.py --tiny --json /tmp/layer.json   # CPU, gloo, seconds

``--m3-block`` times the real MiniMax-M3 block instead of the dense-FFN stand-in: one MoE
layer as recipes/minimax_m3_msa.yaml builds layers 4-60 (SwiGLU-OAI, Gemma RMSNorm, QK norm,
sigmoid top-4 routing with expert bias and scaling 2, one shared expert of 3072, ``--experts``
routed experts of 3072, default all 128: 14.5 GB of bf16 weights and as much of gradients fit
one H200), Megatron's local MoE layer (SequentialMLP, all-to-all dispatcher); the ``dense``
case is the same block with dense attention (default cases: dense,msa_loss_off,msa_sparse_loss).

``--deterministic`` times the rows under ``model.deterministic_mode`` (ADR 0050): Megatron-LM's
determinism environment and ``torch.use_deterministic_algorithms(True)`` set before CUDA starts,
``deterministic_mode=True`` in the config; its dense attention runs flash SDPA, not cuDNN. The
cuDNN rows (attention rows, pair rate) are left out: cuDNN's SDPA has no deterministic backward.
The same rows without it, in another process, give the mode's cost
(``benchmarks/determinism_check.py`` runs both).

``--tiny`` builds a tiny model (hidden 128, 4/2 heads of 32, blocks of 16, top-4, vocab 256,
fp32 on the CPU through ``nemo_msa.megatron.cpu_shim``) so the whole script runs end to end
without a GPU.

The parts: benchmarks/layer_bench (model: shape, cases and the model; timing; steps: the timed work
of each row; report: the table and the JSON); this file is the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import warnings
from pathlib import Path

# Runs from a checkout without installing the package: the parts (benchmarks/layer_bench) and the
# repository (nemo_msa, layer_specs) are found next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
# Set before Megatron is imported (by the parts), so that its import-time warnings stay quiet.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
warnings.filterwarnings("ignore", category=FutureWarning)
logging.getLogger("megatron").setLevel(logging.ERROR)

import torch  # noqa: E402
from layer_bench.bound import step_bound  # noqa: E402
from layer_bench.kernels import profile_step_parts  # noqa: E402
from layer_bench.model import (  # noqa: E402
    ATTENTION_ROWS,
    CASES,
    M3,
    M3_BLOCK,
    TINY,
    TINY_BLOCK,
    Block,
    Shape,
    build_model,
    case_config,
    init_single_rank,
)
from layer_bench.pairs import pair_rate  # noqa: E402
from layer_bench.report import commit_id, fmt_table, log, log_kernels, write_json  # noqa: E402
from layer_bench.rows import next_length, parse_rows  # noqa: E402
from layer_bench.selection import (  # noqa: E402
    NOISE,
    calibrate_row,
    capture_core_attention,
    coherent_index_hooks,
    selection_stats,
)
from layer_bench.steps import attention_step, layer_step, packed_attention_step  # noqa: E402
from layer_bench.timing import free_memory, is_oom, peak_gib, run_row  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from nemo_msa.megatron import MSAIndexerLossAutoScaler, set_training_iteration  # noqa: E402
from nemo_msa.training import determinism  # noqa: E402
from nemo_msa.training.recipe_fields import RecipeError  # noqa: E402
from nemo_msa.triton.launch import launch_overrides, parse_setting  # noqa: E402


def parse_list(text: str, allowed: tuple[str, ...] | None, name: str) -> list:
    """A comma-separated option: names out of ``allowed``, or positive integers where None.

    Args:
        text: the option's value.
        allowed: the names it may list; None for positive integers.
        name: the option, for the error message.

    Returns:
        The names, or the integers.

    Raises:
        SystemExit: an empty list, an unknown name or a value that is not a positive integer.
    """
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


def row_pair_rate(call, args: argparse.Namespace, on_gpu: bool) -> dict:
    """The pair-rate fields of an MSA row (:func:`layer_bench.pairs.pair_rate`, the row's
    warm-up and steps), or ``pair_rate_note`` where timing them failed (out of memory, say):
    the row's step was measured, so the run goes on."""
    try:
        return pair_rate(call, on_gpu, args.warmup, args.steps)
    except Exception as error:  # the step time stands without it
        free_memory(on_gpu)
        return {"pair_rate_note": f"{type(error).__name__}: {str(error)[:300]}"}


def add_bounds(rows: list[dict], shape: Shape) -> None:
    """Adds each MSA row's bound (:func:`layer_bench.bound.step_bound`) against the dense row of
    its tokens, documents and layers, where both were measured."""
    def key(r: dict) -> tuple:
        return r["tokens"], r.get("doc_mean", 0), r.get("layers", 1)

    dense = {key(r): r for r in rows if r["case"] == "dense" and r["status"] == "ok"}
    for row in rows:
        if row["case"].startswith("msa") and row["status"] == "ok" and key(row) in dense:
            base = dense[key(row)]
            row.update(step_bound(row, base["step_ms"], shape.heads, shape.head_dim,
                                  shape.index_heads, shape.index_dim, shape.hidden,
                                  row["tokens"],
                                  base.get("step_kernel_ms", {}).get("dense attention")))


def measure_row(args: argparse.Namespace, model, shape: Shape, case: str, tokens: int,
                doc_mean: int, doc_min: int, device, on_gpu: bool, noise: dict) -> dict:
    """Times one row of ``case`` (``tokens`` tokens, documents of mean ``doc_mean``, 0 for one)
    on ``model``: its step, peak memory and, for a row that ran, its kernels by part and, for
    an MSA row, the selection statistics and the pair rate. ``noise``: the coherent index
    hooks' share of a token's own index query (a trained row calibrates it).

    Returns:
        The row; ``status`` is ``ok``, ``oom``, ``too_slow`` or ``error``.
    """
    row = {"tokens": tokens, "case": case, "docs": None, "doc_mean": doc_mean,
           "layers": args.layers, "step_ms": None, "peak_gib": None}
    stats: dict = {}
    step = layer_step(model, shape, tokens, device, doc_mean, doc_min, args.seed, stats,
                      args.doc_maps)
    if args.index == "trained" and case not in ("dense", "msa_warmup"):
        try:
            row.update(calibrate_row(model, step, noise, doc_mean or tokens))
        except Exception as error:  # out of memory, say: the row cannot run
            free_memory(on_gpu)
            row.update(status="oom" if is_oom(error) else "error",
                       note=f"trained-regime calibration: "
                       f"{type(error).__name__}: {str(error)[:300]}")
            return row
    row_args = args
    if doc_mean:
        row["doc_maps"] = args.doc_maps
        row_args = argparse.Namespace(**{**vars(args), "warmup": max(args.warmup, args.doc_maps)})
    if run_row(step, row_args, on_gpu, row, "step_ms"):
        row["peak_gib"] = peak_gib(on_gpu)
        model.zero_grad(set_to_none=True)
        free_memory(on_gpu)
    if stats.get("documents"):
        row["docs"] = statistics.mean(stats["documents"])
    if case == "dense" and row["status"] == "ok":
        # Its kernels by part (GPU only): the attention time the MSA rows' bound takes.
        row.update(profile_step_parts(step))
    if case != "dense" and row["status"] == "ok":
        # One more, untimed step; its first MSA core-attention call tells how the selections
        # split between the kernels and, timed alone against cuDNN, the attention's rate per
        # attended pair.
        call = capture_core_attention(model, step)
        row.update(selection_stats(call))
        # One more step under the profiler: every sparse kernel's time and the rest by part
        # (GPU only).
        row.update(profile_step_parts(step))
        if call is not None and not args.no_pair_rate:
            row.update(row_pair_rate(call, args, on_gpu))
        del call
        free_memory(on_gpu)
    if row["status"] == "ok":
        row["tokens_per_s"] = tokens / (row["step_ms"] / 1e3)
    return row


def grow(args: argparse.Namespace, model, shape: Shape, case: str, doc_min: int, device,
         on_gpu: bool, noise: dict, done: list[dict], report) -> dict:
    """``--grow-to``: the search for the longest one-document row of ``case`` that runs
    (:func:`layer_bench.rows.next_length`), each row tried reported with ``report``.

    Args:
        done: the case's rows so far (its ``--tokens`` rows; the one-document ones count).

    Returns:
        ``{"tokens", "peak_gib", "step_ms"}`` of the longest row that ran (None where none
        did), ``first_failure`` (the shortest row that ran out of memory or time, None where
        none did) and its ``failure`` status.
    """
    one_doc = [r for r in done if not r["doc_mean"]]
    ran = [r for r in one_doc if r["status"] == "ok"]
    failed = [r for r in one_doc if r["status"] in ("oom", "too_slow")]
    best = max(ran, key=lambda r: r["tokens"], default=None)
    worst = min(failed, key=lambda r: r["tokens"], default=None)
    nxt = None if best is None else next_length(best["tokens"], worst and worst["tokens"],
                                                args.grow_to, args.grow_step)
    while nxt is not None:
        row = measure_row(args, model, shape, case, nxt, 0, doc_min, device, on_gpu, noise)
        row["search"] = "grow-to"
        report(row)
        if row["status"] == "ok":
            best = row
        elif row["status"] in ("oom", "too_slow"):
            worst = row
        else:
            break  # an error is not a length limit: the search stops there
        nxt = next_length(best["tokens"], worst and worst["tokens"], args.grow_to,
                          args.grow_step)
    longest = {"tokens": None, "peak_gib": None, "step_ms": None} if best is None else {
        "tokens": best["tokens"], "peak_gib": best["peak_gib"], "step_ms": best["step_ms"]}
    longest.update(first_failure=worst and worst["tokens"], failure=worst and worst["status"])
    log(f"{case}: longest row that ran {longest['tokens']} tokens (peak {longest['peak_gib']} "
        f"GiB); shortest that failed {longest['first_failure']} ({longest['failure']})")
    return longest


def main(argv: list[str] | None = None) -> int:
    """Parses the arguments, times every row and prints the table (see the module docstring).

    Args:
        argv: the arguments (``sys.argv[1:]`` where None).

    Returns:
        0 where every row is ok, oom, too_slow or skipped; 1 where one failed otherwise.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    ap.add_argument("--tokens", default=None,
                    help="comma-separated rows, N (one document; see --doc-mean) or N:MEAN "
                    "(packed, mean document length MEAN) (default 8192,32768,131072; --tiny: "
                    "128,256)")
    ap.add_argument("--doc-mean", default="0",
                    help="comma-separated mean document lengths of the plain N rows of --tokens "
                    "(0: one document per row)")
    ap.add_argument("--doc-min", type=int, default=None,
                    help="shortest packed document (default 256; --tiny: 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the packed document lengths")
    ap.add_argument("--doc-maps", type=int, default=4,
                    help="packed rows: this many seeded document maps, used in turn (the warm-up "
                    "runs at least this many steps, so every padded length is planned first)")
    ap.add_argument("--layers", type=int, default=1, help="transformer layers per model")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    ap.add_argument("--max-step-s", type=float, default=30.0,
                    help="a row with a warm-up step after the first (which compiles) longer "
                    "than this is reported too_slow")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8192; tiny 256)")
    ap.add_argument("--no-attention-rows", action="store_true",
                    help="skip the dense_attention / cudnn_attention rows")
    ap.add_argument("--no-pair-rate", action="store_true",
                    help="skip the MSA rows' pair rate (their sparse attention and cuDNN's "
                    "dense attention timed alone on the row's q/k/v: a few seconds per row)")
    ap.add_argument("--packed-docs", default=None, metavar="MIN:MAX",
                    help="also time dense attention on one row packed with documents of random "
                    "lengths MIN..MAX, drawn once per size (rows dense_attention_packed and "
                    "cudnn_attention_packed)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel table (torch.profiler) of one more step per row")
    ap.add_argument("--profile-top", type=int, default=12)
    ap.add_argument("--index", choices=("fresh", "coherent", "trained"), default="fresh",
                    help="index queries of the MSA layers: as the freshly initialized indexer "
                    "makes them (random selections), coherent within each 128-token block, or "
                    "with a trained indexer's 8-token-tile unions (a calibrated share of each "
                    "token's own query; layer_bench/selection.py)")
    ap.add_argument("--host-profile", action="store_true",
                    help="per row, the time the host takes to issue one step (host_issue_ms) "
                    "and the top Python functions of another step under cProfile")
    ap.add_argument("--m3-block", action="store_true",
                    help="the real M3 block: one MoE layer (see the module docstring)")
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts of --m3-block (default 128; --tiny 4)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="with --profile: write each profiled step's Chrome trace to DIR")
    ap.add_argument("--transformer-impl", choices=("local", "transformer_engine"),
                    default="local", help="Megatron's transformer_impl of the layer spec")
    ap.add_argument("--fp8", choices=("hybrid", "e4m3"), default=None,
                    help="FP8 GEMMs (TE linears; attention and indexer stay bf16)")
    ap.add_argument("--fp8-recipe", choices=("delayed", "tensorwise", "blockwise"),
                    default="delayed", help="Megatron's fp8_recipe with --fp8")
    ap.add_argument("--deterministic", action="store_true",
                    help="model.deterministic_mode: torch's deterministic algorithms, Megatron's "
                    "deterministic_mode (no cuDNN rows; see the module docstring)")
    ap.add_argument("--tiny", action="store_true", help="tiny model (runs on the CPU in seconds)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA exists")
    ap.add_argument("--json", default=None, help="write the results to this file")
    ap.add_argument("--grow-to", type=int, default=None, metavar="MAX",
                    help="per case, after the --tokens rows, search the longest one-document "
                    "row that fits, up to MAX tokens (see the module docstring)")
    ap.add_argument("--grow-step", type=int, default=16384,
                    help="the resolution of --grow-to's search once a row failed (tokens)")
    ap.add_argument("--set", action="append", default=[], metavar="KERNEL.KEY=VALUE",
                    help="Triton launch parameter for every row (nemo_msa.triton.launch; "
                    "repeatable), e.g. bwd.dq_union_max=64")
    args = ap.parse_args(argv)
    try:
        settings = dict(parse_setting(item) for item in args.set)
        overrides = launch_overrides(settings)
        overrides.__enter__()  # validates every key and value before anything is built
    except ValueError as err:
        raise SystemExit(f"--set: {err}") from None
    try:
        return run(args, argv, settings)
    finally:
        overrides.__exit__(None, None, None)


def run(args: argparse.Namespace, argv: list[str] | None, settings: dict) -> int:
    """Times every row of the parsed arguments ``args`` and prints the table.

    Args:
        args: :func:`main`'s parsed arguments.
        argv: the arguments as given (recorded in the JSON's ``command``).
        settings: the ``--set`` launch parameters in force (recorded in the JSON).

    Returns:
        As :func:`main`.
    """
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit(f"--steps={args.steps} --warmup={args.warmup}: expected both >= 1")
    block = None
    if args.m3_block:
        block = TINY_BLOCK if args.tiny else M3_BLOCK
        if args.experts is not None:
            if args.experts < block.topk:
                raise SystemExit(f"--experts={args.experts}: expected >= the top-k {block.topk}")
            block = Block(**{**block.__dict__, "experts": args.experts})
        if args.cases == ",".join(CASES):
            args.cases = "dense,msa_loss_off,msa_sparse_loss"
    elif args.experts is not None:
        raise SystemExit("--experts needs --m3-block")
    cases = parse_list(args.cases, CASES, "--cases")
    means = [0 if m == "0" else parse_list(m, None, "--doc-mean")[0]
             for m in args.doc_mean.split(",") if m.strip()]
    if not means:
        raise SystemExit(f"--doc-mean={args.doc_mean!r}: expected a comma-separated list")
    row_specs = parse_rows(args.tokens or ("128,256" if args.tiny else "8192,32768,131072"),
                           means, "--tokens")
    sizes = [tokens for tokens, _ in row_specs]
    doc_min = args.doc_min if args.doc_min is not None else (16 if args.tiny else 256)
    if doc_min < 1 or args.layers < 1 or args.doc_maps < 1:
        raise SystemExit(f"--doc-min={doc_min} --layers={args.layers} --doc-maps="
                         f"{args.doc_maps}: expected each >= 1")
    bad_means = [m for m in means + [m for _, m in row_specs] if 0 < m < doc_min]
    if bad_means:
        raise SystemExit(f"--doc-mean / --tokens N:MEAN {sorted(set(bad_means))}: expected 0 "
                         f"or a mean >= --doc-min={doc_min}")
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
    if not on_gpu and args.transformer_impl == "transformer_engine":
        raise SystemExit("--transformer-impl transformer_engine needs a CUDA GPU")
    if args.fp8 is not None and args.transformer_impl != "transformer_engine":
        raise SystemExit(f"--fp8 {args.fp8} needs --transformer-impl transformer_engine (FP8 "
                         "GEMMs are TE's)")
    bad = [n for n in sizes if n % shape.block]
    if bad:
        raise SystemExit(f"--tokens {bad}: expected multiples of the block size {shape.block}")
    if args.grow_to is not None:
        if args.grow_to <= max(sizes) or args.grow_to % shape.block:
            raise SystemExit(f"--grow-to={args.grow_to}: expected a multiple of the block size "
                             f"{shape.block} above the longest --tokens row {max(sizes)}")
        if args.grow_step < 1 or args.grow_step % shape.block:
            raise SystemExit(f"--grow-step={args.grow_step}: expected a positive multiple of "
                             f"the block size {shape.block}")

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.deterministic:
        try:
            determinism.enable()  # before CUDA starts: cuBLAS reads its workspace setting once
        except RecipeError as err:
            raise SystemExit(f"--deterministic: {err}") from None
        if not (args.no_attention_rows and args.no_pair_rate):
            log("--deterministic: no cuDNN attention rows and no pair rate (cuDNN's SDPA has "
                "no deterministic backward)")
        args.no_attention_rows = args.no_pair_rate = True
    init_single_rank(on_gpu)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    gpu = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    log(f"bench_layer: {gpu}, torch {torch.__version__}, triton {triton_version}, shape "
         f"{shape}, M3 block {block}, dtype {dtype}, {args.transformer_impl} spec, fp8 "
         f"{args.fp8}, deterministic {args.deterministic}, steps {args.steps} after "
         f"{args.warmup} warm-up")

    rows: list[dict] = []
    result = {
        "gpu": gpu,
        "commit": commit_id(),
        "torch": torch.__version__,
        "triton": triton_version,
        "command": " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "shape": shape.__dict__,
        "m3_block": block.__dict__ if block is not None else None,
        "dtype": str(dtype),
        "transformer_impl": args.transformer_impl,
        "fp8": args.fp8 and f"{args.fp8} ({args.fp8_recipe})",
        "deterministic": args.deterministic,
        "step": "forward + backward of the mean LM loss (+ indexer loss where on); optimizer "
        "step excluded",
        "layers": args.layers,
        "launch_settings": settings,
        "index": args.index,
        "documents": f"packed rows: {doc_min} + Exponential(doc_mean - {doc_min}) tokens per "
        f"document, the last cut to fit; {args.doc_maps} document maps (seed {args.seed}) in "
        "turn, a new map tensor every step, warm-up >= the maps",
        "rows": rows,
    }
    if args.grow_to is not None:
        result["longest"] = {}

    def report(row: dict) -> None:
        # Written after every row, so a run stopped by a time limit keeps what it measured.
        rows.append(row)
        log(json.dumps(row))
        if args.json:
            write_json(args.json, result)

    for case in cases:
        config = case_config(case, shape, on_gpu, block, args.layers, args.transformer_impl,
                             args.fp8, args.fp8_recipe, args.deterministic)
        set_training_iteration(0)
        model = build_model(config, shape, max(sizes + [args.grow_to or 0]), on_gpu)
        layer = getattr(model, "module", model).decoder.layers[0]
        # The coherent hooks' share of a token's own index query; a trained row calibrates it.
        noise = {"noise": NOISE}
        if args.index in ("coherent", "trained"):
            coherent_index_hooks(model, shape.block, noise)
        log(f"{case}: {type(layer.self_attention).__name__}, {type(layer.mlp).__name__}")
        blocked = None
        for tokens, doc_mean in row_specs:
            if blocked is not None and tokens >= blocked[0]:
                report({"tokens": tokens, "case": case, "docs": None, "doc_mean": doc_mean,
                        "layers": args.layers, "step_ms": None, "peak_gib": None,
                        "status": "skipped", "note": f"{blocked[1]} at {blocked[0]} tokens"})
                continue
            row = measure_row(args, model, shape, case, tokens, doc_mean, doc_min, device,
                              on_gpu, noise)
            if row["status"] in ("oom", "too_slow"):
                blocked = (tokens, row["status"])
            report(row)
        if args.grow_to is not None:
            result["longest"][case] = grow(args, model, shape, case, doc_min, device, on_gpu,
                                           noise, [r for r in rows if r["case"] == case],
                                           report)
        del model
        MSAIndexerLossAutoScaler.reset()
        free_memory(on_gpu)

    if not args.no_attention_rows:
        for tokens in dict.fromkeys(sizes):
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

    add_bounds(rows, shape)
    if args.json:
        write_json(args.json, result)
    log_kernels(rows)
    log("\n" + fmt_table(rows))
    log("step_ms: median of one training step's forward+backward (optimizer excluded); "
         "x dense: dense step / this step; pair rate: the MSA layer's sparse attention's "
         "(query, key) pairs per ms over cuDNN's dense attention's on the same q/k/v and "
         "documents; fwdbwd_ms: attention alone; x cudnn: this / cuDNN; peak_gib: max "
         "allocated during the row (model, grads and inputs included); of bound: the step "
         "the row could reach (the dense step with its attention replaced by the MSA pairs, "
         "the index scoring and projections at cuDNN's rate; layer_bench/bound.py) over "
         "this step.")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0 if all(r["status"] in ("ok", "oom", "too_slow", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
