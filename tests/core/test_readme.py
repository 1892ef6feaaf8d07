"""The README's example runs, and its two set-up commands are where .ci/run reads them."""

from __future__ import annotations

import pathlib
import re

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_core_example_runs_and_backpropagates():
    code = re.search(r"## The MSA core in a few lines.*?```python\n(.*?)```", README, re.S)
    assert code is not None, "README lost its core example"
    scope: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), scope)
    out, msa, q = scope["out"], scope["msa"], scope["q"]
    assert out.shape == (msa.num_tokens, 64, 128) and out.dtype == torch.bfloat16
    assert msa.num_tokens == 300 + 200 + 512
    assert q.grad is not None and q.grad.abs().sum() > 0
    assert torch.all(q.grad[0, 500:] == 0), "padding must receive no gradient"


def test_readme_holds_exactly_one_main_and_one_test_command():
    for marker in ("main-command", "test-command"):
        block = re.findall(rf"<!-- {marker} -->\n```\n(.*?)\n```\n<!-- /{marker} -->", README)
        assert len(block) == 1 and "\n" not in block[0], f"{marker}: {block}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "test-command" in ci, ".ci/run must read the README's test command"


def test_readme_install_and_ci_take_the_measured_versions():
    """The README's install and .ci/run both pass constraints.txt, which pins torch, triton and
    numpy exactly (the versions the GPU figures were measured with)."""
    main = re.search(r"<!-- main-command -->\n```\n(.*?)\n```", README).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert '-e ".[test]" -c constraints.txt' in main, main
    assert '-e ".[test]" -c constraints.txt' in ci
    pins = dict(
        line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert {"torch", "triton", "numpy", "megatron-core"} <= set(pins), pins
    assert all(re.fullmatch(r"\d+(\.\d+)+", v) for v in pins.values()), pins
