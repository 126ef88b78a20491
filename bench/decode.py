"""python -m bench --decode: one decode step (one query token per sequence against a full KV
cache) of fmha.fwd_kvcache against torch SDPA's backends on the same shapes.

Decode reads every cached key and value once and does little arithmetic on them, so the
measure is bandwidth: bytes = K and V of every sequence (batch * cache_len * nheads_k * 2 *
headdim * 2) plus q and out, over the median GPU time of a call replayed from a CUDA graph
(fmha.timing.capture_graph; a serving loop captures its decode steps, and eager calls at small
shapes would time the host, not the kernels). The graph's calls take several copies of the
case's caches in turn, as a model's decode step reads each layer's own cache once: a cache
smaller than the GPU's L2 (50 MB on an H100; batch 1 x 8k keys at d128 with 8 K/V heads is
34 MB) re-read by every call would be served from L2, and time the L2, not the memory
(fmha.timing.copies_beyond_l2; the `copies` column). The yardstick is the device-to-device
copy bandwidth measured in the same run (torch's copy_ of a 1 GiB buffer, counting the bytes
read and written). fmha runs a contiguous cache and paged caches (--pages); SDPA has no paged
cache and runs the contiguous one, (b, h, 1, d) against (b, h_k, L, d) with enable_gqa, with
each backend that accepts it (the best one's time is the row's sdpa column). With
--kv-dtypes same,e4m3 fmha also runs float8 e4m3 caches (per-head scales) of the same shapes,
contiguous and paged, in the same interleaved rounds: their GB/s count one byte an element,
and the `e4m3 x` column is the contiguous e4m3 step's speed over the 16-bit one's (time over
time). Host time per call is measured apart, eagerly, on the smallest shape (fmha.timing's
host_us), for fmha and for SDPA's default choice.
"""

import math
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha.timing import (capture_graph, copies_beyond_l2, host_us, interleaved_medians,
                         median_ms, rotating)

SDPA_DECODE_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


# Calls per captured graph: enough that the replay's own launch (a few us) is a small part.
GRAPH_CALLS = 20


def copy_bandwidth_gbs(args) -> float:
    """Device-to-device copy of 1 GiB, bytes read plus bytes written per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), args.warmup_ms, args.repeat_ms)
    return 2 * src.numel() / ms * 1e-6


def make_cache(batch, cache_len, nhead_k, d, dtype, page_size):
    """(k_cache, v_cache, block_table) of full caches of `dtype` (float8_e4m3fn: codes of
    randn * 32, which e4m3_scales() dequantize): contiguous without page_size, else pages in
    shuffled order (a real allocator's pages are anywhere). bench/prefill.py builds its e4m3
    caches with it too."""
    shape = (batch, cache_len) if not page_size else (batch * (cache_len // page_size), page_size)
    k, v = (torch.randn(*shape, nhead_k, d, device="cuda").mul_(32).to(dtype) for _ in range(2))
    if not page_size:
        return k, v, None
    table = torch.randperm(shape[0], device="cuda").view(batch, -1).to(torch.int32)
    return k, v, table


def e4m3_scales(nhead_k) -> dict:
    """fmha.fwd_kvcache's k_scale and v_scale of make_cache()'s e4m3 caches: per K/V head, as a
    serving stack's calibration gives them."""
    return {name: torch.full((nhead_k,), 1 / 32, device="cuda") for name in ("k_scale", "v_scale")}


def _sdpa_calls(row, q, caches):
    """Each SDPA backend that accepts the decode shape, as a call that takes the contiguous
    `caches` ((k_cache, v_cache) pairs) in turn, on (b, h, s, d) views."""
    qt = q.transpose(1, 2)
    views = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in caches]
    calls = {}
    for name, backend in SDPA_DECODE_BACKENDS.items():
        def call(kt, vt, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            call(*views[0])
            calls[f"sdpa_{name}"] = rotating([lambda kt=kt, vt=vt, call=call: call(kt, vt)
                                               for kt, vt in views])
        except RuntimeError as err:
            row[f"sdpa_{name}_error"] = str(err).splitlines()[0]
    return calls


def run_decode_case(dtype, d, nhead_q, nhead_k, batch, cache_len, args):
    row = {"dtype": str(dtype).removeprefix("torch."), "hdim": d, "heads": f"{nhead_q}/{nhead_k}",
           "batch": batch, "cache_len": cache_len}
    q = torch.randn(batch, 1, nhead_q, d, device="cuda", dtype=dtype)
    lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    calls = {}
    bytes_moved = {}  # per call: its caches and q and out
    element = torch.finfo(dtype).bits // 8
    for kv_dtype in getattr(args, "kv_dtypes", ["same"]):
        e4m3 = kv_dtype == "e4m3"
        cache_dtype = torch.float8_e4m3fn if e4m3 else dtype
        cache_bytes = 2 * (1 if e4m3 else element) * batch * cache_len * nhead_k * d
        copies = copies_beyond_l2(cache_bytes)
        row["e4m3_cache_copies" if e4m3 else "cache_copies"] = copies
        # Every layout's caches are alive while the row's calls take turns: past ~80% of the
        # free memory (b64 x 128k keys is 34 GB a layout at d128, bf16) the row keeps the
        # contiguous one.
        layouts = [0, *[p for p in args.pages if p]]
        if copies * cache_bytes * len(layouts) > 0.8 * torch.cuda.mem_get_info()[0]:
            row["paged_skipped"] = "memory"
            layouts = [0]
        scales = e4m3_scales(nhead_k) if e4m3 else {}
        for page_size in layouts:
            if page_size and cache_len % page_size:
                continue
            caches = [make_cache(batch, cache_len, nhead_k, d, cache_dtype, page_size)
                      for _ in range(copies)]
            name = "fmha" + ("_e4m3" if e4m3 else "") + (f"_paged{page_size}" if page_size else "")
            try:
                steps = [lambda k_cache=k_cache, v_cache=v_cache, table=table, scales=scales:
                         fmha.fwd_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                          block_table=table, **scales)
                         for k_cache, v_cache, table in caches]
                steps[0]()
                calls[name] = rotating(steps)
                bytes_moved[name] = cache_bytes + 2 * element * batch * nhead_q * d
                if not page_size and not e4m3:
                    row["instance"] = fmha.select_kvcache(q, caches[0][0], caches[0][1],
                                                          cache_seqlens=lengths)["name"]
                    sdpa = _sdpa_calls(row, q, [(k, v) for k, v, _ in caches])
                    calls.update(sdpa)
                    bytes_moved.update({n: bytes_moved[name] for n in sdpa})
            except ValueError as err:  # not in this build
                row[f"{name}_error"] = str(err).splitlines()[0]
    copies = max(row["cache_copies"], row.get("e4m3_cache_copies", 1))
    # Each call replays from a CUDA graph of GRAPH_CALLS calls or more (each copy as often), as
    # a serving loop runs decode: back-to-back eager calls would time the host (about 30 us a
    # call) at small shapes.
    graph_calls = copies * math.ceil(GRAPH_CALLS / copies)
    replays = {}
    for name, call in calls.items():
        try:
            replays[name] = capture_graph(call, graph_calls).replay
        except RuntimeError as err:  # a backend that cannot be captured (or memory)
            row[f"{name}_error"] = "graph capture: " + str(err).splitlines()[0]
    medians = {name: ms / graph_calls for name, ms in interleaved_medians(
        replays, args.warmup_ms, args.repeat_ms, args.rounds).items()}
    for name, ms in medians.items():
        row[name] = bytes_moved[name] / ms * 1e-6  # GB/s
        row[f"{name}_us"] = ms * 1e3
    sdpa = {n: row[n] for n in medians if n.startswith("sdpa_")}
    if sdpa:
        best = max(sdpa, key=sdpa.get)
        row["sdpa_best"] = best.removeprefix("sdpa_")
        row["sdpa"] = sdpa[best]
    return row


def host_costs(dtype, d, args, rounds: int = 5) -> dict:
    """Host microseconds per call on a small decode shape of head dim d (GPU work shorter than
    host work): the median of `rounds` rounds that take fmha and SDPA in turn, since a slow
    stretch of the host moves one reading by several microseconds (bench/__main__.py
    measure_host_us)."""
    q = torch.randn(1, 1, 8, d, device="cuda", dtype=dtype)
    k_cache = torch.randn(1, 1024, 1, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    lengths = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    calls = {"fmha": lambda: fmha.fwd_kvcache(q, k_cache, v_cache, cache_seqlens=lengths),
             "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)}
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(host_us(call))
    return {name: statistics.median(us) for name, us in times.items()}


def format_rows(rows, copy_gbs) -> str:
    fmha_columns = sorted({k for r in rows for k in r if k.startswith("fmha_")
                           and not k.endswith(("_error", "_us", "_copies"))},
                          key=lambda c: ("e4m3" in c, len(c), c))
    columns = ["fmha", *fmha_columns, "sdpa"]
    e4m3 = any("fmha_e4m3_us" in r for r in rows)
    widths = [max(13, len(c)) for c in columns]
    header = f"{'case':>34} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths)) + \
        f" {'fmha/copy':>9} {'fmha/sdpa':>9}" + (f" {'e4m3/copy':>9} {'e4m3 x':>7}" if e4m3
                                                  else "") + f" {'copies':>6}  sdpa backend"
    lines = [header]
    for r in rows:
        case = f"{r['dtype']} d{r['hdim']} h{r['heads']} b{r['batch']} L{r['cache_len']}"
        cells = " ".join(f"{r[c]:{w}.0f}" if isinstance(r.get(c), float) else f"{'-':>{w}}"
                         for c, w in zip(columns, widths))
        fmha_gbs = r.get("fmha")
        of_copy = f"{fmha_gbs / copy_gbs:9.2f}" if fmha_gbs else f"{'-':>9}"
        vs = f"{fmha_gbs / r['sdpa']:8.2f}x" if fmha_gbs and r.get("sdpa") else f"{'-':>9}"
        if e4m3:
            e4m3_gbs = r.get("fmha_e4m3")
            vs += f" {e4m3_gbs / copy_gbs:9.2f}" if e4m3_gbs else f" {'-':>9}"
            speed = (r["fmha_us"] / r["fmha_e4m3_us"]
                     if "fmha_us" in r and "fmha_e4m3_us" in r else None)
            vs += f" {speed:6.2f}x" if speed else f" {'-':>7}"
        lines.append(f"{case:>34} {cells} {of_copy} {vs} {r.get('cache_copies', 1):6d}"
                     f"  {r.get('sdpa_best', '-')}")
    return "\n".join(lines)
