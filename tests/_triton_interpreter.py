"""Triton's CPU interpreter, patched once per launch instead of once per device-function call.

Under ``TRITON_INTERPRET=1`` every call of a ``@triton.jit`` helper from a kernel runs
``triton.runtime.interpreter._patch_lang`` again: it walks ``triton.language`` with
``inspect.getmembers`` (about 1.6 ms a call) to swap builtins that the launch has already
swapped, so the walk finds nothing left to patch. The MSA kernels call small helpers
(``nemo_msa/triton/tiles.py``) thousands of times per launch, and the walk took about a third
of the kernel tests' time. Here a helper call skips the walk when every ``triton.language``
module its globals name was patched by the running launch; anything else goes through as before.

Two per-operation costs of Triton 3.6's interpreter go too (on triton 3.6 only, whose internals
they were written against): the Triton -> numpy dtype map, which built a dict on each of its
~10^5 calls per launch, is looked up in one built once; and the name string of a tuple type,
which every shape tuple built and almost nothing reads, is built when read. Together they took
35-45% of a kernel test's time.
"""

from __future__ import annotations

import threading


def install() -> None:
    """Wraps the interpreter's launch and patch functions; a second call does nothing."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_patched_once_per_launch", False):
        return
    patch_lang = interpreter._patch_lang
    launch = interpreter.GridExecutor.__call__
    state = threading.local()

    def _languages(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_lang_once(fn):
        patched = getattr(state, "patched", None)
        languages = _languages(fn)
        if patched is not None and languages <= patched:
            return interpreter._LangPatchScope()  # nothing swapped, nothing to restore
        scope = patch_lang(fn)
        if patched is not None:
            patched |= languages
        return scope

    def launch_patching_once(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.patched = outer

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_patching_once
    if triton.__version__.split(".")[:2] == ["3", "6"]:
        interpreter._get_np_dtype = _np_dtype_cached(interpreter._get_np_dtype)
        tl.core.tuple_type.__init__ = _tuple_type_init
        tl.core.tuple_type.name = property(_tuple_type_name)
    interpreter._patched_once_per_launch = True


def _np_dtype_cached(np_dtype):
    """The interpreter's Triton -> numpy dtype map, which builds a 19-entry dict on each of its
    ~10^5 calls per launch, looked up in a dict built once."""
    import numpy as np
    import triton.language as tl

    by_name: dict[str, np.dtype] = {}
    pointer = np.dtype(np.uint64)

    def cached(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        found = by_name.get(tt_dtype.name)
        if found is None:
            found = by_name[tt_dtype.name] = np_dtype(tt_dtype)
        return found

    return cached


def _tuple_type_init(self, types, fields=None):
    # As triton.language.core.tuple_type's, less the name string, which every shape tuple built
    # and almost nothing reads; _tuple_type_name builds it when read.
    self.types = types
    self.fields = fields or [""] * len(types)


def _tuple_type_name(self) -> str:
    return "[" + ",".join(f"{k}:{v}" for k, v in zip(self.fields, self.types, strict=True)) + "]"
