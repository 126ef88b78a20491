"""python -m fmha.demo: what this build holds, and with a GPU one checked and timed call and
training step.

Checks fmha.fwd against a float64 reference on random inputs and times it next to torch's
scaled_dot_product_attention on the same shape, a causal b=4, s=2048, h=16, d=128 call (a
Llama-family layer's; 69 GFLOP, so about 0.1 ms at the 500-600 TFLOP/s an H100 reaches): long
enough that the kernels decide the speed as long as a call's host time stays below it, which
the demo measures for both and prints. Then the
training step: the gradients of q, k and v through autograd (fmha's backward) against the
float64 reference's, and forward+backward timed next to SDPA's. Without a GPU it says so and
lists the build.
"""

import math
import statistics

import torch
import torch.nn.functional as F

import fmha
from fmha.timing import host_us, median_ms

BATCH, SEQLEN, HEADS = 4, 2048, 16


def _problem():
    """(dtype, head dim, causal) of the demo: bf16 at d128 causal (the default build's) where
    the build has it, else the traits of the dispatcher's first 16-bit instance (the demo
    compares against SDPA, which takes no e4m3 inputs)."""
    candidates = [(torch.bfloat16, 128, True)]
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    first = next((i for i in fmha.instances() if i["dtype"] in dtypes), None)
    if first is not None:
        candidates.append((dtypes[first["dtype"]], first["hdim_q"], first["mask"] == "causal"))
    for dtype, d, causal in candidates:
        q = torch.empty(BATCH, SEQLEN, HEADS, d, device="cuda", dtype=dtype)
        try:
            fmha.select(q, q, q, causal=causal)
            return dtype, d, causal
        except fmha.MissingInstanceError:
            continue
    raise SystemExit("fmha.demo: no compiled instance runs on this GPU; see fmha.instances()")


def main():
    names = [i["name"] for i in fmha.instances()]
    print(f"fmha: {len(names)} instances for {', '.join(fmha.compiled_targets())}, e.g. {names[0]}")
    if not torch.cuda.is_available():
        print("fmha.demo: no CUDA GPU here; build checked, nothing run")
        return
    dtype, d, causal = _problem()
    b, s, h = BATCH, SEQLEN, HEADS
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    out = fmha.fwd(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(
        *(t.transpose(1, 2).double() for t in (q, k, v)), is_causal=causal
    ).transpose(1, 2)
    err = (out.double() - ref).abs().max().item()
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    ours = lambda: fmha.fwd(q, k, v, causal=causal)  # noqa: E731
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
    ours_ms, sdpa_ms = median_ms(ours), median_ms(sdpa)
    # Host time drifts from one stretch to the next: medians of rounds that alternate the two.
    rounds = [(host_us(ours), host_us(sdpa)) for _ in range(5)]
    ours_us = statistics.median(r[0] for r in rounds)
    sdpa_us = statistics.median(r[1] for r in rounds)
    print(f"{torch.cuda.get_device_name()}: b={b} s={s} h={h} d={d} "
          f"{str(dtype).removeprefix('torch.')} causal={causal} via "
          f"{fmha.select(q, k, v, causal=causal)['name']}")
    print(f"  max |out - float64 reference| = {err:.2e}")
    print(f"  fmha {flops / ours_ms * 1e-9:.0f} TFLOP/s, torch SDPA {flops / sdpa_ms * 1e-9:.0f} "
          f"TFLOP/s (GPU time {ours_ms * 1e3:.0f} us against {sdpa_ms * 1e3:.0f} us)")
    print(f"  host time per call: fmha {ours_us:.1f} us, torch SDPA {sdpa_us:.1f} us "
          f"({ours_us / sdpa_us:.2f}x); a call is host-bound where its host time exceeds its "
          f"GPU time")
    assert math.isfinite(err) and err < 2e-2, "output does not match the reference"
    try:
        fmha.select_bwd(q, k, v, causal=causal)
    except fmha.MissingInstanceError:
        print("  training step: this build holds no backward instance for the problem")
        return
    _training_step(q, k, v, causal, flops)


def _training_step(q, k, v, causal: bool, fwd_flops: float) -> None:
    """Gradients through autograd against the float64 reference's, and forward+backward timed
    next to SDPA's (3.5x the forward's FLOPs, FlashAttention's count)."""
    dout = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(fmha.fwd(*leaves, causal=causal), leaves, dout)
    ref_leaves = [t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref_leaves, is_causal=causal)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double().transpose(1, 2))
    errs = [((g.double() - r.transpose(1, 2)).abs().max() / r.abs().max()).item()
            for g, r in zip(grads, ref_grads)]
    sdpa_leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    sdpa_dout = dout.transpose(1, 2).contiguous()
    ours = lambda: torch.autograd.grad(fmha.fwd(*leaves, causal=causal), leaves, dout)  # noqa: E731
    sdpa = lambda: torch.autograd.grad(  # noqa: E731
        F.scaled_dot_product_attention(*sdpa_leaves, is_causal=causal), sdpa_leaves, sdpa_dout)
    ours_ms, sdpa_ms = median_ms(ours), median_ms(sdpa)
    step_flops = 3.5 * fwd_flops
    print(f"  training step via {fmha.select_bwd(q, k, v, causal=causal)['name']}: "
          f"max |grad - float64 reference| / max |reference| = "
          f"{', '.join(f'{e:.1e}' for e in errs)} (dq, dk, dv)")
    print(f"  forward+backward: fmha {step_flops / ours_ms * 1e-9:.0f} TFLOP/s, torch SDPA "
          f"{step_flops / sdpa_ms * 1e-9:.0f} TFLOP/s ({ours_ms * 1e3:.0f} us against "
          f"{sdpa_ms * 1e3:.0f} us)")
    assert all(math.isfinite(e) and e < 2e-2 for e in errs), "gradients do not match"


if __name__ == "__main__":
    main()
