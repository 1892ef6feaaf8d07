"""One training step of a tiny MSA GPT model built through Megatron-Bridge (ADR 0039).

Shows how a Megatron-Bridge 0.6.x user plugs nemo-msa's decoder spec into a Bridge-built GPT
model, and checks that it trains: one forward + backward + optimizer step on a random packed
batch (document ids passed as ``attention_mask``, as for Megatron's GPTModel), printing the loss.

Two Bridge entry points, both with nemo-msa's ``get_msa_decoder_block_spec`` as the spec:

- ``--api provider`` (default): :class:`MSAGPTModelProvider`, Bridge's ``GPTModelProvider``
  subclassed together with :class:`~nemo_msa.megatron.MSATransformerConfig`, so the provider
  carries the ``msa_*`` fields; built with ``provide_distributed_model`` (Bridge's ``get_model``).
  Bridge 0.6.2 marks ``ModelProviderMixin`` deprecated in favour of the builder below.
- ``--api builder``: Bridge's ``GPTModelConfig`` (Megatron-LM's ``megatron.training.models.gpt``,
  re-exported by ``megatron.bridge.models.gpt.gpt_builder``) with ``transformer=`` an
  ``MSATransformerConfig``, built with ``GPTModelBuilder.build_distributed_models``.

Both call the spec as ``spec(config, vp_stage=vp_stage)``: the provider with itself, the builder
with the ``GPTModelConfig`` (which forwards unknown attributes to its ``transformer``).

``import megatron.bridge`` needs Transformer Engine (``megatron.bridge.peft.lora_layers`` imports
``transformer_engine.pytorch``), even with ``--transformer-impl local``.

Usage::

    # CPU (one-rank gloo group, nemo_msa's CPU shim, fp32, local spec)
    python benchmarks/bridge_one_step.py --cpu
    # GPU (one-rank NCCL group)
    python benchmarks/bridge_one_step.py --transformer-impl transformer_engine --bf16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

VOCAB = 128
SEQ = 128
MICRO_BATCH = 2


def _msa_provider_class() -> type:
    """Builds :class:`MSAGPTModelProvider` (imports Bridge, so only when asked for)."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    from nemo_msa.megatron import MSATransformerConfig
    from nemo_msa.megatron.layer_specs import get_msa_decoder_block_spec

    @dataclasses.dataclass
    class MSAGPTModelProvider(GPTModelProvider, MSATransformerConfig):
        """Bridge's GPT provider with the ``msa_*`` fields and nemo-msa's decoder spec.

        The MRO is (this, GPTModelProvider, Bridge TransformerConfig, MSATransformerConfig,
        Megatron TransformerConfig, ...): construction runs Bridge's no-op ``__post_init__``
        (Bridge defers Megatron's post-init to ``finalize()``). Bridge's ``finalize`` calls
        Megatron's ``TransformerConfig.__post_init__`` by name, which would skip
        MSATransformerConfig's (``msa_num_index_heads`` default, field checks, the indexer-loss
        scale hook), so ``finalize`` here runs it afterwards.
        """

        transformer_layer_spec: Any = get_msa_decoder_block_spec

        def finalize(self) -> None:
            """Bridge's finalize, then MSATransformerConfig's post-init (re-runs Megatron's)."""
            super().finalize()
            MSATransformerConfig.__post_init__(self)

    return MSAGPTModelProvider


def model_fields(transformer_impl: str, cpu: bool) -> dict[str, Any]:
    """Transformer fields of the tiny model (the test harness's shape; MSA and dense layers).

    Args:
        transformer_impl: "local" or "transformer_engine".
        cpu: add the CPU/gloo overrides of nemo_msa.megatron.cpu_shim.

    Returns:
        Keyword arguments for MSATransformerConfig or the provider.
    """
    fields = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        transformer_impl=transformer_impl,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        msa_index_head_dim=32,
        msa_block_size=16,
        msa_topk=3,
        msa_layer_pattern="SDSS",
        msa_indexer_loss_query_chunk=64,
    )
    if cpu:
        from nemo_msa.megatron import cpu_shim

        fields.update(cpu_shim.cpu_config_overrides())
    return fields


GPT_FIELDS = dict(
    vocab_size=VOCAB,
    seq_length=SEQ,
    position_embedding_type="rope",
    rotary_percent=0.5,
    rotary_base=5_000_000,
    share_embeddings_and_output_weights=False,
)


def build_with_provider(fields: dict[str, Any], cpu: bool, bf16: bool, pg_collection) -> list:
    """The model chunks through ``MSAGPTModelProvider.provide_distributed_model``.

    Args:
        fields: transformer fields (:func:`model_fields`).
        cpu: initialize on the CPU.
        bf16: bf16 parameters (Bridge wraps the model in Float16Module).
        pg_collection: Megatron's process groups.

    Returns:
        The model chunks (one without virtual pipelining).
    """
    provider = _msa_provider_class()(
        **fields,
        **GPT_FIELDS,
        # Fused kernels that need CUDA/Apex; harmless to switch off for a smoke run.
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        cross_entropy_loss_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    provider.finalize()
    return provider.provide_distributed_model(
        wrap_with_ddp=False,
        bf16=bf16,
        use_cpu_initialization=cpu,
        mixed_precision_wrapper=None if cpu else _float16_module(),
        pg_collection=pg_collection,
    )


def build_with_builder(fields: dict[str, Any], cpu: bool, bf16: bool, pg_collection) -> list:
    """The model chunks through Bridge's ``GPTModelConfig`` / ``GPTModelBuilder``.

    Args:
        fields: transformer fields (:func:`model_fields`).
        cpu: initialize on the CPU.
        bf16: bf16 parameters (Float16Module wrapper).
        pg_collection: Megatron's process groups.

    Returns:
        The model chunks (one without virtual pipelining).
    """
    from megatron.bridge.models.gpt.gpt_builder import GPTModelBuilder, GPTModelConfig

    from nemo_msa.megatron import MSATransformerConfig
    from nemo_msa.megatron.layer_specs import get_msa_decoder_block_spec

    dtype = torch.bfloat16 if bf16 else torch.float32
    transformer = MSATransformerConfig(
        **{**fields, "bf16": bf16, "params_dtype": dtype, "use_cpu_initialization": cpu}
    )
    config = GPTModelConfig(
        transformer=transformer, transformer_layer_spec=get_msa_decoder_block_spec, **GPT_FIELDS
    )
    config.finalize()
    # Moves the model to the current GPU unless use_cpu_initialization.
    return GPTModelBuilder(config).build_distributed_models(
        pg_collection,
        wrap_with_ddp=False,
        mixed_precision_wrapper=None if cpu else _float16_module(),
    )


def _float16_module() -> Callable:
    from megatron.core.transformer.module import Float16Module

    return Float16Module


def packed_batch(device: torch.device, seed: int = 7) -> dict[str, torch.Tensor]:
    """A random packed batch: three documents per row and some tail padding (id 0).

    Args:
        device: where the tensors go.
        seed: generator seed.

    Returns:
        tokens, labels, positions, packed_seq_ids (document ids, 0 = padding) and loss_mask.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    ids = torch.zeros(MICRO_BATCH, SEQ, dtype=torch.int64)
    for row in range(MICRO_BATCH):
        bounds = [0, 37 + 5 * row, 90, SEQ - 6 * row]
        for doc in range(3):
            ids[row, bounds[doc] : bounds[doc + 1]] = row * 3 + doc + 1
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ).contiguous()
    batch = {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "positions": positions,
        "packed_seq_ids": ids,
        "loss_mask": (ids > 0).float(),
    }
    return {key: value.to(device) for key, value in batch.items()}


@contextlib.contextmanager
def one_rank_world(cpu: bool) -> Iterator[Any]:
    """A one-rank process group with Megatron's parallel state (gloo + CPU shim with ``cpu``).

    Args:
        cpu: gloo and nemo_msa's CPU shim instead of NCCL on the current GPU.

    Yields:
        Megatron's ProcessGroupCollection.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_msa.megatron import cpu_shim

    owns_group = not torch.distributed.is_initialized()
    with cpu_shim.enabled() if cpu else contextlib.nullcontext():
        if owns_group:
            if cpu:
                cpu_shim.init_gloo_process_group(0, 1)
            else:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                torch.distributed.init_process_group(
                    "nccl", store=torch.distributed.HashStore(), rank=0, world_size=1
                )
        try:
            ps.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(1234)
            yield ProcessGroupCollection.use_mpu_process_groups()
        finally:
            ps.destroy_model_parallel()
            if owns_group:
                torch.distributed.destroy_process_group()


def one_step(
    api: str = "provider", transformer_impl: str = "local", cpu: bool = True, bf16: bool = False
) -> dict[str, Any]:
    """Builds the model through Bridge and runs one forward+backward+AdamW step.

    Args:
        api: "provider" (GPTModelProvider subclass) or "builder" (GPTModelConfig/Builder).
        transformer_impl: "local" or "transformer_engine" (TE layers need CUDA).
        cpu: run on the CPU (gloo, CPU shim, fp32).
        bf16: bf16 parameters (GPU only).

    Returns:
        loss, the loss after the step on the same batch, parameter and MSA-layer counts, and
        whether every trainable parameter got a finite gradient and changed.
    """
    from nemo_msa.megatron import (
        MSAIndexerLossAutoScaler,
        MSAIndexerMetrics,
        MSASelfAttention,
        set_training_iteration,
    )

    if cpu and bf16:
        raise ValueError("--bf16 is for the GPU; the CPU path runs in fp32")
    if cpu and transformer_impl != "local":
        raise ValueError("Transformer Engine layers need CUDA; use --transformer-impl local")
    build = {"provider": build_with_provider, "builder": build_with_builder}[api]
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    try:
        with one_rank_world(cpu) as pg_collection:
            torch.manual_seed(1234)
            (model,) = build(model_fields(transformer_impl, cpu), cpu, bf16, pg_collection)
            params = [p for p in model.parameters() if p.requires_grad]
            before = [p.detach().clone() for p in params]
            optimizer = torch.optim.AdamW(params, lr=1e-3)
            batch = packed_batch(device)

            def loss_fn() -> torch.Tensor:
                per_token = model(
                    batch["tokens"],
                    batch["positions"],
                    attention_mask=batch["packed_seq_ids"],
                    labels=batch["labels"],
                )
                mask = batch["loss_mask"]
                return (per_token.float() * mask).sum() / mask.sum()

            set_training_iteration(0)
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            grads_finite = all(
                p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in params
            )
            optimizer.step()
            changed = all(
                not torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True)
            )
            with torch.no_grad():
                loss_after = loss_fn()
            msa_layers = sum(isinstance(m, MSASelfAttention) for m in model.modules())
            return {
                "api": api,
                "transformer_impl": transformer_impl,
                "device": str(device),
                "dtype": "bf16" if bf16 else "fp32",
                "loss": float(loss),
                "loss_after_step": float(loss_after),
                "parameters": sum(p.numel() for p in params),
                "msa_attention_modules": msa_layers,
                "grads_finite": grads_finite,
                "all_parameters_changed": changed,
            }
    finally:
        MSAIndexerLossAutoScaler.reset()
        MSAIndexerMetrics.reset()
        set_training_iteration(None)


def main() -> None:
    """Command line: prints the step's result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=("provider", "builder"), default="provider")
    parser.add_argument(
        "--transformer-impl", choices=("local", "transformer_engine"), default="local"
    )
    parser.add_argument("--cpu", action="store_true", help="gloo + CPU shim, fp32")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters (GPU)")
    args = parser.parse_args()
    result = one_step(args.api, args.transformer_impl, cpu=args.cpu, bf16=args.bf16)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
