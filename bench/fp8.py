"""python -m bench --dtypes e4m3: the e4m3 (FP8) forward's TFLOP/s on the forward grid, against
the e4m3 matrix-product rate and fmha's bf16 forward measured in the same rounds.

Each row of the grid (the shapes and FLOPs of the 16-bit rows: batch * seqlen = --tokens,
nheads * headdim = --hidden, 4 * b * h * s^2 * d, halved for causal) times, in turns
(fmha.timing.interleaved_medians, so that clock and heat fall on all alike):
- fmha_vcol: fmha.fwd on float8_e4m3fn q, k and V^T (v given with the sequence dim contiguous,
  what the kernel reads: the kernel's own rate), descales per (batch, K/V head);
- fmha: the same with v row-major, the layout models hold, read in place and transposed in
  the kernel's producer warpgroup: the rate a model sees;
- fmha_bf16: fmha's bf16 forward on the same shapes;
- scaled_mm: torch._scaled_mm of two e4m3 8192 x 8192 matrices into bf16 (the second operand
  column-major, as cuBLASLt's FP8 GEMM takes it: b = x.t() of a row-major x; fp32 scalar scales
  on the device) with use_fast_accum=True, the tensor cores' own accumulation, which is what
  the attention kernel's wgmma does: the e4m3 matrix-product rate of the FP8 issue's bar
  (0.75 of it at d128, 0.85 at d256); scaled_mm_exact, with use_fast_accum=False (cuBLASLt's
  periodic fp32 promotion), is reported beside it;
- sdpa_flash and cudnn: torch SDPA's bf16 backends, as in the 16-bit rows.
Each e4m3 row is printed with its ratios to scaled_mm and to fmha_bf16; the rows go to the
JSON's e4m3_rows (bench/plot.py draws them).
"""

import torch

GEMM_N = 8192
# The FP8 issue's bar: the forward's rate over the e4m3 matrix-product rate, by head dim.
BAR = {128: 0.75, 256: 0.85}
# (numerator, denominator) of each ratio column.
RATIOS = {"vcol/mm": ("fmha_vcol", "scaled_mm"), "row/mm": ("fmha", "scaled_mm"),
          "vcol/bf16": ("fmha_vcol", "fmha_bf16"), "row/bf16": ("fmha", "fmha_bf16")}
COLUMNS = ("fmha_vcol", "fmha", "fmha_bf16", "scaled_mm", "scaled_mm_exact", "sdpa_flash",
           "cudnn", *RATIOS, "bar")
KEYS = ("dtype", "hdim", "causal", "seqlen")


def ratio(row: dict, column: str):
    """A ratio column's value (None where either side did not run)."""
    num, den = (row.get(key) for key in RATIOS[column])
    return num / den if num and den else None


def bar_cell(row: dict) -> str:
    """The issue's bar for the row's head dim and whether the rate a model sees (row-major v)
    meets it: "0.75 met", "0.85 below", "-" for a head dim without one or a row without both
    rates."""
    target = BAR.get(row.get("hdim"))
    achieved = ratio(row, "row/mm")
    if target is None or achieved is None:
        return "-"
    return f"{target:.2f} {'met' if achieved >= target else 'below'}"


def format_rows(rows: list) -> str:
    """The e4m3 rows as a table: TFLOP/s of each column, then the ratios and the bar."""
    cols = ("case", *COLUMNS)
    width = 12
    lines = [" ".join(f"{c:>{width + 10 if c == 'case' else width}}" for c in cols)]
    for r in rows:
        cells = []
        for c in cols:
            if c == "case":
                val = " ".join(str(r.get(key)) for key in KEYS)
                cells.append(f"{val:>{width + 10}}")
                continue
            if c in RATIOS:
                v = ratio(r, c)
                val = "-" if v is None else f"{v:.2f}x"
            elif c == "bar":
                val = bar_cell(r)
            else:
                v = r.get(c)
                val = "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
            cells.append(f"{val:>{width}}")
        lines.append(" ".join(cells))
    errors = sorted({f"{name}: {r[name]}" for r in rows for name in r if name.endswith("_error")})
    return "\n".join(lines + [f"  {e}" for e in errors])


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn)


def v_transposed(v: torch.Tensor) -> torch.Tensor:
    """v (b, s, h, d) as a V^T view: (b, s, h, d) with the sequence dim contiguous, its rows of
    keys 16 bytes apart (the sequence rounded up to 16 e4m3 elements)."""
    b, s, h, d = v.shape
    padded = -(-s // 16) * 16
    buf = torch.zeros(b, h, d, padded, dtype=v.dtype, device=v.device)
    buf[..., :s].copy_(v.permute(0, 2, 3, 1))
    return buf[..., :s].permute(0, 3, 1, 2)


def scaled_mm_calls(n: int = GEMM_N) -> tuple:
    """(FLOPs, {"scaled_mm": call, "scaled_mm_exact": call}) of torch._scaled_mm on two e4m3
    n x n matrices into bf16, with and without fast accumulation."""
    a = e4m3(torch.randn(n, n, device="cuda"))
    b = e4m3(torch.randn(n, n, device="cuda")).t()  # column-major (K, N)
    one = torch.ones((), device="cuda", dtype=torch.float32)

    def call(fast):
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                               use_fast_accum=fast)
        return out[0] if isinstance(out, tuple) else out  # torch < 2.4 returned (out, amax)

    return 2.0 * n ** 3, {"scaled_mm": lambda: call(True), "scaled_mm_exact": lambda: call(False)}


def runnable(row: dict, calls: dict) -> dict:
    """The calls that run, each tried once; one that raises leaves None and its reason in the
    row (a build without the instance, an API without descales, a GPU without FP8)."""
    ok = {}
    for name, fn in calls.items():
        try:
            fn()
            ok[name] = fn
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as err:
            row[name] = None
            row[f"{name}_error"] = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ok


def run_e4m3_case(d, s, causal, args, sdpa_calls, head_dims, grid_backends) -> dict:
    """One e4m3 row of the grid (head dim d, seqlen s): TFLOP/s of every column (module doc).
    sdpa_calls, head_dims and grid_backends are bench.__main__'s."""
    import fmha
    from fmha.timing import interleaved_medians

    d_qk, d_v = head_dims(d)
    b, h = max(1, args.tokens // s), args.hidden // d_qk
    q, k = (torch.randn(b, s, h, d_qk, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(b, s, h, d_v, device="cuda", dtype=torch.bfloat16)
    flops = 2 * b * h * s * s * (d_qk + d_v) / (2 if causal else 1)
    row = {"dtype": "e4m3", "hdim": d, "causal": causal, "batch": b, "nheads": h, "seqlen": s}
    q8, k8, v8 = (e4m3(t) for t in (q, k, v))
    v8t = v_transposed(v8)
    scales = {f"{name}_descale": torch.ones(b, h, device="cuda", dtype=torch.float32)
              for name in ("q", "k", "v")}
    try:
        row["instance"] = fmha.select(q8, k8, v8t, causal=causal, **scales)["name"]
    except (ValueError, TypeError) as err:
        row["instance_error"] = str(err).splitlines()[0]
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    calls = {
        "fmha_vcol": lambda: fmha.fwd(q8, k8, v8t, causal=causal, **scales),
        "fmha": lambda: fmha.fwd(q8, k8, v8, causal=causal, **scales),
        "fmha_bf16": lambda: fmha.fwd(q, k, v, causal=causal),
    }
    mm_flops, mm_calls = scaled_mm_calls()
    calls = runnable(row, {**calls, **mm_calls})
    calls.update(sdpa_calls(row, grid_backends, qt, kt, vt, is_causal=causal))
    medians = interleaved_medians(calls, args.warmup_ms, args.repeat_ms, args.rounds)
    for name, ms in medians.items():
        row[name] = (mm_flops if name in mm_calls else flops) / ms * 1e-9
    return row
