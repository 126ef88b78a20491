"""Writing the generated files: the output directory is replaced as a whole, so no run, not even
one killed midway, leaves it half written; and the build redoes only what changed.

A run builds the new directory next to the old one (`.<name>.staging`), then swaps: the old one
is renamed aside (`.<name>.previous`), the new one renamed into place, and the old one removed.
A run that stops while staging leaves the old directory as it was (the next run removes the
staging directory); one that dies between the two renames leaves the old directory aside with
none in its place, and the next run puts it back before anything else. Runs on one output
directory take turns through a lock on `.<name>.lock`, so whatever they find there is a dead
run's.

In the new directory
- a generated file whose bytes do not change is a hard link to the old one: the same inode and
  mtime, so ninja does not rebuild from it;
- everything of the old directory the generator does not own (not in its previous manifest) is
  carried over the same way; a subdirectory becomes a new one holding links to its entries;
- owned files that this run does not generate (TUs of instances no longer selected) are left
  behind with the old directory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SyncReport:
    written: int
    unchanged: int
    removed: int


def sync(out_dir: Path, files: dict[str, str],
         owned: Callable[[Path], set[str]]) -> SyncReport:
    """Makes `out_dir` hold `files` (name -> text) and, of what it held before, whatever is not
    in owned(out_dir): the names the generator wrote there last time, read once an interrupted
    run's directory is back in place."""
    # A symlink to the output directory stays a symlink: the directory it names is replaced.
    out_dir = out_dir.resolve()
    staging, previous = (out_dir.with_name(f".{out_dir.name}.{what}")
                         for what in ("staging", "previous"))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir.with_name(f".{out_dir.name}.lock")):
        _finish_interrupted_run(out_dir, staging, previous)
        if out_dir.exists() and not out_dir.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out_dir))
        try:
            staging.mkdir()
            report = _stage(out_dir, staging, files, owned(out_dir))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _swap(out_dir, staging, previous)
    return report


@contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    # A lock file rather than a lock on the directory: NFS emulates flock with POSIX locks,
    # which need a descriptor open for writing.
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _finish_interrupted_run(out_dir: Path, staging: Path, previous: Path) -> None:
    if previous.exists():
        if out_dir.exists():
            shutil.rmtree(previous)  # it died after the swap, removing the old directory
        else:
            os.rename(previous, out_dir)  # it died between the renames: the old one is whole
    if staging.exists():
        shutil.rmtree(staging)  # it died while staging


def _stage(out_dir: Path, staging: Path, files: dict[str, str], owned: set[str]) -> SyncReport:
    old = {entry.name: entry for entry in os.scandir(out_dir)} if out_dir.is_dir() else {}
    unchanged = 0
    for name, text in files.items():
        data = text.encode("utf-8")
        entry = old.get(name)
        if entry is not None and _holds(entry, data):
            _carry(entry, staging / name)
            unchanged += 1
        else:
            (staging / name).write_bytes(data)
    removed = 0
    for name, entry in old.items():
        if name in files:
            continue
        if name in owned and entry.is_file(follow_symlinks=False):
            removed += 1
        else:
            _carry(entry, staging / name)
    return SyncReport(written=len(files) - unchanged, unchanged=unchanged, removed=removed)


def _holds(entry: os.DirEntry, data: bytes) -> bool:
    """Whether `entry` is a regular file of exactly these bytes."""
    return (entry.is_file(follow_symlinks=False)
            and entry.stat(follow_symlinks=False).st_size == len(data)
            and Path(entry.path).read_bytes() == data)


def _carry(entry: os.DirEntry, target: Path) -> None:
    """Puts `entry` at `target` unchanged: a hard link (a symlink is linked, not followed), or
    for a directory a new one holding its entries carried likewise, with its mode and times."""
    if entry.is_dir(follow_symlinks=False):
        target.mkdir()
        for child in os.scandir(entry.path):
            _carry(child, target / child.name)
        shutil.copystat(entry.path, target, follow_symlinks=False)
        return
    try:
        os.link(entry.path, target, follow_symlinks=False)
    except OSError:
        # No hard links here (a filesystem without them, a mount point below the directory):
        # a copy with the same times still tells ninja that nothing changed.
        shutil.copy2(entry.path, target, follow_symlinks=False)


def _swap(out_dir: Path, staging: Path, previous: Path) -> None:
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    shutil.copymode(out_dir, staging)  # the directory keeps its permissions
    os.rename(out_dir, previous)
    try:
        os.rename(staging, out_dir)
    except BaseException:
        os.rename(previous, out_dir)
        raise
    shutil.rmtree(previous)
