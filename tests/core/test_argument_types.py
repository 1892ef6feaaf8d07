"""Issue 17, item 6: arguments of the wrong kind are refused at the boundary, not later.

- A bool ``packed_seq_ids`` (a mask, whose polarity would be guessed) -> ValueError naming
  ``padding_mask``.
- Float ``block_size`` / ``init_blocks`` / ``local_blocks`` / ``top_k`` (32.0 passes a range or
  membership check) -> ValueError naming the argument; so do float MSA config fields.
- A source on the meta device, or a ``device`` this machine lacks -> ValueError naming the
  argument (issue #48).
- Writes that bypass ``_version`` (``ids.data``, ``ids.numpy()``) are invisible to the layout
  memo: documented, and pinned down here so that a change of behaviour is noticed.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nemo_msa import MSAMicrobatch, require_msa_support, select_blocks


def test_bool_packed_seq_ids_are_refused_naming_padding_mask():
    mask = torch.zeros(2, 64, dtype=torch.bool)
    mask[1, 50:] = True
    with pytest.raises(ValueError, match=r"packed_seq_ids must hold integer document ids .* got "
                                         r"a bool tensor of shape \(2, 64\)\. For a bool padding "
                                         r"mask \(True = padding, Megatron's convention\) pass it "
                                         r"as padding_mask"):
        MSAMicrobatch.build(packed_seq_ids=mask, block_size=16)
    # The same mask as padding_mask means what Megatron means: True = padding.
    msa = MSAMicrobatch.build(padding_mask=mask, block_size=16)
    assert msa.num_tokens == 64 + 50


@pytest.mark.parametrize("name", ["packed_seq_ids", "attention_mask", "padding_mask"])
def test_a_source_on_the_meta_device_is_refused_naming_it(name):
    dtype = torch.bool if name == "padding_mask" else torch.int64
    source = torch.ones(2, 64, dtype=dtype, device="meta")
    with pytest.raises(ValueError, match=rf"^{name} is on the meta device \(a shape without "
                                         r"data\); expected .* on the CPU or a CUDA device"):
        MSAMicrobatch.build(**{name: source}, block_size=32)


def test_a_device_this_machine_lacks_is_refused_naming_it():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = "cuda" if count == 0 else f"cuda:{count}"
    with pytest.raises(ValueError, match=rf"^device = '{missing}' but this machine has "
                                         rf"{'no' if count == 0 else count} CUDA device"):
        MSAMicrobatch.build(batch_size=2, seq_len=64, device=missing, block_size=32)
    for device, why in (("gpu", "is not a torch device"), ("meta", "expected a device with data")):
        with pytest.raises(ValueError, match=rf"^device = '{device}':? {why}"):
            MSAMicrobatch.build(batch_size=2, seq_len=64, device=device, block_size=32)


@pytest.mark.parametrize("name, value", [
    ("block_size", 32.0), ("block_size", True), ("init_blocks", 0.0), ("local_blocks", 1.5),
])
def test_float_layout_arguments_are_refused(name, value):
    ids = torch.ones(1, 64, dtype=torch.int64)
    kwargs = {"block_size": 32, name: value}
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be an integer; got "
                                         rf"{type(value).__name__}"):
        MSAMicrobatch.build(packed_seq_ids=ids, **kwargs)
    # NumPy integers are integers.
    assert MSAMicrobatch.build(packed_seq_ids=ids, block_size=np.int64(32)).block_size == 32


@pytest.mark.parametrize("top_k", [2.5, 2.0])
def test_float_top_k_is_refused(top_k):
    msa = MSAMicrobatch.build(packed_seq_ids=torch.ones(1, 64, dtype=torch.int64), block_size=16)
    index_q = torch.randn(64, 2, 16)
    index_k = torch.randn(64, 16)
    with pytest.raises(ValueError, match=rf"top_k={top_k!r} must be an integer; got float"):
        select_blocks(index_q, index_k, msa, top_k=top_k)
    assert select_blocks(index_q, index_k, msa, top_k=2).shape == (2, 64, 2)


@pytest.mark.parametrize("field, value", [("msa_block_size", 128.0), ("msa_topk", 2.5)])
def test_float_msa_config_fields_are_refused_by_the_gate(field, value):
    fields = dict(
        num_attention_heads=64, num_query_groups=4, kv_channels=128, hidden_size=6144,
        msa_num_index_heads=4, msa_index_head_dim=128, msa_block_size=128, msa_topk=16,
        msa_init_blocks=0, msa_local_blocks=1, msa_score_type="max", fp8=None, fp4=None,
        apply_rope_fusion=False, fused_single_qkv_rope=False, context_parallel_size=1,
    )
    fields[field] = value
    with pytest.raises(ValueError, match=rf"MSA cannot run {field}={value!r}; expected an "
                                         r"integer"):
        require_msa_support(SimpleNamespace(**fields), backend="reference")


@pytest.mark.parametrize("write", ["data", "numpy"])
def test_writes_that_bypass_version_keep_the_memoized_layout(write):
    """Documented (layout module docstring, README): such writes are invisible to the memo."""
    ids = torch.tensor([[1] * 30 + [2] * 34])
    first = MSAMicrobatch.build(packed_seq_ids=ids, block_size=16)
    version = ids._version
    if write == "data":
        ids.data[0, 10:] = 3
    else:
        ids.numpy()[0, 10:] = 3
    assert ids._version == version  # the counter did not move ...
    assert MSAMicrobatch.build(packed_seq_ids=ids, block_size=16) is first  # ... so: stale
    assert first.cu_seqlens.tolist() == [0, 30, 64]
    # Writing through the tensor itself is seen.
    ids[0, 10:] = 3
    assert MSAMicrobatch.build(packed_seq_ids=ids, block_size=16).cu_seqlens.tolist() == [
        0, 10, 64]
