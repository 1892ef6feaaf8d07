"""Suite-wide set-up.

- Without CUDA, Triton kernels run under the interpreter. Triton fixes compile-vs-interpret when
  a kernel module is imported, and any test may import the Triton backend first (the registry
  loads it lazily), so the variable is set here, before any test module is collected. The
  interpreter patches ``triton.language`` once per launch (``tests/_triton_interpreter.py``).
- Tests marked ``gpu`` or ``te`` skip, with the reason, where CUDA or transformer-engine is
  missing.
- Tests marked ``bench`` (those of the benchmark tooling under benchmarks/) are deselected unless
  ``--run-bench`` is given, ``NEMO_MSA_BENCH_TESTS=1`` is set or ``-m`` names ``bench``
  (ADR 0038): the default run tests the product in minutes; the device validation sets the
  variable, so its ``-m gpu`` calls still run them.
- Under ``--dist loadgroup`` a worker refuses to run if pytest-xdist did not put the
  ``xdist_group`` name into the test ids (pytest-xdist 3.8 with pytest 9): the groups keep the
  process-spawning modules' shared runs to one start each, and without them those start once
  per worker.
- ``kernel_backends_on_the_cpu``: GPU-less doubles of the kernel backends' device checks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from _triton_interpreter import install as _patch_the_interpreter_once_per_launch

    _patch_the_interpreter_once_per_launch()


BENCH_ENV = "NEMO_MSA_BENCH_TESTS"


def pytest_addoption(parser):
    parser.addoption(
        "--run-bench", action="store_true", default=False,
        help=f"also run the tests marked bench (the benchmark tooling under benchmarks/); the same "
             f"as {BENCH_ENV}=1",
    )


def _check_xdist_groups(config, items) -> None:
    if not getattr(getattr(config, "option", None), "loadgroup", False):
        return
    ungrouped = [item.nodeid for item in items
                 if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid]
    if ungrouped:
        raise pytest.UsageError(
            f"--dist loadgroup: pytest-xdist did not group {len(ungrouped)} tests marked "
            f"xdist_group (first: {ungrouped[0]}); pytest {pytest.__version__} with this "
            f"pytest-xdist does not support it: install the versions of constraints.txt")


def _runs_bench_tests(config) -> bool:
    return (config.getoption("--run-bench") or os.environ.get(BENCH_ENV) == "1"
            or "bench" in (config.getoption("markexpr") or ""))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _check_xdist_groups(config, items)
    if not _runs_bench_tests(config):
        bench = [item for item in items if item.get_closest_marker("bench") is not None]
        if bench:
            config.hook.pytest_deselected(items=bench)
            items[:] = [item for item in items if item.get_closest_marker("bench") is None]
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; runs on the device (H200) instead")
    no_te = pytest.mark.skip(reason="needs transformer-engine, which is not installed here")
    has_te = importlib.util.find_spec("transformer_engine") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "te" in item.keywords and not has_te:
            item.add_marker(no_te)


@pytest.fixture
def kernel_backends_on_the_cpu(monkeypatch):
    """GPU-less doubles of the Triton and flashinfer backends' device checks, in a private copy
    of the registry: what a layer's plan decides at construction is tested on the CPU (the
    kernels never launch; flashinfer itself is imported only on first use)."""
    from nemo_msa.backends import registry as backends

    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    for name in ("triton", "flashinfer"):
        backend = backends.get_backend(name)
        backends.register_backend(
            dataclasses.replace(backend, unavailable_reason=lambda device: None))
