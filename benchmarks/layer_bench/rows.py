"""The ``--tokens`` rows of the layer benchmarks: ``N`` (one document, or ``--doc-mean``'s) and
``N:MEAN`` (one row packed with documents of mean length MEAN)."""

from __future__ import annotations


def parse_rows(text: str, means: list[int], name: str) -> list[tuple[int, int]]:
    """The ``--tokens`` rows: ``N`` (one row per ``means`` entry) or ``N:MEAN`` entries.

    Args:
        text: the option's value.
        means: the ``--doc-mean`` values plain ``N`` entries take (0: one document).
        name: the option, for the error message.

    Returns:
        ``(tokens, doc_mean)`` pairs in order, duplicates dropped.

    Raises:
        SystemExit: an entry that is not ``N`` or ``N:MEAN`` with positive N, MEAN >= 0.
    """
    rows: list[tuple[int, int]] = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        parts = item.split(":")
        try:
            values = [int(x) for x in parts]
        except ValueError:
            raise SystemExit(f"{name}={text!r}: {item!r} is not N or N:MEAN") from None
        if len(values) > 2 or values[0] <= 0 or (len(values) == 2 and values[1] < 0):
            raise SystemExit(f"{name}={text!r}: {item!r}: expected N > 0 or N:MEAN, MEAN >= 0")
        for mean in values[1:] or means:
            if (values[0], mean) not in rows:
                rows.append((values[0], mean))
    if not rows:
        raise SystemExit(f"{name}={text!r}: expected a comma-separated list")
    return rows


def next_length(ok: int, failed: int | None, limit: int, step: int) -> int | None:
    """The next row length of a search for the longest row that fits (``--grow-to``).

    Doubles ``ok`` (the longest row that ran) while no row failed, up to ``limit``; once one
    did (``failed``, the shortest row that ran out of memory or time), halves the gap: the
    midpoint, rounded down to a multiple of ``step``, while it lies strictly between the two.

    Args:
        ok: the longest row length that ran.
        failed: the shortest row length that failed, or None.
        limit: the longest length to try.
        step: the resolution of the search once a row failed (a multiple of the block).

    Returns:
        The next length, or None when the search is over.
    """
    if failed is None:
        nxt = min(2 * ok, limit)
        return nxt if nxt > ok else None
    mid = (ok + failed) // 2 // step * step
    return mid if ok < mid < failed else None
