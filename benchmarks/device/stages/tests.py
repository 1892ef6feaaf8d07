"""Every test of tests/core and tests/msa_kernels compiled on the GPU (the interpreter-sized
checks too), then the gpu-marked tests of tests/megatron and tests/training; the benchmark
tooling's tests (marked bench, ADR 0038) run too: the device is where the benchmarks run.

Each pytest call has its bound; the bound interrupts pytest (SIGINT), which still prints its
counts and skip reasons. Writes gpu_tests.log (the whole output, each call's "rc N" after it:
124 where its bound stopped it) and prints the counts, the failures, each call's status and the
last test the first call finished (it names each test as it ends, -v), so that the next call can
start from there with --paths. The first call does not finish in one device call: on an H100,
367 of its 531 tests ran in 230 s.
"""

from __future__ import annotations

import re

from .. import options
from ..runner import Command, python

NAME = "tests"
HELP = "the GPU tests: tests/core and tests/msa_kernels compiled, then the gpu-marked ones"

_COUNTS = re.compile(r"^(=+ )?[0-9]+ (passed|failed|skipped|error)|^(FAILED|ERROR) |^rc ")
_ENDED = re.compile(r"::.* (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def pytest(*args: str, **kwargs) -> Command:
    """A pytest call that lists the skip reasons, writes no cache and hides UserWarnings."""
    return python("-m", "pytest", *args, "-rs", "-p", "no:cacheprovider", "-W",
                  "ignore::UserWarning", **kwargs)


def add_arguments(group) -> None:
    group.add_argument("--paths", nargs="+", default=["tests/core", "tests/msa_kernels"],
                       help="what the first call runs (e.g. the files from where a bound "
                            "stopped the last call)")
    options.add_bound(group, 400.0, "the first call's bound")
    group.add_argument("--marked-paths", nargs="+", default=["tests/megatron", "tests/training"],
                       help="where the second call runs the gpu-marked tests")
    group.add_argument("--marked-seconds", type=options.seconds, default=120.0,
                       help="the second call's bound")


def run(args, ctx) -> dict | None:
    log = ctx.out / "gpu_tests.log"
    ctx.note("", log, new=True)
    env = {"NEMO_MSA_BENCH_TESTS": "1"}
    statuses = []
    for call in (pytest("-v", "-m", "gpu or not slow", *args.paths, log=log,
                        seconds=args.seconds, interrupt=True, env=env),
                 pytest("-q", "-m", "gpu", *args.marked_paths, log=log,
                        seconds=args.marked_seconds, interrupt=True, env=env)):
        statuses.append(ctx.run(call))
        ctx.note(f"\nrc {statuses[-1]}", log)
    if ctx.dry:
        return None
    lines = log.read_text(errors="replace").splitlines()
    summary = [line for line in lines if _COUNTS.search(line)]
    ended = [line for line in lines if _ENDED.search(line)]
    print("\n".join(summary + [f"last test: {ended[-1]}"] * bool(ended)), flush=True)
    return {"statuses": statuses, "summary": summary, "last_test": ended[-1] if ended else None}
