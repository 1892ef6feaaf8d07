#!/usr/bin/env python
"""Peak memory and step time of MSA layers with and without full activation recompute (ADR 0028).

The model is a Megatron-Core ``GPTModel`` of ``--layers`` MSA layers at MiniMax-M3's attention
and dense-FFN width (the shape of ``benchmarks/bench_layer.py``: hidden 6144, SwiGLU FFN 16384,
64 query / 4 KV heads of 128, index heads 4 x 128, blocks of 128, top-16; bf16 under
``Float16Module``, Triton backend on the GPU), one document per row of ``--tokens`` tokens. For
each size the SAME model and the same inputs run a training step (forward + backward of the mean
LM loss and the indexer loss, no optimizer) in each mode of ``--modes``:

- ``none``: no recompute;
- ``full``: ``recompute_granularity="full"``, method ``uniform``, one layer per checkpoint (the
  layers' outputs kept, everything inside recomputed in the backward, the selection replayed);
- ``selective``: ``recompute_granularity="selective"`` with ``core_attn`` (the attention core
  recomputed in the backward, the selection kept by the layer).

Per row: ``peak_gib`` (``torch.cuda.max_memory_allocated`` during the measured step),
``step_peak_gib`` (that minus what was allocated before the step: model and inputs), ``step_ms``
(median of ``--steps`` after one warm-up), ``selections`` (calls of the block selection in the
measured step: one per layer when the recompute replays it), ``repeatable`` (the warm-up and the
last step of the mode, same inputs, give bit-identical loss and gradients: the model is
deterministic, so the next comparison means something) and, against the first mode's row of the
size (``reference``), ``bitwise`` (loss and every gradient bit-identical) and ``max_grad_diff``.

Usage::

    python benchmarks/bench_recompute.py --tokens 16384,65536 --layers 4 --json recompute.json
    python benchmarks/bench_recompute.py --tiny    # CPU, gloo, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
warnings.filterwarnings("ignore", category=FutureWarning)
logging.getLogger("megatron").setLevel(logging.ERROR)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from layer_bench.model import M3, TINY, Shape, init_single_rank  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

from layer_specs import get_msa_decoder_block_spec  # noqa: E402
from nemo_msa.megatron import (  # noqa: E402
    MSAIndexerLossAutoScaler,
    MSAIndexerMetrics,
    MSATransformerConfig,
    cpu_shim,
    msa_attention,
    set_training_iteration,
)

MODES = {
    "none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_method=None,
                      recompute_num_layers=None),
}


def build(shape: Shape, layers: int, max_tokens: int, on_gpu: bool, loss: str):
    """The model (no recompute; :func:`set_mode` switches it) and its config."""
    precision = ({"bf16": True, "params_dtype": torch.bfloat16, "msa_backend": "triton"}
                 if on_gpu else dict(cpu_shim.cpu_config_overrides()))
    losses = {"sparse": {"msa_indexer_loss_type": "sparse"}, "dense": {},
              "off": {"msa_indexer_loss_coeff": 0.0}}[loss]
    config = MSATransformerConfig(
        num_layers=layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads, num_query_groups=shape.groups,
        kv_channels=shape.head_dim, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, transformer_impl="local", msa_num_index_heads=shape.index_heads,
        msa_index_head_dim=shape.index_dim, msa_block_size=shape.block, msa_topk=shape.topk,
        msa_layer_pattern="S" * layers, **losses, **precision,
    )
    model = GPTModel(
        config, get_msa_decoder_block_spec(config), vocab_size=shape.vocab,
        max_sequence_length=max_tokens, position_embedding_type="rope", rotary_percent=0.5,
        rotary_base=5_000_000, share_embeddings_and_output_weights=False,
    )
    if on_gpu:
        model = Float16Module(config, model.cuda())
    return model.train(), config


def set_mode(model, config, mode: str) -> None:
    """Switches recompute on the built model: Megatron's block reads ``recompute_granularity``
    at every forward; selective core-attention recompute is a flag its layers set at build."""
    for name, value in MODES[mode].items():
        setattr(config, name, value)
    if mode == "selective":
        config.recompute_modules = ["core_attn"]
    for module in model.modules():
        if isinstance(module, msa_attention.MSASelfAttention):
            module.checkpoint_core_attention = mode == "selective"


def _same(a: tuple, b: tuple) -> tuple[bool, float]:
    """Whether two (loss, gradients) are bit-identical, and the largest gradient difference."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    if set(grads_a) != set(grads_b):
        return False, float("inf")
    same = torch.equal(loss_a, loss_b) and all(
        torch.equal(grads_a[n], g) for n, g in grads_b.items())
    diff = max((float((grads_a[n].float() - g.float()).abs().max()) for n, g in grads_b.items()),
               default=0.0)
    return same, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default=None, help="comma-separated (default 16384,65536)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--modes", default="none,full,selective")
    ap.add_argument("--loss", default="sparse", choices=("sparse", "dense", "off"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (seconds)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tokens_arg = args.tokens or ("128,256" if args.tiny else "16384,65536")
    try:
        sizes = [int(x) for x in tokens_arg.split(",")]
    except ValueError:
        raise SystemExit(f"--tokens={tokens_arg!r}: expected comma-separated integers") from None
    modes = [m.strip() for m in args.modes.split(",")]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes={args.modes!r}: unknown {bad}; expected some of {list(MODES)}")
    if args.layers < 1 or args.steps < 1:
        raise SystemExit(f"--layers={args.layers} --steps={args.steps}: expected >= 1")
    shape = TINY if args.tiny else M3
    on_gpu = torch.cuda.is_available() and not args.tiny
    if not on_gpu and not args.tiny:
        raise SystemExit("the MiniMax-M3 shape needs a CUDA GPU; on the CPU run with --tiny")
    if any(n % shape.block for n in sizes):
        raise SystemExit(f"--tokens {sizes}: expected multiples of the block size {shape.block}")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    init_single_rank(on_gpu)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    set_training_iteration(0)
    torch.manual_seed(0)
    model, config = build(shape, args.layers, max(sizes), on_gpu, args.loss)

    counter: list = []
    select = msa_attention.select
    msa_attention.select = lambda *a, **k: counter.append(1) or select(*a, **k)
    rows = []
    for tokens in sizes:
        generator = torch.Generator().manual_seed(tokens)
        text = torch.randint(1, shape.vocab, (1, tokens), generator=generator)
        reference = None
        for mode in modes:
            set_mode(model, config, mode)
            row = {"tokens": tokens, "layers": args.layers, "mode": mode, "loss": args.loss}
            try:
                times, results = [], []
                for index in range(args.steps + 1):
                    # Fresh document-map tensor per step, as a loader hands them.
                    batch = {"text": text.to(device), "labels": text.roll(-1, 1).to(device),
                             "ids": torch.ones(1, tokens, dtype=torch.int64, device=device),
                             "positions": torch.arange(tokens, device=device)[None]}
                    if on_gpu:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        before = torch.cuda.memory_allocated()
                    start = time.perf_counter()
                    model.zero_grad(set_to_none=True)
                    del counter[:]
                    out = model(batch["text"], batch["positions"], batch["ids"],
                                labels=batch["labels"])
                    loss = out.float().mean()
                    loss.backward()
                    if on_gpu:
                        torch.cuda.synchronize()
                    if index:
                        times.append((time.perf_counter() - start) * 1e3)
                    MSAIndexerMetrics.reset()
                    if index in (0, args.steps):
                        # Kept on the host, outside the next step's peak.
                        results.append((loss.detach().cpu(), {
                            n: p.grad.detach().cpu() for n, p in model.named_parameters()
                            if p.grad is not None}))
                    del out, loss
                if on_gpu:
                    peak = torch.cuda.max_memory_allocated()
                    row["peak_gib"] = round(peak / 2**30, 2)
                    row["step_peak_gib"] = round((peak - before) / 2**30, 2)
                row["step_ms"] = round(statistics.median(times), 1)
                row["selections"] = len(counter)
                # The same step twice in this mode: is the model deterministic at all?
                row["repeatable"] = _same(results[0], results[-1])[0]
                if reference is None:
                    reference = results[-1]
                    row["reference"] = True
                else:
                    row["bitwise"], row["max_grad_diff"] = _same(results[-1], reference)
                row["status"] = "ok"
            except torch.OutOfMemoryError:
                row["status"] = "oom"
            finally:
                model.zero_grad(set_to_none=True)
                MSAIndexerLossAutoScaler.reset()
                if on_gpu:
                    torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0 if all(r["status"] in ("ok", "oom") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
