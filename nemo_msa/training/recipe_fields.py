"""One recipe value against the type of its field: the typed-field check of every recipe key.

:func:`check_field` takes a value as YAML gives it and the type hint of its field (our
dataclasses', TransformerConfig's, OptimizerConfig's, DistributedDataParallelConfig's), and
returns the value as that type or raises one :class:`RecipeError` naming the key, the value and
the expected type, so that ``train.train_iters=3.5`` or ``optimizer.lr=abc`` stops the run with
one line instead of a traceback from deep inside Megatron or torch. :func:`require` is the same
error for the range and consistency rules that a type cannot express.
"""

from __future__ import annotations

import collections.abc
import enum
import math
import types
import typing
from typing import Any, Literal, Union

import torch
import torch.nn.functional as F
from megatron.core import activations


class RecipeError(ValueError):
    """A recipe or an override is invalid; the message names the key, value and expectation."""


#: YAML spellings of torch dtypes (config fields typed ``torch.dtype``).
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
}
#: YAML spellings of ``model.activation_func``.
ACTIVATIONS = ("gelu", "silu", "relu", "squared_relu", "quick_gelu")


def _activation(name: str):
    return {"gelu": F.gelu, "silu": F.silu, "relu": F.relu,
            "squared_relu": activations.squared_relu,
            "quick_gelu": activations.quick_gelu}[name]


class _Mismatch(Exception):
    """A value does not fit a type hint (internal; turned into a RecipeError)."""


def _describe_type(hint: Any) -> str:
    """A reader's name for a type hint: 'an integer', 'null or a number', ..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin is Union or isinstance(hint, types.UnionType):
        names = [_describe_type(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.insert(0, "null")
        return " or ".join(dict.fromkeys(names))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is bool:
        return "true or false (bool)"
    if hint is int:
        return "an integer (int)"
    if hint is float:
        return "a number (float)"
    if hint is str:
        return "a string"
    if hint is list or origin is list:
        return f"a list of {_describe_type(args[0])} items" if args else "a list"
    if hint is tuple or origin is tuple:
        return "a list"
    if hint is dict or origin is dict:
        return "a mapping"
    if hint is torch.dtype:
        return "a dtype name (" + ", ".join(DTYPES) + ")"
    if hint is collections.abc.Callable or origin is collections.abc.Callable:
        return "null (a Python callable cannot be set from a recipe)"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m) for m in hint.__members__)
    return getattr(hint, "__name__", repr(hint))


def _coerce(value: Any, hint: Any, key: str, convert: bool = True) -> Any:
    """``value`` as the type ``hint`` asks for, or raise _Mismatch.

    With ``convert``, integral floats become ints (``1e3`` for an iteration count), ints become
    floats and numbers become strings for string fields; a union first looks for a member the
    value already is (so ``3`` stays an int in ``str | int``). Dtype names, activation names and
    enum member names become the objects they name. Unknown typing constructs accept anything.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is Union or isinstance(hint, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise _Mismatch
        for attempt in ((False, True) if convert else (False,)):
            for arg in args:
                if arg is type(None):
                    continue
                try:
                    return _coerce(value, arg, key, attempt)
                except _Mismatch:
                    continue
        raise _Mismatch
    if origin is Literal:
        for arg in args:
            if value == arg and type(value) is type(arg):
                return value
        raise _Mismatch
    if value is None:
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if (convert and isinstance(value, float) and math.isfinite(value)
                and value.is_integer()):
            return int(value)
        raise _Mismatch
    if hint is float:
        if isinstance(value, float) or (convert and number):
            return float(value)
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        if convert and number:
            return str(value)
        raise _Mismatch
    if hint is list or origin is list or hint is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise _Mismatch
            return tuple(_coerce(v, a, key, convert) for v, a in zip(value, args, strict=True))
        item = args[0] if args else Any
        items = [_coerce(v, item, key, convert) for v in value]
        return tuple(items) if (hint is tuple or origin is tuple) else items
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise _Mismatch
    if hint is torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value in DTYPES:
            return DTYPES[value]
        raise _Mismatch
    if hint is collections.abc.Callable or origin is collections.abc.Callable:
        if key.endswith("activation_func") and isinstance(value, str) and value in ACTIVATIONS:
            return _activation(value)
        if callable(value):
            return value
        raise _Mismatch
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, hint):
            return value
        if isinstance(value, str) and value in hint.__members__:
            return hint[value]
        raise _Mismatch
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch
    check = origin if isinstance(origin, type) else None
    if check is not None and not isinstance(value, check):
        raise _Mismatch
    return value




def _expected(key: str, hint: Any) -> str:
    if key.endswith("activation_func"):
        return "one of " + ", ".join(repr(a) for a in ACTIVATIONS)
    return _describe_type(hint)


def check_field(key: str, value: Any, hint: Any) -> Any:
    """Check one recipe value against its field's type hint and return it as that type.

    Integral floats become ints (``1e3`` for an iteration count), ints become floats and numbers
    become strings for string fields; dtype, activation and enum member names become the
    objects they name.

    Args:
        key: the recipe key, ``section.field`` (named in the error).
        value: the value as YAML gives it.
        hint: the field's type hint; ``Any`` accepts everything.

    Raises:
        RecipeError: ``recipe key 'section.field' = value: expected <type>, got <type>``.
    """
    try:
        return _coerce(value, hint, key)
    except _Mismatch:
        got = "null" if value is None else type(value).__name__
        raise RecipeError(f"recipe key '{key}' = {value!r}: expected "
                          f"{_expected(key, hint)}, got {got}") from None


def require(cond: bool, key: str, value: Any, expectation: str) -> None:
    """Raise ``recipe key 'key' = value: expected <expectation>`` unless ``cond`` holds."""
    if not cond:
        raise RecipeError(f"recipe key '{key}' = {value!r}: expected {expectation}")


__all__ = ["ACTIVATIONS", "DTYPES", "RecipeError", "check_field", "require"]
