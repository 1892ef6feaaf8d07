"""Issue 63's GPU tests past 2^31 elements (ADR 0051): tests/msa_kernels/
test_long_sequences_gpu.py compiled on the GPU: the MSA ops at 264192 tokens of M3's heads (q,
O, dO and dq past 2^31 elements), a context-parallel shard of as many queries, and the fused
dense indexer loss with head offsets past 2^31, against float64 on sampled rows. They need
about 36 GiB (each skips with the reason below that) and compile their own kernel variants:
--tests runs some of them (pytest node ids), e.g. one per device call. The "tests" stage leaves
the file out.

Writes long_tests.log (the whole output, then "rc N": 124 where the bound stopped it) and prints
the counts, the failures, the skip reasons, each test's time and the status.
"""

from __future__ import annotations

import re

from .. import options
from .tests import LONG, pytest

NAME = "long_tests"
HELP = "issue 63's GPU tests past 2^31 elements (about 36 GiB; minutes)"

_PRINTED = re.compile(r"^(=+ )?[0-9]+ (passed|failed|skipped|error)|^(FAILED|ERROR|SKIPPED) |"
                      r"^rc |s call ")


def add_arguments(group) -> None:
    group.add_argument("--tests", nargs="+", default=[LONG],
                       help=f"what to run, e.g. {LONG}::test_one_gpu_past_2_31_elements")
    options.add_bound(group, 400.0)


def run(args, ctx) -> dict | None:
    log = ctx.out / "long_tests.log"
    ctx.note("", log, new=True)
    rc = ctx.run(pytest("-v", "--durations=0", *args.tests, log=log, seconds=args.seconds,
                        interrupt=True))
    ctx.note(f"\nrc {rc}", log)
    if ctx.dry:
        return None
    summary = [line for line in log.read_text(errors="replace").splitlines()
               if _PRINTED.search(line)]
    print("\n".join(summary), flush=True)
    return {"status": rc, "summary": summary}
