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
The bar chunked prefill was built to: paged within 10% of fwd (paged / fwd >= 0.90).
"""

import torch

import fmha
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


def _decode_instance(dtype_token, d, paged):
    """The name of a decode (non-prefill) causal instance for these traits, if built."""
    for inst in fmha.kvcache_instances():
        if (not inst.get("prefill") and inst["dtype"] == dtype_token and inst["hdim_q"] == d
                and inst["mask"] == "causal" and inst["paged"] == paged
                and inst["bias"] == "none" and not inst["softcap"]):
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
    calls = {"fwd": lambda: fmha.fwd(q, k, v, causal=True, mask_align="bottom_right"),
             "kvcache": lambda: fmha.fwd_kvcache(q, k, v, cache_seqlens=full, causal=True)}
    k_new, v_new = k[:, context - chunk:].contiguous(), v[:, context - chunk:].contiguous()
    for page_size in args.pages:
        if not page_size or context % page_size:
            continue
        k_pages, v_pages, table = paged_copy(k, v, page_size, gen)
        calls[f"paged{page_size}"] = (
            lambda kp=k_pages, vp=v_pages, t=table: fmha.fwd_kvcache(
                q, kp, vp, cache_seqlens=full, block_table=t, causal=True))
        # The append writes the same keys again over themselves: the cache stays valid.
        calls[f"append{page_size}"] = (
            lambda kp=k_pages, vp=v_pages, t=table: fmha.fwd_kvcache(
                q, kp, vp, k_new, v_new, cache_seqlens=before, block_table=t, causal=True))
        decode = _decode_instance(dtype_token, d, paged=True)
        if decode is not None and page_size == args.pages[0]:
            calls[f"decode{page_size}"] = (
                lambda kp=k_pages, vp=v_pages, t=table, name=decode: fmha.fwd_kvcache(
                    q, kp, vp, cache_seqlens=full, block_table=t, causal=True, instance=name))
    for name, call in list(calls.items()):
        try:
            call()
        except ValueError as err:  # not in this build
            row[f"{name}_error"] = str(err).splitlines()[0]
            del calls[name]
    if "kvcache" in calls:
        row["instance"] = fmha.select_kvcache(q, k, v, cache_seqlens=full, causal=True)["name"]
    medians = interleaved_medians(calls, args.warmup_ms, args.repeat_ms, args.rounds)
    flops = 4 * d * visible_pairs(chunk, context) * nhead_q * batch
    for name, ms in medians.items():
        row[name] = flops / ms * 1e-9  # TFLOP/s
    return row


def format_rows(rows) -> str:
    columns = []  # every timed column, in the order the rows measured them
    for r in rows:
        columns += [k for k, v in r.items() if isinstance(v, float) and k not in columns]
    header = f"{'case':>36} " + " ".join(f"{c:>10}" for c in columns) + \
        f" {'kvc/fwd':>8} {'paged/fwd':>9}"
    lines = [header]
    for r in rows:
        case = (f"{r['dtype']} d{r['hdim']} h{r['heads']} b{r['batch']} "
                f"C{r['chunk']} L{r['context']}")
        cells = " ".join(f"{r[c]:10.1f}" if isinstance(r.get(c), float) else f"{'-':>10}"
                         for c in columns)
        fwd = r.get("fwd")
        paged = [v for k, v in r.items() if k.startswith("paged") and isinstance(v, float)]
        kvc = f"{r['kvcache'] / fwd:.2f}" if fwd and "kvcache" in r else "-"
        worst = f"{min(paged) / fwd:.2f}" if fwd and paged else "-"
        lines.append(f"{case:>36} {cells} {kvc:>8} {worst:>9}")
    return "\n".join(lines)
