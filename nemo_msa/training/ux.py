"""User-facing output: progress bar, metrics log, loss-curve PNG, final summary (rank 0 only)."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


class Progress:
    """A tqdm bar with step, loss, MTP loss, indexer loss, tokens/s and ETA; a plain log line
    otherwise.

    Args:
        total: the run's last iteration (train_iters).
        start: the iteration the run starts from (resume).
        enabled: draw the bar; when False (or tqdm is missing) print one line per log interval.
        log_interval: print a plain line every this many steps when the bar is off.
    """

    def __init__(self, total: int, start: int, enabled: bool, log_interval: int,
                 is_rank0: bool = True) -> None:
        self.total = total
        self.is_rank0 = is_rank0
        self.log_interval = log_interval
        self.bar = None
        if enabled and is_rank0:
            # Imported here: without tqdm the run still reports, by plain lines.
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, desc="train", unit="step",
                                dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                logger.warning("tqdm is not installed; printing plain progress lines")

    def update(self, metrics: dict[str, float]) -> None:
        """Advance by one step and show its metrics."""
        shown = {"loss": f"{metrics['loss']:.4f}"}
        if "mtp_loss" in metrics:
            shown["mtp_loss"] = f"{metrics['mtp_loss']:.4f}"
        if "indexer_loss" in metrics:
            shown["idx_loss"] = f"{metrics['indexer_loss']:.4f}"
        if "recall" in metrics:
            shown["recall"] = f"{metrics['recall']:.3f}"
        shown["tok/s"] = f"{metrics['tokens_per_s']:.0f}"
        if "val_loss" in metrics:
            shown["val_loss"] = f"{metrics['val_loss']:.4f}"
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
        elif not self.is_rank0:
            return
        elif metrics["iteration"] % self.log_interval == 0 or metrics["iteration"] == self.total:
            text = " ".join(f"{k}={v}" for k, v in shown.items())
            print(f"step {int(metrics['iteration'])}/{self.total} {text}", flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self.bar is not None:
            self.bar.close()


class MetricsLog:
    """Appends one JSON line per step to ``metrics.jsonl`` in the output directory.

    On resume the lines past the checkpoint belong to a run that was lost: they are dropped, so
    the log is the continued curve rather than two overlapping ones. A line that is not a JSON
    record (cut short by a kill while it was written) is dropped too, and said so in one
    ``warning:`` line on stderr.
    """

    def __init__(self, out_dir: Path, start_iteration: int) -> None:
        self.path = out_dir / "metrics.jsonl"
        out_dir.mkdir(parents=True, exist_ok=True)
        kept, cut = [], []
        if self.path.exists():
            for number, line in enumerate(self.path.read_text().splitlines(), start=1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    cut.append((number, len(line)))
                    continue
                if isinstance(record, dict) and record.get("iteration", 0) <= start_iteration:
                    kept.append(line)
        if cut and start_iteration > 0:
            where = ", ".join(f"line {n} ({size} bytes)" for n, size in cut)
            print(f"warning: {self.path}: {where} cut short, not a whole record (the run that "
                  f"wrote it was killed while writing): dropped; the log continues after "
                  f"iteration {start_iteration}", file=sys.stderr, flush=True)
        self.path.write_text("".join(k + "\n" for k in kept))

    def write(self, metrics: dict[str, Any]) -> None:
        """Append one step."""
        with open(self.path, "a") as fh:
            fh.write(json.dumps(metrics) + "\n")


def plot_loss_curve(history: list[dict[str, float]], path: Path, title: str,
                    warmup_steps: int = 0) -> Path | None:
    """Write the loss (and MTP loss, indexer loss / recall when present) against the step as a
    PNG.

    The MSA dense warm-up (the first ``warmup_steps`` iterations) is shaded.

    Returns:
        The PNG path, or None when matplotlib is not installed (a message says how to get it).
    """
    # Imported here: matplotlib is optional (the [plot] extra) and slow to import.
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed, so no loss curve was written; "
                       "install it with `pip install nemo-msa[plot]` (or `pip install matplotlib`)")
        return None
    steps = [h["iteration"] for h in history]
    has_idx = any("indexer_loss" in h for h in history)
    fig, axes = plt.subplots(1, 2 if has_idx else 1, figsize=(11 if has_idx else 6, 4),
                             squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, [h["loss"] for h in history], label="LM loss")
    mtp = [(h["iteration"], h["mtp_loss"]) for h in history if "mtp_loss" in h]
    if mtp:
        ax.plot(*zip(*mtp, strict=True), color="tab:purple", label="MTP loss")
    val = [(h["iteration"], h["val_loss"]) for h in history if "val_loss" in h]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", color="tab:red", label="validation loss")
    if mtp or val:
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if warmup_steps:
        for row in axes:
            for a in row:
                a.axvspan(0.5, warmup_steps + 0.5, color="0.9", zorder=0)
        ax.text(0.5, 0.02, " dense warm-up", transform=ax.get_xaxis_transform(), fontsize=8,
                color="0.4")
    if has_idx:
        ax2 = axes[0][1]
        pts = [(h["iteration"], h["indexer_loss"]) for h in history if "indexer_loss" in h]
        ax2.plot(*zip(*pts, strict=True), color="tab:orange", label="indexer KL")
        ax2.set_xlabel("step")
        ax2.set_ylabel("indexer loss")
        rec = [(h["iteration"], h["recall"]) for h in history if "recall" in h]
        if rec:
            ax3 = ax2.twinx()
            ax3.plot(*zip(*rec, strict=True), color="tab:green", label="selection recall")
            ax3.set_ylabel("recall")
            ax3.set_ylim(0, 1.05)
            ax3.legend(loc="center right")
        ax2.legend(loc="upper right")
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_summary(summary: dict[str, Any]) -> str:
    """Render the end-of-run summary for the console."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}" if math.isfinite(v) else str(v)
        return str(v)

    width = max(len(k) for k in summary)
    lines = ["", "=== training summary ==="]
    lines += [f"  {k.ljust(width)} : {fmt(v)}" for k, v in summary.items()]
    return "\n".join(lines)


class StepTimer:
    """Wall time per step for tokens/s (synchronizes CUDA so the time is the step's)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self.t0 = now - self.t0, now
        return dt
