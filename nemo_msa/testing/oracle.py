"""Independent references for the MSA kernels, shared by the tests and benchmarks/bench_msa.py.

Written from MSA_SPEC.md, not from the package's kernels or reference backend:

- :func:`select_rows_f64` / :func:`attention_rows_f64`: float64 selection and attention (with
  dq, and the rows' share of dk / dv) for a subset of query tokens, on any device (the benchmark
  and the long-sequence GPU tests check large cases with them);
- :func:`block_scores_f64`, :func:`select_f64`, :func:`attention_f64`,
  :func:`attention_grads_f64`: whole-layout float64 references for small cases;
- :func:`tile_unions_reference`: the union lists of the hybrid kernels by torch sorts.

A layout here is anything with ``cu_seqlens``, ``token_documents``, ``document_positions`` and
``num_tokens`` (an ``MSAMicrobatch`` or the tests' stand-in).
"""

from __future__ import annotations

import math

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64; NaN when ``x`` holds a non-finite value."""
    x = x.double()
    ref = ref.double()
    if not torch.isfinite(x).all():
        return float("nan")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def doc_spans(msa) -> list[tuple[int, int]]:
    """``(start, end)`` compact rows of each document."""
    cu = msa.cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:], strict=True))


# ----------------------------------------------------------------------------- whole layouts


def block_scores_f64(index_q, index_k, msa, block_size):
    """Per document: float64 scores [H, n, nblk] (-inf where no visible key / past own block);
    a NaN among a block's visible q.k makes its score NaN (``amax``)."""
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
        vis = torch.nn.functional.pad(causal, (0, pad), value=False).view(n, nblk, block_size)
        sc = torch.where(vis[None], sc, torch.tensor(float("-inf"), dtype=sc.dtype))
        out.append(sc.amax(-1))
    return out


def select_f64(index_q, index_k, msa, *, top_k, init_blocks, local_blocks, block_size):
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


def attention_f64(q, k, v, q2k, msa, scale, block_size):
    """Dense masked attention in float64: out [T, Hq, d] fp64, lse [Hq, T] fp64.

    Query (p, hq) sees key j of its document iff j <= p and block j // bs is in q2k[hq // G, p].
    Rows with no visible key get out = 0 and lse = -inf.
    """
    hq = q.shape[1]
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
        empty = ~mask.any(-1, keepdim=True)
        pr = torch.exp(sc - torch.where(empty, 0.0, l_[..., None]))
        pr = torch.where(empty | ~mask, 0.0, pr)
        outs.append(torch.einsum("hpj,hjd->hpd", pr, vd).transpose(0, 1))
        lses.append(l_)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def attention_grads_f64(q, k, v, q2k, msa, scale, block_size, dout):
    """float64 out, lse and (dq, dk, dv) by autograd through :func:`attention_f64`."""
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    out, lse = attention_f64(qd, kd, vd, q2k, msa, scale, block_size)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


# ----------------------------------------------------------------------------- query subsets


def select_rows_f64(iq, ik, msa, rows, *, top_k, init_blocks, local_blocks, block_size,
                    local=None):
    """float64 canonical selection for the query tokens ``rows`` -> int32 [H, S, top_k].

    Args:
        iq: [Tq, H, d] index queries; ik: [T, d] the index keys of every token of ``msa``.
        rows: int64 [S] the tokens' global compact rows (the layout's).
        local: int64 [S] their rows of ``iq`` (a query subset's local rows); None: ``rows``.
    """
    local = rows if local is None else local
    cu = msa.cu_seqlens.long()
    doc = msa.token_documents.long()[rows]
    pos = msa.document_positions.long()[rows]
    h = iq.shape[1]
    bs = block_size
    out = torch.full((h, rows.numel(), top_k), -1, dtype=torch.int32, device=iq.device)
    for i in range(rows.numel()):  # S is small; one float64 product per row
        s, p = int(cu[doc[i]]), int(pos[i])
        o = p // bs
        keys = ik[s:s + p + 1].double()
        sc = iq[local[i]].double() @ keys.t()  # [H, p+1]
        nblk = o + 1
        padded = torch.full((h, nblk * bs), float("-inf"), dtype=torch.float64,
                            device=iq.device)
        padded[:, : p + 1] = sc
        bsc = padded.view(h, nblk, bs).amax(-1)
        ids = torch.arange(nblk, device=iq.device)
        forced = (ids < init_blocks) | (ids > o - local_blocks)
        val = torch.where(torch.isnan(bsc), -1e308, bsc)
        val = torch.where(forced[None], float("inf"), val)
        order = torch.sort(val, dim=-1, descending=True, stable=True).indices[:, :top_k]
        chosen = torch.sort(order, dim=-1).values.to(torch.int32)
        out[:, i, : chosen.shape[1]] = chosen
    return out


def attention_rows_f64(q, k, v, do, q2k, msa, rows, scale, block_size, *, local=None,
                       kv_grads=False, chunk=None):
    """float64 out [S, Hq, d], lse [Hq, S], dq [S, Hq, d] for the query tokens ``rows``.

    Args:
        q, do: [Tq, Hq, d]; k, v: [T, Hkv, d] (every token of ``msa``); q2k: int32
            [Hkv, Tq, top_k].
        rows: int64 [S] the tokens' global compact rows (the layout's).
        local: int64 [S] their rows of q, do and q2k (a query subset's local rows); None:
            ``rows``.
        kv_grads: also return ``(dk, dv)``, float64 [T, Hkv, d]: the gradient of
            ``sum(out * do)`` over these rows only, so a key block's whole dk / dv where
            ``rows`` holds every query that selected the block.
        chunk: query tokens per float64 product (None: all at once); each gathers
            Hkv x chunk x top_k x block_size x d doubles of K and of V.

    Returns:
        ``(out, lse, dq)``, then ``dk, dv`` with ``kv_grads``.
    """
    local = rows if local is None else local
    chunk = max(1, rows.numel()) if chunk is None else int(chunk)
    dkv = (torch.zeros(k.shape, dtype=torch.float64, device=k.device),
           torch.zeros(v.shape, dtype=torch.float64, device=v.device)) if kv_grads else None
    parts = [_attention_rows_part(q, k, v, do, q2k, msa, rows[lo:lo + chunk],
                                  local[lo:lo + chunk], scale, block_size, dkv)
             for lo in range(0, rows.numel(), chunk)]
    out, lse, dq = (torch.cat([part[i] for part in parts], dim) for i, dim in
                    ((0, 0), (1, 1), (2, 0)))
    return (out, lse, dq) + (dkv if kv_grads else ())


def _attention_rows_part(q, k, v, do, q2k, msa, rows, local, scale, bs, dkv):
    """:func:`attention_rows_f64` for one chunk of rows; adds the chunk's dk / dv to ``dkv``
    (a pair of float64 [T, Hkv, d] tensors) unless it is None."""
    cu = msa.cu_seqlens.long()
    doc = msa.token_documents.long()[rows]
    pos = msa.document_positions.long()[rows]
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    grp = hq // hkv
    sel = q2k[:, local].long()  # [Hkv, S, K]
    j = sel[..., None] * bs + torch.arange(bs, device=q.device)  # [Hkv, S, K, bs]
    vis = (sel[..., None] >= 0) & (j <= pos[None, :, None, None])
    krow = (cu[doc][None, :, None, None] + j).clamp(0, k.shape[0] - 1)
    gidx = torch.arange(hkv, device=q.device)[:, None, None, None]
    kk = k[krow, gidx].double().flatten(2, 3).requires_grad_(dkv is not None)  # [Hkv, S, K*bs, d]
    vv = v[krow, gidx].double().flatten(2, 3).requires_grad_(dkv is not None)
    vis = vis.flatten(2, 3)
    qs = q[local].double().view(-1, hkv, grp, d).permute(1, 0, 2, 3)
    qs = qs.detach().requires_grad_(True)  # [Hkv, S, G, d]
    sc = torch.einsum("hsgd,hsjd->hsgj", qs, kk) * scale
    sc = sc.masked_fill(~vis[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(sc, -1)
    pr = torch.exp(sc - lse[..., None])
    o = torch.einsum("hsgj,hsjd->hsgd", pr, vv)
    dos = do[local].double().view(-1, hkv, grp, d).permute(1, 0, 2, 3)
    (o * dos).sum().backward()
    if dkv is not None:
        # The gathered keys' gradients, added to their (token, KV head) rows.
        flat = (krow * hkv + gidx).reshape(-1)
        for grad, gathered in zip(dkv, (kk, vv), strict=True):
            grad.view(-1, d).index_add_(0, flat, gathered.grad.reshape(-1, d))
    out = o.detach().permute(1, 0, 2, 3).reshape(rows.numel(), hq, -1)
    dq = qs.grad.permute(1, 0, 2, 3).reshape(rows.numel(), hq, -1)
    lse = lse.detach().permute(0, 2, 1).reshape(hq, rows.numel())
    return out, lse, dq


# ----------------------------------------------------------------------------- union lists

#: Tiles per chunk of :func:`tile_unions_reference`: bounds its temporaries whatever the length.
UNION_CHUNK_TILES = 8192


def tile_unions_reference(q2k: torch.Tensor, view, qt: int,
                          chunk_tiles: int = UNION_CHUNK_TILES):
    """The union lists of :func:`nemo_msa.attention.triton_union.tile_unions` by torch sorts.

    Args:
        q2k: int32 [Hkv, T, top_k] document-local block ids, -1 for none.
        view: the layout's kernel view (``KernelLayout``).
        qt: tokens per tile; divides ``view.block_size``.
        chunk_tiles: tiles per chunk.

    Returns:
        ``(union int32 [Hkv, tiles, qt * top_k], count int32 [Hkv, tiles])``, as the kernel.
    """
    q2k = q2k.contiguous()
    hkv, t, top_k = q2k.shape
    bs = view.block_size
    sub = bs // qt
    tiles = view.num_blocks_bound * sub
    dev = q2k.device
    width = qt * top_k
    big = torch.iinfo(torch.int32).max
    union = torch.empty((hkv, tiles, width), dtype=torch.int32, device=dev)
    count = torch.empty((hkv, tiles), dtype=torch.int32, device=dev)
    cu = view.cu_seqlens.long()
    for lo in range(0, tiles, chunk_tiles):
        hi = min(tiles, lo + chunk_tiles)
        tid = torch.arange(lo, hi, device=dev)
        blk = tid // sub
        doc = view.block_doc[blk].long()
        docc = doc.clamp(min=0)
        start = cu[docc]
        length = cu[docc + 1] - start
        pos = (view.block_local[blk].long() * bs + (tid % sub) * qt)[:, None] + torch.arange(
            qt, device=dev)
        valid = (doc >= 0)[:, None] & (pos < length[:, None])
        tok = torch.where(valid, start[:, None] + pos, 0).clamp(max=max(t - 1, 0))
        lists = q2k[:, tok.reshape(-1)].view(hkv, hi - lo, qt, top_k)
        keys = torch.where(valid[None, :, :, None] & (lists >= 0), lists, big)
        srt = torch.sort(keys.view(hkv, hi - lo, width), dim=-1).values
        dup = torch.zeros_like(srt, dtype=torch.bool)
        dup[..., 1:] = srt[..., 1:] == srt[..., :-1]
        srt = torch.sort(srt.masked_fill_(dup, big), dim=-1).values
        real = srt != big
        count[:, lo:hi] = real.sum(-1)
        union[:, lo:hi] = srt.masked_fill_(~real, 0)
    return union, count
