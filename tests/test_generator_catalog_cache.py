"""The disk cache of the checked catalog (generator/catalog_cache.py): a run with the config and
the generator of an earlier run loads what that run built; any other config or generator builds
afresh; an entry is replaced whole, and one that does not load is built again."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
from conftest import REPO_ROOT

from generator import catalog_cache
from generator.catalog import build_catalog
from generator.catalog_cache import checked_catalog
from generator.config import load
from generator.errors import ConfigError
from generator.selection import check_presets

FP16_ONLY = ("dtype: [fp16, bf16]", "dtype: [fp16]")
NO_MASK = ("mask: [none, causal]", "mask: [none]")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setattr(catalog_cache, "CACHE_DIR", directory)
    return directory


def entries(directory, prefix=""):
    return sorted(directory.glob(f"{prefix}*.pickle"))


def built(config):
    """What checked_catalog computes, computed here."""
    catalog = build_catalog(config)
    return catalog, check_presets(config, catalog)


def test_a_run_loads_what_an_earlier_run_built(make_config, cache_dir, monkeypatch):
    first = checked_catalog(load(make_config()))
    assert first == built(load(make_config()))
    assert len(entries(cache_dir)) == 1

    def unexpected_build(config):
        raise AssertionError("built again, not loaded")

    monkeypatch.setattr(catalog_cache, "build_catalog", unexpected_build)
    assert checked_catalog(load(make_config())) == first


def test_another_config_builds_afresh(make_config, cache_dir):
    checked_catalog(load(make_config()))
    fp16 = load(make_config(FP16_ONLY))
    assert checked_catalog(fp16) == built(fp16)
    assert len(entries(cache_dir)) == 2


def test_changed_generator_sources_build_afresh(make_config, cache_dir, tmp_path, monkeypatch):
    sources = tmp_path / "generator"
    shutil.copytree(catalog_cache.SOURCE_DIR, sources,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(catalog_cache, "SOURCE_DIR", sources)
    config = load(make_config())
    checked_catalog(config)
    dispatch = sources / "dispatch.py"
    dispatch.write_text(dispatch.read_text() + "# a change\n")
    checked_catalog(config)
    assert len(entries(cache_dir)) == 2


def test_a_damaged_entry_is_built_again_and_replaced(make_config, cache_dir):
    config = load(make_config())
    expected = checked_catalog(config)
    [entry] = entries(cache_dir)
    entry.write_bytes(entry.read_bytes()[:1000])
    assert checked_catalog(config) == expected
    assert pickle.loads(entry.read_bytes()) == expected


def test_a_config_that_fails_is_not_stored(make_config, cache_dir):
    # A valid mask that the matrix does not have: the config loads, and its catalog fails.
    config = load(make_config(("rules: []", "rules:\n  - when: {mask: window}\n    reason: x")))
    with pytest.raises(ConfigError, match="this rule matches no point of the matrix"):
        checked_catalog(config)
    assert entries(cache_dir) == []


def test_only_the_most_recently_used_entries_are_kept(make_config, tmp_path, monkeypatch):
    monkeypatch.setattr(catalog_cache, "MAX_ENTRIES", 2)
    # A directory of compile on demand's, whose own files stay whatever their age.
    directory = tmp_path / "fmha-cache"
    directory.mkdir()
    theirs = [directory / name for name in ("fwd_fp16_d64.so", "other.pickle", ".other.tmp")]
    both, fp16, no_mask = (load(make_config(*edits)) for edits in ((), (FP16_ONLY,), (NO_MASK,)))
    checked_catalog(both, directory)
    [both_entry] = entries(directory, catalog_cache.PREFIX)
    checked_catalog(fp16, directory)
    [fp16_entry] = set(entries(directory, catalog_cache.PREFIX)) - {both_entry}
    os.utime(both_entry, (1000, 1000))
    os.utime(fp16_entry, (2000, 2000))
    # A writer killed an hour ago left this one; the other is being written.
    abandoned, in_progress = (directory / f".{catalog_cache.PREFIX}{name}.tmp"
                              for name in ("a.1", "b.2"))
    for path, age_s in ((abandoned, 3601), (in_progress, 0), *((path, 3601) for path in theirs)):
        path.write_bytes(b"")
        os.utime(path, (time.time() - age_s,) * 2)
    checked_catalog(both, directory)  # loaded: now the most recently used
    checked_catalog(no_mask, directory)
    assert fp16_entry not in entries(directory) and both_entry in entries(directory)
    assert len(entries(directory, catalog_cache.PREFIX)) == 2
    assert not abandoned.exists() and in_progress.exists()
    assert all(path.exists() for path in theirs)


def test_a_cache_that_cannot_be_written_costs_only_the_build(make_config, tmp_path,
                                                             monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(catalog_cache, "CACHE_DIR", blocker / "cache")
    config = load(make_config())
    assert checked_catalog(config) == built(config)


RUN_WITH_CACHE_DIR = """
import sys
from pathlib import Path
from generator import catalog_cache
from generator.cli import main
catalog_cache.CACHE_DIR = Path(sys.argv[1])
sys.exit(main(sys.argv[2:]))
"""


def test_racing_runs_store_one_whole_entry(make_config, cache_dir):
    path = make_config()
    runs = [subprocess.Popen([sys.executable, "-c", RUN_WITH_CACHE_DIR, cache_dir, "--config",
                              path, "--list"], cwd=REPO_ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(4)]
    outputs = [run.communicate(timeout=60) for run in runs]
    assert all(run.returncode == 0 for run in runs), outputs
    assert len({stdout for stdout, _ in outputs}) == 1
    [entry] = entries(cache_dir)
    assert pickle.loads(entry.read_bytes()) == built(load(path))
    assert not list(cache_dir.glob(".*.tmp"))
