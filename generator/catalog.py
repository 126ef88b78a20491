"""From the configuration to the instances it defines, per operation: expand its matrix, prune
it with its rules, give each surviving point its tile. Filters then select from this catalog."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

from .config import (TILE_TRAIT_SELECTORS, UNSELECTED_DTYPE_SIZE, Config, OperationConfig,
                     TileEntry)
from .dispatch import check_dispatchable, dispatch_order
from .errors import GeneratorError
from .gaps import PipelineGap, pipeline_gaps
from .model import ABSENT, Instance, MatrixPoint, Traits
from .schema import BUILD_AXES, OperationKind


@dataclass(frozen=True)
class Catalog:
    # Operation by operation (operations.OPERATIONS's order), each in the dispatcher's order of
    # preference.
    instances: tuple[Instance, ...]
    pruned: int  # matrix points dropped by rules
    gaps: tuple[PipelineGap, ...]  # traits the rules leave a pipeline without, per op and arch

    def of(self, op: OperationKind) -> tuple[Instance, ...]:
        return tuple(i for i in self.instances if i.op == op)

    @cached_property
    def head_dims(self) -> dict[OperationKind, tuple[tuple[int, int], ...]]:
        """Each operation's (hdim_q, hdim_v) pairs, smallest first: the dispatch table carries
        them, so that a miss suggests (and compile on demand builds) the matrix's own head dims
        rather than a compiled instance's padded ones."""
        pairs: dict[OperationKind, set] = {}
        for i in self.instances:
            pairs.setdefault(i.op, set()).add((i.point.traits.hdim_q, i.point.traits.hdim_v))
        return {op: tuple(sorted(hdims, key=lambda hdim: (sum(hdim), hdim)))
                for op, hdims in pairs.items()}


def build_catalog(config: Config) -> Catalog:
    points = {token: expand(op_config) for token, op_config in config.operations.items()}
    for rule in config.shared_rules:
        if not any(rule.matches(p) for op_points in points.values() for p in op_points):
            raise config.error(rule.line, f"{rule.label}: this rule matches no point of the "
                                          f"matrix of any operation; fix or remove it")
    instances, pruned, gaps = [], 0, []
    for token, op_config in config.operations.items():
        kept = prune(points[token], op_config, config)
        ordered = dispatch_order(assign_tiles(kept, op_config, config))
        try:
            check_dispatchable(ordered)
        except GeneratorError as err:
            # An instance the dispatcher never runs is a point that a rule should prune.
            raise config.error(op_config.lines["rules"],
                               f"{op_config.label}.rules: {err.message}") from None
        instances += ordered
        pruned += len(points[token]) - len(kept)
        gaps += pipeline_gaps(op_config.rules, ordered)
    return Catalog(tuple(instances), pruned=pruned, gaps=tuple(gaps))


def expand(op_config: OperationConfig) -> tuple[MatrixPoint, ...]:
    """The cross product of an operation's matrix axes, in the order the YAML lists their
    values."""
    op, matrix = op_config.op, op_config.matrix
    # The matrix axes are the traits' fields in order (hdim for the two head dims), then
    # BUILD_AXES in MatrixPoint's order: both are built positionally.
    axes, traits = op.matrix_axes, op.traits
    assert axes[-len(BUILD_AXES):] == BUILD_AXES
    functional = len(axes) - len(BUILD_AXES)
    hdim = axes.index("hdim")
    return tuple(MatrixPoint(traits(*values[:hdim], *values[hdim], *values[hdim + 1:functional]),
                             *values[functional:])
                 for values in itertools.product(*(matrix[axis] for axis in axes)))


def prune(points: tuple[MatrixPoint, ...], op_config: OperationConfig,
          config: Config) -> tuple[MatrixPoint, ...]:
    """Drops the points some rule matches. A rule of the operation's own that matches no point
    of its matrix is dead configuration, most likely a typo in a value that does exist, so it
    is an error (a shared rule needs to match a point of some operation's). So is a kept
    pad_hdim=true point of a kernel that takes exact head dims only
    (operations.Kernel.padded_hdim_step None): its TU would not compile."""
    shared = set(config.shared_rules)
    for rule in op_config.rules:
        if rule not in shared and not any(rule.matches(point) for point in points):
            raise config.error(rule.line, f"{rule.label}: this rule matches no point of the "
                                          f"matrix; fix or remove it")
    kept = tuple(p for p in points if not any(rule.matches(p) for rule in op_config.rules))
    if not kept:
        raise config.error(op_config.lines["rules"],
                           f"{op_config.label}.rules: they prune every point of the matrix, so "
                           f"nothing would be built")
    op = op_config.op
    exact = next((p for p in kept
                  if p.pad_hdim and op.kernel(p.pipeline).padded_hdim_step is None), None)
    if exact is not None:
        pipeline = exact.pipeline.token
        raise config.error(op_config.lines["rules"],
                           f"{op_config.label}.rules: they keep pad_hdim=true points of pipeline "
                           f"{pipeline}, whose kernel takes exact head dims only; add a rule "
                           f"with when: {{pipeline: {pipeline}, pad_hdim: true}}")
    return kept


def assign_tiles(points: tuple[MatrixPoint, ...], op_config: OperationConfig,
                 config: Config) -> tuple[Instance, ...]:
    """Gives each point the one `tiles:` entry of its operation that matches it. None, two, or
    an entry no point uses are configuration errors: a tile choice must be explicit, single
    and alive. So is a tile whose shared memory exceeds what an arch it is used on allows: the
    launch would fail.

    Points differ in many axes a tile does not depend on, so the entry is looked up once per
    (pipeline, arch, hdim_q, hdim_v, and dtype, vlayout, kv_dtype and paged where the operation
    has them: config.TILE_TRAIT_SELECTORS), and its shared memory is checked once per such key,
    on the key's first traits: the key holds every trait the formulas read (the head dims,
    Traits.kv_element_size of the dtypes, Traits.v_rings of dtype and vlayout), and its arch
    the limit a region that gets space of its own only where it fits is weighed against
    (SharedMemory.needed)."""
    instances = []
    used: dict[tuple, TileEntry] = {}
    traits_of: dict[tuple, Traits] = {}  # the traits of the key's first point
    for point in points:
        key = (point.pipeline, point.arch, point.traits.hdim_q, point.traits.hdim_v,
               *(point.traits.value(axis) for axis in TILE_TRAIT_SELECTORS))
        if key not in used:
            used[key] = _tile_entry(point, op_config, config)
            traits_of[key] = point.traits
        instances.append(Instance(point, used[key].tile))
    for entry in op_config.tiles:
        if entry not in used.values():
            raise config.error(entry.line, f"{entry.label}: this entry matches no instance; "
                                           f"fix or remove it")
    for key, entry in used.items():
        pipeline, arch = key[:2]
        smem, traits = op_config.op.kernel(pipeline).shared_memory, traits_of[key]
        for what, tile in (("the tile", entry.tile), ("its full-grid tile", entry.tile.full_grid)):
            needed = smem.needed(tile, traits, arch.smem_limit) if tile else 0
            if needed > arch.smem_limit:
                raise config.error(entry.line, f"{entry.label}: {what} needs {needed} bytes of "
                                               f"shared memory ({smem.formula(traits)}), more "
                                               f"than the {arch.smem_limit} a CTA may use on "
                                               f"{arch.token}")
    return tuple(instances)


def _tile_entry(point: MatrixPoint, op_config: OperationConfig, config: Config) -> TileEntry:
    entries = [entry for entry in op_config.tiles if entry.matches(point)]
    key = (f"pipeline={point.pipeline.token}, arch={point.arch.token}, "
           f"hdim_q={point.traits.hdim_q}, hdim_v={point.traits.hdim_v}")
    for axis in TILE_TRAIT_SELECTORS:
        value = point.traits.value(axis)
        # A 16-bit dtype goes unsaid: an entry without `dtype` serves it.
        if value is ABSENT or (axis == "dtype" and value.size == UNSELECTED_DTYPE_SIZE):
            continue
        key += f", {axis}={str(value).lower() if isinstance(value, bool) else value.token}"
    label = f"{op_config.label}.tiles"
    if not entries:
        raise config.error(op_config.lines["tiles"], f"{label}: no entry matches {key}; add one")
    if len(entries) > 1:
        first, second = entries[:2]
        raise config.error(second.line, f"{label}: this entry and the one at line {first.line} "
                                        f"both match {key}; each instance needs exactly one")
    return entries[0]
