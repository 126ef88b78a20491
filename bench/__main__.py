"""python -m bench: forward TFLOP/s of fmha against torch SDPA's flash and cuDNN backends.

Shapes follow the FlashAttention papers: a fixed number of tokens (batch * seqlen = 16k) and a
fixed hidden size (nheads * headdim = 2048), so every row does the same work at every seqlen.
FLOPs are 4 * b * h * s^2 * d (two GEMMs), halved for causal. Each backend gets its native
layout: fmha (b, s, h, d), SDPA (b, h, s, d). Times are medians of CUDA-event-timed runs
after warm-up. Prints a table and, with --json, writes every row.
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha.timing import median_ms

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    csv = lambda f: (lambda s: [f(x) for x in s.split(",")])  # noqa: E731
    p.add_argument("--dtypes", type=csv(str), default=["bf16", "fp16"])
    p.add_argument("--hdims", type=csv(int), default=[64, 128])
    p.add_argument("--seqlens", type=csv(int), default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="nheads * headdim")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    unknown = set(args.dtypes) - set(DTYPES)
    if unknown:
        p.error(f"unknown dtype {sorted(unknown)}; valid: {', '.join(DTYPES)}")
    return args


def run_case(dtype, d, s, causal, args):
    b, h = max(1, args.tokens // s), args.hidden // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    row = {"dtype": str(dtype).removeprefix("torch."), "hdim": d, "causal": causal,
           "batch": b, "nheads": h, "seqlen": s}

    row["instance"] = fmha.select(q, k, v, causal=causal)["name"]
    ms = median_ms(lambda: fmha.fwd(q, k, v, causal=causal), args.warmup, args.repeat)
    row["fmha"] = flops / ms * 1e-9

    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    for name, backend in SDPA_BACKENDS.items():
        try:
            with sdpa_kernel(backend):
                call = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
                ms = median_ms(call, args.warmup, args.repeat)
            row[name] = flops / ms * 1e-9
        except RuntimeError as err:  # backend unavailable for this shape/GPU
            row[name] = None
            row[f"{name}_error"] = str(err).splitlines()[0]
    return row


def format_table(rows):
    cols = ["dtype", "hdim", "causal", "seqlen", "fmha", "sdpa_flash", "cudnn", "vs_flash", "vs_cudnn"]
    lines = [" ".join(f"{c:>10}" for c in cols)]
    for r in rows:
        cells = []
        for c in cols:
            if c.startswith("vs_"):
                other = r.get("sdpa_flash" if c == "vs_flash" else "cudnn")
                val = f"{r['fmha'] / other:.2f}x" if other else "-"
            else:
                val = r.get(c)
                val = "-" if val is None else f"{val:.1f}" if isinstance(val, float) else str(val)
            cells.append(f"{val:>10}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        sys.exit("python -m bench: needs a CUDA GPU")
    causal_values = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    rows = []
    for dt in args.dtypes:
        for d in args.hdims:
            for causal in causal_values:
                for s in args.seqlens:
                    rows.append(run_case(DTYPES[dt], d, s, causal, args))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "targets": fmha.compiled_targets()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"{info['gpu']}, torch {info['torch']}, cuDNN {info['cudnn']}; TFLOP/s, medians")
    print(format_table(rows))


if __name__ == "__main__":
    main()
