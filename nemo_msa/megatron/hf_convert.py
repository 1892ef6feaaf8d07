"""MiniMax-M3 Hugging Face checkpoint <-> this model's Megatron-Core state dict, whole model.

ADR 0006 maps the MSA index branch; this module maps every tensor of M3's text backbone
(docs/adr/0027-minimax-m3-block.md). ``<r>`` is the checkpoint's root (``""`` for a text-only
checkpoint, ``"language_model."`` for the released vision-language one), ``<i>`` the 0-based
layer on both sides, ``<e>`` the expert:

====================================================  =========================================
Hugging Face (MiniMax-M3)                             Megatron-Core (this project, TP=1)
====================================================  =========================================
<r>model.embed_tokens.weight                          embedding.word_embeddings.weight
<r>model.norm.weight                                  decoder.final_layernorm.weight
<r>lm_head.weight                                     output_layer.weight
..layers.<i>.input_layernorm.weight                   decoder.layers.<i>.input_layernorm.weight
..layers.<i>.self_attn.{q,k,v}_proj.weight            ...self_attention.linear_qkv.weight (fused)
..layers.<i>.self_attn.o_proj.weight                  ...self_attention.linear_proj.weight
..layers.<i>.self_attn.{q,k}_norm.weight              ...self_attention.{q,k}_layernorm.weight
..layers.<i>.self_attn.index_{q,k}_{proj,norm}.weight ...self_attention.indexer.<same>.weight
..layers.<i>.post_attention_layernorm.weight          ...pre_mlp_layernorm.weight
..layers.<i>.mlp.{gate,up}_proj.weight (dense)        ...mlp.linear_fc1.weight (gate rows first)
..layers.<i>.mlp.down_proj.weight (dense)             ...mlp.linear_fc2.weight
..block_sparse_moe.gate.weight                        ...mlp.router.weight
..block_sparse_moe.e_score_correction_bias            ...mlp.router.expert_bias
..block_sparse_moe.experts.<e>.{w1,w3}.weight         ...mlp.experts.local_experts.<e>.linear_fc1
..block_sparse_moe.experts.<e>.w2.weight              ...mlp.experts.local_experts.<e>.linear_fc2
..block_sparse_moe.shared_experts.{gate,up}_proj      ...mlp.shared_experts.linear_fc1 (gate first)
..block_sparse_moe.shared_experts.down_proj           ...mlp.shared_experts.linear_fc2
<r>model.mtp.layers.<k>.{enorm,hnorm}.weight          mtp.layers.<k>.{enorm,hnorm}.weight
<r>model.mtp.layers.<k>.eh_proj.weight                mtp.layers.<k>.eh_proj.weight
<r>model.mtp.layers.<k>.final_layernorm.weight        mtp.layers.<k>.final_layernorm.weight
<r>model.mtp.layers.<k>.transformer_layer.<layer>     mtp.layers.<k>.mtp_model_layer.<layer>
====================================================  =========================================

``linear_qkv`` is Megatron's GQA-interleaved layout: for each KV group g the rows of its
``heads / groups`` query heads, then k_g, then v_g (each head ``kv_channels`` rows). A gated
``linear_fc1`` holds the gate rows, then the up rows (Megatron's GLU takes ``chunk(2)``: the
first half goes through the activation). With ``grouped_experts=True`` the experts are named as
Megatron's grouped GEMM (TE) names them: ``mlp.experts.linear_fc1.weight<e>``; with
``fused_mlp_norm=True`` a dense layer's pre-MLP norm is TE's ``mlp.linear_fc1.layer_norm_weight``
(the TE spec fuses it; the input norm stays separate in this project's specs, ADR 0008).

The multi-token-prediction (MTP) module ``<k>`` (M3 ships one, ``num_mtp_modules: 1``) is
Megatron's ``MultiTokenPredictionLayer``: the norms of the next token's embedding (``enorm``)
and of the hidden state (``hnorm``), ``eh_proj`` [hidden, 2 * hidden] over their concatenation
(embedding first on both sides), one decoder layer of the last layer's kind (``<layer>``: the
names of the table above; MSA with MoE for M3) and ``final_layernorm``; embedding and output
layer are the model's own (docs/adr/0053-mtp-with-msa-layers.md). They are mapped when the
config has ``mtp_num_layers`` (one module with ``mtp_use_repeated_layer``) and skipped on import
otherwise.

Norm weights copy unchanged when the model is ``layernorm_zero_centered_gamma=True`` (M3 stores
them zero-centred, applied as ``1 + w``); otherwise the Megatron weight is ``1 + w``. Tensors
are never cast: the round trip is bitwise (zero-centred models). The functions take full
(TP=1, PP=1, EP=1) state dicts; Megatron's dist-checkpointing reshards from there. The vision
tower and projector of the released checkpoint are not part of the text model and are skipped
on import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nemo_msa.megatron.config import normalize_layer_pattern, normalize_moe_layer_freq

__all__ = ["M3Shapes", "hf_to_megatron", "megatron_to_hf"]

#: Released-checkpoint tensors outside the text model (skipped on import).
_NOT_TEXT = re.compile(r"(^|\.)(vision_tower|multi_modal_projector|patch_merge_mlp)\.")
#: The MTP module's tensors (skipped on import into a model without MTP layers).
_MTP = re.compile(r"(^|\.)model\.mtp\.")


@dataclass(frozen=True)
class M3Shapes:
    """What the conversion needs to know of the model (read from its TransformerConfig)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int | None
    moe_layers: tuple[bool, ...]
    msa_layers: tuple[bool, ...]
    zero_centered_gamma: bool
    #: MTP modules in the state dict (each a layer of the last decoder layer's kind).
    mtp_layers: int = 0

    @classmethod
    def from_config(cls, config) -> M3Shapes:
        """From a (MSA)TransformerConfig; a plain TransformerConfig has no MSA layers."""
        msa = (normalize_layer_pattern(config.msa_layer_pattern, config.num_layers)
               if hasattr(config, "msa_layer_pattern") else (False,) * config.num_layers)
        return cls(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_query_groups or config.num_attention_heads,
            head_dim=config.kv_channels,
            num_experts=config.num_moe_experts,
            moe_layers=normalize_moe_layer_freq(config.moe_layer_freq, config.num_layers,
                                                config.num_moe_experts),
            msa_layers=msa,
            zero_centered_gamma=bool(config.layernorm_zero_centered_gamma),
            mtp_layers=(0 if not getattr(config, "mtp_num_layers", None)
                        else 1 if getattr(config, "mtp_use_repeated_layer", False)
                        else int(config.mtp_num_layers)),
        )


def _layer_names(shapes: M3Shapes, i: int, grouped: bool, fused_mlp_norm: bool = False):
    """``(one_to_one, fused)`` name pairs of layer i.

    one_to_one: list of (hf_suffix, megatron_suffix, is_norm); fused: list of
    (megatron_suffix, kind, [hf_suffix, ...]) with kind "qkv" or "glu".
    """
    # TE's dense MLP fuses its norm into linear_fc1 (TELayerNormColumnParallelLinear).
    pre_mlp = ("mlp.linear_fc1.layer_norm_weight" if fused_mlp_norm and not shapes.moe_layers[i]
               else "pre_mlp_layernorm.weight")
    one = [("input_layernorm.weight", "input_layernorm.weight", True),
           ("post_attention_layernorm.weight", pre_mlp, True),
           ("self_attn.o_proj.weight", "self_attention.linear_proj.weight", False),
           ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", True),
           ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", True)]
    fused = [("self_attention.linear_qkv.weight", "qkv",
              [f"self_attn.{p}_proj.weight" for p in "qkv"])]
    if shapes.msa_layers[i]:
        for p in ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm"):
            one.append((f"self_attn.{p}.weight", f"self_attention.indexer.{p}.weight",
                        p.endswith("norm")))
    if not shapes.moe_layers[i]:
        one.append(("mlp.down_proj.weight", "mlp.linear_fc2.weight", False))
        fused.append(("mlp.linear_fc1.weight", "glu",
                      ["mlp.gate_proj.weight", "mlp.up_proj.weight"]))
        return one, fused
    moe = "block_sparse_moe."
    one += [(moe + "gate.weight", "mlp.router.weight", False),
            (moe + "e_score_correction_bias", "mlp.router.expert_bias", False),
            (moe + "shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight",
             False)]
    fused.append(("mlp.shared_experts.linear_fc1.weight", "glu",
                  [moe + "shared_experts.gate_proj.weight", moe + "shared_experts.up_proj.weight"]))
    for e in range(shapes.num_experts):
        fc1, fc2 = ((f"mlp.experts.linear_fc1.weight{e}", f"mlp.experts.linear_fc2.weight{e}")
                    if grouped else (f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                                     f"mlp.experts.local_experts.{e}.linear_fc2.weight"))
        one.append((f"{moe}experts.{e}.w2.weight", fc2, False))
        fused.append((fc1, "glu", [f"{moe}experts.{e}.w1.weight", f"{moe}experts.{e}.w3.weight"]))
    return one, fused


def _prefixed_layers(shapes: M3Shapes, m: str):
    """``(hf prefix, megatron prefix, layer index)`` of every layer: the decoder's, then each MTP
    module's transformer layer (of the last decoder layer's kind)."""
    for i in range(shapes.num_layers):
        yield f"{m}layers.{i}.", f"decoder.layers.{i}.", i
    for k in range(shapes.mtp_layers):
        yield (f"{m}mtp.layers.{k}.transformer_layer.", f"mtp.layers.{k}.mtp_model_layer.",
               shapes.num_layers - 1)


def _mtp_names(shapes: M3Shapes, m: str):
    """``(hf, megatron, is_norm)`` of the MTP modules' own tensors (norms and ``eh_proj``)."""
    for k in range(shapes.mtp_layers):
        hf, mg = f"{m}mtp.layers.{k}.", f"mtp.layers.{k}."
        for name in ("enorm", "hnorm", "final_layernorm"):
            yield hf + name + ".weight", mg + name + ".weight", True
        yield hf + "eh_proj.weight", mg + "eh_proj.weight", False


def _qkv_fuse(shapes: M3Shapes, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    g, d, h = shapes.num_kv_heads, shapes.head_dim, q.shape[-1]
    per = shapes.num_heads // g
    return torch.cat([q.reshape(g, per * d, h), k.reshape(g, d, h), v.reshape(g, d, h)],
                     dim=1).reshape(-1, h)


def _qkv_split(shapes: M3Shapes, qkv: torch.Tensor):
    g, d, h = shapes.num_kv_heads, shapes.head_dim, qkv.shape[-1]
    per = shapes.num_heads // g
    q, k, v = qkv.reshape(g, (per + 2) * d, h).split([per * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def _check_shape(name: str, tensor: torch.Tensor, rows: int, cols: int | None) -> None:
    want = (rows,) if cols is None else (rows, cols)
    if tuple(tensor.shape) != want:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {want} for this "
                         "model's config")


def hf_to_megatron(
    hf_state_dict: Mapping[str, torch.Tensor],
    config,
    *,
    hf_root: str = "",
    padded_vocab_size: int | None = None,
    grouped_experts: bool = False,
    fused_mlp_norm: bool = False,
) -> dict[str, torch.Tensor]:
    """A MiniMax-M3 checkpoint's text tensors as this model's full Megatron state dict.

    Args:
        hf_state_dict: the checkpoint's tensors (``<hf_root>model.layers.<i>...``).
        config: the model's (MSA)TransformerConfig (layers, heads, experts, MoE / MSA layers,
            ``layernorm_zero_centered_gamma``).
        hf_root: the checkpoint's root ("" text-only, "language_model." the VL release).
        padded_vocab_size: rows of Megatron's embedding and output layer when the vocabulary
            is padded (zero rows appended); None = the checkpoint's vocabulary.
        grouped_experts: name experts as Megatron's grouped GEMM does.
        fused_mlp_norm: the dense layers' pre-MLP norm is TE's fused
            ``mlp.linear_fc1.layer_norm_weight`` (the TE spec), not ``pre_mlp_layernorm.weight``.

    Returns:
        ``{megatron name: tensor}``; load with ``model.load_state_dict(out, strict=False)``
        (only Megatron's ``_extra_state`` entries are absent).

    Raises:
        ValueError: a missing or unexpected checkpoint tensor, or a tensor of the wrong shape
            (named, with the expected shape).
    """
    shapes = M3Shapes.from_config(config)
    left = {k: v for k, v in hf_state_dict.items() if not _NOT_TEXT.search(k)
            and (shapes.mtp_layers or not _MTP.search(k))}
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in left:
            raise ValueError(f"the checkpoint has no tensor {name!r} (hf_root={hf_root!r})")
        return left.pop(name)

    def norm(t: torch.Tensor) -> torch.Tensor:
        return t if shapes.zero_centered_gamma else 1.0 + t

    def vocab(t: torch.Tensor) -> torch.Tensor:
        if padded_vocab_size is None or padded_vocab_size == t.shape[0]:
            return t
        if padded_vocab_size < t.shape[0]:
            raise ValueError(f"padded_vocab_size={padded_vocab_size}; expected >= the "
                             f"checkpoint's vocabulary {t.shape[0]}")
        return torch.cat([t, t.new_zeros(padded_vocab_size - t.shape[0], t.shape[1])])

    m = f"{hf_root}model."
    out["embedding.word_embeddings.weight"] = vocab(take(m + "embed_tokens.weight"))
    out["decoder.final_layernorm.weight"] = norm(take(m + "norm.weight"))
    if f"{hf_root}lm_head.weight" in left:
        out["output_layer.weight"] = vocab(take(f"{hf_root}lm_head.weight"))
    h, d = shapes.hidden_size, shapes.head_dim
    for hf_name, mg_name, is_norm in _mtp_names(shapes, m):
        tensor = take(hf_name)
        if not is_norm:
            _check_shape(hf_name, tensor, h, 2 * h)
        out[mg_name] = norm(tensor) if is_norm else tensor
    for hf, mg, i in _prefixed_layers(shapes, m):
        one, fused = _layer_names(shapes, i, grouped_experts, fused_mlp_norm)
        for hf_name, mg_name, is_norm in one:
            tensor = take(hf + hf_name)
            out[mg + mg_name] = norm(tensor) if is_norm else tensor
        for mg_name, kind, parts in fused:
            tensors = [take(hf + p) for p in parts]
            if kind == "qkv":
                q, k, v = tensors
                _check_shape(hf + parts[0], q, shapes.num_heads * d, h)
                _check_shape(hf + parts[1], k, shapes.num_kv_heads * d, h)
                _check_shape(hf + parts[2], v, shapes.num_kv_heads * d, h)
                out[mg + mg_name] = _qkv_fuse(shapes, q, k, v)
            else:
                gate, up = tensors
                _check_shape(hf + parts[1], up, gate.shape[0], h)
                out[mg + mg_name] = torch.cat([gate, up])
    if left:
        raise ValueError(f"{len(left)} checkpoint tensors are not part of this model's config, "
                         f"e.g. {sorted(left)[:3]}")
    return out


def megatron_to_hf(
    state_dict: Mapping[str, torch.Tensor],
    config,
    *,
    hf_root: str = "",
    vocab_size: int | None = None,
    grouped_experts: bool = False,
    fused_mlp_norm: bool = False,
) -> dict[str, torch.Tensor]:
    """This model's full Megatron state dict under MiniMax-M3's Hugging Face names.

    Args:
        state_dict: a TP=1 ``model.state_dict()`` (``_extra_state`` entries are ignored).
        config: the model's (MSA)TransformerConfig.
        hf_root: the checkpoint's root ("" text-only, "language_model." the VL release).
        vocab_size: the real vocabulary (padding rows are dropped); None keeps every row.
        grouped_experts: experts are named as Megatron's grouped GEMM does.
        fused_mlp_norm: the dense layers' pre-MLP norm is TE's fused
            ``mlp.linear_fc1.layer_norm_weight``.

    Returns:
        ``{hf name: tensor}``; no ``lm_head.weight`` when the embeddings are tied (no
        ``output_layer.weight``).

    Raises:
        ValueError: a missing or unexpected Megatron tensor (named).
    """
    shapes = M3Shapes.from_config(config)
    left = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in left:
            raise ValueError(f"the state dict has no tensor {name!r}")
        return left.pop(name)

    def norm(t: torch.Tensor) -> torch.Tensor:
        return t if shapes.zero_centered_gamma else t - 1.0

    def vocab(t: torch.Tensor) -> torch.Tensor:
        return t if vocab_size is None else t[:vocab_size]

    m = f"{hf_root}model."
    out[m + "embed_tokens.weight"] = vocab(take("embedding.word_embeddings.weight"))
    out[m + "norm.weight"] = norm(take("decoder.final_layernorm.weight"))
    if "output_layer.weight" in left:
        out[f"{hf_root}lm_head.weight"] = vocab(take("output_layer.weight"))
    for hf_name, mg_name, is_norm in _mtp_names(shapes, m):
        tensor = take(mg_name)
        out[hf_name] = norm(tensor) if is_norm else tensor
    for hf, mg, i in _prefixed_layers(shapes, m):
        one, fused = _layer_names(shapes, i, grouped_experts, fused_mlp_norm)
        for hf_name, mg_name, is_norm in one:
            tensor = take(mg + mg_name)
            out[hf + hf_name] = norm(tensor) if is_norm else tensor
        for mg_name, kind, parts in fused:
            tensor = take(mg + mg_name)
            pieces = _qkv_split(shapes, tensor) if kind == "qkv" else tensor.chunk(2)
            for part, piece in zip(parts, pieces, strict=True):
                out[hf + part] = piece.contiguous()
    if left:
        raise ValueError(f"{len(left)} Megatron tensors have no M3 name, e.g. {sorted(left)[:3]}")
    return out
