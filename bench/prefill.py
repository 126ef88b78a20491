"""python -m bench --prefill: chunked prefill (a chunk of new query tokens against a KV cache
that holds the sequence's earlier keys and the chunk's own) of fmha.fwd_kvcache, against
fmha.fwd on the same shapes with the keys in a contiguous tensor.

Each row is one chunk of --chunks tokens whose sequence reaches --contexts keys with it, causal
(bottom-right: query token i sees the keys up to context - chunk + i), bf16 by default, --gqa
query heads per K/V head. TFLOP/s count the visible pairs, 4 * hdim FLOPs each (QK^T and PV).
Columns, all timed eagerly (a chunk is hundreds of microseconds of GPU time), interleaved:
  fwd          fmha.fwd(q, k, v, causal, mask_align="bottom_right") on contiguous (b, L, h_k, d)
  kvcache      fmha.fwd_kvcache on a contiguous cache already holding the chunk's keys
  paged{P}     the same on a paged cache of P-key pages in shuffled order
  append{P}    paged, with the chunk's k/v appended by the call (the serving loop's real call)
  decode{P}    the decode instance forced on the paged cache, where one is built: what the
               dispatcher's prefill threshold (a tile of query tokens) saves
With --kv-dtypes same,e4m3 (default: same) the same calls also run on float8 e4m3 caches of
the same shapes, with per-K/V-head scales (bench/decode.py's make_cache and e4m3_scales; their
codes are random, not the 16-bit caches' keys), in the same interleaved rounds: e4m3_kvcache,
e4m3_paged{P}, e4m3_append{P} (the chunk quantized as it is appended) and e4m3_decode{P} (an
e4m3 decode instance forced, where one is built); `--kv-dtypes e4m3` alone leaves out the
16-bit cache's columns. fmha runs chunks from an e4m3 cache on the chunked-prefill kernel where
the build has its instance (H100/H200, head dims 64 and 128: the cache widened to fp16 in
shared memory), else on the decode kernel; the row's e4m3_instance names the one it ran.
The bar chunked prefill was built to: paged within 10% of fwd (paged / fwd >= 0.90). Beside it
with e4m3 caches: e4m3/same, the e4m3 cache's TFLOP/s over the 16-bit cache's on the same
layout (the worst layout), and e4m3/dec, e4m3 chunked prefill over the e4m3 decode instance on
pages of the first --pages size.
"""

import torch

import fmha
from bench.decode import e4m3_scales, make_cache
from fmha.timing import interleaved_medians


def visible_pairs(chunk: int, context: int) -> int:
    """(query, key) pairs a bottom-right causal chunk sees: token i sees context - chunk + i + 1
    keys."""
    return chunk * (context - chunk) + chunk * (chunk + 1) // 2


def paged_copy(k, v, page_size, gen, ordered=False):
    """k, v (b, L, h, d) as pages of page_size keys in shuffled order, with the block table;
    `ordered`: in table order (the same addresses as k and v, read page by page)."""
    b, length = k.shape[:2]
    pages = length // page_size
    order = (torch.arange(b * pages, device="cuda") if ordered
             else torch.randperm(b * pages, device="cuda", generator=gen))
    k_pages = torch.empty(b * pages, page_size, *k.shape[2:], device="cuda", dtype=k.dtype)
    v_pages = torch.empty_like(k_pages)
    k_pages[order] = k.reshape(b * pages, page_size, *k.shape[2:])
    v_pages[order] = v.reshape(b * pages, page_size, *v.shape[2:])
    return k_pages, v_pages, order.view(b, pages).to(torch.int32)


def _decode_instance(dtype_token, d, paged, kv_dtype="same"):
    """The name of a decode (non-prefill) causal instance for these traits and cache dtype, if
    built."""
    for inst in fmha.kvcache_instances():
        if (not inst.get("prefill") and inst["dtype"] == dtype_token and inst["hdim_q"] == d
                and inst["kv_dtype"] == kv_dtype and inst["mask"] == "causal"
                and inst["paged"] == paged and inst["bias"] == "none" and not inst["softcap"]):
            return inst["name"]
    return None


def run_prefill_case(dtype, d, nhead_q, nhead_k, batch, chunk, context, args):
    dtype_token = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace(
        "float16", "fp16")
    row = {"dtype": dtype_token, "hdim": d, "heads": f"{nhead_q}/{nhead_k}", "batch": batch,
           "chunk": chunk, "context": context}
    gen = torch.Generator(device="cuda").manual_seed(chunk * 7 + context)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    q = randn(batch, chunk, nhead_q, d)
    k, v = randn(batch, context, nhead_k, d), randn(batch, context, nhead_k, d)
    full = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    before = full - chunk
    calls = {"fwd": lambda: fmha.fwd(q, k, v, causal=True, mask_align="bottom_right")}
    k_new, v_new = k[:, context - chunk:].contiguous(), v[:, context - chunk:].contiguous()
    page_sizes = [p for p in args.pages if p and not context % p]
    kv_dtypes = getattr(args, "kv_dtypes", ["same"])
    if "same" in kv_dtypes:
        calls["kvcache"] = lambda: fmha.fwd_kvcache(q, k, v, cache_seqlens=full, causal=True)
        decode = _decode_instance(dtype_token, d, paged=True)
        for page_size in page_sizes:
            k_pages, v_pages, table = paged_copy(k, v, page_size, gen)
            _cache_calls(calls, "", q, k_pages, v_pages, table, page_size, full, before,
                         k_new, v_new, decode, args, {})
    contiguous_e4m3 = None
    if "e4m3" in kv_dtypes:
        # Caches of random codes (bench/decode.py's), not k's and v's: the same work and bytes.
        scales = e4m3_scales(nhead_k)
        contiguous_e4m3 = make_cache(batch, context, nhead_k, d, torch.float8_e4m3fn, 0)[:2]
        calls["e4m3_kvcache"] = lambda: fmha.fwd_kvcache(
            q, *contiguous_e4m3, cache_seqlens=full, causal=True, **scales)
        decode = _decode_instance(dtype_token, d, paged=True, kv_dtype="e4m3")
        for page_size in page_sizes:
            k_pages, v_pages, table = make_cache(batch, context, nhead_k, d, torch.float8_e4m3fn,
                                                 page_size)
            _cache_calls(calls, "e4m3_", q, k_pages, v_pages, table, page_size, full, before,
                         k_new, v_new, decode, args, scales)
    for name, call in list(calls.items()):
        try:
            call()
        except ValueError as err:  # not in this build
            row[f"{name}_error"] = str(err).splitlines()[0]
            del calls[name]
    if "kvcache" in calls:
        row["instance"] = fmha.select_kvcache(q, k, v, cache_seqlens=full, causal=True)["name"]
    if "e4m3_kvcache" in calls:
        row["e4m3_instance"] = fmha.select_kvcache(q, *contiguous_e4m3, cache_seqlens=full,
                                                   causal=True, **scales)["name"]
    medians = interleaved_medians(calls, args.warmup_ms, args.repeat_ms, args.rounds)
    flops = 4 * d * visible_pairs(chunk, context) * nhead_q * batch
    for name, ms in medians.items():
        row[name] = flops / ms * 1e-9  # TFLOP/s
    return row


def _cache_calls(calls, prefix, q, k_pages, v_pages, table, page_size, full, before, k_new, v_new,
                 decode, args, scales):
    """The paged cache's calls of one cache dtype (`prefix` "" or "e4m3_", `scales` its k_scale
    and v_scale): paged{P}, append{P} (the chunk's k/v appended over the rows that hold it,
    the same keys again or their e4m3 codes: the cache stays valid), and decode{P} on the first
    page size where a decode instance `decode` is built."""
    calls[f"{prefix}paged{page_size}"] = (
        lambda: fmha.fwd_kvcache(q, k_pages, v_pages, cache_seqlens=full, block_table=table,
                                 causal=True, **scales))
    calls[f"{prefix}append{page_size}"] = (
        lambda: fmha.fwd_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=before,
                                 block_table=table, causal=True, **scales))
    if decode is not None and page_size == args.pages[0]:
        calls[f"{prefix}decode{page_size}"] = (
            lambda: fmha.fwd_kvcache(q, k_pages, v_pages, cache_seqlens=full, block_table=table,
                                     causal=True, instance=decode, **scales))


def _e4m3_ratios(r) -> tuple:
    """(e4m3/same, e4m3/dec) of a row, None where it lacks the columns: the worst over layouts
    of the e4m3 cache's TFLOP/s over the 16-bit cache's, and the e4m3 paged cache's over the
    e4m3 decode instance's on the same pages."""
    same = [r[f"e4m3_{c}"] / r[c] for c in r
            if not c.startswith(("e4m3_", "fwd", "decode")) and isinstance(r[c], float)
            and isinstance(r.get(f"e4m3_{c}"), float)]
    dec = [r[c.replace("decode", "paged")] / r[c] for c in r
           if c.startswith("e4m3_decode") and isinstance(r[c], float)
           and isinstance(r.get(c.replace("decode", "paged")), float)]
    return (min(same) if same else None), (dec[0] if dec else None)


def format_rows(rows) -> str:
    columns = []  # every timed column, in the order the rows measured them
    for r in rows:
        columns += [k for k, v in r.items() if isinstance(v, float) and k not in columns]
    widths = [max(10, len(c)) for c in columns]
    e4m3 = any(c.startswith("e4m3_") for c in columns)
    header = f"{'case':>36} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths)) + \
        f" {'kvc/fwd':>8} {'paged/fwd':>9}" + (f" {'e4m3/same':>9} {'e4m3/dec':>8}" if e4m3
                                                 else "")
    lines = [header]
    for r in rows:
        case = (f"{r['dtype']} d{r['hdim']} h{r['heads']} b{r['batch']} "
                f"C{r['chunk']} L{r['context']}")
        cells = " ".join(f"{r[c]:{w}.1f}" if isinstance(r.get(c), float) else f"{'-':>{w}}"
                         for c, w in zip(columns, widths))
        fwd = r.get("fwd")
        paged = [v for k, v in r.items() if k.startswith("paged") and isinstance(v, float)]
        kvc = f"{r['kvcache'] / fwd:.2f}" if fwd and "kvcache" in r else "-"
        worst = f"{min(paged) / fwd:.2f}" if fwd and paged else "-"
        line = f"{case:>36} {cells} {kvc:>8} {worst:>9}"
        if e4m3:
            same, dec = _e4m3_ratios(r)
            line += (f" {f'{same:.2f}' if same else '-':>9}"
                     f" {f'{dec:.2f}x' if dec else '-':>8}")
        lines.append(line)
    return "\n".join(lines)
