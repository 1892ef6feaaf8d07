"""The flashinfer backend: availability, registry order, lazy import, and its composition
(flashinfer forward -> converted LSE -> Triton backward) through the public entry point.

On machines without an SM100/SM103 GPU the forward runs the CPU double of
``flashinfer.msa_ops.msa_sparse_attention`` (``flashinfer_double``, installed at the adapter's
import point) and the Triton backward runs under the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 without CUDA). The tests marked ``requires_sm100`` run the real flashinfer
and are skipped, with the reason, everywhere else.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import flashinfer_double
import pytest
import torch
from packs import document_map_from_rows

import nemo_msa.backends.flashinfer as bf
import nemo_msa.backends.triton as bt
from nemo_msa import (
    MSAMicrobatch,
    QueryView,
    Selection,
    register_backend,
    sparse_attention,
    unplanned,
)
from nemo_msa.attention import flashinfer_adapter as fa
from nemo_msa.attention.naive import (
    masked_attention_reference,
    sparse_attention_backward_reference,
    sparse_attention_forward_reference,
)
from nemo_msa.backends import registry as backends
from nemo_msa.backends.registry import ENV_VAR, get_backend, known_backends, resolve_backend
from nemo_msa.selection.naive import select_blocks_reference

REPO = Path(__file__).resolve().parents[2]
#: Where the Triton backward runs: compiled on a GPU, else under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _real_flashinfer_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return bf.BACKEND.unavailable_reason(torch.device("cuda"))


requires_sm100 = pytest.mark.skipif(
    _real_flashinfer_reason() is not None,
    reason="needs flashinfer's MSA prefill on a GPU of compute capability 10.0/10.3; here: "
    f"{_real_flashinfer_reason()}",
)


@pytest.fixture
def flashinfer_here(monkeypatch, fake_flashinfer):
    """The flashinfer backend, available on this device, in a private copy of the registry."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    register_backend(dataclasses.replace(bf.BACKEND, unavailable_reason=lambda device: None))
    return fake_flashinfer


def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def _case(rows, seq_len, hq, hkv, top_k, seed=0, device=DEVICE):
    """Layout, bf16 q/k/v/dout and the selection's q2k on ``device`` (d = 128, blocks of 128)."""
    g = torch.Generator().manual_seed(seed)
    msa = MSAMicrobatch.from_document_map(document_map_from_rows(rows, seq_len).to(device),
                                          block_size=128)
    t = msa.num_tokens
    q, dout = (torch.randn(t, hq, 128, generator=g).bfloat16().to(device) for _ in range(2))
    k, v = (torch.randn(t, hkv, 128, generator=g).bfloat16().to(device) for _ in range(2))
    q2k = select_blocks_reference(torch.randn(t, hkv, 16, generator=g).to(device),
                                  torch.randn(t, 16, generator=g).to(device), msa,
                                  top_k=top_k, init_blocks=0, local_blocks=1)
    return msa, q, k, v, dout, q2k


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


# ------------------------------------------------------------------ availability


def test_flashinfer_is_known_and_refused_on_the_cpu_with_the_reason(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert "flashinfer" in known_backends()
    with pytest.raises(ValueError, match=r"flashinfer backend cannot run on cpu: .*10\.0 or 10\.3"):
        resolve_backend("flashinfer", "cpu")


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (10, 7), (12, 0)])
def test_other_gpus_are_refused_naming_their_capability(monkeypatch, capability):
    _fake_gpu(monkeypatch, capability)
    monkeypatch.setattr(fa, "load_msa_sparse_attention", lambda: flashinfer_double)
    reason = bf.BACKEND.unavailable_reason(torch.device("cuda:0"))
    assert f"has {capability[0]}.{capability[1]}" in reason and "10.0 or 10.3" in reason


@pytest.mark.parametrize("capability", [(10, 0), (10, 3)])
def test_sm100_and_sm103_need_flashinfer_to_import(monkeypatch, capability):
    _fake_gpu(monkeypatch, capability)

    def missing():
        raise ImportError("No module named 'flashinfer'")

    monkeypatch.setattr(fa, "load_msa_sparse_attention", missing)
    reason = bf.BACKEND.unavailable_reason(torch.device("cuda:0"))
    assert "No module named 'flashinfer'" in reason and 'pip install -e ".[flashinfer]"' in reason
    monkeypatch.setattr(fa, "load_msa_sparse_attention", lambda: flashinfer_double)
    assert bf.BACKEND.unavailable_reason(torch.device("cuda:0")) is None


def test_auto_prefers_flashinfer_on_sm100_then_triton(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    _fake_gpu(monkeypatch, (10, 0))
    monkeypatch.setattr(fa, "load_msa_sparse_attention", lambda: flashinfer_double)
    assert resolve_backend("auto", "cuda:0").name == "flashinfer"
    assert resolve_backend("triton", "cuda:0").name == "triton"  # still nameable

    def missing():
        raise ImportError("no flashinfer")

    monkeypatch.setattr(fa, "load_msa_sparse_attention", missing)
    assert resolve_backend("auto", "cuda:0").name == "triton"
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(fa, "load_msa_sparse_attention", lambda: flashinfer_double)
    assert resolve_backend("auto", "cuda:0").name == "triton"
    with pytest.raises(ValueError, match="has 9.0"):
        resolve_backend("flashinfer", "cuda:0")


def test_importing_nemo_msa_and_resolving_never_imports_flashinfer(tmp_path):
    """A poisoned ``flashinfer`` package first on the path: importing nemo_msa, loading the
    backend module and resolving backends on the CPU must not touch it."""
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text(
        "raise RuntimeError('flashinfer was imported')\n")
    code = (
        "import sys\n"
        "import nemo_msa\n"
        "from nemo_msa.backends.registry import get_backend, resolve_backend\n"
        "assert resolve_backend('auto', 'cpu').name == 'reference'\n"
        "backend = get_backend('flashinfer')\n"
        "assert 'nemo_msa.backends.flashinfer' in sys.modules\n"
        "assert backend.unavailable_reason(__import__('torch').device('cpu'))\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer was imported'\n"
    )
    env = {key: value for key, value in os.environ.items() if key != ENV_VAR}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# ------------------------------------------------------------------ composition


def test_selection_is_the_triton_kernel(monkeypatch):
    seen = {}

    def triton_select(index_q, index_k, msa, **kwargs):
        seen.update(kwargs, index_q=index_q)
        return "q2k"

    monkeypatch.setattr(bt, "triton_select_blocks", triton_select)
    index_q = torch.zeros(3, 1, 16)
    got = bf.BACKEND.select_blocks(index_q, torch.zeros(3, 16), QueryView(None), top_k=16,
                                   init_blocks=1, local_blocks=2, score="max")
    assert got == "q2k" and seen["index_q"] is index_q
    assert {k: seen[k] for k in ("top_k", "init_blocks", "local_blocks", "score", "queries")} == {
        "top_k": 16, "init_blocks": 1, "local_blocks": 2, "score": "max", "queries": None}


def test_the_backward_gets_the_converted_lse(monkeypatch, flashinfer_here):
    """The Triton backward receives fp32 [Hq, T] natural-log LSE (flashinfer's [T, Hq]
    transposed), the caller's q2k in its canonical form (the op's) and no union lists (it
    builds its own)."""
    seen = {}

    def triton_backward(dout, q, k, v, out, lse, q2k, msa, scale, *, unions, queries=None,
                        dkdv=None):
        seen.update(lse=lse, q2k=q2k, unions=unions, scale=scale)
        return sparse_attention_backward_reference(dout, q, k, v, out, lse, q2k, msa, scale)

    monkeypatch.setattr(bt, "triton_attention_backward", triton_backward)
    msa, q, k, v, dout, q2k = _case([[(200, 4), (60, 0)]], 270, 4, 2, 3, device="cpu")
    ref_out, ref_lse = sparse_attention_forward_reference(q, k, v, q2k, msa, 0.125)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = sparse_attention(*xs, q2k, msa, softmax_scale=0.125, backend="flashinfer",
                                return_lse=True)
    grads = torch.autograd.grad(out, xs, dout)
    assert len(flashinfer_here) == 1
    assert seen["lse"].dtype == torch.float32 and seen["lse"].shape == (4, msa.num_tokens)
    assert seen["lse"] is lse or torch.equal(seen["lse"], lse)
    torch.testing.assert_close(seen["lse"], ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(seen["q2k"], q2k) and seen["unions"] is None and seen["scale"] == 0.125
    torch.testing.assert_close(out, ref_out)
    ref_grads = sparse_attention_backward_reference(dout, q, k, v, ref_out, ref_lse, q2k, msa,
                                                    0.125)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_forward_and_gradients_through_the_triton_backward(flashinfer_here):
    """The whole composition at a tiny size (Triton interpreted on the CPU, compiled on a GPU):
    a document longer than a block, one shorter, padding; out, lse and dq/dk/dv against the
    reference backend, and out against float64 dense attention."""
    msa, q, k, v, dout, q2k = _case([[(130, 3), (20, 0)]], 160, 2, 1, 2)
    results = {}
    for name in ("flashinfer", "reference"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out, lse = sparse_attention(*xs, q2k, msa, backend=name, return_lse=True)
        results[name] = (out, lse, *torch.autograd.grad(out, xs, dout))
    assert len(flashinfer_here) == 1
    out, lse, *grads = results["flashinfer"]
    ref_out, ref_lse, *ref_grads = results["reference"]
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5)
    dense = masked_attention_reference(q.double(), k.double(), v.double(), msa, q2k=q2k)
    assert _rel(out, dense) < 1e-2
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert _rel(got, want) < 1e-2, name


def test_shapes_flashinfer_does_not_take_run_the_triton_forward(monkeypatch, flashinfer_here):
    """Blocks of 64 tokens: without a plan the call runs the Triton forward (a choice made per
    call, counted), its union lists reach the Triton backward on the selection, and flashinfer
    is never called; a plan that named the prefill kernel for this call is refused, naming the
    field, not served by the Triton forward."""
    seen = []

    def triton_forward(q, k, v, q2k, msa, scale, *, return_unions, return_block_mass, queries):
        assert return_unions and not return_block_mass and queries is None
        return (*sparse_attention_forward_reference(q, k, v, q2k, msa, scale), "unions")

    def triton_backward(dout, q, k, v, out, lse, q2k, msa, scale, *, unions, queries=None,
                        dkdv=None):
        seen.append(unions)
        return sparse_attention_backward_reference(dout, q, k, v, out, lse, q2k, msa, scale)

    monkeypatch.setattr(bt, "triton_attention_forward", triton_forward)
    monkeypatch.setattr(bt, "triton_attention_backward", triton_backward)
    g = torch.Generator().manual_seed(1)
    msa = MSAMicrobatch.from_document_map(torch.ones(1, 150, dtype=torch.int64), block_size=64)
    q = torch.randn(150, 2, 128, generator=g).bfloat16().requires_grad_(True)
    k, v = (torch.randn(150, 1, 128, generator=g).bfloat16() for _ in range(2))
    q2k = torch.tensor([0, 1, 2], dtype=torch.int32).expand(1, 150, 3).contiguous()
    unplanned.reset()
    for _ in range(2):
        sparse_attention(q, k, v, q2k, msa, backend="flashinfer").float().sum().backward()
    assert flashinfer_here == [] and seen == ["unions", "unions"]
    assert unplanned.counts() == {"forward": 2}
    with pytest.raises(ValueError, match="MSAKernels.forward='flashinfer' but this call has "
                                         "msa_block_size=64"):
        bf.BACKEND.attention_forward(q, k, v, Selection(q2k, 64, canonical=True),
                                     QueryView(msa), 0.1, kernel="flashinfer")


# ------------------------------------------------------------------ on SM100/SM103 hardware


@requires_sm100
@pytest.mark.parametrize("rows, seq_len, top_k", [
    ([[(3000, 7), (1, 0), (700, 0)], [(128, 0), (90, 40)]], 4096, 16),
    ([[(8192, 0)]], 8192, 16),  # one long document: flashinfer's long-prefill route
    ([[(1000, 24)]], 1024, 4),  # top_k < 16: widened with -1
])
def test_real_flashinfer_forward_and_gradients(rows, seq_len, top_k):
    """MiniMax-M3 heads (64 / 4, d 128): forward and LSE against float64 dense attention and
    the reference; gradients through the Triton backward against the reference."""
    msa, q, k, v, dout, q2k = _case(rows, seq_len, 64, 4, top_k, device="cuda")
    scale = 1.0 / math.sqrt(128)
    out, lse = fa.flashinfer_attention_forward(q, k, v, q2k, msa, scale)
    reference = get_backend("reference")
    ref_out, ref_lse = reference.attention_forward(q, k, v, q2k, msa, scale)
    assert _rel(out, ref_out) < 1e-2
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    if msa.num_tokens <= 4096:
        dense = masked_attention_reference(q.double(), k.double(), v.double(), msa, scale, q2k)
        assert _rel(out, dense) < 1e-2
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    grads = torch.autograd.grad(sparse_attention(*xs, q2k, msa, backend="flashinfer"), xs, dout)
    ref_grads = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, q2k, msa, scale)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert _rel(got, want) < 1e-2, name


@requires_sm100
def test_real_flashinfer_on_rows_that_select_nothing_and_non_canonical_q2k():
    """What the adapter assumes beyond flashinfer's docstring: a row with no selected block
    gives out 0 and lse -inf; and any q2k means its set of ids (via the conversion)."""
    msa, q, k, v, _, q2k = _case([[(600, 0), (300, 0)]], 1024, 16, 1, 16, device="cuda")
    q2k[0, 100:140] = -1
    out, lse = fa.flashinfer_attention_forward(q, k, v, q2k, msa, 0.1)
    assert bool((out[100:140] == 0).all()) and bool(torch.isneginf(lse[:, 100:140]).all())
    # The same sets as q2k's rows, reversed, repeated and with -1 in front.
    scrambled = torch.cat([q2k.flip(-1)[..., :8], q2k[..., :8]], dim=-1).contiguous()
    out2, lse2 = fa.flashinfer_attention_forward(q, k, v, scrambled, msa, 0.1)
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(lse2, lse, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_on_a_gpu_without_sm100_flashinfer_is_unavailable_and_auto_picks_triton():
    """The device check (H200: compute capability 9.0): the registry names the reason, and
    ``auto`` resolves to the Triton backend."""
    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) in ((10, 0), (10, 3)):
        pytest.skip(f"this GPU is SM{major}{minor}: flashinfer is the expected choice here")
    reason = get_backend("flashinfer").unavailable_reason(device)
    assert reason is not None and f"{major}.{minor}" in reason, reason
    assert resolve_backend("auto", device).name == "triton"
    with pytest.raises(ValueError, match="flashinfer backend cannot run"):
        resolve_backend("flashinfer", device)
