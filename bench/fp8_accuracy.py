"""python -m bench.fp8_accuracy: how far the e4m3 (FP8) forward's output is from the truth, next
to the quantizing reference, bf16 attention and FlashAttention-3's published figures.

For each head dim (--hdims, default 128 and 256), sequence length (--seqlens, default 4096
and 1024) and input kind (--kinds, tests/reference.py's study_inputs):
- normal: every entry of q, k, v N(0, 1);
- fa3_outliers: FlashAttention-3's recipe for its Table 3, every entry N(0, 1) +
  N(0, 100) * Bernoulli(0.001) (a term of standard deviation 10 on 0.1% of them);
- outlier_channels: four head-dim channels of q and four others of k 10-50x larger;
- sinks: the first 4 keys take most of every row's probability mass,
the float32 inputs are quantized to e4m3 with a descale per tensor, and again per
(batch, head), mapping the largest magnitude to 448, and the table gives root mean squared
errors (RMSE over all output elements):
- e4m3: fmha.fwd on the per-tensor e4m3 inputs (v row-major, transposed in the kernel),
  against the float64 attention of the dequantized inputs (the truth of the kernel's own error);
- qref: the quantizing reference (P x 256 rounded to e4m3 relative to the final row max,
  float64 otherwise; the tests' 2x yardstick), against the same truth;
- qref_run: the same with the kernel's running max over 128-key tiles visited last to first;
- sdpa_bf16: torch SDPA (its default backend) in bf16 on the dequantized inputs cast to bf16,
  against the same truth;
- e4m3_head: fmha on the per-head e4m3 inputs, against their own dequantized truth;
- e4m3_orig, e4m3_head_orig, qref_orig: fmha e4m3 (per tensor, per head) and the quantizing
  reference (per tensor), against the float64 attention of the unquantized float inputs: the
  inputs' own quantization included, which is how FlashAttention-3 measured (against "a
  reference implementation in FP64" of the generated Q, K, V), so these are the columns to set
  beside its Table 3, whose FP8 figures are printed in the fa3 column of its input kind;
  sdpa_bf16_orig: SDPA bf16 on the float inputs cast to bf16, against the same.
"|O|" is the output's RMS, the scale the errors are relative to.

FlashAttention-3 (Shah et al., 2024, arXiv 2407.08608), section 4.3 and Table 3, "Numerical
error comparisons in FP16 and FP8 (e4m3)", RMSE: baseline FP16 3.2e-4, FlashAttention-2 FP16
1.9e-4, FlashAttention-3 FP16 1.9e-4; baseline FP8 2.4e-2 ("per-tensor scaling, with matmul
accumulator in FP32 and intermediate softmax results kept in FP16"), FlashAttention-3 FP8
9.1e-3 (block quantization and incoherent processing), without block quantization 9.3e-3,
without incoherent processing 2.4e-2. The paper does not give the shapes of that test. fmha's
e4m3 forward has per-tensor or per-(batch, head) descales and neither block quantization nor
incoherent processing, so its peer there is the baseline FP8 and "no incoherent processing"
(2.4e-2).

Prints a table; --json [PATH] writes the info and every row as JSON lines (to stdout without a
path). --device cpu computes the reference columns without a GPU (fmha's are then "-").

--p-study: the quantizing reference alone (no fmha), with the kernel's running max over
128-key tiles (fwd_reference_e4m3's p_max="running"), for each scale of P before its rounding
to e4m3 (1, 16, the kernel's 256, and 448, the largest that cannot saturate since P <= 1
relative to the exact max) and each order of the key tiles (lf: last to first, the kernel's,
the causal diagonal first and sink keys last; fl: first to last): the RMSE against the float64
attention of the dequantized per-tensor inputs, without a mask and causal, the winner (the
smallest RMSE) and the kernel's choice (256/lf) over the winner's RMSE.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import reference as R  # noqa: E402

FA3_SOURCE = ("FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608) section 4.3, Table 3; "
              "Q, K, V entries N(0,1) + N(0,100) * Bernoulli(0.001), RMSE against FP64")
FA3_RMSE = {
    "baseline FP16": 3.2e-4,
    "FlashAttention-2 FP16": 1.9e-4,
    "FlashAttention-3 FP16": 1.9e-4,
    "baseline FP8 (per-tensor scaling, FP16 softmax intermediates)": 2.4e-2,
    "FlashAttention-3 FP8 (block quantization + incoherent processing)": 9.1e-3,
    "FlashAttention-3 FP8 without block quantization": 9.3e-3,
    "FlashAttention-3 FP8 without incoherent processing": 2.4e-2,
}
# The fa3 column: the FP8 figures of the kind FlashAttention-3 measured.
FA3_CELL = {"fa3_outliers": "2.4e-2/9.1e-3"}
COLUMNS = ("|O|", "e4m3", "qref", "qref_run", "sdpa_bf16", "e4m3_head", "e4m3_orig",
           "e4m3_head_orig", "qref_orig", "sdpa_bf16_orig", "fa3")
# --p-study: P's scales and the key tiles' orders, the kernel's (256, last to first) among them.
P_SCALES = (1.0, 16.0, R.E4M3_P_SCALE, R.E4M3_MAX)
P_ORDER_NAMES = {"last_to_first": "lf", "first_to_last": "fl"}
P_VARIANTS = tuple((scale, order) for scale in P_SCALES for order in R.E4M3_KEY_ORDERS)
P_KERNEL = (R.E4M3_P_SCALE, R.E4M3_KEY_ORDER)


def p_variant_name(variant) -> str:
    scale, order = variant
    return f"{scale:g}/{P_ORDER_NAMES[order]}"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.fp8_accuracy",
                                description=__doc__.splitlines()[0])
    csv = lambda f: (lambda s: [f(x) for x in s.split(",")])  # noqa: E731
    p.add_argument("--hdims", type=csv(int), default=[128, 256])
    p.add_argument("--seqlens", type=csv(int), default=[4096, 1024],
                   help="seqlen_q = seqlen_k")
    p.add_argument("--kinds", type=csv(str), default=list(R.STUDY_KINDS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="query heads = K/V heads")
    p.add_argument("--causal", action="store_true", help="causal (top-left) instead of none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for the reference columns")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="also write JSON lines: the info, then every row (stdout without PATH)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's CPU threads (torch.set_num_threads; default: torch's)")
    p.add_argument("--p-study", action="store_true",
                   help="the quantizing reference's RMSE for each scale of P and order of the "
                        "key tiles, without a mask and causal (no fmha; --causal ignored)")
    args = p.parse_args(argv)
    unknown = set(args.kinds) - set(R.STUDY_KINDS)
    if unknown:
        p.error(f"unknown kind {sorted(unknown)}; valid: {', '.join(R.STUDY_KINDS)}")
    return args


def per_head(fn, heads: int, *tensors, descales=()):
    """fn(*tensors sliced to head h, *descales sliced to it) for each head, concatenated along
    the head dim of its results (output (b, s, h, d), lse (b, h, s)): bounds the float64
    references' memory to one head's (S x S) at a time."""
    outs = []
    for h in range(heads):
        sliced = [t[:, :, h:h + 1] for t in tensors]
        ds = [d if d is None or d.shape[-1] == 1 else d[:, h:h + 1] for d in descales]
        outs.append(fn(*sliced, *ds))
    return [torch.cat([o[i] for o in outs], dim=2 if outs[0][i].dim() == 4 else 1)
            for i in range(len(outs[0]))]


def sdpa_bf16(q, k, v, causal):
    """torch SDPA (its default backend) in bf16 on (b, s, h, d) inputs, as float64."""
    qt, kt, vt = (x.to(torch.bfloat16).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2).double()


def study_row(kind, d, s, args, fmha=None) -> dict:
    """One row of the study: the RMSE of every column (module doc); fmha None: its columns
    None (the reference columns only)."""
    device = args.device
    gen = torch.Generator().manual_seed(args.seed + 1000 * d + s)
    q, k, v = R.study_inputs(kind, args.batch, s, args.heads, args.heads, d, gen=gen,
                             device=device)
    causal = args.causal
    row = {"kind": kind, "hdim": d, "seqlen": s, "batch": args.batch, "heads": args.heads,
           "causal": causal}

    def exact(q_, k_, v_):
        out, _ = R.attention_reference(q_.double(), k_.double(), v_.double(), causal=causal)
        return (out,)

    (orig,) = per_head(exact, args.heads, q, k, v)
    row["|O|"] = R.rms(orig)
    row["sdpa_bf16_orig"] = R.rms(sdpa_bf16(q, k, v, causal) - orig)
    for granularity, suffix in (("tensor", ""), ("head", "_head")):
        (q8, qd), (k8, kd), (v8, vd) = (R.to_e4m3(x, granularity) for x in (q, k, v))

        def references(q_, k_, v_, qd_, kd_, vd_):
            final = R.fwd_reference_e4m3(q_, k_, v_, q_descale=qd_, k_descale=kd_,
                                         v_descale=vd_, causal=causal)
            running = R.fwd_reference_e4m3(q_, k_, v_, q_descale=qd_, k_descale=kd_,
                                           v_descale=vd_, causal=causal, p_max="running")
            return final.truth, final.quantized, running.quantized

        truth, quantized, running = per_head(references, args.heads, q8, k8, v8,
                                             descales=(qd, kd, vd))
        if granularity == "tensor":
            row["qref"] = R.rms(quantized - truth)
            row["qref_run"] = R.rms(running - truth)
            row["qref_orig"] = R.rms(quantized - orig)
            dequantized = [R.dequantize_e4m3(x, ds) for x, ds in ((q8, qd), (k8, kd), (v8, vd))]
            row["sdpa_bf16"] = R.rms(sdpa_bf16(*dequantized, causal) - truth)
        out = None
        if fmha is not None:
            try:
                out = fmha.fwd(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                               v_descale=vd).double()
            except (ValueError, TypeError, RuntimeError) as err:
                row[f"e4m3{suffix}_error"] = str(err).splitlines()[0]
        row[f"e4m3{suffix}"] = None if out is None else R.rms(out - truth)
        row[f"e4m3{suffix}_orig"] = None if out is None else R.rms(out - orig)
        row[f"e4m3{suffix}_max"] = None if out is None else (out - truth).abs().max().item()
    row["fa3"] = FA3_CELL.get(kind)
    return row


def p_study_outputs(q8, k8, v8, descales, causal, variants=P_VARIANTS, rows=64):
    """(truth, {variant: output}) of the per-tensor e4m3 codes q8, k8, v8 (b, s, h, d) and
    their descales (q, k, v): the float64 attention of the dequantized inputs, and the
    quantizing reference with the running max (fwd_reference_e4m3(p_max="running",
    p_scale=scale, order=order).quantized) of each (scale, order), float64 (b, s, h, dv).

    One head at a time, its masked logits computed once (attention_reference's weights hook
    sees them) for every variant, e4m3_p_weights applied to `rows` queries at a time."""
    qd, kd, vd = (R.dequantize_e4m3(x, ds) for x, ds in zip((q8, k8, v8), descales))
    truths, outs = [], {variant: [] for variant in variants}
    for h in range(qd.shape[2]):
        vh = vd[:, :, h:h + 1].permute(0, 2, 1, 3)  # (b, 1, sk, dv)

        def weights(s, lse):
            safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            for variant in variants:
                scale, order = variant
                w = R.e4m3_p_weights(scale, "running", order=order)
                out = torch.cat([w(s[..., i:i + rows, :], lse[..., i:i + rows]) @ vh
                                 for i in range(0, s.shape[-2], rows)], dim=-2)
                outs[variant].append(out.permute(0, 2, 1, 3))
            return torch.exp(s - safe.unsqueeze(-1))  # _attend's own probabilities: the truth

        truth, _ = R.attention_reference(qd[:, :, h:h + 1], kd[:, :, h:h + 1], vd[:, :, h:h + 1],
                                         causal=causal, weights=weights)
        truths.append(truth)
    return torch.cat(truths, dim=2), {v: torch.cat(o, dim=2) for v, o in outs.items()}


def p_study_row(kind, d, s, causal, args) -> dict:
    """One row of --p-study: the RMSE of each (scale, order) against the truth, the winner."""
    gen = torch.Generator().manual_seed(args.seed + 1000 * d + s)
    q, k, v = R.study_inputs(kind, args.batch, s, args.heads, args.heads, d, gen=gen,
                             device=args.device)
    (q8, qd), (k8, kd), (v8, vd) = (R.to_e4m3(x, "tensor") for x in (q, k, v))
    truth, outs = p_study_outputs(q8, k8, v8, (qd, kd, vd), causal)
    row = {"kind": kind, "hdim": d, "seqlen": s, "batch": args.batch, "heads": args.heads,
           "causal": causal, "|O|": R.rms(truth)}
    rmse = {p_variant_name(variant): R.rms(out - truth) for variant, out in outs.items()}
    row["rmse"] = rmse
    row["winner"] = min(rmse, key=rmse.get)
    row["kernel/winner"] = rmse[p_variant_name(P_KERNEL)] / rmse[row["winner"]]
    return row


def format_p_rows(rows) -> str:
    names = [p_variant_name(variant) for variant in P_VARIANTS]
    head = (f"{'kind':>16} {'hdim':>4} {'S':>5} {'mask':>6} {'|O|':>8} "
            + " ".join(f"{n:>8}" for n in names) + f" {'winner':>8} {'256/lf/w':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['kind']:>16} {r['hdim']:>4} {r['seqlen']:>5} "
                     f"{'causal' if r['causal'] else 'none':>6} {r['|O|']:>8.2e} "
                     + " ".join(f"{r['rmse'][n]:>8.2e}" for n in names)
                     + f" {r['winner']:>8} {r['kernel/winner']:>8.3f}")
    return "\n".join(lines)


def format_rows(rows) -> str:
    width = 11
    head = f"{'hdim':>5} {'S':>6} {'kind':>17} " + " ".join(f"{c:>{width}}" for c in COLUMNS)
    lines = [head]
    for r in rows:
        cells = []
        for c in COLUMNS:
            v = r.get(c)
            cells.append(f"{'-' if v is None else v if isinstance(v, str) else f'{v:.2e}':>{width}}")
        lines.append(f"{r['hdim']:>5} {r['seqlen']:>6} {r['kind']:>17} " + " ".join(cells))
    errors = sorted({f"{k}: {r[k]}" for r in rows for k in r if k.endswith("_error")})
    return "\n".join(lines + [f"  {e}" for e in errors])


def fa3_lines() -> list:
    return [f"FlashAttention-3's RMSE ({FA3_SOURCE}):"] + [
        f"  {name}: {value:.1e}" for name, value in FA3_RMSE.items()]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    fmha = None
    if args.device.startswith("cuda") and not args.p_study:
        if not torch.cuda.is_available():
            sys.exit("python -m bench.fp8_accuracy: needs a CUDA GPU (or --device cpu for the "
                     "reference columns alone)")
        import fmha
    info = {"gpu": torch.cuda.get_device_name() if fmha is not None else None,
            "torch": torch.__version__, "device": args.device, "batch": args.batch,
            "heads": args.heads, "causal": args.causal, "seed": args.seed, "p_study": args.p_study,
            "fa3": {"source": FA3_SOURCE, "rmse": FA3_RMSE},
            "command": " ".join(["python", "-m", "bench.fp8_accuracy", *(argv or sys.argv[1:])])}
    out = None
    if args.json:
        out = sys.stdout if args.json == "-" else open(args.json, "w")
        print(json.dumps({"info": info}), file=out, flush=True)
    # With JSON lines on stdout, the table goes to stderr; else each row goes there as it comes.
    table = sys.stderr if out is sys.stdout else sys.stdout
    rows = []
    if args.p_study:
        for kind in args.kinds:
            for d in args.hdims:
                for causal in (False, True):
                    for s in args.seqlens:
                        rows.append(p_study_row(kind, d, s, causal, args))
                        print(json.dumps(rows[-1]), file=out or sys.stderr, flush=True)
    else:
        for d in args.hdims:
            for s in args.seqlens:
                for kind in args.kinds:
                    rows.append(study_row(kind, d, s, args, fmha))
                    print(json.dumps(rows[-1]), file=out or sys.stderr, flush=True)
    if out is not None and out is not sys.stdout:
        out.close()
    if args.p_study:
        print(f"{args.device}, torch {info['torch']}; the quantizing reference (float64 but for "
              f"P rounded to e4m3, the running max over 128-key tiles), not the kernel; RMSE "
              f"of the output against float64 attention of the dequantized per-tensor inputs; "
              f"batch {args.batch}, {args.heads} heads, seed {args.seed}; columns scale/order: "
              "P x scale before its rounding, key tiles visited lf last to first (the "
              "kernel's), fl first to last; winner: the smallest RMSE; 256/lf/w: the kernel's "
              "RMSE over the winner's", file=table)
        print(format_p_rows(rows), file=table)
        return rows
    print(f"{info['gpu'] or args.device}, torch {info['torch']}; RMSE of the output, batch "
          f"{args.batch}, {args.heads} heads, {'causal' if args.causal else 'no mask'}; "
          "e4m3 .. sdpa_bf16: against float64 attention of the dequantized per-tensor inputs "
          "(e4m3_head: of the per-head ones); *_orig: against float64 attention of the "
          "unquantized inputs, as FlashAttention-3 measured; fa3: its baseline FP8 / "
          "FlashAttention-3 FP8 (bench/fp8_accuracy.py's doc)", file=table)
    print(format_rows(rows), file=table)
    print("\n".join(fa3_lines()), file=table)
    return rows


if __name__ == "__main__":
    main()
