"""GPU time of each kernel one fmha call launches, from torch's profiler (CUPTI), to tell which
kernel of a multi-kernel operation a change moved.

    python scripts/kernel_times.py bwd --dtype bf16 --hdim 64 --seqlen 2048 --causal
    python scripts/kernel_times.py decode --batch 1 --cache-len 8192 [--page-size 16]
        [--page-order shuffled|ordered|2mb|sorted] [--num-splits 16] [--copies N]

bwd: fmha.bwd on the bench's shapes (16k tokens, hidden 2048); decode: one fmha.fwd_kvcache
step (bf16, --hdim, 64 query heads on 8 K/V heads), replayed from a CUDA graph so that the gaps
between kernels are those a serving loop sees, the steps taking copies of the cache in turn
as the bench does (--copies; fmha.timing.copies_beyond_l2 by default, so that a cache smaller
than L2 is not read from L2). Prints, per kernel, the median microseconds over --calls calls,
and the median span from the first kernel's start to the last one's end.
"""

import argparse
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import fmha
from fmha.timing import capture_graph, copies_beyond_l2, rotating

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DECODE_KV_HEADS = 8  # decode_step's K/V heads (bf16: 2 bytes an element)


def bwd_call(args):
    dtype = DTYPES[args.dtype]
    batch, heads = args.tokens // args.seqlen, args.hidden // args.hdim
    shape = (batch, args.seqlen, heads, args.hdim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
    out, lse = fmha.fwd(q, k, v, causal=args.causal, return_lse=True)
    return lambda: fmha.bwd(dout, q, k, v, out, lse, causal=args.causal)


def block_table(batch, pages, page_bytes, order):
    """A (batch, pages) block table over a pool of batch * pages pages in `order`: "shuffled" (a
    real allocator's pages are anywhere), "ordered" (the pool's own order, a contiguous cache's
    addresses), "2mb" (shuffled within each 2 MB of the pool, those blocks shuffled too: what
    address translation sees of "ordered", what the DRAM sees of "shuffled"), or "sorted" (each
    sequence's pages shuffled over the pool, its row in address order)."""
    count = batch * pages
    if order == "ordered":
        table = torch.arange(count, device="cuda", dtype=torch.int32)
    elif order in ("shuffled", "sorted"):
        table = torch.randperm(count, device="cuda", dtype=torch.int32)
    else:
        group = max(1, (2 << 20) // page_bytes)
        blocks = torch.randperm(-(-count // group)).tolist()
        table = torch.cat([b * group + torch.randperm(min(group, count - b * group))
                           for b in blocks]).to(device="cuda", dtype=torch.int32)
    table = table.view(batch, pages)
    return table.sort(dim=1).values if order == "sorted" else table


def decode_step(batch, cache_len, page_size=0, gqa=8, num_splits=0, d=128, order="shuffled"):
    """One decode step's call (bf16, head dim d, 8 K/V heads, a full cache; paged when
    page_size is given, the pages in `order` (block_table)), for this script and
    scripts/ncu_decode_case.py."""
    dtype, heads_k = torch.bfloat16, DECODE_KV_HEADS
    q = torch.randn(batch, 1, heads_k * gqa, d, device="cuda", dtype=dtype)
    lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    if page_size:
        pages = cache_len // page_size
        k = torch.randn(batch * pages, page_size, heads_k, d, device="cuda", dtype=dtype)
        table = block_table(batch, pages, page_size * heads_k * d * 2, order)
    else:
        k = torch.randn(batch, cache_len, heads_k, d, device="cuda", dtype=dtype)
        table = None
    v = torch.randn_like(k)
    return lambda: fmha.fwd_kvcache(q, k, v, cache_seqlens=lengths, block_table=table,
                                    num_splits=num_splits)


def decode_call(args):
    """A replay of one graph of decode steps, one a copy of the cache, and its step count."""
    cache_bytes = 2 * args.batch * args.cache_len * DECODE_KV_HEADS * args.hdim * 2  # K and V
    copies = args.copies or copies_beyond_l2(cache_bytes)
    steps = [decode_step(args.batch, args.cache_len, args.page_size, args.gqa, args.num_splits,
                         args.hdim, args.page_order) for _ in range(copies)]
    return capture_graph(rotating(steps), copies).replay, copies


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("op", choices=["bwd", "decode"])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cache-len", type=int, default=8192)
    p.add_argument("--gqa", type=int, default=8)
    p.add_argument("--page-size", type=int, default=0)
    p.add_argument("--page-order", choices=["shuffled", "ordered", "2mb", "sorted"],
                   default="shuffled",
                   help="decode: the block table's order of the pool's pages (block_table)")
    p.add_argument("--num-splits", type=int, default=0, help="decode: 0 lets fmha choose")
    p.add_argument("--copies", type=int, default=0,
                   help="decode: copies of the cache the steps take in turn (0: enough to pass L2)")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()

    call, steps = (bwd_call(args), 1) if args.op == "bwd" else decode_call(args)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            call()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.device_time > 0 and "memcpy" not in e.name.lower()),
                     key=lambda e: e.time_range.start)
    per_call = len(kernels) // (args.calls * steps)
    times = defaultdict(list)
    spans = []
    for c in range(args.calls * steps):
        group = kernels[c * per_call:(c + 1) * per_call]
        for e in group:
            times[e.name].append(e.time_range.end - e.time_range.start)
        spans.append(group[-1].time_range.end - group[0].time_range.start)
    print(f"{torch.cuda.get_device_name()}; {args.op}, medians of {args.calls * steps} calls, us")
    for name, us in times.items():
        short = name.split("(")[0].split("<")[0].split("::")[-1]
        print(f"  {short:<32} {statistics.median(us):9.1f}")
    print(f"  {'first start to last end':<32} {statistics.median(spans):9.1f}")


if __name__ == "__main__":
    main()
