"""python -m fmha.demo: what this build holds, and with a GPU one checked and timed call.

Checks fmha.fwd against a float64 reference on random inputs and times it next to torch's
scaled_dot_product_attention on the same shapes; without a GPU it says so and lists the build.
"""

import math

import torch
import torch.nn.functional as F

import fmha
from fmha.timing import median_ms


def main():
    names = [i["name"] for i in fmha.instances()]
    print(f"fmha: {len(names)} instances for {', '.join(fmha.compiled_targets())}, e.g. {names[0]}")
    if not torch.cuda.is_available():
        print("fmha.demo: no CUDA GPU here; build checked, nothing run")
        return
    inst = fmha.instances()[0]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[inst["dtype"]]
    causal = inst["mask"] == "causal"
    b, s, h, d = 4, 2048, 16, inst["hdim_q"]
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    out = fmha.fwd(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(
        *(t.transpose(1, 2).double() for t in (q, k, v)), is_causal=causal
    ).transpose(1, 2)
    err = (out.double() - ref).abs().max().item()
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    ours = median_ms(lambda: fmha.fwd(q, k, v, causal=causal))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    sdpa = median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    print(f"{torch.cuda.get_device_name()}: b={b} s={s} h={h} d={d} {inst['dtype']} "
          f"causal={causal} via {fmha.select(q, k, v, causal=causal)['name']}")
    print(f"  max |out - float64 reference| = {err:.2e}")
    print(f"  fmha {flops / ours * 1e-9:.0f} TFLOP/s, torch SDPA {flops / sdpa * 1e-9:.0f} TFLOP/s")
    assert math.isfinite(err) and err < 2e-2, "output does not match the reference"


if __name__ == "__main__":
    main()
