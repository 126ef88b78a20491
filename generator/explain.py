"""--explain PROBLEM: the instance the runtime would run for a problem among the selected ones,
the rule of preference that put it first, and the rule of the config that kept a newer pipeline
from it (gaps.py); on a miss, the nearest selected instances and a --filter that would build one
that fits.

It answers with dispatch.serves and dispatch.PREFERENCE, the matching rule and the order that
the C++ dispatcher applies to the table of the problem's operation (op=fwd, op=bwd or
op=kvcache) that this selection renders, so no GPU is needed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from .catalog import Catalog
from .config import Config
from .dispatch import (DEFAULT_OP, EQUAL_TRAITS, PREFERENCE, SERVES_WITHOUT, Problem,
                       deciding_criterion, describe_problem, equal_traits, first_serving, serves,
                       unmet)
from .errors import GeneratorError
from .gaps import fallback_notes, spell
from .model import ABSENT, Instance
from .operations import OPERATIONS, Operation
from .schema import (ARCH, BUILD_AXES, ENUM_AXES, INTEGER, MATRIX_AXES, OPERATION, Arch,
                     head_dims_joined, with_head_dims)
from .selection import Selection, Token, parse_filter, select_each_preset

_SHAPE_DEFAULTS = {"seqlen_q": "1024", "seqlen_k": "1024", "seqused": "false"}
_SHAPE_KEYS = (*_SHAPE_DEFAULTS, "arch")


def problem_keys(op: Operation) -> tuple[str, ...]:
    """The keys of a problem of `op`: its traits (hdim for the two head dims, or each), the
    shape, the device, and op."""
    return (*with_head_dims(head_dims_joined(op.traits.axes())), *_SHAPE_KEYS, "op")


# Every operation's keys, in the order of the matrix axes.
PROBLEM_KEYS = (*with_head_dims(tuple(
                    axis for axis in MATRIX_AXES if axis not in BUILD_AXES
                    and any(axis in op.matrix_axes for op in OPERATIONS.values()))),
                *_SHAPE_KEYS, "op")

# The device a problem runs on unless it says: the newest one a target is built for.
_NEWEST = max(ARCH, key=lambda arch: (arch.cc, arch.exact))

PROBLEM_HELP = f"""\
PROBLEM (--explain) is comma-separated key=value:
  op               {', '.join(OPERATION.tokens)}: the forward or the backward pass, or KV-cache
                   attention (default: {DEFAULT_OP.token})
  dtype            {', '.join(ENUM_AXES['dtype'].tokens)} (required; e4m3 is the forward's only)
  kv_dtype         kvcache only: {', '.join(ENUM_AXES['kv_dtype'].tokens)}, what the cache holds
                   (default: {ENUM_AXES['kv_dtype'].name_default}: the dtype)
  hdim             N or QxV, or hdim_q=N and hdim_v=N (required; hdim_v defaults to hdim_q)
  mask, bias       as in the matrix (default: none, none)
  mode             fwd and bwd: batch or group (default: batch)
  vlayout          fwd only: row or col (default: row)
  lse              fwd only: true or false (default: false)
  dbias            bwd only: true or false (default: false)
  paged            kvcache only: true or false (default: false)
  dropout          fwd and bwd: true or false (default: false)
  softcap          true or false (default: false)
  seqlen_q, seqlen_k              positive integers (default: 1024); kvcache's seqlen_k is
                                  its cache's length
  seqused          true or false: per-batch effective lengths are given (default: false)
  arch             the device: a target (sm90a, 90a) or a compute capability (90, 8.6);
                   default: cc {_NEWEST.cc} ({_NEWEST.token}'s)
e.g. --explain dtype=bf16,hdim=128,mask=causal,lse=true,seqlen_q=1000,arch=sm90a
     --explain op=bwd,dtype=bf16,hdim=128,mask=causal,arch=sm90a
     --explain op=kvcache,dtype=bf16,hdim=128,mask=causal,paged=true,seqlen_q=1,arch=sm90a
     --explain op=kvcache,dtype=bf16,kv_dtype=e4m3,hdim=128,seqlen_q=1,arch=sm90a"""

# How many of the nearest instances a miss lists.
NEAREST = 3


def _error(message: str) -> GeneratorError:
    return GeneratorError(message, "--explain")


def parse_problem(text: str) -> Problem:
    """PROBLEM_HELP's syntax; every mistake names the key and the valid values. It needs no
    config, so a mistake is reported before the catalog is built."""
    fields: dict[str, str] = {}
    for word in (part.strip() for part in text.split(",")):
        key, equals, value = (part.strip() for part in word.partition("="))
        if not (key and equals and value):
            raise _error(f"expected key=value, got {word!r}; keys: {', '.join(PROBLEM_KEYS)}")
        if key not in PROBLEM_KEYS:
            raise _error(f"unknown key {key!r}; valid: {', '.join(PROBLEM_KEYS)}")
        if key in fields:
            raise _error(f"{key} is given twice")
        fields[key] = value
    op = OPERATIONS[_enum_value("op", fields.get("op", DEFAULT_OP.token)).token]
    keys = problem_keys(op)
    for key in fields:
        if key not in keys:
            owners = [other.token for other in OPERATIONS.values() if key in problem_keys(other)]
            raise _error(f"{key} is a key of op={' and op='.join(owners)}, not of op={op.token}; "
                         f"valid: {', '.join(keys)}")
    if "dtype" not in fields:
        raise _error(f"needs dtype= ({', '.join(ENUM_AXES['dtype'].tokens)})")
    hdim_q, hdim_v = _head_dims(fields)
    traits = {}
    for axis in op.traits.axes():
        if axis in ("hdim_q", "hdim_v"):
            continue
        if axis in ENUM_AXES:
            traits[axis] = _enum_value(axis, fields.get(axis, ENUM_AXES[axis].name_default))
        else:
            traits[axis] = _bool_value(axis, fields.get(axis, "false"))
    values = {**_SHAPE_DEFAULTS, **fields}
    return Problem(
        op.traits(hdim_q=hdim_q, hdim_v=hdim_v, **traits),
        seqlen_q=_positive(values, "seqlen_q"), seqlen_k=_positive(values, "seqlen_k"),
        seqused=_bool_value("seqused", values["seqused"]),
        cc=_compute_capability(fields.get("arch", _NEWEST.token)))


def _enum_value(key: str, text: str):
    value = ENUM_AXES[key].get(text)
    if value is None:
        raise _error(f"unknown {key} {text!r}; valid: {', '.join(ENUM_AXES[key].tokens)}")
    return value


def _bool_value(key: str, text: str) -> bool:
    if text not in ("true", "false"):
        raise _error(f"{key} takes true or false, not {text!r}")
    return text == "true"


def _positive(values: dict[str, str], key: str) -> int:
    if not re.fullmatch(INTEGER, values[key]) or int(values[key]) == 0:
        raise _error(f"{key} takes a positive integer, not {values[key]!r}")
    return int(values[key])


def _head_dims(fields: dict[str, str]) -> tuple[int, int]:
    if "hdim" in fields:
        if "hdim_q" in fields or "hdim_v" in fields:
            raise _error("give hdim= or hdim_q=/hdim_v=, not both")
        dims = re.fullmatch(rf"({INTEGER})(?:x({INTEGER}))?", fields["hdim"])
        if not dims or int(dims[1]) == 0 or (dims[2] and int(dims[2]) == 0):
            raise _error(f"hdim takes N or QxV (positive), e.g. 128 or 192x128, "
                         f"not {fields['hdim']!r}")
        return int(dims[1]), int(dims[2] or dims[1])
    if "hdim_q" not in fields:
        raise _error("needs hdim=N or QxV (or hdim_q= and hdim_v=)")
    hdim_q = _positive(fields, "hdim_q")
    return hdim_q, _positive(fields, "hdim_v") if "hdim_v" in fields else hdim_q


def _compute_capability(text: str) -> int:
    """A target token (sm90a, 90a) stands for the GPU it is built for; 90 and 9.0 are cc 9.0."""
    arch = ARCH.get(text) or ARCH.get(f"sm{text}")
    if arch is not None:
        return arch.cc
    if dims := re.fullmatch(r"([0-9]{1,2})\.([0-9])", text):
        return int(dims[1]) * 10 + int(dims[2])
    if re.fullmatch(r"[0-9]{2,3}", text):
        return int(text)
    targets = ", ".join(ARCH.tokens)
    raise _error(f"arch {text!r} is neither a target ({targets}) nor a compute capability "
                 f"(e.g. 90 or 8.6)")


# What an unmet requirement (dispatch.REQUIREMENTS, by name) looks like for one instance and
# problem, in words: the instance's side, then the call's in parentheses.
def _seqlen_mismatch(instance: Instance, problem: Problem) -> str:
    mode = problem.traits.value("mode")
    if mode is ABSENT:
        return (f"pad_seqlen=false runs lengths known on the host only ({problem.op.token}'s "
                f"live on the device)")
    if mode.token != "batch":
        return f"pad_seqlen=false runs batch mode only (the call: {mode.token})"
    if problem.seqused:
        return "pad_seqlen=false runs no seqused (the call gives it)"
    tile = instance.tile
    return (f"pad_seqlen=false needs seqlen_q % {tile.block_m} == 0 and seqlen_k % "
            f"{tile.block_n} == 0 (the call: {problem.seqlen_q} and {problem.seqlen_k})")


def _hdim_mismatch(instance: Instance, problem: Problem) -> str:
    have, want = instance.point.traits, problem.traits
    call = f"(the call: {want.hdim_q}x{want.hdim_v})"
    if instance.point.pad_hdim:
        return f"pads head dims up to {have.hdim_q}x{have.hdim_v} in steps of 8 {call}"
    return f"head dims {have.hdim_q}x{have.hdim_v} {call}"


def _arch_mismatch(instance: Instance, problem: Problem) -> str:
    arch = instance.point.arch
    needs = f"runs only on cc {arch.cc}" if arch.exact else f"needs cc {arch.cc} or newer"
    return f"{arch.token} {needs} (the device: cc {problem.cc})"


def _trait_mismatch(trait: str) -> Callable[[Instance, Problem], str]:
    def mismatch(instance: Instance, problem: Problem) -> str:
        have, want = (getattr(t, trait) for t in (instance.point.traits, problem.traits))
        return f"{trait}={spell(have)} (the call: {spell(want)})"
    return mismatch


_MISMATCH: dict[str, Callable[[Instance, Problem], str]] = {
    "op": lambda instance, problem: f"op={instance.op.token} (the call: {problem.op.token})",
    "arch": _arch_mismatch,
    "hdim": _hdim_mismatch,
    "lse": lambda instance, problem: "lse=false (the call asks for the log-sum-exp)",
    "seqlen": _seqlen_mismatch,
    **{trait: _trait_mismatch(trait) for trait in EQUAL_TRAITS},
}


def mismatches(instance: Instance, problem: Problem) -> list[str]:
    """Why `instance` does not serve `problem`, one phrase per unmet requirement."""
    return [_MISMATCH[requirement.name](instance, problem)
            for requirement in unmet(instance, problem)]


def explain(problem: Problem, selection: Selection, config: Config, catalog: Catalog,
            preset: str, targets: tuple[Arch, ...] | None,
            preset_tokens: dict[str, tuple[Token, ...]] | None = None) -> str:
    """The explanation as printed, for the selection this run's preset, --filter and --targets
    made; the problem's operation's instances are its table. On a miss the config's presets
    are searched for one that builds a fitting instance. `preset_tokens`: check_presets'
    result, as select takes it."""
    lines = [f"problem: {describe_problem(problem)}"]
    table = [i for i in selection.instances if i.op == problem.op]
    serving = [i for i in table if serves(i, problem)]
    if serving:
        lines += _hit(serving, problem, selection, len(table))
    else:
        lines += _miss(problem, table, catalog,
                       select_each_preset(config, catalog, preset_tokens=preset_tokens), preset,
                       targets, config)
    return "\n".join(lines) + "\n"


def _hit(serving: list[Instance], problem: Problem, selection: Selection,
         selected: int) -> list[str]:
    chosen, op = serving[0], problem.op.token
    lines = [f"chosen:  {chosen.name}"]
    notes = [f"note:    {note}"
             for note in fallback_notes(chosen, problem.traits, selection.gaps)]
    if len(serving) == 1:
        return [*lines, f"why:     the only one of the {selected} selected {op} instances that "
                        f"serves it", *notes]
    runner_up = serving[1]
    criterion = deciding_criterion(chosen, runner_up)
    rule = PREFERENCE.index(criterion) + 1
    lines.append(f"why:     {len(serving)} of the {selected} selected {op} instances serve it; "
                 f"it goes ahead of the runner-up {runner_up.name} by rule {rule} of the "
                 f"dispatch order, {criterion.prefers}: {criterion.shows(chosen)} against "
                 f"{criterion.shows(runner_up)}")
    lines += notes
    lines.append("serving, in dispatch order:")
    lines += [f"  {instance.name}" for instance in serving]
    return lines


def _nearest(instances: Sequence[Instance], problem: Problem) -> list[str]:
    """The instances with the fewest unmet requirements (ties in dispatch order), with why each
    does not serve."""
    ranked = sorted(instances, key=lambda i: len(unmet(i, problem)))[:NEAREST]
    return [f"  {i.name}: {'; '.join(mismatches(i, problem))}" for i in ranked]


def trait_rules(problem: Problem, config: Config) -> list:
    """The rules of the problem's operation that drop its traits from the whole matrix: those
    whose every condition is on a trait (none on how or for which GPU an instance is built)
    and holds for the problem's traits, e.g. {dtype: e4m3, vlayout: row}."""
    rules = config.operations[problem.op.token].rules
    return [rule for rule in rules
            if all(c.axis not in (*BUILD_AXES, "op") for c in rule.when)
            and all(c.holds(problem.traits) for c in rule.when)]


def _miss(problem: Problem, table: list[Instance], catalog: Catalog,
          presets: dict[str, Selection], preset: str,
          targets: tuple[Arch, ...] | None, config: Config | None = None) -> list[str]:
    """`table`: the selected instances of the problem's operation; `presets`: what each preset
    selects without --filter and --targets. A miss of the whole matrix quotes the rules that
    drop the problem's traits (trait_rules), where `config` is given."""
    op = problem.op.token
    lines = [f"none of the {len(table)} selected {op} instances serves it; the nearest:",
             *_nearest(table, problem)]
    # The preset to build a fitting instance with: this run's when it has one (then --filter or
    # --targets left it out), else the one that builds the least.
    fits = {name: fit for name, chosen in presets.items()
            if (fit := first_serving(chosen.instances, problem)) is not None}
    if fits:
        chosen_preset = preset if preset in fits else min(
            fits, key=lambda name: len(presets[name].instances))
        fit = fits[chosen_preset]
    else:
        fit = first_serving(catalog.instances, problem)
    if fit is None:
        dropped = [f"  {rule.label} (line {rule.line}): {' '.join(rule.reason.split())}"
                   for rule in (trait_rules(problem, config) if config is not None else ())]
        return lines + [f"no {op} instance of the whole matrix serves it either; the nearest "
                        f"there:",
                        *_nearest(catalog.of(problem.op), problem),
                        *([f"{config.file}'s rules drop these traits:", *dropped]
                          if dropped else []),
                        "extend the matrix (instances.yaml) to build one"]
    filter_text = fitting_filter(fit, problem, catalog)
    lines.append(f"the matrix has one that fits: {fit.name}")
    if not fits:
        return lines + [f"but no preset selects it; add one whose filter admits "
                        f"{filter_text!r}"]
    command = f"python -m generator --preset {chosen_preset} --filter '{filter_text}'"
    if targets is not None and fit.point.arch not in targets:
        command += f" --targets {','.join(a.token for a in (*targets, fit.point.arch))}"
    return lines + [f"build it with: {command}"]


def fitting_filter(fit: Instance, problem: Problem, catalog: Catalog) -> str:
    """A --filter whose every instance serves `problem`, starting from `fit`'s traits: the
    traits serves() compares are always named; the operation, lse, arch and the padding are
    named only where leaving them out would admit an instance that does not fit."""
    traits, point = fit.point.traits, fit.point
    hdim = (f"hdim{traits.hdim_q}" if traits.hdim_q == traits.hdim_v
            else f"hdim{traits.hdim_q}x{traits.hdim_v}")
    core = [traits.dtype.token, hdim,
            *(f"{axis}={spell(getattr(traits, axis))}" for axis in equal_traits(type(traits))
              if axis != "dtype")]
    optional = [fit.op.token,
                *(f"{axis}={spell(getattr(traits, axis))}" for axis in SERVES_WITHOUT
                  if axis in traits.axes()),
                point.arch.token, "pad" if point.pad_seqlen else "nopad",
                "hpad" if point.pad_hdim else "nohpad"]
    core_tokens = parse_filter(",".join(core), "--explain", catalog)
    candidates = [i for i in catalog.instances if all(t.holds(i) for t in core_tokens)]
    kept = list(optional)
    for token in optional:
        trial = [t for t in kept if t != token]
        trial_tokens = parse_filter(",".join(trial), "--explain", catalog) if trial else ()
        if all(serves(i, problem) for i in candidates
               if all(t.holds(i) for t in trial_tokens)):
            kept = trial
    op_token = [token for token in kept if token == fit.op.token]
    return ",".join([*op_token, *core, *(token for token in kept if token != fit.op.token)])
