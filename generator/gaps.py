"""Why a newer pipeline did not run a problem: the rules of the config that leave a pipeline
without instances for some traits, e.g. `{pipeline: fa3, bias: [elementwise, alibi]}`.

When the dispatcher runs an older pipeline's instance on an arch where a newer pipeline has
instances, --explain (generator/explain.py) and the runtime's explain (runtime/src/
dispatcher.cpp, from the rows rendered into the dispatch table, one array per operation) quote
the gaps the problem's traits fall into, with the rules' reasons.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from .config import Rule
from .model import Condition, Instance, Traits
from .schema import ARCH, BUILD_AXES, PIPELINE, Arch, OperationKind, Pipeline


@dataclass(frozen=True)
class PipelineGap:
    """Traits of operation `op` for which `pipeline` has no instance on `arch`, because a rule
    drops them."""

    op: OperationKind
    pipeline: Pipeline
    arch: Arch
    conditions: tuple[Condition, ...]  # the rule's conditions on traits (none on BUILD_AXES)
    reason: str  # the rule's reason, on one line

    def matches(self, traits: Traits) -> bool:
        return traits.kind == self.op and all(c.holds(traits) for c in self.conditions)

    def describe(self, traits: Traits) -> str:
        """The problem's values on the traits the rule names, e.g. `bias=elementwise`."""
        return ", ".join(f"{condition.axis}={spell(traits.value(condition.axis))}"
                         for condition in self.conditions)


def spell(value) -> str:
    """A trait value as instances.yaml and filters write it: fp16, true, 128, 192x128."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return str(value) if isinstance(value, int) else value.token


def pipeline_gaps(rules: Iterable[Rule], instances: Iterable[Instance]) -> tuple[PipelineGap, ...]:
    """The gaps of one operation's rules, given its instances: a gap per rule that names a
    pipeline and otherwise traits (and maybe archs, or the operations a shared rule is for), for
    each pipeline it names and each arch that pipeline has instances of the operation on. A rule
    on padding is left out: it drops a variant of the traits, which another variant serves."""
    instances = tuple(instances)
    if not instances:
        return ()
    op = instances[0].op
    built = {(i.point.pipeline.token, i.point.arch.token) for i in instances}
    gaps = []
    for rule in rules:
        by_axis = {condition.axis: condition for condition in rule.when}
        traits = tuple(c for c in rule.when if c.axis not in (*BUILD_AXES, "op"))
        if "pipeline" not in by_axis or not traits or {"pad_seqlen", "pad_hdim"} & by_axis.keys():
            continue
        reason = " ".join(rule.reason.split())
        for pipeline, arch in itertools.product(PIPELINE, ARCH):
            if ((pipeline.token, arch.token) in built and by_axis["pipeline"].admits(pipeline)
                    and ("arch" not in by_axis or by_axis["arch"].admits(arch))):
                gaps.append(PipelineGap(op, pipeline, arch, traits, reason))
    return tuple(gaps)


def fallback_notes(chosen: Instance, traits: Traits,
                   gaps: Iterable[PipelineGap]) -> list[str]:
    """One note per gap of chosen's operation that keeps a pipeline newer than `chosen`'s, on
    chosen's arch, from a problem with `traits`: `fa3 (sm90a) has no instance for
    bias=elementwise: <reason>; falling back to fa2`."""
    point = chosen.point
    newer = PIPELINE.tokens[:PIPELINE.tokens.index(point.pipeline.token)]
    return [f"{gap.pipeline.token} ({gap.arch.token}) has no instance for "
            f"{gap.describe(traits)}: {gap.reason}; falling back to {point.pipeline.token}"
            for gap in gaps
            if gap.pipeline.token in newer and gap.arch == point.arch and gap.matches(traits)]
