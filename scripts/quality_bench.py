#!/usr/bin/env python
"""Does an MSA model learn as well as a dense one? Train both (and a control) and compare.

For every sequence length the same model (``--recipe``, default ``recipes/quality_bench.yaml``)
is trained three times on the same real corpus with the same seed and data order:

- ``msa``: the recipe's MSA layers;
- ``dense``: every layer dense (``model.msa_layer_pattern`` of ``D`` only);
- ``control``: MSA with ``model.msa_topk=1``, so each query attends only its own block; it must
  come out measurably worse, which shows that the benchmark can tell a difference.

Each run evaluates on the validation split every ``train.eval_interval`` steps and at its end.
The report (``quality.md``, ``quality.json``, ``quality.png`` in ``--out``) gives per length and
arm: steps run, validation loss at equal steps (the last evaluation step all arms reached) and at
equal training wall time (each arm's validation curve interpolated linearly at the shortest arm's
last evaluation time; evaluation time excluded), the final per-position-bucket validation loss,
the validation loss of the copy documents' second copies (``--copy-marker``; a corpus from
``prepare_corpus.py --copy-fraction``: only attention that reaches a copy's length back can
predict them, so an arm that cannot must come out worse there), the mean selection recall of
the last 10 steps, tokens/s and TFLOP/s per GPU (median over steps
after the first 5) and MFU. ``--time-budget-s`` bounds the whole call: each run gets an equal
share of what is left (``train.exit_duration_in_mins``), so one device call cannot overrun.

Examples::

    python scripts/prepare_corpus.py --out /tmp/corpus
    python scripts/quality_bench.py --corpus /tmp/corpus/pycode_text_document \\
        --seq-lengths 8192,32768 --time-budget-s 420 --out runs/quality
    python scripts/quality_bench.py --tiny --corpus PREFIX --out /tmp/q   # CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "scripts"))

from layer_bench.report import commit_id  # noqa: E402  (the layer bench's: NEMO_MSA_COMMIT first)

ARMS = ("msa", "dense", "control")
#: Tokens per training step at every length (global batch = this / sequence length).
TOKENS_PER_STEP = 32768
#: The CPU smoke-test preset: a 2-layer model of width 64 on 256-token rows, a few steps.
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=16",
    "model.msa_index_head_dim=16", "model.msa_block_size=32", "model.msa_topk=2",
    "model.msa_dense_warmup_steps=1", "model.vocab_size=257", "model.bf16=false",
    "model.msa_backend=reference", "optimizer.clip_grad=0.0", "optimizer.lr=3e-3",
    "scheduler.lr_warmup_iters=1", "train.train_iters=4", "train.eval_interval=2",
    "train.eval_iters=1", "logger.progress_bar=false",
    "logger.plot=false", "dataset.split=90,10,0",
]


def arm_overrides(arm: str, num_layers: int) -> list[str]:
    """The overrides that turn the recipe's MSA model into ``arm``."""
    if arm == "msa":
        return []
    if arm == "dense":
        return [f"model.msa_layer_pattern={'D' * num_layers}"]
    if arm == "control":
        return ["model.msa_topk=1", "model.msa_init_blocks=0", "model.msa_local_blocks=1"]
    raise ValueError(f"arm={arm!r}; expected one of {ARMS}")


def read_metrics(path: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(rows: list[dict]) -> dict:
    """One run's figures from its metrics rows (see the module docstring)."""
    train_time = 0.0
    curve = []  # (iteration, cumulative training seconds, val_loss)
    copy_curve = []  # (iteration, cumulative training seconds, val_loss/copy)
    for r in rows:
        train_time += r["step_time_s"]
        if "val_loss" in r:
            curve.append((r["iteration"], train_time, r["val_loss"]))
        if "val_loss/copy" in r:
            copy_curve.append((r["iteration"], train_time, r["val_loss/copy"]))
    steady = rows[5:] or rows
    last_eval = next((r for r in reversed(rows) if "val_loss" in r), {})
    recalls = [r["recall"] for r in rows[-10:] if "recall" in r]
    out = {
        "steps": rows[-1]["iteration"] if rows else 0,
        "train_seconds": train_time,
        "val_curve": curve,
        "copy_curve": copy_curve,
        "final_val_loss": last_eval.get("val_loss", math.nan),
        "buckets": {k.split("/", 1)[1]: v for k, v in last_eval.items()
                    if k.startswith("val_loss/")},
        "recall": statistics.fmean(recalls) if recalls else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if rows else 0.0,
        "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in steady) if rows else 0.0,
    }
    mfu = [r["mfu"] for r in steady if "mfu" in r]
    out["mfu"] = statistics.median(mfu) if mfu else None
    return out


def interpolate(curve: list[tuple[int, float, float]], t: float) -> float:
    """Validation loss at training time ``t`` by linear interpolation (nan outside the curve)."""
    for (_, t0, v0), (_, t1, v1) in zip(curve, curve[1:], strict=False):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    if curve and math.isclose(curve[-1][1], t):
        return curve[-1][2]
    return math.nan


def _gaps(loss: dict[str, float], suffix: str) -> dict[str, float]:
    """``msa_minus_dense<suffix>`` and ``control_minus_best<suffix>`` (control minus the better
    of MSA and dense) of one loss per arm, for the arms present."""
    out = {}
    if {"msa", "dense"} <= loss.keys():
        out[f"msa_minus_dense{suffix}"] = loss["msa"] - loss["dense"]
    if "control" in loss and {"msa", "dense"} & loss.keys():
        best = min(loss[a] for a in ("msa", "dense") if a in loss)
        out[f"control_minus_best{suffix}"] = loss["control"] - best
    return out


def compare(runs: dict[str, dict]) -> dict:
    """Equal-step and equal-time validation losses of the arms of one sequence length."""
    steps_sets = [{it for it, _, _ in r["val_curve"]} for r in runs.values()]
    common = set.intersection(*steps_sets) if steps_sets else set()
    eq_step = max(common) if common else None
    eq_time = min((r["val_curve"][-1][1] for r in runs.values() if r["val_curve"]),
                  default=math.nan)
    out = {"equal_step": eq_step, "equal_time_s": eq_time, "arms": {}}
    for arm, r in runs.items():
        at_step = next((v for it, _, v in r["val_curve"] if it == eq_step), math.nan)
        out["arms"][arm] = {"val_loss_at_equal_step": at_step,
                            "val_loss_at_equal_time": interpolate(r["val_curve"], eq_time)}
        if r.get("copy_curve"):
            out["arms"][arm]["copy_loss_at_equal_step"] = next(
                (v for it, _, v in r["copy_curve"] if it == eq_step), math.nan)
    arms = out["arms"]
    out.update(_gaps({arm: a["val_loss_at_equal_step"] for arm, a in arms.items()}, ""))
    if arms and all("copy_loss_at_equal_step" in a for a in arms.values()):
        out.update(_gaps({arm: a["copy_loss_at_equal_step"] for arm, a in arms.items()}, "_copy"))
    if "control_minus_best" in out:
        out["control_worse"] = bool(out["control_minus_best"] > 0.01)
    return out


def _fmt(v, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown(report: dict) -> str:
    """The report as markdown tables, one per sequence length."""
    lines = [f"# MSA vs dense quality benchmark ({report['date']}, {report['device']}, "
             f"commit {report['commit']})", "", f"Command: `{report['command']}`", ""]
    for seq, block in report["lengths"].items():
        cmp_ = block["comparison"]
        buckets = sorted({b for r in block["runs"].values() for b in r["buckets"]
                          if b.startswith("pos_")},
                         key=lambda b: int(b.split("_")[1].split("-")[0].replace("k", "000")))
        if any("copy" in r["buckets"] for r in block["runs"].values()):
            buckets.append("copy")
        lines += [f"## {seq} tokens per sequence", "",
                  f"equal step = {cmp_['equal_step']}, equal training time = "
                  f"{_fmt(cmp_['equal_time_s'], 1)} s", ""]
        head = ["arm", "steps", "val loss @ equal step", "val loss @ equal time",
                "copy loss @ equal step", "final val loss", *buckets, "selection recall",
                "tokens/s", "TFLOP/s/GPU", "MFU"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for arm, r in block["runs"].items():
            a = cmp_["arms"][arm]
            cells = [arm, str(r["steps"]), _fmt(a["val_loss_at_equal_step"]),
                     _fmt(a["val_loss_at_equal_time"]), _fmt(a.get("copy_loss_at_equal_step")),
                     _fmt(r["final_val_loss"]),
                     *(_fmt(r["buckets"].get(b)) for b in buckets), _fmt(r["recall"], 3),
                     f"{r['tokens_per_s']:.0f}", _fmt(r["tflops_per_gpu"], 2), _fmt(r["mfu"], 3)]
            lines.append("| " + " | ".join(cells) + " |")
        notes = [f"{arm} failed: {r['error']}" for arm, r in block["runs"].items()
                 if "error" in r]
        if "msa_minus_dense" in cmp_:
            notes.append(f"MSA - dense validation loss at equal step: "
                         f"{cmp_['msa_minus_dense']:+.4f}")
        if "control_minus_best" in cmp_:
            notes.append(f"control - best of MSA/dense: {cmp_['control_minus_best']:+.4f} "
                         f"({'worse' if cmp_['control_worse'] else 'NOT measurably worse'})")
        if "msa_minus_dense_copy" in cmp_:
            notes.append(f"MSA - dense copy loss (second copies) at equal step: "
                         f"{cmp_['msa_minus_dense_copy']:+.4f}")
        if "control_minus_best_copy" in cmp_:
            notes.append(f"control - best of MSA/dense copy loss at equal step: "
                         f"{cmp_['control_minus_best_copy']:+.4f}")
        lines += [""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path | None:
    """Validation loss against step and against training time, one column per length."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lengths = list(report["lengths"])
    fig, axes = plt.subplots(2, len(lengths), figsize=(5 * len(lengths), 7), squeeze=False)
    for j, seq in enumerate(lengths):
        for arm, r in report["lengths"][seq]["runs"].items():
            its, ts, vs = zip(*r["val_curve"], strict=True) if r["val_curve"] else ((), (), ())
            axes[0][j].plot(its, vs, "o-", label=arm)
            axes[1][j].plot(ts, vs, "o-", label=arm)
        axes[0][j].set_title(f"{seq} tokens per sequence")
        axes[0][j].set_xlabel("step")
        axes[1][j].set_xlabel("training time (s)")
        for i in (0, 1):
            axes[i][j].set_ylabel("validation loss")
            axes[i][j].grid(alpha=0.3)
            axes[i][j].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_arm(recipe: str | None, overrides: list[str]) -> None:
    """One training run in this process (the process group is set up and torn down)."""
    import torch

    from nemo_msa.training.recipe import load_recipe
    from nemo_msa.training.trainer import pretrain, teardown

    try:
        pretrain(load_recipe(recipe, overrides))
    finally:
        teardown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def main(argv: list[str] | None = None) -> dict:
    """Run the arms, write the report, return it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="indexed-dataset prefix (prepare_corpus)")
    parser.add_argument("--recipe", default=None,
                        help="base recipe (default recipes/quality_bench.yaml; msa_tiny --tiny)")
    parser.add_argument("--seq-lengths", default=None,
                        help="comma-separated (default 8192,32768; 256 with --tiny)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--tokens-per-step", type=int, default=None,
                        help=f"default {TOKENS_PER_STEP} (512 with --tiny)")
    parser.add_argument("--time-budget-s", type=float, default=480.0,
                        help="wall-time budget of the whole call (default 480)")
    parser.add_argument("--copy-marker", type=int, default=None,
                        help="the corpus's copy marker (prepare_corpus --copy-fraction: 0); "
                        "adds the copy column, the loss of second copies")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke-test preset")
    parser.add_argument("--out", default="runs/quality")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every arm")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    args.seq_lengths = args.seq_lengths or ("256" if args.tiny else "8192,32768")
    args.tokens_per_step = args.tokens_per_step or (512 if args.tiny else TOKENS_PER_STEP)
    lengths = [int(x) for x in args.seq_lengths.split(",") if x]
    arms = [a for a in args.arms.split(",") if a]
    if not arms or not lengths:
        raise SystemExit("error: --arms and --seq-lengths must name at least one each")
    for arm in arms:
        arm_overrides(arm, 1)  # names a bad arm before anything runs
    bad = [s for s in lengths if s <= 0 or args.tokens_per_step % s]
    if bad:
        raise SystemExit(f"error: --seq-lengths {bad[0]}: expected a positive divisor of "
                         f"--tokens-per-step ({args.tokens_per_step})")
    if args.time_budget_s <= 0:
        raise SystemExit(f"error: --time-budget-s = {args.time_budget_s}: expected > 0")
    recipe = args.recipe or (None if args.tiny else str(REPO / "recipes/quality_bench.yaml"))
    base = (TINY if args.tiny else []) + list(args.overrides)
    if args.copy_marker is not None:
        base.append(f"train.eval_copy_marker={args.copy_marker}")
    from nemo_msa.training.recipe import load_recipe

    num_layers = int(load_recipe(recipe, base).model.get("num_layers", 1))
    out = Path(args.out)
    report = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "device": _device_name(),
              "commit": commit_id(), "command": "python scripts/quality_bench.py "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "corpus": args.corpus, "tokens_per_step": args.tokens_per_step, "lengths": {}}
    todo = [(s, a) for s in lengths for a in arms]
    for i, (seq, arm) in enumerate(todo):
        left = args.time_budget_s - (time.perf_counter() - t0)
        # Start-up (model build, data indices, kernel compiles) is outside the loop's clock.
        share_min = max(left / (len(todo) - i) - (3.0 if args.tiny else 20.0), 1.0) / 60.0
        gbs = args.tokens_per_step // seq
        run_dir = out / f"seq{seq}" / arm
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        overrides = base + [
            f"dataset.data_path=[{args.corpus}]", f"model.seq_length={seq}",
            f"train.global_batch_size={gbs}", f"train.micro_batch_size={min(gbs, 4)}",
            f"train.exit_duration_in_mins={share_min}", f"logger.output_dir={run_dir}",
            "checkpoint.save=null",
        ] + arm_overrides(arm, num_layers)
        print(f"== {arm} at {seq} tokens ({share_min * 60:.0f} s of training at most)",
              flush=True)
        error = None
        try:
            run_arm(recipe, overrides)
        except Exception as err:  # noqa: BLE001 - one failed run must not lose the others
            error = f"{type(err).__name__}: {err}"
            print(f"== {arm} at {seq} tokens failed: {error}", flush=True)
        log = run_dir / "metrics.jsonl"
        block = report["lengths"].setdefault(str(seq), {"runs": {}})
        block["runs"][arm] = summarize_run(read_metrics(log) if log.exists() else [])
        if error:
            block["runs"][arm]["error"] = error
        block["comparison"] = compare(block["runs"])
        report["wall_seconds"] = time.perf_counter() - t0
        # Written after every run: a call killed from outside still leaves what it finished.
        text = write_report(report, out)
    print(text, flush=True)
    return report


def write_report(report: dict, out: Path) -> str:
    """Write quality.json, quality.md and quality.png to ``out``; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out / "quality.md").write_text(text + "\n")
    plot(report, out / "quality.png")
    return text


if __name__ == "__main__":
    result = main()
    failed = any("error" in r for b in result["lengths"].values() for r in b["runs"].values())
    sys.exit(1 if failed else 0)
