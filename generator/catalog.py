"""From the configuration to the instances it defines: expand the matrix, prune it with the
rules, give each surviving point its tile. Filters then select from this catalog."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .config import Config, Matrix
from .dispatch import check_dispatchable, dispatch_order
from .model import FwdTraits, Instance, MatrixPoint


@dataclass(frozen=True)
class Catalog:
    instances: tuple[Instance, ...]  # in the dispatcher's order of preference
    pruned: int  # matrix points dropped by rules


def build_catalog(config: Config) -> Catalog:
    points = expand(config.matrix)
    kept = prune(points, config)
    instances = dispatch_order(assign_tiles(kept, config))
    check_dispatchable(instances)
    return Catalog(instances, pruned=len(points) - len(kept))


def expand(matrix: Matrix) -> tuple[MatrixPoint, ...]:
    """The cross product of the matrix axes, in the order the YAML lists their values."""
    return tuple(
        MatrixPoint(FwdTraits(dtype, hdim_q, hdim_v, mask, bias, vlayout, mode),
                    pipeline, arch, pad_seqlen)
        for dtype, (hdim_q, hdim_v), mask, bias, vlayout, mode, pipeline, arch, pad_seqlen
        in itertools.product(matrix.dtype, matrix.hdim, matrix.mask, matrix.bias, matrix.vlayout,
                             matrix.mode, matrix.pipeline, matrix.arch, matrix.pad_seqlen))


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
    uses are configuration errors: a tile choice must be explicit, single and alive."""
    instances = []
    used = set()
    for point in points:
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
        used.add(entries[0])
        instances.append(Instance(point, entries[0].tile))
    for entry in config.tiles:
        if entry not in used:
            raise config.error(entry.line, "tiles: this entry matches no instance; "
                                           "fix or remove it")
    return tuple(instances)
