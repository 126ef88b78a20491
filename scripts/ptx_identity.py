"""Whether two PTX files are the same code up to names: a refactor's proof that it moved no
instruction, without a GPU.

    python3 scripts/ptx_identity.py BEFORE.ptx AFTER.ptx      # one pair
    python3 scripts/ptx_identity.py BEFORE_DIR AFTER_DIR      # every *.ptx of BEFORE_DIR
    python3 scripts/ptx_identity.py --normalize FILE.ptx      # the normalized text, to read

Each file is normalized, then the two are diffed line by line:
  - virtual registers (the classes a function declares with `.reg .TYPE %NAME<N>;`, e.g. %r,
    %rd, %f, %fd, %p, %rs) are renumbered per function in order of first appearance, and the
    declarations' counts dropped; special registers (%tid.x, %envreg3) and inline assembly's
    own unnumbered ones (%px, %tmp) are left alone;
  - mangled names (_Z..., a kernel's parameters included) become _F0, _F1, ... in order of
    first appearance in the file, so that a template argument or a namespace that changed
    their spelling changes nothing else;
  - with --labels, basic-block labels ($L__BB0_12) are renumbered per function too (off by
    default: identical code keeps its labels).
Everything else (instructions, their order, constants, parameter offsets, shared-memory sizes,
the compiler's header) must match. The exit status is 0 when every pair is identical, 1
otherwise; each differing pair prints its normalized unified diff (--stat: only its size) and
how many instructions, with every register and label name erased, one file has that the other
lacks: 0 and 0 means the same instructions, only in another order or on other registers.

Getting the PTX of one generated TU: the build tree's exact nvcc command
(`ninja -C BUILD -t commands CMakeFiles/fmha.dir/gen/TU.cu.o`), with `-ptx -o TU.ptx` in place
of `-c -o TU.cu.o` and without -MD/-MT/-MF; once from a worktree of the commit before the change
(`git worktree add /tmp/before HEAD`), once from the working tree. PTX identity implies the
same SASS (ptxas is deterministic on identical input, names aside); `cuobjdump -sass` of the two
cubins checks that directly where wanted.
"""

from __future__ import annotations

import argparse
import difflib
import re
import signal
import sys
from collections import Counter
from pathlib import Path

_FUNCTION_START = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(?:entry|func)\b")
_REG_DECL = re.compile(r"^\s*\.reg\s+\.\w+\s+%([A-Za-z_]+)<(\d+)>;")
_MANGLED = re.compile(r"\b_Z\w+")
_PARAM_SUFFIX = re.compile(r"(_param_\d+)$")
_LABEL = re.compile(r"\$L__BB\d+_\d+")


def _split_functions(lines: list[str]) -> list[list[str]]:
    """The file as chunks: the text before the first function, then one chunk per function."""
    chunks: list[list[str]] = [[]]
    for line in lines:
        if _FUNCTION_START.match(line):
            chunks.append([])
        chunks[-1].append(line)
    return chunks


def _rename_registers(chunk: list[str]) -> list[str]:
    classes = sorted({m.group(1) for line in chunk if (m := _REG_DECL.match(line))},
                     key=len, reverse=True)
    if not classes:
        return chunk
    # Longest prefix first, so that %rd12 is of %rd, not %r; a whole token only (%rd12, not
    # the %r of %rd12x).
    pattern = re.compile(r"%(" + "|".join(map(re.escape, classes)) + r")(\d+)\b")
    numbering: dict[str, dict[str, int]] = {c: {} for c in classes}

    def rename(m: re.Match[str]) -> str:
        seen = numbering[m.group(1)]
        return f"%{m.group(1)}#{seen.setdefault(m.group(2), len(seen))}"

    out = []
    for line in chunk:
        if decl := _REG_DECL.match(line):
            out.append(line.replace(f"<{decl.group(2)}>", "<N>"))
        else:
            out.append(pattern.sub(rename, line))
    return out


def _rename_labels(chunk: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    return [_LABEL.sub(lambda m: f"$L#{seen.setdefault(m.group(0), len(seen))}", line)
            for line in chunk]


def normalize(text: str, labels: bool = False) -> list[str]:
    """The PTX `text` with register numbers and mangled names replaced as the module says."""
    names: dict[str, str] = {}

    def rename_symbol(m: re.Match[str]) -> str:
        name = m.group(0)
        suffix = ""
        if p := _PARAM_SUFFIX.search(name):
            name, suffix = name[: p.start()], p.group(1)
        return names.setdefault(name, f"_F{len(names)}") + suffix

    lines = [_MANGLED.sub(rename_symbol, line) for line in text.splitlines()]
    out: list[str] = []
    for chunk in _split_functions(lines):
        chunk = _rename_registers(chunk)
        if labels:
            chunk = _rename_labels(chunk)
        out.extend(chunk)
    return out


_ANY_REGISTER = re.compile(r"%(\w+?)#\d+")


def _instruction_delta(a: list[str], b: list[str]) -> tuple[int, int]:
    """Lines of `a` missing from `b` and of `b` missing from `a`, as multisets, with register
    numbers and labels erased: what changed beyond order and register assignment."""
    def erase(lines: list[str]) -> Counter[str]:
        return Counter(_LABEL.sub("$L", _ANY_REGISTER.sub(r"%\1", line)) for line in lines)
    ca, cb = erase(a), erase(b)
    return sum((ca - cb).values()), sum((cb - ca).values())


def compare(before: Path, after: Path, labels: bool, stat: bool) -> bool:
    a = normalize(before.read_text(), labels)
    b = normalize(after.read_text(), labels)
    if a == b:
        print(f"identical  {after.name} ({len(b)} lines)")
        return True
    diff = list(difflib.unified_diff(a, b, str(before), str(after), lineterm="", n=2))
    changed = sum(1 for line in diff[2:] if line[:1] in "+-")
    only_a, only_b = _instruction_delta(a, b)
    print(f"DIFFERENT  {after.name}: {changed} changed lines of {len(a)} / {len(b)}; "
          f"instructions only before {only_a}, only after {only_b}")
    if not stat:
        print("\n".join(diff))
    return False


def main() -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: stop quietly
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--normalize", action="store_true", help="print one file normalized")
    parser.add_argument("--labels", action="store_true", help="renumber basic-block labels too")
    parser.add_argument("--stat", action="store_true", help="sizes of the diffs only")
    args = parser.parse_args()
    if args.normalize:
        for path in args.paths:
            print("\n".join(normalize(path.read_text(), args.labels)))
        return 0
    if len(args.paths) != 2:
        parser.error("two files or two directories")
    before, after = args.paths
    if before.is_dir():
        pairs = [(b, after / b.name) for b in sorted(before.glob("*.ptx"))]
        missing = [str(a) for _, a in pairs if not a.exists()]
        if missing:
            print("missing: " + ", ".join(missing))
        pairs = [(b, a) for b, a in pairs if a.exists()]
    else:
        pairs, missing = [(before, after)], []
    results = [compare(b, a, args.labels, args.stat) for b, a in pairs]
    return 0 if all(results) and results and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
