"""The MSA indexer: index_q / index_k projections, per-head Gemma RMSNorm, partial RoPE.

For a packed microbatch the indexer turns the (detached) attention input into
``index_q [T, H_local, d_idx]`` and the one shared ``index_k [T, d_idx]``; the selection scores
blocks with them (nemo_msa.select_blocks) and the indexer loss trains them.

Tensor parallelism (docs/adr/0004-indexer-tensor-parallelism.md): index head h serves KV head h,
so ``index_q_proj`` is column-parallel and splits its heads exactly as Megatron splits the KV
heads (rank r holds KV heads and index heads ``[r * H / tp, (r + 1) * H / tp)``).
``index_k_proj``, ``index_k_norm`` and ``index_q_norm`` are replicated on every TP rank. Each
rank's indexer loss covers only its own heads, so the gradient of a replicated parameter is the
sum over TP ranks of the local gradients; the module produces exactly that inside autograd (an
all-reduce in the backward of ``index_k`` and of the q-norm weight), so gradients are right
after ``backward()`` with or without Megatron's DDP and with fused weight-gradient accumulation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import (
    divide,
    get_pg_size,
)

from nemo_msa.context_parallel import ContextParallelLayout
from nemo_msa.megatron.microbatch import pack_sbhd
from nemo_msa.megatron.norms import GemmaRMSNorm, RMSNorm, planned_norm
from nemo_msa.megatron.precision import high_precision_gemms, high_precision_init
from nemo_msa.megatron.rope import RopeFactors, apply_rope, rope_factors

__all__ = [
    "GemmaRMSNorm",
    "RMSNorm",
    "MSAIndexer",
    "MSAIndexerSubmodules",
    "ReplicatedLinear",
]


@dataclass
class MSAIndexerSubmodules:
    """Builders of the indexer's parts (public MiniMax-M3 names in parentheses).

    Attributes:
        index_q_proj: column-parallel linear hidden -> num_index_heads * index_head_dim, no bias
            (``self_attn.index_q_proj``); called like Megatron's ``linear_qkv``.
        index_k_proj: replicated linear hidden -> index_head_dim, no bias
            (``self_attn.index_k_proj``); called with ``parallel_mode="duplicated"``.
        index_q_norm: per-head RMSNorm over index_head_dim (``index_q_norm``); the layer specs
            build :class:`nemo_msa.megatron.norms.RMSNorm`, whose weight convention (``1 + w`` or
            ``w``) follows ``config.layernorm_zero_centered_gamma`` like every norm of the layer.
        index_k_norm: RMSNorm over index_head_dim (``index_k_norm``), the same.
    """

    index_q_proj: ModuleSpec | type | None = None
    index_k_proj: ModuleSpec | type | None = None
    index_q_norm: ModuleSpec | type | None = None
    index_k_norm: ModuleSpec | type | None = None


class ReplicatedLinear(MegatronModule):
    """A bias-free-or-not linear whose weight is the same on every TP rank (local backend).

    The local counterpart of TE's ``TELinear(parallel_mode="duplicated")``; it accepts the same
    keyword arguments so one spec call builds either. Initialised on the CPU from the default
    generator (like Megatron's ``use_cpu_initialization``), hence identical across TP ranks and
    TP sizes for one seed.

    Returns from forward ``(output, bias)`` with ``bias`` None unless ``skip_bias_add``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method,
        bias: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        parallel_mode: str | None = "duplicated",
        tp_comm_buffer_name: str | None = None,
        is_expert: bool = False,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        super().__init__(config=config)
        del tp_comm_buffer_name, tp_group
        if parallel_mode != "duplicated":
            raise ValueError(
                f"ReplicatedLinear supports parallel_mode='duplicated' only; got {parallel_mode!r}"
            )
        if skip_weight_param_allocation or is_expert:
            raise ValueError(
                "ReplicatedLinear does not support skip_weight_param_allocation or is_expert"
            )
        self.input_size = input_size
        self.output_size = output_size
        self.skip_bias_add = skip_bias_add
        weight = torch.empty(output_size, input_size, dtype=torch.float32)
        if config.perform_initialization:
            init_method(weight)
        self.weight = torch.nn.Parameter(
            weight.to(dtype=config.params_dtype, device=_param_device(config))
        )
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(output_size, dtype=config.params_dtype, device=_param_device(config))
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [..., input_size] -> ([..., output_size], bias or None)``."""
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None


def _param_device(config: TransformerConfig) -> torch.device | None:
    # None: torch's default device (the CPU, or "meta" inside ``with torch.device("meta")``).
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


class MSAIndexer(MegatronModule):
    """Index queries and the shared index key of an MSA layer.

    Args:
        config: an MSATransformerConfig (msa_num_index_heads, msa_index_head_dim,
            layernorm_epsilon, init_method, sequence_parallel).
        submodules: the part builders.
        layer_number: the owning layer's number (for logging).
        pg_collection: process groups; ``tp`` decides the head split.
        fused_norms: the index q/k norms run the one-kernel RMSNorm (the owning layer's plan's
            :attr:`~nemo_msa.plan.MSAKernels.rms_norm`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MSAIndexerSubmodules,
        layer_number: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        fused_norms: bool = False,
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp_size = get_pg_size(self.tp_group)
        self.layer_number = layer_number
        self.num_index_heads = config.msa_num_index_heads
        self.index_head_dim = config.msa_index_head_dim
        if self.num_index_heads % tp_size != 0:
            raise ValueError(
                f"msa_num_index_heads={self.num_index_heads} is not divisible by the tensor "
                f"parallel size {tp_size}; index head h must live on the rank of KV head h"
            )
        self.num_index_heads_per_partition = divide(self.num_index_heads, tp_size)
        self.sequence_parallel = bool(config.sequence_parallel) and tp_size > 1

        # The indexer gathers its sequence-parallel input itself (once, for both projections),
        # so its linears see full-sequence input and must not gather again.
        proj_config = copy.copy(config)
        proj_config.sequence_parallel = False

        # bf16 weights and GEMMs inside an FP8 layer: nemo_msa.megatron.precision says why.
        with high_precision_init(config):
            self.index_q_proj = build_module(
                submodules.index_q_proj,
                config.hidden_size,
                self.num_index_heads * self.index_head_dim,
                config=proj_config,
                init_method=config.init_method,
                gather_output=False,
                bias=False,
                skip_bias_add=False,
                is_expert=False,
                tp_comm_buffer_name="index_q",
                tp_group=self.tp_group,
            )
            self.index_k_proj = build_module(
                submodules.index_k_proj,
                config.hidden_size,
                self.index_head_dim,
                config=proj_config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                skip_weight_param_allocation=False,
                parallel_mode="duplicated",
            )
        # The owning layer's plan decides whether the norms run the one-kernel RMSNorm.
        self.index_q_norm = build_module(
            planned_norm(submodules.index_q_norm, fused_norms),
            config=config,
            hidden_size=self.index_head_dim,
            eps=config.layernorm_epsilon,
            tp_group=self.tp_group,
            sum_grad_across_tp=True,
        )
        # index_k's gradient is summed over TP in forward() (after the norm), which covers both
        # index_k_proj and index_k_norm; the norm itself must not reduce again.
        self.index_k_norm = build_module(
            planned_norm(submodules.index_k_norm, fused_norms),
            config=config,
            hidden_size=self.index_head_dim,
            eps=config.layernorm_epsilon,
            tp_group=self.tp_group,
            sum_grad_across_tp=False,
        )

    def forward(
        self, hidden_states: torch.Tensor, layout, rotary_freqs: torch.Tensor | None,
        rope: RopeFactors | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries and keys of the real tokens.

        Args:
            hidden_states: [s_local, b, hidden] attention input; detached here (the indexer loss
                trains only the indexer). With sequence parallelism s_local = s / tp.
            layout: the microbatch's :class:`nemo_msa.MSAMicrobatch` ([b, s] layout), or its
                :class:`nemo_msa.context_parallel.ContextParallelLayout` (context parallelism:
                index_q of this rank's tokens, index_k all-gathered over the CP group, its
                gradient reduce-scattered back).
            rotary_freqs: [Tq, 1, rot_dim] per-token RoPE angles of this rank's tokens (document
                positions), or None for no RoPE.
            rope: the layer call's :class:`nemo_msa.megatron.rope.RopeFactors` of
                ``rotary_freqs`` (its cos/sin shared with the attention's q and k); built here
                from ``rotary_freqs`` when None.

        Returns:
            ``(index_q [Tq, H_local, d_idx], index_k [T, d_idx])`` in the activation dtype (Tq =
            T without context parallelism).
        """
        x = hidden_states.detach()
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False, group=self.tp_group
            )
        # [s, b, h] -> compact [T, h]: the projections skip padding entirely.
        cp = isinstance(layout, ContextParallelLayout)
        x = layout.pack_local(x) if cp else pack_sbhd(layout, x)
        with high_precision_gemms(self.config):
            q, _ = self.index_q_proj(x)
            k, _ = self.index_k_proj(x)
        q = q.view(q.shape[0], self.num_index_heads_per_partition, self.index_head_dim)
        q = self.index_q_norm(q)
        k = self.index_k_norm(k)
        if rope is None:
            rope = rope_factors(rotary_freqs, self.config)
        if rope is not None:
            cp_group = getattr(self.pg_collection, "cp", None)
            q = apply_rope(q, rope, self.config, cp_group)
            k = apply_rope(k.unsqueeze(1), rope, self.config, cp_group).squeeze(1)
        if get_pg_size(self.tp_group) > 1:
            k = copy_to_tensor_model_parallel_region(k, group=self.tp_group)
        if cp:
            # Every rank's keys, in the global compact order; the backward sums every rank's
            # gradient of them back to the owner (reduce-scatter), TP's all-reduce above.
            k = layout.gather(k)
        return q, k
