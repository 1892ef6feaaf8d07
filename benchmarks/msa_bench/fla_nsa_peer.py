"""fla-org/flash-linear-attention's NSA selected-block attention (fla-core 0.6.0) beside ours.

The peer's op is ``fla.ops.nsa.parallel.ParallelNSAFunction.apply(q, k, v, block_indices,
block_counts, block_size, scale, cu_seqlens) -> o`` (Triton, autograd), the "selected" branch of
Native Sparse Attention; ``parallel_nsa(..., block_indices=...)`` without gates returns the same
tensor but also mean-pools k and v for the compressed branch it then discards, so the benchmark
calls the Function directly. Given the same selection both sides compute the same function, so
the comparison is of attention kernels on identical inputs: our q2k is converted to the peer's
``block_indices`` and our layout to its ``cu_seqlens``; the selection itself is not part of
either side's timing (ours is timed and reported on its own).

What the peer computes (read from fla-core 0.6.0: ``fla/ops/nsa/parallel.py`` -- the forward
kernel, ``parallel_nsa_bwd_kernel_dq``, ``parallel_nsa_bwd_kernel_dkv`` -- and
``fla/ops/utils/csr.py``'s ``prepare_block_csr``):

- layout: q [B, T, HQ, D], k / v [B, T, H, D], block_indices int [B, T, H, S]; with
  ``cu_seqlens`` (int64 [N + 1], packed documents) B must be 1 and every index is relative to
  the query's own sequence start (the kernel offsets k / v by the sequence's first row), which
  is our q2k's document-local block id. Query head ``h * G + g`` reads KV head h (G = HQ / H), as
  ours. G must be a power of two >= 16 (a Triton tile dimension; ``parallel_nsa`` asserts it,
  the Function does not, so :func:`fla_attention` checks it).
- per (query t, KV head h) the softmax runs over the keys of every slot s < NS whose block start
  ``block_indices[t, h, s] * block_size`` is >= 0 and <= t (its in-sequence position): slots
  holding -1 (any negative id) are skipped, and so are blocks past the query's own block; inside
  the own block the keys after t are masked (causal). The forward and the dq kernel test
  ``0 <= i_s <= t`` per slot; the dk/dv kernel gets its (block -> queries) lists from
  ``prepare_block_csr``, which drops slots with id < 0, id >= the largest sequence's block count
  or a block start past the query's packed-global row, and masks keys after the query in packed
  rows, so the three kernels agree on the set of keys.
- slots are not deduplicated: a block listed twice counts twice (ours: set semantics); our
  canonical q2k (ascending, unique, -1 at the tail) has no duplicates, and :func:`check_q2k`
  refuses any that do.
- ``block_counts``: an int makes the forward and dq kernels loop over all S slots (they read S
  from ``block_indices``' last dim, not from the int) while ``prepare_block_csr`` reads the first
  ``block_counts`` slots: they agree only with ``block_counts == S``, which the adapter passes.
  ``prepare_block_csr`` builds ``tl.arange(0, S)``, so S must be a power of two: the adapter
  pads the slot axis with -1 (skipped) up to the next one.
- the row sum is kept in fp32, the output cast to q's dtype; ``scale`` multiplies q (rounded to
  q's dtype) before q.k; D <= 256 (one key tile).
- cost model: one Triton autotune per (block size, head dims, G) key on the first call (12
  forward, 12 dq and up to 16 dk/dv configurations: timed apart as the first call); the varlen
  backward reads the longest sequence's length on the host (``.item()``: one synchronization).

On the CPU (``TRITON_INTERPRET=1``) fla-core 0.6.0 runs on float32 tensors when each autotuned
kernel has one configuration (the autotuner's benchmark needs a GPU driver): see
:func:`single_config_autotune`. bf16 does not run there (the interpreter cannot build a bf16
scalar for ``q * scale``).
"""

from __future__ import annotations

import contextlib
import importlib
import math

import torch
from msa_bench.peer_steps import import_site_modules, peer_table

#: The release this module's reading (docstring) is of.
FLA_VERSION = "0.6.0"
#: The modules the run needs: einops (fla imports it) and the op's module.
PEER_MODULES = ("einops", "fla.ops.nsa.parallel")
#: fla's modules whose autotuned kernels the NSA op launches.
NSA_KERNEL_MODULES = ("fla.ops.nsa.parallel", "fla.ops.utils.csr", "fla.ops.attn.parallel",
                      "fla.ops.utils.index")


class PeerImportError(RuntimeError):
    """fla-core or einops cannot be imported; ``missing`` names the module."""

    def __init__(self, missing: str, detail: str):
        self.missing = missing
        super().__init__(
            f"cannot import fla-core's NSA: {detail} (missing module: {missing}; install "
            f"fla_core-{FLA_VERSION} and einops with pip --target DIR and pass DIR as --site)")


def import_peer(site_dirs=()):
    """Imports :data:`PEER_MODULES` after adding each existing ``site_dirs`` entry with
    ``site.addsitedir``.

    Returns:
        ``fla.ops.nsa.parallel.ParallelNSAFunction``.

    Raises:
        PeerImportError: naming the first module that cannot be imported.
    """
    import_site_modules(site_dirs, PEER_MODULES, PeerImportError)
    return importlib.import_module(PEER_MODULES[-1]).ParallelNSAFunction


@contextlib.contextmanager
def single_config_autotune(index: int = 0, modules=NSA_KERNEL_MODULES):
    """Inside the block, every autotuned kernel of ``modules`` has only its configuration
    ``index`` (clamped to the last): Triton's autotuner benchmarks candidates with the GPU
    driver, which the CPU interpreter lacks. A configuration sets launch parameters only
    (warps, stages, the dk/dv kernel's queries per step), not what is computed. Restored on exit.

    Yields:
        ``{"module.kernel": number of configurations it had}`` for the kernels it pinned.
    """
    from triton.runtime.autotuner import Autotuner

    saved, pinned = [], {}
    try:
        for mod_name in modules:
            mod = importlib.import_module(mod_name)
            for name, obj in vars(mod).items():
                tuner = obj
                while tuner is not None and not isinstance(tuner, Autotuner):
                    tuner = getattr(tuner, "fn", None)  # heuristics wrap the autotuner
                if tuner is None or len(tuner.configs) < 2:
                    continue
                saved.append((tuner, tuner.configs))
                pinned[f"{mod_name}.{name}"] = len(tuner.configs)
                tuner.configs = [tuner.configs[min(index, len(tuner.configs) - 1)]]
        yield pinned
    finally:
        for tuner, configs in saved:
            tuner.configs = configs


# ------------------------------------------------------------------------------- layouts


def slots_for(top_k: int) -> int:
    """The peer's slot count for ``top_k`` blocks: the next power of two (>= 1)."""
    if top_k < 1:
        raise ValueError(f"top_k={top_k}; expected at least one block per query")
    return 1 << (top_k - 1).bit_length()


def q2k_to_block_indices(q2k: torch.Tensor, slots: int | None = None) -> torch.Tensor:
    """Our selection as the peer's ``block_indices``.

    Args:
        q2k: int [Hkv, T, K] document-local block ids, -1 = none.
        slots: the peer's S (>= K, a power of two); default :func:`slots_for` (K).

    Returns:
        contiguous int32 [1, T, Hkv, S]: ``out[0, t, h, s] = q2k[h, t, s]`` for s < K, -1 after.

    Raises:
        ValueError: q2k not a 3-D integer tensor, or ``slots`` < K or not a power of two.
    """
    if q2k.dim() != 3 or q2k.dtype.is_floating_point or q2k.dtype == torch.bool:
        raise ValueError(f"q2k: expected an integer [Hkv, T, K] tensor, got {tuple(q2k.shape)} "
                         f"{q2k.dtype}")
    h, t, k = q2k.shape
    s = slots_for(k) if slots is None else int(slots)
    if s < k or s & (s - 1):
        raise ValueError(f"slots={s}: expected a power of two >= top_k={k}")
    out = torch.full((1, t, h, s), -1, dtype=torch.int32, device=q2k.device)
    out[0, :, :, :k] = q2k.transpose(0, 1)
    return out


def fla_cu_seqlens(msa) -> torch.Tensor | None:
    """The layout's documents as the peer's ``cu_seqlens`` (int64 [D + 1], compact starts then
    T), or None where one document holds every token (the peer's non-varlen path, same
    function)."""
    cu = msa.cu_seqlens.long()
    if cu.numel() == 2:
        return None
    return cu


def check_q2k(q2k: torch.Tensor, msa, block_size: int) -> None:
    """Refuses a q2k on which the two sides would differ: a valid id must lie in [0, own block]
    (ours skips later blocks too, but the peer's dk/dv lists count ids up to the longest
    document's last block) and the valid ids of a row ascending and unique with -1 only at the
    tail (the peer counts a duplicate twice).

    Args:
        q2k: int [Hkv, T, K]; msa: its layout; block_size: tokens per block.

    Raises:
        ValueError: naming the first offending (head, token) and its ids.
    """
    own = (msa.document_positions.long() // block_size)[None, :, None]
    ids = q2k.long()
    valid = ids >= 0
    bad = (ids < -1) | (valid & (ids > own))
    if ids.shape[-1] > 1:
        later = ids[..., 1:]
        bad[..., 1:] |= (later >= 0) & ((ids[..., :-1] < 0) | (later <= ids[..., :-1]))
    if bad.any():
        h, t, _ = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"q2k[{h}, {t}] = {q2k[h, t].tolist()} (own block {int(own[0, t, 0])}): expected "
            "ascending unique ids in [0, own block], -1 only at the tail")


def fla_inputs(q2k: torch.Tensor, msa, block_size: int, check: bool = True) -> dict:
    """Everything the peer needs besides q / k / v, converted once (outside the timing):
    ``{"block_indices", "block_counts", "cu_seqlens", "block_size"}``; ``check`` runs
    :func:`check_q2k` first."""
    if check:
        check_q2k(q2k, msa, block_size)
    bi = q2k_to_block_indices(q2k)
    return {"block_indices": bi, "block_counts": bi.shape[-1], "cu_seqlens": fla_cu_seqlens(msa),
            "block_size": int(block_size)}


def fla_attention(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, conv: dict,
                  scale: float) -> torch.Tensor:
    """One checked call of the peer on our compact tensors (autograd flows through).

    Args:
        fn: ``ParallelNSAFunction`` (or a stand-in with its ``apply``).
        q: [T, HQ, D]; k, v: [T, H, D], q's dtype, HQ / H a power of two >= 16, D <= 256.
        conv: :func:`fla_inputs` of the selection.
        scale: the softmax scale.

    Returns:
        [T, HQ, D] in q's dtype.

    Raises:
        ValueError: on shapes or dtypes the peer does not take (named with the expectation).
    """
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "[T, HQ, D] and two equal [T, H, D]")
    t, hq, d = q.shape
    h = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k/v {tuple(k.shape)} {k.dtype}: expected [{t}, H, {d}] {q.dtype}")
    grp = hq // h if h and hq % h == 0 else 0
    if grp < 16 or grp & (grp - 1):
        raise ValueError(f"HQ={hq}, H={h}: fla's NSA needs HQ / H a power of two >= 16")
    if d > 256:
        raise ValueError(f"head dim {d}: fla's NSA takes at most 256")
    bi = conv["block_indices"]
    if bi.shape[:3] != (1, t, h):
        raise ValueError(f"block_indices {tuple(bi.shape)}: expected [1, {t}, {h}, S]")
    bs = conv["block_size"]
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"block_size={bs}: fla's NSA needs a power of two >= 16")
    o = fn.apply(q[None], k[None], v[None], bi, conv["block_counts"], bs, float(scale),
                 conv["cu_seqlens"])
    if o.shape != (1, t, hq, d):
        raise RuntimeError(f"fla returned {tuple(o.shape)}, expected (1, {t}, {hq}, {d})")
    return o[0]


# ------------------------------------------------------------------------ float64 reference


def fla_semantics_f64(q, k, v, block_indices, cu_seqlens, block_size, scale):
    """float64 attention as fla's NSA kernels define it (module docstring), written from its
    rules and not from our q2k's: per (sequence, query t, KV head h) every slot with
    ``0 <= id * block_size <= t`` adds its block's keys j <= t (inside the sequence), a block
    listed twice counting twice. It checks the adapter without fla, and fla on the CPU.

    Args:
        q: [1, T, HQ, D]; k, v: [1, T, H, D]; block_indices: int [1, T, H, S];
        cu_seqlens: int [N + 1] or None (one sequence); block_size; scale.

    Returns:
        float64 [1, T, HQ, D] (autograd flows to float64 copies: use ``.backward`` on it with
        inputs that require grad, which are cast inside).
    """
    _, t, hq, d = q.shape
    h = k.shape[2]
    grp = hq // h
    cu = [0, t] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    outs = []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        n = e - s
        ids = block_indices[0, s:e].long()  # [n, H, S]
        pos = torch.arange(n, device=q.device)
        start = ids * block_size
        live = (ids >= 0) & (start <= pos[:, None, None])
        key = torch.arange(n, device=q.device)
        inblk = (key[None, None, None, :] >= start[..., None]) & (
            key[None, None, None, :] < start[..., None] + block_size)
        count = (inblk & live[..., None]).sum(2)  # [n, H, n] multiplicity of key j
        count = count * (key[None, None, :] <= pos[:, None, None])
        mult = count.repeat_interleave(grp, 1).double()  # [n, HQ, n]
        qd = q[0, s:e].double()
        kd = k[0, s:e].double().repeat_interleave(grp, 1)
        vd = v[0, s:e].double().repeat_interleave(grp, 1)
        sc = torch.einsum("thd,jhd->thj", qd, kd) * scale
        sc = torch.where(mult > 0, sc + torch.log(mult.clamp_min(1)), -math.inf)
        pr = torch.softmax(sc, -1).nan_to_num(0.0)  # a query with no key: zeros
        outs.append(torch.einsum("thj,jhd->thd", pr, vd))
    return torch.cat(outs, 0)[None]


# ------------------------------------------------------------------------------- reporting

HEAD = ("| case | tokens | docs | fla fwd ms | ours fwd ms | dense fwd ms | fla f+b ms "
        "| ours f+b ms | dense f+b ms | fla/ours fwd | fla/ours f+b | ours sel ms "
        "| fla 1st f+b ms | fla out err | ours out err | fla dq err | ours dq err "
        "| fla vs ours dk | fla vs ours dv | errors |")

_COLS = ("docs", "fla_fwd_ms", "ours_fwd_ms", "dense_fwd_ms", "fla_fwdbwd_ms", "ours_fwdbwd_ms",
         "dense_fwdbwd_ms", "fla_over_ours_fwd", "fla_over_ours_fwdbwd", "ours_sel_ms",
         "fla_first_fwdbwd_ms", "fla_out_err", "ours_out_err", "fla_dq_err", "ours_dq_err",
         "fla_vs_ours_dk", "fla_vs_ours_dv")


def _fmt(key: str, value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if key == "docs":
        return str(value)
    if key.endswith("_ms"):
        return f"{value:.1f}"
    if key.startswith("fla_over_ours"):
        return f"{value:.2f}x"
    return f"{value:.1e}"


def fmt_table(results: list[dict], notes: list[str]) -> str:
    """The markdown table of ``results``, then the notes and every recorded error in full."""
    return peer_table(results, notes, HEAD, _COLS, _fmt)


NOTES = [
    "same function on both sides: fla's NSA selected-block attention on our q2k (converted to "
    "its block_indices, -1 padded to a power of two; our documents as its cu_seqlens)",
    "selection excluded from the fla and ours columns (one q2k per input set, computed before "
    "timing); ours sel ms is our select_blocks alone",
    "fla 1st f+b: its first forward + backward, Triton autotuning (12 + 12 + 16 configurations) "
    "included; dense: cuDNN SDPA causal over each padded row (no documents)",
    "errors: relative norm vs float64 on a query subset (out, dq); dk / dv fla vs ours (both "
    "bf16, whole tensors); fla rounds q * scale to bf16 before q.k, ours scales the fp32 scores",
]
