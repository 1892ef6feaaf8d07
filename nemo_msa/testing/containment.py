"""One NaN/Inf containment check for any attention callable (tests on the CPU and the GPU).

:func:`check_containment` poisons one (token, KV head) row of K or V, runs the callable forward
and backward and holds it to the float64 rule of :mod:`nemo_msa.testing.nonfinite`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_msa.testing.nonfinite import (
    affected_rows,
    clean_keys,
    contained_attention_f64,
)
from nemo_msa.testing.oracle import rel_err

__all__ = ["check_containment"]


def check_containment(run: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      dout: torch.Tensor, visible: torch.Tensor, scale: float, which: str,
                      token: int, kv_head: int, value: float, tol: float,
                      device: str | torch.device = "cpu") -> None:
    """Asserts the containment rule for ``run(q, k, v) -> out`` with ``which`` ('k' or 'v')
    set to ``value`` at (``token``, ``kv_head``).

    - the set of output rows (token, query head) holding a non-finite value equals the
      float64 oracle's (:func:`contained_attention_f64` on the same poisoned inputs); with NaN
      it is exactly the rows that attend the bad key (:func:`affected_rows`);
    - every other row matches the oracle within ``tol`` (relative norm error);
    - dq of every unaffected row and dk/dv of every key no affected row attends are finite and
      match the oracle on the inputs with the bad entry removed (set to 0, which those
      gradients do not see).

    Args:
        run: the attention under test, differentiable in q, k, v (tensors on ``device``).
        q: [Tq, Hq, d]; k, v: [T, Hkv, d]; dout: [Tq, Hq, d]: host tensors in the dtype to run.
        visible: bool [Hkv, Tq, T] (:func:`~nemo_msa.testing.nonfinite.visible_pairs`).
        scale: softmax scale.
        which, token, kv_head, value: the poisoned entry.
        tol: bound on the relative norm errors.
        device: where ``run`` gets its inputs.
    """
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if which == "k" else bad_v)[token, kv_head] = value
    inputs = [x.detach().to(device).clone().requires_grad_(True) for x in (q, bad_k, bad_v)]
    out = run(*inputs)
    out.backward(dout.to(device))
    out = out.detach().cpu()
    dq, dk, dv = (x.grad.cpu() for x in inputs)

    affected = affected_rows(visible, token, kv_head, q.shape[1])
    oracle, _ = contained_attention_f64(q, bad_k, bad_v, visible, scale)
    expected = ~torch.isfinite(oracle).all(-1)  # [Tq, Hq]
    if value != value:  # NaN: exactly the rows that attend the bad key
        assert torch.equal(expected, affected), "oracle: NaN must reach exactly its attenders"
    assert not (expected & ~affected).any(), "oracle: a non-finite row that does not attend"
    got = ~torch.isfinite(out).all(-1)
    leaked = (got & ~expected).nonzero().tolist()
    lost = (expected & ~got).nonzero().tolist()
    assert not leaked and not lost, (
        f"non-finite rows differ from the oracle's: leaked to (row, head) {leaked[:8]} "
        f"({len(leaked)}), missing at {lost[:8]} ({len(lost)})")
    err = rel_err(out[~expected], oracle[~expected])
    assert err < tol, f"finite rows: rel err {err:.2e}"

    # Gradients of what the bad entry does not reach, against the oracle without it.
    clean = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    with torch.no_grad():
        clean[1 if which == "k" else 2][token, kv_head] = 0.0
    ref, _ = contained_attention_f64(*clean, visible, scale)
    ref.backward(dout.double())
    keys = clean_keys(visible, affected, token, kv_head)
    for name, x, r, keep in (("dq", dq, clean[0].grad, ~affected),
                             ("dk", dk, clean[1].grad, keys), ("dv", dv, clean[2].grad, keys)):
        part = x[keep]
        bad = (~torch.isfinite(part).all(-1)).sum().item()
        assert bad == 0, f"{name}: {bad} unaffected rows are not finite"
        err = rel_err(part, r[keep])
        assert err < tol, f"{name}: unaffected rows, rel err {err:.2e}"
