"""Sustained clock, power and energy per FLOP of one shape, fmha against SDPA's backends.

    python3 scripts/power_case.py HDIM SEQLEN CAUSAL(0|1) [SECONDS] [--bwd]

The forward is compared with SDPA's cuDNN backend; with --bwd, the backward (fmha.bwd on the
forward's out and log-sum-exp; SDPA's through autograd, FLOPs at 2.5x the forward's) with
SDPA's flash (FlashAttention-2) and cuDNN backends.

Each backend runs back to back for SECONDS (default 4) after one second of warm-up while
nvidia-smi samples the SM clock and the board power every 100 ms. Under a sustained load an
H100 settles at the clock its 700 W limit allows, so two kernels that take the same cycles (as
Nsight Compute counts them with the clock locked) can differ in speed by how much energy each
spends per FLOP: GFLOP/J is the column that says so. Shapes are the benchmark's: 16k tokens,
hidden 2048, bf16.
"""

import argparse
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha

SAMPLE_FIELDS = "clocks.sm,power.draw,clocks_event_reasons.active"


def run_for(fn, seconds):
    """Calls `fn` back to back for about `seconds`; returns (calls, elapsed seconds)."""
    calls = 0
    torch.cuda.synchronize()
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    return calls, time.perf_counter() - begin


def measure(fn, flops, seconds):
    run_for(fn, 1.0)
    sampler = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={SAMPLE_FIELDS}", "--format=csv,noheader,nounits",
         "-lms", "100"], stdout=subprocess.PIPE, text=True)
    calls, elapsed = run_for(fn, seconds)
    sampler.terminate()
    samples = [line.split(", ") for line in sampler.communicate()[0].splitlines() if line]
    mhz = statistics.median(float(s[0]) for s in samples)
    watts = statistics.median(float(s[1]) for s in samples)
    reasons = sorted({s[2] for s in samples})
    tflops = flops * calls / elapsed / 1e12
    return tflops, mhz, watts, tflops * 1e3 / watts, reasons


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hdim", type=int)
    p.add_argument("seqlen", type=int)
    p.add_argument("causal", choices=["0", "1"])
    p.add_argument("seconds", type=float, nargs="?", default=4.0)
    p.add_argument("--bwd", action="store_true", help="time the backward pass")
    return p.parse_args()


def sdpa_backward(backend, qt, kt, vt, causal):
    """A call that runs SDPA's backward of `backend` (autograd of one forward, kept)."""
    leaves = [x.detach().contiguous().requires_grad_() for x in (qt, kt, vt)]
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def main():
    args = parse_args()
    hdim, seqlen, causal, seconds = args.hdim, args.seqlen, args.causal == "1", args.seconds
    batch, heads = 16384 // seqlen, 2048 // hdim
    q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    flops = 4 * batch * heads * seqlen * seqlen * hdim / (2 if causal else 1)

    if args.bwd:
        flops *= 2.5
        out, lse = fmha.fwd(q, k, v, causal=causal, return_lse=True)
        dout = torch.randn_like(out)
        backends = {
            "fmha": lambda: fmha.bwd(dout, q, k, v, out, lse, causal=causal),
            "flash": sdpa_backward(SDPBackend.FLASH_ATTENTION, qt, kt, vt, causal),
            "cudnn": sdpa_backward(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, causal),
        }
    else:
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        backends = {"fmha": lambda: fmha.fwd(q, k, v, causal=causal), "cudnn": cudnn}
    print(f"bf16 d{hdim} S={seqlen} causal={causal} {'backward' if args.bwd else 'forward'}, "
          f"{seconds:g} s each")
    print(f"{'backend':8} {'TFLOP/s':>8} {'SM MHz':>7} {'W':>6} {'GFLOP/J':>8}  event reasons")
    for name, fn in backends.items():
        tflops, mhz, watts, per_joule, reasons = measure(fn, flops, seconds)
        print(f"{name:8} {tflops:8.1f} {mhz:7.0f} {watts:6.0f} {per_joule:8.1f}  {' '.join(reasons)}")


if __name__ == "__main__":
    main()
