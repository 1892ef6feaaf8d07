"""The kernels one training step of a small MiniMax-M3-shaped layer launches (issue #28 item 3),
counted on the CPU by benchmarks/count_layer_ops.py (aten ops that launch a kernel on the GPU plus
Triton launches, the Triton backend under the interpreter in bf16; one row of 128 tokens, one
document, 8 query heads per KV head, blocks of 16, top-4), in a subprocess (the script owns its
process group).

Counts of one forward + backward (torch 2.11, megatron-core 0.19.2):

| case | c4785ab | ADR 0030 | no dense dispatch | ADR 0032 | rows in order | ADR 0033 | where |
|---|---|---|---|---|---|---|---|
| dense layer | 359 | 329 | 329 | 329 | 319 | 319 | 325 |
| MSA layer, sparse indexer loss | 685 | 447 | 358 | 362 | 351 | 371 | 371 |
| MSA minus dense | 326 | 118 | 29 | 33 | 32 | 52 | 46 |

(The dense dispatch of ADR 0026, measured slower on the H200 and deleted, ran at this size: the
first 64 tokens select every candidate block. Its plan, query subsets, NaN containment, slices
and the prefix rows' second sparse forward were 89 of the 118. ADR 0032 adds the forward's
NaN/Inf row count, two launches that dq reuses, and a second launch of each union kernel.
"Rows in order": one row without padding packs and unpacks q, k, v, the indexer's input and
the output by reshape, not by gather and scatter, in both layers. ADR 0033: the sparse loss's
scores and argmax keys come from a block-major pass over the selected slots instead of the
selection kernel, and its d index_k from a one-hot MMA instead of atomics: the slots' sort and
chunk plan (a sort-key kernel, the sort and 11 small ops; 2 more for the blocks' first keys,
kept for every layer of a microbatch) and four kernels for the one atomic kernel; estimated to
take GPU time off the step at every size, not yet measured. "where": `torch.where` (ADR 0025's
update of 2026-12-05): the dense layer's three NaN-containment sites each make their scalar
operand a 0-dim tensor (`aten::scalar_tensor`, a one-element fill on the GPU), forward and
backward: six more counted ops. The out-of-place `masked_fill` they replace was counted as one
op but launches a copy and a fill on the GPU, so the GPU's launch count is the same, and each
large tensor is now read and written once instead of twice.)
The bounds are the last column: a change that adds kernels to the step fails here and says
where (the script prints the count by site).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = {"dense": 325, "msa_sparse_loss": 371}
MSA_EXTRA_BOUND = 46


def test_msa_layer_step_launches_at_most_the_bound(tmp_path):
    out = tmp_path / "counts.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "count_layer_ops.py"), "--tokens", "128",
           "--cases", "dense,msa_sparse_loss", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=tmp_path,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = json.loads(out.read_text())
    report = proc.stdout[-6000:]
    for case, bound in BOUNDS.items():
        assert 0 < counts[case]["total"] <= bound, (case, counts[case]["total"], report)
    extra = counts["msa_sparse_loss"]["total"] - counts["dense"]["total"]
    assert extra <= MSA_EXTRA_BOUND, (extra, report)
    sites = counts["msa_sparse_loss"]["sites"]
    # The fused paths ran: the loss's block scores, the KL forward, the loss's backward, RoPE,
    # the index norms, the sampled recall.
    for site in ("indexer_loss/triton_byproducts.py:block_scores_triton",
                 "indexer_loss/triton_byproducts.py:sparse_kl_forward_triton",
                 "indexer_loss/triton_byproducts.py:byproduct_grads_triton",
                 "triton/rope.py:rope_triton",
                 "triton/rms_norm.py:rms_norm_forward_triton",
                 "indexer_loss/triton_recall.py:selection_recall_rows_triton"):
        assert sites.get(site, 0) > 0, (site, sorted(sites))
