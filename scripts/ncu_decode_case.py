"""One fmha.fwd_kvcache decode step for Nsight Compute to catch (kernel_times.py's: bf16 d128,
64 query heads on 8 K/V heads, a full cache), contiguous or paged.

    ncu --kernel-name regex:kvcache_kernel --launch-skip 3 --launch-count 1 \
        --section WarpStateStats python3 scripts/ncu_decode_case.py BATCH CACHE_LEN [PAGE_SIZE]

Three warm-up calls come first (the launches to skip); PAGE_SIZE 0 or absent is contiguous.
"""

import sys

import torch

from kernel_times import decode_step

step = decode_step(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
for _ in range(4):
    step()
torch.cuda.synchronize()
