"""Chunked prefill on the same keys as pages of 16-256 keys, in table order and shuffled: tells
what a small page costs through its TMA box height (each box lies in one page) from what its
scatter costs. Pages in table order are the contiguous cache's own addresses.

    PYTHONPATH=build/X/python:. python scripts/prefill_box_sizes.py CHUNK CONTEXT [HDIM]

bf16, 64 query heads on 8 K/V heads, causal bottom-right, one sequence; TFLOP/s (visible
pairs, bench/prefill.py), medians of 3 interleaved rounds; fmha.fwd on contiguous K/V where the
build has it. Each paged column is first checked equal to the contiguous cache's output.
"""

import sys

import torch

import fmha
from bench.prefill import paged_copy, visible_pairs
from fmha.timing import interleaved_medians

PAGE_SIZES = (16, 32, 64, 128, 256)

chunk, context = int(sys.argv[1]), int(sys.argv[2])
d = int(sys.argv[3]) if len(sys.argv) > 3 else 128
dtype, heads_q, heads_k = torch.bfloat16, 64, 8
gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, chunk, heads_q, d, device="cuda", dtype=dtype, generator=gen)
k, v = (torch.randn(1, context, heads_k, d, device="cuda", dtype=dtype, generator=gen)
        for _ in range(2))
full = torch.full((1,), context, dtype=torch.int32, device="cuda")
calls = {"fwd": lambda: fmha.fwd(q, k, v, causal=True, mask_align="bottom_right"),
         "contig": lambda: fmha.fwd_kvcache(q, k, v, cache_seqlens=full, causal=True)}
for page_size in PAGE_SIZES:
    for order_name, ordered in (("ord", True), ("shuf", False)):
        k_pages, v_pages, table = paged_copy(k, v, page_size, gen, ordered=ordered)
        calls[f"p{page_size}{order_name}"] = (
            lambda kp=k_pages, vp=v_pages, t=table: fmha.fwd_kvcache(
                q, kp, vp, cache_seqlens=full, block_table=t, causal=True))
try:
    calls["fwd"]()
except ValueError:  # no forward instance in this build
    del calls["fwd"]
expected = calls["contig"]()
for name, call in calls.items():
    if name.startswith("p"):
        torch.testing.assert_close(call(), expected, atol=0, rtol=0)
medians = interleaved_medians(calls, 100, 400, 3)
flops = 4 * d * visible_pairs(chunk, context) * heads_q
print(f"d{d} C{chunk} L{context}: " +
      "  ".join(f"{name} {flops / ms * 1e-9:.0f}" for name, ms in medians.items()))
