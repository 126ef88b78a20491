"""python -m bench.ab: fmha builds against each other, interleaved, to tell a change from noise.

    python -m bench.ab NAME=PYTHON_DIR NAME=PYTHON_DIR ... [--rounds 3] [-- bench arguments]

Each round runs `python -m bench` once per build, in the order given (a fresh process each, with
PYTHON_DIR, the build's python/ folder, first on PYTHONPATH), so that clock and thermal drift
fall on every build alike. Two runs of one build on an H200 differ by up to about 5% at a point,
which is more than many changes gain: the table gives each build's median over the rounds and
its spread (max / min - 1), and SDPA's medians over all runs, as the common yardsticks. With
--bwd among the bench arguments it compares the backward's rows (TFLOP/s), with --decode the
decode steps' (GB/s, each fmha column: the contiguous cache and each page size), with --prefill
the chunks' (TFLOP/s of fwd_kvcache's columns; fmha.fwd on the same shapes is the yardstick).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Mode:
    """What one kind of bench run writes: its rows' JSON key, the fields that name a case, the
    yardstick columns (SDPA's, their medians over every run of every build), the unit, and the
    prefixes of the columns each build is compared on."""

    def __init__(self, flag, rows_key, case_fields, peers, unit, measured=("fmha",)):
        self.flag, self.rows_key, self.case_fields = flag, rows_key, case_fields
        self.peers, self.unit, self.measured = peers, unit, measured


MODES = [
    Mode("--bwd", "bwd_rows", ("dtype", "hdim", "causal", "seqlen"), ("sdpa_flash", "cudnn"),
         "TFLOP/s (backward)"),
    Mode("--decode", "decode_rows", ("dtype", "hdim", "heads", "batch", "cache_len"), ("sdpa",),
         "GB/s (decode step)"),
    Mode("--prefill", "prefill_rows", ("dtype", "hdim", "heads", "batch", "chunk", "context"),
         ("fwd",), "TFLOP/s (chunked prefill)", measured=("kvcache", "paged", "append", "decode")),
    Mode(None, "rows", ("dtype", "hdim", "causal", "seqlen"), ("sdpa_flash", "cudnn"),
         "TFLOP/s"),
]


def mode_of(bench_args):
    return next(m for m in MODES if m.flag is None or m.flag in bench_args)


def fmha_columns(row, mode):
    """The row's measurements of the build: "fmha", with --decode "fmha_paged16" and the like,
    with --prefill "kvcache", "paged16" and the like."""
    return {k: v for k, v in row.items() if k.startswith(mode.measured)
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


def parse_args(argv):
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1:]
    else:
        bench_args = []
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    p.add_argument("builds", nargs="+", metavar="NAME=PYTHON_DIR")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    builds = {}
    for spec in args.builds:
        name, sep, path = spec.partition("=")
        if not sep or not name or not (Path(path) / "fmha").is_dir():
            p.error(f"{spec!r}: expected NAME=PYTHON_DIR, a folder holding the fmha package")
        builds[name] = str(Path(path).resolve())
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return builds, args.rounds, bench_args


def run_bench(python_dir, bench_args):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([python_dir, str(REPO)]))
        subprocess.run([sys.executable, "-m", "bench", "--json", str(out), *bench_args],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = json.loads(out.read_text())
        return result[mode_of(bench_args).rows_key]


def main(argv=None):
    builds, rounds, bench_args = parse_args(sys.argv[1:] if argv is None else argv)
    mode = mode_of(bench_args)
    fmha_runs = defaultdict(lambda: defaultdict(list))  # case -> build -> value per round
    peer_runs = defaultdict(lambda: defaultdict(list))  # case -> SDPA column -> values
    for _ in range(rounds):
        for name, path in builds.items():
            for row in run_bench(path, bench_args):
                fields = tuple(row[f] for f in mode.case_fields)
                for column, value in fmha_columns(row, mode).items():
                    case = (*fields, column)
                    fmha_runs[case][name].append(value)
                    for peer in mode.peers:
                        if isinstance(row.get(peer), (int, float)):
                            peer_runs[case][peer].append(row[peer])
    header = [*mode.case_fields, "column", *mode.peers]
    for name in builds:
        header += [name, "spread"]
    print(f"{mode.unit}, medians of {rounds} interleaved runs per build; SDPA's over every run")
    print(" ".join(f"{h:>9}" for h in header))
    for case, by_build in fmha_runs.items():
        cells = [str(c) for c in case]
        for peer in mode.peers:
            runs = peer_runs[case][peer]
            cells.append(f"{statistics.median(runs):.1f}" if runs else "-")
        for name in builds:
            runs = by_build[name]
            cells += ([f"{statistics.median(runs):.1f}", f"{max(runs) / min(runs) - 1:.1%}"]
                      if runs else ["-", "-"])
        print(" ".join(f"{c:>9}" for c in cells))

if __name__ == "__main__":
    main()
