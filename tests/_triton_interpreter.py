"""Triton's CPU interpreter, patched once per launch instead of once per device-function call.

Under ``TRITON_INTERPRET=1`` every call of a ``@triton.jit`` helper from a kernel runs
``triton.runtime.interpreter._patch_lang`` again: it walks ``triton.language`` with
``inspect.getmembers`` (about 1.6 ms a call) to swap builtins that the launch has already
swapped, so the walk finds nothing left to patch. The MSA kernels call small helpers
(``nemo_msa/triton/tiles.py``) thousands of times per launch, and the walk took about a third
of the kernel tests' time. Here a helper call skips the walk when every ``triton.language``
module its globals name was patched by the running launch; anything else goes through as before.
"""

from __future__ import annotations

import threading


def install() -> None:
    """Wraps the interpreter's launch and patch functions; a second call does nothing."""
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
    interpreter._patched_once_per_launch = True
