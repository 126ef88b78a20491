"""The dispatcher's view of the instances: which problems an instance serves, the order of
preference, and the proof that each instance is the one chosen for some problem.

The C++ dispatcher (runtime/src/dispatcher.cpp) walks the generated table of the problem's
operation in order and runs the first instance that serves the problem. `serves` is its
matching rule, mirrored here so that the generator can order each table, prove it has no dead
rows, and explain a choice (generator/explain.py) without a GPU. The rule and the order are
the same for every operation, over the traits it has: its traits must be equal (the forward's
lse excepted: an instance writing it also serves calls that do not ask for it).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cache

from .errors import GeneratorError
from .model import Instance, Traits
from .operations import PREFILL_MIN_PACKED_ROWS, PREFILL_PAGE_MULTIPLE, operation_of
from .schema import MODE, OPERATION, PIPELINE, Arch, OperationKind

# The head dims below its own at which a head-dim-padded instance looks for a problem it is
# chosen for (candidate_problems): multiples of 8 even where the operation's kernels take any
# head dim (Operation.padded_hdim_step), as a padded instance serves an odd head dim only where
# it serves the next multiple of 8, unless an exact instance has that one, and exact instances
# come in multiples of 32.
WITNESS_HDIM_STEP = 8

_BATCH = MODE.get("batch")


@dataclass(frozen=True)
class Problem:
    """One call as the dispatcher sees it: the traits it asks for (FwdArgs::traits(),
    BwdArgs::traits(), KvcacheArgs::traits(), whose class says the operation), the shape facts
    the padding rules read (kvcache: seqlen_k is the cache's), and the device it runs on."""

    traits: Traits
    seqlen_q: int
    seqlen_k: int
    seqused: bool  # per-batch effective lengths (FwdArgs::seqused_q / seqused_k) are given
    cc: int  # the device's compute capability, major*10+minor
    page_size: int = 0  # kvcache: keys per page of a paged cache; 0 for a contiguous one
    group: int = 1  # kvcache: query heads per K/V head, which pack with the tokens into rows
    leftpad: bool = False  # kvcache: cache_leftpad is given (left-padded sequences)

    @property
    def op(self) -> OperationKind:
        return self.traits.kind


def runs_on(arch: Arch, cc: int) -> bool:
    """An exact target ('a', e.g. sm90a) runs only on its own compute capability; a portable one
    on its own and every newer one (through the PTX it embeds)."""
    return cc == arch.cc if arch.exact else cc >= arch.cc


def _hdims_fit(instance: Instance, problem: Problem) -> bool:
    have, want = instance.point.traits, problem.traits
    if not instance.point.pad_hdim:
        return (want.hdim_q, want.hdim_v) == (have.hdim_q, have.hdim_v)
    step = operation_of(instance).padded_hdim_step
    return all(0 < dim <= own and dim % step == 0
               for dim, own in ((want.hdim_q, have.hdim_q), (want.hdim_v, have.hdim_v)))


def _seqlens_fit(instance: Instance, problem: Problem) -> bool:
    """An unpadded instance needs lengths known on the host that are whole tiles: batch mode
    without seqused. An operation without modes (kvcache, whose cache lengths live on the
    device) never has them. A prefill kernel (operations.Kernel.prefill) takes calls of at
    least a tile of query tokens or PREFILL_MIN_PACKED_ROWS packed rows, on pages of a multiple
    of PREFILL_PAGE_MULTIPLE keys, without cache_leftpad (the decode kernel's alone)."""
    tile = instance.tile
    if operation_of(instance).kernel(instance.point.pipeline).prefill:
        long_enough = (problem.seqlen_q >= tile.block_m
                       or problem.seqlen_q * problem.group >= PREFILL_MIN_PACKED_ROWS)
        return (long_enough and problem.page_size % PREFILL_PAGE_MULTIPLE == 0
                and not problem.leftpad)
    if instance.point.pad_seqlen:
        return True
    return (problem.traits.value("mode") == _BATCH and not problem.seqused
            and problem.seqlen_q % tile.block_m == 0 and problem.seqlen_k % tile.block_n == 0)


# The traits `serves` requires equal, of every operation (each has some of them): instances
# that differ in one of them never compete.
EQUAL_TRAITS = ("dtype", "kv_dtype", "mask", "bias", "vlayout", "mode", "dbias", "paged",
                "dropout", "softcap")


def _same(trait: str) -> Callable[[Instance, Problem], bool]:
    return lambda instance, problem: (getattr(instance.point.traits, trait)
                                      == getattr(problem.traits, trait))


@dataclass(frozen=True)
class Requirement:
    """One condition of the matching rule; `needs` says it in words for explanations. `trait`:
    the trait it reads, which only some operations have; None for a condition of every
    operation's."""

    name: str
    needs: str
    met: Callable[[Instance, Problem], bool]
    trait: str | None = None


# The matching rule: an instance serves a problem when every requirement of its operation is
# met. The order is only for speed: instances that share their traits (the dispatch proof's
# competitors) differ in arch, head dims, lse and padding, so those tests come first and reject
# early. The operation comes first: an instance never serves another operation's problem.
REQUIREMENTS = (
    Requirement("op", "the same operation",  # each operation has a traits class of its own
                lambda instance, problem: type(instance.point.traits) is type(problem.traits)),
    Requirement("arch", "an arch that runs on the device (an exact target such as sm90a only on "
                        "its own compute capability, a portable one on it and newer)",
                lambda instance, problem: runs_on(instance.point.arch, problem.cc)),
    Requirement("hdim", "the same head dims or, with pad_hdim, head dims no larger in the "
                        "operation's step (multiples of 8 for fwd and bwd, any for kvcache)",
                _hdims_fit),
    Requirement("lse", "lse=true when the call asks for the log-sum-exp (an lse instance also "
                       "serves calls that do not; the store is skipped)",
                lambda instance, problem: instance.point.traits.lse or not problem.traits.lse,
                trait="lse"),
    Requirement("seqlen", "batch mode, no seqused, and seqlen_q and seqlen_k multiples of "
                          "block_m and block_n when pad_seqlen=false (kvcache's cache lengths "
                          "live on the device: never); for a prefill kernel, seqlen_q >= "
                          f"block_m or {PREFILL_MIN_PACKED_ROWS} packed rows, pages of a "
                          f"multiple of {PREFILL_PAGE_MULTIPLE} keys, and no cache_leftpad",
                _seqlens_fit),
    *(Requirement(trait, f"the same {trait}", _same(trait), trait=trait)
      for trait in EQUAL_TRAITS),
)

# Flags with which an instance also serves calls that do not ask for them (see "lse" above).
SERVES_WITHOUT = ("lse",)


@cache
def _requirements(traits: type[Traits]) -> tuple[Requirement, ...]:
    return tuple(r for r in REQUIREMENTS if r.trait is None or r.trait in traits.axes())


def requirements(instance: Instance) -> tuple[Requirement, ...]:
    """The requirements of the instance's operation: REQUIREMENTS on the traits it has."""
    return _requirements(type(instance.point.traits))


def equal_traits(traits: type[Traits]) -> tuple[str, ...]:
    """The traits of an operation that `serves` requires equal, in EQUAL_TRAITS's order."""
    return tuple(trait for trait in EQUAL_TRAITS if trait in traits.axes())


def serves(instance: Instance, problem: Problem) -> bool:
    """The runtime's matching rule (REQUIREMENTS): can this instance run this problem?"""
    for requirement in _requirements(type(instance.point.traits)):
        if not requirement.met(instance, problem):
            return False
    return True


def unmet(instance: Instance, problem: Problem) -> list[Requirement]:
    """The requirements that keep `instance` from serving `problem`; empty when it serves it.
    For another operation's problem, only `op`."""
    if instance.op != problem.op:
        return [REQUIREMENTS[0]]
    return [r for r in requirements(instance) if not r.met(instance, problem)]


@dataclass(frozen=True)
class Criterion:
    """One rule of the order of preference: `key` sorts better instances first, `prefers` says
    what it prefers and `shows` an instance's value, for explanations."""

    prefers: str
    key: Callable[[Instance], object]
    shows: Callable[[Instance], str]


def _padded_hdims(instance: Instance) -> tuple:
    traits = instance.point.traits
    return (traits.hdim_q, traits.hdim_v) if instance.point.pad_hdim else ()


# The order of preference, best first. The runtime runs the first instance that serves a
# problem, so the table is sorted by how much we want each one:
#   1-2. code built for the newest arch the GPU runs is tuned for it; at equal cc an exact 'a'
#        target (sm90a) goes first since it runs only there and a portable one covers the rest;
#   3. on that arch, the newest pipeline (schema.PIPELINE lists them newest first) is the one
#      built for what the arch adds, e.g. fa3's TMA and wgmma on sm90a; for the traits it lacks
#      the rules leave it no instance, and an older pipeline serves (gaps.py says why);
#   4. the unpadded fast path skips the bounds checks; it needs tile-multiple seqlens, so the
#      padded sibling behind it catches every other problem;
#   5-6. exact head dims before padded ones, and among padded ones the smallest that fits, so
#      the fewest zero-filled lanes are computed;
#   7. leanest first: a forward instance without the log-sum-exp store before one with it (the
#      latter also serves calls that do not ask for it; the other operations have no lse);
#   8. a larger tile does more work per CTA when both fit;
#   9. the name, so the order is total and the output deterministic.
PREFERENCE = (
    Criterion("higher compute capability first", lambda i: -i.point.arch.cc,
              lambda i: f"{i.point.arch.token} (cc {i.point.arch.cc})"),
    Criterion("exact target before portable", lambda i: not i.point.arch.exact,
              lambda i: f"{i.point.arch.token} ({'exact' if i.point.arch.exact else 'portable'})"),
    Criterion("newer pipeline first", lambda i: PIPELINE.tokens.index(i.point.pipeline.token),
              lambda i: f"pipeline {i.point.pipeline.token}"),
    Criterion("unpadded seqlens first", lambda i: i.point.pad_seqlen,
              lambda i: f"pad_seqlen={str(i.point.pad_seqlen).lower()}"),
    Criterion("exact head dims first", lambda i: i.point.pad_hdim,
              lambda i: f"pad_hdim={str(i.point.pad_hdim).lower()}"),
    Criterion("the tightest padded head dims first", _padded_hdims,
              lambda i: f"head dims {i.point.traits.hdim_q}x{i.point.traits.hdim_v}"),
    Criterion("without the log-sum-exp store first", lambda i: i.point.traits.flag("lse"),
              lambda i: f"lse={str(i.point.traits.flag('lse')).lower()}"),
    Criterion("larger tile first", lambda i: -i.tile.block_m * i.tile.block_n,
              lambda i: f"tile {i.tile.block_m}x{i.tile.block_n}"),
    Criterion("by name", lambda i: i.name, lambda i: i.name),
)


def preference(instance: Instance) -> tuple:
    """Sort key, best first: PREFERENCE's keys in turn."""
    return tuple(criterion.key(instance) for criterion in PREFERENCE)


def deciding_criterion(first: Instance, second: Instance) -> Criterion:
    """The rule of PREFERENCE that puts `first` ahead of `second`."""
    return next(c for c in PREFERENCE if c.key(first) != c.key(second))


def dispatch_order(instances: Iterable[Instance]) -> tuple[Instance, ...]:
    """Each operation's instances in its order of preference, the operations in
    schema.OPERATION's order (each has a table of its own)."""
    return tuple(sorted(instances, key=lambda i: (OPERATION.values.index(i.op),
                                                  *preference(i))))


def first_serving(ordered: Iterable[Instance], problem: Problem) -> Instance | None:
    """The instance the runtime runs for `problem`, from instances in dispatch order."""
    return next((instance for instance in ordered if serves(instance, problem)), None)


def check_dispatchable(ordered: tuple[Instance, ...]) -> None:
    """Every instance needs a unique name (its identity: the TU, the launch symbol) and must be
    the one the dispatcher runs for at least one problem: an instance that is never chosen is
    dead code in every build, most likely a matrix point that a rule should prune."""
    by_name: dict[str, Instance] = {}
    for instance in ordered:
        if instance.name in by_name:
            raise GeneratorError(f"two different instances are named {instance.name}; the name "
                                 f"grammar (model.Instance.name) must tell them apart")
        by_name[instance.name] = instance

    # Instances that differ in a trait serves() requires equal never compete, and the candidate
    # problems run on the instance's own arch, so each instance is checked only against those
    # of its group that run there: this keeps the proof fast on thousands of instances.
    groups: dict[tuple, list[Instance]] = defaultdict(list)
    for instance in ordered:
        groups[_equal_key(instance)].append(instance)
    for group in groups.values():
        running: dict[int, list[Instance]] = {}
        for instance in group:
            cc = instance.point.arch.cc
            if cc not in running:
                running[cc] = [other for other in group if runs_on(other.point.arch, cc)]
            _check_chosen(instance, running[cc])


def _equal_key(instance: Instance) -> tuple:
    traits = instance.point.traits
    return (instance.op, *(getattr(traits, trait) for trait in equal_traits(type(traits))))


def _check_chosen(instance: Instance, group: list[Instance]) -> None:
    """Looks for a witness: a problem for which `instance` is the first of `group` (its
    competitors, in dispatch order) that serves it. Raises naming what shadows it otherwise."""
    shadows: list[Instance] = []
    served_any = False
    for problem in candidate_problems(instance):
        if not serves(instance, problem):
            continue
        served_any = True
        first = first_serving(group, problem)
        if first is instance:
            return
        if first not in shadows:
            shadows.append(first)
    own = own_problem(instance)
    if not served_any:
        reasons = "; ".join(f"{r.name}: needs {r.needs}" for r in unmet(instance, own))
        raise GeneratorError(f"{instance.name} serves no problem, so the dispatcher can never "
                             f"run it ({reasons}); prune it with a rule")
    raise GeneratorError(
        f"{instance.name} is shadowed by {', '.join(s.name for s in shadows)}: for every "
        f"problem tried that it serves (e.g. {describe_problem(own)}) the dispatcher runs "
        f"{'that instance' if len(shadows) == 1 else 'one of those'} first")


def own_problem(instance: Instance) -> Problem:
    """The problem an instance is made for: its own traits on its own arch, with seqlens that
    are tile multiples for the unpadded fast path and one past them otherwise."""
    tile, point = instance.tile, instance.point
    pad = 1 if point.pad_seqlen else 0
    return Problem(point.traits, tile.block_m + pad, tile.block_n + pad, seqused=False,
                   cc=point.arch.cc)


def candidate_problems(instance: Instance) -> Iterator[Problem]:
    """Problems the instance may be chosen for, likeliest first: its own problem, then the
    variations its capabilities allow (smaller head dims when it pads them, calls without the
    log-sum-exp when it writes it, other seqlen shapes when it pads them), all on its own arch:
    on a newer GPU a newer arch's instance would be preferred. Lazy, as the first one is
    usually a witness."""
    own = own_problem(instance)
    tile = instance.tile
    # The flags it writes but a call may leave off: every combination, its own first.
    flags = [axis for axis in SERVES_WITHOUT if instance.point.traits.flag(axis)]
    variants = [dict(zip(flags, values))
                for values in itertools.product((True, False), repeat=len(flags))]
    shapes = [(own.seqlen_q, own.seqlen_k, False)]
    if instance.point.pad_seqlen:
        shapes += [(tile.block_m, tile.block_n, True), (tile.block_m, tile.block_n, False)]
    for hdim_q, hdim_v in _candidate_hdims(instance):
        for variant in variants:
            traits = replace(own.traits, hdim_q=hdim_q, hdim_v=hdim_v, **variant)
            for seqlen_q, seqlen_k, seqused in shapes:
                yield replace(own, traits=traits, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                              seqused=seqused)


def _candidate_hdims(instance: Instance) -> Iterator[tuple[int, int]]:
    """Its own head dims, then, when it pads them, every smaller pair nearest first: the pair
    just below its own is the likeliest witness, as a smaller padded instance is preferred for
    everything it covers."""
    own = (instance.point.traits.hdim_q, instance.point.traits.hdim_v)
    yield own
    if instance.point.pad_hdim:
        step = WITNESS_HDIM_STEP
        smaller = itertools.product(*(range(dim // step * step, 0, -step) for dim in own))
        yield from sorted((pair for pair in smaller if pair != own),
                          key=lambda pair: sum(own) - sum(pair))


# The operation of an --explain problem that does not name one.
DEFAULT_OP = OPERATION.get("fwd")


def spelled(value) -> str:
    """A trait value as problems and filters write it: true, causal."""
    return str(value).lower() if isinstance(value, bool) else value.token


def describe_problem(problem: Problem) -> str:
    """A problem in the --explain syntax, so that it can be pasted back: op= first unless it
    is the default, then its traits in their class's order."""
    traits = problem.traits
    fields = [] if problem.op == DEFAULT_OP else [f"op={problem.op.token}"]
    for axis in traits.axes():
        value = getattr(traits, axis)
        if axis == "hdim_q":
            fields.append(f"hdim={traits.hdim_q}x{traits.hdim_v}")
        elif axis != "hdim_v":
            fields.append(f"{axis}={spelled(value)}")
    fields += [f"seqlen_q={problem.seqlen_q}", f"seqlen_k={problem.seqlen_k}",
               f"seqused={str(problem.seqused).lower()}", f"arch={problem.cc}"]
    return ",".join(fields)
