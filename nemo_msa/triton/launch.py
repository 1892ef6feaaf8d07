"""Launch parameters of the Triton MSA kernels: frozen, typed, passed to the launchers.

Each launcher (:func:`~nemo_msa.selection.triton_select.triton_select_blocks`,
:func:`~nemo_msa.attention.triton_fwd.triton_attention_forward`,
:func:`~nemo_msa.attention.triton_bwd.triton_attention_backward`) takes a ``launch`` argument;
when it is None the launcher uses :func:`current_launch`, which is the defaults below unless a
:func:`launch_overrides` block is active. The defaults are the H200 (d = 128, block 128)
schedule of ADR 0003; smaller head dims use a whole block per key tile whatever they say.

Tests and ``benchmarks/bench_msa.py --set KERNEL.KEY=VALUE`` change parameters only through
:func:`launch_overrides`, which validates every key and value and restores the previous
parameters when the block ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


def _check(name: str, ok: bool, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: expected {expected}")


@dataclass(frozen=True)
class SelectLaunch:
    """The selection kernel's launch.

    Attributes:
        bm: query rows per program.
        bn: keys per inner tile (d = 128).
        num_warps: warps per program.
        num_stages: software-pipeline depth of the key loop.
        tma: read the whole key blocks by TMA where the GPU has it (pointer loads elsewhere;
            False forces the pointer loads).
    """

    bm: int = 128
    bn: int = 128
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = True

    def __post_init__(self) -> None:
        _check_fields(self, "sel")


@dataclass(frozen=True)
class ForwardLaunch:
    """The sparse forward's launch: the per-token kernel, the union kernel and the split.

    Tiles of ``union_qt`` tokens of one block whose selected blocks have a union of at most
    ``union_max`` blocks run the union kernel (K/V read once per tile); the other tiles run
    the per-token kernel.

    Attributes:
        bn: per-token kernel: keys per inner tile (d = 128).
        num_warps: per-token kernel: warps.
        num_stages: per-token kernel: pipeline depth.
        union_qt: tokens per union tile; 0 disables the union kernel (per-token only).
        union_max: the largest union (in blocks) the union kernel takes.
        union_warps: union kernel: warps.
        union_bn: union kernel: keys per inner tile (d = 128).
        union_stages: union kernel: pipeline depth.
        union_tma: read the whole blocks before a tile's own block by TMA (Hopper or newer;
            False forces the pointer loads other GPUs take).
        union_own_tma: read the own block by TMA too (no int64 pointer tiles in registers).
        union_maxnreg: register cap per thread of the union kernel (None: Triton's), applied
            only with the own block by TMA (else it spills the pointer tiles); with it two
            8-warp programs share an SM.
        tile_grid_tiles: union tiles per program of the per-token kernel's grid in a hybrid
            launch (1..64); each program does the tokens the union kernel left.
        union_build_tiles: union-list build: tiles per program (a power of two).
        union_build_warps: union-list build: warps (1, 2, 4 or 8).
    """

    bn: int = 128
    num_warps: int = 4
    num_stages: int = 2
    union_qt: int = 8
    union_max: int = 40
    union_warps: int = 8
    union_bn: int = 64
    union_stages: int = 2
    union_tma: bool = True
    union_own_tma: bool = True
    union_maxnreg: int | None = 128
    tile_grid_tiles: int = 1
    union_build_tiles: int = 1
    union_build_warps: int = 1

    def __post_init__(self) -> None:
        _check_fields(self, "fwd")
        _check_grid_and_build(self, "fwd.tile_grid_tiles", self.tile_grid_tiles,
                              "fwd.union_build_tiles", self.union_build_tiles,
                              "fwd.union_build_warps", self.union_build_warps)


@dataclass(frozen=True)
class BackwardLaunch:
    """The sparse backward's launch: dq (per-token and union kernels, as the forward) and the
    KV-outer dk/dv kernel.

    Attributes:
        dq_bn, dq_warps, dq_stages: per-token dq kernel: keys per tile, warps, stages.
        dq_union_qt, dq_union_max, dq_union_warps, dq_union_bn, dq_union_stages,
        dq_union_tma, dq_tile_grid_tiles, dq_union_build_tiles, dq_union_build_warps: as the
            forward's ``union_*`` / ``tile_grid_tiles`` fields, for dq (its union lists are the
            forward's when their tile size is dq's). dq has no flat loop, own block by TMA or
            register cap: with its Q and dO tiles two dq programs do not fit an SM.
        kv_bn: dk/dv: keys per program (a block is split into ``bs / kv_bn`` programs).
        kv_rows: dk/dv: rows per query tile (tokens x padded group).
        kv_warps, kv_stages: dk/dv: warps and stages.
        kv_kernel: dk/dv kernel on SM90 with bf16, d = 128, block 128 and 16 query heads per
            KV head: ``"gluon"`` (:mod:`~nemo_msa.attention.gluon_dkdv`) or ``"triton"``.
    """

    dq_bn: int = 64
    dq_warps: int = 4
    dq_stages: int = 2
    dq_union_qt: int = 8
    dq_union_max: int = 30
    dq_union_warps: int = 8
    dq_union_bn: int = 64
    dq_union_stages: int = 2
    dq_union_tma: bool = True
    dq_tile_grid_tiles: int = 8
    dq_union_build_tiles: int = 1
    dq_union_build_warps: int = 1
    kv_bn: int = 64
    kv_rows: int = 64
    kv_warps: int = 4
    kv_stages: int = 2
    kv_kernel: typing.Literal["triton", "gluon"] = "gluon"

    def __post_init__(self) -> None:
        _check_fields(self, "bwd")
        _check_grid_and_build(self, "bwd.dq_tile_grid_tiles", self.dq_tile_grid_tiles,
                              "bwd.dq_union_build_tiles", self.dq_union_build_tiles,
                              "bwd.dq_union_build_warps", self.dq_union_build_warps)


#: The launch classes by the kernel name of ``--set KERNEL.KEY=VALUE``.
LAUNCH_KINDS: dict[str, type] = {"sel": SelectLaunch, "fwd": ForwardLaunch,
                                 "bwd": BackwardLaunch}

_CURRENT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("msa_triton_launch",
                                                                       default=None)


@functools.cache
def _field_types(cls) -> dict[str, object]:
    # Resolving the string annotations is the costly part of validating a launch.
    return typing.get_type_hints(cls)


def _value_ok(value, hint) -> bool:
    """Whether ``value`` has the field type ``hint`` (bool is not an int here)."""
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    args = typing.get_args(hint)
    if args:  # int | None
        return any(value is None if a is type(None) else _value_ok(value, a) for a in args)
    return isinstance(value, hint)


def _type_name(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    args = typing.get_args(hint)
    if args:
        return " or ".join(_type_name(a) for a in args)
    return "None" if hint is type(None) else hint.__name__


def _check_fields(launch, kind: str) -> None:
    for name, hint in _field_types(type(launch)).items():
        value = getattr(launch, name)
        _check(f"{kind}.{name}", _value_ok(value, hint), value, _type_name(hint))


def _check_grid_and_build(launch, grid_name, grid, tiles_name, tiles, warps_name, warps) -> None:
    _check(grid_name, 1 <= grid <= 64, grid, "an int in 1..64")
    _check(tiles_name, tiles >= 1 and tiles & (tiles - 1) == 0, tiles, "a power of two >= 1")
    _check(warps_name, warps in (1, 2, 4, 8), warps, "1, 2, 4 or 8")


# Built once: the launches are frozen, and every kernel call outside an override reads these.
_DEFAULTS = types.MappingProxyType({kind: cls() for kind, cls in LAUNCH_KINDS.items()})


def _launches() -> Mapping[str, object]:
    current = _CURRENT.get()
    return _DEFAULTS if current is None else current


def current_launch(kind: str):
    """The launch parameters of ``kind`` (``"sel"``, ``"fwd"`` or ``"bwd"``) now in force."""
    return _launches()[kind]


def apply_settings(launches: Mapping[str, object], settings: Mapping[str, object]) -> dict:
    """``launches`` with ``{"KERNEL.KEY": value}`` settings applied (validated).

    Raises:
        ValueError: naming an unknown kernel or key, or a value of the wrong type.
    """
    out = dict(launches)
    by_kind: dict[str, dict] = {}
    for name, value in settings.items():
        kind, _, key = name.partition(".")
        if kind not in LAUNCH_KINDS or key not in _field_types(LAUNCH_KINDS[kind]):
            known = {k: sorted(_field_types(c)) for k, c in LAUNCH_KINDS.items()}
            raise ValueError(f"unknown launch parameter {name!r}: expected KERNEL.KEY with "
                             f"KERNEL.KEY one of {known}")
        by_kind.setdefault(kind, {})[key] = value
    for kind, changes in by_kind.items():
        out[kind] = dataclasses.replace(out[kind], **changes)
    return out


def parse_setting(item: str) -> tuple[str, object]:
    """``"KERNEL.KEY=VALUE"`` -> ``("KERNEL.KEY", value)``; the value is parsed as JSON, and one
    that is not JSON (such as ``triton``) is taken as a string.

    Raises:
        ValueError: for an item without ``=`` or with an empty value.
    """
    name, sep, text = item.partition("=")
    if not sep or not text or "." not in name:
        raise ValueError(f"{item!r}: expected KERNEL.KEY=VALUE")
    try:
        return name, json.loads(text)
    except json.JSONDecodeError:
        return name, text


@contextlib.contextmanager
def launch_overrides(settings: Mapping[str, object] | None = None, *, sel=None, fwd=None,
                     bwd=None) -> Iterator[dict]:
    """Runs the block with other launch parameters; the previous ones come back after it.

    Args:
        settings: ``{"KERNEL.KEY": value}``, e.g. ``{"fwd.union_max": 48}``; applied after
            the instances below.
        sel, fwd, bwd: whole :class:`SelectLaunch` / :class:`ForwardLaunch` /
            :class:`BackwardLaunch` instances to use.

    Yields:
        The launches in force in the block, by kernel name.

    Raises:
        ValueError: naming an unknown key or a bad value, before the block runs.
    """
    launches = dict(_launches())
    for kind, launch in (("sel", sel), ("fwd", fwd), ("bwd", bwd)):
        if launch is not None:
            if not isinstance(launch, LAUNCH_KINDS[kind]):
                raise ValueError(f"{kind}={launch!r}: expected a {LAUNCH_KINDS[kind].__name__}")
            launches[kind] = launch
    launches = apply_settings(launches, settings or {})
    token = _CURRENT.set(launches)
    try:
        yield launches
    finally:
        _CURRENT.reset(token)
