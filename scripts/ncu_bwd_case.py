"""One backward shape through fmha and through SDPA's flash backend (FlashAttention-2), for
Nsight Compute to catch the two main kernels side by side.

    ncu -k regex:'bwd_kernel|dq_dk_dv' --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats \
        python3 scripts/ncu_bwd_case.py HDIM SEQLEN CAUSAL(0|1)

Two warm-up rounds of the pair come first, so skipping 4 launches of the main kernels leaves
fmha's bwd_kernel, then FlashAttention-2's flash_bwd_dq_dk_dv_* kernel. Shapes are the
benchmark's: 16k tokens, hidden 2048, bf16. ncu locks the SM clock at base unless given
--clock-control none.
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
dout = torch.randn_like(q)
out, lse = fmha.fwd(q, k, v, causal=causal, return_lse=True)
qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
for _ in range(3):
    fmha.bwd(dout, q, k, v, out, lse, causal=causal)
    torch.autograd.grad(ref, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
torch.cuda.synchronize()
