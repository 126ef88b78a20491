"""Choosing the instances to build from the catalog: the --filter grammar (GRAMMAR below),
presets (named filters in the config) and --targets, all of which must hold; and --shard,
which splits the selected TUs between build jobs."""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Protocol

from .catalog import Catalog
from .config import Config
from .errors import GeneratorError
from .gaps import PipelineGap
from .model import Condition, Instance
from .operations import OPERATIONS
from .schema import (ARCH, BOOL_AXES, ENUM_AXES, FILTER_AXES, INT_AXES, INTEGER, MATRIX_AXES,
                     TRAIT_BOOL_AXES, Arch, AxisValue, OperationKind)


GRAMMAR = """\
A filter is comma-separated tokens that must all hold. A token is
  an operation     fwd, bwd, kvcache (op=kvcache): the forward or the backward pass, or
                   KV-cache attention (decode)
  a value          fp16, e4m3, causal, alibi, col, group, sm90a, fa2 (the axis is implied);
                   kvcache's kv_dtype as names spell it: kve4m3 (e4m3 is the dtype's)
  a head dim       hdim128 (hdim_q = hdim_v = 128), hdim192x128 (hdim_q 192, hdim_v 128)
  a flag           lse, dbias, paged, dropout, softcap: the trait is on (!lse: off)
  padding          pad, nopad (sequence lengths); hpad, nohpad (head dims)
  axis=value       mask=none, hdim_q=192, lse=true, pad_hdim=false, hdim=128
  alternatives     fp16|bf16, causal|*_pad, mask=none|causal (causal joins the axis before)
  a negation       !causal; !fp16|bf16 (neither)
  a name glob      any term with * ? or [ matches instance names (fnmatch): *_sm90a_*
A condition on an axis that an instance's operation does not have (vlayout and lse are fwd's,
dbias bwd's, kv_dtype and paged kvcache's, mode and dropout fwd's and bwd's) does not hold for
it, and its negation does: lse and lse=false select fwd instances only, !lse also every bwd
and kvcache one. A bare value of more than one axis (none: mask and bias) is an error asking
for axis=value, and so is a filter that selects nothing: it names the token that emptied the
selection."""


class Term(Protocol):
    """One alternative of a token: a Condition, HeadDims or NameGlob."""

    def holds(self, instance: Instance) -> bool: ...


@dataclass(frozen=True)
class HeadDims:
    hdim_q: int
    hdim_v: int

    def holds(self, instance: Instance) -> bool:
        traits = instance.point.traits
        return (traits.hdim_q, traits.hdim_v) == (self.hdim_q, self.hdim_v)


@dataclass(frozen=True)
class NameGlob:
    pattern: str

    def holds(self, instance: Instance) -> bool:
        return fnmatchcase(instance.name, self.pattern)


@dataclass(frozen=True)
class Token:
    """One comma-separated token: holds when any alternative does (none, when negated)."""

    text: str  # as written, for messages
    source: str  # where it came from: "--filter", "preset 'minimal'", "--targets"
    alternatives: tuple[Term, ...]
    negated: bool = False

    def holds(self, instance: Instance) -> bool:
        # Loops, here and in AllOf.holds, rather than any() and all() over a generator, which
        # costs one a call: what every preset of instances.yaml selects took 2.0-2.5 s of CPU
        # with them, 1.0-1.1 s without (2026-11-28).
        for term in self.alternatives:
            if term.holds(instance):
                return not self.negated
        return self.negated


class FilterError(GeneratorError):
    """A filter (--filter, or a preset's) that does not parse or selects nothing."""


@dataclass(frozen=True)
class Selection:
    instances: tuple[Instance, ...]  # in the dispatcher's order of preference
    targets: tuple[Arch, ...]  # the archs that have at least one selected instance
    # The catalog's: the dispatch table carries them, so that the runtime can say why a newer
    # pipeline did not run a problem, and which head dims the matrix has (Catalog.head_dims).
    gaps: tuple[PipelineGap, ...]
    head_dims: dict[OperationKind, tuple[tuple[int, int], ...]]


def parse_filter(text: str, source: str, catalog: Catalog) -> tuple[Token, ...]:
    """Parses a whole filter; the catalog only helps error messages list the valid tokens."""
    if not text.strip():
        return ()
    tokens = []
    for word in (part.strip() for part in text.split(",")):
        if not word:
            raise FilterError(f"empty token in {text!r} (tokens are separated by single commas)",
                              source)
        negated = word.startswith("!")
        body = word[1:] if negated else word
        try:
            alternatives = _alternatives(body)
        except _BadTerm as bad:
            context = "" if bad.term == body else f" in {word!r}"
            raise FilterError(f"{bad}{context}", source,
                              details=_vocabulary(catalog) if bad.list_tokens else "") from None
        tokens.append(Token(word, source, alternatives, negated))
    return tuple(tokens)


def parse_targets(text: str) -> tuple[Arch, ...]:
    """--targets: arch tokens (sm80,sm90a) or CMake CUDA_ARCHITECTURES style (80;90a), split by
    ';' or ','."""
    archs = []
    for word in filter(None, (part.strip() for part in re.split(r"[;,]", text))):
        arch = ARCH.get(word) or ARCH.get(f"sm{word}")
        if arch is None:
            valid = ", ".join(f"{a.token} ({a.token[2:]})" for a in ARCH)
            raise GeneratorError(f"unknown target {word!r}; valid: {valid}", "--targets")
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise GeneratorError("no target given", "--targets")
    return tuple(archs)


@dataclass(frozen=True)
class Shard:
    """Part `index` (from 1) of `count` disjoint parts of a selection's TUs, for a build split
    over several jobs (--shard K/N)."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def take(self, instances: Sequence[Instance]) -> tuple[Instance, ...]:
        """This shard's instances, in their given order.

        Instances are dealt round-robin in order of their compile_cost_class, so that every
        shard gets its share of each class. Within a class the order is a hash of the name:
        names sort in periods (dtype, mask, ...) that round-robin would alias with, e.g.
        dealing every padded TU to half of four shards. The split depends on nothing but the
        selection."""
        dealt = sorted(instances, key=lambda instance: (
            compile_cost_class(instance),
            hashlib.sha256(instance.name.encode()).hexdigest()))[self.index - 1::self.count]
        mine = {instance.name for instance in dealt}
        return tuple(instance for instance in instances if instance.name in mine)


def compile_cost_class(instance: Instance) -> tuple:
    """A proxy for how long nvcc takes on an instance's TU, costliest first: the larger head
    dims (more unrolled MMA code per step), then the operation (a bwd TU holds three kernels),
    the pipeline (CuTe-based fa3 and hand-written fa2 compile differently), the traits that
    add code (padding, dropout, bias) and the arch."""
    point, traits = instance.point, instance.point.traits
    return (-traits.hdim_q - traits.hdim_v, -traits.hdim_q, instance.op.token,
            point.pipeline.token, point.pad_seqlen, point.pad_hdim, traits.flag("dropout"),
            traits.bias.value, point.arch.token)


def parse_shard(text: str) -> Shard:
    """--shard K/N with 1 <= K <= N."""
    match = re.fullmatch(rf"\s*({INTEGER})\s*/\s*({INTEGER})\s*", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise GeneratorError(f"expected K/N with 1 <= K <= N, e.g. 2/4; got {text!r}", "--shard")
    return Shard(int(match[1]), int(match[2]))


def select(config: Config, catalog: Catalog, preset: str, filter_text: str = "",
           targets: tuple[Arch, ...] | None = None,
           preset_tokens: dict[str, tuple[Token, ...]] | None = None) -> Selection:
    """The instances that pass the preset, the filter and the targets (all must hold). Every
    preset of the config is checked on the way, so a broken one fails every run, not just the
    run that happens to use it; a caller that selects many times from one config passes
    check_presets' result once checked (compile on demand: seconds a selection)."""
    if preset_tokens is None:
        preset_tokens = check_presets(config, catalog)
    if preset not in preset_tokens:
        raise GeneratorError(f"unknown preset {preset!r}; valid: {', '.join(config.presets)}",
                             "--preset")
    options = _option_tokens(catalog, filter_text, targets)
    return _selection(catalog, narrow(catalog, [*preset_tokens[preset], *options]))


def select_each_preset(config: Config, catalog: Catalog, filter_text: str = "",
                       targets: tuple[Arch, ...] | None = None,
                       preset_tokens: dict[str, tuple[Token, ...]] | None = None
                       ) -> dict[str, Selection]:
    """What each preset selects with the filter and the targets, for --presets: a preset they
    empty has an empty selection here rather than an error. `preset_tokens`: check_presets'
    result, as select takes it."""
    if preset_tokens is None:
        preset_tokens = check_presets(config, catalog)
    options = _option_tokens(catalog, filter_text, targets)
    return {name: _selection(catalog, tuple(
                i for i in catalog.instances
                if all(token.holds(i) for token in (*tokens, *options))))
            for name, tokens in preset_tokens.items()}


def check_presets(config: Config, catalog: Catalog) -> dict[str, tuple[Token, ...]]:
    """Every preset's parsed filter; a preset that does not parse or selects nothing is an
    error at its line."""
    return {name: _preset_tokens(config, catalog, name) for name in config.presets}


def _option_tokens(catalog: Catalog, filter_text: str,
                   targets: tuple[Arch, ...] | None) -> list[Token]:
    tokens = list(parse_filter(filter_text, "--filter", catalog))
    if targets is not None:
        tokens.append(Token(";".join(a.token for a in targets), "--targets",
                            (Condition("arch", frozenset(targets)),)))
    return tokens


def _selection(catalog: Catalog, instances: tuple[Instance, ...]) -> Selection:
    archs = {instance.point.arch for instance in instances}
    return Selection(instances, tuple(a for a in ARCH if a in archs), catalog.gaps,
                     catalog.head_dims)


def narrow(catalog: Catalog, tokens: Sequence[Token]) -> tuple[Instance, ...]:
    """Applies the tokens in turn; the first one that leaves nothing is named in the error."""
    remaining = catalog.instances
    for index, token in enumerate(tokens):
        narrowed = tuple(i for i in remaining if token.holds(i))
        if narrowed:
            remaining = narrowed
            continue
        if not any(token.holds(i) for i in catalog.instances):
            problem = f"{token.text!r} matches none of the {len(catalog.instances)} instances"
        else:
            by_source = defaultdict(list)
            for earlier in tokens[:index]:
                by_source[earlier.source].append(earlier.text)
            before = " and ".join(f"{source} {','.join(texts)!r}"
                                  for source, texts in by_source.items())
            problem = (f"{token.text!r} matches none of the {len(remaining)} instances left "
                       f"by {before}")
        raise FilterError(f"{problem}, so nothing would be built", token.source)
    return remaining


@dataclass(frozen=True)
class AllOf:
    """One filter of a union preset: holds when all its tokens do."""

    tokens: tuple[Token, ...]

    def holds(self, instance: Instance) -> bool:
        for token in self.tokens:  # a loop: see Token.holds
            if not token.holds(instance):
                return False
        return True


def _preset_tokens(config: Config, catalog: Catalog, name: str) -> tuple[Token, ...]:
    """A preset of one filter is its tokens; a union of several is one token whose
    alternatives are the filters. Each filter must parse and select something by itself."""
    preset = config.presets[name]
    source = f"preset {name!r}"
    filters = []
    for index, text in enumerate(preset.filters):
        where = f"presets.{name}.filter" + (f"[{index}]" if len(preset.filters) > 1 else "")
        try:
            tokens = parse_filter(text, source, catalog)
            narrow(catalog, tokens)
        except FilterError as err:
            raise config.error(preset.line, f"{where}: {err.message}",
                               details=err.details) from None
        filters.append(tokens)
    if len(filters) == 1:
        return filters[0]
    return (Token(preset.filter, source, tuple(AllOf(tokens) for tokens in filters)),)


class _BadTerm(Exception):
    """A term the grammar rejects; parse_filter says which token held it and, when the problem
    is a word the grammar does not know, lists the valid tokens."""

    def __init__(self, message: str, term: str, list_tokens: bool = False) -> None:
        super().__init__(message)
        self.term = term
        self.list_tokens = list_tokens


def _bare_values() -> dict[str, list[tuple[str, AxisValue]]]:
    """Each bare word of an enum value and the axes it is a value of: its token, and for an
    axis with a name prefix also the token as instance names spell it (kve4m3). Where a token
    is a value of an axis without a prefix too (dtype's e4m3), the bare token is that axis's
    and the prefixed axis's value takes its prefixed word only, as in names: e4m3 is the
    queries' dtype, kve4m3 the cache's. A word of two axes without prefixes (none: mask and
    bias) is ambiguous bare."""
    owners = defaultdict(list)
    for axis in ENUM_AXES.values():
        for value in axis:
            owners[value.token].append((axis.name, value))
            if axis.name_prefix:
                owners[axis.name_prefix + value.token].append((axis.name, value))
    for word, claims in owners.items():
        plain = [(name, value) for name, value in claims
                 if not ENUM_AXES[name].name_prefix or word != value.token]
        if plain and len(plain) < len(claims):
            owners[word] = plain
    return dict(owners)


_BARE_VALUES = _bare_values()

_HDIM = re.compile(rf"({INTEGER})(?:x({INTEGER}))?")
# Bare words of the boolean axes: a trait flag is named after its axis and means it is on (as
# in instance names); each padding axis has a word for either value.
_BOOL_WORDS: dict[str, tuple[str, bool]] = {
    **{axis: (axis, True) for axis in TRAIT_BOOL_AXES},
    "pad": ("pad_seqlen", True), "nopad": ("pad_seqlen", False),
    "hpad": ("pad_hdim", True), "nohpad": ("pad_hdim", False),
}
_GLOB_CHARS = set("*?[")


def _alternatives(body: str) -> tuple[Term, ...]:
    """The '|'-separated terms of a token. A plain term after an axis=value one is another value
    of that axis when it can be (mask=none|causal), and a term of its own otherwise."""
    terms: list[Term] = []
    axis = None  # the axis the last axis=value term named
    for text in body.split("|"):
        if "=" in text:
            axis, _, value = text.partition("=")
            terms.append(_axis_term(axis, value, text))
        else:
            joined = _value_of(axis, text) if axis else None
            terms.append(joined or _term(text))
    return tuple(terms)


def _term(text: str) -> Term:
    if not text:
        raise _BadTerm("empty alternative", text)
    if _GLOB_CHARS & set(text):
        return NameGlob(text)
    if text.startswith("hdim") and (dims := _HDIM.fullmatch(text[len("hdim"):])):
        return _head_dims(dims)
    if text in _BOOL_WORDS:
        axis, value = _BOOL_WORDS[text]
        return Condition(axis, frozenset({value}))
    owners = _BARE_VALUES.get(text)
    if not owners:
        raise _BadTerm(f"unknown token {text!r}", text, list_tokens=True)
    if len(owners) > 1:
        axes = [axis for axis, _ in owners]
        raise _BadTerm(f"{text!r} is a value of more than one axis ({', '.join(axes)}); write "
                       f"{' or '.join(f'{axis}={text}' for axis in axes)}", text)
    axis, value = owners[0]
    return Condition(axis, frozenset({value}))


def _axis_term(axis: str, text: str, term: str) -> Term:
    """axis=text, written as `term`."""
    if axis == "hdim":
        dims = _HDIM.fullmatch(text)
        if not dims:
            raise _BadTerm(f"{term!r}: hdim= takes N or QxV, e.g. hdim=128, hdim=192x128", term)
        return _head_dims(dims)
    if axis not in FILTER_AXES:
        raise _BadTerm(f"unknown axis {axis!r} in {term!r}", term, list_tokens=True)
    return Condition(axis, frozenset({_axis_value(axis, text, term)}))


def _value_of(axis: str, text: str) -> Term | None:
    try:
        return _axis_term(axis, text, text)
    except _BadTerm:
        return None


def _axis_value(axis: str, text: str, term: str):
    if axis in ENUM_AXES:
        value = ENUM_AXES[axis].get(text)
        if value is None:
            raise _BadTerm(f"{term!r}: unknown {axis} {text!r}; valid: "
                           f"{', '.join(ENUM_AXES[axis].tokens)}", term)
        return value
    if axis in INT_AXES:
        if not re.fullmatch(INTEGER, text):
            raise _BadTerm(f"{term!r}: {axis} takes a number, not {text!r}", term)
        return int(text)
    assert axis in BOOL_AXES, axis
    if text not in ("true", "false"):
        raise _BadTerm(f"{term!r}: {axis} takes true or false, not {text!r}", term)
    return text == "true"


def _head_dims(match: re.Match) -> HeadDims:
    hdim_q = int(match[1])
    return HeadDims(hdim_q, int(match[2]) if match[2] else hdim_q)


def _vocabulary(catalog: Catalog) -> str:
    """The valid tokens, grouped by axis, for error messages."""
    hdims = sorted({(i.point.traits.hdim_q, i.point.traits.hdim_v) for i in catalog.instances})
    hdim_tokens = [f"hdim{q}" if q == v else f"hdim{q}x{v}" for q, v in hdims]
    # A value is listed by its bare word (kv_dtype's e4m3 by its prefixed one, kve4m3), or as
    # axis=value where a bare one would be ambiguous.
    groups = {name: [_bare_word(name, value) for value in axis]
              for name, axis in ENUM_AXES.items()}
    groups["hdim"] = [*hdim_tokens, "hdim_q=N", "hdim_v=N"]
    for axis in BOOL_AXES:
        words = [word for word, (word_axis, _) in _BOOL_WORDS.items() if word_axis == axis]
        groups[axis] = [*words, f"{axis}=true|false"]
    axes = ("op", *MATRIX_AXES)
    width = max(map(len, axes))
    lines = [f"  {axis:<{width}}  {', '.join(groups[axis])}" for axis in axes]
    lines.append(f"  {'name':<{width}}  a glob with * ? or [, e.g. *_sm90a_*")
    own = "; ".join(f"{', '.join(axes)}: {owners}" for owners, axes in _own_axes().items())
    return ("valid tokens (',' joins tokens that must all hold, '|' alternatives, "
            "a leading '!' negates):\n" + "\n".join(lines)
            + f"\nan operation's own axes ({own}) hold for no instance of another operation")


def _bare_word(axis: str, value: AxisValue) -> str:
    """The word a filter names `value` of `axis` by alone, or axis=value where none does."""
    for word in (value.token, ENUM_AXES[axis].name_prefix + value.token):
        if _BARE_VALUES.get(word) == [(axis, value)]:
            return word
    return f"{axis}={value.token}"


def _own_axes() -> dict[str, list[str]]:
    """The matrix axes that not every operation has, by the operations that have them (e.g.
    "fwd's and bwd's"), in the order of their first axis."""
    ops = OPERATIONS.values()
    owned = defaultdict(list)
    for axis in MATRIX_AXES:
        owners = [op.token for op in ops if axis in op.matrix_axes]
        if len(owners) < len(ops):
            owned[" and ".join(f"{owner}'s" for owner in owners)].append(axis)
    return dict(owned)
