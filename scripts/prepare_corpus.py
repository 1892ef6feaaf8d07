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

With ``--passkey-fraction P`` and ``--mqar-fraction Q`` the documents that are not copy documents
teach retrieval the way the evaluation's probes (``train.eval_probes``, ADR 0040) test it: a
stable draw from the name's hash makes a share P of them passkey documents (the marker byte 1
and a key of ``--passkey-length`` random letters 'A'..'Z' inserted at a random depth of the file,
the same marker and key again at its end) and a share Q MQAR documents (``--mqar-pairs`` pairs
of byte 2, a two-letter key and a two-letter value at random places of the file's first three
quarters, then one query per pair, the same five bytes, in a random order in its last quarter).
Keys, values and places come from a generator seeded by the name's hash, so the corpus is the
same on every machine. Files that hold a marker byte in use are dropped. The markers and the
letters are the defaults of ``train.eval_probe_markers`` / ``train.eval_probe_token_range``.

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
#: Opens the key of a passkey document and its question at the end (``train.eval_probe_markers``).
PASSKEY_MARKER = 1
#: Opens every pair and query of an MQAR document.
MQAR_MARKER = 2
#: Key and value bytes: 'A' <= byte < 'Z' + 1 (``train.eval_probe_token_range``).
KEY_RANGE = (65, 91)
#: Bytes of an MQAR key and of its value (``nemo_msa.training.probes``).
MQAR_KEY_BYTES = 2
MQAR_VALUE_BYTES = 2
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
                      max_file_bytes: int,
                      markers: tuple[int, ...] = (COPY_MARKER,)) -> list[tuple[str, bytes]]:
    """Read the files, drop duplicates, non-UTF-8 ones and those holding a ``markers`` byte,
    order by path hash, cap the total.

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
        if any(bytes([m]) in data for m in markers):
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


def retrieval_kind(name: str, passkey_fraction: float, mqar_fraction: float) -> str | None:
    """``"passkey"``, ``"mqar"`` or None for a document that is not a copy document: one stable
    draw from the name's hash, below P passkey, from P to P + Q MQAR."""
    draw = int.from_bytes(hashlib.sha256(b"probe:" + name.encode()).digest()[:8], "big") / 2.0**64
    if draw < passkey_fraction:
        return "passkey"
    if draw < passkey_fraction + mqar_fraction:
        return "mqar"
    return None


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(b"plant:" + name.encode())
                                                .digest()[:8], "big"))


def _boundaries(data: bytes, lo: int, hi: int) -> np.ndarray:
    """UTF-8 character starts ``lo <= i <= hi`` of ``data`` (``len(data)`` counts as one)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    starts = np.flatnonzero((arr & 0xC0) != 0x80)
    starts = np.append(starts, len(data))
    return starts[(starts >= lo) & (starts <= hi)]


def _insert(data: bytes, items: list[tuple[int, bytes]]) -> bytes:
    """``data`` with each ``(position, bytes)`` inserted before the byte at ``position``."""
    out, last = [], 0
    for pos, piece in sorted(items, key=lambda x: x[0]):
        out += [data[last:pos], piece]
        last = pos
    return b"".join([*out, data[last:]])


def passkey_document(name: str, data: bytes, key_length: int) -> tuple[bytes, int]:
    """``data`` with ``marker key`` at a random character start and again at the end.

    Returns:
        The document and the key's position in it (the marker's byte offset).
    """
    rng = _rng(name)
    key = bytes(rng.integers(KEY_RANGE[0], KEY_RANGE[1], size=key_length).tolist())
    starts = _boundaries(data, 0, len(data))
    pos = int(starts[rng.integers(0, len(starts))])
    needle = bytes([PASSKEY_MARKER]) + key
    return _insert(data, [(pos, needle)]) + needle, pos


def mqar_document(name: str, data: bytes, pairs: int) -> tuple[bytes, list[bytes]]:
    """``data`` with ``pairs`` pairs ``marker key value`` in its first three quarters and their
    queries (the same bytes, in a random order) in its last quarter, at character starts.

    Returns:
        The document and the pairs (``marker key value`` each) in the order of the queries.
    """
    rng = _rng(name)
    width = KEY_RANGE[1] - KEY_RANGE[0]
    codes = rng.choice(width ** MQAR_KEY_BYTES, size=pairs, replace=False)
    items = [bytes([MQAR_MARKER, *(KEY_RANGE[0] + int(c) // width ** i % width
                                   for i in range(MQAR_KEY_BYTES)),
                    *rng.integers(KEY_RANGE[0], KEY_RANGE[1], size=MQAR_VALUE_BYTES).tolist()])
             for c in codes]
    cut = 3 * len(data) // 4
    early, late = _boundaries(data, 0, cut - 1), _boundaries(data, cut, len(data))
    if early.size == 0:
        early = np.array([0])
    if late.size == 0:
        late = np.array([len(data)])
    pair_at = np.sort(rng.choice(early, size=pairs))
    query_at = np.sort(rng.choice(late, size=pairs))
    order = rng.permutation(pairs)
    planted = [(int(p), item) for p, item in zip(pair_at, items, strict=True)]
    queries = [items[i] for i in order]
    # At a shared position the pairs go first (sorted() is stable), so every pair precedes
    # every query.
    planted += [(int(q), item) for q, item in zip(query_at, queries, strict=True)]
    return _insert(data, planted), queries


def add_retrieval(docs: list[tuple[str, bytes]], passkey_fraction: float, mqar_fraction: float,
                  copy_fraction: float, key_length: int, pairs: int
                  ) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
    """Make passkey and MQAR documents of the non-copy documents (see the module docstring).

    Returns:
        The documents in the same order, and ``{"passkey_documents", "mqar_documents"}``.
    """
    out, counts = [], {"passkey_documents": 0, "mqar_documents": 0}
    for name, data in docs:
        copy = copy_fraction > 0 and is_copy_document(name, copy_fraction)
        kind = None if copy else retrieval_kind(name, passkey_fraction, mqar_fraction)
        if kind == "passkey":
            data = passkey_document(name, data, key_length)[0]
        elif kind == "mqar":
            data = mqar_document(name, data, pairs)[0]
        if kind:
            counts[f"{kind}_documents"] += 1
        out.append((name, data))
    return out, counts


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
    parser.add_argument("--passkey-fraction", type=float, default=0.0,
                        help="share of the non-copy documents made passkey documents")
    parser.add_argument("--passkey-length", type=int, default=8,
                        help="letters of a passkey document's key (default 8)")
    parser.add_argument("--mqar-fraction", type=float, default=0.0,
                        help="share of the non-copy documents made MQAR documents")
    parser.add_argument("--mqar-pairs", type=int, default=8,
                        help="key-value pairs of an MQAR document (default 8)")
    args = parser.parse_args(argv)
    fractions = (args.passkey_fraction, args.mqar_fraction)
    if min(fractions) < 0 or sum(fractions) > 1:
        print(f"error: --passkey-fraction = {args.passkey_fraction} and --mqar-fraction = "
              f"{args.mqar_fraction}: expected non-negative shares adding up to at most 1",
              file=sys.stderr)
        return 2
    width = KEY_RANGE[1] - KEY_RANGE[0]
    if args.passkey_length < 1 or not 1 <= args.mqar_pairs <= width ** MQAR_KEY_BYTES:
        print(f"error: --passkey-length = {args.passkey_length} and --mqar-pairs = "
              f"{args.mqar_pairs}: expected >= 1 and 1 to {width ** MQAR_KEY_BYTES} (distinct "
              "two-letter keys)", file=sys.stderr)
        return 2
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
    markers = (COPY_MARKER,) + ((PASSKEY_MARKER,) if args.passkey_fraction > 0 else ()) \
        + ((MQAR_MARKER,) if args.mqar_fraction > 0 else ())
    docs = collect_documents(sources, args.pattern, int(args.max_mb * 1e6),
                             int(args.max_file_kb * 1e3), markers)
    if not docs:
        print(f"error: no UTF-8 {args.pattern} files under {[str(s) for s in sources]}",
              file=sys.stderr)
        return 1
    docs, copied = add_copies(docs, args.copy_fraction, int(args.copy_kb * 1e3))
    docs, planted = add_retrieval(docs, args.passkey_fraction, args.mqar_fraction,
                                  args.copy_fraction, args.passkey_length, args.mqar_pairs)
    info = write_indexed_dataset(Path(args.out) / PREFIX_NAME, docs)
    info.update(vocab_size=VOCAB_SIZE, eod_id=EOD, sources=[str(s) for s in sources])
    if args.copy_fraction > 0:
        info.update(copy_fraction=args.copy_fraction, copy_kb=args.copy_kb,
                    copy_marker=COPY_MARKER,
                    copy_documents=sum(is_copy_document(n, args.copy_fraction) for n, _ in docs),
                    second_copy_token_share=round(copied / info["tokens"], 4))
    if args.passkey_fraction > 0 or args.mqar_fraction > 0:
        info.update(passkey_fraction=args.passkey_fraction, mqar_fraction=args.mqar_fraction,
                    passkey_marker=PASSKEY_MARKER, mqar_marker=MQAR_MARKER,
                    key_range=list(KEY_RANGE), **planted)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
