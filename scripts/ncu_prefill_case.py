"""One chunked-prefill chunk three ways for Nsight Compute to catch, in this order: fmha.fwd
on contiguous K/V, fmha.fwd_kvcache on a contiguous cache, and on pages of PAGE_SIZE keys in
shuffled order, or in table order with `ordered` (the contiguous cache's own addresses, read
in boxes of the page's height) (bench/prefill.py's shapes: bf16 d128, 64 query heads on 8 K/V
heads, causal bottom-right), each after one warm-up call.

    PYTHONPATH=build/X/python:. ncu --kernel-name regex:fwd_kernel --launch-skip 3 \
        --launch-count 3 --section SpeedOfLight python3 scripts/ncu_prefill_case.py \
        CHUNK CONTEXT PAGE_SIZE [ordered]
"""

import sys

import torch

import fmha
from bench import prefill

chunk, context, page_size = (int(a) for a in sys.argv[1:4])
ordered = sys.argv[4:5] == ["ordered"]
dtype, d, heads_q, heads_k = torch.bfloat16, 128, 64, 8
gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, chunk, heads_q, d, device="cuda", dtype=dtype, generator=gen)
k, v = (torch.randn(1, context, heads_k, d, device="cuda", dtype=dtype, generator=gen)
        for _ in range(2))
full = torch.full((1,), context, dtype=torch.int32, device="cuda")
k_pages, v_pages, table = prefill.paged_copy(k, v, page_size, gen, ordered=ordered)

calls = [lambda: fmha.fwd(q, k, v, causal=True, mask_align="bottom_right"),
         lambda: fmha.fwd_kvcache(q, k, v, cache_seqlens=full, causal=True),
         lambda: fmha.fwd_kvcache(q, k_pages, v_pages, cache_seqlens=full, block_table=table,
                                  causal=True)]
for call in calls:
    call()
for call in calls:
    call()
torch.cuda.synchronize()
