"""No input crashes the process: a fuzz test of fmha's whole public surface.

tests/fuzz_surface.py draws the problems, each one call from its seed: fmha.fwd in batch and
group mode, fmha.bwd, autograd through fmha.fwd, select/explain and their backward and KV-cache
forms, fwd_kvcache on contiguous and paged caches, dropout_mask, the transformers and SDPA
integrations, and the example programs fmha_fwd and fmha_bwd when FMHA_EXAMPLES_DIR names a
build directory that holds them; valid calls and corrupted ones. This test runs them in worker
processes of BATCH problems and judges what the workers report. Nothing here needs a GPU: on
the CPU the problems use CPU, meta and fake CUDA tensors; with a GPU most use CUDA tensors and
the valid ones launch.

Pass rule:
- no crash: no worker dies by a signal, spends more than PROBLEM_TIMEOUT_S on a problem, or
  exits without the outcome of a problem it started (the next worker starts at the problem
  after it); no example program dies by a signal or runs past its timeout;
- no device fault: no CUDA error such as an illegal memory access or a misaligned address (the
  worker stops there, its CUDA context dead, and the next starts after it);
- every exception is a clear one: a TypeError, a ValueError (fmha.MissingInstanceError is one)
  or a NotImplementedError whose message names the API: "fmha." (or "fmha::", the C++ API's
  prefix; a MissingInstanceError's "fmha"), "fmha" for the integrations. Under
  F.scaled_dot_product_attention, what torch's own checks raise before fmha is reached is
  torch's business;
- no message is garbled: cut off where the C++ runtime failed to format a value into it
  (fuzz_surface.GARBLED), the form a leaked C++ runtime takes where it does not crash;
- a valid call returns, or raises MissingInstanceError (traits the build lacks); one on a CPU
  or meta device stops at the device check, with the ValueError that says so.

Everything else fails the test and is listed, grouped by cause, with each problem's seed and
description; replay one with `python tests/fuzz_surface.py --first SEED --count 1`.

FMHA_FUZZ_PROBLEMS: how many problems (default 400, well under a minute on a 2-core machine
without a GPU; run 5000 on a GPU machine); FMHA_FUZZ_FIRST: the first seed (default 0);
FMHA_FUZZ_REPORT: a file to write the summary to. The summary is printed too (pytest -s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")

WORKER = Path(__file__).with_name("fuzz_surface.py")
PROBLEMS = int(os.environ.get("FMHA_FUZZ_PROBLEMS", "400"))
FIRST = int(os.environ.get("FMHA_FUZZ_FIRST", "0"))
BATCH = 50
# A problem runs for milliseconds, an example program for seconds (the worker gives it 60);
# past this, the worker is taken to hang.
PROBLEM_TIMEOUT_S = 120
STARTUP_TIMEOUT_S = 120  # importing torch and fmha, and CUDA's start
# Workers at once: one per core, at most 4; on a GPU 2, so that the huge problems (outputs of
# several GB) of two workers fit its memory together.
WORKERS = 2 if torch.cuda.is_available() else max(1, min(4, os.cpu_count() or 1))
# The exit status of a worker that stopped after a device fault (fuzz_surface.DEVICE_FAULT_EXIT).
DEVICE_FAULT_EXIT = 3
CLEAR_KINDS = ("TypeError", "ValueError", "NotImplementedError")
DEVICE_CHECK = re.compile(r"needs CUDA tensors|must be a CUDA device")
STDERR_LINES = 12


@dataclass
class Finding:
    """A problem that failed the pass rule."""

    # crash, device fault, unclear exception, garbled message, valid call failed, harness error
    category: str
    seed: int
    surface: str
    description: str
    detail: str

    def cause(self) -> str:
        """What problems with one cause share: the category and the message without its
        numbers (shapes, sizes), or for a crash how it ended and the surface."""
        detail = re.sub(r"\d+", "N", self.detail.split("\n")[0])[:110]
        return f"{self.category}: {detail}" + (f" [{self.surface}]" if self.category == "crash"
                                               else "")


@dataclass
class Tally:
    """What the workers reported: problems run, outcomes by kind, problems by surface, and the
    findings."""

    problems: int = 0
    outcomes: Counter = field(default_factory=Counter)
    surfaces: Counter = field(default_factory=Counter)
    findings: list = field(default_factory=list)


def judge(outcome: dict) -> Optional[tuple[str, str]]:
    """(category, detail) of a finished problem that fails the pass rule, else None."""
    name, message = outcome["outcome"], outcome.get("message", "")
    said = f"{name}: {message}"
    if outcome.get("crash"):
        return "crash", message
    if outcome.get("device_fault"):
        return "device fault", said
    if name == "HarnessError":
        return "harness error", said
    expect = outcome.get("expect")
    if name == "result" or name == "skipped" or name.startswith("exit "):
        if expect == "device" and name == "result":
            return "valid call failed", "returned where the device check should have stopped it"
        return None
    token = outcome["token"]
    names_api = token in message or (token == "fmha." and "fmha::" in message) or (
        name == "MissingInstanceError" and "fmha" in message)
    if not (outcome.get("kind") in CLEAR_KINDS and message and names_api):
        if outcome.get("torch_may_reject") and not outcome.get("in_fmha"):
            return None  # torch's own checks, before fmha's code
        return "unclear exception", said
    if outcome.get("garbled"):
        return "garbled message", said
    if expect == "result" and name != "MissingInstanceError":
        return "valid call failed", said
    if expect == "device" and not (outcome["kind"] == "ValueError" and
                                   DEVICE_CHECK.search(message)):
        return "valid call failed", f"{said} (expected the device check)"
    return None


def _read_lines(path: Path, offset: int) -> tuple[list, int]:
    """The complete JSON lines of `path` from `offset` on, and the offset after them."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    return [json.loads(line) for line in data[:end].splitlines()], offset + end


def _stderr_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-STDERR_LINES:])


def run_worker(first: int, count: int, directory: Path) -> tuple[list, Optional[str], str]:
    """Runs problems first .. first + count - 1 in one worker: (its JSON lines, how it ended
    if not by finishing its problems, its stderr's last lines)."""
    jsonl = directory / f"worker-{first}.jsonl"
    errors = directory / f"worker-{first}.stderr"
    jsonl.unlink(missing_ok=True)
    # The worker imports fmha from where this test did.
    package_root = str(Path(fmha.__file__).parent.parent)
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, (package_root,
                                                       os.environ.get("PYTHONPATH"))))}
    with errors.open("wb") as stderr:
        worker = subprocess.Popen(
            [sys.executable, str(WORKER), "--first", str(first), "--count", str(count),
             "--jsonl", str(jsonl)],
            stdout=subprocess.DEVNULL, stderr=stderr, env=env,
            start_new_session=True)  # its own process group: a hang is killed with its children
    lines, offset, progress, ended = [], 0, time.monotonic(), None
    while True:
        status = worker.poll()
        new, offset = _read_lines(jsonl, offset)
        lines += new
        if new:
            progress = time.monotonic()
        if status is not None:
            break
        limit = PROBLEM_TIMEOUT_S if lines else STARTUP_TIMEOUT_S
        if time.monotonic() - progress > limit:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
            ended = f"timed out: no progress for {limit} s"
            break
        time.sleep(0.05)
    lines += _read_lines(jsonl, offset)[0]
    if ended is None and status < 0:
        ended = f"died by {signal.Signals(-status).name}"
    elif ended is None and status not in (0, DEVICE_FAULT_EXIT):
        ended = f"exited with status {status}"
    return lines, ended, _stderr_tail(errors)


def run_range(first: int, end: int, directory: Path) -> Tally:
    """Runs problems first .. end - 1, a worker at a time, each starting after the last problem
    the one before it finished or crashed on."""
    tally = Tally()
    seed = first
    while seed < end:
        lines, ended, stderr = run_worker(seed, min(BATCH, end - seed), directory)
        starts = {line["seed"]: line for line in lines if "start" in line}
        outcomes = {line["seed"]: line for line in lines if "outcome" in line}
        for number, start in sorted(starts.items()):
            tally.problems += 1
            tally.surfaces[start["surface"]] += 1
            outcome = outcomes.get(number)
            if outcome is None:  # the worker died on this problem
                tally.outcomes["crash"] += 1
                tally.findings.append(Finding("crash", number, start["surface"], start["start"],
                                              f"the worker {ended or 'stopped'}\n{stderr}"))
                continue
            tally.outcomes[outcome["outcome"]] += 1
            verdict = judge(outcome)
            if verdict:
                category, detail = verdict
                tally.findings.append(Finding(category, number, start["surface"],
                                              start["start"], detail))
        last = max(starts, default=seed - 1)
        if (ended or last < seed) and all(number in outcomes for number in starts):
            # Between problems: the worker failed to start or to draw the next problem (a bug
            # of fuzz_surface.py), or hung there; it counts as the next problem's crash.
            last += 1
            tally.problems += 1
            tally.outcomes["crash"] += 1
            tally.findings.append(Finding("crash", last, "?", "(not started)",
                                          f"the worker {ended or 'stopped'}\n{stderr}"))
        seed = last + 1
    return tally


def summary(tally: Tally, first: int) -> str:
    categories = Counter(f.category for f in tally.findings)
    machine = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
               if torch.cuda.is_available() else "no GPU")
    examples = os.environ.get("FMHA_EXAMPLES_DIR") or "not set"
    lines = [
        f"fmha surface fuzz: {tally.problems} problems, seeds {first}.."
        f"{first + tally.problems - 1} ({machine}; FMHA_EXAMPLES_DIR {examples})",
        f"crashes: {categories['crash']}, device faults: {categories['device fault']}, "
        f"unclear exceptions: {categories['unclear exception']}, garbled messages: "
        f"{categories['garbled message']}, valid calls failed: "
        f"{categories['valid call failed']}, harness errors: {categories['harness error']}",
        "outcomes: " + ", ".join(f"{k} {n}" for k, n in tally.outcomes.most_common()),
        "surfaces: " + ", ".join(f"{k} {n}" for k, n in tally.surfaces.most_common()),
    ]
    by_cause: dict[str, list] = {}
    for finding in tally.findings:
        by_cause.setdefault(finding.cause(), []).append(finding)
    if by_cause:
        lines.append(f"failures ({len(tally.findings)}), by cause:")
    for cause, findings in sorted(by_cause.items(), key=lambda item: -len(item[1])):
        lines.append(f"  {cause} ({len(findings)} problems)")
        for finding in findings[:3]:
            lines.append(f"    seed {finding.seed} [{finding.surface}]: {finding.description}")
            if finding.category in ("crash", "harness error"):
                lines += [f"      | {line}" for line in finding.detail.splitlines()]
            else:
                lines.append(f"      -> {' | '.join(finding.detail.splitlines())}")
        if len(findings) > 3:
            lines.append(f"    ... and seeds {', '.join(str(f.seed) for f in findings[3:20])}"
                         + (" ..." if len(findings) > 20 else ""))
    return "\n".join(lines)


def test_no_input_crashes_the_process(tmp_path):
    ranges = [(first, min(first + BATCH, FIRST + PROBLEMS))
              for first in range(FIRST, FIRST + PROBLEMS, BATCH)]
    with ThreadPoolExecutor(WORKERS) as pool:
        tallies = list(pool.map(lambda r: run_range(*r, tmp_path), ranges))
    tally = Tally()
    for part in tallies:
        tally.problems += part.problems
        tally.outcomes += part.outcomes
        tally.surfaces += part.surfaces
        tally.findings += part.findings
    text = summary(tally, FIRST)
    print(text)
    if os.environ.get("FMHA_FUZZ_REPORT"):
        Path(os.environ["FMHA_FUZZ_REPORT"]).write_text(text + "\n")
    assert tally.problems == PROBLEMS, text
    assert not tally.findings, text
