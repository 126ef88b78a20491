"""Timing for the demo and the benchmark: the GPU time of a call, and the host time of one.

GPU time is taken the way kernels are compared (FlashAttention's and Triton's benchmarks): the
calls run back to back, each between two CUDA events, and the host waits once at the end, so
it stays ahead of the GPU and its own cost per call (argument checks, the launch) stays out of
the number as long as it is shorter than the GPU's. Waiting after every call instead charges
that host cost to the kernel: on an H100 machine whose host needed ~200 us per fmha.fwd call,
bf16 d128 at S = 2k (a 410 us kernel) read 462 TFLOP/s that way against 662 back to back and
664 replayed from a CUDA graph. host_us measures that host cost on its own.

Warm-up and timing run for a stretch of time rather than a count of calls: under a sustained
load the GPU settles at the clock its power limit allows, and a short burst that starts idle
reads that transient instead. On an H100, 30 calls each (~50 ms) put fmha at 0.93x of cuDNN for
bf16 d128 at S = 8k; 200 calls each after 50 warm-up calls put it at 1.01-1.02x, in two runs.
"""

import itertools
import math
import statistics
import time
from typing import Optional

import torch


def median_ms(fn, warmup_ms: float = 100.0, repeat_ms: float = 200.0,
              min_calls: int = 10) -> float:
    """Median milliseconds of `fn()`'s GPU work on the current stream: calls back to back (see
    the module's docstring) for about `repeat_ms`, at least `min_calls`, after about
    `warmup_ms` of untimed calls."""
    return interleaved_medians({"fn": fn}, warmup_ms, repeat_ms, 1, min_calls)["fn"]


def interleaved_medians(fns: dict, warmup_ms: float = 100.0, repeat_ms: float = 200.0,
                        rounds: int = 3, min_calls: int = 10, before=None,
                        host_us: Optional[dict] = None) -> dict:
    """Median milliseconds of each `fns[name]()`'s GPU work, timed as median_ms does but in
    `rounds` rounds that take the functions in turn: in each round a function runs untimed
    for `warmup_ms`, then timed for `repeat_ms / rounds`. Each round samples the GPU's power
    state at another moment, so one clamp of the clock falls on one round of one function, not
    on its whole number. The warm-up before every timed stretch is what lets the clock settle
    after the previous function: on an H100 at its 700 W cap, the first bf16 d128 backward
    call (11 ms) after cuDNN's backward ran 23% slow, and the clock took 50-90 ms to recover.
    `before` and `host_us` as in event_times_ms, `host_us` a dict that gets each function's
    median host microseconds per timed call."""
    estimates = {name: _estimate_ms(fn) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    host = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(int(warmup_ms / estimates[name])):
                if before is not None:
                    before()
                fn()
            calls = max(-(-min_calls // rounds), int(repeat_ms / rounds / estimates[name]))
            times[name] += event_times_ms(fn, calls, before, host[name])
    if host_us is not None:
        host_us.update({name: statistics.median(us) for name, us in host.items()})
    return {name: statistics.median(ms) for name, ms in times.items()}


def _estimate_ms(fn) -> float:
    """Wall milliseconds of one synchronized `fn()` call after a first one (which may compile
    or allocate): the unit in which warm-up and repeat stretches are counted."""
    fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return max((time.perf_counter() - begin) * 1e3, 1e-3)


def event_times_ms(fn, calls: int, before=None, host_us: Optional[list] = None) -> list:
    """GPU milliseconds of `calls` back-to-back `fn()` calls, each between two CUDA events.
    `before()`, if given, runs ahead of each call outside its events (an L2 flush); the list
    `host_us`, if given, gets each call's host microseconds."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(calls)]
    torch.cuda.synchronize()
    for start, stop in events:
        if before is not None:
            before()
        start.record()
        begin = time.perf_counter()
        fn()
        if host_us is not None:
            host_us.append((time.perf_counter() - begin) * 1e6)
        stop.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(stop) for start, stop in events]


def capture_graph(fn, calls: int = 20) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of `calls` calls of `fn()`, warmed up off the capturing stream first (as
    capture needs): replaying it runs their GPU work with no host work between the calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def copies_beyond_l2(nbytes: int, l2_multiple: int = 4) -> int:
    """How many copies of an input of `nbytes` the timed calls should take in turn so that
    together they hold `l2_multiple` times the GPU's L2 (one where the input alone does): an
    input smaller than L2 (50 MB on an H100) that every call re-reads is served from L2 after
    the first call, and a memory-bound kernel's time is then the L2's, not the memory's. The
    copies stand for what a real workload reads between two calls: a model's decode step reads
    each layer's own KV cache once."""
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, math.ceil(l2_multiple * l2_bytes / nbytes))


def l2_flush(l2_multiple: int = 2):
    """A call that evicts the GPU's L2 by writing `l2_multiple` times its size, as the layers a
    training step runs between two attention calls do (Triton's do_bench writes 256 MB)."""
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    buffer = torch.empty(l2_multiple * l2_bytes, dtype=torch.uint8, device="cuda")
    return buffer.zero_


def rotating(calls: list):
    """One call that runs `calls` in turn, the next one at each call."""
    turn = itertools.count()
    return lambda: calls[next(turn) % len(calls)]()


def graph_median_ms(fn, calls: int = 20, warmup_ms: float = 100.0,
                    repeat_ms: float = 200.0) -> float:
    """Median milliseconds of one `fn()` call's GPU work replayed from a CUDA graph of `calls`
    calls: no host work between the calls at all, the yardstick for median_ms on problems
    whose kernels are shorter than a call's host time."""
    return median_ms(capture_graph(fn, calls).replay, warmup_ms, repeat_ms) / calls


def host_us(fn, warmup: int = 20, repeat: int = 200) -> float:
    """Mean host microseconds per `fn()` call. Meaningful when the GPU work of a call is shorter
    than its host work (a small problem), so that the host never waits for the GPU."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(repeat):
        fn()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed / repeat * 1e6
