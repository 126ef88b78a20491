"""GPU timing for the demo and the benchmark: CUDA events around each call, median of many."""

import statistics

import torch


def median_ms(fn, warmup: int = 10, repeat: int = 30) -> float:
    """Median milliseconds of `fn()` on the current stream, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)
