"""Loading instances.yaml: every key, type and value is checked against the schema, and each
mistake is reported as `file:line: what is wrong; valid: ...`.

The file's sections:
  matrix:      optional; the axes several operations have, written once: their values (each
               operation takes the ones it has: kvcache has no mode or dropout)
  rules:       optional; pruning rules shared by the operations: a rule holds for those that
               have every axis it names and, when it names them (`op: [fwd, bwd]`), are among
               its operations
  operations:  one entry per operation (fwd, bwd, kvcache; operations.py says what each is):
    matrix:    optional; the values of its own axes (and of shared ones the top matrix leaves
               out): each axis of an operation is given once, here or in the top matrix; its
               matrix is their cross product
    tiles:     the tile of each (pipeline, arch, hdim_q, hdim_v), and of each value of the
               traits in TILE_TRAIT_SELECTORS that the operation has where an entry names one
               (dtype; fwd: vlayout; kvcache: kv_dtype, paged), with the reason for it: an
               entry without a dtype serves the 16-bit dtypes (fp16, bf16), one for e4m3 names
               it; where the kernel takes one
               (Kernel.full_grid_tile), a second tile for the calls whose units alone fill every
               SM (`full_grid`)
    rules:     optional; its pruning rules, `{when: {axis: value, [values] or {not: either}},
               reason: ...}`
  presets:     named filters over every operation, like CK's receipts; `default` is what a
               plain run builds
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from . import yamllines
from .errors import ConfigError, GeneratorError
from .model import Condition, MatrixPoint, Tile
from .operations import OPERATIONS, Kernel, Operation
from .schema import (BOOL_AXES, CONDITION_AXES, ENUM_AXES, INT_AXES, MATRIX_AXES, Arch, CacheType,
                     DataType, EnumAxis, EnumValue, Pipeline)
from .yamllines import LineList, LineMap

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "instances.yaml"
DEFAULT_PRESET = "default"

# In the order of the file; `operations` and `presets` are required.
_SECTIONS = ("matrix", "rules", "operations", "presets")
_OPERATION_SECTIONS = ("matrix", "tiles", "rules")  # `tiles` is required
_TILE_MATCH_KEYS = ("pipeline", "hdim_q", "hdim_v")
_TILE_SHAPE_KEYS = ("block_m", "block_n", "warps", "stages")
# The traits a tile entry may select its points by, beside arch, in an operation that has them
# (the inputs' dtype; fwd: V's layout, as a row-major e4m3 V takes a second ring of shared
# memory; kvcache: its cache's dtype, and paged or contiguous); an entry without one covers
# each value, but for dtype: an entry without it covers the dtypes of
# UNSELECTED_DTYPE_SIZE-byte elements (fp16, bf16), as a tile chosen for 16-bit inputs says
# nothing of 8-bit ones (other shared-memory bytes, other wgmma k-steps); an e4m3 point takes
# an entry that names e4m3.
TILE_TRAIT_SELECTORS = ("dtype", "vlayout", "kv_dtype", "paged")
UNSELECTED_DTYPE_SIZE = 2


@dataclass(frozen=True)
class Matrix:
    """The values of each axis of an operation's matrix, in its matrix_axes order; `hdim` holds
    (hdim_q, hdim_v) pairs."""

    axes: dict[str, tuple]

    def __getitem__(self, axis: str) -> tuple:
        return self.axes[axis]


@dataclass(frozen=True)
class TileEntry:
    """One row of an operation's `tiles:`: the tile of every point with its pipeline and head
    dims, on its arch or, when arch is not given, on every arch; for an operation with the
    `vlayout` axis (fwd), of its points with that V layout when `vlayout` is given; for one
    with the `kv_dtype` and `paged` axes (kvcache), of its points with that cache dtype when
    `kv_dtype` is given, and of its paged or contiguous points when `paged` is given; of its
    points of that dtype when `dtype` is given, else of its 16-bit ones
    (UNSELECTED_DTYPE_SIZE)."""

    label: str  # its place in the file, operations.fwd.tiles[i], for messages
    pipeline: Pipeline
    arch: Arch | None
    hdim: tuple[int, int]
    tile: Tile
    why: str
    line: int
    paged: bool | None = None
    kv_dtype: CacheType | None = None
    dtype: DataType | None = None
    vlayout: EnumValue | None = None

    def matches(self, point: MatrixPoint) -> bool:
        return (point.pipeline == self.pipeline
                and (self.arch is None or point.arch == self.arch)
                and (point.traits.dtype == self.dtype if self.dtype is not None
                     else point.traits.dtype.size == UNSELECTED_DTYPE_SIZE)
                and (self.vlayout is None or point.traits.vlayout == self.vlayout)
                and (self.kv_dtype is None or point.traits.kv_dtype == self.kv_dtype)
                and (self.paged is None or point.traits.paged == self.paged)
                and (point.traits.hdim_q, point.traits.hdim_v) == self.hdim)


@dataclass(frozen=True)
class Rule:
    """Drops every point for which all its conditions hold."""

    when: tuple[Condition, ...]
    reason: str
    line: int
    label: str  # its place in the file: rules[i] (a shared rule) or operations.fwd.rules[i]

    def matches(self, point: MatrixPoint) -> bool:
        # A loop rather than all() over a generator, which costs one a call: pruning
        # instances.yaml's 104835 points took 0.9-1.0 s of CPU with it, 0.65 s without.
        for condition in self.when:
            if not condition.holds(point):
                return False
        return True

    def applies_to(self, op: Operation) -> bool:
        """Whether the rule can hold for `op`'s points: `op` has every axis it names and is one
        of its operations, when it names them."""
        return all(condition.admits(op.kind) if condition.axis == "op"
                   else condition.axis in op.condition_axes for condition in self.when)


@dataclass(frozen=True)
class Preset:
    name: str
    # Filters in the --filter grammar; the preset selects what any of them selects (a union,
    # as CK's receipts are). "" selects everything.
    filters: tuple[str, ...]
    why: str
    line: int

    @property
    def filter(self) -> str:
        """The filters as one line, for listings: alternatives joined by ' + '."""
        return " + ".join(self.filters)


@dataclass(frozen=True)
class OperationConfig:
    """One entry of `operations:`: an operation's matrix (the shared axes it has included),
    tiles and rules (the shared rules that apply to it first)."""

    op: Operation
    matrix: Matrix
    tiles: tuple[TileEntry, ...]
    rules: tuple[Rule, ...]
    label: str  # operations.fwd
    lines: dict[str, int]  # where the entry, its matrix, tiles and rules start (or the entry)


@dataclass(frozen=True)
class Config:
    file: str  # the path as shown in messages
    digest: str  # sha256 of the bytes it was read from: catalog_cache's key
    # In operations.OPERATIONS's order, whatever the file's.
    operations: dict[str, OperationConfig]
    shared_rules: tuple[Rule, ...]  # also in the rules of each operation they apply to
    presets: dict[str, Preset]
    section_lines: dict[str, int]  # where `matrix:`, `operations:`, ... start

    def error(self, line: int, message: str, details: str = "") -> ConfigError:
        return ConfigError(self.file, line, message, details)


def load(path: Path = DEFAULT_CONFIG) -> Config:
    file = _shown(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise GeneratorError(f"cannot read config {file}: {err.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise ConfigError(file, data.count(b"\n", 0, err.start) + 1,
                          f"not UTF-8: byte {data[err.start]:#04x} at column {column}") from None
    return _Reader(file, hashlib.sha256(data).hexdigest()).config(yamllines.load(text, file))


def _shared_axes(axes: tuple[str, ...], ops: list[Operation], axes_of) -> tuple[str, ...]:
    """Of `axes`, those that the top matrix and the shared rules of a config with the
    operations `ops` may name: an axis several operations have, when one of `ops` has it
    (each takes it where it has it); every axis of a config's only operation."""
    def owners(axis: str, among) -> int:
        return sum(axis in axes_of(op) for op in among)
    return tuple(axis for axis in axes if owners(axis, ops)
                 and (len(ops) == 1 or owners(axis, OPERATIONS.values()) > 1))


def _shown(path: Path) -> str:
    """The path relative to the working directory when it lies below it, as compilers print."""
    relative = os.path.relpath(path)
    return path.as_posix() if relative.startswith("..") else Path(relative).as_posix()


def _yaml_text(value) -> str:
    """A scalar or list as YAML spells it: true, null, 'fp16', [64, 64]."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, list):
        return f"[{', '.join(map(_yaml_text, value))}]"
    return repr(value)


def _describe(value) -> str:
    if value is None:
        return "nothing"
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            LineList: "a list", LineMap: "a mapping"}.get(type(value), type(value).__name__)
    return f"{kind} {_yaml_text(value)}" if isinstance(value, (bool, int, float, str)) else kind


def _full_grid_kernels() -> str:
    """The pipelines whose launchers take a full-grid tile, for messages: `kvcache's fa2`."""
    return ", ".join(f"{op.token}'s {kernel.pipeline.token}" for op in OPERATIONS.values()
                     for kernel in op.kernels if kernel.full_grid_tile)


class _Reader:
    """Turns the loaded YAML into a Config, or a ConfigError at the first mistake.

    Every reader takes (raw value, label, line): the label names the value's place in the file
    (`tiles[1].block_m`) and the line is where it is, for the error message."""

    def __init__(self, file: str, digest: str) -> None:
        self.file = file
        self.digest = digest

    def error(self, line: int, message: str) -> ConfigError:
        return ConfigError(self.file, line, message)

    # -- sections ----------------------------------------------------------------------------

    def config(self, data) -> Config:
        top = self.mapping(data, "", 1, required=("operations", "presets"),
                           optional=("matrix", "rules"), order=_SECTIONS)
        entries = self.mapping(top["operations"], "operations", top.line_of("operations"),
                               optional=tuple(OPERATIONS))
        if not entries:
            raise self.error(entries.line, f"operations: needs at least one operation; valid: "
                                           f"{', '.join(OPERATIONS)}")
        ops = [op for token, op in OPERATIONS.items() if token in entries]
        shared = self.shared_matrix(top, ops)
        shared_rules = ()
        if "rules" in top:
            rules = self.items(top["rules"], "rules", top.line_of("rules"), allow_empty=True)
            shared_rules = tuple(self.rule(item, f"rules[{i}]", line, ops, shared=True)
                                 for i, item, line in rules)
        operations = {op.token: self.operation(op, entries[op.token], entries.line_of(op.token),
                                               shared, shared_rules) for op in ops}
        return Config(
            file=self.file,
            digest=self.digest,
            operations=operations,
            shared_rules=shared_rules,
            presets=self.presets(top["presets"], "presets", top.line_of("presets")),
            section_lines={section: top.line_of(section) for section in _SECTIONS},
        )

    def shared_matrix(self, top: LineMap, ops: list[Operation]) -> dict[str, list]:
        """The top `matrix:`: axis -> (raw values, line), for the axes operations share."""
        if "matrix" not in top:
            return {}
        shared = _shared_axes(MATRIX_AXES, ops, lambda op: op.matrix_axes)
        fields = self.mapping(top["matrix"], "matrix", top.line_of("matrix"), any_key=True)
        for key in fields:
            owners = [op.token for op in ops if key in op.matrix_axes]
            if key in shared:
                continue
            if owners:
                raise self.error(fields.line_of(key), f"matrix: {key} is an axis of "
                                 f"{' and '.join(owners)} only; give it under "
                                 f"operations.{owners[0]}.matrix")
            raise self.error(fields.line_of(key),
                             f"matrix: unknown key {key!r}; valid: {', '.join(shared)}")
        return {axis: (fields[axis], fields.line_of(axis)) for axis in fields}

    def operation(self, op: Operation, data, line: int, shared: dict,
                  shared_rules: tuple[Rule, ...]) -> OperationConfig:
        label = f"operations.{op.token}"
        fields = self.mapping(data, label, line, required=("tiles",),
                              optional=("matrix", "rules"), order=_OPERATION_SECTIONS)
        lines = {"operation": line, **{key: fields.line_of(key) for key in _OPERATION_SECTIONS}}
        matrix = self.matrix(op, fields, label, line, shared)
        tiles = self.items(fields["tiles"], f"{label}.tiles", fields.line_of("tiles"))
        rules = []
        if "rules" in fields:
            items = self.items(fields["rules"], f"{label}.rules", fields.line_of("rules"),
                               allow_empty=True)
            rules = [self.rule(item, f"{label}.rules[{i}]", item_line, [op])
                     for i, item, item_line in items]
        return OperationConfig(
            op=op, matrix=matrix,
            tiles=tuple(self.tile(op, item, f"{label}.tiles[{i}]", item_line)
                        for i, item, item_line in tiles),
            rules=(*(rule for rule in shared_rules if rule.applies_to(op)), *rules), label=label,
            lines=lines)

    def matrix(self, op: Operation, fields: LineMap, label: str, line: int,
               shared: dict) -> Matrix:
        """The operation's matrix: its own `matrix:` and the shared axes."""
        own_label = f"{label}.matrix"
        own = {}
        if "matrix" in fields:
            own = self.mapping(fields["matrix"], own_label, fields.line_of("matrix"),
                               optional=op.matrix_axes)
            for key in own:
                if key in shared:
                    raise self.error(own.line_of(key), f"{own_label}: {key} is given in the top "
                                     f"matrix too (line {shared[key][1]}); give each axis once")
        axes = {}
        for axis in op.matrix_axes:
            if axis in own:
                raw, axis_label, axis_line = own[axis], f"{own_label}.{axis}", own.line_of(axis)
            elif axis in shared:
                (raw, axis_line), axis_label = shared[axis], f"matrix.{axis}"
            else:
                where = fields.line_of("matrix") if "matrix" in fields else line
                raise self.error(where, f"{own_label}: missing field {axis!r} (an axis of "
                                        f"{op.token} that the top matrix does not give)")
            values: list = []
            for _, item, item_line in self.items(raw, axis_label, axis_line):
                value = self.axis_value(axis, item, axis_label, item_line, op)
                if value in values:
                    raise self.error(item_line, f"{axis_label}: {_yaml_text(item)} is listed "
                                                f"twice")
                values.append(value)
            axes[axis] = tuple(values)
        return Matrix(axes)

    def tile(self, op: Operation, data, label: str, line: int) -> TileEntry:
        selectors = ("arch", *(axis for axis in TILE_TRAIT_SELECTORS
                               if axis in op.traits.axes()))
        fields = self.mapping(data, label, line, optional=(*selectors, "full_grid"),
                              required=(*_TILE_MATCH_KEYS, *_TILE_SHAPE_KEYS, "why"))

        def field(key: str, read):
            return read(fields[key], f"{label}.{key}", fields.line_of(key))

        def axis(key: str):
            return field(key, partial(self.axis_value, key, op=op))

        pipeline = axis("pipeline")
        arch = axis("arch") if "arch" in fields else None
        dtype = axis("dtype") if "dtype" in fields else None
        vlayout = axis("vlayout") if "vlayout" in fields else None
        kv_dtype = axis("kv_dtype") if "kv_dtype" in fields else None
        paged = axis("paged") if "paged" in fields else None
        hdim = (axis("hdim_q"), axis("hdim_v"))
        kernel = op.kernel(pipeline)
        full_grid = None
        if "full_grid" in fields:
            where = f"{label}.full_grid"
            if not kernel.full_grid_tile:
                raise self.error(fields.line_of("full_grid"),
                                 f"{where}: pipeline {pipeline.token} of {op.token} runs one "
                                 f"tile for every call; a full-grid tile is for "
                                 f"{_full_grid_kernels()}")
            grid_fields = self.mapping(fields["full_grid"], where, fields.line_of("full_grid"),
                                       required=_TILE_SHAPE_KEYS[1:])
            full_grid = self.tile_shape(
                kernel, {"block_m": fields["block_m"], **grid_fields}, hdim, where,
                fields.line_of("full_grid"),
                lambda key: grid_fields.line_of(key) if key in grid_fields
                else fields.line_of(key))
        tile = replace(self.tile_shape(kernel, fields, hdim, label, line, fields.line_of),
                       full_grid=full_grid)
        return TileEntry(label, pipeline, arch, hdim, tile, field("why", self.text), line, paged,
                         kv_dtype, dtype, vlayout)

    def tile_shape(self, kernel: Kernel, fields, hdim: tuple[int, int], label: str, line: int,
                   line_of) -> Tile:
        """The tile of `_TILE_SHAPE_KEYS` in `fields`, checked against the kernel's
        constraints."""
        tile = Tile(**{key: self.positive_int(fields[key], f"{label}.{key}", line_of(key))
                       for key in _TILE_SHAPE_KEYS})
        for constraint in kernel.tile_constraints:
            if not constraint.holds(tile, hdim):
                raise self.error(line, f"{label}: pipeline {kernel.pipeline.token} needs "
                                       f"{constraint.reason}; got block_m={tile.block_m}, "
                                       f"block_n={tile.block_n}, warps={tile.warps}, "
                                       f"stages={tile.stages}, hdim_q={hdim[0]}, hdim_v={hdim[1]}")
        return tile

    def rule(self, data, label: str, line: int, ops: list[Operation],
             shared: bool = False) -> Rule:
        """A rule of one operation (`ops` is it), on its axes; or with `shared`, a rule of the
        config's operations `ops`, on the axes they share and `op`, the operations it is for."""
        fields = self.mapping(data, label, line, required=("when", "reason"))
        when_label = f"{label}.when"
        axes = (["op", *_shared_axes(CONDITION_AXES, ops, lambda op: op.condition_axes)]
                if shared else list(ops[0].condition_axes))
        when = self.mapping(fields["when"], when_label, fields.line_of("when"), any_key=True)
        for key in when:
            owners = [op.token for op in ops if key in op.condition_axes]
            if key not in axes:
                if len(ops) > 1 and owners:
                    raise self.error(when.line_of(key), f"{when_label}: {key} is an axis of "
                                     f"{' and '.join(owners)} only; give this rule under "
                                     f"operations.{owners[0]}.rules")
                raise self.error(when.line_of(key), f"{when_label}: unknown key {key!r}; "
                                                    f"valid: {', '.join(axes)}")
        if not when:
            raise self.error(when.line, f"{when_label}: needs at least one condition; "
                                        f"axes: {', '.join(axes)}")
        op = ops[0] if len(ops) == 1 else None
        conditions = tuple(self.condition(axis, raw, f"{when_label}.{axis}", when.line_of(axis),
                                          op)
                           for axis, raw in when.items())
        reason = self.text(fields["reason"], f"{label}.reason", fields.line_of("reason"))
        return Rule(conditions, reason, line, label)

    def condition(self, axis: str, raw, label: str, line: int,
                  op: Operation | None) -> Condition:
        """One value, a list of values any of which matches, or `{not: either}`, which matches
        every other value. `hdim` takes a list of [hdim_q, hdim_v] pairs, as matrix.hdim does."""
        negated = isinstance(raw, LineMap)
        if negated:
            fields = self.mapping(raw, label, line, required=("not",))
            label, line, raw = f"{label}.not", fields.line_of("not"), fields["not"]
        items = (self.items(raw, label, line) if isinstance(raw, LineList) or axis == "hdim"
                 else [(0, raw, line)])
        values = frozenset(self.axis_value(axis, item, label, item_line, op)
                           for _, item, item_line in items)
        return Condition(axis, values, negated)

    def presets(self, data, label: str, line: int) -> dict[str, Preset]:
        entries = self.mapping(data, label, line, required=(DEFAULT_PRESET,), any_key=True)
        presets = {}
        for name, raw in entries.items():
            name_line = entries.line_of(name)
            if not isinstance(name, str):
                raise self.error(name_line, f"{label}: a preset name must be a string, "
                                            f"got {_describe(name)}")
            preset_label = f"{label}.{name}"
            fields = self.mapping(raw, preset_label, name_line, required=("filter", "why"))
            raw_filter = fields["filter"]
            filter_line = fields.line_of("filter")
            if isinstance(raw_filter, LineList):  # a union: every entry is a whole filter
                filters = tuple(raw_filter)
                bad = [f for f in filters if not isinstance(f, str) or not f.strip()]
                if not filters or bad:
                    raise self.error(filter_line, f"{preset_label}.filter: a list of filters "
                                     f"needs non-empty strings in the --filter grammar, got "
                                     f"{_describe(bad[0]) if bad else 'an empty list'}")
            elif isinstance(raw_filter, str):  # may be empty: "" selects everything
                filters = (raw_filter,)
            else:
                raise self.error(filter_line, f"{preset_label}.filter: expected a string in the "
                                 f"--filter grammar or a list of them (their union), got "
                                 f"{_describe(raw_filter)}")
            why = self.text(fields["why"], f"{preset_label}.why", fields.line_of("why"))
            presets[name] = Preset(name, filters, why, name_line)
        return presets

    # -- building blocks ---------------------------------------------------------------------

    def mapping(self, data, label: str, line: int, required=(), optional=(),
                any_key: bool = False, order=()) -> LineMap:
        """Checks that `data` is a mapping with all `required` keys and no keys beyond
        `required` and `optional` (any key when `any_key`); `order` lists the valid keys in
        the order messages name them, when it is not required then optional."""
        where = f"{label}: " if label else ""
        if not isinstance(data, LineMap):
            raise self.error(line, f"{where}expected a mapping, got {_describe(data)}")
        valid = order or (*required, *optional)
        for key in data:
            if not any_key and key not in valid:
                raise self.error(data.line_of(key),
                                 f"{where}unknown key {key!r}; valid: {', '.join(valid)}")
        for key in required:
            if key not in data:
                raise self.error(line, f"{where}missing field {key!r}")
        return data

    def items(self, data, label: str, line: int, allow_empty: bool = False):
        """(index, item, line) for each item of the list `data`."""
        if not isinstance(data, LineList):
            raise self.error(line, f"{label}: expected a list, got {_describe(data)}")
        if not data and not allow_empty:
            raise self.error(line, f"{label}: needs at least one entry")
        return [(i, item, data.line_of(i)) for i, item in enumerate(data)]

    def axis_value(self, axis: str, raw, label: str, line: int, op: Operation | None = None):
        """A value on one of schema.CONDITION_AXES, typed: a schema value, an int, a bool or an
        (hdim_q, hdim_v) pair. A pipeline must be one of `op`'s, when given."""
        if axis == "hdim":
            return self.hdim_pair(raw, label, line)
        if axis == "pipeline" and op is not None:
            value = self.token(ENUM_AXES[axis], raw, label, line)
            if value not in op.pipelines.values:
                raise self.error(line, f"{label}: {op.token} has no pipeline {raw!r}; its "
                                       f"pipelines: {', '.join(op.pipelines.tokens)}")
            return value
        if axis in ENUM_AXES:
            return self.token(ENUM_AXES[axis], raw, label, line)
        if axis in INT_AXES:
            return self.positive_int(raw, label, line)
        assert axis in BOOL_AXES, axis
        if not isinstance(raw, bool):
            raise self.error(line, f"{label}: expected true or false, got {_describe(raw)}")
        return raw

    def token(self, axis: EnumAxis, raw, label: str, line: int):
        value = axis.get(raw) if isinstance(raw, str) else None
        if value is None:
            problem = f"unknown value {raw!r}" if isinstance(raw, str) else f"got {_describe(raw)}"
            raise self.error(line, f"{label}: {problem}; valid: {', '.join(axis.tokens)}")
        return value

    def positive_int(self, raw, label: str, line: int) -> int:
        # bool is an int in Python; `block_m: yes` is not a tile size.
        if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
            raise self.error(line, f"{label}: expected a positive integer, got {_describe(raw)}")
        return raw

    def hdim_pair(self, raw, label: str, line: int) -> tuple[int, int]:
        if not (isinstance(raw, LineList) and len(raw) == 2):
            raise self.error(line, f"{label}: expected a [hdim_q, hdim_v] pair, "
                                   f"got {_describe(raw)}")
        return (self.positive_int(raw[0], label, raw.line_of(0)),
                self.positive_int(raw[1], label, raw.line_of(1)))

    def text(self, raw, label: str, line: int) -> str:
        if not isinstance(raw, str) or not raw.strip():
            raise self.error(line, f"{label}: expected a non-empty string, got {_describe(raw)}")
        return raw
