"""The README's Megatron snippet runs as written, in a fresh process (it sets up gloo)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_readme_megatron_snippet_trains_a_step():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## MSA layers in a Megatron-Core GPT model.*?```python\n(.*?)```", text,
                      re.S)
    assert block is not None, "README lost its Megatron snippet"
    code = block.group(1)
    code += (
        "\nassert loss.shape == (2, 1024)\n"
        "grads = [p.grad for p in model.parameters() if p.requires_grad]\n"
        "assert all(g is not None for g in grads), 'every parameter gets a gradient'\n"
        "print('README-SNIPPET-OK', float(loss.mean()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "README-SNIPPET-OK" in result.stdout
