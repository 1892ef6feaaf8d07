"""What each MSA backend can run, as data: one frozen :class:`MSACapabilities` record per backend.

The bottom of the package with nemo_msa.limits (ADR 0017): the construction-time plan
(nemo_msa.plan), the backend records (nemo_msa.backends.*) and the kernels' launch asserts all
read these records, so that each fact ("the Triton kernels take head dims 16..128") is stated
once (ADR 0019). Nothing here imports Triton or asks the device: the plan passes the device's
compute capability in, so every choice made from these records is a function of its arguments
(and tested on the CPU).

- :data:`REFERENCE`: the plain-PyTorch references, the contract's whole range (nemo_msa.limits)
  and any head dim, any floating dtype (bf16/fp16 in training, fp32/fp64 in the float checks);
  its layer helpers are their torch references;
- :data:`TRITON`: the Triton selection, attention and fused dense indexer loss, with its layer
  helpers' kernels (:data:`TRITON_HELPERS`) and the SM90 Gluon dk/dv kernel
  (:data:`GLUON_DKDV`);
- :data:`FLASHINFER_PREFILL`: flashinfer's SM100/SM103 MSA prefill kernel (the flashinfer
  backend's forward; other shapes run the Triton forward, so that backend declares
  :data:`TRITON`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_msa.limits import MAX_TOP_K, SUPPORTED_BLOCK_SIZES, SUPPORTED_SCORE_TYPES

__all__ = [
    "FLASHINFER_PREFILL",
    "GLUON_DKDV",
    "GluonDkdvLimits",
    "HelperKernel",
    "HelperKernels",
    "MSACapabilities",
    "REFERENCE",
    "TORCH_HELPERS",
    "TRITON",
    "TRITON_BLOCK_SIZES",
    "TRITON_HEAD_DIMS",
    "TRITON_HELPERS",
    "TRITON_INDEX_HEAD_DIMS",
]


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


@dataclass(frozen=True)
class HelperKernel:
    """A kernel a layer runs around the ops in place of its torch reference (the same
    function): what it reads.

    Attributes:
        name: for messages ("the one-kernel RMSNorm").
        dtypes: the input dtypes it reads.
        dims: the sizes of its inputs' last dim it takes (None: any).
        query_subset: it takes a query subset (context parallelism's local queries).
        cuda_only: it runs on a CUDA device only (torch's cuDNN SDPA); otherwise it is a
            Triton kernel, which also runs on the host under Triton's interpreter.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    dims: tuple[int, ...] | None = None
    query_subset: bool = True
    cuda_only: bool = False

    def why_not(self, *, dtype: torch.dtype, dim: int | None = None, query_subset: bool = False,
                cuda: bool = True) -> str | None:
        """Why the kernel does not take inputs of ``dtype`` and last dim ``dim`` (of a query
        subset when ``query_subset``; on a CUDA device when ``cuda``, else on the host under
        the interpreter); None when it does."""
        if self.cuda_only and not cuda:
            return f"{self.name}: a CUDA device only"
        if dtype not in self.dtypes:
            return f"{self.name}: dtype {dtype}, not one of {_dtype_names(self.dtypes)}"
        if dim is not None and self.dims is not None and dim not in self.dims:
            return f"{self.name}: last dim {dim}, not one of {self.dims}"
        if query_subset and not self.query_subset:
            return f"{self.name}: no query subset (context parallelism's local queries)"
        return None


@dataclass(frozen=True)
class HelperKernels:
    """The kernels a layer on a backend runs around the ops; None: the torch reference.

    Attributes:
        rms_norm: the layer's q/k and index RMSNorms (nemo_msa.megatron.norms).
        rope: RoPE of q, k, index_q and index_k (nemo_msa.megatron.rope).
        loss_passes: the sparse indexer loss's passes over the selected slots
            (nemo_msa.indexer_loss.byproducts).
        recall: the sampled selection recall (nemo_msa.indexer_loss.recall).
        dense_attention: the dense path (dense layers, the dense warm-up) per run of
            equal-length documents (nemo_msa.attention.dense).
    """

    rms_norm: HelperKernel | None = None
    rope: HelperKernel | None = None
    loss_passes: HelperKernel | None = None
    recall: HelperKernel | None = None
    dense_attention: HelperKernel | None = None


#: Every helper on its torch reference: the reference backend runs plain PyTorch everywhere.
TORCH_HELPERS = HelperKernels()

#: Head dims (``kv_channels``) of the Triton attention kernels.
TRITON_HEAD_DIMS = (16, 32, 64, 128)
#: Index head dims (``msa_index_head_dim``) of the Triton selection and loss kernels.
TRITON_INDEX_HEAD_DIMS = (16, 32, 64, 128)
#: Key-block sizes (``msa_block_size``) of the Triton kernels.
TRITON_BLOCK_SIZES = (16, 32, 64, 128)

_HALF = (torch.float16, torch.bfloat16)

TRITON_HELPERS = HelperKernels(
    # nemo_msa.triton.rms_norm: one row per program, a power-of-two width (the index heads).
    rms_norm=HelperKernel("the one-kernel RMSNorm", _HALF, dims=(16, 32, 64, 128, 256)),
    # nemo_msa.triton.rope: bf16 only; its fp16 results differed from torch's by one unit in
    # the last place compiled on an H200 (2026-12-04), and bit equality is its contract.
    rope=HelperKernel("the one-kernel RoPE", (torch.bfloat16,)),
    loss_passes=HelperKernel("the by-product loss's Triton passes", _HALF,
                             dims=TRITON_INDEX_HEAD_DIMS),
    recall=HelperKernel("the Triton recall", _HALF, dims=TRITON_HEAD_DIMS, query_subset=False),
    dense_attention=HelperKernel("cuDNN's per-document SDPA", _HALF, query_subset=False,
                                 cuda_only=True),
)


@dataclass(frozen=True)
class GluonDkdvLimits:
    """What the SM90 Gluon dk/dv kernel (nemo_msa.attention.gluon_dkdv, ADR 0042) takes; the
    Triton dk/dv kernel computes the same function everywhere else.

    Attributes:
        compute_capability: the GPU's (major, minor).
        dtype: q/k/v dtype.
        head_dim: ``kv_channels``.
        block_size: ``msa_block_size``.
        group: query heads per KV head.
        triton_versions: the Triton release prefixes whose Gluon API it was written and tested
            against (Gluon changes between releases).
    """

    compute_capability: tuple[int, int]
    dtype: torch.dtype
    head_dim: int
    block_size: int
    group: int
    triton_versions: tuple[str, ...]

    def why_not(self, *, compute_capability: tuple[int, int] | None, dtype: torch.dtype,
                head_dim: int, block_size: int, group: int, triton_version: str) -> str | None:
        """Why the kernel does not run this layer (None when it does); a function of its
        arguments only (``compute_capability`` None: no CUDA device)."""
        if not triton_version.startswith(self.triton_versions):
            return (f"Triton {triton_version}: the Gluon dk/dv kernel was tested with "
                    f"{self.triton_versions}")
        if compute_capability != self.compute_capability:
            return (f"compute capability {compute_capability}: the Gluon dk/dv kernel needs "
                    f"{self.compute_capability}")
        for field, value, wanted in (("params dtype", dtype, self.dtype),
                                     ("kv_channels", head_dim, self.head_dim),
                                     ("msa_block_size", block_size, self.block_size),
                                     ("query heads per KV head", group, self.group)):
            if value != wanted:
                return f"{field}={value}: the Gluon dk/dv kernel takes {wanted}"
        return None


GLUON_DKDV = GluonDkdvLimits(compute_capability=(9, 0), dtype=torch.bfloat16, head_dim=128,
                             block_size=128, group=16, triton_versions=("3.6.",))


@dataclass(frozen=True)
class MSACapabilities:
    """What one implementation runs. Every ``why_not`` answer names the config field.

    Attributes:
        name: who runs it, for messages ("the Triton kernels").
        key: the short name of its forward kernel, as a plan names it (``"triton"``).
        dtypes: q/k/v and index_q/index_k dtypes (the layer's parameter dtype).
        head_dims: attention head dims (``kv_channels``); None: any (the config's contract,
            nemo_msa.limits, still applies to layers).
        index_head_dims: indexer head dims (``msa_index_head_dim``); None: any; empty: no
            selection here.
        block_sizes: key-block sizes (``msa_block_size``).
        top_k: inclusive range of blocks per query (``msa_topk``).
        score_types: block scores of the selection (``msa_score_type``).
        max_group: most query heads per KV head, None for any.
        fused_dense_loss: the fused dense indexer loss (Triton) runs with this backend.
        fused_dense_loss_max_group: most query heads per KV head the fused loss takes.
        block_mass: the sparse forward returns the per-slot block mass and the selection the
            per-slot scores (the indexer loss from by-products, ADR 0016).
        query_subset: the ops take a subset of the queries (context parallelism's
            ``queries=``); declared for the backends that implement it.
        helpers: the kernels a layer on this backend runs around the ops (its norms, RoPE,
            the by-product loss's passes, the recall, the dense path), each with what it reads;
            :data:`TORCH_HELPERS` (the reference backend): their torch references everywhere.
        gluon_dkdv: its backward may take dk/dv from the SM90 Gluon kernel, where
            :data:`GLUON_DKDV` takes the layer (the plan decides; the Triton kernel otherwise).
    """

    name: str
    key: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...] | None
    index_head_dims: tuple[int, ...] | None
    block_sizes: tuple[int, ...]
    top_k: tuple[int, int]
    score_types: tuple[str, ...]
    max_group: int | None = None
    fused_dense_loss: bool = False
    fused_dense_loss_max_group: int = 0
    block_mass: bool = True
    query_subset: bool = False
    helpers: HelperKernels = TORCH_HELPERS
    gluon_dkdv: bool = False

    def why_not(
        self,
        *,
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
        index_head_dim: int | None = None,
        block_size: int | None = None,
        top_k: int | None = None,
        score_type: str | None = None,
        group: int | None = None,
        cp_size: int | None = None,
    ) -> str | None:
        """Why this implementation cannot run a shape, or None when it can.

        Args:
            dtype: the parameters' (q/k/v, index) dtype.
            head_dim: ``kv_channels``.
            index_head_dim: ``msa_index_head_dim``.
            block_size: ``msa_block_size``.
            top_k: ``msa_topk``.
            score_type: ``msa_score_type``.
            group: query heads per KV head (``num_attention_heads / num_query_groups``).
            cp_size: the context-parallel size; above 1 the ops run a query subset (this rank's
                queries against the gathered keys), which needs ``query_subset``.
            Absent (None) arguments are not checked.

        Returns:
            None, or one sentence naming the first field it cannot run, its value and what it
            takes.
        """
        for field, value, allowed in (
            ("msa_score_type", score_type, self.score_types),
            ("kv_channels", head_dim, self.head_dims),
            ("msa_index_head_dim", index_head_dim, self.index_head_dims),
            ("msa_block_size", block_size, self.block_sizes),
        ):
            if value is not None and allowed is not None and value not in allowed:
                return f"{field}={value!r}: {self.name} take one of {allowed}"
        low, high = self.top_k
        if top_k is not None and not low <= top_k <= high:
            return f"msa_topk={top_k}: {self.name} take {low}..{high}"
        if group is not None and self.max_group is not None and group > self.max_group:
            return (f"num_attention_heads / num_query_groups = {group} query heads per KV head: "
                    f"{self.name} take at most {self.max_group}")
        if cp_size is not None and cp_size > 1 and not self.query_subset:
            return (f"context_parallel_size={cp_size}: {self.name} take no query subset (this "
                    "rank's queries against the gathered keys)")
        if dtype is not None and dtype not in self.dtypes:
            return (f"params dtype {dtype} (model.bf16 / model.fp16): {self.name} read "
                    f"{_dtype_names(self.dtypes)}")
        return None

    def why_not_fused_dense_loss(self, *, dtype: torch.dtype, head_dim: int,
                                 index_head_dim: int, block_size: int, group: int,
                                 score_type: str, cp_size: int = 1) -> str | None:
        """Why the fused dense indexer loss does not run with this backend and shape (then the
        chunked reference computes the same function), or None when it does."""
        if not self.fused_dense_loss:
            return f"{self.name} have no fused dense indexer loss"
        if score_type != "max":
            return f"msa_score_type={score_type!r}: the fused dense loss scores blocks by 'max'"
        if group > self.fused_dense_loss_max_group:
            return (f"{group} query heads per KV head: the fused dense loss takes at most "
                    f"{self.fused_dense_loss_max_group}")
        return self.why_not(dtype=dtype, head_dim=head_dim, index_head_dim=index_head_dim,
                            block_size=block_size, cp_size=cp_size)


REFERENCE = MSACapabilities(
    name="the reference (plain PyTorch) ops",
    key="reference",
    dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
    # Any head dim (the ops' direct users and tests run small ones); a layer's config is held to
    # the contract's SUPPORTED_HEAD_DIMS by nemo_msa.support.MSATopology.
    head_dims=None,
    index_head_dims=None,
    block_sizes=SUPPORTED_BLOCK_SIZES,
    top_k=(1, MAX_TOP_K),
    score_types=SUPPORTED_SCORE_TYPES,
    query_subset=True,
)

TRITON = MSACapabilities(
    name="the Triton kernels",
    key="triton",
    dtypes=(torch.bfloat16, torch.float16),
    head_dims=TRITON_HEAD_DIMS,
    index_head_dims=TRITON_INDEX_HEAD_DIMS,
    block_sizes=TRITON_BLOCK_SIZES,
    top_k=(1, 32),
    score_types=("max",),
    fused_dense_loss=True,
    # The fused loss's program holds 16 query tokens x the padded group in 256 rows.
    fused_dense_loss_max_group=16,
    query_subset=True,
    helpers=TRITON_HELPERS,
    gluon_dkdv=True,
)

FLASHINFER_PREFILL = MSACapabilities(
    name="flashinfer's MSA prefill kernel",
    key="flashinfer",
    dtypes=(torch.bfloat16, torch.float16),
    head_dims=(128,),
    index_head_dims=(),
    block_sizes=(128,),
    top_k=(1, 16),
    score_types=(),
    max_group=16,
    block_mass=False,
)
