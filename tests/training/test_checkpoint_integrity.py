"""Checkpoint integrity: manifests at save, verification at resume, fallback, no silent restart.

The damage cases are the issue's: 64 random bytes into the newest ``__0_0.distcp`` (same size),
4 KiB of zeros, truncation, a deleted file, a lost pointer file. Each is detected by
:func:`find_resume_iteration` with a message naming the file and the newest intact checkpoint;
end to end, ``checkpoint.fallback=true`` resumes from that one bit-exactly, and a lost pointer
stops the CLI before anything is overwritten.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from _runs import REFERENCE, SMALL, cli, copy_checkpoint, losses, train

from nemo_msa.training.checkpoint_integrity import (
    MANIFEST,
    POINTER,
    CheckpointError,
    file_digest,
    find_resume_iteration,
    latest_iteration,
    verify_checkpoint,
)

SHARD = "__0_0.distcp"


def _both(reference, root: Path) -> Path:
    """iter_3 and iter_6 of the reference run under ``root``, the pointer naming 6."""
    ref_root, _ = reference
    copy_checkpoint(ref_root, 3, root)
    copy_checkpoint(ref_root, 6, root)
    return root


def _write_at_middle(path: Path, data: bytes) -> None:
    """Overwrite ``len(data)`` bytes in the middle of ``path``; the size stays the same."""
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(size // 2)
        before = fh.read(len(data))
        assert before != data  # the damage really changes the file
        fh.seek(size // 2)
        fh.write(data)
    assert path.stat().st_size == size


def _random_bytes(path: Path) -> None:
    _write_at_middle(path, np.random.default_rng(0).bytes(64))


def _zeros(path: Path) -> None:
    _write_at_middle(path, bytes(4096))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1000)


def _delete(path: Path) -> None:
    path.unlink()


DAMAGE = {
    "64 random bytes": (_random_bytes, r"contents changed after the save \(SHA-256 differs from "
                                       r"the manifest; same size\)"),
    "4 KiB of zeros": (_zeros, r"contents changed after the save"),
    "truncation": (_truncate, r"\d+ bytes, the manifest says \d+ \(truncated after the save\)"),
    "deleted file": (_delete, r"missing \(the manifest lists it with \d+ bytes\)"),
}


def test_save_writes_a_manifest_of_every_file(reference):
    ref_root, _ = reference
    for name in ("iter_0000003", "iter_0000006"):
        ckpt = ref_root / name
        body = json.loads((ckpt / MANIFEST).read_text())
        assert body["iteration"] == int(name[5:]) and body["algorithm"] == "sha256"
        on_disk = sorted(p.name for p in ckpt.iterdir() if p.name != MANIFEST)
        assert sorted(body["files"]) == on_disk and SHARD in on_disk
        for fname, entry in body["files"].items():
            assert file_digest(ckpt / fname) == (entry["size"], entry["sha256"])
        assert verify_checkpoint(ckpt) == []
    assert not list(ref_root.glob("*.partial"))


@pytest.mark.parametrize("kind, name", [*((kind, SHARD) for kind in DAMAGE),
                                        ("deleted file", ".metadata"),
                                        ("deleted file", "metadata.json")])
def test_damaged_newest_checkpoint_is_named_with_the_intact_one(reference, tmp_path, kind, name,
                                                                capsys):
    damage, what = DAMAGE[kind]
    root = _both(reference, tmp_path)
    damage(root / "iter_0000006" / name)
    with pytest.raises(CheckpointError) as err:
        find_resume_iteration(root)
    msg = str(err.value)
    assert re.search(r"the newest checkpoint \(iteration 6, named by .*latest_checkpointed_"
                     r"iteration.txt\) is damaged or incomplete: .*iter_0000006/"
                     + re.escape(name) + ": " + what, msg), msg
    assert re.search(r"The newest intact checkpoint is .*iter_0000003: pass "
                     r"checkpoint.fallback=true to resume from it", msg), msg
    # Opt-in: resume from the intact one, saying so.
    assert find_resume_iteration(root, fallback=True) == 3
    assert re.search(r"warning: .*iter_0000006/" + re.escape(name) + r".* "
                     r"checkpoint.fallback=true: resuming from .*iter_0000003",
                     capsys.readouterr().err)


def test_damaged_metadata_and_nothing_intact(reference, tmp_path):
    root = _both(reference, tmp_path)
    _random_bytes(root / "iter_0000006" / ".metadata")
    _truncate(root / "iter_0000003" / SHARD)
    with pytest.raises(CheckpointError, match=r"iter_0000006/.metadata: contents changed.*"
                       r"No other intact checkpoint is in .*move the damaged directories away"):
        find_resume_iteration(root, fallback=True)


def test_missing_or_unreadable_manifest(reference, tmp_path):
    root = _both(reference, tmp_path)
    (root / "iter_0000006" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"iter_0000006/manifest.json is missing .*"
                       r"checkpoint.verify=false.*newest intact checkpoint is .*iter_0000003"):
        find_resume_iteration(root)
    # An unverified load accepts it (a checkpoint saved before manifests existed).
    assert find_resume_iteration(root, verify=False) == 6
    (root / "iter_0000006" / MANIFEST).write_text('{"format": 1, "files": {"x": {}}')
    with pytest.raises(CheckpointError, match=r"manifest.json is unreadable \(JSONDecodeError"):
        find_resume_iteration(root)


def test_lost_pointer_names_the_finished_checkpoints(reference, tmp_path):
    root = _both(reference, tmp_path)
    (root / POINTER).unlink()
    with pytest.raises(CheckpointError) as err:
        find_resume_iteration(root)
    msg = str(err.value)
    assert re.search(r"latest_checkpointed_iteration.txt is missing but .* holds finished "
                     r"checkpoints \(iter_0000003, iter_0000006\); starting from iteration 0 "
                     r"would overwrite them", msg), msg
    assert re.search(r"newest intact checkpoint is .*iter_0000006: pass checkpoint.fallback=true"
                     r" to resume from it, or move the iter_\* directories away \(or set another "
                     r"checkpoint.save\) to start from scratch, or restore "
                     r".*latest_checkpointed_iteration.txt",
                     msg), msg
    assert find_resume_iteration(root, fallback=True) == 6
    # A directory with no checkpoint at all is a fresh start, as before.
    assert find_resume_iteration(tmp_path / "empty") is None


def test_unreadable_or_dangling_pointer(reference, tmp_path):
    root = _both(reference, tmp_path)
    (root / POINTER).write_text("six\n")
    with pytest.raises(CheckpointError, match=r"holds 'six', not an iteration.*intact checkpoint "
                       r"is .*iter_0000006"):
        find_resume_iteration(root)
    (root / POINTER).write_text("9\n")
    with pytest.raises(CheckpointError, match=r"iteration 9.*damaged or incomplete: .*"
                       r"iter_0000009 is missing.*intact checkpoint is .*iter_0000006"):
        find_resume_iteration(root)
    assert find_resume_iteration(root, fallback=True) == 6


def test_fallback_resumes_bit_exactly_and_replaces_the_damaged_checkpoint(reference, tmp_path):
    _, ref = reference
    root = _both(reference, tmp_path)
    _random_bytes(root / "iter_0000006" / SHARD)
    # Without the flag the run stops before training (the issue: it resumed at 6 and diverged).
    with pytest.raises(CheckpointError, match=r"iter_0000006/__0_0.distcp: contents changed"):
        train([*REFERENCE, f"checkpoint.save={root}", "checkpoint.save_interval=3"])
    resumed = train([*REFERENCE, f"checkpoint.save={root}", "checkpoint.save_interval=3",
                     "checkpoint.fallback=true"])
    assert "(resumed at 3)" in resumed["steps"]
    want, got = losses(ref["history"]), losses(resumed["history"])
    for it in (4, 5, 6):
        assert got[it] == want[it], (it, got[it], want[it])  # bitwise on the CPU
    assert latest_iteration(root) == 6 and verify_checkpoint(root / "iter_0000006") == []


def test_megatron_load_errors_name_the_path_and_the_cause(reference, tmp_path):
    ref_root, _ = reference
    copy_checkpoint(ref_root, 3, tmp_path / "other")
    # A checkpoint of another model, resumed although the recipe change is refused by default
    # (ADR 0049): Megatron's shape error, with the recipe key that differs.
    with pytest.raises(CheckpointError, match=r"loading checkpoint .*other/iter_0000003 failed "
                       r"inside Megatron dist-checkpointing \(rank 0: CheckpointingException: "
                       r"Global shape mismatch.*\)\. It was saved with another model "
                       r"\(model.hidden_size differs from this recipe\)"):
        train([*REFERENCE, f"checkpoint.save={tmp_path / 'other'}", "model.hidden_size=32",
               "checkpoint.allow_recipe_change=true"])
    # Damage that verification would have caught, with verification off: a bare EOFError or
    # torch's zip-reader error before, now wrapped with the path and what to do.
    copy_checkpoint(ref_root, 3, tmp_path / "unverified")
    _truncate(tmp_path / "unverified" / "iter_0000003" / SHARD)
    with pytest.raises(CheckpointError, match=r"loading checkpoint .*unverified/iter_0000003 "
                       r"failed inside Megatron dist-checkpointing \(rank 0: \w+Error\b.*\)\. "
                       r"If the model, parallel layout or code changed.*checkpoint.verify=false"):
        train([*REFERENCE, f"checkpoint.save={tmp_path / 'unverified'}",
               "checkpoint.verify=false"])


def test_cli_with_a_lost_pointer_stops_and_overwrites_nothing(reference, tmp_path, capsys):
    """The issue's case 2: the same command used to restart at 0 and rewrite iter_3 and iter_6.
    (The script's main() in this process: test_recipe.py starts the script itself.)"""
    root = _both(reference, tmp_path)
    (root / POINTER).unlink()
    before = {p.relative_to(root): file_digest(p) for p in root.rglob("*") if p.is_file()}
    code = cli(*SMALL, *REFERENCE, f"checkpoint.save={root}", "checkpoint.save_interval=3")
    stderr = capsys.readouterr().err
    assert code == 1, stderr[-3000:]
    assert re.search(r"^error: cannot resume: .*latest_checkpointed_iteration.txt is missing",
                     stderr, re.M), stderr[-3000:]
    after = {p.relative_to(root): file_digest(p) for p in root.rglob("*") if p.is_file()}
    assert after == before


def test_a_run_that_would_overwrite_checkpoints_it_did_not_resume_from_is_refused(
        reference, tmp_path):
    """Issue #29: ``checkpoint.resume=false`` on a directory of finished checkpoints, or a run
    loading elsewhere into it, is refused naming checkpoint.save and the iterations (it started
    at step 1 and overwrote them before); ``checkpoint.overwrite=true`` allows it."""
    from nemo_msa.training.recipe import RecipeError

    root = _both(reference, tmp_path / "run")
    before = {p.name: p.stat().st_mtime_ns for p in root.rglob("*")}
    with pytest.raises(RecipeError, match=r"recipe key 'checkpoint.save' = .*run' holds finished "
                                          r"checkpoints \(iterations 3, 6\) that this run did "
                                          r"not resume from \(checkpoint.resume=false\)"):
        train([*REFERENCE, f"checkpoint.save={root}", "checkpoint.resume=false"])
    start = tmp_path / "start"
    copy_checkpoint(reference[0], 3, start)
    with pytest.raises(RecipeError, match=r"\(the run starts from .*start\) and would "
                                          r"overwrite; .* checkpoint.overwrite=true"):
        train([*REFERENCE, f"checkpoint.save={root}", f"checkpoint.load={start}"])
    assert {p.name: p.stat().st_mtime_ns for p in root.rglob("*")} == before  # untouched
    fresh = train([*REFERENCE, "train.train_iters=2", f"checkpoint.save={root}",
                   "checkpoint.resume=false", "checkpoint.overwrite=true"])
    assert fresh["history"][0]["iteration"] == 1


def _poison_largest_tensors(path: Path, data: bytes = b"\xff" * 4096) -> None:
    """Write ``data`` (by default fp32 NaN bit patterns) over the start of the largest tensor
    records.

    A ``.distcp`` file is one torch.save archive per tensor, laid end to end; tensor bytes
    follow each ``archive/data/0`` local header up to the next ``PK`` signature. Damage there
    loads without complaint (no CRC check) and poisons the weights, as the issue's random bytes
    did; damage elsewhere breaks the archive and fails the load instead.
    """
    blob = bytearray(path.read_bytes())
    records, pos = [], 0
    while (pos := blob.find(b"PK\x03\x04", pos)) >= 0:
        name_len, extra_len = struct.unpack("<HH", blob[pos + 26:pos + 30])
        start = pos + 30 + name_len + extra_len
        if bytes(blob[pos + 30:pos + 30 + name_len]).endswith(b"/data/0"):
            records.append((blob.find(b"PK", start) - start, start))
        pos += 4
    largest = max(size for size, _ in records)
    assert largest >= 4096, records
    for size, start in records:
        if size == largest:
            blob[start:start + len(data)] = data
    path.write_bytes(bytes(blob))


def _parameter_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and "loaded unverified" in r.getMessage()]


def test_unverified_damaged_checkpoint_is_not_called_intact_when_the_loss_turns_nan(
        reference, tmp_path, caplog):
    """Issue #29 case 6: with checkpoint.verify=false a damaged newest checkpoint loads, the
    loss turns NaN, and the error called that very checkpoint intact. It is checked against its
    manifest at that moment now and named as damaged. Issue #48: the NaN weights are named in
    one warning when they load, before any step."""
    root = _both(reference, tmp_path)
    _poison_largest_tensors(root / "iter_0000006" / SHARD)
    with pytest.raises(FloatingPointError) as err:
        train([*REFERENCE, "train.train_iters=8", f"checkpoint.save={root}",
               "checkpoint.save_interval=3", "checkpoint.verify=false",
               "scheduler.override_opt_param_scheduler=true"])
    warned = _parameter_warnings(caplog)
    assert len(warned) == 1, warned
    assert re.fullmatch(r"checkpoint .*iter_0000006, loaded unverified \(checkpoint.verify=false"
                        r"\): parameter [\w.]+ holds a non-finite value( \(and \d+ more "
                        r"parameters like it\))?; no training produces that, so its file may be "
                        r"damaged \(verify it, or resume from another checkpoint\); the run goes "
                        r"on", warned[0]), warned[0]
    msg = str(err.value)
    assert re.search(r"loss is nan at iteration [78]; the last finished checkpoint \(.*iter_0000006"
                     r"\) is damaged: .*iter_0000006/__0_0.distcp: contents changed after the "
                     r"save", msg), msg
    assert "intact" not in msg
    # A checkpoint that matches its manifest is called intact, having been checked.
    from nemo_msa.training.loop import _last_checkpoint

    assert re.fullmatch(r"the last finished checkpoint \(.*iter_0000003\) is intact \(verified "
                        r"against its manifest\)", _last_checkpoint(str(root), 3))
    assert _last_checkpoint(None, None) == "no checkpoint was saved or resumed from"


def test_unverified_absurd_weights_are_named_once_and_the_run_goes_on(reference, tmp_path,
                                                                     caplog):
    """Issue #48: a finite but absurd weight (2e4, as damaged bytes can read) loaded with
    checkpoint.verify=false is one warning naming the tensor; training continues."""
    root = _both(reference, tmp_path)
    _poison_largest_tensors(root / "iter_0000006" / SHARD, struct.pack("<f", 2e4))
    summary = train([*REFERENCE, "train.train_iters=7", f"checkpoint.save={root}",
                     "checkpoint.verify=false", "scheduler.override_opt_param_scheduler=true"])
    assert summary["steps"] == "7/7 (resumed at 6)"
    warned = _parameter_warnings(caplog)
    assert len(warned) == 1, warned
    assert re.search(r"iter_0000006, loaded unverified \(checkpoint.verify=false\): parameter "
                     r"[\w.]+weight holds a value of magnitude 2e\+04 \(above 10000\)", warned[0])
