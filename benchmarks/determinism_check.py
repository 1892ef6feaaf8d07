#!/usr/bin/env python
"""Checks that ``model.deterministic_mode`` makes pretraining bitwise repeatable, and times it.

Three runs of ``scripts/pretrain.py`` with one seed, each in a process of its own, on one GPU by
default with the mode, the Triton backend and bf16 (``model.deterministic_mode=true
model.msa_backend=triton model.bf16=true optimizer.clip_grad=1.0``; ``--cpu`` runs the
reference backend in fp32 on gloo instead), checkpoints every ``--interrupt-at`` steps:

- ``a`` and ``b``: the whole schedule of ``--steps`` steps, each into its own directory;
- ``c``: the same command stopped after ``--interrupt-at`` steps (``train.exit_interval``), then
  the same command again, which resumes from its checkpoint.

It compares the runs' ``metrics.jsonl`` step by step (the LM loss, the indexer loss and the
gradient norm, to the bit) and the content digests of their checkpoints at the interruption and
at the end (:mod:`nemo_msa.training.checkpoint_digests`: every tensor, RNG state and the
training state; the paths differ, so the files do), and prints one line per check, ``PASS`` or
``FAIL`` with the first step or item that differs. Exit code 0 when every check passes.

With ``--cost-tokens`` it then times the one-layer rows of ``benchmarks/bench_layer.py``
(``--cost-cases``) with and without ``--deterministic``, each in a process of its own (the mode
is a process setting), and prints the cost per row: the mode's step time over the default's.

The runs' directories go to ``--work`` (a new temporary directory by default, removed at the
end unless ``--keep-work``); ``--out`` gets four files: ``determinism.json`` (the checks, each
run's per-step metrics, the content digests of run a's checkpoints, the cost rows, the GPU,
torch and the commit), ``determinism.log`` (every run's output under a header), and
``layer_default.json`` / ``layer_deterministic.json`` with ``--cost-tokens``. Usage on one
GPU (the checks and the cost fit one 10-minute call each on an H100)::

    python benchmarks/determinism_check.py --out OUT/checks
    python benchmarks/determinism_check.py --out OUT/cost --skip-checks --cost-tokens 8192,32768
    python benchmarks/determinism_check.py --out /tmp/det --cpu --steps 4 --interrupt-at 2 \\
        -- model.num_layers=2 model.hidden_size=64 ...   # CPU smoke run (tests)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nemo_msa.training.checkpoint_digests import (  # noqa: E402
    content_digests,
    differing_items,
)
from nemo_msa.training.provenance import commit_id  # noqa: E402

#: The recipe overrides of the GPU runs: the mode, the Triton kernels, bf16.
GPU_OVERRIDES = ["model.deterministic_mode=true", "model.msa_backend=triton", "model.bf16=true",
                 "optimizer.clip_grad=1.0"]
#: The CPU runs' (tests): the mode on the reference backend, fp32, gloo.
CPU_OVERRIDES = ["model.deterministic_mode=true", "model.msa_backend=reference",
                 "dist.force_cpu=true"]
#: Per-step metrics compared to the bit (where a run logs them).
COMPARED = ("loss", "indexer_loss", "grad_norm")


def read_metrics(path: Path) -> dict[int, dict]:
    """``{iteration: row}`` of a ``metrics.jsonl`` (the last row of an iteration wins)."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["iteration"])] = row
    return rows


def first_difference(a: dict[int, dict], b: dict[int, dict],
                     keys: tuple[str, ...] = COMPARED) -> str | None:
    """The first step (and metric) where two runs' metrics differ, as a sentence; None if they
    agree bit for bit at every step of both (a step only one of them has is a difference)."""
    for it in sorted(set(a) | set(b)):
        if it not in a or it not in b:
            return f"step {it} is in only one run ({'a' if it in a else 'b'})"
        for key in keys:
            x, y = a[it].get(key), b[it].get(key)
            same = x == y or (isinstance(x, float) and isinstance(y, float)
                              and math.isnan(x) and math.isnan(y))
            if not same:
                return f"{key} differs first at step {it} ({x!r} against {y!r})"
    return None


def compare_checkpoints(a: Path, b: Path) -> str | None:
    """Where two checkpoints' contents differ (the first items), as a sentence; None if every
    item is equal."""
    differ = differing_items(content_digests(a), content_digests(b))
    if not differ:
        return None
    shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    return f"{a.name} differs in {shown}"


def check(name: str, problems: list[str | None]) -> dict:
    """One check's verdict and its line (printed)."""
    found = [p for p in problems if p]
    line = f"{name}: {'PASS' if not found else 'FAIL: ' + '; '.join(found)}"
    print(line, flush=True)
    return {"check": name, "passed": not found, "problems": found, "line": line}


def run(log: Path, name: str, cmd: list[str]) -> None:
    """One process (``scripts/pretrain.py`` or ``bench_layer.py``), its output appended to
    ``log`` under a header; a failure stops the check, quoting the output's end."""
    header = f"== {name}: {' '.join(cmd[1:])}"
    print(header, flush=True)
    with open(log, "a") as fh:
        fh.write(header + "\n")
        fh.flush()
        start = fh.tell()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode:
        with open(log) as fh:
            fh.seek(start)
            tail = fh.read()[-3000:]
        raise SystemExit(f"error: {name} exited with {proc.returncode}:\n{tail}")


def pretrain(args: argparse.Namespace, name: str, overrides: list[str]) -> None:
    """One ``scripts/pretrain.py`` run in its own process."""
    run(args.out / "determinism.log", name,
        [sys.executable, str(ROOT / "scripts" / "pretrain.py"), *overrides])


def run_checks(args: argparse.Namespace, work: Path, report: dict) -> list[dict]:
    """The three runs and their comparisons (see the module docstring); each run's per-step
    metrics and run a's checkpoint digests go into ``report``."""
    base = [*(CPU_OVERRIDES if args.cpu else GPU_OVERRIDES),
            f"train.train_iters={args.steps}", f"checkpoint.save_interval={args.interrupt_at}",
            "logger.plot=false", "logger.progress_bar=false", *args.overrides]
    for name in ("a", "b"):
        pretrain(args, name, [*base, f"checkpoint.save={work / name}"])
    pretrain(args, "c_interrupted", [*base, f"checkpoint.save={work / 'c'}",
                                     f"train.exit_interval={args.interrupt_at}"])
    pretrain(args, "c_resumed", [*base, f"checkpoint.save={work / 'c'}"])
    metrics = {n: read_metrics(work / n / "metrics.jsonl") for n in ("a", "b", "c")}
    report["runs"] = {n: {it: {k: row.get(k) for k in COMPARED} for it, row in rows.items()}
                      for n, rows in metrics.items()}
    last, cut = f"iter_{args.steps:07d}", f"iter_{args.interrupt_at:07d}"
    report["digests_a"] = {it: content_digests(work / "a" / it) for it in (cut, last)}
    return [
        check(f"two runs, {args.steps} steps: per-step metrics",
              [first_difference(metrics["a"], metrics["b"])]),
        check("two runs: checkpoints",
              [compare_checkpoints(work / "a" / cut, work / "b" / cut),
               compare_checkpoints(work / "a" / last, work / "b" / last)]),
        check(f"interrupted at {args.interrupt_at} and resumed: per-step metrics",
              [first_difference(metrics["a"], metrics["c"])]),
        check("interrupted and resumed: checkpoints",
              [compare_checkpoints(work / "a" / cut, work / "c" / cut),
               compare_checkpoints(work / "a" / last, work / "c" / last)]),
    ]


def run_cost(args: argparse.Namespace) -> list[dict]:
    """bench_layer.py's rows with and without ``--deterministic``; the cost per row."""
    results = {}
    for mode in ("default", "deterministic"):
        path = args.out / f"layer_{mode}.json"
        run(args.out / "determinism.log", f"cost, {mode}",
            [sys.executable, str(ROOT / "benchmarks" / "bench_layer.py"), "--tokens",
             args.cost_tokens, "--cases", args.cost_cases, "--no-attention-rows",
             "--no-pair-rate", "--json", str(path), *(["--deterministic"] * (mode != "default")),
             *(["--tiny", "--cpu", "--steps", "1", "--warmup", "1"] if args.cpu else [])])
        results[mode] = {(r["tokens"], r["case"]): r for r in json.loads(path.read_text())["rows"]}
    rows = []
    print(f"{'tokens':>8} {'case':<18} {'default ms':>11} {'determ. ms':>11} {'cost':>7}")
    for key, plain in results["default"].items():
        det = results["deterministic"].get(key, {})
        row = {"tokens": key[0], "case": key[1], "default_step_ms": plain.get("step_ms"),
               "deterministic_step_ms": det.get("step_ms"), "status": det.get("status")}
        if row["default_step_ms"] and row["deterministic_step_ms"]:
            row["cost"] = row["deterministic_step_ms"] / row["default_step_ms"]
            print(f"{key[0]:>8} {key[1]:<18} {row['default_step_ms']:>11.2f} "
                  f"{row['deterministic_step_ms']:>11.2f} {row['cost']:>6.3f}x")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Runs the checks (and the cost rows); returns 0 when every check passes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True,
                    help="a new directory for the results (four files at most)")
    ap.add_argument("--work", type=Path, default=None,
                    help="where the runs write their checkpoints (default: a new temporary "
                    "directory)")
    ap.add_argument("--keep-work", action="store_true", help="keep --work's runs at the end")
    ap.add_argument("--steps", type=int, default=40, help="steps of every run")
    ap.add_argument("--interrupt-at", type=int, default=20, help="where run c is interrupted")
    ap.add_argument("--cpu", action="store_true",
                    help="reference backend, fp32, gloo (the CI form; pass a small model)")
    ap.add_argument("--cost-tokens", default=None, metavar="N,N",
                    help="also time bench_layer.py's rows of these sizes with and without the "
                    "mode")
    ap.add_argument("--cost-cases", default="dense,msa_sparse_loss",
                    help="bench_layer.py's cases for the cost")
    ap.add_argument("--skip-checks", action="store_true", help="only the cost rows")
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every run (after --)")
    args = ap.parse_args(argv)
    if not 0 < args.interrupt_at < args.steps:
        raise SystemExit(f"error: --interrupt-at={args.interrupt_at} --steps={args.steps}: "
                         "expected 0 < interrupt-at < steps")
    for name, path in (("--out", args.out), ("--work", args.work)):
        if path is not None and path.exists() and any(path.iterdir()):
            raise SystemExit(f"error: {name} {path} is not empty; expected a new directory")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch  # after the argument checks: a bad command line fails fast

    started = time.time()
    report = {
        "commit": commit_id(), "torch": torch.__version__,
        "gpu": "cpu" if args.cpu or not torch.cuda.is_available()
        else torch.cuda.get_device_name(0),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None
                                                       else sys.argv[1:])]),
        "steps": args.steps, "interrupt_at": args.interrupt_at,
        "overrides": [*(CPU_OVERRIDES if args.cpu else GPU_OVERRIDES), *args.overrides],
    }
    work = args.work or Path(tempfile.mkdtemp(prefix="determinism_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        checks = [] if args.skip_checks else run_checks(args, work, report)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    cost = run_cost(args) if args.cost_tokens else []
    report.update(checks=checks, cost=cost, seconds=time.time() - started)
    (args.out / "determinism.json").write_text(json.dumps(report, indent=1))
    passed = all(c["passed"] for c in checks)
    print(f"determinism check: {'PASS' if passed else 'FAIL'} ({len(checks)} checks)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
