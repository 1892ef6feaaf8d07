"""The forward step of MSA models under Megatron-Bridge's ``pretrain`` (ADR 0055).

Bridge's GPT step (``megatron.bridge.training.gpt_step``) hands ``attention_mask`` from the
dataset (None for pretraining) to the model. MSA layers read the document map there
(ADR 0005): this step derives it from the microbatch's full token rows (a document ends at its
EOD token, nemo_msa.training.data.packed_seq_ids_from_tokens) before Bridge's pipeline and
context-parallel slicing, so every stage gets the global ids [b, S] (MSA's layout takes them
under context parallelism). THD batches (``cu_seqlens`` from Bridge's packed datasets) keep
Bridge's ``packed_seq_params``, from which the layers build the layout. The step also sets the
training iteration each call, which the dense warm-up reads (``msa_dense_warmup_steps``).

Pipeline stages other than the first and last read the microbatch only where Bridge's
``skip_getting_attention_mask_from_dataset`` is False; nemo_msa.bridge's recipes set it so.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial

import torch
from megatron.bridge.training import gpt_step
from megatron.bridge.training.state import GlobalState

from nemo_msa.megatron.phase import set_training_iteration
from nemo_msa.training.data import packed_seq_ids_from_tokens

__all__ = ["forward_step"]

_PACKED_KEYS = ("cu_seqlens", "cu_seqlens_q")


class _Tap(Iterator):
    """Yields the next microbatch of ``source`` once and keeps its document ids."""

    def __init__(self, source: Iterable, eod: int) -> None:
        self._source = source
        self._eod = eod
        self.document_ids: torch.Tensor | None = None

    def __next__(self) -> dict:
        batch = next(self._source)
        tokens = batch.get("tokens")
        if tokens is not None and not any(batch.get(k) is not None for k in _PACKED_KEYS):
            self.document_ids = packed_seq_ids_from_tokens(tokens, self._eod)
        return batch


def _get_batch_with_document_ids(data_iterator, cfg, use_mtp=False, *, pg_collection,
                                 vp_stage=None, eod: int):
    """Bridge's ``get_batch`` whose ``attention_mask`` is the document map [b, S] (int64, 1, 2,
    ... per document), for BSHD microbatches."""
    tap = _Tap(data_iterator, eod)
    tokens, labels, loss_mask, attention_mask, position_ids, packed = gpt_step.get_batch(
        tap, cfg, use_mtp, pg_collection=pg_collection, vp_stage=vp_stage)
    if tap.document_ids is not None:
        attention_mask = tap.document_ids.cuda(non_blocking=True)
    return tokens, labels, loss_mask, attention_mask, position_ids, packed


def forward_step(state: GlobalState, data_iterator: Iterable, model,
                 return_schedule_plan: bool = False):
    """Bridge's GPT forward step with MSA's document map and training iteration.

    Args:
        state: Bridge's global state (its config, tokenizer and train state).
        data_iterator: the microbatch iterator.
        model: the model chunk.
        return_schedule_plan: Bridge's MoE overlap schedule (passed through).

    Returns:
        ``(output, loss function)`` as ``megatron.bridge.training.gpt_step.forward_step``.
    """
    set_training_iteration(state.train_state.step)
    get_batch = partial(_get_batch_with_document_ids, eod=int(state.tokenizer.eod))
    output, loss_mask = gpt_step._forward_step_common(
        state, data_iterator, model, return_schedule_plan, _get_batch_fn=get_batch)
    checks = state.cfg.rerun_state_machine
    return output, gpt_step._create_loss_function(
        loss_mask, check_for_nan_in_loss=checks.check_for_nan_in_loss,
        check_for_spiky_loss=checks.check_for_spiky_loss)
