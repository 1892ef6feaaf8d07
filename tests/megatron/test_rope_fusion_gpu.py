"""``apply_rope_fusion=True`` with MSA layers: Transformer Engine's fused RoPE at each token's
document position (ADR 0054) computes the unfused path's function.

- The op: TE's fused RoPE and the unfused one (``nemo_msa.megatron.rope``) against a float64
  reference at per-document positions, forward and gradient, partial and full rotary dims,
  interleaved or not, bf16 and fp32.
- A two-layer model (a dense-document and an MSA layer, TE spec, fp32, reference backend) built
  with ``apply_rope_fusion=True``: logits and every gradient equal the same model's with the
  flag off, and TE's kernel rotated the main and the index q/k of both layers.
- The main job's tiny model trains through ``scripts/pretrain.py`` with the TE spec in bf16 and
  fused RoPE, on the loss curve of the unfused run.

Every test needs CUDA and Transformer Engine (skipped with the reason elsewhere); the one-line
refusal without TE is tested on the CPU (tests/megatron/test_megatron_config_and_specs.py).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_te_spec import _curve, _pretrain, _rel

pytestmark = [pytest.mark.te, pytest.mark.gpu]

SEQ, MICRO_BATCH, VOCAB = 256, 2, 256


def _document_angles(lengths: list[int], rot: int, interleaved: bool) -> torch.Tensor:
    """fp64 [T, 1, rot] angles of packed documents of ``lengths`` (positions restart at 0),
    in Megatron's layout (halves, or pairs when interleaved)."""
    positions = torch.cat([torch.arange(n, dtype=torch.float64) for n in lengths])
    inv = 1.0 / (5e6 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    angles = torch.outer(positions, inv)
    if interleaved:
        both = torch.stack((angles, angles), dim=-1).flatten(-2)
    else:
        both = torch.cat((angles, angles), dim=-1)
    return both.unsqueeze(1)


def _reference(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """float64 RoPE of the first ``rot`` channels (Megatron's formula)."""
    rot = angles.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    if interleaved:
        x1, x2 = x[..., ::2], x[..., 1::2]
        turned = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x * angles.cos() + turned * angles.sin(), rest), dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize(("heads", "dim", "rot"), [(4, 128, 64), (1, 64, 64)])
def test_fused_rope_is_the_unfused_function_at_document_positions(cuda_single_rank, dtype,
                                                                   interleaved, heads, dim, rot):
    # cuda_single_rank: Megatron's unfused interleaved RoPE looks the context-parallel group up
    # when given none; in a run it is there.
    from types import SimpleNamespace

    from nemo_msa.megatron.rope import apply_rope, rope_factors

    lengths = [300, 1, 129, 77]
    angles = _document_angles(lengths, rot, interleaved)
    g = torch.Generator().manual_seed(dim + rot + interleaved)
    t64 = torch.randn(sum(lengths), heads, dim, generator=g, dtype=torch.float64) * 3
    grad64 = torch.randn(t64.shape, generator=g, dtype=torch.float64)
    want = _reference(t64, angles, interleaved)
    want_grad = torch.func.vjp(lambda x: _reference(x, angles, interleaved), t64)[1](grad64)[0]

    errors = {}
    for fused in (False, True):
        config = SimpleNamespace(rotary_interleaved=interleaved, apply_rope_fusion=fused,
                                 multi_latent_attention=False, mrope_section=None)
        x = t64.to(dtype).cuda().requires_grad_()
        factors = rope_factors(angles.float().cuda(), config)
        assert factors.te_fused is fused
        out = apply_rope(x, factors, config)
        out.backward(grad64.to(dtype).cuda())
        assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(x.grad).all()
        errors[fused] = (_rel(out.double().cpu(), want), _rel(x.grad.double().cpu(), want_grad))
    print(json.dumps({"dtype": str(dtype), "interleaved": interleaved, "rot": rot,
                      "unfused": errors[False], "fused": errors[True]}))
    # TE rounds once from fp32; the unfused path rounds its cos/sin and each product: the fused
    # error is within the unfused one's order (bf16 ~4e-3, fp32 ~1e-7).
    bound = 8e-3 if dtype == torch.bfloat16 else 1e-6
    for fused in (False, True):
        assert errors[fused][0] < bound and errors[fused][1] < bound, errors


def _model_config(fused: bool):
    from nemo_msa.megatron import MSATransformerConfig

    return MSATransformerConfig(
        num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
        num_query_groups=2, kv_channels=64, normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, attention_dropout=0.0, hidden_dropout=0.0,
        qk_layernorm=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        transformer_impl="transformer_engine", apply_rope_fusion=fused,
        msa_layer_pattern="DS", msa_num_index_heads=2, msa_index_head_dim=64,
        msa_block_size=64, msa_topk=2, msa_backend="reference", msa_indexer_loss_coeff=1.0,
    )


def test_fused_rope_model_matches_the_unfused_model(cuda_single_rank, monkeypatch):
    """Two fp32 models (TE spec, reference backend, a dense-document and an MSA layer) with the
    same weights, one built with apply_rope_fusion=True and one with False (the layers' plans
    decide at construction), on one packed batch (documents that restart mid-row, tail
    padding): logits and every gradient agree to fp32 rounding, and only the first calls TE."""
    from megatron.core.models.gpt import GPTModel

    from layer_specs import get_msa_decoder_block_spec
    from nemo_msa.megatron import rope, set_training_iteration

    calls = []
    te_rope = rope.fused_apply_rotary_pos_emb
    monkeypatch.setattr(rope, "fused_apply_rotary_pos_emb",
                        lambda t, *a, **k: calls.append(tuple(t.shape)) or te_rope(t, *a, **k))

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g).cuda()
    ids = torch.tensor([1] * 100 + [2] * 140 + [0] * 16, device="cuda")
    ids = torch.stack([ids, torch.where(ids > 0, 5 - ids, 0)])  # row 2: documents 4 and 3
    positions = torch.arange(SEQ, device="cuda").expand(MICRO_BATCH, SEQ)
    labels, mask = tokens.roll(-1, 1), (ids > 0).float()

    results, weights = {}, None
    for fused in (True, False):
        config = _model_config(fused=fused)
        torch.manual_seed(1234)
        model = GPTModel(config, get_msa_decoder_block_spec(config), vocab_size=VOCAB,
                         max_sequence_length=SEQ, position_embedding_type="rope",
                         rotary_percent=0.5, rotary_base=5_000_000).cuda()
        if weights is None:
            # TE modules' _extra_state entries are None or bytes, not tensors.
            weights = {k: v.clone() if torch.is_tensor(v) else v
                       for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(weights)
        calls.clear()
        set_training_iteration(0)
        logits = model(tokens, positions, ids)
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                 reduction="none").view_as(mask)
        ((losses * mask).sum() / mask.sum()).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        results[fused] = (logits.detach(), grads, list(calls))
    (fused_logits, fused_grads, fused_calls), (logits, grads, unfused_calls) = (
        results[True], results[False])
    # Dense-document layer: q, k; MSA layer: q, k, index_q, index_k; all through TE's kernel.
    tokens_real = int(mask.sum())
    assert fused_calls == [(tokens_real, 1, 8, 64), (tokens_real, 1, 2, 64)] * 2 + [
        (tokens_real, 1, 2, 64), (tokens_real, 1, 1, 64)], fused_calls
    assert unfused_calls == []
    errors = {"logits": _rel(fused_logits, logits)}
    assert set(fused_grads) == set(grads)
    errors.update({n: _rel(fused_grads[n], grads[n]) for n in grads})
    print(json.dumps(errors, indent=1))
    assert any(".indexer." in n for n in grads)
    bad = {n: e for n, e in errors.items() if not e < 1e-5}
    assert not bad, bad


def test_pretraining_with_fused_rope_follows_the_unfused_curve(tmp_path):
    """The main job's tiny model, 40 steps through pretrain.py with the TE spec in bf16 and
    the Triton backend, with and without apply_rope_fusion: both learn, and the fused curve
    follows the unfused one as two bf16 runs of different seeds do (ADR 0036's bounds: the
    step where the loss first falls below 1 within 4 steps, the last 10 losses' mean within
    0.1)."""
    common = ["model.msa_backend=triton"]
    unfused = _curve(_pretrain(tmp_path / "unfused", *common))
    fused = _curve(_pretrain(tmp_path / "fused", *common, "model.apply_rope_fusion=true"))
    assert set(unfused) == set(fused) and len(unfused) >= 30, (sorted(unfused), sorted(fused))
    steps = sorted(unfused)

    def below_one(curve):
        return next((s for s in steps if curve[s] < 1.0), None)

    def tail(curve):
        return sum(curve[s] for s in steps[-10:]) / 10

    record = {"unfused": [unfused[s] for s in steps], "fused": [fused[s] for s in steps],
              "below_one": [below_one(unfused), below_one(fused)],
              "tail10": [tail(unfused), tail(fused)]}
    print(json.dumps(record))
    assert all(math.isfinite(v) for v in [*unfused.values(), *fused.values()])
    assert None not in record["below_one"], record
    assert abs(record["below_one"][0] - record["below_one"][1]) <= 4, record
    assert abs(tail(unfused) - tail(fused)) < 0.1, record
