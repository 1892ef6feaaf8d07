"""A GPTModel built from the MSA spec, on one CPU rank: behaviour of the layers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _megatron_harness import (
    MICRO_BATCH,
    SEQ,
    VOCAB,
    build_model_chunks,
    deterministic_init,
    packed_batches,
    tiny_config,
)

from nemo_msa import MSAMicrobatch, select_blocks
from nemo_msa.indexer_loss import compute_indexer_loss
from nemo_msa.megatron import (
    MSAIndexerLossAutoScaler,
    MSAIndexerMetrics,
    indexer_parameters,
    set_main_parameters_trainable,
    set_training_iteration,
)
from nemo_msa.plan import MSAPlan

pytestmark = pytest.mark.usefixtures("single_rank")


def _model(**overrides):
    (model,) = build_model_chunks(tiny_config(**overrides))
    deterministic_init([model])
    return model


def _logits(model, tokens, document_ids):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, document_ids)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_gpt_forward_backward_mixed_pattern():
    model = _model()
    batch = packed_batches(1)[0]
    MSAIndexerMetrics.reset()
    builds = MSAMicrobatch.num_builds()
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    loss = model(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])
    assert MSAMicrobatch.num_builds() - builds == 1, (
        f"4 layers built {MSAMicrobatch.num_builds() - builds} layouts for one microbatch; "
        "expected 1 shared layout"
    )
    total = (loss * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    assert math.isfinite(float(total)) and abs(float(total) - math.log(VOCAB)) < 0.5, float(total)
    total.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    index_norms = {n: float(p.grad.norm()) for n, p in model.named_parameters() if ".indexer." in n}
    assert len(index_norms) == 3 * 4, sorted(index_norms)  # 3 MSA layers x 4 tensors
    assert all(v > 0 for v in index_norms.values()), index_norms
    dense_layer = dict(model.named_parameters())
    assert not any(k.startswith("decoder.layers.1.self_attention.indexer") for k in dense_layer)
    metrics = MSAIndexerMetrics.pop(num_layers=4)
    assert set(k for k in metrics if "/layer_" in k and "loss" in k) == {
        "indexer_loss/layer_1",
        "indexer_loss/layer_3",
        "indexer_loss/layer_4",
    }, metrics
    assert 0 < metrics["selection_recall"] <= 1 + 1e-6, metrics


def test_packed_documents_match_documents_alone():
    """Document isolation and RoPE restart: a document packed after another gives the same
    logits as the same document at the start of its own row (selection is active: the document
    has 4 blocks, top-k is 3)."""
    model = _model()
    model.eval()
    generator = torch.Generator().manual_seed(3)
    doc_a = torch.randint(0, VOCAB, (40,), generator=generator)
    doc_b = torch.randint(0, VOCAB, (60,), generator=generator)
    tokens = torch.zeros(2, SEQ, dtype=torch.long)
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    tokens[0, :40], tokens[0, 40:100] = doc_a, doc_b
    ids[0, :40], ids[0, 40:100] = 1, 2
    tokens[1, :60] = doc_b
    ids[1, :60] = 3
    with torch.no_grad():
        packed = _logits(model, tokens, ids)
        leaked = _logits(model, tokens, None)  # no document map: one causal document per row
    alone = packed[1, :60]
    error = float((packed[0, 40:100] - alone).abs().max())
    assert error < 1e-4, f"packed vs alone: max |diff| = {error:.3e} (expected < 1e-4)"
    control = float((leaked[0, 40:100] - alone).abs().max())
    assert control > 1e-2, f"control without document map should differ; max |diff| {control}"


def test_sparse_equals_dense_when_top_k_covers_every_block():
    batch = packed_batches(1, seed=5)[0]
    blocks = SEQ // 16
    full = _model(msa_topk=blocks, msa_dense_warmup_steps=1)
    full.eval()
    with torch.no_grad():
        set_training_iteration(0)  # dense warm-up
        dense = _logits(full, batch["tokens"], batch["packed_seq_ids"])
        set_training_iteration(1)  # sparse, every block selected
        sparse = _logits(full, batch["tokens"], batch["packed_seq_ids"])
    set_training_iteration(None)
    error = _rel(sparse, dense)
    assert error < 1e-5, f"sparse(top_k={blocks}) vs dense: relative error {error:.3e}"
    small = _model(msa_topk=2)
    small.eval()
    with torch.no_grad():
        narrow = _logits(small, batch["tokens"], batch["packed_seq_ids"])
    control = _rel(narrow, dense)
    assert control > 1e-4, f"top_k=2 should differ from dense; relative error {control:.3e}"


def test_indexer_loss_trains_only_the_indexer_and_follows_the_scale():
    model = _model()
    batch = packed_batches(1, seed=9)[0]
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)

    def grads(scale):
        model.zero_grad(set_to_none=True)
        MSAIndexerLossAutoScaler.reset()
        if scale is not None:
            MSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(scale))
        out = model(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])
        (0.0 * out.sum()).backward()  # only the attached indexer losses carry gradient
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    base = grads(None)
    main = {n: float(g.abs().max()) for n, g in base.items() if ".indexer." not in n}
    assert max(main.values()) == 0.0, {k: v for k, v in main.items() if v}
    index = {n: float(g.norm()) for n, g in base.items() if ".indexer." in n}
    assert len(index) == 12 and min(index.values()) > 0, index
    doubled = grads(2.0)
    for name in index:
        ratio = float(doubled[name].norm() / base[name].norm())
        assert abs(ratio - 2.0) < 1e-5, f"{name}: scale 2 gave gradient ratio {ratio}"
    MSAIndexerLossAutoScaler.reset()


def _bruteforce_indexer_kl(
    index_q, index_k, query, key, documents, positions, block, scale, q2k=None
):
    """KL(P || Q) per (token, head), by loops over plain Python indices, in float64; with q2k
    both distributions live on the selected blocks only."""
    tokens, heads, _ = index_q.shape
    group = query.shape[1] // heads
    total = 0.0
    for t in range(tokens):
        own = positions[t] // block
        for h in range(heads):
            allowed = set(range(own + 1)) if q2k is None else {b for b in q2k[h][t] if b >= 0}
            keys = [
                j
                for j in range(tokens)
                if documents[j] == documents[t]
                and positions[j] <= positions[t]
                and positions[j] // block in allowed
            ]
            logits = torch.stack(
                [(query[t, h * group + i] @ key[keys, h].T) * scale for i in range(group)]
            )
            probs = torch.softmax(logits, dim=-1).sum(0) / group
            target = torch.zeros(own + 1, dtype=torch.float64)
            index_scores = torch.full((own + 1,), -math.inf, dtype=torch.float64)
            for slot, j in enumerate(keys):
                b = positions[j] // block
                target[b] += probs[slot]
                score = float(index_q[t, h] @ index_k[j]) / math.sqrt(index_q.shape[-1])
                index_scores[b] = max(float(index_scores[b]), score)
            log_q = torch.log_softmax(index_scores, dim=0)
            mask = target > 0
            total += float((target[mask] * (target[mask].log() - log_q[mask])).sum())
    return total / (tokens * heads)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-loss", "sparse-loss"])
def test_indexer_loss_matches_a_bruteforce_reference(sparse):
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1] * 37 + [2] * 20 + [0] * 7, [3] * 64])
    msa = MSAMicrobatch.from_document_map(ids, block_size=16)
    tokens = msa.num_tokens
    heads, group, dim = 2, 2, 16
    index_q = torch.randn(tokens, heads, dim, dtype=torch.float64, generator=generator)
    index_k = torch.randn(tokens, dim, dtype=torch.float64, generator=generator)
    query = torch.randn(tokens, heads * group, dim, dtype=torch.float64, generator=generator)
    key = torch.randn(tokens, heads, dim, dtype=torch.float64, generator=generator)
    q2k = select_blocks(index_q, index_k, msa, top_k=2) if sparse else None
    loss, stats = compute_indexer_loss(
        index_q,
        index_k,
        query,
        key,
        msa,
        softmax_scale=0.25,
        num_index_heads_total=heads,
        loss_coeff=1.0,
        query_chunk=13,
        q2k=q2k,
        sparse=sparse,
    )
    expected = _bruteforce_indexer_kl(
        index_q,
        index_k,
        query,
        key,
        msa.token_documents.tolist(),
        msa.document_positions.tolist(),
        16,
        0.25,
        q2k=q2k.tolist() if sparse else None,
    )
    assert abs(float(loss) - expected) < 1e-5 * max(1.0, abs(expected)), (
        f"indexer KL {float(loss):.8f} vs brute force {expected:.8f}"
    )
    assert float(stats["kl"]) == pytest.approx(float(loss))


def test_dense_warmup_phase_and_freezing():
    model = _model(msa_dense_warmup_steps=2)
    batch = packed_batches(1, seed=4)[0]
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    set_training_iteration(None)
    with pytest.raises(RuntimeError, match="msa_dense_warmup_steps=2"):
        model(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])
    set_training_iteration(1)
    assert set_main_parameters_trainable(model, False) > 0
    MSAIndexerMetrics.reset()
    out = model(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])
    out.mean().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    indexer = {id(p) for p in indexer_parameters(model)}
    assert trained and all(".indexer." in n for n in trained), sorted(trained)
    assert len(trained) == len(indexer) == 12
    metrics = MSAIndexerMetrics.pop(num_layers=4)
    # Attention is dense in the warm-up, but the selection still runs for the recall metric.
    assert "indexer_loss" in metrics and "selection_recall" in metrics, metrics
    assert 0.0 < metrics["selection_recall"] <= 1.0 + 1e-6, metrics
    set_main_parameters_trainable(model, True)
    set_training_iteration(None)


def test_bf16_model_runs_the_sparse_op_and_tracks_fp32():
    batch = packed_batches(1, seed=8)[0]
    fp32 = _model()
    fp32.eval()
    bf16 = _model(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    bf16.load_state_dict(
        {
            k: v.to(torch.bfloat16)
            for k, v in fp32.state_dict().items()
            if v is not None and v.is_floating_point()
        },
        strict=False,
    )
    bf16.eval()
    with torch.no_grad():
        reference = _logits(fp32, batch["tokens"], batch["packed_seq_ids"])
        low = _logits(bf16, batch["tokens"], batch["packed_seq_ids"])
    assert low.dtype == torch.bfloat16
    error = _rel(low.float(), reference)
    assert error < 3e-2, f"bf16 vs fp32 logits: relative error {error:.3e}"
    bf16.train()
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    out = bf16(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])
    out.float().mean().backward()
    qkv = bf16.decoder.layers[0].self_attention.linear_qkv.weight.grad
    assert qkv is not None and bool(torch.isfinite(qkv).all()) and float(qkv.norm()) > 0


def _loss_and_grads(**overrides):
    model = _model(**overrides)
    batch = packed_batches(1, seed=13)[0]
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    out = model(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])
    out.mean().backward()
    return float(out.mean()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    ],
    ids=["full", "selective-core-attn"],
)
def test_activation_recompute_gives_the_same_gradients(recompute):
    """Full: the indexer loss is attached once, in the recomputed forward (the first one runs
    without grad), and its gradient survives recomputation. Selective: the core attention is
    recomputed with the same layout and selection."""
    attention = _model(**recompute).decoder.layers[0].self_attention
    assert attention.checkpoint_core_attention == (recompute["recompute_granularity"] != "full")
    loss, grads = _loss_and_grads()
    loss_r, grads_r = _loss_and_grads(**recompute)
    worst = max(float((grads[k] - grads_r[k]).abs().max()) for k in grads)
    index = min(float(g.norm()) for k, g in grads_r.items() if ".indexer." in k)
    assert loss == loss_r and worst < 1e-7 and index > 0, (
        f"recompute: loss {loss_r} vs {loss}, max |grad diff| {worst:.2e}, min indexer grad "
        f"norm {index:.2e}"
    )


def test_moe_mlp_with_msa_attention():
    """MiniMax-M3 is a MoE model: the MSA layer spec keeps Megatron's MoE MLP (the allgather
    dispatcher; alltoall needs CUDA streams, which the CPU shim does not map)."""
    loss, grads = _loss_and_grads(
        num_moe_experts=2,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        add_bias_linear=False,
    )
    experts = [k for k in grads if ".mlp.experts." in k]
    assert math.isfinite(loss) and experts, sorted(grads)
    assert all(float(grads[k].norm()) > 0 for k in experts), experts


def test_sparse_indexer_loss_in_the_model():
    loss, grads = _loss_and_grads(msa_indexer_loss_type="sparse")
    index = {k: float(g.norm()) for k, g in grads.items() if ".indexer." in k}
    assert math.isfinite(loss) and len(index) == 12 and min(index.values()) > 0, index


@pytest.mark.parametrize(
    "recompute",
    [{}, dict(recompute_granularity="selective", recompute_modules=["core_attn"])],
    ids=["plain", "selective-core-attn"],
)
def test_sparse_loss_from_byproducts_matches_the_recomputing_reference(monkeypatch, recompute):
    """The layer's production loss (selection scores/keys + forward block mass) trains the
    indexer exactly as the reference that gathers the keys again: same logged KL, same
    gradients (fp32 on the CPU), with and without selective recompute of the core."""
    from nemo_msa.megatron import indexer_step

    calls = []
    fused = indexer_step.sparse_indexer_loss_from_byproducts
    monkeypatch.setattr(indexer_step, "sparse_indexer_loss_from_byproducts",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    MSAIndexerMetrics.reset()
    loss, grads = _loss_and_grads(msa_indexer_loss_type="sparse", **recompute)
    kl = MSAIndexerMetrics.pop(reduce=False)["indexer_loss"]
    assert calls, "the sparse loss did not take the by-product path"
    build = MSAPlan.build.__func__
    monkeypatch.setattr(MSAPlan, "build", classmethod(lambda cls, *a, **k: dataclasses.replace(
        build(cls, *a, **k), loss_route="reference_sparse")))
    ref_loss, ref_grads = _loss_and_grads(msa_indexer_loss_type="sparse", **recompute)
    ref_kl = MSAIndexerMetrics.pop(reduce=False)["indexer_loss"]
    assert len(calls) == 3, calls  # one per MSA layer; the reference run made none
    assert loss == pytest.approx(ref_loss, rel=1e-6) and kl == pytest.approx(ref_kl, rel=1e-5)
    for name, g in ref_grads.items():
        assert _rel(grads[name], g) < 1e-5 or float(g.norm()) < 1e-12, name
    index = [k for k in grads if ".indexer." in k]
    assert index and min(float(grads[k].norm()) for k in index) > 0


def test_indexer_matches_a_hand_written_reference():
    """index_q/index_k = RMSNorm per head (weight w, or 1 + w with zero-centred gamma, as the
    model's other norms), then rotate-half RoPE on the first rot_dim channels at document
    positions (theta 5e6), written out by hand here."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    model = _model()
    attention = model.decoder.layers[0].self_attention
    indexer = attention.indexer
    ids = torch.tensor([[1] * 50 + [2] * 60 + [0] * 18, [3] * 128])
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=16)
    hidden = torch.randn(SEQ, MICRO_BATCH, 64, generator=torch.Generator().manual_seed(2))
    rotary = RotaryEmbedding(kv_channels=32, rotary_percent=0.5, rotary_base=5_000_000)(SEQ)
    freqs = attention._token_rotary_freqs(rotary, msa)
    with torch.no_grad():
        index_q, index_k = indexer(hidden, msa, freqs)

        x = hidden.transpose(0, 1).reshape(-1, 64)[msa.token_rows].double()
        positions = msa.document_positions.double()
        rot = 16
        inv_freq = 1.0 / (5_000_000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
        angles = positions[:, None] * inv_freq[None, :]
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

        offset = 1.0 if attention.config.layernorm_zero_centered_gamma else 0.0

        def gemma(v, weight):
            return v / v.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * (offset
                                                                           + weight.double())

        def rope(v):
            head, rest = v[..., :rot], v[..., rot:]
            half = torch.cat([-head[..., rot // 2 :], head[..., : rot // 2]], -1)
            shape = (-1,) + (1,) * (v.dim() - 2) + (rot,)
            return torch.cat([head * cos.view(shape) + half * sin.view(shape), rest], -1)

        q = x @ indexer.index_q_proj.weight.double().T
        q = rope(gemma(q.view(-1, 2, 32), indexer.index_q_norm.weight))
        k = rope(gemma(x @ indexer.index_k_proj.weight.double().T, indexer.index_k_norm.weight))
    errors = (_rel(index_q.double(), q), _rel(index_k.double(), k))
    assert max(errors) < 1e-5, f"relative error of index_q, index_k vs by hand: {errors}"
    # The weight term is exercised (not the init value of either convention).
    assert float((indexer.index_q_norm.weight - (1.0 - offset)).abs().max()) > 0
