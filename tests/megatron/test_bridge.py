"""nemo_msa.bridge (ADR 0055): MSA models through Megatron-Bridge's ModelConfig + ModelBuilder.

- The recipes' model config defers its checks to ``finalize()`` (Bridge's contract), which runs
  Megatron's post-init and MSA's: the index heads' default, the ``msa_*`` checks, the refusals of
  MTP and of position embeddings MSA does not run.
- Bridge's GPTModelBuilder builds the tiny recipe's model with MSA attention in every layer, and
  it trains a step (CPU shim, local spec, fp32).
- MiniMax-M3's Hugging Face names (released root ``language_model.``) round-trip through Bridge's
  conversion with :class:`~nemo_msa.bridge.MSAMiniMaxM3Bridge` bit for bit, every text tensor
  and the index branch; the imported model's MSA layers select, and their indexers get
  gradients.

Megatron-Bridge is not a dependency of nemo-msa (ADR 0039): where it (or the Transformer Engine
and the packages it imports) is missing, every test skips with the reason, as in CI.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (not a nemo-msa dependency; ADR 0039, 0055)",
                allow_module_level=True)
try:
    import nemo_msa.bridge as msa_bridge
except Exception as error:  # Bridge installed without what it imports (TE, datasets, ...)
    pytest.skip(f"nemo_msa.bridge does not import: {type(error).__name__}: {error}",
                allow_module_level=True)

from _megatron_harness import MICRO_BATCH, SEQ, packed_batches  # noqa: E402

from nemo_msa.training.recipe import RECIPES_DIR  # noqa: E402


def _tiny(overrides=(), recipe="msa_tiny.yaml"):
    return msa_bridge.model_config_from_recipe(RECIPES_DIR / recipe, list(overrides))


def test_finalize_runs_megatrons_and_msas_post_init():
    model = _tiny()
    assert isinstance(model.transformer, msa_bridge.MSABridgeTransformerConfig)
    assert model.transformer.msa_num_index_heads is None  # deferred, as Bridge's configs
    model.finalize()
    assert model.transformer.msa_num_index_heads == model.transformer.num_query_groups
    hook = model.transformer.experimental_attention_variant_loss_scale_func
    assert hook is not None and hook.__qualname__.startswith("MSAIndexerLossAutoScaler")
    assert model.msa_block_size == 32  # GPTModelConfig forwards the member's fields


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("msa_block_size", 48, ValueError, "msa_block_size=48"),
        ("mtp_num_layers", 1, ValueError, "mtp_num_layers=1: MTP layers are not built with MSA"),
        ("position_embedding_type", "mrope", ValueError,
         "position_embedding_type='mrope'; expected one of"),
    ],
)
def test_finalize_refuses_what_msa_cannot_run(field, value, error, match):
    model = _tiny()
    setattr(model, field, value)  # a recipe override after construction
    with pytest.raises(error, match=match):
        model.finalize()


def _build(model_config) -> torch.nn.Module:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_msa.megatron import cpu_shim

    for name, value in cpu_shim.cpu_config_overrides().items():
        setattr(model_config.transformer, name, value)
    model_config.finalize()
    builder = model_config.get_builder_cls()(model_config)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    (model,) = builder.build_distributed_models(pg, wrap_with_ddp=False,
                                                mixed_precision_wrapper=None)
    return model


def _loss(model, batch) -> torch.Tensor:
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    losses = model(batch["tokens"], positions, attention_mask=batch["packed_seq_ids"],
                   labels=batch["labels"])
    return (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


@pytest.mark.usefixtures("single_rank")
def test_the_builder_builds_the_tiny_recipe_and_it_trains():
    from nemo_msa.megatron import MSASelfAttention, set_training_iteration

    model = _build(_tiny(["model.seq_length=128", "model.vocab_size=96"]))
    attention = [m for m in model.modules() if isinstance(m, MSASelfAttention)]
    assert len(attention) == 4 and all(m.indexer is not None for m in attention)
    set_training_iteration(10)  # past the dense warm-up: the layers select
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = packed_batches(1)[0]
    loss = _loss(model, batch)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert all(grads[n].any() for n in grads if ".indexer." in n)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert float(_loss(model, batch)) < float(loss)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("mlp", ["moe", "dense"])
def test_minimax_m3_hf_round_trip_is_bitwise_with_the_index_branch(tmp_path, mlp):
    """An M3-named checkpoint (the released layout, root ``language_model.``) of the tiny M3
    recipe's model, written by this project's converter (nemo_msa.megatron.hf_convert), is
    imported by Bridge's conversion with MSAMiniMaxM3Bridge into a fresh model: every parameter
    equals the source's bit for bit; the export gives back every tensor bit for bit. Then the
    imported dense-MLP model's MSA layers select and their indexers get gradients. (Megatron's
    MoE router computes its logits with TE's GEMM, a CUDA kernel, wherever TE imports, which
    Bridge needs: benchmarks/bridge_msa.py trains the imported MoE model on the GPU.)"""
    from safetensors.torch import save_file

    from nemo_msa.megatron import set_training_iteration
    from nemo_msa.megatron.hf_convert import megatron_to_hf

    overrides = ["model.seq_length=128", "model.vocab_size=96"]
    if mlp == "dense":
        overrides += ["model.num_moe_experts=null", "model.moe_layer_freq=1",
                      "model.moe_ffn_hidden_size=null",
                      "model.moe_shared_expert_intermediate_size=null"]
    torch.manual_seed(1)
    source = _build(_tiny(overrides, "minimax_m3_tiny.yaml"))
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))  # every tensor distinct from a fresh init
    config = source.config
    hf = megatron_to_hf(source.state_dict(), config, hf_root="language_model.")
    index = [k for k in hf if ".index_" in k]
    assert len(index) == 4 * sum(config.msa_layer_flags), len(index)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "model.safetensors"))

    torch.manual_seed(2)
    target = _build(_tiny(overrides, "minimax_m3_tiny.yaml"))
    msa_bridge.load_minimax_m3_hf(target, tmp_path)
    want = dict(source.named_parameters())
    for name, p in target.named_parameters():
        assert p.dtype == want[name].dtype and torch.equal(p, want[name]), name

    exported = dict(msa_bridge.export_minimax_m3_hf(target, tmp_path))
    assert set(exported) == set(hf), set(exported) ^ set(hf)
    for name, tensor in hf.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    if mlp == "moe":
        return  # the router needs CUDA with TE (above); the dense case trains here
    set_training_iteration(10)  # past the dense warm-up: the imported MSA layers select
    _loss(target, packed_batches(1)[0]).backward()
    indexer = {n: p.grad for n, p in target.named_parameters() if ".indexer." in n}
    assert len(indexer) == 4 * sum(config.msa_layer_flags)
    assert all(g is not None and torch.isfinite(g).all() and g.any() for g in indexer.values())


def test_the_recipes_make_bridge_containers_that_validate():
    """The tiny recipe's ConfigContainer passes Bridge's runtime_config_update (its finalize and
    validation, before Bridge's setup, which needs CUDA); M3's carries its parallel layout."""
    try:
        from megatron.bridge.training.config import runtime_config_update

        from nemo_msa.bridge import recipes
    except Exception as error:  # Bridge's training stack needs more wheels (ADR 0055)
        pytest.skip(f"Bridge's training configs do not import: {type(error).__name__}: {error}")
    cfg = recipes.msa_tiny_pretrain_config(["train.train_iters=7"])
    runtime_config_update(cfg)
    assert cfg.train.train_iters == 7 and cfg.scheduler.lr_decay_iters == 7
    assert cfg.model.transformer.msa_num_index_heads == cfg.model.transformer.num_query_groups
    assert cfg.tokenizer.vocab_size == cfg.model.vocab_size == 256  # recipes/msa_tiny.yaml
    assert cfg.dataset.skip_getting_attention_mask_from_dataset is False
    m3 = recipes.minimax_m3_msa_pretrain_config()
    m3.model.finalize()
    t = m3.model.transformer
    assert (t.num_layers, t.num_moe_experts, t.tensor_model_parallel_size,
            t.pipeline_model_parallel_size, t.expert_model_parallel_size) == (60, 128, 2, 4, 32)
    assert sum(t.msa_layer_flags) == 57 and m3.mixed_precision.bf16
    assert m3.tokenizer.tokenizer_model == recipes.MINIMAX_M3_HF_PATH
