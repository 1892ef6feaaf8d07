#!/usr/bin/env python
"""Build a real byte-level corpus from this machine's Python sources, with no download.

Every Python installation carries megabytes of real, long text that nobody here wrote: the
``.py`` files of the standard library and of site-packages. This script turns them into one
Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``, written by
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``): one document per file, its
UTF-8 bytes as tokens 0..255 followed by the end-of-document token 256 (vocabulary 257, no
tokenizer needed). The files are ordered by a hash of their path relative to the source
directory, so Megatron's ``dataset.split`` (which cuts the document list into contiguous
train / validation / test ranges) holds out whole files, a deterministic sample of them.

Examples::

    python scripts/prepare_corpus.py --out runs/corpus          # stdlib + site-packages, <= 64 MB
    python scripts/pretrain.py dataset.data_path=[runs/corpus/pycode_text_document] \\
        model.vocab_size=257 dataset.split=98,2,0 train.eval_interval=10

With ``--copy-fraction F`` a deterministic share F of the documents (chosen by the hash of
their name) becomes a long-range copy document: the marker byte 0, the file's first
``--copy-kb`` KB, the marker again and the same bytes again. The second copy is predictable
only by attending to the first, a copy's length back: an attention that cannot reach that far (a
local window, or a block selection that misses the right blocks) cannot predict it, which Python
source alone (mostly local structure, learned first) does not expose in a short run. Files that
hold byte 0 are dropped, so the marker marks only copy documents; the evaluation's
``train.eval_copy_marker=0`` reports the loss of the second copies (ADR 0023).

Prints one JSON line: prefix, documents, tokens, bytes on disk, the sources read, and with
copy documents their number and the share of tokens that are second copies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

#: Byte tokens are 0..255; the end-of-document token follows them.
EOD = 256
VOCAB_SIZE = 257
#: Opens each copy of a copy document (the NUL byte: no kept source file holds it).
COPY_MARKER = 0
PREFIX_NAME = "pycode_text_document"


def default_sources() -> list[Path]:
    """The standard library and the site-packages of the running interpreter (existing ones)."""
    paths = sysconfig.get_paths()
    seen: list[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        p = Path(paths[key]).resolve()
        if p.is_dir() and p not in seen:
            seen.append(p)
    return seen


def collect_documents(sources: list[Path], pattern: str, max_bytes: int,
                      max_file_bytes: int) -> list[tuple[str, bytes]]:
    """Read the files, drop duplicates and non-UTF-8 ones, order by path hash, cap the total.

    Returns:
        ``(name, bytes)`` per document in corpus order (name = source index + relative path).
    """
    seen_digests: set[bytes] = set()
    files: list[tuple[bytes, str, Path]] = []
    for i, root in enumerate(sources):
        for path in root.rglob(pattern):
            if not path.is_file() or path.is_symlink():
                continue
            name = f"{i}:{path.relative_to(root).as_posix()}"
            files.append((hashlib.sha256(name.encode()).digest(), name, path))
    files.sort()
    docs: list[tuple[str, bytes]] = []
    total = 0
    for _, name, path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data or len(data) > max_file_bytes:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if bytes([COPY_MARKER]) in data:
            continue
        digest = hashlib.sha256(data).digest()
        if digest in seen_digests:
            continue
        if total + len(data) > max_bytes:
            break
        seen_digests.add(digest)
        docs.append((name, data))
        total += len(data)
    return docs


def is_copy_document(name: str, fraction: float) -> bool:
    """Whether document ``name`` is a copy document: a stable draw from the name's hash."""
    draw = int.from_bytes(hashlib.sha256(b"copy:" + name.encode()).digest()[:8], "big")
    return draw < fraction * 2.0**64


def add_copies(docs: list[tuple[str, bytes]], fraction: float,
               head_bytes: int) -> tuple[list[tuple[str, bytes]], int]:
    """Turn a ``fraction`` of the documents into ``marker head marker head`` (head = the first
    ``head_bytes`` bytes, cut back to a UTF-8 character boundary).

    Returns:
        The documents in the same order, and how many bytes are second copies.
    """
    out, copied = [], 0
    mark = bytes([COPY_MARKER])
    for name, data in docs:
        if fraction > 0 and is_copy_document(name, fraction):
            head = data[:head_bytes].decode("utf-8", errors="ignore").encode("utf-8")
            out.append((name, mark + head + mark + head))
            copied += len(head)
        else:
            out.append((name, data))
    return out, copied


def write_indexed_dataset(prefix: Path, docs: list[tuple[str, bytes]]) -> dict:
    """Write ``prefix.bin`` / ``prefix.idx`` with Megatron's builder (uint16 tokens).

    Returns:
        ``{"prefix", "documents", "tokens", "bytes_on_disk"}``.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    tokens = 0
    for _, data in docs:
        arr = np.empty(len(data) + 1, dtype=np.uint16)
        arr[:-1] = np.frombuffer(data, dtype=np.uint8)
        arr[-1] = EOD
        builder.add_document(arr, [arr.size])
        tokens += arr.size
    builder.finalize(str(prefix) + ".idx")
    size = sum(Path(str(prefix) + ext).stat().st_size for ext in (".bin", ".idx"))
    return {"prefix": str(prefix), "documents": len(docs), "tokens": tokens,
            "bytes_on_disk": size}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, build the corpus, print its description as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/corpus", help="output directory")
    parser.add_argument("--source", action="append", type=Path, default=None,
                        help="directory to read (repeatable; default: stdlib + site-packages)")
    parser.add_argument("--pattern", default="*.py", help="file glob (default *.py)")
    parser.add_argument("--max-mb", type=float, default=64.0,
                        help="stop adding files past this many MB of text (default 64)")
    parser.add_argument("--max-file-kb", type=float, default=512.0,
                        help="skip files larger than this (generated tables; default 512)")
    parser.add_argument("--copy-fraction", type=float, default=0.0,
                        help="share of documents made copy documents (head twice, marked)")
    parser.add_argument("--copy-kb", type=float, default=2.0,
                        help="bytes per copy of a copy document, in KB (default 2)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.copy_fraction <= 1.0:
        print(f"error: --copy-fraction = {args.copy_fraction}: expected 0 <= F <= 1",
              file=sys.stderr)
        return 2
    if args.copy_kb <= 0:
        print(f"error: --copy-kb = {args.copy_kb}: expected > 0", file=sys.stderr)
        return 2
    sources = [p.resolve() for p in args.source] if args.source else default_sources()
    missing = [str(p) for p in sources if not p.is_dir()]
    if missing:
        print(f"error: --source {missing[0]!r} is not a directory", file=sys.stderr)
        return 2
    if args.max_mb <= 0 or args.max_file_kb <= 0:
        print(f"error: --max-mb = {args.max_mb} and --max-file-kb = {args.max_file_kb}: "
              "expected positive sizes", file=sys.stderr)
        return 2
    docs = collect_documents(sources, args.pattern, int(args.max_mb * 1e6),
                             int(args.max_file_kb * 1e3))
    if not docs:
        print(f"error: no UTF-8 {args.pattern} files under {[str(s) for s in sources]}",
              file=sys.stderr)
        return 1
    docs, copied = add_copies(docs, args.copy_fraction, int(args.copy_kb * 1e3))
    info = write_indexed_dataset(Path(args.out) / PREFIX_NAME, docs)
    info.update(vocab_size=VOCAB_SIZE, eod_id=EOD, sources=[str(s) for s in sources])
    if args.copy_fraction > 0:
        info.update(copy_fraction=args.copy_fraction, copy_kb=args.copy_kb,
                    copy_marker=COPY_MARKER,
                    copy_documents=sum(is_copy_document(n, args.copy_fraction) for n, _ in docs),
                    second_copy_token_share=round(copied / info["tokens"], 4))
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
