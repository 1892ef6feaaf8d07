"""poolside's ``flash-msa`` (PyPI 0.1.1, CuTeDSL MSA training kernels) beside ours, same inputs.

The peer's public op is ``flash_msa.flash_msa_func(q_proxy, k_proxy, q, k, v, top_k, scale) ->
(out [B, S, H*D], kl_loss)`` on (B, H, S, D) bf16 tensors, one sequence per batch row (no
documents), D = 128, 128-token blocks, ``top_k`` in tokens (a multiple of 128, at most 4096). This
module converts our compact [T, H, D] layout (one document per row: compact row ``b * S + s``)
to its layout, and holds the float64 references that check both sides on the same inputs.

What each side computes (read from flash-msa 0.1.1's code, ``flash_msa.py``,
``msa_select_cutedsl.py``, ``sparse_flash_varlen.py``, ``msa_backward_cutedsl.py`` and its eager
model ``tests/testing_model.py``):

- selection: the same rule as ours at MiniMax-M3's settings. Per proxy (= our index) head and
  query, block score = max over the block's causally visible keys of ``scale * q_proxy . k_proxy``
  (ours: the unscaled max; the same order), the query's own block forced (score +inf), no sink
  block forced (ours: ``init_blocks=0, local_blocks=1``), top ``top_k / 128`` blocks, ties to the
  lower block id, fewer candidates than slots leave sentinel ids (= number of blocks). Two
  differences: the peer rounds each scaled score to bf16 before the max (ours ranks fp32 scores),
  so near ties can pick different blocks; its ids are ordered by score, ours ascending with -1
  padding (:func:`flash_ids_to_q2k` converts). Proxy head p serves query heads
  ``p * H / Hp .. (p + 1) * H / Hp - 1``, as our index head h serves KV head h (Hp = Hkv here).
- attention: softmax over the selected blocks' keys, causal inside the own block; the same
  function as ours given the same blocks (its local block by FlashAttention-4 varlen, earlier
  blocks by paged varlen calls merged on the host-driven metadata of a CUDA extension that
  ``torch.utils.cpp_extension.load`` JIT-compiles with nvcc on first use).
- indexer (proxy) loss, the main difference: the peer's is token-level, ours block-level.
  Peer: ``mean_{b, p, t} KL(T || softmax(scale * q_proxy . k_proxy))`` over the selected,
  causally visible key *tokens*, the teacher T the group's main attention probabilities averaged
  over its query heads; its gradient reaches every selected key of q_proxy / k_proxy. Ours
  (``msa_indexer_loss_type: sparse``): ``mean_{t, h} KL(P || softmax(max-score / sqrt(d_idx)))``
  over the selected *blocks*, P the main attention mass per block; its gradient reaches only each
  block's argmax key. The peer returns ``kl_loss`` as a zero placeholder (no value): the KL exists
  only as the gradient its backward adds to q_proxy / k_proxy (scaled by kl_loss's upstream
  gradient), so the loss values cannot be compared; :func:`peer_kl_grad_rows_f64` is a float64
  reference of that gradient, which checks this reading of the peer.
- cost model: the peer's forward synchronizes with the host (task counts, remote metadata copied
  to the CPU), and its backward kernel is compiled per number of reverse-index tasks, which
  depends on the selection, so a new selection can mean a new JIT compile (timed separately as
  the first call per input set).

Proxy dims: the peer needs 128-dim proxy heads. Our index heads are 128-dim at MiniMax-M3's shape;
a narrower index head is zero-padded to 128 (scores unchanged), a wider one refused.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import torch
from msa_bench.peer_steps import import_site_modules, peer_table

#: The peer's fixed block size and head dim, and its largest top-k in blocks.
PEER_BLOCK, PEER_DIM, PEER_MAX_BLOCKS = 128, 128, 32

#: The peer's modules the run needs: the op, its CuTeDSL kernels (cutlass, cuda.bindings), its
#: backward, and FlashAttention-4's CuTe interface (imported lazily by the peer at first call).
PEER_MODULES = ("flash_msa", "flash_msa.msa_select_cutedsl", "flash_msa.msa_backward_cutedsl",
                "flash_msa.sparse_flash_varlen", "flash_attn.cute.interface")


class PeerImportError(RuntimeError):
    """flash-msa or one of its dependencies cannot be imported; ``missing`` names the module."""

    def __init__(self, missing: str, detail: str):
        self.missing = missing
        super().__init__(
            f"cannot import flash-msa: {detail} (missing module: {missing}; install the wheels "
            "listed in docs/adr/0029-flash-msa-peer.md and pass their --target directory as "
            "--site)"
        )


def import_peer(site_dirs=()):
    """Imports flash-msa and every module its run needs, after adding ``site_dirs`` with
    ``site.addsitedir`` (a ``pip install --target`` directory: its ``.pth`` files, which make
    ``cutlass`` importable, are processed only that way).

    Returns:
        the first of :data:`PEER_MODULES` (the ``flash_msa`` module).

    Raises:
        PeerImportError: naming the first module that cannot be imported.
    """
    import_site_modules(site_dirs, PEER_MODULES, PeerImportError)
    return importlib.import_module(PEER_MODULES[0])


def prepare_extension_build(candidates=("/usr/local/cuda",)) -> dict:
    """Makes flash-msa's JIT-compiled CUDA extension (``torch.utils.cpp_extension.load`` of its
    ``csrc/reverse_index_cuda.cu``) buildable where torch's guesses fall short; returns what it
    set.

    - CUDA_HOME: torch takes the parent of the ``bin/`` holding the first ``nvcc`` on PATH; where
      that is a wrapper script (``/usr/local/bin/nvcc`` on this project's CPU machine) the guess
      has no headers. The first of ``$CUDA_HOME``, ``$CUDA_PATH``, torch's guess and
      ``candidates`` with ``include/cuda_runtime.h`` and ``bin/nvcc`` is used.
    - Headers: ATen's CUDAContext.h includes cusparse.h / cublas_v2.h / cusolverDn.h; a toolkit
      installed without the math libraries' headers gets the include directories of torch's pip
      CUDA wheels (``nvidia/*/include``) on CPLUS_INCLUDE_PATH, searched after the toolkit's.
    """
    import os

    import torch.utils.cpp_extension as cpp_ext

    done = {}
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_ext.CUDA_HOME,
             *candidates]
    home = next((h for h in homes if h and Path(h, "include", "cuda_runtime.h").is_file()
                 and Path(h, "bin", "nvcc").is_file()), None)
    if home is not None and home != cpp_ext.CUDA_HOME:
        cpp_ext.CUDA_HOME = home  # read by load() at call time
        os.environ["CUDA_HOME"] = home
        done["cuda_home"] = home
    if not Path(home or cpp_ext.CUDA_HOME or "/", "include", "cusparse.h").is_file():
        try:
            import nvidia
        except ImportError:
            return done
        dirs = sorted(str(p) for base in nvidia.__path__ for p in Path(base).glob("*/include")
                      if (p / "cusparse.h").is_file() or (p / "cublas_v2.h").is_file())
        if dirs:
            old = [d for d in os.environ.get("CPLUS_INCLUDE_PATH", "").split(os.pathsep) if d]
            os.environ["CPLUS_INCLUDE_PATH"] = os.pathsep.join(old + dirs)
            done["cplus_include_path"] = dirs
    return done


# ------------------------------------------------------------------------------- layouts


def to_bhsd(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Compact tokens, one document per row, to the peer's layout.

    Args:
        x: [T, H, D] (or [T, D]: one head) with T = batch * S, compact row ``b * S + s``.
        batch: rows B.

    Returns:
        contiguous (B, H, S, D) (H = 1 for a [T, D] input), x's dtype.
    """
    if x.dim() == 2:
        x = x[:, None, :]
    t, h, d = x.shape
    if t % batch:
        raise ValueError(f"tokens={t} is not a multiple of batch={batch} (one document per row)")
    return x.view(batch, t // batch, h, d).transpose(1, 2).contiguous()


def from_bhsd(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> compact [B * S, H, D] (inverse of :func:`to_bhsd`)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def peer_out_to_thd(out: torch.Tensor, heads: int) -> torch.Tensor:
    """The peer's output (B, S, H * D) (head-major inside a token) -> compact [B * S, H, D]."""
    b, s, hd = out.shape
    if hd % heads:
        raise ValueError(f"output width {hd} is not a multiple of heads={heads}")
    return out.reshape(b * s, heads, hd // heads)


def proxy_tensors(iq: torch.Tensor, ik: torch.Tensor, batch: int, dim: int = PEER_DIM):
    """Our index q [T, Hi, di] and shared index k [T, di] as the peer's proxies
    (B, Hi, S, dim) and (B, 1, S, dim); di < dim is zero-padded (every q.k unchanged).

    Raises:
        ValueError: di > dim (the peer's proxy heads are exactly 128-dim).
    """
    di = iq.shape[-1]
    if di > dim or ik.shape[-1] != di:
        raise ValueError(f"index head dim {di} (index_k {ik.shape[-1]}): the peer needs proxy "
                         f"heads of exactly {dim}; a narrower one is zero-padded")
    if di < dim:
        iq = torch.nn.functional.pad(iq, (0, dim - di))
        ik = torch.nn.functional.pad(ik, (0, dim - di))
    return to_bhsd(iq, batch), to_bhsd(ik, batch)


def peer_top_k(top_k_blocks: int, block_size: int) -> int:
    """Our top-k (blocks) as the peer's ``top_k`` (tokens).

    Raises:
        ValueError: a block size other than the peer's 128, or more than 32 blocks.
    """
    if block_size != PEER_BLOCK:
        raise ValueError(f"block_size={block_size}; flash-msa's blocks are {PEER_BLOCK} tokens")
    if not 1 <= top_k_blocks <= PEER_MAX_BLOCKS:
        raise ValueError(f"top_k={top_k_blocks} blocks; flash-msa takes 1..{PEER_MAX_BLOCKS}")
    return top_k_blocks * PEER_BLOCK


def flash_ids_to_q2k(block_indices: torch.Tensor) -> torch.Tensor:
    """The peer's selection (B, Hp, S, Kb) int32 (score order, sentinel ids >= S / 128 in unused
    slots) -> our canonical q2k int32 [Hp, B * S, Kb]: ascending row-local (= document-local)
    block ids, -1 padding at the tail."""
    b, hp, s, kb = block_indices.shape
    ids = block_indices.long()
    unused = (ids < 0) | (ids >= s // PEER_BLOCK)
    big = torch.iinfo(torch.int64).max
    ids = torch.where(unused, big, ids).sort(-1).values
    ids = torch.where(ids == big, -1, ids)
    return ids.permute(1, 0, 2, 3).reshape(hp, b * s, kb).to(torch.int32)


def row_agreement(q2k_a: torch.Tensor, q2k_b: torch.Tensor) -> torch.Tensor:
    """bool [H, T]: where two canonical selections [H, T, K] hold the same blocks."""
    return (q2k_a == q2k_b).all(-1)


def semantic_notes(*, init_blocks: int, local_blocks: int, index_dim: int) -> list[str]:
    """The differences between the two sides at these settings (printed and stored)."""
    notes = [
        "indexer loss: flash-msa token-level KL(main attention averaged over the group || proxy "
        "softmax over selected tokens), gradient to every selected key, kl_loss value a zero "
        "placeholder; ours (sparse) block-level KL(block mass || softmax(block max / "
        "sqrt(d_idx))), gradient via each block's argmax key, value computed",
        "selection scores: flash-msa rounds scale*q.k to bf16 before the block max (near ties "
        "may differ); ours ranks fp32 scores",
        "flash-msa: host syncs in the forward; backward JIT-compiled per reverse-index task count"
        " (a new selection may recompile: see the first-call column)",
    ]
    if (init_blocks, local_blocks) != (0, 1):
        notes.append(f"forced blocks: ours init={init_blocks}, local={local_blocks}; flash-msa "
                     "forces only the own block (no sink), so selections differ by design")
    if index_dim != PEER_DIM:
        notes.append(f"index head dim {index_dim} zero-padded to {PEER_DIM} for flash-msa "
                     "(scores unchanged)")
    return notes


# ------------------------------------------------------------------------ float64 references


def _selected_keys(q2k, msa, rows, bs):
    """Per (head, row): compact key rows [H, S, K*bs] of the selected blocks and visibility."""
    cu = msa.cu_seqlens.long()
    doc = msa.token_documents.long()[rows]
    pos = msa.document_positions.long()[rows]
    sel = q2k[:, rows].long()
    j = sel[..., None] * bs + torch.arange(bs, device=q2k.device)
    vis = (sel[..., None] >= 0) & (j <= pos[None, :, None, None])
    krow = (cu[doc][None, :, None, None] + j).clamp(0, msa.num_tokens - 1)
    return krow.flatten(2, 3), vis.flatten(2, 3)


def peer_kl_grad_rows_f64(iq, ik, q, k, q2k, msa, rows, scale, block_size=PEER_BLOCK):
    """float64 gradient of flash-msa's token-level proxy KL w.r.t. the index queries of ``rows``
    (upstream gradient 1), given the selection ``q2k``.

    loss = sum_{t, p} KL(T_p(t) || softmax_j(scale * iq[t, p] . ik[j])) / (T * Hp) over the
    selected, visible key tokens j of (p, t), with T_p(t) the main attention probabilities of the
    query heads served by p, averaged (no gradient). A row's index query enters only its own
    terms, so the rows' gradient is exact.

    Args:
        iq: [T, Hp, dp] index (proxy) queries; ik: [T, dp] the shared index key.
        q: [T, Hq, d]; k: [T, Hkv, d] main queries and keys.
        q2k: int32 [Hp, T, K] canonical selection (proxy head p serves query heads
            ``p * Hq / Hp ..``).
        msa: the layout; rows: int64 [S] query rows; scale: the softmax scale of both softmaxes.

    Returns:
        float64 [S, Hp, dp].
    """
    hp, hq, hkv = iq.shape[1], q.shape[1], k.shape[1]
    grp = hq // hp
    krow, vis = _selected_keys(q2k, msa, rows, block_size)  # [Hp, S, J]
    kv_head = (torch.arange(hp, device=q.device) * grp // (hq // hkv))[:, None, None]
    kk = k[krow, kv_head].double()  # [Hp, S, J, d]
    qs = q[rows].double().view(-1, hp, grp, q.shape[2]).permute(1, 0, 2, 3)  # [Hp, S, G, d]
    sc = torch.einsum("psgd,psjd->psgj", qs, kk) * scale
    teacher = torch.softmax(sc.masked_fill(~vis[:, :, None, :], -math.inf), -1).mean(2)
    qp = iq[rows].double().permute(1, 0, 2).detach().requires_grad_(True)  # [Hp, S, dp]
    sp = torch.einsum("psd,psjd->psj", qp, ik[krow].double()) * scale
    log_q = torch.log_softmax(sp.masked_fill(~vis, -math.inf), -1)
    has = teacher > 0
    terms = torch.where(has, teacher * (torch.log(teacher.clamp_min(1e-300)) - log_q), 0.0)
    (terms.sum() / (msa.num_tokens * hp)).backward()
    return qp.grad.permute(1, 0, 2)


def peer_kl_grad_dense_f64(iq, ik, q, k, batch, top_k_blocks, scale, block_size=PEER_BLOCK):
    """The same gradient for every token, straight from flash-msa's eager model's formula
    (``tests/testing_model.py``: dense scores, local block forced by +inf, ``topk`` over block
    maxima, ``kl_div(..., reduction="none").sum(-1).mean()``), on (B, H, S, D)-shaped float64
    copies: the check of :func:`peer_kl_grad_rows_f64` on small cases.

    Returns:
        ``(d iq [T, Hp, dp] float64, the selection (B, Hp, S, Kb) in score order, the blocks
        past a query's own one replaced by the sentinel S / block_size as the peer's kernel
        leaves them)``.
    """
    qp = to_bhsd(iq, batch).double().requires_grad_(True)
    kp = to_bhsd(ik, batch).double()
    qm, km = to_bhsd(q, batch).double(), to_bhsd(k, batch).double()
    b, hp, s, _ = qp.shape
    hq, hkv, nb = qm.shape[1], km.shape[1], s // block_size
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    ps = (qp @ kp.transpose(-1, -2)) * scale
    ps = ps.masked_fill(causal, -math.inf)
    blocks = ps.detach().view(b, hp, s, nb, block_size).amax(-1)
    own = (torch.arange(s, device=q.device) // block_size).view(1, 1, s, 1).expand(b, hp, s, 1)
    blocks = blocks.scatter(3, own, math.inf)
    chosen = blocks.topk(top_k_blocks, dim=-1).indices
    bmask = torch.zeros(b, hp, s, nb, dtype=torch.bool, device=q.device).scatter_(3, chosen, True)
    tmask = bmask[..., None].expand(b, hp, s, nb, block_size).reshape(b, hp, s, s) & ~causal
    main = (qm @ km.repeat_interleave(hq // hkv, 1).transpose(-1, -2)) * scale
    main = main.masked_fill(~tmask.repeat_interleave(hq // hp, 1), -math.inf)
    teacher = torch.softmax(main, -1).view(b, hp, hq // hp, s, s).mean(2)
    log_q = torch.log_softmax(ps.masked_fill(~tmask, -math.inf), -1)
    terms = torch.where(tmask & (teacher > 0),
                        teacher * (torch.log(teacher.clamp_min(1e-300)) - log_q), 0.0)
    terms.sum(-1).mean().backward()
    chosen = torch.where(chosen > own, nb, chosen)
    return from_bhsd(qp.grad), chosen.to(torch.int32)


# ------------------------------------------------------------------------------- reporting

HEAD = ("| case | tokens | sel agree | flash fwd ms | ours fwd ms | dense fwd ms | flash f+b ms "
        "| ours f+b ms | dense f+b ms | flash/ours f+b | flash 1st f+b ms | flash out err "
        "| ours out err | flash dq err | flash d iq err | flash vs ours out | errors |")

_COLS = ("sel_agree", "flash_fwd_ms", "ours_fwd_ms", "dense_fwd_ms", "flash_fwdbwd_ms",
         "ours_fwdbwd_ms", "dense_fwdbwd_ms", "flash_over_ours_fwdbwd", "flash_first_fwdbwd_ms",
         "flash_out_err", "ours_out_err", "flash_dq_err", "flash_diq_err", "flash_vs_ours_out")


def _fmt(key: str, value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, list):
        return "/".join(_fmt(key, v) for v in value)
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if key.endswith("_ms"):
        return f"{value:.1f}"
    if key in ("sel_agree", "flash_over_ours_fwdbwd"):
        return f"{value:.3f}" if key == "sel_agree" else f"{value:.2f}x"
    return f"{value:.1e}"


def fmt_table(results: list[dict], notes: list[str]) -> str:
    """The markdown table of ``results``, then the notes and every recorded error in full."""
    return peer_table(results, notes, HEAD, _COLS, _fmt)


def write_json(path, payload: dict) -> None:
    """Writes ``payload`` (NaN/inf as JSON strings, so that strict readers load it)."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    Path(path).write_text(json.dumps(clean(payload), indent=1))
