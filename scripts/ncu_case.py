"""One shape through fmha and through SDPA's cuDNN backend, for Nsight Compute to catch.

    ncu --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        python3 scripts/ncu_case.py HDIM SEQLEN CAUSAL(0|1)

Three warm-up rounds of the pair come first; the launches to skip depend on how many kernels a
call launches (fmha one, cuDNN one on torch 2.11). Shapes are the benchmark's: 16k tokens,
hidden 2048, bf16. ncu locks the SM clock at base unless given --clock-control none.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha

hdim, seqlen, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
batch, heads = 16384 // seqlen, 2048 // hdim
q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16)
           for _ in range(3))
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
for _ in range(3):
    fmha.fwd(q, k, v, causal=causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
torch.cuda.synchronize()
