"""Counts the device work a piece of code launches, on the CPU: aten kernels and Triton launches.

On the GPU every aten op that computes (not a view, not an allocation) launches at least one
kernel, and each launch costs host time and, when the host falls behind, idle GPU time: the
MSA layer's small-kernel overhead (issue #28) is a count before it is a time. :class:`OpCounter`
records, under a ``TorchDispatchMode``, every such aten op and every Triton kernel launch of
the code inside it, forward and backward, each with where it came from:

- the innermost frame of this package's code on the Python stack (``indexer_loss/byproducts.py:
  backward``): custom autograd functions and every forward op of the MSA modules;
- else, inside the autograd engine, the backward node that ran it (``MulBackward0``): the
  backward of a built-in op, attributed to the forward op's node name;
- else ``"other"`` (Megatron, torch.nn code outside this package).

Host synchronizations (``aten::_local_scalar_dense``: ``.item()``, ``bool(tensor)``, a
``.tolist()``) are counted apart, under ``syncs``.

Example::

    with OpCounter() as ops:
        loss = layer(x).sum()
        loss.backward()
    print(ops.table())
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "NO_KERNEL_OPS"]

_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])
#: Frames that are not a site: this module, and the CPU shim's torch-function mode (it wraps
#: every op of a Megatron model on the CPU).
_SKIPPED_FILES = (
    str(Path(__file__).resolve()),
    str(Path(_PACKAGE_DIR) / "megatron" / "cpu_shim.py"),
)

#: Ops that launch no kernel on the GPU (allocation, metadata) and are not views.
NO_KERNEL_OPS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
    "aten::new_empty_strided", "aten::detach", "aten::lift_fresh", "aten::alias",
    "aten::set_", "aten::resize_", "aten::is_same_size", "aten::_has_compatible_shallow_copy_type",
    "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset",
    "aten::is_nonzero", "aten::record_stream",
})


def _package_site() -> str | None:
    """``relative/file.py:function`` of the innermost package frame on the stack (not this
    module's), or None."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE_DIR) and name not in _SKIPPED_FILES:
            rel = name[len(_PACKAGE_DIR) + 1:]
            return f"{rel}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


class OpCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops and Triton launches (see the module docstring).

    Attributes:
        ops: Counter of ``(site, op)``: site as described above, op the aten name
            (``aten::mul``) or ``triton:<kernel name>``.
        syncs: Counter of the sites of host synchronizations (``aten::_local_scalar_dense``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self._patched: list[tuple[type, object]] = []
        # Inside a Triton launch: the interpreter's own host copies are not the program's ops.
        self._in_launch = False

    # ---------------------------------------------------------------- recording
    def _site(self) -> str:
        site = _package_site()
        if site is not None:
            return site
        node = torch._C._current_autograd_node()
        return node.name() if node is not None else "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if self._in_launch:
            pass
        elif name == "aten::_local_scalar_dense":
            self.syncs[self._site()] += 1
        elif not func.is_view and name not in NO_KERNEL_OPS:
            self.ops[(self._site(), name)] += 1
        return func(*args, **(kwargs or {}))

    def _record_triton(self, kernel_name: str) -> None:
        self.ops[(self._site(), f"triton:{kernel_name}")] += 1

    # ---------------------------------------------------------------- Triton launches
    def _patch_triton(self) -> None:
        try:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:  # no Triton: only aten ops are counted
            return
        counter = self
        for cls in (JITFunction, InterpretedFunction):
            original = cls.run

            def run(fn_self, *args, _original=original, **kwargs):
                if counter._in_launch:
                    return _original(fn_self, *args, **kwargs)
                if not kwargs.get("warmup", False):
                    inner = getattr(fn_self, "fn", fn_self)
                    counter._record_triton(getattr(inner, "__name__", type(inner).__name__))
                counter._in_launch = True
                try:
                    return _original(fn_self, *args, **kwargs)
                finally:
                    counter._in_launch = False

            self._patched.append((cls, original))
            cls.run = run

    def __enter__(self):
        self._patch_triton()
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, original in reversed(self._patched):
            cls.run = original
        self._patched.clear()
        return super().__exit__(*exc)

    # ---------------------------------------------------------------- reading
    @property
    def total(self) -> int:
        """Kernel-launching ops recorded (aten and Triton)."""
        return sum(self.ops.values())

    def triton_launches(self) -> collections.Counter:
        """Counter of the Triton kernels launched, by kernel name (every site together)."""
        out: collections.Counter = collections.Counter()
        for (_, op), n in self.ops.items():
            if op.startswith("triton:"):
                out[op.removeprefix("triton:")] += n
        return out

    def by_site(self) -> collections.Counter:
        """Counter of sites (every op of a site together)."""
        out: collections.Counter = collections.Counter()
        for (site, _), n in self.ops.items():
            out[site] += n
        return out

    def count(self, site_prefix: str = "") -> int:
        """Ops whose site starts with ``site_prefix`` (``"indexer_loss/"``: the indexer loss)."""
        return sum(n for (site, _), n in self.ops.items() if site.startswith(site_prefix))

    def table(self, top: int | None = None) -> str:
        """One line per (site, op), most frequent first, then the total and the syncs."""
        rows = self.ops.most_common(top)
        width = max((len(site) for (site, _), _ in rows), default=4)
        lines = [f"{n:5d}  {site:<{width}}  {op}" for (site, op), n in rows]
        lines.append(f"{self.total:5d}  total")
        if self.syncs:
            lines.append(f"syncs: {dict(self.syncs)}")
        return "\n".join(lines)
