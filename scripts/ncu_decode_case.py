"""One fmha.fwd_kvcache decode step for Nsight Compute to catch (bf16 d128, 64 query heads on
8 K/V heads, a full cache), contiguous or paged.

    ncu --kernel-name regex:kvcache_kernel --launch-skip 3 --launch-count 1 \
        --section WarpStateStats python3 scripts/ncu_decode_case.py BATCH CACHE_LEN [PAGE_SIZE]

Three warm-up calls come first (the launches to skip); PAGE_SIZE 0 or absent is contiguous.
"""

import sys

import torch

import fmha

batch, cache_len = int(sys.argv[1]), int(sys.argv[2])
page_size = int(sys.argv[3]) if len(sys.argv) > 3 else 0
q = torch.randn(batch, 1, 64, 128, device="cuda", dtype=torch.bfloat16)
lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
table = None
if page_size:
    pages = cache_len // page_size
    k = torch.randn(batch * pages, page_size, 8, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
else:
    k = torch.randn(batch, cache_len, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
for _ in range(4):
    fmha.fwd_kvcache(q, k, v, cache_seqlens=lengths, block_table=table)
torch.cuda.synchronize()
