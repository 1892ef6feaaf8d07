"""``msa_backend="reference"`` on a GPU: a bf16 training step of a whole MSA GPTModel launches no
Triton kernel (issue #47, ADR 0019), while the same step on the Triton backend launches the ops'
and the fused helpers' kernels (so the counter sees compiled launches).

The CPU test of the same claim (``test_megatron_plan.py``) runs under the interpreter and the CPU
shim; this one runs compiled on CUDA, where every helper that decided from the device alone
would launch its kernel. On the device: ``python -m pytest -q -m gpu
tests/megatron/test_reference_backend_gpu.py``.
"""

from __future__ import annotations

import collections

import pytest
import torch
from _megatron_harness import MICRO_BATCH, SEQ, build_model_chunks, packed_batches, tiny_config

from nemo_msa.megatron import MSAIndexerMetrics
from nemo_msa.testing.op_count import OpCounter

pytestmark = pytest.mark.gpu

#: The sparse indexer loss from the attention's by-products, its sampled recall, q/k norms and
#: RoPE: every fused helper a layer step can run.
_STEP = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
             qk_layernorm=True, msa_indexer_loss_coeff=0.1, msa_indexer_loss_type="sparse",
             msa_log_selection_recall=True)
#: Kernels of the fused helpers (norms, RoPE, loss passes, recall) a Triton step must launch.
_HELPERS = {"_rms_fwd_kernel", "_rms_bwd_kernel", "_rope_kernel", "_block_scores_kernel",
            "_sparse_kl_fwd_kernel", "_recall_kernel"}


def _triton_launches_of_a_training_step(backend: str) -> collections.Counter:
    """One forward + backward of a packed microbatch through a bf16 MSA + dense GPTModel on the
    GPU (``msa_backend=backend``), counting Triton launches by kernel name."""
    from megatron.core.transformer.module import Float16Module

    config = tiny_config(msa_backend=backend, **_STEP)
    (model,) = build_model_chunks(config)
    model = Float16Module(config, model.cuda()).train()
    plans = {m.msa_plan.backend.name for m in model.modules() if hasattr(m, "msa_plan")}
    assert plans == {backend}, plans
    batch = {k: v.cuda() for k, v in packed_batches(1)[0].items()}
    positions = torch.arange(SEQ, device="cuda").expand(MICRO_BATCH, SEQ)
    MSAIndexerMetrics.reset()
    with OpCounter() as ops:
        loss = model(batch["tokens"], positions, batch["packed_seq_ids"], labels=batch["labels"])
        (loss.float() * batch["loss_mask"]).sum().backward()
        torch.cuda.synchronize()
    assert "indexer_loss" in MSAIndexerMetrics.pop(num_layers=config.num_layers)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g.float()).all() for g in grads)
    return ops.triton_launches()


def test_the_reference_backend_launches_no_triton_kernel_on_the_gpu(cuda_single_rank):
    launches = _triton_launches_of_a_training_step("reference")
    assert not launches, f"the reference backend launched Triton kernels: {dict(launches)}"


def test_the_triton_backend_launches_its_kernels_and_the_helpers_on_the_gpu(cuda_single_rank):
    launches = _triton_launches_of_a_training_step("triton")
    assert _HELPERS <= set(launches), dict(launches)
    assert any("fwd" in name for name in launches) and any("bwd" in name for name in launches)
