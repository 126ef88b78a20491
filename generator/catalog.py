"""From the configuration to the instances it defines: expand the matrix, prune it with the
rules, give each surviving point its tile. Filters then select from this catalog."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .config import Config, Matrix, TileEntry
from .dispatch import check_dispatchable, dispatch_order
from .errors import GeneratorError
from .gaps import PipelineGap, pipeline_gaps
from .model import FwdTraits, Instance, MatrixPoint
from .schema import MATRIX_AXES


@dataclass(frozen=True)
class Catalog:
    instances: tuple[Instance, ...]  # in the dispatcher's order of preference
    pruned: int  # matrix points dropped by rules
    gaps: tuple[PipelineGap, ...]  # traits the rules leave a pipeline without, per arch


def build_catalog(config: Config) -> Catalog:
    points = expand(config.matrix)
    kept = prune(points, config)
    instances = dispatch_order(assign_tiles(kept, config))
    try:
        check_dispatchable(instances)
    except GeneratorError as err:
        # An instance the dispatcher never runs is a point that a rule should prune.
        raise config.error(config.section_lines["rules"], f"rules: {err.message}") from None
    return Catalog(instances, pruned=len(points) - len(kept),
                   gaps=pipeline_gaps(config.rules, instances))


def expand(matrix: Matrix) -> tuple[MatrixPoint, ...]:
    """The cross product of the matrix axes, in the order the YAML lists their values."""
    return tuple(
        MatrixPoint(FwdTraits(dtype, hdim_q, hdim_v, mask, bias, vlayout, mode, lse, dropout,
                              softcap),
                    pipeline, arch, pad_seqlen, pad_hdim)
        for (dtype, (hdim_q, hdim_v), mask, bias, vlayout, mode, lse, dropout, softcap, pipeline,
             arch, pad_seqlen, pad_hdim)
        in itertools.product(*(getattr(matrix, axis) for axis in MATRIX_AXES)))


def prune(points: tuple[MatrixPoint, ...], config: Config) -> tuple[MatrixPoint, ...]:
    """Drops the points some rule matches. A rule that matches no point of the matrix is dead
    configuration, most likely a typo in a value that does exist, so it is an error."""
    for rule in config.rules:
        if not any(rule.matches(point) for point in points):
            raise config.error(rule.line, "rules: this rule matches no point of the matrix; "
                                          "fix or remove it")
    kept = tuple(p for p in points if not any(rule.matches(p) for rule in config.rules))
    if not kept:
        raise config.error(config.section_lines["rules"], "rules: they prune every point of "
                                                          "the matrix, so nothing would be built")
    return kept


def assign_tiles(points: tuple[MatrixPoint, ...], config: Config) -> tuple[Instance, ...]:
    """Gives each point the one `tiles:` entry that matches it. None, two, or an entry no point
    uses are configuration errors: a tile choice must be explicit, single and alive. So is a
    tile whose shared memory exceeds what an arch it is used on allows: the launch would fail.

    Points differ in many axes a tile does not depend on, so the entry is looked up once per
    (pipeline, arch, hdim_q, hdim_v)."""
    instances = []
    used: dict[tuple, TileEntry] = {}
    for point in points:
        key = (point.pipeline, point.arch, point.traits.hdim_q, point.traits.hdim_v)
        if key not in used:
            used[key] = _tile_entry(point, config)
        instances.append(Instance(point, used[key].tile))
    for entry in config.tiles:
        if entry not in used.values():
            raise config.error(entry.line, "tiles: this entry matches no instance; "
                                           "fix or remove it")
    for (pipeline, arch, *_), entry in used.items():
        smem = pipeline.shared_memory
        needed = smem.bytes(entry.tile, entry.hdim)
        if needed > arch.smem_limit:
            raise config.error(entry.line, f"{entry.label}: the tile needs {needed} bytes of "
                                           f"shared memory ({smem.formula}), more than the "
                                           f"{arch.smem_limit} a CTA may use on {arch.token}")
    return tuple(instances)


def _tile_entry(point: MatrixPoint, config: Config) -> TileEntry:
    entries = [entry for entry in config.tiles if entry.matches(point)]
    key = (f"pipeline={point.pipeline.token}, arch={point.arch.token}, "
           f"hdim_q={point.traits.hdim_q}, hdim_v={point.traits.hdim_v}")
    if not entries:
        raise config.error(config.section_lines["tiles"], f"tiles: no entry matches {key}; "
                                                          f"add one")
    if len(entries) > 1:
        first, second = entries[:2]
        raise config.error(second.line, f"tiles: this entry and the one at line {first.line} "
                                        f"both match {key}; each instance needs exactly one")
    return entries[0]
