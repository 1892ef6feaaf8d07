"""The stages, in the order ``--help`` lists them. Each module has ``NAME``, ``HELP`` (one
line), ``add_arguments(group)`` and ``run(args, ctx)`` (its summary for the record, or None);
its docstring is its ``--help``."""

from . import (
    ab,
    bench,
    bridge,
    determinism,
    fla_peer,
    layer,
    peer,
    peer_part,
    pp1,
    pretrain,
    profile,
    quality_runs,
    rows,
    sparse_peers,
    sweep,
    te,
    te_part,
    te_rows,
    tests,
)

STAGES = (
    tests,
    te_part,
    te,
    bridge,
    rows,
    layer,
    sweep,
    profile,
    te_rows,
    bench,
    ab,
    peer,
    fla_peer,
    peer_part,
    sparse_peers,
    pretrain,
    determinism,
    pp1,
    quality_runs,
)
