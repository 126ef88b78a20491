"""What a bare read of N bytes reaches on this GPU, timed as `python -m bench --decode` times a
decode step: calls replayed from a CUDA graph, taking copies of the input in turn so that they
hold four times the L2 together (fmha.timing). A decode step reads its cache once, so this is
its ceiling at that size; the 1 GiB copy the bench divides by overstates it at small sizes,
where a launch, the first round trip to memory and the last CTAs' tail are a large part.

    PYTHONPATH=build/X/python:. python scripts/read_ceiling.py [--mib 4,34,...]

The read is a Triton kernel (Triton ships with CUDA builds of torch; fmha does not use it):
each program sums `block * iters` consecutive bf16 elements, `block` of them an iteration, and
stores one float. Several shapes of that grid are timed, since at tens of MB the best one
depends on how many programs share the tail (a bf16 d128 decode step at batch 1 x 8k keys, 8
K/V heads: 34 MB); the table prints the best and the spread. The same bytes are also read as a
decode CTA reads a (batch, keys, 8 heads, 128) cache, one head's 256-byte rows at a 2 KB stride
("heads"): what the layout itself costs against reading whole rows. With each size, torch's
copy_ of the same bytes (read plus written; its destination rotated too) and torch's sum, for
scale.
"""

import argparse
import math

import torch
import triton
import triton.language as tl

from bench.decode import GRAPH_CALLS, copy_bandwidth_gbs
from fmha.timing import capture_graph, copies_beyond_l2, median_ms, rotating

# (elements an iteration, iterations a program, warps): 4 KB to 128 KB a program.
READ_SHAPES = [(1024, 2, 4), (1024, 4, 4), (2048, 8, 8), (4096, 4, 8), (1024, 32, 8),
               (4096, 8, 8), (4096, 16, 8), (8192, 8, 16)]
# (keys a program, warps) of the head-strided read: from one 64-key tile (16 KB of one head's
# rows) to a split of 4k keys (1 MB).
HEAD_READ_SHAPES = [(64, 4), (256, 4), (1024, 4), (4096, 4)]


@triton.jit
def _read_kernel(x_ptr, sums_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    begin = tl.program_id(0) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offsets = begin + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def _read_head_kernel(x_ptr, sums_ptr, rows, HEADS: tl.constexpr, D: tl.constexpr,
                      ROWS: tl.constexpr, ITERS: tl.constexpr):
    # x as (rows, HEADS, D): program (i, h) reads head h of rows [i * ROWS * ITERS, ...), D
    # elements a row at a stride of HEADS * D, as a decode CTA reads one K/V head of a cache
    # in (batch, keys, heads, d) layout.
    head = tl.program_id(1)
    row0 = tl.program_id(0) * ROWS * ITERS
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    for i in range(ITERS):
        r = row0 + i * ROWS + tl.arange(0, ROWS)
        offsets = (r[:, None] * HEADS + head) * D + tl.arange(0, D)[None, :]
        acc += tl.load(x_ptr + offsets, mask=r[:, None] < rows, other=0.0).to(tl.float32)
    tl.store(sums_ptr + tl.program_id(0) * HEADS + head, tl.sum(acc))


def head_read(x, sums, heads, d, rows_per_iter, iters, warps):
    rows = x.numel() // (heads * d)
    programs = triton.cdiv(rows, rows_per_iter * iters)
    _read_head_kernel[(programs, heads)](x, sums, rows, HEADS=heads, D=d, ROWS=rows_per_iter,
                                         ITERS=iters, num_warps=warps)


def bare_read(x, sums, block, iters, warps):
    programs = triton.cdiv(x.numel(), block * iters)
    _read_kernel[(programs,)](x, sums, x.numel(), BLOCK=block, ITERS=iters, num_warps=warps)


def per_call_ms(calls, args) -> float:
    """Median GPU milliseconds of one of `calls` (taken in turn) replayed from a CUDA graph."""
    count = len(calls) * math.ceil(GRAPH_CALLS / len(calls))
    graph = capture_graph(rotating(calls), count)
    return median_ms(graph.replay, args.warmup_ms, args.repeat_ms) / count


def measure(nbytes: int, args) -> dict:
    copies = copies_beyond_l2(nbytes)
    inputs = [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
              for _ in range(copies)]
    sums = torch.empty(nbytes // (2 * 1024 * 2) + 1, device="cuda", dtype=torch.float32)
    row = {"bytes": nbytes, "copies": copies, "reads": {}, "heads": {}}
    for block, iters, warps in READ_SHAPES:
        ms = per_call_ms([lambda x=x: bare_read(x, sums, block, iters, warps) for x in inputs],
                         args)
        row["reads"][f"{block}x{iters}/{warps}w"] = nbytes / ms * 1e-6
    # As a decode step's CTAs read a bf16 d128 cache of 8 K/V heads: 64-key tiles of one head.
    for keys, warps in HEAD_READ_SHAPES:
        ms = per_call_ms([lambda x=x: head_read(x, sums, 8, 128, 64, keys // 64, warps)
                          for x in inputs], args)
        row["heads"][f"{keys} keys/{warps}w"] = nbytes / ms * 1e-6
    row["sum"] = nbytes / per_call_ms([x.sum for x in inputs], args) * 1e-6
    # The copy's destinations rotate with the sources, half as many (each written every other
    # turn), so that they do not stay in L2 either.
    outputs = [torch.empty_like(x) for x in inputs[:max(1, copies // 2)]]
    copy_calls = [lambda x=x, y=outputs[i % len(outputs)]: y.copy_(x)
                  for i, x in enumerate(inputs)]
    row["copy"] = 2 * nbytes / per_call_ms(copy_calls, args) * 1e-6
    return row


def decode_sizes() -> list:
    """K and V bytes of the decode bench's bf16 d128 steps with 8 K/V heads (batch x keys),
    up to 4 GiB (past it the read is flat)."""
    per_key = 2 * 8 * 128 * 2
    sizes = sorted({b * keys * per_key for b in (1, 8, 64) for keys in (1024, 8192, 32768, 131072)})
    return [s for s in sizes if s <= 4 << 30]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=lambda t: [float(x) for x in t.split(",")], default=None,
                   help="sizes in MiB (default: the decode bench's cache sizes)")
    p.add_argument("--warmup-ms", type=float, default=100.0)
    p.add_argument("--repeat-ms", type=float, default=300.0)
    args = p.parse_args()
    sizes = [int(m * 2**20) // 2 * 2 for m in args.mib] if args.mib else decode_sizes()
    copy_gbs = copy_bandwidth_gbs(args)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; GB/s, medians; copy of 1 GiB (read + written, one buffer, as "
          f"the decode bench) {copy_gbs:.0f}")
    print(f"{'MB':>8} {'copies':>6} {'read best':>9} {'/1GiB copy':>10} {'read shapes':>11} "
          f"{'heads best':>10} {'head shapes':>11} {'sum':>6} {'copy':>6}  best shapes")
    for nbytes in sizes:
        row = measure(nbytes, args)
        reads, heads = row["reads"], row["heads"]
        best, best_heads = max(reads, key=reads.get), max(heads, key=heads.get)
        print(f"{nbytes / 1e6:8.1f} {row['copies']:6d} {reads[best]:9.0f} "
              f"{reads[best] / copy_gbs:10.2f} {min(reads.values()):5.0f}-{reads[best]:<5.0f} "
              f"{heads[best_heads]:10.0f} {min(heads.values()):5.0f}-{heads[best_heads]:<5.0f} "
              f"{row['sum']:6.0f} {row['copy']:6.0f}  {best}, {best_heads}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
