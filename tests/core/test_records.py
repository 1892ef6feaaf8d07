"""The record a reader follows: results named by date, GPU, what and commit; no numbered run
labels in any tracked file; no tooling copies in the results; every ADR indexed with a status.

Results are named `benchmarks/results/YYYY-MM-DD-<gpu>-<what>[-<commit>]/`, each a flat folder
with a README.md that gives the exact command, the commit, the card and the date, or one such
.md file where the outputs are quoted in it (issue #61). Every `benchmarks/results/...` path a
tracked file names exists. The folder stays under 3 MB as `du` counts it (allocated blocks, so
many small files cost more than their bytes). Numbered labels of working runs (the words
session or call followed by a number) mean nothing to a reader; git history keeps when each
measurement ran. The samples below are built from pieces so that this file passes its own scan.
"""

from __future__ import annotations

import glob
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ADR_DIR = ROOT / "docs" / "adr"

LABEL = r"\bsessions?[ _-]?\d+|\bcalls?[ _-]?\d+|\bs\d+call"
RUN_LABEL = re.compile(LABEL, re.IGNORECASE)
RUN_LABEL_BYTES = re.compile(LABEL.encode(), re.IGNORECASE)
GPUS = "h100|h200|b200|gb200|a100|cpu"
RESULT_NAME = re.compile(rf"^\d{{4}}-\d{{2}}-\d{{2}}-(?:{GPUS})-[a-z0-9][a-z0-9.-]*$")
RESULTS_LIMIT = 3 * 1024 * 1024  # bytes allocated on disk, what `du -s` reports
RESULTS_PATH = re.compile(r"benchmarks/results/[A-Za-z0-9_.*<>/-]*")
MD_LINK = re.compile(r"\]\(([^)#\s]+)\)")
PLACEHOLDER = re.compile(r"<[^>]*>|YYYY-MM-DD")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
ADR_ROW = re.compile(r"^\| (?:\[(\d{4})\]\(([^)]+)\)|(\d{4})) \| [^|]* \| ([^|]+?) \|", re.M)
STATUS = re.compile(r"^(accepted|experiment-rejected|never used|superseded by (\d{4}))$")


def _tracked_files() -> list[pathlib.Path]:
    """The files git tracks (a clean clone's view); every file but .git/.venv without git."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                             check=True, timeout=30).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        return [p for p in ROOT.rglob("*") if p.is_file()
                and not {".git", ".venv"} & set(p.relative_to(ROOT).parts)]


def _text(path: pathlib.Path) -> bytes | None:
    """A text file's bytes; None for a binary file or one deleted in the working tree."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return None if b"\0" in data else data


def test_the_label_pattern_finds_run_labels_and_nothing_else():
    session, call = "sess" + "ion", "ca" + "ll"
    for label in (f"{session} 22", f"{session.title()}22", f"{call} 3", f"{call}s 2-3",
                  f"{call}4-rows-5c40d00", f"s13{call}2.sh", f"{session}s 8 and 9"):
        assert RUN_LABEL.search(label), label
    for text in ("recall 0.91", "test session starts", "a call beyond inputs", "per call",
                 "start_new_session=True", "2026-12-06-h100-layer-rows-b3b8630"):
        assert not RUN_LABEL.search(text), text


def test_no_tracked_file_or_path_holds_a_numbered_run_label():
    hits = []
    for path in _tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if RUN_LABEL.search(rel):
            hits.append(f"{rel}: in the path")
            continue
        text = _text(path)
        match = RUN_LABEL_BYTES.search(text) if text is not None else None
        if match:
            line = text.count(b"\n", 0, match.start()) + 1
            hits.append(f"{rel}:{line}: {match.group(0).decode(errors='replace')!r}")
    assert not hits, "numbered run labels (name runs by date, GPU and commit):\n" + "\n".join(hits)


def test_results_are_named_by_date_gpu_and_what_and_each_has_a_readme():
    assert RESULTS.is_dir()
    bad = []
    for entry in sorted(RESULTS.iterdir()):
        name = entry.name[:-3] if entry.is_file() and entry.name.endswith(".md") else entry.name
        if not RESULT_NAME.match(name):
            bad.append(f"{entry.name}: not YYYY-MM-DD-<gpu>-<what>")
        elif entry.is_dir() and not (entry / "README.md").is_file():
            bad.append(f"{entry.name}: no README.md (command, commit, card, date)")
        elif entry.is_dir():
            bad += [f"{entry.name}/{sub.name}/: a subfolder (name the file <sub>-<file> instead)"
                    for sub in sorted(entry.iterdir()) if sub.is_dir()]
    assert not bad, "\n".join(bad)


def _allocated_bytes(root: pathlib.Path) -> int:
    """Bytes on disk under root, directories included: what `du -s` counts (st_blocks of 512)."""
    return sum(p.lstat().st_blocks * 512 for p in [root, *root.rglob("*")])


def test_results_hold_no_tooling_copies_and_stay_under_3_mb_on_disk():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    scripts = [p.relative_to(ROOT).as_posix() for p in files if p.suffix in (".sh", ".py")]
    assert not scripts, f"the commit has the tooling; results keep what it produced: {scripts}"
    size = _allocated_bytes(RESULTS)
    assert size >= sum(p.stat().st_size for p in files), "st_blocks undercounts the bytes"
    assert size < RESULTS_LIMIT, (
        f"benchmarks/results takes {size} bytes on disk as du counts it (limit {RESULTS_LIMIT}): "
        f"{len(files)} files; merge small files, quote short outputs in the README")


def _named_paths_exist(text: str) -> list[str]:
    """The benchmarks/results paths a text names that match nothing (<...> is a placeholder)."""
    missing = []
    for match in RESULTS_PATH.finditer(text):
        path = match.group(0).rstrip(".,")
        pattern = PLACEHOLDER.sub("*", path)
        if not glob.glob(str(ROOT / pattern)):
            missing.append(path)
    return missing


def test_the_path_check_finds_a_moved_path_and_takes_placeholders():
    here = "benchmarks/results/" + min(p.name for p in RESULTS.iterdir())
    assert _named_paths_exist(f"see `{here}`.") == []
    assert _named_paths_exist("`benchmarks/results/YYYY-MM-DD-<gpu>-<what>/`") == []
    gone = "benchmarks/" + "results/2026-01-01-h100-nothing-0000000/sub/"
    assert _named_paths_exist(f"in `{gone}`, and") == [gone]


def test_every_results_path_a_tracked_file_names_exists():
    missing = []
    for path in _tracked_files():
        text = _text(path)
        if text is None or b"benchmarks/results/" not in text:
            continue
        rel = path.relative_to(ROOT).as_posix()
        missing += [f"{rel}: {p}" for p in _named_paths_exist(text.decode(errors="replace"))]
    assert not missing, "paths into benchmarks/results that do not exist:\n" + "\n".join(missing)


def test_links_between_results_resolve():
    broken = []
    for path in sorted(RESULTS.rglob("*.md")):
        for link in MD_LINK.findall(CODE.sub("", path.read_text())):
            if "://" not in link and not (path.parent / link).exists():
                broken.append(f"{path.relative_to(ROOT).as_posix()}: ({link})")
    assert not broken, "links in benchmarks/results that resolve to nothing:\n" + "\n".join(broken)


def test_the_adr_index_lists_every_adr_with_a_status():
    files = {p.name[:4]: p.name for p in ADR_DIR.glob("[0-9][0-9][0-9][0-9]-*.md")}
    assert files, "no ADR files found"
    index = (ADR_DIR / "README.md").read_text()
    rows: dict[str, str] = {}
    problems = []
    for match in ADR_ROW.finditer(index):
        number = match.group(1) or match.group(3)
        link, status = match.group(2), match.group(4).strip()
        if number in rows:
            problems.append(f"{number}: listed twice")
        rows[number] = status
        state = STATUS.match(status)
        if state is None:
            problems.append(f"{number}: status {status!r} is not accepted, experiment-rejected, "
                            f"superseded by NNNN or never used")
            continue
        if link is not None and link != files.get(number):
            problems.append(f"{number}: links {link!r}, the file is {files.get(number)!r}")
        if (status == "never used") != (number not in files):
            there = "is there" if number in files else "is missing"
            problems.append(f"{number}: {status!r} but its file {there}")
        if state.group(2) is not None and state.group(2) not in files:
            problems.append(f"{number}: superseded by {state.group(2)}, which has no file")
    missing = sorted(set(files) - set(rows))
    problems += [f"{n}: {files[n]} has no line in docs/adr/README.md" for n in missing]
    assert not problems, "\n".join(problems)
    highest = max(int(n) for n in files)
    gaps = [f"{n:04d}" for n in range(1, highest + 1) if f"{n:04d}" not in rows]
    assert not gaps, f"ADR numbers with no line (write 'never used' for a skipped one): {gaps}"


def test_the_status_pattern_takes_only_the_allowed_statuses():
    for status in ("accepted", "experiment-rejected", "superseded by 0031", "never used"):
        assert STATUS.match(status), status
    for status in ("decided", "superseded", "accepted (amended)", "superseded by 31", "rejected"):
        assert not STATUS.match(status), status
