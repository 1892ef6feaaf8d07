"""The benchmark's output: the log lines, the printed table, the commit, the JSON file and the
per-kernel lists of the profiled rows."""

from __future__ import annotations

import json
from pathlib import Path

from nemo_msa.training.provenance import commit_id

__all__ = ["commit_id", "fmt_table", "log", "log_kernels", "write_json"]


def log(*parts) -> None:
    """Prints at once (flushed), so a run stopped by a time limit shows what it did."""
    print(*parts, flush=True)


def fmt_table(rows: list[dict]) -> str:
    """The printed table: one line per row, with its speed-up over dense and over cuDNN, and an
    MSA row's pair rate (its sparse attention's pairs per ms over cuDNN's,
    ``pair_rate_vs_cudnn``) and the share of its bound it reaches (``fraction_of_bound``,
    :mod:`layer_bench.bound`).

    Args:
        rows: the rows as reported (``tokens``, ``case``, ``status`` and the timings).

    Returns:
        The table, in Markdown.
    """
    def key(r: dict) -> tuple:
        # A model row is compared with the dense row of its tokens, documents and layers.
        return r["tokens"], r.get("doc_mean", 0), r.get("layers", 1)

    dense_ms = {key(r): r["step_ms"] for r in rows
                if r["case"] == "dense" and r.get("status") == "ok"}
    # Each attention row against cuDNN on the same tokens: single documents against
    # cudnn_attention, packed rows against cudnn_attention_packed.
    cudnn_ms = {(r["tokens"], "_packed" in r["case"]): r["fwdbwd_ms"] for r in rows
                if r["case"].startswith("cudnn_attention") and r.get("status") == "ok"}
    head = (f"| {'tokens':>7} | {'docs':>6} | {'case':<28} | {'status':<8} | {'step_ms':>9} "
            f"| {'tok/s':>10} | {'x dense':>7} | {'pair rate':>9} | {'fwdbwd_ms':>9} "
            f"| {'x cudnn':>7} | {'peak_gib':>8} | {'of bound':>8} |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]

    def num(value, width, digits=1):
        return f"{value:>{width}.{digits}f}" if isinstance(value, (int, float)) else " " * width

    for r in rows:
        step, fb = r.get("step_ms"), r.get("fwdbwd_ms")
        x_dense = dense_ms[key(r)] / step if step and key(r) in dense_ms else None
        base = cudnn_ms.get((r["tokens"], "_packed" in r["case"]))
        x_cudnn = fb / base if fb and base else None
        docs = r.get("docs") or r.get("documents_mean")
        case = r["case"] + (f" x{r['layers']}" if r.get("layers", 1) > 1 else "")
        lines.append(
            f"| {r['tokens']:>7} | {num(docs, 6)} | {case:<28} | {r['status']:<8} "
            f"| {num(step, 9)} | {num(r.get('tokens_per_s'), 10, 0)} | {num(x_dense, 7, 2)} "
            f"| {num(r.get('pair_rate_vs_cudnn'), 9, 2)} | {num(fb, 9)} | {num(x_cudnn, 7, 2)} "
            f"| {num(r.get('peak_gib'), 8, 2)} | {num(r.get('fraction_of_bound'), 8, 2)} |"
        )
    return "\n".join(lines)


def write_json(path: str, result: dict) -> None:
    """Writes ``result`` to ``path`` (its folder made where missing).

    Called after every row, so a run stopped by a time limit keeps what it measured.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))


def log_kernels(rows: list[dict]) -> None:
    """Prints the top kernels of each profiled row (``--profile``) and its host functions
    (``--host-profile``)."""
    for row in rows:
        if row.get("kernels"):
            log(f"\ntop kernels, {row['case']} at {row['tokens']} tokens (ms in one step):")
            for kernel in row["kernels"]:
                log(f"  {kernel['ms']:10.3f}  {kernel['calls']:6d}  {kernel['name']}")
        if row.get("host_functions"):
            log(f"\nhost, {row['case']} at {row['tokens']} tokens: issuing the step took "
                f"{row['host_issue_ms']:.1f} ms (step {row['step_ms']:.1f} ms); functions by "
                "self time under cProfile (self ms, total ms, calls):")
            for fn in row["host_functions"]:
                log(f"  {fn['self_ms']:9.2f} {fn['total_ms']:9.2f} {fn['calls']:6d}  "
                    f"{fn['function']}")
