"""nemo_msa.bridge on one GPU (ADR 0055): Bridge's ``pretrain`` and the M3 Hugging Face round trip.

Two checks, each printing one ``RESULT {json}`` line and exiting non-zero when it fails:

- ``pretrain``: ``recipes/msa_tiny.yaml`` through
  :func:`nemo_msa.bridge.recipes.msa_tiny_pretrain_config` and Bridge's ``pretrain`` with
  :func:`nemo_msa.bridge.step.forward_step` (bf16, the TE spec and Triton backend by default;
  ``--iters`` steps). The per-step LM losses are recorded from the step's loss function.
  Passes when every loss is finite and the mean of the last 5 is below the first loss minus 1
  (the CPU run of the same recipe falls from about 5.6 to about 0.1 in 40 steps, README).
- ``roundtrip``: ``recipes/minimax_m3_tiny.yaml``'s model built by Bridge's GPTModelBuilder on
  the GPU (TE spec, grouped-GEMM experts, bf16); its weights, randomized, are written under
  MiniMax-M3's released names by this project's converter, imported into a fresh model by
  Bridge's conversion (:func:`nemo_msa.bridge.load_minimax_m3_hf`) and exported again
  (:func:`nemo_msa.bridge.export_minimax_m3_hf`). Passes when every parameter and every exported
  tensor, index branch included, is bitwise equal, and the imported model's indexers get finite,
  non-zero gradients from one step.

Run under torchrun (Bridge initializes the process group from its environment)::

    torchrun --nproc-per-node 1 benchmarks/bridge_msa.py pretrain --iters 40
    torchrun --nproc-per-node 1 benchmarks/bridge_msa.py roundtrip --out /tmp/m3_hf
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

import nemo_msa.bridge as msa_bridge
from nemo_msa.training.recipe import RECIPES_DIR


def _setup_and_train(cfg, step) -> None:
    """Bridge's ``pretrain`` without its in-process-restart import: the same ``setup`` and
    ``train`` calls (``megatron.bridge.training.pretrain._pretrain``)."""
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.setup import setup
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.train import train

    runtime_config_update(cfg)
    state = GlobalState()
    state.cfg = cfg
    out = setup(state, get_dataset_provider(cfg.dataset))
    train(step, out.model, out.optimizer, out.scheduler, out.train_data_iterator,
          out.valid_data_iterator, out.state, out.checkpoint_manager, out.pg_collection)


def pretrain(iters: int, impl: str, backend: str, out: Path, cpu: bool = False) -> dict:
    """Bridge's pretrain of the tiny recipe; the per-step LM losses and whether they fell.

    ``megatron.bridge.training.pretrain`` imports nvidia-resiliency-ext, whose PyPI release
    (0.4.1) breaks ``import megatron.core`` 0.19.2 (ADR 0055); where it does not import, the
    same ``setup`` + ``train`` run, and the result says so (``entry``, ``pretrain_import``).
    """
    from nemo_msa.bridge.recipes import msa_tiny_pretrain_config
    from nemo_msa.bridge.step import forward_step

    precision = ["model.bf16=false"] if cpu else ["model.bf16=true", "optimizer.clip_grad=1.0"]
    cfg = msa_tiny_pretrain_config([
        f"train.train_iters={iters}", f"model.transformer_impl={impl}",
        f"model.msa_backend={backend}", f"logger.output_dir={out}", *precision,
    ])
    cfg.logger.log_interval = 1
    if cpu:  # one gloo rank under nemo_msa's CPU shim
        from nemo_msa.megatron import cpu_shim

        cpu_shim.install()
        for name, value in cpu_shim.cpu_config_overrides().items():
            setattr(cfg.model.transformer, name, value)
        cfg.dist.distributed_backend = "gloo"
    losses: list[float] = []

    def step(state, data_iterator, model, return_schedule_plan: bool = False):
        output, loss_function = forward_step(state, data_iterator, model,
                                             return_schedule_plan)

        def recorded(output_tensor, *args, **kwargs):
            result = loss_function(output_tensor, *args, **kwargs)
            total, count = result[2]["lm loss"].detach().float().tolist()
            losses.append(total / max(count, 1.0))
            return result

        return output, recorded

    try:
        from megatron.bridge.training.pretrain import pretrain as bridge_pretrain
        entry, why = "pretrain", None
    except Exception as error:  # nvidia-resiliency-ext missing, or one that breaks megatron.core
        entry, why = "setup+train", f"{type(error).__name__}: {error}"
    if entry == "pretrain":
        bridge_pretrain(cfg, step)
    else:
        _setup_and_train(cfg, step)
    tail = sum(losses[-5:]) / max(len(losses[-5:]), 1)
    ok = (len(losses) == iters and all(math.isfinite(x) for x in losses)
          and tail < losses[0] - 1.0)
    return {"check": "pretrain", "ok": ok, "entry": entry, "pretrain_import": why,
            "steps": len(losses), "first": losses[:1], "last5_mean": tail,
            "losses": [round(x, 4) for x in losses]}


def _build(overrides: list[str]):
    from megatron.core.process_groups_config import ProcessGroupCollection

    model_config = msa_bridge.model_config_from_recipe(RECIPES_DIR / "minimax_m3_tiny.yaml",
                                                       overrides)
    model_config.finalize()
    builder = model_config.get_builder_cls()(model_config)
    (model,) = builder.build_distributed_models(
        ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False,
        mixed_precision_wrapper=None)
    return model


def roundtrip(out: Path) -> dict:
    """The M3 Hugging Face round trip through Bridge's conversion, on the GPU with the TE spec."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import save_file

    from nemo_msa.megatron import set_training_iteration
    from nemo_msa.megatron.hf_convert import megatron_to_hf

    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    overrides = ["model.transformer_impl=transformer_engine", "model.bf16=true",
                 "model.moe_grouped_gemm=true", "model.moe_token_dispatcher_type=alltoall"]
    source = _build(overrides)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))
    config = source.config
    hf = megatron_to_hf({k: v.cpu() for k, v in source.state_dict().items()}, config,
                        hf_root="language_model.", grouped_experts=True, fused_mlp_norm=True)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out / "model.safetensors"))

    target = _build(overrides)
    msa_bridge.load_minimax_m3_hf(target, out)
    want = dict(source.named_parameters())
    params_equal = [n for n, p in target.named_parameters() if not torch.equal(p, want[n])]
    exported = dict(msa_bridge.export_minimax_m3_hf(target, out))
    tensors_differ = sorted(n for n, t in hf.items()
                            if n not in exported or not torch.equal(exported[n].cpu(), t))
    extra = sorted(set(exported) - set(hf))

    set_training_iteration(10)  # past the recipe's dense warm-up: the MSA layers select
    # The tiny M3 recipe's vocabulary and row length (256); two documents per row.
    tokens = torch.randint(0, 256, (2, 256), device="cuda")
    ids = torch.tensor([1] * 100 + [2] * 156, device="cuda").expand(2, -1)
    positions = torch.arange(256, device="cuda").expand(2, -1)
    losses = target(tokens, positions, attention_mask=ids, labels=tokens.roll(-1, 1))
    losses.float().mean().backward()
    grads = {n: p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
             for n, p in target.named_parameters() if ".indexer." in n}
    index_ok = bool(grads) and all(g is not None and torch.isfinite(g).all() and bool(g.any())
                                   for g in grads.values())
    index_tensors = sum(".index_" in n for n in hf)
    ok = not params_equal and not tensors_differ and not extra and index_ok
    return {"check": "roundtrip", "ok": ok, "hf_tensors": len(hf), "index_tensors": index_tensors,
            "params_differ": params_equal[:5], "tensors_differ": tensors_differ[:5],
            "extra_exported": extra[:5], "indexer_grads_finite_nonzero": index_ok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=["pretrain", "roundtrip"])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--transformer-impl", default="transformer_engine")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--out", type=Path, default=Path("/tmp/nemo_msa_bridge"))
    parser.add_argument("--cpu", action="store_true",
                        help="pretrain only: one gloo rank, CPU shim, fp32 (local spec, reference)")
    args = parser.parse_args()
    if args.check == "pretrain":
        result = pretrain(args.iters, args.transformer_impl, args.backend, args.out, args.cpu)
    else:
        result = roundtrip(args.out)
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
