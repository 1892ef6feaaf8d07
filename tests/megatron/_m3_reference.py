"""A synthetic MiniMax-M3 checkpoint (M3's tensor names, toy shapes) and a float64 forward of the
text model written from those names alone, as M3's modeling code computes it: Gemma RMSNorm
x * (1 + w), per-head q/k norm, partial rotate-half RoPE, GQA causal attention (MSA layers attend
the blocks their index branch selects: max over visible keys of index q . index k, the own block
forced, top-k), SwiGLU-OAI MLPs, sigmoid routing with the correction bias used for the choice
only, the top-k weights normalized and scaled, plus the shared expert. The checkpoint can carry
M3's multi-token-prediction modules (``model.mtp.layers.<k>``: enorm, hnorm, eh_proj, a
transformer layer of the last layer's kind, final_layernorm)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ToyM3:
    """Toy sizes with M3's structure (dense layers first, then MoE; MSA where marked)."""

    vocab: int = 128
    hidden: int = 32
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    dense_ffn: int = 48
    expert_ffn: int = 16
    shared_ffn: int = 24
    experts: int = 6
    topk: int = 2
    scaling: float = 2.0
    moe_layers: tuple[int, ...] = (0, 1, 1)
    msa_layers: tuple[int, ...] = (0, 1, 1)
    index_heads: int = 2
    index_dim: int = 16
    block: int = 16
    msa_topk: int = 2
    rotary_dim: int = 8
    theta: float = 5_000_000.0
    eps: float = 1e-6
    limit: float = 7.0
    #: MTP modules in the checkpoint (M3's release: 1).
    mtp_layers: int = 0


def synthetic_checkpoint(toy: ToyM3, seed: int = 0, root: str = "") -> dict[str, torch.Tensor]:
    """Random float64 tensors under M3's Hugging Face names (the router's gate and correction
    bias in float32, as the released checkpoint stores them and Megatron's router holds them).
    Norm weights are zero-centred and far from zero, so a wrong convention shows; gate/up
    weights are large enough that SwiGLU-OAI's clamps engage."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    h = toy.hidden
    sd = {f"{root}model.embed_tokens.weight": rnd(toy.vocab, h, scale=1.0),
          f"{root}model.norm.weight": rnd(h, scale=0.3),
          f"{root}lm_head.weight": rnd(toy.vocab, h)}
    for i, (moe, msa) in enumerate(zip(toy.moe_layers, toy.msa_layers, strict=True)):
        _layer(sd, f"{root}model.layers.{i}.", moe, msa, toy, rnd)
    for k in range(toy.mtp_layers):
        p = f"{root}model.mtp.layers.{k}."
        for name in ("enorm", "hnorm", "final_layernorm"):
            sd[p + name + ".weight"] = rnd(h, scale=0.3)
        sd[p + "eh_proj.weight"] = rnd(h, 2 * h)
        _layer(sd, p + "transformer_layer.", toy.moe_layers[-1], toy.msa_layers[-1], toy, rnd)
    return sd


def _layer(sd: dict, p: str, moe: int, msa: int, toy: ToyM3, rnd) -> None:
    """One decoder layer's tensors under prefix ``p``."""
    h, d = toy.hidden, toy.head_dim
    sd[p + "input_layernorm.weight"] = rnd(h, scale=0.3)
    sd[p + "post_attention_layernorm.weight"] = rnd(h, scale=0.3)
    sd[p + "self_attn.q_proj.weight"] = rnd(toy.heads * d, h)
    sd[p + "self_attn.k_proj.weight"] = rnd(toy.kv_heads * d, h)
    sd[p + "self_attn.v_proj.weight"] = rnd(toy.kv_heads * d, h)
    sd[p + "self_attn.o_proj.weight"] = rnd(h, toy.heads * d)
    sd[p + "self_attn.q_norm.weight"] = rnd(d, scale=0.3)
    sd[p + "self_attn.k_norm.weight"] = rnd(d, scale=0.3)
    if msa:
        sd[p + "self_attn.index_q_proj.weight"] = rnd(toy.index_heads * toy.index_dim, h)
        sd[p + "self_attn.index_k_proj.weight"] = rnd(toy.index_dim, h)
        sd[p + "self_attn.index_q_norm.weight"] = rnd(toy.index_dim, scale=0.3)
        sd[p + "self_attn.index_k_norm.weight"] = rnd(toy.index_dim, scale=0.3)
    if not moe:
        for name, shape in (("gate_proj", (toy.dense_ffn, h)), ("up_proj", (toy.dense_ffn, h)),
                            ("down_proj", (h, toy.dense_ffn))):
            sd[p + f"mlp.{name}.weight"] = rnd(*shape, scale=3.0 * shape[-1] ** -0.5)
        return
    m = p + "block_sparse_moe."
    sd[m + "gate.weight"] = rnd(toy.experts, h).float()
    sd[m + "e_score_correction_bias"] = (rnd(toy.experts, scale=0.1)).float()
    for e in range(toy.experts):
        sd[m + f"experts.{e}.w1.weight"] = rnd(toy.expert_ffn, h, scale=3.0 * h ** -0.5)
        sd[m + f"experts.{e}.w3.weight"] = rnd(toy.expert_ffn, h, scale=3.0 * h ** -0.5)
        sd[m + f"experts.{e}.w2.weight"] = rnd(h, toy.expert_ffn)
    for name, shape in (("gate_proj", (toy.shared_ffn, h)), ("up_proj", (toy.shared_ffn, h)),
                        ("down_proj", (h, toy.shared_ffn))):
        sd[m + f"shared_experts.{name}.weight"] = rnd(*shape, scale=3.0 * shape[-1] ** -0.5)


def gemma_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1.0)


def _rope(x: torch.Tensor, toy: ToyM3) -> torch.Tensor:
    """Rotate-half RoPE on the first rotary_dim channels of x [T, n, dim] at positions 0..T-1."""
    r = toy.rotary_dim
    # Angles, cos and sin in float32, as both M3's and Megatron's rotary embeddings make them.
    inv = 1.0 / (toy.theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    angles = torch.outer(torch.arange(x.shape[0], dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().double()[:, None], angles.sin().double()[:, None]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], -1)
    return torch.cat([rot * cos + half * sin, rest], -1)


def _msa_mask(sd, p: str, h: torch.Tensor, toy: ToyM3) -> torch.Tensor:
    """[kv_heads, T, T] keys each KV head's queries may attend (selected blocks, causal)."""
    t = h.shape[0]
    iq = (h @ sd[p + "self_attn.index_q_proj.weight"].T).view(t, toy.index_heads, toy.index_dim)
    ik = h @ sd[p + "self_attn.index_k_proj.weight"].T
    iq = _rope(gemma_rms(iq, sd[p + "self_attn.index_q_norm.weight"], toy.eps), toy)
    ik = _rope(gemma_rms(ik, sd[p + "self_attn.index_k_norm.weight"], toy.eps)[:, None], toy)[:, 0]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    blocks = torch.arange(t) // toy.block
    masks = []
    for head in range(toy.index_heads):
        scores = (iq[:, head] @ ik.T).masked_fill(~causal, float("-inf"))  # [T(q), T(k)]
        block_scores = torch.full((t, int(blocks.max()) + 1), float("-inf"), dtype=torch.float64)
        for b in range(block_scores.shape[1]):
            block_scores[:, b] = scores[:, blocks == b].max(-1).values
        own = blocks[:, None] == torch.arange(block_scores.shape[1])[None]
        ranked = block_scores.masked_fill(own, float("inf"))  # the own (local) block is forced
        chosen = torch.zeros_like(own)
        top = ranked.topk(min(toy.msa_topk, block_scores.shape[1]), -1).indices
        chosen.scatter_(1, top, True)
        chosen &= block_scores > float("-inf")  # never a block wholly in the future
        masks.append(chosen[:, blocks] & causal)
    return torch.stack(masks)


def _decoder_layer(sd: dict[str, torch.Tensor], p: str, x: torch.Tensor, moe: int, msa: int,
                   toy: ToyM3) -> torch.Tensor:
    """One decoder layer (prefix ``p``) on the residual stream ``x [T, hidden]``."""
    t, d = x.shape[0], toy.head_dim
    group = toy.heads // toy.kv_heads
    h = gemma_rms(x, sd[p + "input_layernorm.weight"], toy.eps)
    q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(t, toy.heads, d)
    k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(t, toy.kv_heads, d)
    v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(t, toy.kv_heads, d)
    q = _rope(gemma_rms(q, sd[p + "self_attn.q_norm.weight"], toy.eps), toy)
    k = _rope(gemma_rms(k, sd[p + "self_attn.k_norm.weight"], toy.eps), toy)
    allowed = (_msa_mask(sd, p, h, toy) if msa
               else torch.ones(t, t, dtype=torch.bool).tril().expand(toy.kv_heads, t, t))
    out = torch.empty(t, toy.heads, d, dtype=torch.float64)
    for head in range(toy.heads):
        g = head // group
        s = (q[:, head] @ k[:, g].T) / d ** 0.5
        out[:, head] = s.masked_fill(~allowed[g], float("-inf")).softmax(-1) @ v[:, g]
    x = x + out.reshape(t, -1) @ sd[p + "self_attn.o_proj.weight"].T
    h = gemma_rms(x, sd[p + "post_attention_layernorm.weight"], toy.eps)
    if not moe:
        act = swiglu_oai(h @ sd[p + "mlp.gate_proj.weight"].T,
                         h @ sd[p + "mlp.up_proj.weight"].T, toy.limit)
        return x + act @ sd[p + "mlp.down_proj.weight"].T
    m = p + "block_sparse_moe."
    # Routing arithmetic in float32, as M3's reference and Megatron's router both do it.
    scores = torch.sigmoid((h @ sd[m + "gate.weight"].double().T).float())
    chosen = (scores + sd[m + "e_score_correction_bias"]).topk(toy.topk, -1).indices
    weights = scores.gather(1, chosen)
    weights = (weights / weights.sum(-1, keepdim=True) * toy.scaling).double()
    routed = torch.zeros_like(x)
    for slot in range(toy.topk):
        for e in range(toy.experts):
            rows = chosen[:, slot] == e
            if rows.any():
                he = h[rows]
                act = swiglu_oai(he @ sd[m + f"experts.{e}.w1.weight"].T,
                                 he @ sd[m + f"experts.{e}.w3.weight"].T, toy.limit)
                routed[rows] += weights[rows, slot, None] * (
                    act @ sd[m + f"experts.{e}.w2.weight"].T)
    shared = swiglu_oai(h @ sd[m + "shared_experts.gate_proj.weight"].T,
                        h @ sd[m + "shared_experts.up_proj.weight"].T, toy.limit)
    return x + routed + shared @ sd[m + "shared_experts.down_proj.weight"].T


def hf_hidden(sd: dict[str, torch.Tensor], toy: ToyM3, tokens: torch.Tensor,
              root: str = "") -> torch.Tensor:
    """The final-normed hidden states [T, hidden] (float64) of one document ``tokens [T]``."""
    x = sd[f"{root}model.embed_tokens.weight"][tokens]
    for i, (moe, msa) in enumerate(zip(toy.moe_layers, toy.msa_layers, strict=True)):
        x = _decoder_layer(sd, f"{root}model.layers.{i}.", x, moe, msa, toy)
    return gemma_rms(x, sd[f"{root}model.norm.weight"], toy.eps)


def hf_forward(sd: dict[str, torch.Tensor], toy: ToyM3, tokens: torch.Tensor,
               root: str = "") -> torch.Tensor:
    """Logits [T, vocab] (float64) of one document ``tokens [T]``, from M3's names only."""
    return hf_hidden(sd, toy, tokens, root) @ sd[f"{root}lm_head.weight"].T


def hf_mtp_forward(sd: dict[str, torch.Tensor], toy: ToyM3, tokens: torch.Tensor,
                   root: str = "") -> torch.Tensor:
    """Logits [T, vocab] of MTP module 0 (token i + 2 at position i), from M3's names: the
    module combines position i's final-normed hidden state with the embedding of token i + 1
    (token 0 past the end, as Megatron rolls the ids), ``eh_proj(cat[enorm(e), hnorm(h)])``,
    runs its layer (the last layer's kind) and ``final_layernorm``, then the shared head."""
    p = f"{root}model.mtp.layers.0."
    hidden = hf_hidden(sd, toy, tokens, root)
    nxt = torch.cat([tokens[1:], tokens.new_zeros(1)])
    e = gemma_rms(sd[f"{root}model.embed_tokens.weight"][nxt], sd[p + "enorm.weight"], toy.eps)
    h = gemma_rms(hidden, sd[p + "hnorm.weight"], toy.eps)
    x = torch.cat([e, h], -1) @ sd[p + "eh_proj.weight"].T
    x = _decoder_layer(sd, p + "transformer_layer.", x, toy.moe_layers[-1], toy.msa_layers[-1],
                       toy)
    x = gemma_rms(x, sd[p + "final_layernorm.weight"], toy.eps)
    return x @ sd[f"{root}lm_head.weight"].T
