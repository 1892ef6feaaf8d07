"""Shared helpers of the Triton kernel tests: a small layout stand-in and float64 references.

The references here are deliberately independent of the package's own reference backend: dense
masked attention in float64 and brute-force block scores, written from MSA_SPEC.md.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

#: Where the kernels run in these tests: compiled on a CUDA GPU, else under the interpreter on
#: the host. Inputs and float64 references are built on the host either way (same seeds, same
#: cases); only the kernel calls see device tensors.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_kernel_device(*tensors: torch.Tensor):
    """The tensors moved to :data:`KERNEL_DEVICE` (a tuple, or one tensor for one argument)."""
    moved = tuple(x.to(KERNEL_DEVICE) for x in tensors)
    return moved[0] if len(moved) == 1 else moved


def layout_on_kernel_device(msa):
    """A copy of a :func:`make_layout` namespace with its tensors on :data:`KERNEL_DEVICE`."""
    fields = {name: value.to(KERNEL_DEVICE) if isinstance(value, torch.Tensor) else value
              for name, value in vars(msa).items()}
    return SimpleNamespace(**fields)


def make_layout(rows: list[list[int]], seq_len: int, block_size: int, device="cpu"):
    """Builds the layout fields the kernels read, for documents packed into padded rows.

    Args:
        rows: per batch row, the document lengths in order (the rest of the row is padding).
        seq_len: padded row length.
        block_size: MSA block size.
        device: where the tensors live.

    Returns:
        A namespace with ``cu_seqlens`` int32 [D+1], ``token_documents`` int32 [T],
        ``document_positions`` int32 [T], ``token_rows`` int64 [T], host ints ``num_tokens``,
        ``num_documents``, ``max_seqlen``, ``block_size``, ``batch_size``, ``seq_len``.
    """
    lengths, token_rows = [], []
    for r, docs in enumerate(rows):
        assert sum(docs) <= seq_len
        off = 0
        for n in docs:
            lengths.append(n)
            token_rows.extend(range(r * seq_len + off, r * seq_len + off + n))
            off += n
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    docs = [d for d, n in enumerate(lengths) for _ in range(n)]
    pos = [p for n in lengths for p in range(n)]
    return SimpleNamespace(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        token_documents=torch.tensor(docs, dtype=torch.int32, device=device),
        document_positions=torch.tensor(pos, dtype=torch.int32, device=device),
        token_rows=torch.tensor(token_rows, dtype=torch.int64, device=device),
        num_tokens=cu[-1], num_documents=len(lengths), max_seqlen=max(lengths),
        block_size=block_size, batch_size=len(rows), seq_len=seq_len,
    )


def doc_spans(msa):
    cu = msa.cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:], strict=True))


def block_scores_f64(index_q, index_k, msa, block_size):
    """Per document: float64 scores [H, n, nblk] (-inf where no visible key / past own block)."""
    out = []
    for s, e in doc_spans(msa):
        q = index_q[s:e].double()  # [n, H, d]
        k = index_k[s:e].double()  # [n, d]
        n = e - s
        nblk = -(-n // block_size)
        qk = torch.einsum("phd,jd->hpj", q, k)
        causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
        qk = qk.masked_fill(~causal, float("-inf"))
        pad = nblk * block_size - n
        qk = torch.nn.functional.pad(qk, (0, pad), value=float("-inf"))
        sc = qk.view(qk.shape[0], n, nblk, block_size)
        # amax propagates NaN like the contract's "max over visible keys".
        vis = torch.nn.functional.pad(causal, (0, pad), value=False).view(n, nblk, block_size)
        sc = torch.where(vis[None], sc, torch.tensor(float("-inf"), dtype=sc.dtype))
        out.append(sc.amax(-1))
    return out


def select_reference(index_q, index_k, msa, *, top_k, init_blocks, local_blocks, block_size):
    """Brute-force canonical selection: int32 [H, T, top_k]; also returns the scores."""
    t, h, _ = index_q.shape
    res = torch.full((h, t, top_k), -1, dtype=torch.int32)
    all_scores = block_scores_f64(index_q, index_k, msa, block_size)
    for (s, _e), scores in zip(doc_spans(msa), all_scores, strict=True):
        for hh in range(h):
            for p in range(scores.shape[1]):
                o = p // block_size
                cands = []
                for b in range(o + 1):
                    v = scores[hh, p, b].item()
                    forced = b < init_blocks or b > o - local_blocks
                    nan = math.isnan(v)
                    cands.append((not forced, nan, -v if not nan else 0.0, b))
                cands.sort()
                chosen = sorted(c[3] for c in cands[:top_k])
                res[hh, s + p, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return res, all_scores


def attention_reference(q, k, v, q2k, msa, scale, block_size):
    """Dense masked attention in float64: out [T, Hq, d] fp64, lse [Hq, T] fp64.

    Query (p, hq) sees key j of its document iff j <= p and block j // bs is in q2k[hq // G, p].
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    grp = hq // hkv
    outs, lses = [], []
    for s, e in doc_spans(msa):
        n = e - s
        nblk = -(-n // block_size)
        sel = torch.zeros((hkv, n, nblk + 1), dtype=torch.bool)
        qk_idx = q2k[:, s:e].long().clamp(min=-1)
        qk_idx = torch.where(qk_idx < 0, nblk, qk_idx.clamp(max=nblk))
        sel.scatter_(2, qk_idx, True)
        sel = sel[:, :, :nblk]
        keyblk = torch.arange(n) // block_size
        mask = sel[:, :, keyblk]  # [hkv, n, n]
        mask &= torch.arange(n)[None, None, :] <= torch.arange(n)[None, :, None]
        mask = mask.repeat_interleave(grp, dim=0)  # [hq, n, n]
        qd = q[s:e].double().transpose(0, 1)
        kd = k[s:e].double().transpose(0, 1).repeat_interleave(grp, dim=0)
        vd = v[s:e].double().transpose(0, 1).repeat_interleave(grp, dim=0)
        sc = torch.einsum("hpd,hjd->hpj", qd, kd) * scale
        sc = sc.masked_fill(~mask, float("-inf"))
        l_ = torch.logsumexp(sc, -1)
        # Rows with no visible key: p = 0 and lse = -inf, as the op contract says.
        empty = ~mask.any(-1, keepdim=True)
        pr = torch.exp(sc - torch.where(empty, 0.0, l_[..., None]))
        pr = torch.where(empty | ~mask, 0.0, pr)
        outs.append(torch.einsum("hpj,hjd->hpd", pr, vd).transpose(0, 1))
        lses.append(l_)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def rel_err(x, ref):
    x = x.double()
    ref = ref.double()
    assert torch.isfinite(x).all(), "non-finite values in the kernel output"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def random_q2k(msa, hkv, top_k, block_size, gen, drop_own=False):
    """Random canonical-looking q2k int32 [hkv, T, top_k]: own block + random earlier ones.

    With ``drop_own`` some rows leave out their own block (legal input: the kernels must then
    mask by selection alone), and a few rows select nothing at all.
    """
    t = msa.num_tokens
    pos = msa.document_positions.tolist()
    out = torch.full((hkv, t, top_k), -1, dtype=torch.int32)
    for g in range(hkv):
        for i in range(t):
            o = pos[i] // block_size
            others = torch.randperm(o, generator=gen)[: top_k - 1].tolist() if o else []
            chosen = others + [o]
            if drop_own and i % 7 == 3:
                chosen = others
            if drop_own and i % 11 == 5:
                chosen = []
            chosen = sorted(chosen)
            out[g, i, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def attention_reference_grads(q, k, v, q2k, msa, scale, block_size, dout):
    """float64 out, lse and (dq, dk, dv) by autograd through :func:`attention_reference`."""
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    out, lse = attention_reference(qd, kd, vd, q2k, msa, scale, block_size)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad
