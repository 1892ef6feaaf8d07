"""The example in docs/integration.md trains on the CPU as written, in a fresh process."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integration.md"


def _example() -> str:
    """Returns the python block between the doc's integration-example markers."""
    match = re.search(
        r"<!-- integration-example -->\n```python\n(.*?)```\n<!-- /integration-example -->",
        DOC.read_text(), re.S)
    assert match is not None, "docs/integration.md lost its example"
    return match.group(1)


def test_integration_example_trains_and_the_indexer_learns():
    """Three steps (one dense warm-up step) give finite losses and indexer gradients."""
    code = _example()
    code += (
        "\nimport math\n"
        "from nemo_msa.megatron import indexer_parameters, non_indexer_parameters\n"
        "assert math.isfinite(float(total[0] / total[1])), total\n"
        "assert math.isfinite(msa['indexer_loss']), msa\n"
        "grads = [p.grad for p in indexer_parameters(model)]\n"
        "assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)\n"
        "assert all(p.grad is not None for p in non_indexer_parameters(model))\n"
        "print('INTEGRATION-DOC-OK')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "INTEGRATION-DOC-OK" in result.stdout
    assert re.search(r"step 2: loss \d", result.stdout), result.stdout[-2000:]
