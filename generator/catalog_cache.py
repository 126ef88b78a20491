"""The catalog and its checked presets, kept on disk between runs of the generator.

What a run computes from the config before it selects (build_catalog, then check_presets) takes
3.5-5 s of CPU for instances.yaml's 15348 instances on a 2-core machine (2026-11-28; the more
beside other jobs), and the same config is expanded again by every run: CMake's configure, each
shard job, the tests' hundred-odd runs, each compile on demand. Loading the stored result takes
0.2-0.5 s.

An entry's name holds a digest of everything its result is computed from: the bytes of the
config that were parsed (Config.digest), the generator's sources, the package's import name
(its classes are pickled by it) and the Python version (pickle's and dataclasses' behavior). A
config that fails is never stored, so its error is found again and names the config's path as
this run was given it. An entry is written to a temporary file beside its name and renamed
into place, so that a reader sees a whole entry or none whichever processes run at once; one
that does not load (cut short, unpicklable) is built again and replaced.

`python -m generator` keeps its entries in the build/ directory beside the generator (git
ignores it); compile on demand in its own cache (fmha.jit.cache_dir()), which may not be
beside an installed generator. A directory keeps the MAX_ENTRIES most recently used entries;
where it cannot be written, every run builds.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

from .catalog import Catalog, build_catalog
from .config import Config
from .selection import Token, check_presets

SOURCE_DIR = Path(__file__).resolve().parent
CACHE_DIR = SOURCE_DIR.parent / "build" / "generator-cache"
# Entries and temporary files are named after it: a directory may hold other files (the objects
# of compile on demand), which eviction leaves alone.
PREFIX = "catalog-"
# About 20 MB at most: an entry of the repository's matrix takes 2.5 MB, one of a test's small
# config 5 kB.
MAX_ENTRIES = 8
# A writer killed midway leaves its temporary file behind; a write takes under a second, so a
# temporary file an hour old has no writer left.
ABANDONED_AFTER_S = 3600

CheckedCatalog = tuple[Catalog, dict[str, tuple[Token, ...]]]


def checked_catalog(config: Config, directory: Path | None = None) -> CheckedCatalog:
    """build_catalog(config) and check_presets(config, catalog), from the cache in `directory`
    (default CACHE_DIR) when an earlier run computed them from the same config with the same
    generator."""
    path = (directory or CACHE_DIR) / f"{PREFIX}{_key(config)}.pickle"
    stored = _load(path)
    if stored is not None:
        return stored
    catalog = build_catalog(config)
    checked = catalog, check_presets(config, catalog)
    _store(path, checked)
    return checked


def _key(config: Config) -> str:
    digest = hashlib.sha256()
    for part in (config.digest, __package__, sys.version):
        digest.update(part.encode() + b"\0")
    for source in sorted(SOURCE_DIR.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def _load(path: Path) -> CheckedCatalog | None:
    try:
        with path.open("rb") as file:
            stored = pickle.load(file)
    except Exception:  # none yet, or one cut short or garbled: pickle fails in many ways
        return None
    try:
        os.utime(path)  # used now: eviction keeps the most recently used entries
    except OSError:
        pass
    return stored


def _store(path: Path, checked: CheckedCatalog) -> None:
    try:
        # Made only where missing: apart from the first, a run creates no directory but its
        # output's (test_generator_render's killed runs count the output's calls that way).
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.",
                                                 suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "wb") as file:
            pickle.dump(checked, file, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(temporary, path)
    except OSError:  # a full disk, say: this run's result stands, unstored
        Path(temporary).unlink(missing_ok=True)
        return
    _evict(path.parent)


def _evict(directory: Path) -> None:
    """Removes all but the MAX_ENTRIES most recently used entries, and abandoned temporary
    files. Another process may remove the same files first."""
    def used(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    entries = sorted(directory.glob(f"{PREFIX}*.pickle"), key=used, reverse=True)
    abandoned_before = time.time() - ABANDONED_AFTER_S
    abandoned = [path for path in directory.glob(f".{PREFIX}*.tmp")
                 if used(path) < abandoned_before]
    for path in (*entries[MAX_ENTRIES:], *abandoned):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
