"""Writing the generated files so that the build redoes only what changed: a file is rewritten
only when its bytes change (ninja then sees an old mtime), each write is atomic, and TUs of
instances that are no longer selected are removed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SyncReport:
    written: int
    unchanged: int
    removed: int


def sync(out_dir: Path, files: dict[str, str], owned: set[str]) -> SyncReport:
    """Makes `out_dir` hold `files` (name -> text). Of the files it held before, only those in
    `owned` (what the generator wrote there last time) that are not in `files` are removed;
    anything else in the directory is left alone. Files are written in order, so the caller
    puts the manifest last: until it is replaced the previous one stays in charge."""
    out_dir.mkdir(parents=True, exist_ok=True)
    removed = 0
    for name in sorted(owned - files.keys()):
        stale = out_dir / name
        if Path(name).name == name and stale.is_file():  # only plain files of this directory
            stale.unlink()
            removed += 1
    written = sum(write_if_changed(out_dir / name, text) for name, text in files.items())
    return SyncReport(written, unchanged=len(files) - written, removed=removed)


def write_if_changed(path: Path, text: str) -> bool:
    """Writes `text` to `path` unless it already holds exactly those bytes; True if written.
    The bytes go to a temporary file that replaces `path` in one step, so a crash never
    leaves a half-written file behind."""
    data = text.encode("utf-8")
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    # Created with open() rather than tempfile so it gets the usual umask-derived permissions.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return True
