"""Fuzzing the generator with broken configurations: random edits of a good instances.yaml (lines
deleted, duplicated, swapped or re-indented, values and keys replaced by random tokens, numbers,
booleans and lists, values emptied, sections dropped, garbage characters or bytes inserted, the
file cut short) run through `python -m generator`'s entry point against an output directory that
holds the good configuration's render.

Whatever the edit, the generator exits 0 or 2, never with a traceback; on 2 its message names the
file and a line of it, and the output directory is untouched; on 0 it holds a complete render,
the same one a run into an empty directory writes.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import BASE_CONFIG, BWD_OPERATION, KVCACHE_OPERATION
from hypothesis import given, settings
from hypothesis import strategies as st

from generator.cli import main
from generator.config import DEFAULT_CONFIG
from generator.schema import ENUM_AXES, MATRIX_AXES

CONFIG = "config.yaml"
# The base config with both operations, and a rule shared by them.
BOTH_CONFIG = BASE_CONFIG.replace(BWD_OPERATION[0], BWD_OPERATION[1]).replace(
    "operations:\n", "rules:\n  - when: {arch: sm80, pad_seqlen: true, dtype: bf16}\n"
                     "    reason: shared\noperations:\n")
# With kvcache too, and a shared rule that names its operations.
EVERY_CONFIG = BOTH_CONFIG.replace(KVCACHE_OPERATION[0], KVCACHE_OPERATION[1]).replace(
    "operations:\n", "  - when: {op: [fwd, bwd], mask: causal, pad_seqlen: true}\n"
                     "    reason: by operation\noperations:\n")
OUT = "gen"

# Keys of every level of the file, so that a replaced key is often a valid one in a wrong place.
KEYS = ["matrix", "operations", "fwd", "bwd", "kvcache", "op", "tiles", "rules", "presets",
        *MATRIX_AXES,
        "hdim_q", "hdim_v", "block_m", "block_n", "warps", "stages", "why", "arch", "when", "not",
        "reason", "filter", "default", "minimal", "<<"]

# Scalars that PyYAML turns into something other than a str, an int or a list, or fails to.
YAML_TYPES = [
    "2001-12-14", "2001-13-45", "2001-12-14 25:61:61", "9" * 5000, ".nan", ".inf", "1e999",
    "0x40", "0o100", "1_000", "64.0", "!!int x", "!!float x", "!!timestamp 2001-13-45",
    "!!binary ===", "!!set {a}", "!!str 64", "!!python/object:os.system x", "&a [64, 64]", "*a",
    "*undefined", "[" * 300 + "]" * 300, "{a: " * 300 + "1" + "}" * 300, "? [a]",
]
# Structure: empty, null and boolean values, flow collections, block indicators, broken quotes.
STRUCTURE = [
    "", "~", "null", "true", "false", "yes", "''", '""', "[]", "{}", "[1, 2]", "[[64, 64]]",
    "[64, 64, 64]", "{a: 1}", "[fp16, fp16]", "- x", ": x", "|", ">-", "%TAG", "@x", "`x",
    "'unclosed", '"\\x"', "\t", "[", "{", "]",
]
# Preset filters, in the --filter grammar, that are easy to get wrong.
FILTERS = [
    "hdim²", "hdim" + "9" * 5000, "hdim_q=²", "hdim_q=" + "9" * 5000, "hdim_q=0", "hdim0",
    "*[z-a]*", "fp16|", "!", "mask=", "=", ",", "fp16,,bf16", "!lse|*", "hdim=6x",
    "sm90a,sm80", "lse=yes", "pad_hdim=true,nopad", "bwd,lse", "op=", "op=decode", "fwd|bwd",
    "!fwd,!bwd", "dbias,vlayout=col", "kvcache,mode=batch", "paged,fwd", "op=kvcache,!paged",
]
TOKENS = sorted({token for axis in ENUM_AXES.values() for token in axis.tokens}
                | {"32", "64", "128", "256", "1", "2", "4", "8", "16"})

yaml_types = st.sampled_from(YAML_TYPES)
filters = st.sampled_from(FILTERS)
scalars = st.one_of(
    yaml_types, yaml_types,  # twice as likely as the others: they find the most
    st.sampled_from(STRUCTURE),
    filters,
    st.sampled_from(TOKENS),
    st.integers(-2**70, 2**70).map(str),
    st.floats().map(repr),
    st.lists(st.sampled_from(TOKENS), max_size=4).map(lambda items: f"[{', '.join(items)}]"),
    st.text(max_size=8),
)
indents = st.sampled_from(["", " ", "  ", "   ", "    ", "      ", "\t", "  \t"])


def _key_of(line: str) -> tuple[str, str] | None:
    """(indent and key, rest) of a `key: value` line."""
    match = re.match(r"(\s*(?:- )?[^\s:#][^:#]*):(.*)", line)
    return (match[1], match[2]) if match else None


@st.composite
def edited_lines(draw, lines: list[str]) -> list[str]:
    lines = list(lines)
    # Value edits keep the YAML well-formed more often than the others, so they reach the
    # checks past the parser: they are the likeliest.
    edit = draw(st.sampled_from(["delete", "duplicate", "swap", "indent", "key", "empty",
                                 "section", "insert", *["value", "word"] * 3, "filter", "filter"]))
    if not lines:
        return [draw(scalars) + "\n"]
    i = draw(st.integers(0, len(lines) - 1))
    line = lines[i]
    keyed = _key_of(line.rstrip("\n"))
    if edit == "delete":
        del lines[i]
    elif edit == "duplicate":
        lines.insert(i, line)
    elif edit == "swap":
        j = draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    elif edit == "indent":
        lines[i] = draw(indents) + line.lstrip(" \t")
    elif edit == "value":
        if keyed:
            lines[i] = f"{keyed[0]}: {draw(scalars)}\n"
        elif line.lstrip().startswith("- "):
            lines[i] = f"{line[:len(line) - len(line.lstrip())]}- {draw(scalars)}\n"
        else:
            lines[i] = f"{draw(scalars)}\n"
    elif edit == "word":  # a word of a flow collection, or a quoted string
        spans = [m.span() for m in re.finditer(r'"[^"]*"|[^\s,\[\]{}:"]+', line)]
        if spans:
            start, end = draw(st.sampled_from(spans))
            lines[i] = line[:start] + draw(scalars) + line[end:]
    elif edit == "filter":  # a preset's filter: the --filter grammar has its own mistakes
        at = [n for n, text in enumerate(lines) if re.search(r"filter: *\"", text)]
        if at:
            n = draw(st.sampled_from(at))
            replacement = f'filter: "{draw(filters)}"'
            lines[n] = re.sub(r'filter: *"[^"]*"', lambda _: replacement, lines[n])
    elif edit == "key" and keyed:
        indent = keyed[0][:len(keyed[0]) - len(keyed[0].lstrip(" \t-"))]
        key = draw(st.one_of(st.sampled_from(KEYS), st.sampled_from(YAML_TYPES),
                             st.text(min_size=1, max_size=6)))
        lines[i] = f"{indent}{key}:{keyed[1]}\n"
    elif edit == "empty" and keyed:
        lines[i] = f"{keyed[0]}:\n"
    elif edit == "section":
        tops = [n for n, text in enumerate(lines) if re.match(r"[A-Za-z_]\w*:", text)]
        if tops:
            start = draw(st.sampled_from(tops))
            end = next((n for n in tops if n > start), len(lines))
            del lines[start:end]
    elif edit == "insert":
        key = draw(st.sampled_from(KEYS))
        lines.insert(i, f"{draw(indents)}{key}: {draw(scalars)}\n")
    return lines


@st.composite
def broken(draw, text: str) -> bytes:
    """`text` with one to three line edits, and sometimes garbage inserted or the file cut
    short."""
    lines = text.splitlines(keepends=True)
    for _ in range(draw(st.sampled_from([1, 1, 2, 3]))):
        lines = draw(edited_lines(lines))
    data = "".join(lines).encode("utf-8")
    ending = draw(st.sampled_from(["garbage", "cut", *["none"] * 6]))
    if ending == "garbage":
        at = draw(st.integers(0, len(data)))
        garbage = draw(st.one_of(st.text(min_size=1, max_size=6).map(str.encode),
                                 st.binary(min_size=1, max_size=4)))
        data = data[:at] + garbage + data[at:]
    elif ending == "cut":
        data = data[:draw(st.integers(0, len(data)))]
    return data


def snapshot(directory: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file's bytes, inode and mtime."""
    return {path.name: (path.read_bytes(), path.stat().st_ino, path.stat().st_mtime_ns)
            for path in directory.iterdir()}


def generate(workdir: Path, out: str) -> tuple[int, str]:
    """Runs the generator in `workdir` on config.yaml: (exit status, stderr). An exception
    escaping main() fails the test with its traceback."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.chdir(workdir), contextlib.redirect_stdout(stdout), \
            contextlib.redirect_stderr(stderr):
        status = main(["--config", CONFIG, "--out", out, "-q"])
    return status, stderr.getvalue()


def check_run(previous_render: Path, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / CONFIG).write_bytes(data)
        out = workdir / OUT
        shutil.copytree(previous_render, out)
        before = snapshot(out)
        status, stderr = generate(workdir, OUT)
        assert "Traceback" not in stderr
        assert status in (0, 2), stderr
        if status == 2:
            # file:line: message, at a line of the file (or just past its end, for a problem
            # found where it ends).
            match = re.match(rf"{re.escape(CONFIG)}:(\d+): \S", stderr)
            assert match, stderr
            assert 1 <= int(match[1]) <= data.count(b"\n") + 1, stderr
            assert snapshot(out) == before
            return
        assert stderr == ""
        names = {path.name for path in out.iterdir()}
        manifest = json.loads((out / "manifest.json").read_text())
        assert {record["tu"] for record in manifest["instances"]} == {
            name for name in names if name.endswith(".cu")}
        assert {"dispatch_table.cpp", "instances.cmake", "manifest.json"} <= names
        # The same files as a run into an empty directory writes.
        assert generate(workdir, "fresh") == (0, "")
        assert {name: entry[0] for name, entry in snapshot(out).items()} == {
            name: entry[0] for name, entry in snapshot(workdir / "fresh").items()}
        assert sorted(p.name for p in workdir.iterdir() if p.name.startswith(".")) == [
            ".fresh.lock", f".{OUT}.lock"]


def good_render(tmp_path_factory, text: str) -> Path:
    workdir = tmp_path_factory.mktemp("good")
    (workdir / CONFIG).write_text(text)
    assert generate(workdir, OUT) == (0, "")
    return workdir / OUT


@pytest.fixture(scope="module")
def base_render(tmp_path_factory) -> Path:
    return good_render(tmp_path_factory, BASE_CONFIG)


@pytest.fixture(scope="module")
def both_render(tmp_path_factory) -> Path:
    return good_render(tmp_path_factory, BOTH_CONFIG)


@pytest.fixture(scope="module")
def every_render(tmp_path_factory) -> Path:
    return good_render(tmp_path_factory, EVERY_CONFIG)


@pytest.fixture(scope="module")
def repository_render(tmp_path_factory) -> Path:
    return good_render(tmp_path_factory, DEFAULT_CONFIG.read_text())


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(data=broken(BASE_CONFIG))
def test_broken_base_config(base_render, data):
    check_run(base_render, data)


@settings(max_examples=100, derandomize=True, deadline=None, database=None)
@given(data=broken(BOTH_CONFIG))
def test_broken_config_with_both_operations(both_render, data):
    check_run(both_render, data)


@settings(max_examples=100, derandomize=True, deadline=None, database=None)
@given(data=broken(EVERY_CONFIG))
def test_broken_config_with_every_operation(every_render, data):
    check_run(every_render, data)


# The repository's matrix takes about a second a run (15348 instances): a few examples.
@settings(max_examples=10, derandomize=True, deadline=None, database=None)
@given(data=broken(DEFAULT_CONFIG.read_text()))
def test_broken_repository_config(repository_render, data):
    check_run(repository_render, data)
