"""The float64 oracle of NaN/Inf containment (issue 29), shared by the CPU and GPU tests.

The rule (docs/MSA_SPEC.md): a non-finite key or value of token j, KV head g affects exactly
the queries that attend to it, i.e. the query rows of j's document at positions >= j's (and,
for sparse attention, whose selection for head g holds j's block), in the query heads of
group g. Every other output row equals attention without that key; every gradient that does
not involve it (dq of an unaffected row, dk/dv of a key no affected row attends) stays finite.

- :func:`visible_pairs`: bool [Hkv, Tq, T], which query attends which key;
- :func:`affected_rows`: bool [Tq, Hq], the rows a bad (token, KV head) reaches;
- :func:`clean_keys`: bool [T, Hkv], the keys whose dk/dv no affected row touches;
- :func:`contained_attention_f64`: attention in float64 in which a pair that is not visible
  never enters a product (so a non-finite input reaches exactly the rows that attend to it),
  differentiable (use it on finite inputs for the gradients of the unaffected rows).

A layout here is anything with ``token_documents`` and ``document_positions`` (an
``MSAMicrobatch``).
"""

from __future__ import annotations

import math

import torch

__all__ = ["affected_rows", "clean_keys", "contained_attention_f64", "visible_pairs"]


def visible_pairs(msa, block_size: int, q2k: torch.Tensor | None = None,
                  queries: torch.Tensor | None = None, kv_heads: int = 1) -> torch.Tensor:
    """bool [Hkv, Tq, T]: query row i attends key j (same document, j's position <= i's and,
    with ``q2k``, j's document-local block in the query's selection for that KV head).

    Args:
        msa: the layout (host tensors).
        block_size: the MSA block size.
        q2k: optional int [Hkv, Tq, top_k] selected document-local block ids (-1 = none; any
            order, duplicates allowed); None = dense causal attention within documents.
        queries: optional int64 [Tq] global compact rows of the query tokens; None = every token.
        kv_heads: Hkv when ``q2k`` is None.

    Returns:
        bool [Hkv, Tq, T] on the host.
    """
    docs = msa.token_documents.cpu().long()
    pos = msa.document_positions.cpu().long()
    rows = torch.arange(docs.shape[0]) if queries is None else queries.cpu().long()
    causal = (docs[rows][:, None] == docs[None, :]) & (pos[None, :] <= pos[rows][:, None])
    if q2k is None:
        return causal[None].expand(kv_heads, -1, -1).clone()
    key_block = (pos // block_size)[None, None, None, :]  # [1, 1, 1, T]
    chosen = q2k.cpu().long()[..., None]  # [Hkv, Tq, K, 1]
    selected = ((chosen == key_block) & (chosen >= 0)).any(dim=2)  # [Hkv, Tq, T]
    return causal[None] & selected


def affected_rows(visible: torch.Tensor, token: int, kv_head: int, q_heads: int) -> torch.Tensor:
    """bool [Tq, Hq]: the (query row, query head) pairs that attend key ``token`` of KV head
    ``kv_head`` (query head h reads KV head h // (Hq / Hkv)).

    Args:
        visible: bool [Hkv, Tq, T] from :func:`visible_pairs`.
        token: compact row of the bad key/value.
        kv_head: its KV head.
        q_heads: Hq.
    """
    hkv, tq, _ = visible.shape
    group = q_heads // hkv
    out = torch.zeros(tq, q_heads, dtype=torch.bool)
    out[:, kv_head * group:(kv_head + 1) * group] = visible[kv_head, :, token, None]
    return out


def clean_keys(visible: torch.Tensor, affected: torch.Tensor, token: int,
               kv_head: int) -> torch.Tensor:
    """bool [T, Hkv]: the keys whose dk and dv involve neither the bad (token, KV head) nor an
    affected query row: no affected row of the head's group attends them.

    Args:
        visible: bool [Hkv, Tq, T] from :func:`visible_pairs`.
        affected: bool [Tq, Hq] from :func:`affected_rows`.
        token, kv_head: the bad key/value.
    """
    hkv = visible.shape[0]
    group = affected.shape[1] // hkv
    rows = affected.view(affected.shape[0], hkv, group).any(-1)  # [Tq, Hkv]
    touched = (visible & rows.t()[:, :, None]).any(1)  # [Hkv, T]
    clean = ~touched.t()
    clean[token, kv_head] = False
    return clean


def contained_attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            visible: torch.Tensor, scale: float | None = None):
    """Attention in float64 where only visible pairs enter a product.

    ``out(i, h) = sum_{j visible} softmax_j(q(i, h) . k(j, g) * scale) v(j, g)``, g = h // G.
    A score q . k involves one key only, so Q K^T is exact per pair; the sum over keys is
    where a hidden pair would meet a non-finite value (0 * NaN), so P V runs on V with its
    non-finite rows zeroed and each such row is added back only where it is visible.
    Differentiable (through finite inputs). Memory O(Tq x T) per head.

    Args:
        q: [Tq, Hq, d] float; k, v: [T, Hkv, d] float.
        visible: bool [Hkv, Tq, T] (:func:`visible_pairs`).
        scale: softmax scale, default 1 / sqrt(d).

    Returns:
        ``(out float64 [Tq, Hq, d], lse float64 [Hq, Tq])``; a row with no visible key gets 0
        and -inf.
    """
    tq, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    outs, lses = [], []
    for h in range(hq):
        g = h // group
        vis = visible[g].to(q.device)  # [Tq, T]
        qh, kh, vh = q[:, h].double(), k[:, g].double(), v[:, g].double()
        sc = (qh @ kh.t() * scale).masked_fill(~vis, -math.inf)
        lse = torch.logsumexp(sc, dim=-1)  # -inf for a row without a visible key
        shift = torch.where(torch.isneginf(lse), 0.0, lse)
        pr = torch.where(vis, torch.exp(sc - shift[:, None]), 0.0)
        bad = ~torch.isfinite(vh).all(-1)  # [T]
        out = pr @ vh.masked_fill(bad[:, None], 0.0)
        for j in bad.nonzero().flatten().tolist():
            out = out + torch.where(vis[:, j, None], pr[:, j, None] * vh[j], 0.0)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs, 1), torch.stack(lses, 0)
