"""Spike (issue 16, fourteenth session): does a decode CTA that reads every K/V head of its keys
(whole 2 KB rows of a (pages, 16, 8, 128) bf16 cache) read faster than one CTA a head (256-byte
rows at a 2 KB stride), on shuffled pages and in table order? The same Triton kernel runs both
ways (KV_HEADS heads a program: 1 or 8), each program one split of one sequence writing a
partial output and log-sum-exp, as fmha's split kernel does; the splits are combined in torch
only to check the result against a float64 reference. Timed as `python -m bench --decode`
times a step (CUDA graph replay; copies of the caches rotated past the L2), attention kernel
only, GB/s of K/V read. Not part of the library: evidence for the next decode tile.

    python docs/results/h100-issue16-s14/heads_per_cta_spike.py
"""

import math

import torch
import triton
import triton.language as tl

from fmha.timing import capture_graph, copies_beyond_l2, median_ms, rotating

HEADS, GROUP, D, PAGE = 8, 8, 128, 16


@triton.jit
def _decode_split(Q, K, V, TABLE, O, LSE, tiles_per_split, table_stride, page_stride, scale,
                  HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  D: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
                  KV_HEADS: tl.constexpr):
    split, head_block, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(0)
    heads = head_block * KV_HEADS + tl.arange(0, KV_HEADS)
    rows = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    q_rows = heads[:, None] * GROUP + rows[None, :]  # query heads, (KV_HEADS, GROUP_PAD)
    q_offsets = (batch * HEADS * GROUP + q_rows)[:, :, None] * D + d[None, None, :]
    q = tl.load(Q + q_offsets, mask=(rows < GROUP)[None, :, None], other=0.0)
    m = tl.full([KV_HEADS, GROUP_PAD], -float("inf"), tl.float32)
    l = tl.zeros([KV_HEADS, GROUP_PAD], tl.float32)
    acc = tl.zeros([KV_HEADS, GROUP_PAD, D], tl.float32)
    keys = tl.arange(0, TILE)
    for t in range(split * tiles_per_split, (split + 1) * tiles_per_split):
        pages = tl.load(TABLE + batch * table_stride + t * (TILE // PAGE) + keys // PAGE)
        row_offsets = pages.to(tl.int64) * page_stride + (keys % PAGE) * (HEADS * D)
        offsets = row_offsets[None, :, None] + (heads * D)[:, None, None] + d[None, None, :]
        k = tl.load(K + offsets)
        v = tl.load(V + offsets)
        s = tl.dot(q, tl.trans(k, (0, 2, 1))) * scale  # log2 units
        m_new = tl.maximum(m, tl.max(s, 2))
        p = tl.exp2(s - m_new[:, :, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out_rows = (batch * splits + split) * HEADS * GROUP + q_rows
    tl.store(O + out_rows[:, :, None] * D + d[None, None, :], acc / l[:, :, None],
             mask=(rows < GROUP)[None, :, None])
    tl.store(LSE + out_rows, m + tl.log2(l), mask=(rows < GROUP)[None, :])


def decode(q, k, v, table, splits, kv_heads, tile, o, lse):
    batch, pages_per_seq = table.shape
    tiles = pages_per_seq * PAGE // tile
    scale = D ** -0.5 * 1.4426950408889634
    _decode_split[(splits, HEADS // kv_heads, batch)](
        q, k, v, table, o, lse, tiles // splits, table.stride(0), k.stride(0), scale,
        HEADS=HEADS, GROUP=GROUP, GROUP_PAD=16, D=D, PAGE=PAGE, TILE=tile, KV_HEADS=kv_heads,
        num_warps=8 if kv_heads > 1 else 4, num_stages=3)


def combine(o, lse, batch, splits):
    o = o.view(batch, splits, HEADS * GROUP, D).double()
    lse = lse.view(batch, splits, HEADS * GROUP).double()
    w = torch.softmax(lse * math.log(2), dim=1)
    return (o * w[..., None]).sum(1)


def reference(q, k, v, table):
    batch, pages_per_seq = table.shape
    kk = k[table.long()].view(batch, pages_per_seq * PAGE, HEADS, D).double()
    vv = v[table.long()].view(batch, pages_per_seq * PAGE, HEADS, D).double()
    qq = q.view(batch, HEADS, GROUP, D).double()
    s = torch.einsum("bhgd,bkhd->bhgk", qq, kk) * D ** -0.5
    return torch.einsum("bhgk,bkhd->bhgd", torch.softmax(s, -1), vv).reshape(batch, -1, D)


def caches(batch, keys, shuffled):
    pages = batch * keys // PAGE
    k = torch.randn(pages, PAGE, HEADS, D, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(pages, device="cuda") if shuffled else torch.arange(pages, device="cuda")
    return k, torch.randn_like(k), order.view(batch, -1).to(torch.int32)


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    # Correctness on a small case, both ways.
    q = torch.randn(2, HEADS * GROUP, D, device="cuda", dtype=torch.bfloat16)
    k, v, table = caches(2, 1024, shuffled=True)
    want = reference(q, k, v, table)
    for kv_heads, tile, splits in ((1, 64, 4), (8, 16, 8)):
        o = torch.full((2 * splits * HEADS * GROUP, D), float("nan"), device="cuda")
        lse = torch.full((2 * splits * HEADS * GROUP,), float("nan"), device="cuda")
        decode(q, k, v, table, splits, kv_heads, tile, o, lse)
        err = (combine(o, lse, 2, splits) - want).abs().max().item()
        print(f"check: {kv_heads} K/V heads a program, {tile}-key tiles: max error {err:.2e}")
        assert err < 2e-2
    # (batch, keys, [(K/V heads a program, keys a tile, splits)])
    cases = [(8, 32768, [(1, 64, 2), (1, 64, 4), (8, 16, 16), (8, 16, 32), (8, 32, 16)]),
             (64, 8192, [(1, 64, 1), (1, 64, 2), (8, 16, 2), (8, 16, 4), (8, 32, 2)]),
             (1, 131072, [(1, 64, 16), (1, 64, 32), (8, 16, 128), (8, 16, 256), (8, 32, 128)])]
    print("batch x keys, pages (order): GB/s of the attention kernel for each "
          "(K/V heads a program, keys a tile, splits), medians")
    for batch, keys, configs in cases:
        nbytes = 2 * batch * keys * HEADS * D * 2
        q = torch.randn(batch, HEADS * GROUP, D, device="cuda", dtype=torch.bfloat16)
        for shuffled in (False, True):
            copies = copies_beyond_l2(nbytes)
            sets = [caches(batch, keys, shuffled) for _ in range(copies)]
            results = []
            for kv_heads, tile, splits in configs:
                o = torch.empty(batch * splits * HEADS * GROUP, D, device="cuda")
                lse = torch.empty(batch * splits * HEADS * GROUP, device="cuda")
                calls = [lambda k=k, v=v, t=t: decode(q, k, v, t, splits, kv_heads, tile, o, lse)
                         for k, v, t in sets]
                count = copies * math.ceil(20 / copies)
                graph = capture_graph(rotating(calls), count)
                ms = median_ms(graph.replay, 100, 400) / count
                results.append(f"({kv_heads},{tile},{splits}) {nbytes / ms * 1e-6:5.0f}")
            order = "shuffled" if shuffled else "in order"
            print(f"{batch} x {keys}, pages of {PAGE} ({order}): " + "  ".join(results),
                  flush=True)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
