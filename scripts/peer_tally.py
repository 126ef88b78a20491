"""Counts of passed, failed, skipped and error per test function of a peer suite's run, from
pytest's verbose output (`-v`, with or without xdist), which a run cut short by a time limit
has written up to the last finished case:

    python scripts/peer_tally.py run.log [more.log ...]

Prints a Markdown table, a row per test function, and the total; a case reported in several
logs counts once, by its last outcome. Failed cases are listed under the table with the first
line of their error where the log has a short summary (`-rf`).
"""

import re
import sys
from collections import Counter, defaultdict

# "path::test_fn[params] PASSED" (plain -v) or "[gw3] ... PASSED path::test_fn[params]" (xdist).
_PLAIN = re.compile(r"^(\S+::(\w+)(\[[^\]]*\])?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
_XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) "
                    r"(\S+::(\w+)(\[[^\]]*\])?)")
_SUMMARY_FAILED = re.compile(r"^FAILED (\S+::\w+(\[[^\]]*\])?)( - (.*))?")
OUTCOMES = ("PASSED", "FAILED", "SKIPPED", "ERROR")


def outcomes(lines):
    """{case id: outcome} and {case id: first error line} of a log's lines."""
    result, reasons = {}, {}
    for line in lines:
        line = line.rstrip("\n")
        if m := _XDIST.match(line):
            result[m.group(2)] = m.group(1)
        elif m := _PLAIN.match(line):
            result[m.group(1)] = m.group(4)
        elif m := _SUMMARY_FAILED.match(line):
            reasons[m.group(1)] = (m.group(4) or "")[:160]
    return result, reasons


def main(paths) -> int:
    cases, reasons = {}, {}
    for path in paths:
        with open(path, errors="replace") as f:
            found, why = outcomes(f)
        cases.update(found)
        reasons.update(why)
    per_function = defaultdict(Counter)
    for case, outcome in cases.items():
        function = case.split("::")[-1].split("[")[0]
        per_function[function][outcome] += 1
    print("| test function | " + " | ".join(o.lower() for o in OUTCOMES) + " |")
    print("| --- |" + " --- |" * len(OUTCOMES))
    total = Counter()
    for function in sorted(per_function):
        counts = per_function[function]
        total.update(counts)
        print(f"| `{function}` | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    print("| total | " + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
    failed = sorted(case for case, outcome in cases.items() if outcome in ("FAILED", "ERROR"))
    for case in failed:
        print(f"- {case}: {reasons.get(case, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
