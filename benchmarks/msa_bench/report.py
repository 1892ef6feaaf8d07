"""The benchmark's printed table: one row per case, then the notes."""

from __future__ import annotations

HEAD = ("| case | tokens | sel ms | scores ms | fwd ms | fwd+mass ms | bwd ms | bwd det ms "
        "| MSA fwd ms | MSA f+b ms "
        "| dense fwd ms "
        "| dense f+b ms | speedup fwd | speedup f+b | fwd TF/s | bwd TF/s | sel TF/s "
        "| sel extra MiB | fwd extra MiB | bwd extra MiB | sel match | out err | dq err "
        "| dk err | dv err |")


def fmt_row(r: dict) -> str:
    """One case's row; ``s`` marks errors on the query subset, ``f`` on all rows."""
    match = f"{r['sel_match_subset']:.4f}s"
    if "sel_match_full" in r:
        match += f" / {r['sel_match_full']:.4f}f"
    out_err = f"{r['out_err_subset']:.1e}s"
    dq_err = f"{r['dq_err_subset']:.1e}s"
    dk_err = dv_err = "n/a"
    if "out_err_full" in r:
        out_err += f" {r['out_err_full']:.1e}f"
        dq_err += f" {r['dq_err_full']:.1e}f"
        dk_err = f"{r['dk_err_full']:.1e}f"
        dv_err = f"{r['dv_err_full']:.1e}f"
    return (f"| {r['case']} | {r['tokens']} | {r['sel_ms']:.2f} "
            f"| {r['scores_ms']:.2f} | {r['fwd_ms']:.2f} "
            f"| {r['fwd_mass_ms']:.2f} | {r['bwd_ms']:.2f} | {r['bwd_det_ms']:.2f} "
            f"| {r['msa_fwd_ms']:.2f} "
            f"| {r['msa_fwdbwd_ms']:.2f} "
            f"| {r['dense_fwd_ms']:.2f} | {r['dense_fwdbwd_ms']:.2f} | {r['speedup_fwd']:.2f}x "
            f"| {r['speedup_fwdbwd']:.2f}x | {r['fwd_tflops']:.0f} | {r['bwd_tflops']:.0f} "
            f"| {r['sel_tflops']:.0f} | {r['sel_extra_mib']:.1f} | {r['fwd_extra_mib']:.1f} "
            f"| {r['bwd_extra_mib']:.1f} | {match} | {out_err} | {dq_err} | {dk_err} "
            f"| {dv_err} |")


def fmt_table(results: list[dict], notes: list[str]) -> str:
    """The markdown table of ``results`` followed by ``notes``."""
    lines = [HEAD, "|" + "---|" * (HEAD.count("|") - 1)]
    lines += [fmt_row(r) for r in results]
    return "\n".join(lines + [""] + notes)


def fmt_notes(coherent: bool, launches: dict, settings: list[str]) -> list[str]:
    """The notes under the table: inputs, the hybrid's parameters, what the columns mean."""
    fwd, bwd = launches["fwd"], launches["bwd"]
    return [
        "index inputs: "
        + ("coherent (shared per 128-token block + 5% noise)" if coherent else "random")
        + f"; forward union_qt={fwd.union_qt}, union_max={fwd.union_max}"
        + f"; dq union_qt={bwd.dq_union_qt}, union_max={bwd.dq_union_max}"
        + " (the backward takes the forward's union lists, as through autograd)"
        + (f"; overrides {settings}" if settings else "") + ".",
        "s = checked on a random subset of query rows (incl. the last) against float64; "
        "f = all rows against the package reference (selection in fp32, attention in float64).",
        "TF/s: fwd on selected, causally visible block FLOPs (4 d G per key); bwd counts 2.5x "
        "fwd; sel counts 2 H d per causal (q, k) pair. Dense runs causal over each padded row.",
        "extra MiB: peak allocation during the call beyond inputs and outputs.",
        "scores: the sparse indexer loss's pass over the selected blocks (each slot's block "
        "score and argmax key, ADR 0033); fwd+mass: the forward that also returns the "
        "attention mass per selected block (the loss's target), as the layer runs them.",
    ]


def fmt_sweep_line(trial: dict) -> str:
    """One sweep trial: kind, settings, then its time and rate or its failure."""
    import json

    head = f"{trial['kind']:5s} {json.dumps(trial['settings']):70s}"
    if trial.get("error"):
        return f"{head} FAILED {trial['error']}"
    return f"{head} {trial['ms']:9.3f} ms {trial['tflops']:7.1f} TF/s"
