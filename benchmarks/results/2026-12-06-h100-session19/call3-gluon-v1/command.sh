# session 19 call 2, commit 9fff32f + working tree
bash .run/call2.sh
# Session 19 call 2 (commit in .run/commit + the Gluon dk/dv kernel, uncommitted): its GPU
# tests, the backward with each dk/dv kernel (.run/ab_dkdv.py), Nsight Compute on the Gluon
# kernel (coherent 8192).
set -uo pipefail
export PYTHONUNBUFFERED=1 NEMO_MSA_COMMIT=$(cat .run/commit)
{ echo "# session 19 call 2, commit $(cat .run/commit) + working tree"; echo "bash .run/call2.sh"; cat .run/call2.sh; echo "# .run/ab_dkdv.py:"; cat .run/ab_dkdv.py; git diff 2>/dev/null; } > $OUT/command.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/msa_kernels/test_gluon_dkdv.py > $OUT/gluon_tests.log 2>&1; echo "gluon tests rc=$?"; tail -30 $OUT/gluon_tests.log | cut -c1-300
timeout 200 python3 .run/ab_dkdv.py 2>&1 | tee $OUT/ab_dkdv.log | tail -8 | cut -c1-400
timeout 120 /usr/local/cuda/bin/ncu --clock-control none --kernel-name _dkdv_sm90_kernel --launch-skip 2 --launch-count 1 --set full --import-source yes -o $OUT/ncu_gluon python3 .run/probe.py --ncu > $OUT/ncu_gluon.log 2>&1; echo "ncu rc=$?"
/usr/local/cuda/bin/ncu -i $OUT/ncu_gluon.ncu-rep --page raw --csv > $OUT/ncu_gluon_raw.csv 2>&1
/usr/local/cuda/bin/ncu -i $OUT/ncu_gluon.ncu-rep --page source --csv --print-source sass > $OUT/ncu_gluon_sass.csv 2>&1
/usr/local/cuda/bin/ncu -i $OUT/ncu_gluon.ncu-rep --page details > $OUT/ncu_gluon_details.txt 2>&1
grep -E "Duration|Registers Per|Achieved Occupancy|L2 Hit Rate  |DRAM Throughput|Compute \(SM\) Throughput" $OUT/ncu_gluon_details.txt | head
echo "total ${SECONDS}s"
cd $OUT && tar czf results.tgz --remove-files $(ls | grep -v '^command.sh$')
# .run/ab_dkdv.py:
"""Session 19: the sparse backward with the Triton and the Gluon dk/dv kernels, alternating in
one process (CUDA-event medians after warm-up, two fresh input sets), 8192 and 32768 tokens on
one document, coherent and fresh selections; plus the gradients' agreement."""
import math
import statistics
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "benchmarks"), str(root)]
from msa_bench.cases import INIT, LOCAL, TOPK, D, fresh_inputs, make_case  # noqa: E402

from nemo_msa.attention.triton_bwd import triton_attention_backward  # noqa: E402
from nemo_msa.attention.triton_fwd import triton_attention_forward  # noqa: E402
from nemo_msa.selection.triton_select import triton_select_blocks  # noqa: E402
from nemo_msa.testing.oracle import rel_err  # noqa: E402
from nemo_msa.triton.launch import launch_overrides  # noqa: E402

variants = {"triton": {"bwd.kv_kernel": "triton"}, "gluon": {"bwd.kv_kernel": "gluon"},
            "gluon3": {"bwd.kv_kernel": "gluon", "bwd.kv_gluon_stages": 3}}
if len(sys.argv) > 1:
    variants = {k: variants[k] for k in sys.argv[1].split(",")}
gen = torch.Generator(device="cuda").manual_seed(0)
for tokens in (8192, 32768):
    case = make_case("one", [[tokens]], tokens, "cuda")
    msa = case["msa"]
    scale = 1 / math.sqrt(D)
    for coherent in (True, False):
        sets = [fresh_inputs(tokens, "cuda", gen, coherent) for _ in range(2)]
        for s in sets:
            s["q2k"] = triton_select_blocks(s["iq"], s["ik"], msa, top_k=TOPK, init_blocks=INIT,
                                            local_blocks=LOCAL)
            s["out"], s["lse"], s["un"] = triton_attention_forward(
                s["q"], s["k"], s["v"], s["q2k"], msa, scale, return_unions=True)

        def bwd(s):
            return triton_attention_backward(s["do"], s["q"], s["k"], s["v"], s["out"],
                                             s["lse"], s["q2k"], msa, scale, unions=s["un"])

        grads, times = {}, {k: [] for k in variants}
        for name, over in variants.items():
            with launch_overrides(over):
                grads[name] = bwd(sets[0])
                bwd(sets[1])
        torch.cuda.synchronize()
        for rep in range(12):
            for name, over in variants.items():
                with launch_overrides(over):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    bwd(sets[rep % 2])
                    b.record()
                    torch.cuda.synchronize()
                    times[name].append(a.elapsed_time(b))
        base = statistics.median(times["triton"]) if "triton" in times else None
        line = f"{tokens} {'coherent' if coherent else 'fresh'}: bwd ms " + ", ".join(
            f"{k} {statistics.median(v):.3f}" for k, v in times.items())
        if base:
            line += " | " + ", ".join(f"{k}/triton {statistics.median(v) / base:.3f}"
                                      for k, v in times.items() if k != "triton")
            ref = grads["triton"]
            line += " | rel err vs triton " + ", ".join(
                f"{k}: dk {rel_err(g[1], ref[1]):.1e} dv {rel_err(g[2], ref[2]):.1e}"
                for k, g in grads.items() if k != "triton")
        print(line, flush=True)
        del sets, grads
        torch.cuda.empty_cache()
diff --git a/nemo_msa/attention/triton_bwd.py b/nemo_msa/attention/triton_bwd.py
index db96a40..1c33a10 100644
--- a/nemo_msa/attention/triton_bwd.py
+++ b/nemo_msa/attention/triton_bwd.py
@@ -24,6 +24,7 @@ import torch
 import triton
 import triton.language as tl
 
+from nemo_msa.attention.gluon_dkdv import gluon_dkdv, gluon_dkdv_supported
 from nemo_msa.attention.triton_union import TileUnions, hybrid_plan, tensor_identity
 from nemo_msa.triton.guards import (
     dq_tile_masked,
@@ -463,6 +464,10 @@ def triton_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tens
     # The dq launch also writes delta (rowsum(dO * O)), which the dk/dv kernel reads.
     _launch_dq(cfg, view, rows, q2k_, scale, t, hkv, top_k, grp, gp, d, unions, subset)
     csr = block_query_csr(q2k_, view, subset)
+    if cfg.kv_kernel == "gluon" and gluon_dkdv_supported(q_, k_, v_, do_, grp, bs):
+        gluon_dkdv(q_, k_, v_, do_, lse_, delta, csr, view, (subset or view).token_pos, scale,
+                   bs, dk, dv, stages=cfg.kv_gluon_stages)
+        return dq, dk, dv
     meta = dkdv_launch(cfg, grp, bs, d)
     rows = dict(q_ptr=q_, k_ptr=k_, v_ptr=v_, do_ptr=do_, lse_ptr=lse_, delta_ptr=delta,
                 dk_ptr=dk, dv_ptr=dv)
diff --git a/nemo_msa/triton/launch.py b/nemo_msa/triton/launch.py
index e6f719b..2dc57b1 100644
--- a/nemo_msa/triton/launch.py
+++ b/nemo_msa/triton/launch.py
@@ -119,6 +119,9 @@ class BackwardLaunch:
         kv_bn: dk/dv: keys per program (a block is split into ``bs / kv_bn`` programs).
         kv_rows: dk/dv: rows per query tile (tokens x padded group).
         kv_warps, kv_stages: dk/dv: warps and stages.
+        kv_kernel: dk/dv kernel on SM90 with bf16, d = 128, block 128 and 16 query heads per
+            KV head: ``"gluon"`` (:mod:`~nemo_msa.attention.gluon_dkdv`) or ``"triton"``.
+        kv_gluon_stages: the Gluon dk/dv kernel's query-row ring depth.
     """
 
     dq_bn: int = 64
@@ -137,6 +140,8 @@ class BackwardLaunch:
     kv_rows: int = 64
     kv_warps: int = 4
     kv_stages: int = 2
+    kv_kernel: typing.Literal["triton", "gluon"] = "gluon"
+    kv_gluon_stages: int = 2
 
     def __post_init__(self) -> None:
         _check_fields(self, "bwd")
