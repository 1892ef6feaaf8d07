# session 23 call 2, commit 1daaf59 + diff below
bash .run/call2.sh
# Session 23 call 2 (commit in .run/commit + the diff below: the kernel layout built on the host).
# 1. GPU tests of what the host-built kernel layout feeds (the core at production shape on packed
#    rows against float64, the layout's one sync, the Triton attention kernels).
# 2. .run/launch_probe.py: host cost of one Triton launch by path, and of the kernel layout build.
# 3. The 8192 row, coherent and fresh (bench_layer, dense beside MSA, one process each).
set -uo pipefail
export PYTHONUNBUFFERED=1 NEMO_MSA_COMMIT=$(cat .run/commit)
{ echo "# session 23 call 2, commit $(cat .run/commit) + diff below"; echo "bash .run/call2.sh"; cat .run/call2.sh; echo "# .run/launch_probe.py:"; cat .run/launch_probe.py; echo "# .run/host_probe.py:"; cat .run/host_probe.py; git diff 2>/dev/null; } > $OUT/command.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/core/test_gpu_core.py tests/core/test_layout.py \
  tests/msa_kernels/test_triton_attention.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$? ${SECONDS}s"; tail -4 $OUT/gpu_tests.log | cut -c1-300
timeout 60 python3 .run/launch_probe.py > $OUT/launch_probe.log 2>&1; echo "launch probe rc=$? ${SECONDS}s"
grep -v Warning $OUT/launch_probe.log | cut -c1-300
for idx in coherent fresh; do
  (( SECONDS > 330 )) && break
  echo "== rows $idx" >> $OUT/rows.log
  timeout 90 python3 benchmarks/bench_layer.py --tokens 8192 --cases dense,msa_sparse_loss --index $idx \
    --no-attention-rows --no-pair-rate --steps 7 --warmup 2 >> $OUT/rows.log 2>&1
  echo "rc $? ${SECONDS}s" >> $OUT/rows.log
done
grep -E "^== |^\|  +[0-9]|^rc" $OUT/rows.log | cut -c1-150
echo "total ${SECONDS}s"
# .run/launch_probe.py:
"""Host cost of one Triton launch, and of the kernel layout build (session 23's probe).

The GPU is kept busy (torch.cuda._sleep) so every number is host time only. Launch paths:
- `jit`: `kernel[grid](...)` as the package launches (JITFunction.run);
- `bound`: the native binder + a dict lookup + CompiledKernel.run (what a launch cache keyed on
  the binder's specialization would cost);
- `run`: CompiledKernel.run alone on pre-bound arguments (the floor).
Kernels: the RoPE kernel (14 arguments) and the sparse forward's per-token kernel (about 50).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")


def per_call_us(fn, n=300, reps=5):
    out = []
    for _ in range(reps):
        torch.cuda._sleep(int(2e8))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def launch_paths(name, jit_fn, grid, kwargs):
    from triton.runtime import driver
    from triton import knobs
    compiled = jit_fn[grid](**kwargs)
    device = driver.active.get_current_device()
    binder = jit_fn.device_caches[device][4]
    cache = {}

    def bound():
        stream = driver.active.get_current_stream(device)
        bound_args, spec, options = binder(**kwargs, debug=False, instrumentation_mode="")
        key = tuple(spec)
        k = cache.get(key)
        if k is None:
            k = cache[key] = compiled
        k.run(grid[0], grid[1] if len(grid) > 1 else 1, 1, stream, k.function,
              k.packed_metadata, None, None, None, *bound_args.values())

    bound_args, _, _ = binder(**kwargs, debug=False, instrumentation_mode="")
    values = tuple(bound_args.values())

    def run():
        stream = driver.active.get_current_stream(device)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, 1, stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *values)

    del knobs
    res = {"jit": per_call_us(lambda: jit_fn[grid](**kwargs)), "bound": per_call_us(bound),
           "run": per_call_us(run)}
    print(f"{name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()), flush=True)


def guarded(fn):
    try:
        fn()
    except Exception as error:  # a probe section that fails must not stop the call
        print(f"{fn.__name__} failed: {type(error).__name__}: {error}", flush=True)


def main():
    from nemo_msa.triton import rope as rope_mod
    from nemo_msa.layout import MSAMicrobatch
    from nemo_msa.triton import kernel_layout as kl
    dev = torch.device("cuda")
    t, h, d = 8192, 64, 128
    x = torch.randn(t, h, d, device=dev, dtype=torch.bfloat16)
    cos = torch.randn(t, 1, 64, device=dev, dtype=torch.bfloat16)
    sin = torch.randn(t, 1, 64, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    rows = t * h
    import inspect
    names = list(inspect.signature(rope_mod._rope_kernel.fn).parameters)
    print("rope kernel params:", names, flush=True)
    args = [x, cos, sin, out, rows, h, x.stride(0), x.stride(1), cos.stride(0)]
    kw = dict(zip(names, args))
    kw.update(HALF=32, HALF_P=32, PASS=64, PASS_P=64, BR=rope_mod._BR, BACKWARD=False,
              IS_BF16=True, num_warps=4)
    import triton
    launch_paths("rope (14 args)", rope_mod._rope_kernel, (triton.cdiv(rows, rope_mod._BR),), kw)
    print(f"rope_triton() whole wrapper: {per_call_us(lambda: rope_mod.rope_triton(x, cos, sin)):.1f} us")
    print(f"aten add (for scale): {per_call_us(lambda: torch.add(cos, sin)):.1f} us")
    print(f"aten empty: {per_call_us(lambda: torch.empty(100, device=dev)):.1f} us")

    ids = torch.ones(1, t, dtype=torch.int64, device=dev)
    msa = MSAMicrobatch.build(packed_seq_ids=ids, block_size=128)
    sys.path.insert(0, ".run")
    from host_probe import device_kernel_layout
    for name, fn in (("host (this tree)", kl.build_kernel_layout), ("device ops (base)", device_kernel_layout)):
        print(f"kernel layout {name}: {per_call_us(lambda: fn(msa, 128), n=100):.1f} us", flush=True)
    a = [__import__("numpy").arange(t, dtype="int64")] * 2
    print(f"_upload of 2 x {t} int64: {per_call_us(lambda: kl._upload(a, dev), n=100):.1f} us")
    print(f"pinned empty 100 KB: {per_call_us(lambda: torch.empty(100000, dtype=torch.uint8, pin_memory=True), n=100):.1f} us")


if __name__ == "__main__":
    main()
# .run/host_probe.py:
"""Host issue time of one training step, by section (session 23's probe).

Builds bench_layer's one-layer model (dense and msa_sparse_loss), warms up, then times the host
side of each step with fresh inputs: perf_counter around wrapped functions (inclusive, per
step), the host time inside Triton launches (JITFunction.run) and the host time of the step
(from a synchronized start to the backward's return). Syncs inside a section show up as that
section's time; the step's GPU time comes with it (CUDA events), so the idle part is known.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import importlib
import json
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")

from layer_bench.model import M3, TINY, build_model, case_config, init_single_rank  # noqa: E402
from layer_bench.selection import coherent_index_hooks  # noqa: E402
from layer_bench.steps import layer_step  # noqa: E402
from nemo_msa.megatron import set_training_iteration  # noqa: E402

TIMES: dict = collections.defaultdict(float)
CALLS: dict = collections.Counter()
SYNC = [False]


def _wrap(label, fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - t0
            CALLS[label] += 1
    return inner


TARGETS = [
    ("nemo_msa.megatron.msa_attention", "context_parallel_layout_for_layer", "layout"),
    ("nemo_msa.megatron.msa_attention", "select_blocks", "select_blocks"),
    ("nemo_msa.megatron.msa_attention", "indexer_loss", "indexer_loss(fwd)"),
    ("nemo_msa.megatron.msa_attention", "rope_factors", "rope_factors"),
    ("nemo_msa.megatron.msa_attention", "apply_rope", "apply_rope(q,k)"),
    ("nemo_msa.megatron.msa_attention", "check_runtime_arguments", "check_runtime_arguments"),
    ("nemo_msa.backends_triton", "triton_attention_forward", "triton_attention_forward"),
    ("nemo_msa.backends_triton", "triton_attention_backward", "triton_attention_backward"),
    ("nemo_msa.backends_triton", "triton_select_blocks", "triton_select_blocks"),
    ("nemo_msa.attention.triton_fwd", "hybrid_plan", "fwd:hybrid_plan"),
    ("nemo_msa.attention.triton_fwd", "nonfinite_row_counts", "fwd:nonfinite_row_counts"),
    ("nemo_msa.attention.triton_fwd", "kernel_layout", "fwd:kernel_layout"),
    ("nemo_msa.attention.triton_fwd", "kv_descriptors", "fwd:kv_descriptors"),
    ("nemo_msa.attention.triton_fwd", "check_attention_inputs", "fwd:check_attention_inputs"),
    ("nemo_msa.attention.triton_fwd", "query_subset", "fwd:query_subset"),
    ("nemo_msa.attention.triton_bwd", "kernel_layout", "bwd:kernel_layout"),
    ("nemo_msa.attention.triton_bwd", "_launch_dq", "bwd:_launch_dq"),
    ("nemo_msa.attention.triton_bwd", "check_attention_inputs", "bwd:check_attention_inputs"),
    ("nemo_msa.ops", "validate_attention_inputs", "ops:validate_attention_inputs"),
    ("nemo_msa.ops", "validate_selection_inputs", "ops:validate_selection_inputs"),
    ("nemo_msa.ops", "validate_q2k", "ops:validate_q2k"),
    ("nemo_msa.attention.dense", "dense_document_attention", "dense_document_attention"),
]
METHODS = [
    ("nemo_msa.megatron.msa_attention", "MSASelfAttention", "forward", "attention.forward"),
    ("nemo_msa.megatron.msa_attention", "MSASelfAttention", "_compact_qkv", "_compact_qkv"),
    ("nemo_msa.megatron.msa_attention", "MSASelfAttention", "_core_attention", "_core_attention"),
    ("nemo_msa.megatron.msa_attention", "MSASelfAttention", "_token_rotary_freqs",
     "_token_rotary_freqs"),
    ("nemo_msa.megatron.indexer", "MSAIndexer", "forward", "indexer.forward"),
]


def install() -> None:
    for mod, name, label in TARGETS:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, name):
            setattr(m, name, _wrap(label, getattr(m, name)))
    for mod, cls, name, label in METHODS:
        try:
            c = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):
            continue
        setattr(c, name, _wrap(label, getattr(c, name)))
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    run = JITFunction.run

    def timed_run(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            name = getattr(getattr(self, "fn", None), "__name__", "?")
            TIMES[f"launch:{name}"] += time.perf_counter() - t0
            CALLS[f"launch:{name}"] += 1
            TIMES["launch:ALL"] += time.perf_counter() - t0
            CALLS["launch:ALL"] += 1
    JITFunction.run = timed_run
    sync = torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu
    for attr, fn in zip(("tolist", "item", "cpu"), sync, strict=True):
        setattr(torch.Tensor, attr, _wrap(f"sync:{attr}", fn))


def device_kernel_layout(msa, block_size):
    """The kernel layout as the base tree built it: about twenty device ops."""
    from nemo_msa.triton.kernel_layout import KernelLayout
    num_tokens, num_docs = msa.num_tokens, msa.num_documents
    cu = msa.cu_seqlens
    device = cu.device
    lengths = (cu[1:] - cu[:-1]).to(torch.int64)
    nblk = (lengths + block_size - 1) // block_size
    cum = torch.cumsum(nblk, 0)
    first = cum - nblk
    bound = num_tokens // block_size + num_docs
    ids = torch.arange(bound, device=device, dtype=torch.int64)
    doc = torch.searchsorted(cum, ids, right=True)
    valid = doc < num_docs
    doc_c = doc.clamp(max=max(num_docs - 1, 0))
    local = torch.where(valid, ids - first[doc_c], torch.zeros_like(ids))
    block_doc = torch.where(valid, doc, torch.full_like(doc, -1)).to(torch.int32)
    token_docs = msa.token_documents.to(torch.int64)
    return KernelLayout(block_size=block_size, num_tokens=num_tokens, num_documents=num_docs,
                        num_blocks_bound=bound, cu_seqlens=cu, block_doc=block_doc.contiguous(),
                        block_local=local.to(torch.int32).contiguous(),
                        doc_first_block=first.contiguous(),
                        token_first_block=first[token_docs].contiguous(),
                        token_start=cu[token_docs].to(torch.int32).contiguous(),
                        token_pos=msa.document_positions.to(torch.int32).contiguous())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cases", default="dense,msa_sparse_loss")
    ap.add_argument("--index", default="coherent")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--cprofile", type=int, default=45)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available()
    shape = TINY if args.tiny else M3
    init_single_rank(on_gpu)
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    install()
    out = {}
    import nemo_msa.layout as layout_module
    host_kernel_layout = layout_module.build_kernel_layout
    for case in args.cases.split(","):
        # "msa_sparse_loss@base": the kernel layout built by device ops, as the base tree did.
        case, _, variant = case.partition("@")
        layout_module.build_kernel_layout = _wrap(
            "kernel_layout_build", device_kernel_layout if variant == "base" else host_kernel_layout)
        config = case_config(case, shape, on_gpu, None, 1, "local", None, "delayed")
        set_training_iteration(0)
        model = build_model(config, shape, args.tokens, on_gpu)
        if args.index == "coherent":
            coherent_index_hooks(model, shape.block)
        prepare, run = layer_step(model, shape, args.tokens, device)
        for _ in range(3):
            run(prepare())
        if on_gpu:
            torch.cuda.synchronize()
        steps = []
        for _ in range(args.steps):
            x = prepare()
            if on_gpu:
                torch.cuda.synchronize()
            TIMES.clear()
            CALLS.clear()
            e0 = torch.cuda.Event(enable_timing=True) if on_gpu else None
            e1 = torch.cuda.Event(enable_timing=True) if on_gpu else None
            if on_gpu:
                e0.record()
            t0 = time.perf_counter()
            run(x)
            host = time.perf_counter() - t0
            if on_gpu:
                e1.record()
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            steps.append({"host_ms": host * 1e3, "wall_ms": wall * 1e3,
                          "gpu_ms": e0.elapsed_time(e1) if on_gpu else None,
                          "sections": {k: (v * 1e3, CALLS[k]) for k, v in TIMES.items()}})
        med = {k: statistics.median(s[k] for s in steps) for k in ("host_ms", "wall_ms")}
        if on_gpu:
            med["gpu_ms"] = statistics.median(s["gpu_ms"] for s in steps)
        keys = sorted({k for s in steps for k in s["sections"]})
        sections = {k: (statistics.median(s["sections"].get(k, (0.0, 0))[0] for s in steps),
                        steps[-1]["sections"].get(k, (0.0, 0))[1]) for k in keys}
        case = f"{case}@{variant}" if variant else case
        print(f"== {case} {args.tokens} {args.index}: host issue {med['host_ms']:.2f} ms, "
              f"wall {med['wall_ms']:.2f} ms, gpu {med.get('gpu_ms')}")
        for k, (ms, n) in sorted(sections.items(), key=lambda kv: -kv[1][0]):
            print(f"  {ms:9.3f} ms  {n:4d}  {k}")
        out[case] = {"median": med, "sections": sections}
        if args.cprofile:
            x = prepare()
            if on_gpu:
                torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            run(x)
            prof.disable()
            if on_gpu:
                torch.cuda.synchronize()
            st = pstats.Stats(prof)
            rows = []
            for (path, line, name), (_, calls, self_s, cum_s, _) in st.stats.items():
                rows.append((self_s * 1e3, cum_s * 1e3, calls, f"{path.split('site-packages/')[-1]}:{line}({name})"))
            print(f"-- cProfile {case}: top {args.cprofile} by self time (slowed by the profiler)")
            for self_ms, cum_ms, calls, fn in sorted(rows, reverse=True)[:args.cprofile]:
                print(f"  self {self_ms:8.3f}  cum {cum_ms:8.3f}  {calls:5d}  {fn}")
            nm = [r for r in rows if "nemo_msa" in r[3]]
            print(f"-- cProfile {case}: nemo_msa functions by cumulative time")
            for self_ms, cum_ms, calls, fn in sorted(nm, key=lambda r: -r[1])[:args.cprofile]:
                print(f"  cum {cum_ms:8.3f}  self {self_ms:8.3f}  {calls:5d}  {fn}")
        del model, prepare, run
        if on_gpu:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
diff --git a/nemo_msa/triton/kernel_layout.py b/nemo_msa/triton/kernel_layout.py
index e3aff43..c7d24a8 100644
--- a/nemo_msa/triton/kernel_layout.py
+++ b/nemo_msa/triton/kernel_layout.py
@@ -21,6 +21,7 @@ import os
 import weakref
 from dataclasses import dataclass
 
+import numpy as np
 import torch
 
 from nemo_msa.capabilities import TRITON
@@ -133,48 +134,83 @@ def kernel_layout(msa, block_size: int) -> KernelLayout:
 
 
 def build_kernel_layout(msa, block_size: int) -> KernelLayout:
-    """Builds the :class:`KernelLayout` of ``msa`` for ``block_size`` with device ops only.
+    """Builds the :class:`KernelLayout` of ``msa`` for ``block_size`` from its host document
+    lengths, with one host-to-device copy and no device op.
+
+    The maps are functions of the document lengths alone (documents are contiguous and in
+    order in the compact order), which the layout read on the host in its one synchronization.
+    Computing them there and uploading one buffer replaces about twenty small device ops, each
+    a launch the host pays on the forward's critical path (issue #50).
 
     Args:
-        msa: layout with device tensors ``cu_seqlens`` int32 [D + 1], ``token_documents``
-            int32 [T], ``document_positions`` int32 [T] and host ints ``num_tokens``,
-            ``num_documents``.
+        msa: layout with host ints ``num_tokens``, ``num_documents``, host ``document_lengths``
+            (compact order) and device tensors ``cu_seqlens`` int32 [D + 1] and
+            ``document_positions`` int32 [T].
         block_size: key block size in tokens.
 
     Returns:
         The view; every tensor lives on ``cu_seqlens``' device.
+
+    Raises:
+        ValueError: host lengths that disagree with ``num_tokens`` / ``num_documents``.
     """
     num_tokens = _host_int(msa, "num_tokens")
     num_docs = _host_int(msa, "num_documents")
-    cu = msa.cu_seqlens
-    device = cu.device
-    lengths = (cu[1:] - cu[:-1]).to(torch.int64)
-    nblk = (lengths + block_size - 1) // block_size
-    cum = torch.cumsum(nblk, 0)
-    first = cum - nblk
+    lengths = np.asarray(getattr(msa, "document_lengths", ()), dtype=np.int64)
+    if lengths.size != num_docs or int(lengths.sum()) != num_tokens:
+        raise ValueError(
+            f"msa.document_lengths holds {lengths.size} lengths summing to {int(lengths.sum())}; "
+            f"expected num_documents={num_docs} lengths summing to num_tokens={num_tokens}"
+        )
     bound = num_tokens // block_size + num_docs
-    ids = torch.arange(bound, device=device, dtype=torch.int64)
-    doc = torch.searchsorted(cum, ids, right=True)
-    valid = doc < num_docs
-    doc_c = doc.clamp(max=max(num_docs - 1, 0))
-    local = torch.where(valid, ids - first[doc_c], torch.zeros_like(ids))
-    block_doc = torch.where(valid, doc, torch.full_like(doc, -1)).to(torch.int32)
-    token_docs = msa.token_documents.to(torch.int64)
+    nblk = (lengths + block_size - 1) // block_size
+    first = np.cumsum(nblk) - nblk
+    used = int(nblk.sum())
+    block_doc = np.full(bound, -1, dtype=np.int32)
+    block_doc[:used] = np.repeat(np.arange(num_docs, dtype=np.int32), nblk)
+    block_local = np.zeros(bound, dtype=np.int32)
+    block_local[:used] = np.arange(used, dtype=np.int32) - np.repeat(first.astype(np.int32), nblk)
+    starts = (np.cumsum(lengths) - lengths).astype(np.int32)
+    (doc_first_block, token_first_block, block_doc, block_local, token_start) = _upload(
+        (first, np.repeat(first, lengths), block_doc, block_local, np.repeat(starts, lengths)),
+        msa.cu_seqlens.device,
+    )
     return KernelLayout(
         block_size=block_size,
         num_tokens=num_tokens,
         num_documents=num_docs,
         num_blocks_bound=bound,
-        cu_seqlens=cu,
-        block_doc=block_doc.contiguous(),
-        block_local=local.to(torch.int32).contiguous(),
-        doc_first_block=first.contiguous(),
-        token_first_block=first[token_docs].contiguous(),
-        token_start=cu[token_docs].to(torch.int32).contiguous(),
+        cu_seqlens=msa.cu_seqlens,
+        block_doc=block_doc,
+        block_local=block_local,
+        doc_first_block=doc_first_block,
+        token_first_block=token_first_block,
+        token_start=token_start,
         token_pos=msa.document_positions.to(torch.int32).contiguous(),
     )
 
 
+def _upload(arrays, device: torch.device) -> list[torch.Tensor]:
+    """The int32/int64 host arrays as tensors on ``device``, through one staging buffer and one
+    copy (the tensors are views of the copy, each 128-byte aligned as the kernels' pointer
+    arguments are specialized on 16-byte alignment).
+
+    On CUDA the staging buffer is pinned and the copy asynchronous: no synchronization, and
+    the caching host allocator keeps the buffer until the copy has run."""
+    offsets, total = [], 0
+    for a in arrays:
+        offsets.append(total)
+        total += -(-a.nbytes // 128) * 128
+    staging = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
+    raw = staging.numpy()
+    for a, at in zip(arrays, offsets, strict=True):
+        raw[at:at + a.nbytes] = a.view(np.uint8)
+    buffer = staging if device.type == "cpu" else staging.to(device, non_blocking=True)
+    dtypes = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}
+    return [buffer[at:at + a.nbytes].view(dtypes[a.dtype])
+            for a, at in zip(arrays, offsets, strict=True)]
+
+
 def check_attention_inputs(q, k, v, q2k, view: KernelLayout, subset: QuerySubset | None = None):
     """Validates the shared inputs of the forward and backward; returns (Tq, Hq, Hkv, d, G, K).
 
diff --git a/pyproject.toml b/pyproject.toml
index 493ad17..988e64a 100644
--- a/pyproject.toml
+++ b/pyproject.toml
@@ -16,6 +16,8 @@ dependencies = [
     # Triton ships with torch's Linux wheels; named so that CPU-only installs that lack it
     # still get the interpreter used by the kernel tests.
     "triton>=3.2",
+    # The layout's host-side maps (nemo_msa.document_map, nemo_msa.triton.kernel_layout).
+    "numpy>=1.26",
     "omegaconf>=2.3,<2.5",
     "tqdm>=4.66",
     "pyyaml>=6",
diff --git a/tests/core/test_gpu_core.py b/tests/core/test_gpu_core.py
index 14cf2b9..b284d28 100644
--- a/tests/core/test_gpu_core.py
+++ b/tests/core/test_gpu_core.py
@@ -33,11 +33,25 @@ def test_layout_build_synchronizes_exactly_once_on_cuda():
             x = msa.pack(torch.randn(2, 4096, 8, device="cuda"))
             msa.unpack(x)
             msa.position_ids()
+            view = msa.kernel_layout(128)  # built on the host, one asynchronous upload
     finally:
         torch.cuda.set_sync_debug_mode("default")
     syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
     assert len(syncs) == 1, [str(w.message) for w in syncs]
     assert msa.num_tokens == int((ids > 0).sum())
+    # The uploaded maps are the layout's own (what the device ops derived from it gave).
+    first = torch.cumsum((torch.diff(msa.cu_seqlens) + 127) // 128, 0)
+    first = torch.cat([first.new_zeros(1), first[:-1]])
+    docs = msa.token_documents.long()
+    assert view.doc_first_block.is_cuda and torch.equal(view.doc_first_block, first)
+    assert torch.equal(view.token_first_block, first[docs])
+    assert torch.equal(view.token_start, msa.cu_seqlens[docs])
+    blocks = torch.arange(view.num_blocks_bound, device="cuda")
+    doc = torch.searchsorted(first, blocks, right=True) - 1
+    used = int(((torch.diff(msa.cu_seqlens) + 127) // 128).sum())
+    assert torch.equal(view.block_doc[:used].long(), doc[:used])
+    assert torch.equal(view.block_local[:used].long(), blocks[:used] - first[doc[:used]])
+    assert bool((view.block_doc[used:] == -1).all()) and bool((view.block_local[used:] == 0).all())
 
 
 def _production_inputs(seed: int, max_doc: int):
diff --git a/tests/core/test_layout.py b/tests/core/test_layout.py
index 3235d22..c64bf03 100644
--- a/tests/core/test_layout.py
+++ b/tests/core/test_layout.py
@@ -12,7 +12,9 @@ from packs import packed_batches
 from torch.overrides import TorchFunctionMode
 
 from nemo_msa import MSAMicrobatch
+from nemo_msa.testing.op_count import OpCounter
 from nemo_msa.testing.packs import document_map_from_lengths
+from nemo_msa.triton.kernel_layout import build_kernel_layout
 
 
 def expected_documents(ids: torch.Tensor):
@@ -92,6 +94,54 @@ def test_pack_unpack_and_workspace_round_trip(case):
     assert torch.all(msa.position_ids()[starts] == 0)
 
 
+@settings(max_examples=40, deadline=None)
+@given(packed_batches(max_batch=3, max_seq=1500))
+def test_kernel_layout_matches_an_independent_reading_and_launches_nothing(case):
+    """The Triton kernels' view is built on the host from the document lengths and uploaded in
+    one copy (issue #50: about twenty small device ops before): every map equals a per-document
+    reading of the map, for the layout's block size and a larger one, and on the CPU the build
+    runs no kernel-launching op at all."""
+    ids, block = case
+    msa = MSAMicrobatch.from_document_map(ids, block_size=block)
+    docs = expected_documents(ids)
+    for bs in (block, 128):
+        with OpCounter() as ops:
+            view = build_kernel_layout(msa, bs)
+        assert ops.total == 0, ops.table()
+        block_doc, block_local, first, token_first, token_start = [], [], [], [], []
+        at = 0
+        for d, (*_, n) in enumerate(docs):
+            blocks = -(-n // bs)
+            first.append(len(block_doc))
+            block_doc += [d] * blocks
+            block_local += list(range(blocks))
+            token_first += [first[-1]] * n
+            token_start += [at] * n
+            at += n
+        bound = msa.num_tokens // bs + msa.num_documents
+        assert view.num_blocks_bound == bound >= len(block_doc)
+        pad = bound - len(block_doc)
+        assert view.block_doc.dtype == view.block_local.dtype == torch.int32
+        assert view.block_doc.tolist() == block_doc + [-1] * pad
+        assert view.block_local.tolist() == block_local + [0] * pad
+        assert view.doc_first_block.dtype == view.token_first_block.dtype == torch.int64
+        assert view.doc_first_block.tolist() == first
+        assert view.token_first_block.tolist() == token_first
+        assert view.token_start.dtype == torch.int32 and view.token_start.tolist() == token_start
+        assert torch.equal(view.token_pos, msa.document_positions)
+        for x in (view.block_doc, view.block_local, view.doc_first_block, view.token_first_block,
+                  view.token_start):
+            assert x.data_ptr() % 16 == 0  # the kernels' pointers are specialized on alignment
+
+
+def test_kernel_layout_refuses_host_lengths_that_disagree_with_the_layout():
+    msa = MSAMicrobatch.from_document_map(torch.tensor([[1] * 20 + [2] * 12]), block_size=16)
+    bad = copy.copy(msa)
+    object.__setattr__(bad, "document_lengths", (20, 11))
+    with pytest.raises(ValueError, match=r"document_lengths holds 2 lengths summing to 31"):
+        build_kernel_layout(bad, 16)
+
+
 def test_pack_and_unpack_reject_wrong_shapes():
     msa = MSAMicrobatch.build(batch_size=2, seq_len=4, block_size=16)
     for bad, call in ((torch.zeros(2, 5), msa.pack), (torch.zeros(7, 3), msa.unpack)):
