"""Shared fixtures of the generator tests (tests/test_generator*.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# `generator` is a top-level package of the repository: importable without installing anything,
# whichever directory pytest is started from.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from generator.catalog import build_catalog  # noqa: E402
from generator.config import load  # noqa: E402
from generator.errors import ConfigError  # noqa: E402
from generator.model import FwdTraits, Instance, MatrixPoint, Tile  # noqa: E402
from generator.schema import ARCH, BIAS, DTYPE, MASK, MODE, PIPELINE, VLAYOUT  # noqa: E402
from generator.selection import select  # noqa: E402

# A configuration independent of the repository's instances.yaml, so the tests keep their
# meaning when the real matrix or its tiles are tuned. Its d128 tile differs from the d64 one
# so that tile order and names can be told apart. It has every axis, most with one value (32
# instances); tests widen an axis by replacing its line, e.g. ("lse: [false]", "lse: [false,
# true]").
BASE_CONFIG = """\
matrix:
  dtype: [fp16, bf16]
  hdim:
    - [64, 64]
    - [128, 128]
  mask: [none, causal]
  bias: [none]
  vlayout: [row]
  mode: [batch]
  lse: [false]
  dropout: [false]
  softcap: [false]
  pipeline: [fa2]
  arch: [sm80, sm90a]
  pad_seqlen: [false, true]
  pad_hdim: [false]
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


def _line_of(text: str, fragment: str) -> int:
    lines = [n for n, line in enumerate(text.splitlines(), 1) if fragment in line]
    assert len(lines) == 1, f"{fragment!r} is on lines {lines}"
    return lines[0]


@pytest.fixture
def line_of():
    """line_of(text, fragment): the 1-based line of the only line of `text` with `fragment`."""
    return _line_of


@pytest.fixture
def make_config(tmp_path):
    """Writes BASE_CONFIG, with (old, new) replacements applied, and returns its path."""

    def make(*replacements: tuple[str, str], text: str = BASE_CONFIG) -> Path:
        for old, new in replacements:
            assert old in text, old
            text = text.replace(old, new, 1)
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
