"""The dispatcher's view of the instances: their order of preference, and the proof that each
one can be chosen for some problem."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import GeneratorError
from .model import Instance


def preference(instance: Instance) -> tuple:
    """Sort key, best first. The runtime runs the first entry whose traits match and whose
    constraints hold, so the table must be sorted by how much we want each instance:
      1. higher compute capability first: code built for the newest arch the GPU supports is
         tuned for it, and at equal cc an exact 'a' target (sm90a) goes first since it runs
         only there and a portable one covers the rest;
      2. unpadded before padded: it skips the bounds checks, and needs seqlens that are tile
         multiples, so the padded sibling behind it catches every other problem;
      3. larger tile first: more work per CTA when both fit;
      4. the name, so the order is total and the output deterministic."""
    point, tile = instance.point, instance.tile
    return (-point.arch.cc, not point.arch.exact, point.pad_seqlen,
            -tile.block_m * tile.block_n, instance.name)


def dispatch_order(instances: Iterable[Instance]) -> tuple[Instance, ...]:
    return tuple(sorted(instances, key=preference))


def check_dispatchable(ordered: tuple[Instance, ...]) -> None:
    """Every instance needs a unique name (its identity: the TU, the launch symbol) and must not
    be shadowed: two instances with the same traits, arch and padding accept exactly the same
    problems on the same GPUs, so the dispatcher would never run the later one."""
    by_name: dict[str, Instance] = {}
    by_role: dict[tuple, Instance] = {}
    for instance in ordered:
        if instance.name in by_name:
            raise GeneratorError(f"two different instances are named {instance.name}; the name "
                                 f"grammar (model.Instance.name) must tell them apart")
        by_name[instance.name] = instance
        role = (instance.point.traits, instance.point.arch, instance.point.pad_seqlen)
        if role in by_role:
            raise GeneratorError(
                f"{instance.name} is shadowed by {by_role[role].name}: both serve the same traits "
                f"on {instance.point.arch.token} with pad_seqlen="
                f"{str(instance.point.pad_seqlen).lower()}, and "
                f"the dispatcher always runs {by_role[role].name} first")
        by_role[role] = instance
