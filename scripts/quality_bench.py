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
after the first 5) and MFU. With ``--probes passkey,mqar`` every evaluation also runs the
retrieval probes (``train.eval_probes``, ADR 0040) and the report adds a probe table: accuracy per
passkey depth and MQAR distance bucket at the equal step, MSA minus dense in points, and whether
MSA is within 5 points of dense at every passkey depth.

Every arm trains ``--steps`` steps (its schedule spans them: ``train.train_iters``), so the arms
compare at equal steps. ``--time-budget-s`` bounds the whole call and is only a guard: each arm
still to run gets an equal share of what is left (``train.exit_duration_in_mins``), so one
device call cannot overrun; an arm the guard stops is reported as stopped by the time guard at
its step. Arms are resumable: each saves checkpoints into its run directory
(``--out/seq<S>/<arm>``, every ``--save-interval`` steps and when stopped) and the next call with
the same ``--out`` continues it from its newest checkpoint (``checkpoint.save`` with
``checkpoint.resume``); an arm that has reached ``--steps`` is only summarized. ``--restart``
deletes the arms' directories first.

``--extrapolate-to L`` adds, per trained length S <= L, an evaluation of each finished arm's
checkpoint at L (``train.skip_train`` with ``checkpoint.load``; run directory
``--out/seq<S>_at<L>/<arm>``), the length-extrapolation rows of the report (S = L: a final
evaluation at the trained length); ``--final-probe-rows N`` gives these evaluations N probe rows
per bucket (more than the per-interval evaluations can afford, for the 5-point verdict).

Examples::

    python scripts/prepare_corpus.py --out /tmp/corpus
    python scripts/quality_bench.py --corpus /tmp/corpus/pycode_text_document \\
        --seq-lengths 8192,32768 --time-budget-s 420 --out runs/quality
    python scripts/quality_bench.py --tiny --corpus PREFIX --out /tmp/q   # CPU, seconds
    python scripts/prepare_corpus.py --out /tmp/corpus --copy-fraction 0.05 \
        --passkey-fraction 0.05 --mqar-fraction 0.05
    python scripts/quality_bench.py --corpus /tmp/corpus/pycode_text_document --copy-marker 0 \
        --probes passkey,mqar --steps 2000 --seq-lengths 8192 --extrapolate-to 32768 \
        --time-budget-s 540 --out runs/quality49     # repeat the same call until every arm is done
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "scripts"))

from nemo_msa.training.provenance import commit_id  # noqa: E402

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
    "logger.plot=false", "dataset.split=90,10,0", "train.eval_probe_rows=1",
]
#: The checkpoint pointer file (nemo_msa.training.checkpoint_integrity.POINTER).
POINTER = "latest_checkpointed_iteration.txt"


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
    probe_curve = []  # (iteration, {probe/...: value})
    for r in rows:
        train_time += r.get("step_time_s", 0.0)
        if "val_loss" in r:
            curve.append((r["iteration"], train_time, r["val_loss"]))
        if "val_loss/copy" in r:
            copy_curve.append((r["iteration"], train_time, r["val_loss/copy"]))
        probes = {k: v for k, v in r.items() if k.startswith("probe/")}
        if probes:
            probe_curve.append((r["iteration"], probes))
    rows = [r for r in rows if "step_time_s" in r] or rows  # training steps (not skip_train)
    steady = rows[5:] or rows
    last_eval = next((r for r in reversed(rows) if "val_loss" in r), {})
    recalls = [r["recall"] for r in rows[-10:] if "recall" in r]
    out = {
        "steps": rows[-1]["iteration"] if rows else 0,
        "train_seconds": train_time,
        "val_curve": curve,
        "copy_curve": copy_curve,
        "probe_curve": probe_curve,
        "probes": probe_curve[-1][1] if probe_curve else {},
        "final_val_loss": last_eval.get("val_loss", math.nan),
        "buckets": {k.split("/", 1)[1]: v for k, v in last_eval.items()
                    if k.startswith("val_loss/")},
        "recall": statistics.fmean(recalls) if recalls else None,
        "tokens_per_s": statistics.median(r.get("tokens_per_s", 0.0) for r in steady)
        if rows else 0.0,
        "tflops_per_gpu": statistics.median(r.get("tflops_per_gpu", 0.0) for r in steady)
        if rows else 0.0,
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


#: The issue's bar: MSA's passkey accuracy at most this many points below dense at every depth.
PROBE_TOLERANCE_POINTS = 5.0


def probe_gaps(probes: dict[str, dict[str, float]]) -> dict:
    """MSA minus dense probe accuracy in points per bucket, and the 5-point verdict.

    Args:
        probes: per arm, its ``probe/...`` metrics at the equal step (empty: none).

    Returns:
        ``{"probe_msa_minus_dense_points": {bucket key: points}, "msa_within_5_points":
        bool}`` when both arms have probe accuracies (the verdict over the passkey depths when
        there are any, else over every bucket); empty otherwise.
    """
    msa, dense = probes.get("msa") or {}, probes.get("dense") or {}
    keys = [k for k in msa if "_acc/" in k and k in dense]
    if not keys:
        return {}
    gaps = {k: 100.0 * (msa[k] - dense[k]) for k in keys}
    judged = [k for k in keys if k.startswith("probe/passkey_acc/")] or keys
    return {"probe_msa_minus_dense_points": gaps,
            "msa_within_5_points": all(gaps[k] >= -PROBE_TOLERANCE_POINTS for k in judged)}


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
        probes = dict(r.get("probe_curve", [])).get(eq_step)
        if probes:
            out["arms"][arm]["probes_at_equal_step"] = probes
    arms = out["arms"]
    out.update(probe_gaps({arm: a.get("probes_at_equal_step", {}) for arm, a in arms.items()}))
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
        title = (f"{seq} tokens per sequence" if "_at_" not in seq else
                 "trained at {} tokens, evaluated at {} tokens".format(*seq.split("_at_")))
        lines += [f"## {title}", "",
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
        lines += probe_table(block)
        notes = [f"{arm} failed: {r['error']}" for arm, r in block["runs"].items()
                 if "error" in r]
        notes += [f"{arm} stopped at step {r['steps']} of {r['target_steps']} (the time guard; "
                  "call again with the same --out to resume it)"
                  for arm, r in block["runs"].items() if r.get("stopped_early")]
        if "msa_within_5_points" in cmp_:
            notes.append("MSA within 5 points of dense at every passkey depth: "
                         + ("yes" if cmp_["msa_within_5_points"] else "NO"))
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
    lines += regime_tables(report.get("regimes", {}))
    return "\n".join(lines)


def read_regimes(out: Path) -> dict:
    """The ``regime_<S>_at_<L>.json`` files of ``benchmarks/indexer_regime.py`` in ``out``
    (the trained MSA arms' selections), by file stem."""
    regimes = {}
    for path in sorted(out.glob("regime_*.json")):
        try:
            regimes[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            print(f"warning: {path} skipped: {err}", flush=True)
    return regimes


def regime_tables(regimes: dict) -> list[str]:
    """Markdown lines of the trained indexers' selection statistics, beside the random and
    block-shared selections on the same rows; empty without any."""
    lines = []
    for name, r in regimes.items():
        mean = r.get("mean") or {}
        if not mean:
            continue
        qts = sorted(mean, key=int)
        lines += [f"## The trained indexer's selections: {name} (iteration {r.get('iteration')}, "
                  f"{r.get('seq_length')} tokens, {r.get('rows')} rows, cap {r.get('cap')})", "",
                  "| selections | " + " | ".join(f"union qt={q}" for q in qts)
                  + f" | union-kernel work share qt={qts[-1]} | inflation qt={qts[-1]} |",
                  "|" + "---|" * (len(qts) + 3)]
        rows = {"trained (mean over layers)": mean, **(r.get("synthetic") or {})}
        for label, stats in rows.items():
            last = stats[qts[-1]]
            lines.append(f"| {label} | " + " | ".join(_fmt(stats[q]["union_mean"], 1)
                                                        for q in qts)
                         + f" | {_fmt(last['union_exact_share'], 3)} | "
                         f"{_fmt(last['union_inflation'], 2)} |")
        needle = (r.get("passkey_needle") or {}).get("buckets")
        if needle:
            lines += ["", "Passkey needle block selected by the question's tokens (shares):", "",
                      "| depth | selected (layer, head, token) | by some layer and head | "
                      "uniform draw | rows |", "|---|---|---|---|---|"]
            for bucket, e in needle.items():
                lines.append(f"| {bucket.removeprefix('passkey/')} | {_fmt(e['selected'], 3)} "
                             f"| {_fmt(e['selected_any'], 3)} | {_fmt(e['chance'], 3)} "
                             f"| {e['rows']} |")
        lines.append("")
    return lines


def probe_table(block: dict) -> list[str]:
    """Markdown lines of one length's probe accuracies (%) per arm at the equal step (or the
    last evaluation), empty without probes."""
    cmp_ = block.get("comparison", {})
    per_arm = {arm: cmp_.get("arms", {}).get(arm, {}).get("probes_at_equal_step") or r["probes"]
               for arm, r in block["runs"].items()}
    keys = sorted({k for p in per_arm.values() for k in p if "_acc/" in k},
                  key=lambda k: (not k.startswith("probe/passkey"), k.split("/")[1],
                                 _bucket_order(k)))
    if not keys:
        return []
    head = ["arm", *(k.removeprefix("probe/").replace("_acc", "") for k in keys)]
    lines = ["Retrieval probes, accuracy % (teacher-forced argmax), at the equal step:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, p in per_arm.items():
        cells = [arm, *(_fmt(100.0 * p[k], 1) if k in p else "-" for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    gaps = cmp_.get("probe_msa_minus_dense_points")
    if gaps:
        cells = ["MSA - dense (points)", *(f"{gaps[k]:+.1f}" if k in gaps else "-"
                                           for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _bucket_order(key: str) -> int:
    """Sort key of a probe bucket name (``depth_25``, ``dist_50-75``): its first number."""
    digits = key.rsplit("_", 1)[-1].split("-")[0]
    return int(digits) if digits.isdigit() else 0


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


def finished_steps(run_dir: Path) -> int:
    """The iteration of the newest finished checkpoint in ``run_dir`` (0: none)."""
    pointer = run_dir / POINTER
    try:
        return int(pointer.read_text().strip()) if pointer.is_file() else 0
    except ValueError:
        return 0


def main(argv: list[str] | None = None) -> dict:
    """Run (or continue) the arms, write the report, return it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="indexed-dataset prefix (prepare_corpus)")
    parser.add_argument("--recipe", default=None,
                        help="base recipe (default recipes/quality_bench.yaml; msa_tiny --tiny)")
    parser.add_argument("--seq-lengths", default=None,
                        help="comma-separated (default 8192,32768; 256 with --tiny)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--tokens-per-step", type=int, default=None,
                        help=f"default {TOKENS_PER_STEP} (512 with --tiny)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps of every arm (default: the recipe's "
                        "train.train_iters; 4 with --tiny)")
    parser.add_argument("--save-interval", type=int, default=None,
                        help="checkpoint every this many steps (default 200; 2 with --tiny); "
                        "an arm also saves when it stops")
    parser.add_argument("--restart", action="store_true",
                        help="delete the arms' run directories (checkpoints, metrics) first")
    parser.add_argument("--time-budget-s", type=float, default=480.0,
                        help="wall-time guard of the whole call (default 480)")
    parser.add_argument("--copy-marker", type=int, default=None,
                        help="the corpus's copy marker (prepare_corpus --copy-fraction: 0); "
                        "adds the copy column, the loss of second copies")
    parser.add_argument("--probes", default="",
                        help="retrieval probes at every evaluation, e.g. passkey,mqar "
                        "(train.eval_probes)")
    parser.add_argument("--extrapolate-to", type=int, default=None,
                        help="also evaluate every finished arm of a shorter length at this "
                        "length (train.skip_train from its checkpoint)")
    parser.add_argument("--final-probe-rows", type=int, default=None,
                        help="train.eval_probe_rows of the --extrapolate-to evaluations")
    parser.add_argument("--finished", action="store_true",
                        help="run nothing: print the steps each arm has done and exit 0 where "
                        "every arm has its --steps at every length, else 1")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke-test preset")
    parser.add_argument("--out", default="runs/quality")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every arm")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    args.seq_lengths = args.seq_lengths or ("256" if args.tiny else "8192,32768")
    args.tokens_per_step = args.tokens_per_step or (512 if args.tiny else TOKENS_PER_STEP)
    args.save_interval = args.save_interval or (2 if args.tiny else 200)
    lengths = [int(x) for x in args.seq_lengths.split(",") if x]
    arms = [a for a in args.arms.split(",") if a]
    if not arms or not lengths:
        raise SystemExit("error: --arms and --seq-lengths must name at least one each")
    for arm in arms:
        arm_overrides(arm, 1)  # names a bad arm before anything runs
    bad = [s for s in lengths if s <= 0 or args.tokens_per_step % s]
    if args.extrapolate_to is not None:
        bad += [] if args.extrapolate_to > 0 and args.tokens_per_step % args.extrapolate_to == 0 \
            else [args.extrapolate_to]
    if bad:
        raise SystemExit(f"error: --seq-lengths / --extrapolate-to {bad[0]}: expected a positive "
                         f"divisor of --tokens-per-step ({args.tokens_per_step})")
    if args.time_budget_s <= 0:
        raise SystemExit(f"error: --time-budget-s = {args.time_budget_s}: expected > 0")
    if args.save_interval <= 0 or (args.steps is not None and args.steps <= 0):
        raise SystemExit(f"error: --steps = {args.steps}, --save-interval = "
                         f"{args.save_interval}: expected positive step counts")
    recipe = args.recipe or (None if args.tiny else str(REPO / "recipes/quality_bench.yaml"))
    base = (TINY if args.tiny else []) + list(args.overrides)
    if args.copy_marker is not None:
        base.append(f"train.eval_copy_marker={args.copy_marker}")
    if args.probes:
        base.append(f"train.eval_probes=[{args.probes}]")
    if args.steps is not None:
        base.append(f"train.train_iters={args.steps}")
    from nemo_msa.training.recipe import load_recipe

    loaded = load_recipe(recipe, base)  # a bad override or probe key stops here, named
    num_layers = int(loaded.model.get("num_layers", 1))
    steps = loaded.train.train_iters
    out = Path(args.out)
    if args.finished:
        done = [finished_steps(_run_dir(out, s, a, None)) for s in lengths for a in arms]
        print(f"steps done: {done} of {steps}", flush=True)
        raise SystemExit(0 if min(done) >= steps else 1)
    report = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "device": _device_name(),
              "commit": commit_id(), "command": "python scripts/quality_bench.py "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "corpus": args.corpus, "tokens_per_step": args.tokens_per_step,
              "steps_per_arm": steps, "lengths": {},
              # benchmarks/indexer_regime.py's files, written before this call (not during it).
              "regimes": read_regimes(out)}
    todo = [(s, a, None) for s in lengths for a in arms]
    if args.extrapolate_to is not None:
        todo += [(s, a, args.extrapolate_to) for s in lengths if s <= args.extrapolate_to
                 for a in arms]
    if args.restart:
        for seq, arm, at in todo:
            shutil.rmtree(_run_dir(out, seq, arm, at), ignore_errors=True)
    text = ""
    for i, (seq, arm, at) in enumerate(todo):
        run_dir = _run_dir(out, seq, arm, at)
        trained = _run_dir(out, seq, arm, None)
        done = finished_steps(trained)
        if at is None and done >= steps:
            print(f"== {arm} at {seq} tokens: finished ({done} steps), summarized", flush=True)
            error = None
        elif at is not None and (done < steps or (run_dir / "metrics.jsonl").exists()
                                 and _evaluated_at(run_dir) == done):
            why = "already evaluated" if done >= steps else f"trained {done} of {steps} steps"
            print(f"== {arm} trained at {seq}, at {at} tokens: skipped ({why})", flush=True)
            if done < steps:
                continue  # nothing to report until the arm has trained to the end
            error = None
        else:
            left = args.time_budget_s - (time.perf_counter() - t0)
            # Start-up (model build, data indices, kernel compiles) is outside the loop's clock.
            share_min = max(left / (len(todo) - i) - (3.0 if args.tiny else 20.0), 1.0) / 60.0
            length = at or seq
            gbs = args.tokens_per_step // length
            overrides = base + [
                f"dataset.data_path=[{args.corpus}]", f"model.seq_length={length}",
                f"train.global_batch_size={gbs}", f"train.micro_batch_size={min(gbs, 4)}",
            ] + arm_overrides(arm, num_layers)
            if at is None:
                overrides += [f"train.exit_duration_in_mins={share_min}",
                              f"checkpoint.save={run_dir}",
                              f"checkpoint.save_interval={args.save_interval}",
                              "checkpoint.keep_last=2"]
                print(f"== {arm} at {seq} tokens: steps {done} -> {steps} "
                      f"({share_min * 60:.0f} s of training at most)", flush=True)
            else:
                overrides += ["train.skip_train=true", f"checkpoint.load={trained}",
                              "checkpoint.save=null", f"logger.output_dir={run_dir}"]
                if args.final_probe_rows:
                    overrides.append(f"train.eval_probe_rows={args.final_probe_rows}")
                print(f"== {arm} trained at {seq}, evaluated at {at} tokens", flush=True)
            error = None
            try:
                run_arm(recipe, overrides)
            except Exception as err:  # noqa: BLE001 - one failed run must not lose the others
                error = f"{type(err).__name__}: {err}"
                print(f"== {arm} at {seq} tokens failed: {error}", flush=True)
        log = run_dir / "metrics.jsonl"
        key = str(seq) if at is None else f"{seq}_at_{at}"
        block = report["lengths"].setdefault(key, {"runs": {}})
        summary = summarize_run(read_metrics(log) if log.exists() else [])
        if at is None:
            summary["target_steps"] = steps
            summary["stopped_early"] = not error and summary["steps"] < steps
        block["runs"][arm] = summary
        if error:
            block["runs"][arm]["error"] = error
        block["comparison"] = compare(block["runs"])
        report["wall_seconds"] = time.perf_counter() - t0
        # Written after every run: a call killed from outside still leaves what it finished.
        text = write_report(report, out)
    print(text, flush=True)
    return report


def _run_dir(out: Path, seq: int, arm: str, at: int | None) -> Path:
    """An arm's run directory: ``seq<S>/<arm>``, or ``seq<S>_at<L>/<arm>`` evaluated at L."""
    return out / (f"seq{seq}" if at is None else f"seq{seq}_at{at}") / arm


def _evaluated_at(run_dir: Path) -> int | None:
    """The iteration a skip_train evaluation in ``run_dir`` evaluated (None: none)."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    return next((r["iteration"] for r in reversed(rows) if "val_loss" in r), None)


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
