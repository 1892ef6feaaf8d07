"""The queries of one call against a layout's keys: :class:`QueryView`.

Every op and kernel reads the keys and values of a layout's every token; the queries are either
every token too, or, under context parallelism, this rank's subset (ADR 0021). The layer and the
ops pass that pair as one object, built once per microbatch by the context-parallel layout
(:attr:`nemo_msa.context_parallel.ContextParallelLayout.view`); the kernels and references below
the backends keep their own ``(msa, queries=)`` arguments, into which the backends unpack it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_msa.layout import MSAMicrobatch, query_rows, validate_queries

__all__ = ["QueryView"]


@dataclass(frozen=True, eq=False)
class QueryView:
    """A layout and the queries a call runs against its keys.

    Attributes:
        msa: the (global) layout: keys and values have its ``num_tokens`` rows.
        queries: int64 [Tq] global compact rows of the queries, ascending and unique (context
            parallelism's local queries), or None: every token is a query.
    """

    msa: MSAMicrobatch
    queries: torch.Tensor | None = None

    @classmethod
    def of(cls, msa: MSAMicrobatch | QueryView,
           queries: torch.Tensor | None = None) -> QueryView:
        """The view of ``msa`` (a layout, with an optional query subset, or a view as it is).

        Raises:
            TypeError: ``msa`` is neither a layout nor a view.
            ValueError: a view with ``queries`` as well (the view holds its own).
        """
        if isinstance(msa, QueryView):
            if queries is not None:
                raise ValueError("queries= given with a QueryView, which holds its own queries; "
                                 "pass one or the other")
            return msa
        if not isinstance(msa, MSAMicrobatch):
            raise TypeError(f"msa must be an MSAMicrobatch or a QueryView; got "
                            f"{type(msa).__name__}")
        return cls(msa, queries)

    @property
    def num_queries(self) -> int:
        """Tq: the rows of the query-side tensors (q, index_q, q2k, the output)."""
        return self.msa.num_tokens if self.queries is None else int(self.queries.shape[0])

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """A per-token table [T, ...] of the layout read at the queries: [Tq, ...]."""
        return query_rows(values, self.queries)

    def validate(self, rows: int) -> None:
        """Checks the queries against the layout and a query-side tensor's ``rows``
        (:func:`nemo_msa.layout.validate_queries`)."""
        validate_queries(self.queries, self.msa, rows)
