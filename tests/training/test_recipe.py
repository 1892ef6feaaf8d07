"""Recipe loading, overrides and the documented error messages (no training)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import cli, train

from nemo_msa.training.recipe import (
    DEFAULT_RECIPE,
    RECIPES_DIR,
    RecipeError,
    check_parallel_layout,
    load_recipe,
    parse_split,
)

REPO = Path(__file__).resolve().parents[2]


def test_default_recipe_is_msa_tiny_and_overrides_apply():
    recipe = load_recipe(None, ["train.train_iters=7", "optimizer.lr=1e-3", "model.msa_topk=2",
                                "dataset.data_path=null", "+logger.plot=false"])
    assert recipe.source == str(DEFAULT_RECIPE)
    assert recipe.train.train_iters == 7
    assert recipe.optimizer["lr"] == pytest.approx(1e-3)
    assert recipe.model["msa_topk"] == 2
    assert recipe.logger.plot is False
    # GPTModel arguments are split off the TransformerConfig fields.
    assert recipe.gpt.seq_length == 512 and "seq_length" not in recipe.model


@pytest.mark.parametrize("name", ["msa_tiny.yaml", "minimax_m3_msa.yaml", "minimax_m3_tiny.yaml",
                                  "minimax_m3_msa_1m_cp8.yaml", "msa_pp2_vpp2_tp2.yaml"])
def test_shipped_recipes_make_valid_msa_configs(name):
    import torch

    from nemo_msa.training.build import build_config
    from nemo_msa.training.setup import RunContext

    recipe = load_recipe(RECIPES_DIR / name)
    # As on a GPU node (no CPU restrictions): the config class validates every field.
    config = build_config(recipe, RunContext(0, 1, torch.device("cpu"), False, False))
    assert type(config).__name__ == "MSATransformerConfig"
    if name == "minimax_m3_msa.yaml":
        assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (
            64, 4, 128)
        assert (config.msa_num_index_heads, config.msa_index_head_dim, config.msa_block_size,
                config.msa_topk) == (4, 128, 128, 16)
        assert recipe.gpt.rotary_base == 5_000_000 and recipe.gpt.rotary_percent == 0.5
        # MiniMax-M3's block through Megatron's own fields.
        assert config.num_layers == 60 and config.moe_layer_freq == [0] * 3 + [1] * 57
        assert config.msa_layer_flags == (False,) * 3 + (True,) * 57
        assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size,
                config.moe_shared_expert_intermediate_size) == (128, 4, 3072, 3072)
        assert (config.moe_router_score_function, config.moe_router_enable_expert_bias,
                config.moe_router_topk_scaling_factor) == ("sigmoid", True, 2.0)
        assert config.activation_func.__name__ == "quick_gelu"
        assert (config.activation_func_clamp_value, config.glu_linear_offset) == (7.0, 1.0)
        assert config.layernorm_zero_centered_gamma and config.layernorm_epsilon == 1e-6
        # TP x PP = 8 GPUs per replica, EP=32 over PP=4: 128 GPUs at least (DP 16, 32).
        for world in (128, 256):
            assert check_parallel_layout(recipe.model, world, recipe.train.global_batch_size,
                                         recipe.train.micro_batch_size, config.num_layers)
        with pytest.raises(RecipeError, match="'model.expert_model_parallel_size' = 32"):
            check_parallel_layout(recipe.model, 64, recipe.train.global_batch_size,
                                  recipe.train.micro_batch_size, config.num_layers)


def test_cpu_refuses_what_megatron_cannot_run_there():
    import torch

    from nemo_msa.training.build import build_config
    from nemo_msa.training.setup import RunContext

    cpu = RunContext(0, 1, torch.device("cpu"), True, False)
    with pytest.raises(RecipeError, match=r"'model.bf16' = True: expected false on the CPU"):
        build_config(load_recipe(None, ["model.bf16=true"]), cpu)
    m3 = load_recipe(RECIPES_DIR / "minimax_m3_tiny.yaml",
                     ["model.moe_token_dispatcher_type=alltoall"])
    with pytest.raises(RecipeError, match=r"^the model section cannot run on the CPU: config.moe_"
                                          r"token_dispatcher_type='alltoall' is not supported"):
        build_config(m3, cpu)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.mtp_num_layers=0"], r"'model.mtp_num_layers' = 0: expected 0 < value"),
    (["model.mtp_hybrid_override_pattern=M"], r"'model.mtp_hybrid_override_pattern' = 'M': "
                                              r"expected null"),
    (["model.mtp_detach_heads=true"], r"'model.mtp_detach_heads' = True: expected false without "
                                      r"model.mtp_num_layers"),
    (["model.mtp_num_layers=1", "model.recompute_granularity=full",
      "model.recompute_method=uniform", "model.recompute_num_layers=2"],
     r"'model.recompute_num_layers' = 2: expected 1 with model.mtp_num_layers"),
    (["model.experimental_attention_variant=dsa"],
     r"'model.experimental_attention_variant' = 'dsa': expected null \(the MSA spec builds"),
    (["model.tensor_model_parallel_size=2"],
     r"'model.sequence_parallel' = False: expected true with model.num_moe_experts and "
     r"tensor_model_parallel_size = 2"),
    (["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
     r"'model.sequence_parallel' = True: expected false with model.transformer_impl = 'local'"),
])
def test_megatron_fields_the_trainer_cannot_run_are_refused_at_load(overrides, message):
    """Fields Megatron's config accepts but this trainer's model cannot run: one line at load,
    not a traceback at the first step or a silently ignored key (issue 62)."""
    with pytest.raises(RecipeError, match=message) as err:
        load_recipe(RECIPES_DIR / "minimax_m3_tiny.yaml", overrides)
    assert "\n" not in str(err.value)


def test_msa_refusals_are_recipe_errors_before_the_model_is_built(tmp_path):
    """Issue #48: the MSA layers' gate refused fused RoPE (or a backend this device cannot run)
    from inside Megatron's module construction, as a traceback; it now runs once before."""
    with pytest.raises(RecipeError, match=r"^the model section cannot be built with MSA layers "
                                          r"here: MSA attention does not support "
                                          r"fused_single_qkv_rope=True"):
        train(["model.fused_single_qkv_rope=true", f"logger.output_dir={tmp_path}"])


def test_unknown_key_names_key_section_and_valid_keys():
    with pytest.raises(RecipeError) as err:
        load_recipe(None, ["model.hiden_size=64"])
    msg = str(err.value)
    assert "'model.hiden_size' is unknown" in msg
    assert "Did you mean 'hidden_size'" in msg
    assert "Valid keys of section 'model'" in msg and "msa_topk" in msg


def test_unknown_section_and_malformed_override():
    with pytest.raises(RecipeError, match=r"recipe section 'trian' is unknown.*'train'"):
        load_recipe(None, ["trian.train_iters=3"])
    with pytest.raises(RecipeError, match=r"not of the form section.key=value"):
        load_recipe(None, ["train.train_iters"])
    with pytest.raises(RecipeError, match=r"must name a section and a field"):
        load_recipe(None, ["train_iters=3"])


def test_bad_values_are_named():
    with pytest.raises(RecipeError, match=r"'train.global_batch_size' = 3: expected a positive "
                                          r"multiple of train.micro_batch_size \(2\)"):
        load_recipe(None, ["train.micro_batch_size=2", "train.global_batch_size=3"])
    with pytest.raises(RecipeError, match=r"'scheduler.lr_warmup_iters' = 9"):
        load_recipe(None, ["train.train_iters=5", "scheduler.lr_warmup_iters=9"])
    with pytest.raises(RecipeError, match=r"'optimizer.min_lr' = 0.003: expected <= "
                                          r"optimizer.lr \(0.001\)"):
        load_recipe(None, ["optimizer.lr=1e-3", "optimizer.min_lr=3e-3"])
    with pytest.raises(RecipeError, match=r"use_checkpoint_opt_param_scheduler' = True: expected "
                                          r"false when scheduler.override_opt_param_scheduler"):
        load_recipe(None, ["scheduler.override_opt_param_scheduler=true",
                           "scheduler.use_checkpoint_opt_param_scheduler=true"])
    with pytest.raises(RecipeError, match=r"recipe file '.*nope.yaml' does not exist"):
        load_recipe("nope.yaml")


def test_parallel_layout_must_divide_world_size():
    model = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    with pytest.raises(RecipeError, match=r"tensor_model_parallel_size=2 x "
                                          r"pipeline_model_parallel_size=2 x "
                                          r"context_parallel_size=1 = 4, but the world size is 6"):
        check_parallel_layout(model, 6, 8, 1, 4)
    assert check_parallel_layout(model, 8, 8, 1, 4) == 2
    with pytest.raises(RecipeError, match=r"'model.num_layers' = 6: expected a multiple of"):
        check_parallel_layout({**model, "virtual_pipeline_model_parallel_size": 2}, 4, 8, 1, 6)


def test_missing_dataset_path_is_named(tmp_path):
    from nemo_msa.training.data import build_train_dataset

    recipe = load_recipe(None, [f"dataset.data_path=[{tmp_path}/corpus]"])
    with pytest.raises(RecipeError, match=r"dataset prefix '.*corpus' has no .*corpus.bin and "
                                          r"no .*corpus.idx"):
        build_train_dataset(recipe.dataset, recipe.gpt, 1, 8)


def test_cli_reports_bad_key_and_exits_2(capsys):
    assert cli("model.hiden_size=64") == 2
    assert "error: recipe key 'model.hiden_size' is unknown" in capsys.readouterr().err


def test_cli_out_of_memory_is_one_line_naming_the_sizes_and_exits_1(tmp_path, capsys):
    # A feed-forward of 2**40 channels: the CPU allocator refuses its first weight at once.
    # (In this process, a traceback would be the exception escaping main(): the test fails.)
    code = cli("model.ffn_hidden_size=1099511627776", f"logger.output_dir={tmp_path}",
               "logger.progress_bar=false")
    stderr = capsys.readouterr().err
    assert code == 1, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-2000:]
    assert errors[0].startswith("error: out of memory (") and "can't allocate memory" in errors[0]
    assert "model.ffn_hidden_size=1099511627776" in errors[0]
    assert "expected a model, sequence and micro batch that fit" in errors[0]


@pytest.mark.parametrize("override, message", [
    ("train.train_iters=3.5", r"'train.train_iters' = 3.5: expected an integer \(int\), got float"),
    ("train.train_iters=abc", r"'train.train_iters' = 'abc': expected an integer \(int\), got str"),
    ("optimizer.lr=abc", r"'optimizer.lr' = 'abc': expected null or a number \(float\), got str"),
    ("model.hidden_size=abc", r"'model.hidden_size' = 'abc': expected an integer \(int\), got str"),
    ("model.bf16=1", r"'model.bf16' = 1: expected true or false \(bool\), got int"),
    ("model.activation_func=tanh", r"'model.activation_func' = 'tanh': expected one of 'gelu', "
                                   r"'silu', 'relu', 'squared_relu', 'quick_gelu', got str"),
    ("model.params_dtype=fp8", r"'model.params_dtype' = 'fp8': expected a dtype name \(fp32, "),
    ("model.attention_backend=nope", r"'model.attention_backend' = 'nope': expected one of "
                                     r"'flash', "),
    ("model.transformer_impl=te", r"'model.transformer_impl' = 'te': expected one of 'local', "
                                  r"'transformer_engine'"),
    ("logger.output_dir=[a]", r"'logger.output_dir' = \['a'\]: expected null or a string, "
                              r"got list"),
    ("model.hidden_size=-4", r"'model.hidden_size' = -4: expected 0 < value"),
    ("train.seed=-1", r"'train.seed' = -1: expected 0 <= value"),
    ("optimizer.adam_beta2=1.0", r"'optimizer.adam_beta2' = 1.0: expected 0 <= value < 1"),
    ("model.rotary_percent=1.5", r"'model.rotary_percent' = 1.5: expected 0 < value <= 1"),
    ("checkpoint.keep_last=0", r"'checkpoint.keep_last' = 0: expected 0 < value"),
    ("model.vocab_size=1", r"'model.vocab_size' = 1: expected 2 <= value"),
    ("model.position_embedding_type=foo", r"'model.position_embedding_type' = 'foo': expected "
                                          r"'rope' \(per-document positions\), "
                                          r"'learned_absolute' or 'none'"),
    ("dataset.num_workers=2", r"recipe key 'dataset.num_workers' is unknown"),
    ("scheduler.lr_decay_style=WSD", r"'scheduler.lr_wsd_decay_iters' = None: expected a "
                                     r"positive number of annealing steps"),
    ("optimizer.optimizer=foo", r"'optimizer.optimizer' = 'foo': expected 'adam' or 'sgd'"),
    ("model.init_method_std=-1", r"'model.init_method_std' = -1.0: expected 0 < value"),
    ("dataset.eod_id=256", r"'dataset.eod_id' = 256: expected a token id inside the "
                           r"vocabulary, 0 <= id < model.vocab_size \(256\)"),
    ("dataset.eod_id=-1", r"'dataset.eod_id' = -1: expected a token id inside the vocabulary"),
    ("dataset.split=abc", r"'dataset.split' = 'abc': expected one to three non-negative numbers "
                          r"for train, valid, test separated by ','"),
    ("dataset.split=0,1,0", r"'dataset.split' = '0,1,0': expected .* with a positive first one"),
    ("dataset.split=99,1,0,5", r"'dataset.split' = '99,1,0,5': expected one to three"),
    ("train.train_iters=[1,", r"override 'train.train_iters=\[1,': the value is not valid YAML "
                              r"\(.*did not find expected node content at line \d+, column \d+\)"),
    ("checkpoint.lock_stale_s=0", r"'checkpoint.lock_stale_s' = 0.0: expected 0 < value"),
    ("checkpoint.lock_stale_s=600", r"'checkpoint.lock_stale_s' = 600.0: expected less than "
                                    r"dist.timeout_minutes x 60 = 600 s"),
    ("model.deterministic_mode=true model.cross_entropy_loss_fusion=true",
     r"'model.cross_entropy_loss_fusion' = True: expected false with "
     r"model.deterministic_mode=true"),
])
def test_values_are_typed_and_range_checked(override, message):
    with pytest.raises(RecipeError, match=message) as err:
        load_recipe(None, override.split(" "))
    assert "\n" not in str(err.value)  # one `error:` line in the CLI


def test_fp8_keys_are_checked_before_anything_is_built(monkeypatch):
    """FP8 GEMMs (ADR 0036): Megatron's keys with TE's layers and bf16; FP8 attention, FP8
    without TE's layers, and FP8 where TE does not import are one error line each."""
    from nemo_msa.training import recipe as recipe_module

    fp8 = ["model.fp8=hybrid", "model.bf16=true"]
    cases = [
        (["model.fp8=hybrid"], r"'model.fp8' = 'hybrid': expected null/None with "
                               r"transformer_impl='local'"),
        (["model.transformer_impl=transformer_engine", "model.fp8=e4m3"],
         r"'model.bf16' = False: expected true with model.fp8"),
        (["model.transformer_impl=transformer_engine", *fp8,
          "model.fp8_dot_product_attention=true"],
         r"'model.fp8_dot_product_attention' = True: expected false: the MSA kernels read bf16"),
        (["model.fp8_param=true"], r"'model.fp8_param' = True: expected false without model.fp8"),
        (["model.fp8=bf8"], r"'model.fp8' = 'bf8': expected null or one of 'e4m3', 'hybrid'"),
    ]
    for overrides, message in cases:
        with pytest.raises(RecipeError, match=message):
            load_recipe(None, overrides)
    te = ["model.transformer_impl=transformer_engine", *fp8, "model.fp8_recipe=delayed",
          "model.fp8_amax_history_len=16", "model.fp8_amax_compute_algo=max"]
    monkeypatch.setattr(recipe_module, "te_unavailable_reason", lambda: "no TE here")
    with pytest.raises(RecipeError, match=r"'model.fp8' = 'hybrid': expected null on this "
                                          r"machine: FP8 needs Transformer Engine \(no TE here"):
        load_recipe(None, te)
    monkeypatch.setattr(recipe_module, "te_unavailable_reason", lambda: None)
    recipe = load_recipe(None, te)
    assert (recipe.model["fp8"], recipe.model["fp8_recipe"], recipe.model["fp8_amax_history_len"],
            recipe.model["fp8_amax_compute_algo"]) == ("hybrid", "delayed", 16, "max")


def test_typed_values_are_normalised():
    recipe = load_recipe(None, ["train.train_iters=1e3", "optimizer.lr=1", "dataset.split=100",
                                "dataset.split=98/2", "model.attention_backend=flash"])
    assert recipe.train.train_iters == 1000 and isinstance(recipe.train.train_iters, int)
    assert recipe.optimizer["lr"] == 1.0 and isinstance(recipe.optimizer["lr"], float)
    assert recipe.dataset.split == "98/2"
    assert parse_split("98/2") == [98.0, 2.0, 0.0] and parse_split("100") == [100.0, 0.0, 0.0]


def test_malformed_yaml_is_one_error_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  train_iters: 3\n   x: [1,\n")
    with pytest.raises(RecipeError, match=r"recipe file '.*bad.yaml' is not valid YAML: "
                                          r"mapping values are not allowed in this context at "
                                          r"line 3, column 5$"):
        load_recipe(bad)
    bad.write_text("train:\n  train_iters: 3\n  train_iters: 4\n")
    with pytest.raises(RecipeError, match=r"is not valid YAML: while constructing a mapping: "
                                          r"found duplicate key train_iters at line 3, column 3"):
        load_recipe(bad)


def test_empty_non_mapping_and_binary_recipe_files_are_one_error_line(tmp_path):
    """Issue #29: an empty file, a section that is not a mapping and a binary file each stop
    the run with one line naming the file or key (a ZeroDivisionError and a
    UnicodeDecodeError before)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("")
    with pytest.raises(RecipeError, match=r"recipe file '.*bad.yaml' is empty; expected a YAML "
                                          r"mapping of sections \(model, train, "):
        load_recipe(bad)
    bad.write_text("model: 5\n")
    with pytest.raises(RecipeError, match=r"recipe section 'model' must be a mapping"):
        load_recipe(bad)
    # Issue #48: an override of the section used to replace the 5 (a model of defaults, a
    # ZeroDivisionError when built); so did a falsy body, and a model without its sizes.
    with pytest.raises(RecipeError, match=r"^recipe section 'model' must be a mapping of key: "
                                          r"value, got 5$"):
        load_recipe(bad, ["model.num_layers=2"])
    for body in ("0", "false"):
        bad.write_text(f"train:\n  train_iters: 2\nmodel: {body}\n")
        with pytest.raises(RecipeError, match=r"^recipe section 'model' must be a mapping of "
                                              rf"key: value, got {body.title()}$"):
            load_recipe(bad)
    bad.write_text("train:\n  train_iters: 2\nmodel:\n  num_layers: 2\n  hidden_size: 64\n")
    with pytest.raises(RecipeError, match=r"^recipe key 'model.num_attention_heads' is not set: "
                                          r"expected a positive integer"):
        load_recipe(bad)
    bad.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(RecipeError, match=r"recipe file '.*bad.yaml' is not UTF-8 text"):
        load_recipe(bad)


@pytest.mark.parametrize("value, message", [
    ("[0.7,/data/web_text_document,0.3]", r"item 3 \('0.3'\) is a weight with no prefix after it"),
    ("[0.7x,/data/web,0.3,/data/code]", r"item 1 \('0.7x'\) is not a number where a weight "
                                        r"belongs"),
    ("[0.7,0.3,/data/web,/data/code]", r"item 2 \('0.3'\) is a weight where a dataset prefix "
                                       r"belongs"),
    ("[-1,/data/web]", r"expected non-negative weights, not all zero"),
])
def test_misspelt_weight_list_is_named(value, message):
    from nemo_msa.training.data import build_train_dataset

    recipe = load_recipe(None, [f"dataset.data_path={value}"])
    with pytest.raises(RecipeError, match=r"'dataset.data_path' = .*" + message):
        build_train_dataset(recipe.dataset, recipe.gpt, 1, 8)


def test_data_path_forms():
    from nemo_msa.training.data import parse_data_path

    assert parse_data_path(None) is None and parse_data_path([]) is None
    assert parse_data_path(["/a", "/b"]) == (["/a", "/b"], None)
    assert parse_data_path([0.7, "/a", 0.3, "/b"]) == (["/a", "/b"], [0.7, 0.3])
    assert parse_data_path("0.7 /a 0.3 /b") == (["/a", "/b"], [0.7, 0.3])
    assert parse_data_path("0.7,/a,0.3,/b") == (["/a", "/b"], [0.7, 0.3])


def test_cli_reports_bad_values_on_one_line_and_exits_2():
    """The script as a user starts it (the one CLI test that pays an interpreter start: the
    other ``error:`` lines are checked through its ``main()`` in this process)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "pretrain.py"),
                           "train.train_iters=3.5"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"^error: recipe key 'train.train_iters' = 3.5: expected an integer "
                     r"\(int\), got float$", errors[0]), errors[0]


def test_cli_reports_a_bad_recipe_file_on_one_line_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1,\n")
    code = cli("--recipe", str(bad))
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-2000:]
    assert re.search(r"^error: recipe file '.*bad.yaml' is not valid YAML: ", errors[0]), errors


@pytest.mark.parametrize("key", ["logger.output_dir", "dataset.path_to_cache"])
def test_a_directory_that_cannot_be_created_is_named_before_the_run(tmp_path, key):
    """Issue #48: an output or cache directory under a file was an OSError traceback (the
    output directory only after the first step)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    where = blocker / "runs"
    with pytest.raises(RecipeError, match=rf"^recipe key '{re.escape(key)}' = "
                                          rf"'{re.escape(str(where))}': cannot create the "
                                          r"directory \(Not a directory: .*a_file.*\); expected a "
                                          r"directory this run can create and write to$"):
        train([f"{key}={where}", "checkpoint.save=null"])


def test_a_checkpoint_save_that_names_a_file_is_refused_at_load(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RecipeError, match=rf"^recipe key 'checkpoint.save' = "
                                          rf"'{tmp_path / 'file'}': expected a checkpoint "
                                          r"directory \(or a path to create one at\), but it is "
                                          r"an existing file$"):
        load_recipe(None, [f"checkpoint.save={tmp_path / 'file'}"])
    with pytest.raises(RecipeError, match=rf"but it lies under the file {tmp_path / 'file'}$"):
        load_recipe(None, [f"checkpoint.save={tmp_path / 'file' / 'ckpt'}"])
    assert load_recipe(None, [f"checkpoint.save={tmp_path / 'new' / 'ckpt'}"])
