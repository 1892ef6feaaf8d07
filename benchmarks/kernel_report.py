"""Compiles the hot MSA kernels for the H200 (sm_90a) on any machine and reports their resources.

No GPU is needed: Triton compiles to PTX for a named target and its bundled ``ptxas`` and
``cuobjdump`` give the registers, spills and machine code. Each kernel is specialized as the
JIT specializes a launch at the production shape (aligned pointers, strides divisible by 16,
an integer 1 made a constant; ADR 0034). For each kernel it prints registers
per thread, spill bytes, shared memory, and, per loop that issues tensor-core MMAs (Hopper's
HGMMA, or the HMMA of the per-token kernels' 16-row tiles), its
size in instructions, its program-wide barriers (BAR.SYNC) and its local-memory accesses
(spills inside the loop). Launch variants are the benchmark's ``--set KERNEL.KEY=VALUE``.

This screens variants before device time is spent (ADR 0003): a variant that spills in
its hot loop, or needs more registers or shared memory than two programs per SM allow, can be
dropped here. Timing still needs the GPU (benchmarks/bench_msa.py).

Usage::

    python benchmarks/kernel_report.py \
        [--kernel sel|fwd_union|dq_union|fwd_token|dq_token|dkdv|union_build|loss_scores|loss_dk|
                  all] \
        [--set KERNEL.KEY=VALUE ...] [--emit] [--guarded]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The production topology (MSA_SPEC.md): d = 128, block 128, top-k 16, 16 query heads per KV head.
D, BS, TOPK, G = 128, 128, 16, 16
#: The runtime integers (not strides) at the production shape, one 131072-token document and
#: the recipe's forced blocks (none at the start, the own block): the JIT specializes an integer
#: argument that is 1 into a constant and marks one divisible by 16 (``tt.divisibility``), and
#: the report must compile the code the launch runs. ``max_count`` (the largest union of a
#: tile) depends on the selection: 31 stands for a count the JIT gets no hint on.
_T = 131072
PRODUCTION_INTS = {"num_blocks_bound": _T // BS, "bound": _T // BS, "TQ": _T, "top_k": TOPK,
                   "init_blocks": 0, "local_blocks": 1, "num_tiles": _T // 8, "max_count": 31,
                   "t0": 0, "HQ": 64, "OOB": _T * 64}
#: Every stride at the production shape is a multiple of 16 elements (d = 128, top-k 16, token
#: counts a multiple of the block), and every tensor a 16-byte aligned allocation or view.
_STRIDE = 16 * D


@dataclass
class Source:
    """What ``triton.compile`` takes for one kernel: signature, constants, attributes."""

    signature: dict
    constexprs: dict
    attrs: dict


def _signature(fn, constexprs, pointers, floats, descs):
    """The :class:`Source` of ``fn`` as the JIT would build it at the production shape:
    constexprs; typed pointers (``pointers``, ``*i32`` otherwise), 16-byte aligned; fp32
    scalars; tensor descriptors (name -> block shape); integers from :data:`PRODUCTION_INTS`
    or, for ``stride_*``, a multiple of 16, specialized by Triton's own rule."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: constexpr arguments without a value: {missing}")
    sig, consts, attrs = {}, dict(constexprs), {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in descs:
            if isinstance(descs[name], str):  # a Gluon descriptor, its layout spelled out
                sig[name] = descs[name]
                continue
            rows, cols = descs[name]
            sig[name] = f"tensordesc<bf16[{rows}, {cols}]>"
            continue
        if name.endswith("_ptr"):
            kind, spec = pointers.get(name, "*i32"), "D"
        elif name in floats:
            kind, spec = "fp32", None
        elif name.startswith("stride_"):
            kind, spec = native_specialize_impl(BaseBackend, _STRIDE, False, True, True)
        elif name in PRODUCTION_INTS:
            kind, spec = native_specialize_impl(BaseBackend, PRODUCTION_INTS[name], False, True,
                                                True)
        else:
            raise ValueError(f"{fn.__name__}: no production value for the integer {name!r}; "
                             "add it to PRODUCTION_INTS")
        if kind == "constexpr":
            sig[name], consts[name] = "constexpr", spec
            continue
        sig[name] = kind
        if spec:
            attrs[(index,)] = BaseBackend.parse_attr(spec)
    return Source(sig, consts, attrs)


def _selection(cfg, emit, guarded):
    import nemo_msa.selection.triton_select as ts

    constexprs = dict(BS=BS, BM=cfg.bm, BN=cfg.bn, D=D, KP=TOPK, FP32_DOT=False, TMA=cfg.tma,
                      SUBSET=False)
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16"}
    src = _signature(ts._select_kernel, constexprs, pointers, set(), {"k_desc": (cfg.bn, D)})
    return ts._select_kernel, src, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _union_kernel(cfg, prefix, fn, pointers, floats, emit, guarded):
    """The shared build of the two union kernels' reports (forward: ``union_*`` fields, dq:
    ``dq_union_*``): the launch's constexprs, typed arguments and options. Only the forward
    has the own block by TMA and the register cap. ``guarded``: the launch for programs whose
    whole blocks hold a NaN/Inf (ADR 0032), else the common one."""
    from nemo_msa.attention.triton_union import union_tile_tokens
    from nemo_msa.triton.tiles import next_pow2, register_cap

    def field(name):
        return getattr(cfg, prefix + name)

    bn = field("bn")
    qt = union_tile_tokens(field("qt"), BS, G)  # the tile the launch would use
    constexprs = dict(TOPK=TOPK, KP=TOPK, G=G, GP=G, QT=qt, BS=BS, BN=bn, D=D, FP32_DOT=False,
                      TMA=field("tma"), UW=next_pow2(qt * TOPK), GUARD=guarded, SUBSET=False)
    options = {"num_warps": field("warps"), "num_stages": field("stages")}
    if "OWN_TMA" in fn.arg_names:  # the forward
        import nemo_msa.attention.triton_fwd as tf

        own_tma = field("tma") and field("own_tma")
        constexprs.update(OWN_TMA=own_tma, EMIT=emit)
        options.update(register_cap(tf.union_register_cap(field("maxnreg"), own_tma),
                                    interpret=False))
    return fn, _signature(fn, constexprs, pointers, floats,
                          {"k_desc": (bn, D), "v_desc": (bn, D)}), options


def _forward_union(cfg, emit, guarded):
    import nemo_msa.attention.triton_fwd as tf

    pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    pointers.update(lse_ptr="*fp32", mass_ptr="*fp32")
    return _union_kernel(cfg, "union_", tf._fwd_union_kernel, pointers, {"scale_log2"}, emit,
                         guarded)


def _dq_union(cfg, emit, guarded):
    import nemo_msa.attention.triton_bwd as tb

    pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "o_ptr", "dq_ptr")}
    pointers.update(lse_ptr="*fp32", delta_ptr="*fp32")
    return _union_kernel(cfg, "dq_union_", tb._dq_union_kernel, pointers,
                         {"scale", "scale_log2"}, emit, guarded)


def _per_token(cfg, fn, pointers, floats, fields, emit):
    """The shared build of the per-token kernels' reports in their hybrid grid (the tokens the
    union kernel left, ``tile_grid_tiles`` union tiles per program): ``fields`` names the
    launch's (keys per tile, warps, stages, tiles per program, union tile size) fields."""
    from nemo_msa.attention.triton_union import union_tile_tokens

    bn, warps, stages, tpp, qt = (getattr(cfg, f) for f in fields)
    constexprs = dict(TOPK=TOPK, G=G, GP=G, BS=BS, BN=bn, D=D, FP32_DOT=False, HYBRID=True,
                      QT=union_tile_tokens(qt, BS, G), TPP=tpp, SUBSET=False)
    if "EMIT" in fn.arg_names:
        constexprs.update(KP=TOPK, EMIT=emit)
    return fn, _signature(fn, constexprs, pointers, floats, {}), {"num_warps": warps,
                                                                  "num_stages": stages}


def _forward_token(cfg, emit, guarded):
    import nemo_msa.attention.triton_fwd as tf

    pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    pointers.update(lse_ptr="*fp32", mass_ptr="*fp32")
    return _per_token(cfg, tf._fwd_kernel, pointers, {"scale_log2"},
                      ("bn", "num_warps", "num_stages", "tile_grid_tiles", "union_qt"), emit)


def _dq_token(cfg, emit, guarded):
    import nemo_msa.attention.triton_bwd as tb

    pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "o_ptr", "dq_ptr")}
    pointers.update(lse_ptr="*fp32", delta_ptr="*fp32")
    return _per_token(cfg, tb._dq_kernel, pointers, {"scale", "scale_log2"},
                      ("dq_bn", "dq_warps", "dq_stages", "dq_tile_grid_tiles", "dq_union_qt"),
                      emit)


def _dkdv(cfg, emit, guarded):
    import nemo_msa.attention.triton_bwd as tb

    meta = tb.dkdv_launch(cfg, G, BS, D)
    options = {name: meta.pop(name) for name in ("num_warps", "num_stages")}
    constexprs = dict(G=G, BS=BS, D=D, FP32_DOT=False, **meta)
    pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr")}
    pointers.update(lse_ptr="*fp32", delta_ptr="*fp32", offsets_ptr="*i64")  # the rest int32
    return tb._dkdv_kernel, _signature(tb._dkdv_kernel, constexprs, pointers,
                                       {"scale", "scale_log2"}, {}), options


def _dkdv_gluon(cfg, emit, guarded):
    """The SM90 dk/dv kernel in Gluon (ADR 0042); it has no launch fields."""
    import nemo_msa.attention.gluon_dkdv as gd

    descs = {name: f"tensordesc<{dtype}[{', '.join(map(str, shape))}],{layout!r}>"
             for name, (dtype, shape, layout) in gd.descriptor_blocks(G, D, BS).items()}
    pointers = {"dk_ptr": "*bf16", "dv_ptr": "*bf16", "offsets_ptr": "*i64"}  # the rest int32
    fn = gd._dkdv_sm90_kernel
    return fn, _signature(fn, dict(G=G, QT=4, BS=BS, D=D), pointers, {"scale", "scale_log2"},
                          descs), {"num_warps": gd.GLUON_DKDV_WARPS, "maxnreg": gd.MAXNREG}


def _union_build(cfg, emit, guarded):
    import nemo_msa.attention.triton_union as tu
    from nemo_msa.triton.tiles import next_pow2

    qt = tu.union_tile_tokens(cfg.union_qt, BS, G)
    constexprs = dict(TOPK=TOPK, QT=qt, BS=BS, WIDTH=qt * TOPK, W=next_pow2(qt * TOPK),
                      TP=cfg.union_build_tiles, SUBSET=False)
    return (tu._tile_union_kernel, _signature(tu._tile_union_kernel, constexprs, {}, set(), {}),
            {"num_warps": cfg.union_build_warps})


def _byproduct_pass(fn_name, extra):
    """The sparse indexer loss's block-major passes (ADR 0033); they have no launch fields."""
    import nemo_msa.indexer_loss.triton_byproducts as tb

    fn = getattr(tb, fn_name)
    constexprs = dict(K=TOPK, BS=BS, DI=D, BE=tb._BE, CHUNK=tb._CHUNK, FP32_DOT=False, **extra)
    pointers = {"iq_ptr": "*bf16", "ik_ptr": "*bf16", "dscore_ptr": "*fp32", "score_ptr": "*fp32",
                "factor_ptr": "*fp32", "part_ptr": "*fp32", "chunk_block_ptr": "*i64",
                "offsets_ptr": "*i64", "end_ptr": "*i64", "split_end_ptr": "*i64",
                "dk_ptr": "*bf16"}
    return fn, _signature(fn, constexprs, pointers, set(), {}), {"num_warps": tb._WARPS,
                                                                  "num_stages": 2}


def _loss_scores(cfg, emit, guarded):
    return _byproduct_pass("_block_scores_kernel", {})


def _loss_dk(cfg, emit, guarded):
    return _byproduct_pass("_dk_onehot_kernel", {"FACTOR": True})


KERNELS = {"sel": ("sel", _selection), "fwd_union": ("fwd", _forward_union),
           "dq_union": ("bwd", _dq_union), "fwd_token": ("fwd", _forward_token),
           "dq_token": ("bwd", _dq_token), "dkdv": ("bwd", _dkdv),
           "dkdv_gluon": ("bwd", _dkdv_gluon),
           "union_build": ("fwd", _union_build),
           "loss_scores": ("bwd", _loss_scores), "loss_dk": ("bwd", _loss_dk)}


def _tool(name):
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def _mma_loops(sass):
    """(first address, instructions, BAR.SYNC, MMAs, MMA kind, wgmma waits, local ld/st) per
    innermost loop holding an HGMMA or HMMA, from the backward branches of the disassembly. A
    wgmma wait is a ``WARPGROUP.DEPBAR``: one per HGMMA means ptxas serialized them."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1), 16) for ln in lines]
    where = {a: i for i, a in enumerate(addr)}
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if not m or int(m.group(1), 16) >= addr[i] or int(m.group(1), 16) not in where:
            continue
        body = lines[where[int(m.group(1), 16)]: i + 1]
        count = collections.Counter()
        for b in body:
            for op in ("BAR.SYNC", "HGMMA", "HMMA", "WARPGROUP.DEPBAR", "LDL", "STL"):
                count[op] += op in b
        if count["HGMMA"] or count["HMMA"]:
            loops.append((where[int(m.group(1), 16)], i, count))
    # Innermost loops only: a branch back over a whole inner loop is an outer loop or a jump
    # between the kernel's phases.
    inner = [(s, e, c) for s, e, c in loops
             if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2, _ in loops)]
    return [(hex(addr[s]), e - s + 1, c["BAR.SYNC"], c["HGMMA"] or c["HMMA"],
             "HGMMA" if c["HGMMA"] else "HMMA", c["WARPGROUP.DEPBAR"], c["LDL"] + c["STL"])
            for s, e, c in inner]


def report(kernel, cfg, emit=False, guarded=False):
    """Compiles one kernel with the launch parameters ``cfg`` (its launch dataclass; ``emit``:
    with the indexer loss's by-products, as the training step with the sparse loss launches
    the selection and the union forward; ``guarded``: the union kernels' launch for whole
    blocks holding a NaN/Inf) and returns its report lines."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    fn, src, options = KERNELS[kernel][1](cfg, emit, guarded)
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    compiled = triton.compile(source(fn, src.signature, constexprs=src.constexprs,
                                     attrs=src.attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([str(_tool("ptxas")), "-arch=sm_90a", "-v", str(ptx), "-o",
                               str(cubin)], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(_tool("cuobjdump")), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    lines = [f"{kernel}: {regs} registers, spills {spill.group(1)} B stored / {spill.group(2)} B "
             f"loaded, shared {compiled.metadata.shared} B, {options}"]
    for start, size, bars, mmas, kind, waits, local in _mma_loops(sass):
        lines.append(f"  loop at {start}: {size} instructions, {bars} BAR.SYNC, {mmas} {kind}, "
                     f"{waits} wgmma waits, {local} local loads/stores")
    if "C7512" in info:
        lines.append("  ptxas C7512: wgmma serialized for lack of registers (a wait after each)")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="all", choices=["all", *KERNELS])
    ap.add_argument("--set", action="append", default=[], metavar="KERNEL.KEY=VALUE")
    ap.add_argument("--emit", action="store_true",
                    help="compile the forward kernels with the indexer loss's block mass (EMIT)")
    ap.add_argument("--guarded", action="store_true",
                    help="compile the union kernels' launch for whole blocks that hold a "
                         "NaN/Inf (ADR 0032); by default the common, finite one")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_report.py compiles the kernels: unset TRITON_INTERPRET")
    from bench_msa import apply_overrides

    with apply_overrides(args.set) as launches:
        for kernel in KERNELS if args.kernel == "all" else [args.kernel]:
            for line in report(kernel, launches[KERNELS[kernel][0]], args.emit, args.guarded):
                print(line, flush=True)


if __name__ == "__main__":
    main()
