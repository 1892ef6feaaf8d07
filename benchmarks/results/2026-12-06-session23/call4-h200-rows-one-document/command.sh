# session 23 call 4, commit 1daaf59 + diff below
bash .run/call4.sh
# Session 23 call 4 (commit in .run/commit + the diff below): the rows stage on this card, the
# three one-document rows, fresh then coherent (dense beside MSA in each process).
set -uo pipefail
export PYTHONUNBUFFERED=1 NEMO_MSA_COMMIT=$(cat .run/commit)
{ echo "# session 23 call 4, commit $(cat .run/commit) + diff below"; echo "bash .run/call4.sh"; cat .run/call4.sh; git diff 2>/dev/null; } > $OUT/command.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
STAGES=rows ROWS_TOKENS=8192,32768,131072 ROWS_S=140 bash benchmarks/device_validation.sh | grep -v "^|--" | cut -c1-200
echo "total ${SECONDS}s"
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
