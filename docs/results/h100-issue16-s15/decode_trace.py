"""Where a decode step's time goes, CTA by CTA: a timeline from %globaltimer stamps.

Needs a build with decode-trace.patch applied (git apply; it is not for landing: FMHA_TRACE_VARIANT
odd makes the attention and combine kernels write their stamps into the call's output instead of
the output), for example

    git apply docs/results/h100-issue16-s15/decode-trace.patch
    scripts/build_dev.sh build/trace -DFMHA_PRESET=all \
        '-DFMHA_FILTER=kvcache,bf16,hdim128,fa2,sm90a,bias=none,!softcap,mask=none,!hpad,!paged' \
        -DFMHA_ARCHS=90a
    PYTHONPATH=build/trace/python:. python docs/results/h100-issue16-s15/decode_trace.py 1 8192

Batch B x L keys (bf16 d128, 64 query heads on 8 K/V heads, a contiguous cache, fmha's split
count; the stamps' layout assumes the 128 CTAs and 16 combine CTAs of batch 1), one graph of
steps on rotated copies as the decode bench replays them. Prints the step time with the stamps
off (FMHA_TRACE_VARIANT 0) and with the combine letting the next step launch at its start (2),
then, stamps on, each step's phases (min/median/max over the CTAs) and their medians over the
steps. The globaltimer ticks every 256 ns here, so each phase is +-0.25 us.
"""

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from kernel_times import decode_step  # noqa: E402

from fmha.timing import copies_beyond_l2  # noqa: E402

SLOTS = 12          # stamps a CTA (decode-trace.patch)
COMBINE_BASE = 1536  # the combine CTAs' stamps, 4 a CTA
NAMES = {0: "entry", 1: "waited", 2: "length", 3: "tile0", 10: "lasttile", 4: "loopend",
         7: "drained", 8: "staged", 5: "exit"}


def graph_of_steps(batch, cache_len, copies, variant):
    os.environ["FMHA_TRACE_VARIANT"] = str(variant)
    torch.manual_seed(0)
    steps = [decode_step(batch, cache_len) for _ in range(copies)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in steps:
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [step() for step in steps]
    return graph, outs


def step_us(graph, copies, replays=40):
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / replays / copies)
    return statistics.median(times)


def main():
    batch, cache_len = int(sys.argv[1]), int(sys.argv[2])
    copies = copies_beyond_l2(2 * batch * cache_len * 8 * 128 * 2)
    print(torch.cuda.get_device_name(), f"batch {batch} x {cache_len} keys, {copies} copies")
    for variant in (0, 2):
        runs = [step_us(graph_of_steps(batch, cache_len, copies, variant)[0], copies)
                for _ in range(3)]
        print(f"FMHA_TRACE_VARIANT={variant}: us a step {[round(t, 2) for t in runs]}, "
              f"median {statistics.median(runs):.2f}")

    graph, outs = graph_of_steps(batch, cache_len, copies, 1)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    ctas = batch * 8 * 16
    stamps = [o.contiguous().flatten().view(torch.int64).cpu() for o in outs]
    attention = [s[:ctas * SLOTS].view(ctas, SLOTS).double() / 1e3 for s in stamps]
    combine = [s[COMBINE_BASE:COMBINE_BASE + 16 * 4].view(16, 4).double() / 1e3 for s in stamps]
    origin = attention[0][:, 0].min().item()
    print("\nstamps (us from the first step's first entry; min/median/max over the CTAs)")
    for i, (a, c) in enumerate(zip(attention, combine)):
        cols = [f"{name} " + "/".join(f"{x - origin:.2f}" for x in
                                      (a[:, j].min(), a[:, j].median(), a[:, j].max()))
                for j, name in NAMES.items()]
        cols += [f"combine {name} {c[:, j].min() - origin:.2f}/{c[:, j].max() - origin:.2f}"
                 for j, name in enumerate(("entry", "waited", "end"))]
        print(f"step {i}: " + " | ".join(cols))

    phases = {
        "launch gap (last combine end -> first entry)": lambda a, c, p: a[:, 0].min() - p,
        "entry -> length known": lambda a, c, p: a[:, 2].median() - a[:, 0].min(),
        "length -> first tile landed": lambda a, c, p: a[:, 3].median() - a[:, 2].median(),
        "first tile -> last tile landed": lambda a, c, p: a[:, 10].median() - a[:, 3].median(),
        "last tile -> loop end": lambda a, c, p: a[:, 4].median() - a[:, 10].median(),
        "loop end -> merge staged": lambda a, c, p: a[:, 8].median() - a[:, 4].median(),
        "merge staged -> exit": lambda a, c, p: a[:, 5].median() - a[:, 8].median(),
        "median exit -> last exit": lambda a, c, p: a[:, 5].max() - a[:, 5].median(),
        "last exit -> combine released": lambda a, c, p: c[:, 1].max() - a[:, 5].max(),
        "combine released -> combine end": lambda a, c, p: c[:, 2].max() - c[:, 1].max(),
        "step (combine end to combine end)": lambda a, c, p: c[:, 2].max() - p,
    }
    print(f"\nphases, medians over steps 2..{len(stamps) - 1} (CTA medians unless named), us")
    for name, phase in phases.items():
        values = [float(phase(attention[i], combine[i], combine[i - 1][:, 2].max()))
                  for i in range(2, len(stamps))]
        print(f"  {name:46s} {statistics.median(values):6.2f}")


if __name__ == "__main__":
    main()
