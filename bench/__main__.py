"""python -m bench: forward TFLOP/s of fmha against torch SDPA's flash and cuDNN backends.

Shapes follow the FlashAttention papers: a fixed number of tokens (batch * seqlen = 16k) and a
fixed hidden size (nheads * headdim = 2048), so every row does the same work at every seqlen.
FLOPs are 4 * b * h * s^2 * d (two GEMMs), halved for causal. Each backend gets its native
layout: fmha (b, s, h, d), SDPA (b, h, s, d). Times are medians of CUDA-event-timed calls
run back to back after warm-up, in --rounds rounds that take a case's backends in turn: GPU
time, with the host's own cost per call kept out, and the same clock and heat for every backend
(fmha.timing). That host cost is measured apart, on a small and a mid-size problem, for fmha
and for SDPA's default choice and each of its two fast backends, and printed under the table;
--graph adds fmha's time replayed from a CUDA graph, which shows where host time still bounds
a row. Prints a table and, with --json, writes every row; --plot draws them (bench/plot.py).

--features adds one row per trait at one sequence length (--feature-seqlen), each against the
SDPA backends that can compute the same thing (attn_mask: cuDNN and memory-efficient; dropout:
flash) and against fmha's own plain row, whose ratio shows what the trait costs. Windows count
only the visible (query, key) pairs as FLOPs.

--bwd times the backward pass instead, at FlashAttention's 2.5x the forward's FLOPs, and the
forward and backward together at 3.5x: every backend through torch.autograd.grad (fmha's
through fmha.fwd's autograd formula, SDPA's through the backward its forward's autograd node
runs), on the same grid. --deterministic adds fmha.bwd's deterministic mode, called directly
(column fmha_det, and det/fmha its share of the default mode's speed). Under the tables: the
peak memory of one forward+backward of each backend on one shape of the grid. Then the same
grid as a training loop meets it (bench/training.py): L2 flushed before each call, inputs
rotated, backward into the leaves' .grad, the leaves held (b, h, s, d) and (b, s, h, d), host
time included, with the host's microseconds per call (--no-loop leaves these tables out).

--host times what a call costs the host instead (bench/host.py): the forward without and with
grad, a training call and a compiled one, for fmha (both leaf layouts) and SDPA's backends.

--dtypes e4m3 (alone or beside bf16, fp16) adds the e4m3 (FP8) forward's rows to the grid
(bench/fp8.py): fmha on e4m3 inputs with V^T given and with v row-major, fmha's bf16 forward,
torch._scaled_mm's e4m3 8192^3 GEMM and SDPA's bf16 backends, timed in turns, each e4m3 row
with its ratios to the GEMM and to fmha bf16; a table of its own, the JSON's e4m3_rows.
"""

import argparse
import contextlib
import datetime
import json
import shlex
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from bench import decode, fp8, generate, host, plot, prefill, training
from fmha.timing import graph_median_ms, host_us, interleaved_medians

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The forward grid's FP8 rows (bench/fp8.py): --dtypes e4m3.
FP8_DTYPES = ("e4m3",)
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
# The rows of the main grid compare with the two fast backends; the memory-efficient one is
# only there for the bias rows, which flash cannot run.
GRID_BACKENDS = ("sdpa_flash", "cudnn")


def head_dim(text: str):
    """A --hdims entry: 128 (QK and V alike) or 192x128 (QK x V), kept as written in rows."""
    qk, _, v = text.partition("x")
    return text if v and int(qk) != int(v) else int(qk)


def head_dims(d) -> tuple[int, int]:
    """(QK, V) head dims of a --hdims entry."""
    if isinstance(d, int):
        return d, d
    qk, v = d.split("x")
    return int(qk), int(v)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    csv = lambda f: (lambda s: [f(x) for x in s.split(",")])  # noqa: E731
    p.add_argument("--dtypes", type=csv(str), default=["bf16", "fp16"])
    p.add_argument("--hdims", type=csv(head_dim), default=[64, 128],
                   help="head dims: 128, or QK x V as 192x128")
    p.add_argument("--seqlens", type=csv(int), default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="nheads * headdim")
    p.add_argument("--warmup-ms", type=float, default=100.0,
                   help="untimed calls per case and backend, in milliseconds of GPU time")
    p.add_argument("--repeat-ms", type=float, default=200.0,
                   help="timed calls per case and backend, in milliseconds of GPU time")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed rounds per case, each taking the backends in turn so that "
                        "clock and heat drift fall on all of them alike")
    p.add_argument("--features", action="store_true",
                   help="also time one row per trait (bias, ALiBi, window, soft-cap, dropout, "
                        "varlen, V^T, head-dim padding)")
    p.add_argument("--feature-seqlen", type=int, default=4096)
    p.add_argument("--bwd", action="store_true",
                   help="time the backward pass (2.5x the forward's FLOPs) and forward+backward "
                        "(3.5x) instead of the forward, on the same grid")
    p.add_argument("--no-loop", action="store_true",
                   help="with --bwd: only the kernel-only tables, not the training-loop ones")
    p.add_argument("--deterministic", action="store_true",
                   help="with --bwd: also time fmha.bwd(deterministic=True) (column fmha_det)")
    p.add_argument("--graph", action="store_true",
                   help="also time fmha replayed from a CUDA graph (column fmha_graph): no "
                        "host work between calls, so fmha/fmha_graph below 1 is host-bound")
    p.add_argument("--decode", action="store_true",
                   help="time one decode step of fmha.fwd_kvcache against SDPA instead (GB/s "
                        "against the device's copy bandwidth; bench/decode.py)")
    p.add_argument("--batches", type=csv(int), default=None,
                   help="with --decode: batch sizes (default 1,8,64); with --prefill: "
                        "sequences per chunked call (default 1)")
    p.add_argument("--cache-lens", type=csv(int), default=[1024, 8192, 32768, 131072],
                   help="with --decode: cached keys per sequence")
    p.add_argument("--gqa", type=csv(int), default=[8, 4],
                   help="with --decode: query heads per K/V head")
    p.add_argument("--kv-heads", type=int, default=8, help="with --decode: K/V heads")
    p.add_argument("--kv-dtypes", type=csv(str), default=["same"],
                   help="with --decode and --prefill: the caches' dtypes, 'same' (the "
                        "queries') and 'e4m3' (float8, per-head scales)")
    p.add_argument("--pages", type=csv(int), default=[16, 64, 256],
                   help="with --decode and --prefill: page sizes of the paged caches (0: none)")
    p.add_argument("--prefill", action="store_true",
                   help="chunked prefill: fmha.fwd_kvcache on contiguous and paged caches "
                        "against fmha.fwd on the same shapes (bench/prefill.py)")
    p.add_argument("--chunks", type=csv(int), default=[512, 1024, 2048, 4096],
                   help="with --prefill: query tokens per chunk")
    p.add_argument("--contexts", type=csv(int), default=[4096, 8192, 16384],
                   help="with --prefill: keys a sequence holds with its chunk")
    p.add_argument("--generate", action="store_true",
                   help="decode end to end: transformers' generate() of a random Llama-family "
                        "model with attn_implementation fmha against sdpa (bench/generate.py); "
                        "--batches (default 1,8,32), --hidden")
    p.add_argument("--prompts", type=csv(int), default=[512, 2048],
                   help="with --generate: prompt lengths")
    p.add_argument("--new-tokens", type=int, default=64, help="with --generate: tokens generated")
    p.add_argument("--model-layers", type=int, default=16, help="with --generate")
    p.add_argument("--model-head-dim", type=int, default=64, help="with --generate")
    p.add_argument("--model-kv-heads", type=int, default=8, help="with --generate")
    p.add_argument("--vocab", type=int, default=32000, help="with --generate")
    p.add_argument("--left-pad", action="store_true",
                   help="with --generate: a quarter of each batch's rows left-padded to half "
                        "the prompt")
    p.add_argument("--host", action="store_true",
                   help="host time per call instead: the forward without and with grad, a "
                        "training call, and a compiled one, of fmha and SDPA (bench/host.py)")
    p.add_argument("--no-compile", action="store_true",
                   help="with --host: leave out the compiled training call")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--plot", metavar="PATH",
                   help="draw TFLOP/s (GB/s for --decode) against sequence length into this "
                        "image, a panel per configuration, fmha beside each peer (needs "
                        "matplotlib; --bwd draws the backward, python -m bench.plot redraws "
                        "any table from the --json file)")
    args = p.parse_args(argv)
    args.argv = list(argv)
    unknown = set(args.dtypes) - set(DTYPES) - set(FP8_DTYPES)
    if unknown:
        p.error(f"unknown dtype {sorted(unknown)}; valid: {', '.join([*DTYPES, *FP8_DTYPES])}")
    if set(args.dtypes) & set(FP8_DTYPES) and (args.bwd or args.decode or args.prefill
                                               or args.generate or args.host):
        p.error("--dtypes e4m3 times the e4m3 forward on the grid only (no --bwd, --decode, "
                "--prefill, --generate or --host); decode from an e4m3 cache is --decode "
                "--kv-dtypes e4m3, chunked prefill from one --prefill --kv-dtypes e4m3")
    unknown = set(args.kv_dtypes) - {"same", "e4m3"}
    if unknown:
        p.error(f"unknown --kv-dtypes {sorted(unknown)}; valid: same, e4m3")
    if args.deterministic and not args.bwd:
        p.error("--deterministic times the backward: give --bwd too")
    if args.generate and (args.new_tokens < 2 or args.hidden % args.model_head_dim):
        p.error("--generate needs --new-tokens >= 2 (a step is the time past the first token) "
                "and --hidden a multiple of --model-head-dim")
    if args.plot:
        if args.host or args.generate:
            p.error("--plot draws the grid, --bwd, --decode and --prefill runs")
        plot.require_matplotlib()  # before the run, not after it
    return args


def save(args, results):
    """Writes a run's results (its info and row tables) to --json and draws them into --plot.
    The info records the date and the command, which a plot redrawn from the JSON names."""
    results["info"].update(date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
                           command=shlex.join(["python", "-m", "bench", *args.argv]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot.draw(results, args.plot)


def sdpa_calls(row, backends, qt, kt, vt, **kwargs):
    """Each SDPA backend's forward on (b, h, s, d) inputs as a call to time; a backend that
    refuses the problem gets None in the row, with its reason."""
    calls = {}
    for name in backends:
        def call(backend=SDPA_BACKENDS[name]):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, **kwargs)
        try:
            call()
            calls[name] = call
        except RuntimeError as err:  # backend unavailable for this shape/GPU
            row[name] = None
            row[f"{name}_error"] = str(err).splitlines()[0]
    return calls


def time_forward(row, flops, args, fmha_inputs, fmha_kwargs, sdpa):
    """Adds the TFLOP/s of fmha.fwd(*fmha_inputs, **fmha_kwargs) and of the SDPA calls to the
    row, timed in turns (interleaved_medians); with --graph also fmha's replayed from a CUDA
    graph. A problem fmha's build has no instance for leaves fmha_error."""
    calls = dict(sdpa)
    try:
        row["instance"] = fmha.select(*fmha_inputs, **fmha_kwargs)["name"]
        fmha.fwd(*fmha_inputs, **fmha_kwargs)  # raises here, not while timing
        calls = {"fmha": lambda: fmha.fwd(*fmha_inputs, **fmha_kwargs), **sdpa}
    except ValueError as err:  # not in this build: say so in the row
        row["fmha"] = None
        row["fmha_error"] = str(err).splitlines()[0]
    medians = interleaved_medians(calls, args.warmup_ms, args.repeat_ms, args.rounds)
    row.update({name: flops / ms * 1e-9 for name, ms in medians.items()})
    if args.graph and "fmha" in calls:
        row["fmha_graph"] = flops / graph_median_ms(calls["fmha"], 20, args.warmup_ms,
                                                    args.repeat_ms) * 1e-9


def run_case(dtype, d, s, causal, args):
    d_qk, d_v = head_dims(d)
    b, h = max(1, args.tokens // s), args.hidden // d_qk
    q, k = (torch.randn(b, s, h, d_qk, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(b, s, h, d_v, device="cuda", dtype=dtype)
    flops = 2 * b * h * s * s * (d_qk + d_v) / (2 if causal else 1)
    row = {"dtype": str(dtype).removeprefix("torch."), "hdim": d, "causal": causal,
           "batch": b, "nheads": h, "seqlen": s}
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    time_forward(row, flops, args, (q, k, v), {"causal": causal},
                 sdpa_calls(row, GRID_BACKENDS, qt, kt, vt, is_causal=causal))
    return row


def fmha_backward_calls(bwd, both, q, k, v, dout, causal, deterministic):
    """fmha's backward and forward+backward as calls to time, keyed by column: torch.autograd.grad
    through fmha.fwd, and with `deterministic` fmha.bwd(deterministic=True) on the forward's
    out and lse (fmha_det). A problem the build has no instance for leaves fmha_error."""
    try:
        bwd["instance"] = both["instance"] = fmha.select_bwd(q, k, v, causal=causal)["name"]
        out = fmha.fwd(q, k, v, causal=causal)
        grads = {"fmha": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)}
        steps = {"fmha": lambda: torch.autograd.grad(fmha.fwd(q, k, v, causal=causal),
                                                     (q, k, v), dout)}
        if deterministic:
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            out_d, lse = fmha.fwd(qd, kd, vd, causal=causal, return_lse=True)
            grads["fmha_det"] = lambda: fmha.bwd(dout, qd, kd, vd, out_d, lse, causal=causal,
                                                 deterministic=True)
            steps["fmha_det"] = lambda: deterministic_step(qd, kd, vd, dout, causal)
        for call in (*grads.values(), *steps.values()):
            call()  # raises here, not while timing, for a problem it cannot run
        return grads, steps
    except (ValueError, RuntimeError) as err:  # not in this build, or unavailable here
        for row in (bwd, both):
            row["fmha"] = None
            row["fmha_error"] = str(err).splitlines()[0]
        return {}, {}


def deterministic_step(q, k, v, dout, causal):
    """fmha.fwd(q, k, v) and fmha.bwd(deterministic=True) of it, on tensors without grad."""
    out, lse = fmha.fwd(q, k, v, causal=causal, return_lse=True)
    return fmha.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True)


def sdpa_backward_calls(bwd, both, qt, kt, vt, causal):
    """Each SDPA backend's backward (the one its forward's autograd node runs) and
    forward+backward as calls to time; a backend that refuses the problem gets None and its
    reason in both rows."""
    grads, steps = {}, {}
    for name in GRID_BACKENDS:
        backend = SDPA_BACKENDS[name]

        def forward(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        try:
            out = forward()
            dout = torch.randn_like(out)
            grads[name] = lambda out=out, dout=dout: torch.autograd.grad(
                out, (qt, kt, vt), dout, retain_graph=True)
            steps[name] = lambda forward=forward, dout=dout: torch.autograd.grad(
                forward(), (qt, kt, vt), dout)
            grads[name]()
            steps[name]()
        except RuntimeError as err:  # backend unavailable for this shape/GPU
            grads.pop(name, None)
            steps.pop(name, None)
            bwd[name] = both[name] = None
            bwd[f"{name}_error"] = both[f"{name}_error"] = str(err).splitlines()[0]
    return grads, steps


def run_backward_case(dtype, d, s, causal, args):
    """The backward pass and forward+backward of one grid case: two kernel-only rows, TFLOP/s
    at FlashAttention's convention of 2.5x (3.5x) the forward's FLOPs, every backend timed in
    turns with the others (interleaved_medians), and the training loop's rows
    (bench/training.py)."""
    d_qk, d_v = head_dims(d)
    b, h = max(1, args.tokens // s), args.hidden // d_qk
    flops = 2 * b * h * s * s * (d_qk + d_v) / (2 if causal else 1)
    key = {"dtype": str(dtype).removeprefix("torch."), "hdim": d, "causal": causal, "batch": b,
           "nheads": h, "seqlen": s}
    bwd, both = dict(key), dict(key)
    q, k, v = (torch.randn(b, s, h, dim, device="cuda", dtype=dtype, requires_grad=True)
               for dim in (d_qk, d_qk, d_v))
    grads, steps = fmha_backward_calls(bwd, both, q, k, v, torch.randn_like(v), causal,
                                       args.deterministic)
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    sdpa_grads, sdpa_steps = sdpa_backward_calls(bwd, both, qt, kt, vt, causal)
    for row, calls, factor in ((bwd, {**grads, **sdpa_grads}, 2.5),
                               (both, {**steps, **sdpa_steps}, 3.5)):
        medians = interleaved_medians(calls, args.warmup_ms, args.repeat_ms, args.rounds)
        row.update({name: factor * flops / ms * 1e-9 for name, ms in medians.items()})
    del grads, steps, sdpa_grads, sdpa_steps, q, k, v, qt, kt, vt
    loop = [] if args.no_loop else training.run_case(
        key, flops, (b, s, h, d_qk, d_v), dtype, causal,
        {name: SDPA_BACKENDS[name] for name in GRID_BACKENDS}, args)
    return bwd, both, loop


def peak_mib(step) -> float:
    """MiB one step() allocates at its peak above what was allocated before it (its outputs
    included); a first call, untimed and unmeasured, leaves plans and workspaces behind it."""
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure_backward_memory(args) -> dict:
    """The peak memory of one forward+backward of each backend on one case of the grid: the
    first dtype, head dim 128 where the grid has it, the longest sequence, no mask. {"shape":
    its description, backend: MiB or the error that stopped it}."""
    dtype = DTYPES[args.dtypes[0]]
    d = 128 if 128 in args.hdims else args.hdims[0]
    d_qk, d_v = head_dims(d)
    s = max(args.seqlens)
    b, h = max(1, args.tokens // s), args.hidden // d_qk
    q, k, v = (torch.randn(b, s, h, dim, device="cuda", dtype=dtype, requires_grad=True)
               for dim in (d_qk, d_qk, d_v))
    dout = torch.randn_like(v)
    qt, kt, vt, dout_t = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v, dout))
    qt, kt, vt = (t.requires_grad_() for t in (qt, kt, vt))
    steps = {"fmha": lambda: torch.autograd.grad(fmha.fwd(q, k, v), (q, k, v), dout)}
    if args.deterministic:
        steps["fmha_det"] = lambda: deterministic_step(q.detach(), k.detach(), v.detach(),
                                                       dout, False)
    sdpa = lambda: torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt),  # noqa: E731
                                       (qt, kt, vt), dout_t)
    memory = {"shape": f"{args.dtypes[0]} d{d} S={s} b={b} h={h}"}
    for name, step in steps.items():
        try:
            memory[name] = peak_mib(step)
        except (ValueError, RuntimeError) as err:
            memory[name] = str(err).splitlines()[0]
    for name in GRID_BACKENDS:
        try:
            with sdpa_kernel(SDPA_BACKENDS[name]):
                memory[name] = peak_mib(sdpa)
        except RuntimeError as err:
            memory[name] = str(err).splitlines()[0]
    return memory


def visible_pairs(s, left, right):
    """(query, key) pairs a window (left, right) leaves visible at seqlen_q = seqlen_k = s."""
    i = torch.arange(s, dtype=torch.int64)
    lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = (i + right).clamp(max=s - 1) if right >= 0 else torch.full_like(i, s - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def run_features(dtype, d, args):
    """One row per trait at seqlen args.feature_seqlen, plus the plain row they compare with;
    none for a QK x V head dim (the traits are timed where QK and V share one)."""
    if not isinstance(d, int):
        return []
    s = args.feature_seqlen
    b, h = max(1, args.tokens // s), args.hidden // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    full = 4 * b * h * s * s * d
    rows = []

    def row(feature, flops=full, sdpa=(), sdpa_kwargs=None, inputs=(q, k, v), **kwargs):
        r = {"dtype": str(dtype).removeprefix("torch."), "hdim": d, "feature": feature,
             "batch": b, "nheads": h, "seqlen": s}
        time_forward(r, flops, args, inputs, kwargs,
                     sdpa_calls(r, sdpa, qt, kt, vt, **(sdpa_kwargs or {})))
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)

    bias = torch.randn(1, h, s, s, device="cuda", dtype=dtype)
    window = (256, 0)
    row("plain", sdpa=GRID_BACKENDS)
    row("bias(1,h,s,s)", sdpa=("cudnn", "sdpa_efficient"), sdpa_kwargs={"attn_mask": bias},
        bias=bias)
    row("alibi", alibi_slopes=torch.rand(h, device="cuda", dtype=torch.float32))
    row(f"window{window}", flops=4 * b * h * d * visible_pairs(s, *window), window_size=window)
    row("softcap30", softcap=30.0)
    row("dropout0.1", sdpa=("sdpa_flash",), sdpa_kwargs={"dropout_p": 0.1}, dropout_p=0.1)
    row("lse", return_lse=True)
    v_col = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # (b, s, h, d), seq stride 1
    row("v_colmajor", inputs=(q, k, v_col))
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    packed = [t.reshape(b * s, h, d) for t in (q, k, v)]
    row("varlen", inputs=packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s,
        max_seqlen_k=s)
    d_pad = d - 8  # a head dim the padded instance one size up serves
    row(f"hdim{d_pad}(padded)", flops=full * d_pad // d,
        inputs=tuple(t[..., :d_pad] for t in (q, k, v)))
    return rows


# Host time is measured on two problems: a small one whose kernel takes a few microseconds, so
# every backend's host cost shows whole, and the demo's (python -m fmha.demo), whose kernel
# takes ~40-50 us on an H100: (name, batch, seqlen, nheads, headdim, causal), bf16.
HOST_SHAPES = (("small", 1, 128, 16, 128, False), ("mid", 4, 2048, 16, 64, True))


def measure_host_us(rounds: int = 5):
    """Host microseconds per call of fmha and of torch SDPA (its default choice of backend,
    and flash and cuDNN forced) on HOST_SHAPES: {shape name: {backend: us}}, the median of
    `rounds` rounds that take the backends in turn, so that a slow stretch of the host (the
    same backend reads 20-31 us from one run to the next on the H100 machines) falls on all."""
    costs = {}
    for name, b, s, h, d, causal in HOST_SHAPES:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
        # (backend, call, the SDPA backend it forces or None)
        calls = [("fmha", lambda: fmha.fwd(q, k, v, causal=causal), None), ("sdpa", sdpa, None)]
        calls += [(backend, sdpa, SDPA_BACKENDS[backend]) for backend in GRID_BACKENDS]
        try:
            fmha.fwd(q, k, v, causal=causal)
        except fmha.MissingInstanceError:  # not in this build
            calls = calls[1:]
        times = {backend: [] for backend, _, _ in calls}
        for _ in range(rounds):
            for backend, call, forced in calls:
                with sdpa_kernel(forced) if forced is not None else contextlib.nullcontext():
                    times[backend].append(host_us(call))
        row = {backend: statistics.median(us) for backend, us in times.items()}
        costs[f"{name} b={b} s={s} h={h} d={d}{' causal' if causal else ''}"] = row
    return costs


# The ratio columns of the tables: (numerator, denominator) of the row's TFLOP/s.
RATIOS = {"vs_flash": ("fmha", "sdpa_flash"), "vs_cudnn": ("fmha", "cudnn"),
          "vs_graph": ("fmha", "fmha_graph"), "det/fmha": ("fmha_det", "fmha")}


def format_table(rows, first):
    cols = [first, "fmha", "sdpa_flash", "cudnn", "sdpa_efficient", "vs_flash", "vs_cudnn"]
    if any("fmha_graph" in r for r in rows):
        cols += ["fmha_graph", "vs_graph"]
    if any("fmha_det" in r for r in rows):
        cols += ["fmha_det", "det/fmha"]
    cols += [c for c in ("fmha_host_us", "sdpa_flash_host_us", "cudnn_host_us")
             if any(c in r for r in rows)]
    lines = [" ".join(f"{c:>14}" for c in cols)]
    for r in rows:
        cells = []
        for c in cols:
            if c in RATIOS:
                num, den = (r.get(key) for key in RATIOS[c])
                val = f"{num / den:.2f}x" if num and den else "-"
            elif c == first:
                val = " ".join(str(r[key]) for key in KEYS[first])
            else:
                val = r.get(c)
                val = "-" if val is None else f"{val:.1f}" if isinstance(val, float) else str(val)
            cells.append(f"{val:>14}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


# The columns that name a row, per table: the grid's (dtype hdim causal seqlen) and the
# feature rows' (dtype hdim feature).
KEYS = {"case": ("dtype", "hdim", "causal", "seqlen"), "feature": ("dtype", "hdim", "feature"),
        "loop case": ("dtype", "hdim", "causal", "seqlen", "layout")}


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        sys.exit("python -m bench: needs a CUDA GPU")
    causal_values = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.decode:
        return main_decode(args)
    if args.prefill:
        return main_prefill(args)
    if args.generate:
        return main_generate(args)
    if args.bwd:
        return main_backward(args, causal_values)
    if args.host:
        return main_host(args)
    rows, e4m3_rows = [], []
    for dt in args.dtypes:
        for d in args.hdims:
            for causal in causal_values:
                for s in args.seqlens:
                    if dt in FP8_DTYPES:
                        e4m3_rows.append(fp8.run_e4m3_case(d, s, causal, args, sdpa_calls,
                                                           head_dims, GRID_BACKENDS))
                        print(json.dumps(e4m3_rows[-1]), file=sys.stderr, flush=True)
                        continue
                    rows.append(run_case(DTYPES[dt], d, s, causal, args))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    feature_rows = []
    if args.features:
        for dt in args.dtypes:
            if dt in FP8_DTYPES:
                continue  # the traits are timed in the 16-bit dtypes
            for d in args.hdims:
                feature_rows += run_features(DTYPES[dt], d, args)
    host = measure_host_us()
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "targets": fmha.compiled_targets(),
            "host_us_per_call": host}
    results = {"info": info, "rows": rows, "feature_rows": feature_rows}
    if e4m3_rows:
        results["e4m3_rows"] = e4m3_rows
    save(args, results)
    print(f"{info['gpu']}, torch {info['torch']}, cuDNN {info['cudnn']}; TFLOP/s, medians")
    if rows or not e4m3_rows:
        print(format_table(rows, "case"))
    if e4m3_rows:
        print(f"e4m3 forward (bench/fp8.py): fmha_vcol V^T given, fmha v row-major (transposed "
              f"in the kernel), fmha_bf16 the bf16 forward, scaled_mm torch._scaled_mm e4m3 "
              f"{fp8.GEMM_N}^3 -> bf16 (fast accumulation; _exact without), SDPA bf16; "
              f"bar: the FP8 issue's share of scaled_mm, for the row-major rate")
        print(fp8.format_rows(e4m3_rows))
    print("host time per call, us (not in the TFLOP/s above; bf16, sdpa: its default backend):")
    for shape, costs in host.items():
        print(f"  {shape:32s} " + ", ".join(
            f"{name} {us:.1f}" for name, us in costs.items()))
    if feature_rows:
        print(format_table(feature_rows, "feature"))


def main_backward(args, causal_values):
    """python -m bench --bwd: the backward grid and the forward+backward grid."""
    bwd_rows, both_rows, loop_rows = [], [], []
    for dt in args.dtypes:
        for d in args.hdims:
            for causal in causal_values:
                for s in args.seqlens:
                    bwd, both, loop = run_backward_case(DTYPES[dt], d, s, causal, args)
                    bwd_rows.append(bwd)
                    both_rows.append(both)
                    loop_rows += loop
                    print(json.dumps({"bwd": bwd, "fwd_bwd": both, "loop": loop}),
                          file=sys.stderr, flush=True)
    memory = measure_backward_memory(args)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "targets": fmha.compiled_targets(),
            "peak_memory_mib": memory}
    save(args, {"info": info, "bwd_rows": bwd_rows, "fwd_bwd_rows": both_rows,
                "loop_rows": loop_rows})
    print(f"{info['gpu']}, torch {info['torch']}, cuDNN {info['cudnn']}; TFLOP/s, medians")
    print("backward (2.5x the forward's FLOPs), kernel-only:")
    print(format_table(bwd_rows, "case"))
    print("forward + backward (3.5x), kernel-only:")
    print(format_table(both_rows, "case"))
    for kind, title in (("bwd", "backward"), ("fwd_bwd", "forward + backward")):
        rows = [r for r in loop_rows if r["kind"] == kind]
        if rows:
            print(f"{title}, training loop (L2 flushed, inputs rotated, host time included; "
                  "bench/training.py), host us per call last:")
            print(format_table(rows, "loop case"))
    for error in sorted({r["fmha_error"] for r in bwd_rows if r.get("fmha_error")}):
        print(f"fmha: {error}")
    shape = memory.pop("shape")
    print(f"peak memory of one forward+backward ({shape}), MiB above the inputs, gradients "
          "included:")
    print("  " + ", ".join(f"{name} {mib:.0f}" if isinstance(mib, float) else f"{name}: {mib}"
                           for name, mib in memory.items()))


def main_host(args):
    """python -m bench --host: host microseconds per call (bench/host.py)."""
    costs = host.measure(rounds=args.rounds, compiled=not args.no_compile)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": host.SHAPE}
    save(args, {"info": info, "host_us_per_call": costs})
    print(f"{info['gpu']}, torch {info['torch']}")
    print(host.format_rows(costs))


def main_decode(args):
    """python -m bench --decode: GB/s of one decode step, head dims --hdims, on the grid of
    --batches x --cache-lens x --gqa (query heads per K/V head, --kv-heads K/V heads)."""
    copy_gbs = decode.copy_bandwidth_gbs(args)
    rows = []
    for dt in args.dtypes:
        for d in args.hdims:
            for group in args.gqa:
                for batch in args.batches or [1, 8, 64]:
                    for cache_len in args.cache_lens:
                        rows.append(decode.run_decode_case(
                            DTYPES[dt], head_dims(d)[0], group * args.kv_heads, args.kv_heads,
                            batch, cache_len, args))
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    host_hdim = head_dims(args.hdims[-1])[0]  # the default's 128
    host = decode.host_costs(DTYPES[args.dtypes[0]], host_hdim, args)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "copy_gbs": copy_gbs, "host_us_per_call": host}
    save(args, {"info": info, "decode_rows": rows})
    print(f"{info['gpu']}, torch {info['torch']}; decode GB/s (K/V read once, plus q and out), "
          f"medians; device-to-device copy {copy_gbs:.0f} GB/s")
    print(decode.format_rows(rows, copy_gbs))
    print(f"host time per call, us (b1 h8/1 d{host_hdim} L1024): " +
          ", ".join(f"{name} {us:.1f}" for name, us in host.items()))



def main_prefill(args):
    """python -m bench --prefill: TFLOP/s of causal chunks, head dims --hdims, on the grid of
    --batches x --chunks x --contexts x --gqa (--kv-heads K/V heads), on caches of each of
    --kv-dtypes; chunks longer than their context are skipped."""
    rows = []
    for dt in args.dtypes:
        for d in args.hdims:
            for group in args.gqa:
                for batch in args.batches or [1]:
                    for context in args.contexts:
                        for chunk in args.chunks:
                            if chunk > context:
                                continue
                            rows.append(prefill.run_prefill_case(
                                DTYPES[dt], head_dims(d)[0], group * args.kv_heads,
                                args.kv_heads, batch, chunk, context, args))
                            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "targets": fmha.compiled_targets()}
    save(args, {"info": info, "prefill_rows": rows})
    print(f"{info['gpu']}, torch {info['torch']}; chunked prefill TFLOP/s (causal, "
          f"bottom-right), medians" + ("; e4m3_*: float8 e4m3 caches, per-head scales"
                                       if "e4m3" in args.kv_dtypes else ""))
    print(prefill.format_rows(rows))
    for instance in sorted({r["e4m3_instance"] for r in rows if r.get("e4m3_instance")}):
        print(f"e4m3 chunks, contiguous cache: ran {instance}")


def main_generate(args):
    """python -m bench --generate: ms per prefill and per decode step of generate(), fmha and
    sdpa, on the grid of --batches x --prompts."""
    model = generate.build_model(args)
    rows = []
    for batch in args.batches or [1, 8, 32]:
        for prompt in args.prompts:
            rows.append(generate.run_generate_case(model, batch, prompt, args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    import transformers

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "model": {
                "hidden": args.hidden, "layers": args.model_layers,
                "heads": f"{args.hidden // args.model_head_dim}/{args.model_kv_heads}",
                "head_dim": args.model_head_dim, "vocab": args.vocab}}
    save(args, {"info": info, "generate_rows": rows})
    m = info["model"]
    print(f"{info['gpu']}, torch {info['torch']}, transformers {info['transformers']}; "
          f"generate() of a random Llama (hidden {m['hidden']}, {m['layers']} layers, heads "
          f"{m['heads']} of {m['head_dim']}, vocabulary {m['vocab']}), bf16, eager, greedy, "
          f"{args.new_tokens} new tokens{', left-padded rows' if args.left_pad else ''}; ms, "
          f"medians of {args.rounds} rounds")
    print(generate.format_rows(rows))


if __name__ == "__main__":
    main()
