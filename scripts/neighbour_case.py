"""How one backward shape's timing depends on the backend that ran just before it.

    python3 scripts/neighbour_case.py HDIM SEQLEN

Two measurements, bf16, non-causal, the benchmark's shapes (16k tokens, hidden 2048):
- the median TFLOP/s of fmha's and FlashAttention-2's backward (SDPA's flash backend) timed in
  turns (fmha.timing.interleaved_medians, the benchmark's method) with cuDNN's backward out of
  the rotation, in it, and out again;
- the TFLOP/s of each of the first calls of one backend after another ran for 0.5 s: how long
  the clock takes to recover from its neighbour.
On one H100 (2026-11-25), cuDNN in the rotation cost fmha 9-13% and FlashAttention-2 4-8% at
d128 8k and 16k; on another, the benchmark with cuDNN in its rotation read what the first
machine read without it. This tells the two kinds of machine apart in about 20 s.
"""

import sys

import torch
from torch.nn.attention import SDPBackend

import fmha
from fmha.timing import event_times_ms, interleaved_medians
from power_case import run_for, sdpa_backward


def main():
    hdim, seqlen = int(sys.argv[1]), int(sys.argv[2])
    batch, heads = 16384 // seqlen, 2048 // hdim
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * hdim
    q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    out = fmha.fwd(q, k, v)
    qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
    backends = {
        "fmha": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "flash": sdpa_backward(SDPBackend.FLASH_ATTENTION, qt, kt, vt, False),
        "cudnn": sdpa_backward(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, False),
    }
    print(f"bf16 d{hdim} S={seqlen} backward, TFLOP/s")
    for rotation in (("fmha", "flash"), ("fmha", "flash", "cudnn"), ("fmha", "flash")):
        medians = interleaved_medians({name: backends[name] for name in rotation})
        tflops = {name: flops / ms * 1e-9 for name, ms in medians.items()}
        print(f"in turns with {'+'.join(rotation):17s} "
              + "  ".join(f"{name} {value:5.1f}" for name, value in tflops.items())
              + f"  fmha/flash {tflops['fmha'] / tflops['flash']:.3f}")
    for before in backends:
        for name in ("fmha", "flash"):
            if name != before:
                run_for(backends[before], 0.5)
                times = event_times_ms(backends[name], 12)
                print(f"first calls of {name:5s} after {before:5s}: "
                      f"{[round(flops / ms * 1e-9) for ms in times]}")


if __name__ == "__main__":
    main()
