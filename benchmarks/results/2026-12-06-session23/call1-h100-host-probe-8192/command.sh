# session 23 call 1, commit 1daaf59
bash .run/call1.sh
# Session 23 call 1 (commit in .run/commit): where the MSA step's host time goes. .run/host_probe.py
# times the host side of each step by section (perf_counter around the layer's functions, the
# Triton launches, the host syncs), dense and MSA at 8192 tokens, coherent then fresh, plus one
# cProfile pass per case; then the GPU tests of the kernels (unchanged here) are not run.
set -uo pipefail
export PYTHONUNBUFFERED=1 NEMO_MSA_COMMIT=$(cat .run/commit)
{ echo "# session 23 call 1, commit $(cat .run/commit)"; echo "bash .run/call1.sh"; cat .run/call1.sh; echo "# .run/host_probe.py:"; cat .run/host_probe.py; git diff 2>/dev/null; } > $OUT/command.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
for idx in coherent fresh; do
  echo "== host_probe --tokens 8192 --index $idx" | tee $OUT/host_$idx.log
  timeout 200 python3 .run/host_probe.py --tokens 8192 --index $idx --steps 8 --cprofile 45 --cases dense,msa_sparse_loss,msa_sparse_loss@base \
    --json $OUT/host_$idx.json >> $OUT/host_$idx.log 2>&1
  echo "rc $? ${SECONDS}s" | tee -a $OUT/host_$idx.log
  grep -E "^== |^ +[0-9.]+ ms" $OUT/host_$idx.log | head -70
done
echo "total ${SECONDS}s"
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
index e3aff43..ed07487 100644
--- a/nemo_msa/triton/kernel_layout.py
+++ b/nemo_msa/triton/kernel_layout.py
@@ -21,6 +21,7 @@ import os
 import weakref
 from dataclasses import dataclass
 
+import numpy as np
 import torch
 
 from nemo_msa.capabilities import TRITON
@@ -133,48 +134,84 @@ def kernel_layout(msa, block_size: int) -> KernelLayout:
 
 
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
+    docs = np.arange(num_docs, dtype=np.int64)
+    used = int(nblk.sum())
+    token_docs = np.repeat(docs, lengths)
+    block_doc = np.full(bound, -1, dtype=np.int32)
+    block_doc[:used] = np.repeat(docs, nblk)
+    block_local = np.zeros(bound, dtype=np.int32)
+    block_local[:used] = np.arange(used, dtype=np.int64) - np.repeat(first, nblk)
+    token_start = (np.cumsum(lengths) - lengths)[token_docs].astype(np.int32)
+    (doc_first_block, token_first_block, block_doc, block_local, token_start) = _upload(
+        (first, first[token_docs], block_doc, block_local, token_start), msa.cu_seqlens.device
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
