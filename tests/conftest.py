"""Shared fixtures of the generator tests (tests/test_generator*.py), and the suite's
environment."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# A call outside the build misses here, as the miss tests expect, rather than compiling on demand
# (fmha.jit: a fuzzed call could compile dozens of instances); the tests of compile on demand
# (test_jit.py, test_misses_gpu.py) turn it on in the processes they start.
os.environ.setdefault("FMHA_JIT", "0")

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# `generator` is a top-level package of the repository: importable without installing anything,
# whichever directory pytest is started from.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from generator.catalog import Catalog, build_catalog  # noqa: E402
from generator.config import DEFAULT_CONFIG, Config, load  # noqa: E402
from generator.errors import ConfigError  # noqa: E402
from generator.model import (  # noqa: E402
    BwdTraits, FwdTraits, Instance, KvcacheTraits, MatrixPoint, Tile)
from generator.operations import OPERATIONS  # noqa: E402
from generator.schema import (  # noqa: E402
    ARCH, BIAS, DTYPE, ENUM_AXES, KV_DTYPE, MASK, MODE, PIPELINE, VLAYOUT)
from generator.selection import Selection, Token, check_presets, select  # noqa: E402

# A configuration independent of the repository's instances.yaml, so the tests keep their
# meaning when the real matrix or its tiles are tuned. Its d128 tile differs from the d64 one
# so that tile order and names can be told apart. It has the fwd operation only, with every
# axis, most with one value (32 instances); tests widen an axis by replacing its line, e.g.
# ("lse: [false]", "lse: [false, true]"). BWD_OPERATION adds the bwd operation, KVCACHE_OPERATION
# the kvcache one (which takes the top matrix's axes it has: not mode or dropout).
BASE_CONFIG = """\
matrix:
  dtype: [fp16, bf16]
  hdim:
    - [64, 64]
    - [128, 128]
  mask: [none, causal]
  bias: [none]
  mode: [batch]
  dropout: [false]
  softcap: [false]
  arch: [sm80, sm90a]
  pad_seqlen: [false, true]
  pad_hdim: [false]
operations:
  fwd:
    matrix:
      vlayout: [row]
      lse: [false]
      pipeline: [fa2]
    tiles:
      - {pipeline: fa2, hdim_q: 64, hdim_v: 64, block_m: 128, block_n: 64, warps: 8, stages: 2, why: d64}
      - pipeline: fa2
        hdim_q: 128
        hdim_v: 128
        block_m: 64
        block_n: 32
        warps: 4
        stages: 2
        why: d128
    rules: []
presets:
  default: {filter: "", why: everything}
  minimal: {filter: "fp16,hdim64,mask=none", why: smoke build}
"""

# The bwd operation for BASE_CONFIG, as a replacement: 32 more instances (its d128 tile also
# differs from its d64 one). With it the default preset selects 64.
BWD_OPERATION = ("presets:\n", """\
  bwd:
    matrix:
      dbias: [false]
      pipeline: [fa2]
    tiles:
      - {pipeline: fa2, hdim_q: 64, hdim_v: 64, block_m: 64, block_n: 128, warps: 8, stages: 2, why: bwd d64}
      - {pipeline: fa2, hdim_q: 128, hdim_v: 128, block_m: 64, block_n: 64, warps: 4, stages: 2, why: bwd d128}
    rules: []
presets:
""")

# The kvcache operation for BASE_CONFIG, as a replacement (after BWD_OPERATION's, when both are
# used): a cache of the queries' dtype, contiguous and paged, padded only, so 32 more instances
# (its d128 tile differs from its d64 one too).
KVCACHE_OPERATION = ("presets:\n", """\
  kvcache:
    matrix:
      kv_dtype: [same]
      paged: [false, true]
      pipeline: [fa2]
    tiles:
      - {pipeline: fa2, hdim_q: 64, hdim_v: 64, block_m: 16, block_n: 64, warps: 4, stages: 2, why: kvcache d64}
      - {pipeline: fa2, hdim_q: 128, hdim_v: 128, block_m: 16, block_n: 128, warps: 4, stages: 2, why: kvcache d128}
    rules:
      - {when: {pad_seqlen: false}, reason: the cache lengths live on the device}
presets:
""")


def make_traits(op: str, hdim: tuple[int, int], **values):
    """Traits of operation `op` (fwd, bwd, kvcache) at head dims `hdim`: each enum trait its
    axis's first value (fp16, no mask, row-major V, ...) and each flag false, but for `values`
    (tokens of enum traits, booleans of flags), e.g. make_traits("fwd", (128, 128),
    dtype="e4m3", vlayout="col"): what operations.SharedMemory reads."""
    cls = OPERATIONS[op].traits
    fields = {}
    for axis in cls.axes():
        if axis in ("hdim_q", "hdim_v"):
            continue
        value = values.pop(axis, None)
        fields[axis] = (ENUM_AXES[axis].get(value or ENUM_AXES[axis].tokens[0])
                        if axis in ENUM_AXES else bool(value))
    assert not values, f"{op} has no trait {', '.join(values)}"
    return cls(hdim_q=hdim[0], hdim_v=hdim[1], **fields)


@dataclass(frozen=True)
class RepositoryMatrix:
    """instances.yaml's config, catalog and checked presets (check_presets' result)."""

    config: Config
    catalog: Catalog
    preset_tokens: dict[str, tuple[Token, ...]]

    def select(self, preset: str, filter_text: str = "") -> Selection:
        return select(self.config, self.catalog, preset, filter_text,
                      preset_tokens=self.preset_tokens)


@functools.cache
def repository() -> RepositoryMatrix:
    """instances.yaml's matrix, built once for the whole run: a build and its preset check take
    3.5-5 s of CPU on a 2-core machine like CI's, and a dozen test modules read the same
    immutable matrix. The tests that time a build make their own."""
    config = load(DEFAULT_CONFIG)
    catalog = build_catalog(config)
    return RepositoryMatrix(config, catalog, check_presets(config, catalog))


def _line_of(text: str, fragment: str) -> int:
    lines = [n for n, line in enumerate(text.splitlines(), 1) if fragment in line]
    assert len(lines) == 1, f"{fragment!r} is on lines {lines}"
    return lines[0]


@pytest.fixture
def line_of():
    """line_of(text, fragment): the 1-based line of the only line of `text` with `fragment`."""
    return _line_of


def _replace(text: str, old: str, new: str) -> str:
    """Replaces the first `old` with `new`. Both are written as for a flat file of one operation
    (its matrix axes, tiles and rules at the top level, as instances.yaml was before it had
    `operations:`): where `old` lies inside `operations:`, their lines are shifted right by the
    4 columns of `operations:` and `fwd:` (the first line too when `old` starts with
    indentation). So ("rules: []", "rules:\n  - when: ...") replaces the fwd operation's
    rules, and ("    warps: 4\n", "") drops a line of its tiles."""
    indented = old.startswith(" ")

    def shifted(lines: str, by: int) -> str:
        first, *rest = lines.split("\n")
        pad = [" " * by + line if line else line for line in (first, *rest)]
        return "\n".join([pad[0] if indented else first, *pad[1:]])

    # Inside `operations:`: from the line after it to `presets:`.
    begin = text.find("\noperations:\n")
    begin, end = (-1, -1) if begin == -1 else (begin + 13, text.find("\npresets:"))
    found = []
    for by in (0, 4):
        target = shifted(old, by)
        at = text.find(target)
        while at != -1 and (by == 4) != (begin <= at < end):
            at = text.find(target, at + 1)
        if at != -1:
            found.append((at, by, target))
    assert found, f"{old!r} is not in the config"
    at, by, target = min(found)
    return text[:at] + shifted(new, by) + text[at + len(target):]


@pytest.fixture
def make_config(tmp_path):
    """Writes BASE_CONFIG, with (old, new) replacements applied (see _replace), and returns its
    path."""

    def make(*replacements: tuple[str, str], text: str = BASE_CONFIG) -> Path:
        for old, new in replacements:
            text = _replace(text, old, new)
        path = tmp_path / "config.yaml"
        path.write_text(text)
        return path

    return make


@pytest.fixture
def build(make_config):
    """Loads a config made as make_config does and builds its catalog: (config, catalog)."""

    def build_(*replacements: tuple[str, str], text: str = BASE_CONFIG):
        config = load(make_config(*replacements, text=text))
        return config, build_catalog(config)

    return build_


@pytest.fixture
def config_error(make_config):
    """The ConfigError that a run (load, build the catalog, check the presets) raises for a
    config made as make_config does, and the config's text."""

    def config_error_(*replacements: tuple[str, str]):
        path = make_config(*replacements)
        with pytest.raises(ConfigError) as caught:
            config = load(path)
            select(config, build_catalog(config), "default")
        return caught.value, path.read_text()

    return config_error_


@pytest.fixture
def run_cli():
    """Runs `python -m generator` from the repository root, as users and CMake do."""

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "generator", *map(str, args)], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60)

    return run


@pytest.fixture
def make_bwd_instance():
    """make_bwd_instance(dtype=..., hdim=(q, v), mask=..., dbias=..., arch=..., ...): one bwd
    Instance built directly, without a config; unnamed traits take their defaults."""

    def make(dtype="fp16", hdim=(64, 64), mask="none", bias="none", mode="batch", dbias=False,
             dropout=False, softcap=False, pipeline=PIPELINE.get("fa2"), arch="sm80",
             pad_seqlen=False, pad_hdim=False, tile=Tile(64, 128, 8, 2)) -> Instance:
        traits = BwdTraits(DTYPE.get(dtype), *hdim, MASK.get(mask), BIAS.get(bias),
                           MODE.get(mode), dbias, dropout, softcap)
        return Instance(MatrixPoint(traits, pipeline, ARCH.get(arch), pad_seqlen, pad_hdim), tile)

    return make


@pytest.fixture
def make_kvcache_instance():
    """make_kvcache_instance(dtype=..., hdim=(q, v), mask=..., paged=..., kv_dtype=..., ...): one
    kvcache Instance built directly, without a config; unnamed traits take their defaults
    (padded sequence lengths, as every kvcache instance has)."""

    def make(dtype="fp16", hdim=(64, 64), mask="none", bias="none", paged=False, softcap=False,
             pipeline=PIPELINE.get("fa2"), arch="sm80", pad_seqlen=True, pad_hdim=False,
             tile=Tile(16, 64, 4, 2), kv_dtype="same") -> Instance:
        traits = KvcacheTraits(DTYPE.get(dtype), KV_DTYPE.get(kv_dtype), *hdim, MASK.get(mask),
                               BIAS.get(bias), paged, softcap)
        return Instance(MatrixPoint(traits, pipeline, ARCH.get(arch), pad_seqlen, pad_hdim), tile)

    return make


@pytest.fixture
def make_instance():
    """make_instance(dtype=..., hdim=(q, v), mask=..., lse=..., arch=..., pad_seqlen=..., ...):
    one Instance built directly, without a config; unnamed traits take their defaults."""

    def make(dtype="fp16", hdim=(64, 64), mask="none", bias="none", vlayout="row", mode="batch",
             lse=False, dropout=False, softcap=False, pipeline=PIPELINE.get("fa2"), arch="sm80",
             pad_seqlen=False, pad_hdim=False, tile=Tile(128, 64, 8, 2)) -> Instance:
        traits = FwdTraits(DTYPE.get(dtype), *hdim, MASK.get(mask), BIAS.get(bias),
                           VLAYOUT.get(vlayout), MODE.get(mode), lse, dropout, softcap)
        return Instance(MatrixPoint(traits, pipeline, ARCH.get(arch), pad_seqlen, pad_hdim), tile)

    return make
