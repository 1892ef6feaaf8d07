"""The benchmark's cases (production topology), their fresh random inputs and FLOP counts."""

from __future__ import annotations

import torch

from nemo_msa.layout import MSAMicrobatch
from nemo_msa.testing.packs import document_map_from_lengths

#: The MiniMax-M3 topology (MSA_SPEC.md): query / KV heads, head dim, index heads and dim.
HQ, HKV, D, HI, DI = 64, 4, 128, 4, 128
#: Block size, blocks per query, forced sink and local blocks.
BS, TOPK, INIT, LOCAL = 128, 16, 0, 1


def make_case(name, rows, seq_len, device, block_size=BS):
    """A case of ``rows`` (document lengths per batch row, padded to ``seq_len``) and its
    layout: ``{"name", "rows", "seq_len", "msa", "ids"}``."""
    ids = document_map_from_lengths(rows, seq_len, device)
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=block_size, init_blocks=INIT,
                              local_blocks=LOCAL)
    return {"name": name, "rows": rows, "seq_len": seq_len, "msa": msa, "ids": ids}


def packed_rows(total, lo, hi, per_row, gen):
    """Rows of ``per_row`` slots filled with documents of lo..hi tokens; some padding left."""
    rows, left = [], total
    while left > 0:
        docs, room = [], min(per_row, left)
        while room >= lo:
            n = int(torch.randint(lo, min(hi, room) + 1, (1,), generator=gen))
            docs.append(n)
            room -= n
        rows.append(docs)
        left -= per_row
    return rows


def coherent_index_q(t, device, gen, hi=HI, di=DI):
    """Index queries like a trained indexer's: neighbouring queries pick mostly the same blocks.
    One random index query per 128-token block of the compact order, plus 5% noise."""
    base = torch.randn((t // BS + 1, hi, di), generator=gen, device=device)
    return (base[torch.arange(t, device=device) // BS]
            + 0.05 * torch.randn((t, hi, di), generator=gen, device=device)).to(torch.bfloat16)


def fresh_inputs(t, device, gen, coherent=False, hq=HQ, hkv=HKV, d=D, hi=HI, di=DI):
    """Fresh bf16 inputs of ``t`` tokens: index q/k, q, k, v and the output gradient."""
    def rnd(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(
            torch.bfloat16)

    iq = coherent_index_q(t, device, gen, hi, di) if coherent else rnd(t, hi, di)
    return {"iq": iq, "ik": rnd(t, di), "q": rnd(t, hq, d), "k": rnd(t, hkv, d),
            "v": rnd(t, hkv, d), "do": rnd(t, hq, d)}


def selected_flops(q2k, msa, grp, d, bs=BS):
    """Forward FLOPs over the selected, causally visible keys (QK^T and PV, 2 each per MAC)."""
    pos = msa.document_positions.long()[None, :, None]
    b = q2k.long()
    visible = (pos - b * bs + 1).clamp(0, bs)
    visible = torch.where(b >= 0, visible, torch.zeros_like(visible))
    return float(visible.sum().item()) * grp * d * 4


def selection_flops(msa, hi, di):
    """The selection's q.k FLOPs over every causal (query, key) pair of each document."""
    cu = msa.cu_seqlens.long().cpu()
    n = (cu[1:] - cu[:-1]).double()
    return float((n * (n + 1) / 2).sum()) * 2 * hi * di


def dense_flops(rows, seq_len, hq, d):
    """Dense causal attention FLOPs over each whole padded row (it knows no documents)."""
    return len(rows) * 2.0 * seq_len * seq_len * d * hq
