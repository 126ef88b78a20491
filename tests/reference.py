"""The float64 reference of fmha.fwd and fmha.bwd, the dropout pattern, and the problem builder
of the GPU tests.

Nothing here imports fmha: the reference is plain torch, so its own tests (test_reference.py)
run on a CPU, and the GPU tests compare the kernels against it.

- attention_reference(): the forward pass with every feature of fmha.fwd (masks and their
  alignment, windows, elementwise bias / SDPA attn_mask, ALiBi, soft-capping, dropout given the
  keep pattern, GQA, batch mode with seqused, group (varlen) mode with physical padding),
  computed in float64 (the truth) or in the input precision (the yardstick of the pass rule).
- attention_grads(): the backward pass, torch.autograd.grad of attention_reference() in either
  precision (dq, dk, dv, and the gradient of an elementwise bias summed over its broadcast
  dimensions).
- philox4x32_10() and dropout_keep_mask(): runtime/include/fmha/kernels/philox.cuh in torch,
  the uint8 (batch, nhead, seqlen_q, seqlen_k) keep tensor fmha.dropout_mask writes.
- Spec, make_inputs() and compare(): a problem described in a few fields, its tensors (with
  NaN poison where a kernel must not look), and the pass rule of the GPU tests; check_fwd() and
  check_bwd() run one problem through fmha and apply it.
- The e4m3 (FP8) forward: fwd_reference_e4m3() (the float64 truth on the dequantized inputs
  and the quantizing reference, P rounded to e4m3 as the kernel rounds it), round_e4m3(), the
  descales (to_e4m3, dequantize_e4m3), the accuracy study's input kinds (study_inputs:
  FlashAttention-3's outliers, outlier channels, attention sinks), and E4m3Case,
  make_e4m3_inputs(), compare_e4m3() and check_fwd_e4m3(): the cases and the pass rule of
  tests/test_fwd_e4m3_gpu.py.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

# ---------------------------------------------------------------------------------------------
# Philox4x32-10 and the keep rule of philox.cuh.
# ---------------------------------------------------------------------------------------------

MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * b, for a < 2^32 and int64 b < 2^32.

    b is split into 16-bit halves so that no intermediate leaves int64's positive range.
    """
    p_lo = a * (b & 0xFFFF)  # < 2^48
    p_hi = a * (b >> 16)  # < 2^48
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49
    return (p_hi >> 16) + (t >> 32), t & MASK32


def philox4x32_10(counter: Sequence, key: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Philox4x32 with 10 rounds: four int64 tensors holding 32-bit words.

    counter: four ints or int64 tensors (broadcast together), key: two ints.
    """
    device = next((x.device for x in counter if isinstance(x, torch.Tensor)), None)
    c = [torch.as_tensor(x, dtype=torch.int64, device=device) & MASK32 for x in counter]
    c0, c1, c2, c3 = torch.broadcast_tensors(*c)
    k0, k1 = int(key[0]) & MASK32, int(key[1]) & MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def dropout_threshold(dropout_p: float) -> int:
    """philox.cuh's drop_threshold: min(floor(p * 2^32), 2^32 - 1), p rounded to float32 first
    (the C++ API takes a float)."""
    p32 = torch.tensor(dropout_p, dtype=torch.float32).item()
    scaled = p32 * 4294967296.0
    return MASK32 if scaled >= 4294967295.0 else int(scaled)


def dropout_keep_mask(seed: int, offset: int, dropout_p: float, batch: int, nhead: int,
                      seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """The keep pattern of (seed, offset, p): uint8 (batch, nhead, seqlen_q, seqlen_k), 1 = kept.

    One Philox call (key = (seed lo, seed hi)) per rows (i, i + 8) of a 16-row block and keys
    (j, j + 1), j even: counter = (j / 2, (i / 16) * 8 + i % 8, batch * nhead + head, offset);
    word 2 * ((i / 8) % 2) + j % 2 decides (i, j), kept when >= threshold.
    """
    row_blocks = (seqlen_q + 15) // 16
    key_pairs = (seqlen_k + 1) // 2
    bh = torch.arange(batch * nhead, device=device, dtype=torch.int64).view(-1, 1, 1, 1)
    block = torch.arange(row_blocks, device=device, dtype=torch.int64).view(1, -1, 1, 1)
    row = torch.arange(8, device=device, dtype=torch.int64).view(1, 1, -1, 1)
    pair = torch.arange(key_pairs, device=device, dtype=torch.int64).view(1, 1, 1, -1)
    seed = int(seed)
    words = philox4x32_10((pair, block * 8 + row, bh, int(offset)),
                          (seed & MASK32, (seed >> 32) & MASK32))
    # (bh, block, row, pair, 4) with word 2 * half + key % 2 -> rows block*16 + half*8 + row.
    w = torch.stack(words, dim=-1).view(batch * nhead, row_blocks, 8, key_pairs, 2, 2)
    w = w.permute(0, 1, 4, 2, 3, 5).reshape(batch * nhead, row_blocks * 16, key_pairs * 2)
    keep = (w[:, :seqlen_q, :seqlen_k] >= dropout_threshold(dropout_p)).to(torch.uint8)
    return keep.reshape(batch, nhead, seqlen_q, seqlen_k)


# ---------------------------------------------------------------------------------------------
# The attention reference.
# ---------------------------------------------------------------------------------------------

ALIGNS = ("top_left", "bottom_right")


def window_bounds(causal: bool, window_size) -> tuple[int, int]:
    """(left, right) key bounds relative to the aligned diagonal; -1 is unbounded.

    causal alone is (-1, 0); causal with a window keeps its left size and clamps right to 0.
    """
    left, right = (-1, -1) if window_size is None else window_size
    left = -1 if left is None or left < 0 else int(left)
    right = -1 if right is None or right < 0 else int(right)
    if causal:
        right = 0
    return left, right


def visible(seqlen_q: int, seqlen_k: int, left: int, right: int, mask_align: str,
            device=None) -> torch.Tensor:
    """bool (seqlen_q, seqlen_k): row i sees key j iff i+off-left <= j <= i+off+right."""
    if mask_align not in ALIGNS:
        raise ValueError(f"mask_align must be one of {ALIGNS}, got {mask_align!r}")
    off = 0 if mask_align == "top_left" else seqlen_k - seqlen_q
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        vis &= j >= i + off - left
    if right >= 0:
        vis &= j <= i + off + right
    return vis


def _attend(q, k, v, *, scale, softcap, bias, slopes, left, right, mask_align, keep, dropout_p,
            compute_dtype, weights=None):
    """One batch of sequences of equal lengths.

    q (B, sq, hq, d), k (B, sk, hk, d), v (B, sk, hk, dv); bias (B, hq, sq, sk) or None;
    slopes (B, hq) or None; keep (B, hq, sq, sk) or None. Returns out (B, sq, hq, dv) in
    compute_dtype and lse (B, hq, sq) in float64 (float32 for a low-precision compute_dtype).
    weights(s, lse): the (B, hq, sq, sk) weights of V's rows given the masked logits and their
    log-sum-exp, instead of the probabilities exp(s - lse) (the e4m3 reference's rounded P).
    """
    B, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
    qh = q.permute(0, 2, 1, 3).to(compute_dtype)
    kh = k.permute(0, 2, 1, 3).to(compute_dtype).repeat_interleave(hq // hk, dim=1)
    vh = v.permute(0, 2, 1, 3).to(compute_dtype).repeat_interleave(hq // hk, dim=1)
    # In low precision S = QK^T is rounded to the input dtype (as a PyTorch matmul returns it);
    # everything after it is fp32 up to P, which is rounded again before P @ V.
    s = (qh @ kh.transpose(-1, -2)).to(acc) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(acc)
    off = 0 if mask_align == "top_left" else sk - sq
    i = torch.arange(sq, device=q.device).view(-1, 1)
    j = torch.arange(sk, device=q.device).view(1, -1)
    if slopes is not None:
        s = s - slopes.to(acc).view(B, hq, 1, 1) * (i + off - j).abs().to(acc)
    s = s.masked_fill(~visible(sq, sk, left, right, mask_align, device=q.device), float("-inf"))
    # lse is -inf where a row sees nothing (also for sk == 0). Such a row's logits go into
    # logsumexp as zeros: its value is replaced anyway, and logsumexp's gradient at a row of
    # -inf is NaN (exp(-inf - -inf)), which would reach q and k where a bias empties the row.
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty.squeeze(-1),
                                                                        float("-inf"))
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    if weights is not None:
        p = weights(s, lse)
    else:
        p = torch.exp(s - safe.unsqueeze(-1))  # rows of only -inf: exp(-inf) = 0, output 0
    if keep is not None:
        p = p * keep.to(acc) / (1.0 - dropout_p)
    out = p.to(compute_dtype) @ vh
    return out.permute(0, 2, 1, 3), lse


def as_bias(bias: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor], dtype):
    """The additive bias of a call: `bias`, or SDPA's attn_mask (bool: True attends -> 0, False
    -> -inf, in the input dtype; float: a bias), left-padded to 4 dims."""
    if bias is not None and attn_mask is not None:
        raise ValueError("pass bias or attn_mask, not both")
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)
            bias = bias.masked_fill(~attn_mask, float("-inf"))
        else:
            bias = attn_mask
    if bias is None:
        return None
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias


def _as_list(x, n, default):
    if x is None:
        return [default] * n if not isinstance(default, list) else default
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    return [int(e) for e in x]


def attention_reference(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                        mask_align="top_left", bias=None, attn_mask=None, alibi_slopes=None,
                        softcap=0.0, dropout_p=0.0, dropout_keep=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                        seqused_k=None, compute_dtype=torch.float64, weights=None):
    """fmha.fwd's semantics in plain torch: returns (out, lse).

    Batch mode: q (b, sq, hq, d), k (b, sk, hk, d), v (b, sk, hk, dv) -> out (b, sq, hq, dv),
    lse (b, hq, sq). Group mode (cu_seqlens_q/k given): q (total_q, hq, d) ... -> out
    (total_q, hq, dv), lse (hq, total_q). Rows the kernel leaves untouched (past seqused_q, or
    outside every sequence) are NaN in both, so `~out.isnan()` marks what to compare.

    logits = softmax_scale * q.k, then softcap * tanh(logits / softcap), then + bias (or
    attn_mask) and ALiBi (-slope * |i + off - j|), then the mask; lse is of those logits (natural
    log, -inf for rows that see no key, whose output is 0). With dropout_p > 0, dropout_keep is
    the (b, hq, >= sq, >= sk) keep pattern (fmha.dropout_mask's), indexed by the sequence's
    local (i, j): out = (P * keep / (1 - p)) @ V. The mask offset is 0 for top_left and
    seqlen_k - seqlen_q for bottom_right, with the lengths the sequence really uses.

    compute_dtype float64 gives the truth; the input dtype gives the same attention in the input
    precision (S and P rounded to it, softmax in fp32), the yardstick of the pass rule.
    weights: _attend's hook, called once per sequence (group mode, seqused) or per batch: the
    weights of V's rows in place of the probabilities (fwd_reference_e4m3's rounded P).
    """
    if dropout_p > 0 and dropout_keep is None:
        raise ValueError("dropout_p > 0 needs dropout_keep (fmha.dropout_mask's pattern)")
    keep = dropout_keep if dropout_p > 0 else None
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    left, right = window_bounds(causal, window_size)
    bias4 = as_bias(bias, attn_mask, q.dtype)
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes.unsqueeze(0)
    common = dict(scale=scale, softcap=float(softcap), left=left, right=right,
                  mask_align=mask_align, dropout_p=float(dropout_p), compute_dtype=compute_dtype,
                  weights=weights)
    group = cu_seqlens_q is not None
    if group != (cu_seqlens_k is not None):
        raise ValueError("group mode needs both cu_seqlens_q and cu_seqlens_k")

    if not group:
        B, sq, hq, _ = q.shape
        sk = k.shape[1]
        dv = v.shape[-1]
        if bias4 is not None:
            bias4 = bias4.expand(B, hq, sq, sk)
        if slopes is not None:
            slopes = slopes.expand(B, hq)
        if seqused_q is None and seqused_k is None:
            kp = keep[:, :, :sq, :sk] if keep is not None else None
            out, lse = _attend(q, k, v, bias=bias4, slopes=slopes, keep=kp, **common)
            return out, lse
        used_q = _as_list(seqused_q, B, sq)
        used_k = _as_list(seqused_k, B, sk)
        out = torch.full((B, sq, hq, dv), float("nan"), dtype=compute_dtype, device=q.device)
        lse = torch.full((B, hq, sq), float("nan"), dtype=acc, device=q.device)
        for b in range(B):
            uq, uk = used_q[b], used_k[b]
            o, l = _attend(
                q[b:b + 1, :uq], k[b:b + 1, :uk], v[b:b + 1, :uk],
                bias=None if bias4 is None else bias4[b:b + 1, :, :uq, :uk],
                slopes=None if slopes is None else slopes[b:b + 1],
                keep=None if keep is None else keep[b:b + 1, :, :uq, :uk], **common)
            out[b, :uq] = o[0]
            lse[b, :, :uq] = l[0]
        return out, lse

    cu_q = _as_list(cu_seqlens_q, 0, 0)
    cu_k = _as_list(cu_seqlens_k, 0, 0)
    B = len(cu_q) - 1
    hq, dv = q.shape[1], v.shape[-1]
    phys_q = [cu_q[b + 1] - cu_q[b] for b in range(B)]
    phys_k = [cu_k[b + 1] - cu_k[b] for b in range(B)]
    used_q = _as_list(seqused_q, B, phys_q)
    used_k = _as_list(seqused_k, B, phys_k)
    if bias4 is not None:
        mq = max_seqlen_q if max_seqlen_q is not None else max(phys_q, default=0)
        mk = max_seqlen_k if max_seqlen_k is not None else max(phys_k, default=0)
        bias4 = bias4.expand(B, hq, mq, mk)
    if slopes is not None:
        slopes = slopes.expand(B, hq)
    out = torch.full((q.shape[0], hq, dv), float("nan"), dtype=compute_dtype, device=q.device)
    lse = torch.full((hq, q.shape[0]), float("nan"), dtype=acc, device=q.device)
    for b in range(B):
        uq, uk = used_q[b], used_k[b]
        q0, k0 = cu_q[b], cu_k[b]
        o, l = _attend(
            q[q0:q0 + uq].unsqueeze(0), k[k0:k0 + uk].unsqueeze(0), v[k0:k0 + uk].unsqueeze(0),
            bias=None if bias4 is None else bias4[b:b + 1, :, :uq, :uk],
            slopes=None if slopes is None else slopes[b:b + 1],
            keep=None if keep is None else keep[b:b + 1, :, :uq, :uk], **common)
        out[q0:q0 + uq] = o[0]
        lse[:, q0:q0 + uq] = l[0]
    return out, lse


# ---------------------------------------------------------------------------------------------
# The KV-cache reference (fmha.fwd_kvcache).
# ---------------------------------------------------------------------------------------------

def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, d) rotated at positions (batch, seqlen) by the rows of cos and
    sin (seqlen_rotary, rotary_dim / 2): pairs (2j, 2j + 1) when interleaved (GPT-J), else
    (j, j + rotary_dim / 2) (GPT-NeoX); dims past rotary_dim pass through. Computed in float64
    and rounded once to x's dtype, as the kernel rounds its fp32 result once."""
    half = cos.shape[1]
    c = cos[positions].unsqueeze(2).double()  # (batch, seqlen, 1, half)
    s_ = sin[positions].unsqueeze(2).double()
    dtype, x = x.dtype, x.double()
    out = x.clone()
    if interleaved:
        first, second = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = first * c - second * s_
        out[..., 1:2 * half:2] = second * c + first * s_
    else:
        first, second = x[..., :half], x[..., half:2 * half]
        out[..., :half] = first * c - second * s_
        out[..., half:2 * half] = second * c + first * s_
    return out.to(dtype)


def gather_cache(cache: torch.Tensor, batch: int, *, block_table=None,
                 cache_batch_idx=None) -> torch.Tensor:
    """The (batch, seqlen_cache, heads, d) view of each sequence's cache: its pages in
    block_table's order, or its row cache_batch_idx[b] (b without it)."""
    if block_table is not None:
        pages = cache[block_table.long()]  # (batch, pages, page_size, heads, d)
        return pages.reshape(batch, -1, *cache.shape[2:])
    rows = torch.arange(batch) if cache_batch_idx is None else cache_batch_idx.long().cpu()
    return cache[rows.to(cache.device)]


def rotated_for_append(q, k, lengths, capacity, rotary_cos, rotary_sin, interleaved, causal,
                       window_size):
    """(q, k) of a call that appends k, rotated as fmha.fwd_kvcache rotates them (unchanged
    without rotary tables): new token i of sequence b at cache_seqlens[b] + i, query token i
    there too under a mask and at cache_seqlens[b] without one."""
    if rotary_cos is None:
        return q, k
    batch, seqlen_q = q.shape[:2]
    positions = (lengths[:, None] + torch.arange(k.shape[1])).clamp(max=capacity - 1)
    k = rotary(k, rotary_cos, rotary_sin, positions.to(k.device), interleaved)
    masked = causal or tuple(window_size) != (-1, -1)
    q_positions = lengths[:, None] + (torch.arange(seqlen_q) if masked else 0)
    q = rotary(q, rotary_cos, rotary_sin, q_positions.expand(batch, seqlen_q).to(q.device),
               interleaved)
    return q, k


def kvcache_reference(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                      cache_batch_idx=None, cache_leftpad=None, rotary_cos=None, rotary_sin=None,
                      rotary_interleaved=False, causal=False, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, softmax_scale=None,
                      compute_dtype=torch.float64):
    """fmha.fwd_kvcache's semantics in plain torch: returns (out, lse, k_cache, v_cache), the
    caches as the call leaves them (new k rotated in the input dtype, then written). Attention
    is attention_reference() over each sequence's first cache_seqlens[b] + seqlen_new keys
    (from key cache_leftpad[b] on when given), aligned bottom-right, with q rotated at
    cache_seqlens + i under a mask and at cache_seqlens without one; compute_dtype as there."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch = q.shape[0]
    lengths = cache_seqlens.long().cpu()
    seqlen_new = 0 if k is None else k.shape[1]
    keys = gather_cache(k_cache, batch, block_table=block_table, cache_batch_idx=cache_batch_idx)
    values = gather_cache(v_cache, batch, block_table=block_table,
                          cache_batch_idx=cache_batch_idx)
    capacity = keys.shape[1]
    if k is not None:
        q, k = rotated_for_append(q, k, lengths, capacity, rotary_cos, rotary_sin,
                                  rotary_interleaved, causal, window_size)
        for b in range(batch):
            n = max(0, min(seqlen_new, capacity - int(lengths[b])))
            keys[b, lengths[b]:lengths[b] + n] = k[b, :n]
            values[b, lengths[b]:lengths[b] + n] = v[b, :n]
        # Write the appended rows back where the call writes them.
        if block_table is not None:
            page_size = k_cache.shape[1]
            for b in range(batch):
                n = max(0, min(seqlen_new, capacity - int(lengths[b])))
                for t in range(int(lengths[b]), int(lengths[b]) + n):
                    page = int(block_table[b, t // page_size])
                    k_cache[page, t % page_size] = keys[b, t]
                    v_cache[page, t % page_size] = values[b, t]
        else:
            rows = torch.arange(batch) if cache_batch_idx is None else cache_batch_idx.long().cpu()
            for b in range(batch):
                k_cache[int(rows[b])] = keys[b]
                v_cache[int(rows[b])] = values[b]
    used = (lengths + seqlen_new).clamp(max=capacity)
    if cache_leftpad is not None:
        # Sequence b's keys from its start on, the padding before it moved past its end.
        starts = torch.minimum(cache_leftpad.long().cpu().clamp(min=0), used)
        keys = torch.stack([keys[b].roll(-int(s), dims=0) for b, s in enumerate(starts)])
        values = torch.stack([values[b].roll(-int(s), dims=0) for b, s in enumerate(starts)])
        used = used - starts
    out, lse = attention_reference(
        q, keys, values, causal=causal, window_size=window_size, mask_align="bottom_right",
        alibi_slopes=alibi_slopes, softcap=softcap, softmax_scale=softmax_scale,
        seqused_k=used.to(q.device), compute_dtype=compute_dtype)
    return out, lse, k_cache, v_cache


# An e4m3 KV cache (KvCacheDtype::kE4M3): elements of torch.float8_e4m3fn, a key being
# k_cache[..] * k_scale[b, h] for sequence b and K/V head h.
E4M3_MAX = 448.0


def e4m3_scales(scale: torch.Tensor, batch: int, nhead_k: int) -> torch.Tensor:
    """A k_scale/v_scale as fmha.fwd_kvcache takes it (shape (), (1,), (nhead_k,) or
    (batch, nhead_k)) as the (batch, nhead_k) float32 table it stands for."""
    scale = scale.float()
    return scale if scale.dim() == 2 else scale.reshape(1, -1).expand(batch, nhead_k)


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (batch, seqlen, nhead_k, d) as an e4m3 cache stores it with (batch, nhead_k) scales:
    divided in float32, saturated to +-448, rounded to nearest even (the append kernel's
    arithmetic, e4m3_cache.cuh)."""
    quotient = x.float() / scale[:, None, :, None].float()
    return quotient.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def kvcache_reference_e4m3(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, k_scale,
                           v_scale, block_table=None, cache_batch_idx=None, rotary_cos=None,
                           rotary_sin=None, rotary_interleaved=False, causal=False,
                           window_size=(-1, -1), compute_dtype=torch.float64, **kwargs):
    """kvcache_reference() of e4m3 caches (k_scale, v_scale as fmha.fwd_kvcache takes them):
    returns (out, lse, k_cache, v_cache), the caches as e4m3 tensors as the call leaves them
    (k rotated in the input dtype, then quantized with its sequence's and head's scale). The
    attention is kvcache_reference()'s over the dequantized caches in compute_dtype: the
    float64 truth, or the yardstick of the input precision (dequantized keys rounded to it)."""
    batch, nhead_k = q.shape[0], k_cache.shape[2]
    k_scales = e4m3_scales(k_scale, batch, nhead_k).cpu()
    v_scales = e4m3_scales(v_scale, batch, nhead_k).cpu()
    lengths = cache_seqlens.long().cpu()
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    appended = 0
    if k is not None:
        q, k = rotated_for_append(q, k, lengths, capacity, rotary_cos, rotary_sin,
                                  rotary_interleaved, causal, window_size)
        k8 = quantize_e4m3(k, k_scales.to(k.device))
        v8 = quantize_e4m3(v, v_scales.to(v.device))
        rows = torch.arange(batch) if cache_batch_idx is None else cache_batch_idx.long().cpu()
        for b in range(batch):
            n = max(0, min(k.shape[1], capacity - int(lengths[b])))
            for t in range(int(lengths[b]), int(lengths[b]) + n):
                if block_table is not None:
                    at = (int(block_table[b, t // k_cache.shape[1]]), t % k_cache.shape[1])
                else:
                    at = (int(rows[b]), t)
                k_cache[at] = k8[b, t - int(lengths[b])]
                v_cache[at] = v8[b, t - int(lengths[b])]
        appended = k.shape[1]

    def dequantized(cache, scales):
        codes = gather_cache(cache, batch, block_table=block_table,
                             cache_batch_idx=cache_batch_idx)
        return codes.double() * scales.double().to(codes.device)[:, None, :, None]

    used = (lengths + appended).clamp(max=capacity)
    out, lse, _, _ = kvcache_reference(
        q, dequantized(k_cache, k_scales), dequantized(v_cache, v_scales),
        cache_seqlens=used.to(torch.int32).to(q.device), causal=causal, window_size=window_size,
        compute_dtype=compute_dtype, **kwargs)
    return out, lse, k_cache, v_cache


# ---------------------------------------------------------------------------------------------
# The e4m3 (FP8) forward: fmha.fwd on torch.float8_e4m3fn q, k, v with descales (issue 41).
# ---------------------------------------------------------------------------------------------

# What the fa3 e4m3 forward does with P (docs/design/fp8.md): the probabilities times 2^8,
# relative to the running row max, rounded to e4m3 before P V, over key tiles of 128 visited
# last to first; the row sum stays fp32 and unrounded. Its output is bf16 (fp16 when asked).
E4M3_P_SCALE = 256.0
E4M3_KEY_TILE = 128
# The orders the running max may visit the key tiles in: the kernel's first.
E4M3_KEY_ORDERS = ("last_to_first", "first_to_last")
E4M3_KEY_ORDER = E4M3_KEY_ORDERS[0]
E4M3_OUT_DTYPE = torch.bfloat16
# How the e4m3 tests and the accuracy study pick descales: none (the codes are the values),
# one for the tensor, one per (batch, K/V head) (FlashAttention-3's q/k/v_descale).
DESCALE_KINDS = (None, "tensor", "head")


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest float8 e4m3 value (torch.float8_e4m3fn's), ties to even,
    saturating at +-448 (cvt.rn.satfinite.e4m3x2.f32's rule), with e4m3's subnormals (steps of
    2^-9 below 2^-6); NaN stays NaN. Computed in x's own floating dtype, so a float64 x is
    rounded once, not through float32 as a cast to torch.float8_e4m3fn would."""
    a = x.abs()
    _, exponent = torch.frexp(a)  # a = m * 2^exponent, m in [0.5, 1)
    lead = (exponent.to(a.dtype) - 1).clamp(min=-6.0)  # the leading bit's; -6 for subnormals
    step = torch.exp2(lead - 3)  # 3 mantissa bits
    rounded = (torch.round(a / step) * step).clamp(max=E4M3_MAX)  # torch.round: half to even
    return torch.copysign(rounded, x)


def descale_table(descale: Optional[torch.Tensor], batch: int, nhead_k: int) -> torch.Tensor:
    """The float64 (batch, nhead_k) table a q/k/v_descale stands for: None is 1; a tensor of
    a shape that broadcasts to (batch, nhead_k) ((), (1, 1), (batch, 1), (1, nhead_k) or
    (batch, nhead_k)) is expanded. Another shape raises ValueError."""
    if descale is None:
        return torch.ones(batch, nhead_k, dtype=torch.float64)
    if descale.dim() > 2:
        raise ValueError(f"a descale has at most 2 dims (batch, nhead_k); got "
                         f"{tuple(descale.shape)}")
    try:
        return descale.double().expand(batch, nhead_k)
    except RuntimeError as err:
        raise ValueError(f"descale of shape {tuple(descale.shape)} does not broadcast to "
                         f"(batch, nhead_k) = {(batch, nhead_k)}") from err


def _lead_count(x: torch.Tensor, cu_seqlens) -> int:
    return x.shape[0] if cu_seqlens is None else len(_as_list(cu_seqlens, 0, 0)) - 1


def _row_factors(table: torch.Tensor, x: torch.Tensor, cu_seqlens, heads_per: int):
    """The (batch, nhead_k) `table` broadcastable against x: (batch, 1, nhead, 1) for batch
    mode's (batch, seqlen, nhead, d), (total, nhead, 1) for group mode's (total, nhead, d), the
    rows of sequence b reading row b, query head h reading K/V head h // heads_per."""
    per_head = table.repeat_interleave(heads_per, dim=1).to(x.device)
    if cu_seqlens is None:
        return per_head[:, None, :, None]
    cu = torch.as_tensor(_as_list(cu_seqlens, 0, 0), device=x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    sequence = torch.bucketize(rows, cu[1:], right=True).clamp(max=max(per_head.shape[0] - 1, 0))
    return per_head[sequence][:, :, None]


def dequantize_e4m3(x: torch.Tensor, descale: Optional[torch.Tensor], *, cu_seqlens=None,
                    heads_per_descale: int = 1) -> torch.Tensor:
    """x (e4m3 codes, or any values) times its descale, in float64: batch mode x (batch, seqlen,
    nhead, d), group mode (cu_seqlens given) x (total, nhead, d) with descale row b for the
    rows of sequence b. heads_per_descale: query heads per K/V head for q (whose descale is
    indexed by K/V head, as FlashAttention-3's q_descale is), 1 for k and v."""
    values = x.float().double() if x.dtype == torch.float8_e4m3fn else x.double()
    if descale is None:
        return values
    table = descale_table(descale.cpu(), _lead_count(x, cu_seqlens),
                          x.shape[-2] // heads_per_descale)
    return values * _row_factors(table, x, cu_seqlens, heads_per_descale)


def e4m3_descale(x: torch.Tensor, kind: Optional[str], *, cu_seqlens=None,
                 heads_per_descale: int = 1) -> Optional[torch.Tensor]:
    """The descale that maps the largest magnitude of x to 448, float32 on x's device: kind
    "tensor" gives a (1, 1) one, "head" a (batch, nhead_k) one, each over the rows of one
    sequence and the query heads of one K/V head (heads_per_descale as in dequantize_e4m3);
    None gives None (x quantized as it is). A group of zeros gets 1."""
    if kind is None:
        return None
    a = x.detach().abs().float()
    if kind == "tensor":
        amax = (a.amax() if a.numel() else a.new_zeros(())).reshape(1, 1)
    elif kind == "head":
        nhead_k = a.shape[-2] // heads_per_descale
        if cu_seqlens is None:
            grouped = a.unflatten(2, (nhead_k, heads_per_descale))  # (b, s, hk, per, d)
            amax = (grouped.amax(dim=(1, 3, 4)) if a.shape[1] else
                    a.new_zeros(a.shape[0], nhead_k))
        else:
            cu = _as_list(cu_seqlens, 0, 0)
            amax = a.new_zeros(len(cu) - 1, nhead_k)
            for b in range(len(cu) - 1):
                rows = a[cu[b]:cu[b + 1]].unflatten(1, (nhead_k, heads_per_descale))
                if rows.shape[0]:
                    amax[b] = rows.amax(dim=(0, 2, 3))
    else:
        raise ValueError(f"descale kind must be one of {DESCALE_KINDS}, got {kind!r}")
    descale = amax / E4M3_MAX
    return torch.where(descale > 0, descale, torch.ones_like(descale)).float()


def quantize_fwd_e4m3(x: torch.Tensor, descale: Optional[torch.Tensor], *, cu_seqlens=None,
                      heads_per_descale: int = 1) -> torch.Tensor:
    """x's e4m3 codes under `descale` (indexed as dequantize_e4m3 indexes it): x / descale in
    float32, saturated to +-448, rounded to nearest even; a contiguous torch.float8_e4m3fn
    tensor of x's shape."""
    values = x.float()
    if descale is not None:
        table = descale_table(descale.cpu(), _lead_count(x, cu_seqlens),
                              x.shape[-2] // heads_per_descale)
        values = values / _row_factors(table, x, cu_seqlens, heads_per_descale).float()
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous()


def to_e4m3(x: torch.Tensor, kind: Optional[str], *, cu_seqlens=None,
            heads_per_descale: int = 1) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(codes, descale) of x: e4m3_descale's descale of the kind and the codes under it."""
    descale = e4m3_descale(x, kind, cu_seqlens=cu_seqlens, heads_per_descale=heads_per_descale)
    codes = quantize_fwd_e4m3(x, descale, cu_seqlens=cu_seqlens,
                              heads_per_descale=heads_per_descale)
    return codes, descale


def e4m3_p_weights(p_scale: float = E4M3_P_SCALE, p_max: str = "final",
                   block_n: int = E4M3_KEY_TILE, round_p: bool = True,
                   order: str = E4M3_KEY_ORDER):
    """attention_reference's `weights` hook of the e4m3 forward: row i's weight of key j is
    round_e4m3(p_scale * exp(s_ij - m_ij)) * exp(m_ij - M_i) / (p_scale * sum_j exp(s_ij - M_i)),
    M_i the row's final max, in float64 but for that rounding.

    p_max "final": m_ij = M_i, P rounded relative to the final row max, the reference the issue
    names ("quantizes q, k, v and P the way the kernel does") and the tests' yardstick.
    "running": m_ij is the max over the key tiles of block_n keys (counted from the sequence's
    first key) that the kernel has visited when it reaches j's tile, visiting them in `order`
    (the kernel's "last_to_first", or "first_to_last"), with the exact running max: P rounded
    as the kernel rounds it, the accumulated sum rescaled by exp(m - M) exactly. The two
    differ where that max grows as the tiles go, most where a first tile holds sink keys:
    relative to the final max the other keys' P fall into e4m3's subnormals or to 0, relative
    to the running max they do not (in the output the sinks' own rounding, the same in both,
    weighs more: bench/fp8_accuracy.py measures both). The order matters in the same way:
    first to last, sinks in the first tile set the max before the other keys are rounded.
    p_scale: the kernel's 256; P <= 1 relative to the exact max, so 448 is the largest scale
    that cannot saturate (bench/fp8_accuracy.py --p-study compares scales and orders).
    round_p False leaves P unrounded: the weights are then the probabilities (the truth).
    """
    if p_max not in ("final", "running"):
        raise ValueError(f"p_max must be 'final' or 'running', got {p_max!r}")
    if order not in E4M3_KEY_ORDERS:
        raise ValueError(f"order must be one of {E4M3_KEY_ORDERS}, got {order!r}")

    def weights(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        if s.shape[-1] == 0:
            return torch.zeros_like(s)
        final = s.amax(-1, keepdim=True)
        final = torch.where(torch.isfinite(final), final, torch.zeros_like(final))
        if p_max == "final":
            m = final
        else:
            sk = s.shape[-1]
            tiles = -(-sk // block_n)
            padded = torch.nn.functional.pad(s, (0, tiles * block_n - sk), value=float("-inf"))
            tile_max = padded.unflatten(-1, (tiles, block_n)).amax(-1)
            if order == "last_to_first":
                running = tile_max.flip(-1).cummax(-1).values.flip(-1)
            else:
                running = tile_max.cummax(-1).values
            m = running.repeat_interleave(block_n, dim=-1)[..., :sk]
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = p_scale * torch.exp(s - m)  # 0 where masked
        if round_p:
            p = round_e4m3(p)
        rowsum = p_scale * torch.exp(s - final).sum(-1, keepdim=True)
        w = p * torch.exp(m - final) / torch.where(rowsum > 0, rowsum, torch.ones_like(rowsum))
        return torch.where(rowsum > 0, w, torch.zeros_like(w))

    return weights


@dataclass
class E4m3Reference:
    """fwd_reference_e4m3's result (iterates as (truth, lse, quantized))."""

    truth: torch.Tensor      # float64 attention of the dequantized q, k, v
    lse: torch.Tensor        # its natural-log log-sum-exp, float64 (-inf: a row sees no key)
    quantized: torch.Tensor  # the quantizing reference's output, float64
    # The largest |logit| the inputs could give, softmax_scale * max |q_row| * max |k_row|
    # (Cauchy-Schwarz): the scale of the error of the fp8 products' accumulation.
    logit_bound: float = 0.0

    def __iter__(self):
        return iter((self.truth, self.lse, self.quantized))


E4M3_UNSUPPORTED = ("bias", "attn_mask", "alibi_slopes", "softcap", "dropout_p", "dropout_keep")


def fwd_reference_e4m3(q, k, v, *, q_descale=None, k_descale=None, v_descale=None,
                       p_scale: float = E4M3_P_SCALE, p_max: str = "final",
                       block_n: int = E4M3_KEY_TILE, round_p: bool = True,
                       order: str = E4M3_KEY_ORDER, **kwargs) -> E4m3Reference:
    """fmha.fwd's e4m3 forward in plain torch: q, k, v torch.float8_e4m3fn codes (or any
    values) in fmha.fwd's layouts (v may be a V^T view), q/k/v_descale None or float32 of a
    shape that broadcasts to (batch, nhead_k) (q's indexed by K/V head: query head h reads
    h // (nhead_q / nhead_k)); kwargs: attention_reference's masks, alignment, softmax_scale,
    cu_seqlens and seqused (no bias, ALiBi, soft-capping or dropout: the e4m3 forward has none).

    A logit is (q * q_descale) . (k * k_descale) * softmax_scale, an output row
    sum_j p_j (v_j * v_descale) / sum_j p_j. Returns
    - truth, lse: attention_reference() in float64 on the dequantized inputs, the truth;
    - quantized: the same attention with P rounded as the kernel rounds it
      (e4m3_p_weights(p_scale, p_max, block_n, round_p, order)): p_scale * exp(s - m) to e4m3
      (nearest even, saturating at 448) before P V, the row sum of the unrounded values; by
      default m is the row's FINAL max (p_max="final"), not the running max the kernel uses
      (p_max="running" mirrors that: key tiles of block_n visited in `order`, the kernel's
      "last_to_first" by default, or "first_to_last"), and everything else is float64:
      the quantizing reference of the issue's bar ("a reference that quantizes q, k, v and P
      the way the kernel does": q, k, v are quantized already, being e4m3 codes). The kernel's
      bf16 output rounding is not in it (compare_e4m3's floor stands for it).
    """
    given = [name for name in E4M3_UNSUPPORTED if kwargs.get(name) not in (None, 0, 0.0)]
    if given:
        raise ValueError(f"the e4m3 forward has no {', '.join(given)}")
    heads_per = q.shape[-2] // k.shape[-2]
    qd = dequantize_e4m3(q, q_descale, cu_seqlens=kwargs.get("cu_seqlens_q"),
                         heads_per_descale=heads_per)
    kd = dequantize_e4m3(k, k_descale, cu_seqlens=kwargs.get("cu_seqlens_k"))
    vd = dequantize_e4m3(v, v_descale, cu_seqlens=kwargs.get("cu_seqlens_k"))
    truth, lse = attention_reference(qd, kd, vd, **kwargs)
    quantized, _ = attention_reference(qd, kd, vd, **kwargs,
                                       weights=e4m3_p_weights(p_scale, p_max, block_n, round_p,
                                                              order))
    scale = kwargs.get("softmax_scale") or q.shape[-1] ** -0.5
    logit_bound = scale * qd.double().norm(dim=-1).max().item() * (
        kd.double().norm(dim=-1).max().item() if kd.numel() else 0.0)
    return E4m3Reference(truth, lse, quantized, logit_bound)


def rms(x: torch.Tensor) -> float:
    """The root mean square of x's elements in float64 (0 for none)."""
    return x.double().square().mean().sqrt().item() if x.numel() else 0.0


@dataclass
class E4m3Comparison:
    """compare_e4m3's result: the errors over the whole output, and the worst ratio of error to
    tolerance over the slices the rule is applied to (which one, in `worst`)."""

    err_max: float      # max |out - truth| over the defined elements
    err_rms: float      # their root mean square
    ref_err_max: float  # the same for the quantizing reference
    ref_err_rms: float
    out_max: float      # max |truth|
    ratio: float = 0.0  # the largest err / tol of a slice, max or RMS: the rule holds up to 1
    worst: str = ""     # that slice
    lse_err: float = 0.0  # max |lse - truth's| over rows that see keys


def _errors(o, truth, quantized, factor, floor_ulps, out_dtype) -> dict:
    defined = ~torch.isnan(truth)
    diff, ref_diff = (o - truth)[defined], (quantized - truth)[defined]
    if not diff.numel():
        return dict(err_max=0.0, err_rms=0.0, ref_err_max=0.0, ref_err_rms=0.0, out_max=0.0,
                    tol_max=0.0, tol_rms=0.0)
    e = dict(err_max=diff.abs().max().item(), err_rms=rms(diff),
             ref_err_max=ref_diff.abs().max().item(), ref_err_rms=rms(ref_diff),
             out_max=truth[defined].abs().max().item())
    # The output's rounding to its dtype (bf16, or fp16 when asked): floor_ulps ulps of the
    # largest element for the max error, floor_ulps half-ulps of each element (the rounding's
    # bound; at least a subnormal's) in RMS for the RMS error.
    floor_max = floor_ulps * ulp(e["out_max"], out_dtype)
    magnitude = truth[defined].abs()
    finfo = torch.finfo(out_dtype)
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[out_dtype]
    half_ulps = torch.where(magnitude > 0,
                            torch.exp2(torch.frexp(magnitude)[1] - (mantissa + 2.0)).clamp_min(
                                finfo.smallest_normal * finfo.eps / 2),
                            torch.zeros_like(magnitude))
    floor_rms = floor_ulps * rms(half_ulps)
    e.update(floor_max=floor_max, floor_rms=floor_rms,
             tol_max=factor * e["ref_err_max"] + floor_max,
             tol_rms=factor * e["ref_err_rms"] + floor_rms)
    return e


def _slices(out: torch.Tensor, cu_seqlens) -> list:
    """(label, index) of each (sequence, query head) of an output: (b, :, h) in batch mode;
    in group mode the rows of each sequence of cu_seqlens (all rows as one without it)."""
    if out.dim() == 4:
        return [(f"batch {b} head {h}", (b, slice(None), h))
                for b in range(out.shape[0]) for h in range(out.shape[2])]
    cu = _as_list(cu_seqlens, 0, 0) if cu_seqlens is not None else [0, out.shape[0]]
    return [(f"sequence {b} head {h}", (slice(cu[b], cu[b + 1]), h))
            for b in range(len(cu) - 1) if cu[b + 1] > cu[b] for h in range(out.shape[1])]


def compare_e4m3(out: torch.Tensor, ref: E4m3Reference, *, lse=None, what: str = "",
                 cu_seqlens=None, factor: float = 2.0, floor_ulps: float = 2.0,
                 lse_rtol: float = 1e-3) -> E4m3Comparison:
    """The e4m3 forward's pass rule (the FP8 issue's bar): the max and the RMS error of `out`
    against the float64 truth each at most `factor` times the quantizing reference's, plus a
    floor for the output's own rounding to its dtype (bf16, or fp16), which is all there is
    where the reference's error is tiny (one key): floor_ulps ulps of the largest output for the
    max error,
    floor_ulps times the RMS of each element's half ulp for the RMS error. The rule holds for each
    (sequence, query head) of the output on its own (cu_seqlens: group mode's sequences), so
    that a head of small values, whose descale the kernel misreads, cannot hide behind a head
    of large ones. Elements NaN in the truth (rows the kernel does not write) are not compared;
    elsewhere no NaN. Rows that see no key are exactly 0 with lse -inf; lse elsewhere within
    lse_rtol * max(1, |lse|) of the truth's plus 2^-9 of ref.logit_bound: Hopper's e4m3 wgmma
    adds its products with fewer bits than fp32 (DeepSeek-V3's report measured about 14 on
    H800), so a logit, and with it the log-sum-exp, carries an error of the order of 2^-14 of
    the sum of its products' magnitudes (H200: up to 0.05 at an lse of 42 on outlier channels).
    The output's own rule above holds whatever this error is.
    """
    truth = ref.truth
    assert tuple(out.shape) == tuple(truth.shape), (
        f"{what}: output shape {tuple(out.shape)} != {tuple(truth.shape)}")
    defined = ~torch.isnan(truth)
    o = out.double()
    bad = torch.isnan(o) & defined
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} NaN output elements in rows the kernel must write "
        f"(first at {tuple(bad.nonzero()[0].tolist())})")
    quantized = ref.quantized.double()
    whole = _errors(o, truth, quantized, factor, floor_ulps, out.dtype)
    ratio, worst = 0.0, ""
    for label, index in _slices(out, cu_seqlens):
        e = _errors(o[index], truth[index], quantized[index], factor, floor_ulps, out.dtype)
        for kind in ("max", "rms"):
            err, tol = e[f"err_{kind}"], e[f"tol_{kind}"]
            if tol > 0 and err / tol > ratio:
                ratio, worst = err / tol, label
            if err <= tol:
                continue
            where = ""
            if kind == "max":
                full = (o[index] - truth[index]).abs().nan_to_num(0.0)
                at = tuple(torch.nonzero(full == full.max())[0].tolist())
                where = (f" at {at} of it: got {o[index][at].item():.6g}, want "
                         f"{truth[index][at].item():.6g}, the quantizing reference "
                         f"{quantized[index][at].item():.6g}")
            name = "max error" if kind == "max" else "RMS error"
            raise AssertionError(
                f"{what}: {label}: {name} {err:.4g} > {tol:.4g} ({factor:g} x the quantizing "
                f"reference's {e[f'ref_err_{kind}']:.4g} + {e[f'floor_{kind}']:.3g}){where}")

    empty = torch.isneginf(ref.lse)
    rows = empty.permute(0, 2, 1) if out.dim() == 4 else empty.transpose(0, 1)
    assert (o[rows] == 0).all(), f"{what}: rows that see no key must be exactly 0"
    lse_err = 0.0
    if lse is not None:
        assert tuple(lse.shape) == tuple(ref.lse.shape), (
            f"{what}: lse shape {tuple(lse.shape)} != {tuple(ref.lse.shape)}")
        assert lse.dtype == torch.float32, f"{what}: lse dtype {lse.dtype}, want float32"
        got = lse.double()
        if empty.any():
            wrong = got[empty][~torch.isneginf(got[empty])][:4].tolist()
            assert not wrong, f"{what}: rows that see no key must have lse -inf; got {wrong}"
        finite = torch.isfinite(ref.lse)
        if finite.any():
            assert not torch.isnan(got[finite]).any(), f"{what}: NaN lse in rows that see keys"
            d = (got[finite] - ref.lse[finite]).abs()
            lse_err = d.max().item()
            accumulation = 2.0 ** -9 * ref.logit_bound
            tol = lse_rtol * ref.lse[finite].abs().clamp(min=1.0) + accumulation
            bad = d > tol
            assert not bad.any(), (
                f"{what}: lse error {lse_err:.4g} > {lse_rtol:g} x max(1, |lse|) + "
                f"{accumulation:.3g} (2^-9 of the logit bound) (want "
                f"{ref.lse[finite][bad][0].item():.6g}, got {got[finite][bad][0].item():.6g})")
    return E4m3Comparison(whole["err_max"], whole["err_rms"], whole["ref_err_max"],
                          whole["ref_err_rms"], whole["out_max"], ratio, worst, lse_err)


# The inputs of the e4m3 accuracy study (bench/fp8_accuracy.py) and of the GPU tests' own kinds.
STUDY_KINDS = ("normal", "fa3_outliers", "outlier_channels", "sinks")
# FlashAttention-3's outliers (arXiv 2407.08608, section 4.3): every entry of Q, K and V is
# N(0, 1) + N(0, 100) * Bernoulli(0.001), a term of standard deviation 10 added to 0.1% of them.
FA3_OUTLIER_P, FA3_OUTLIER_STD = 0.001, 10.0
# outlier_channels: head-dim channels of q (and other ones of k) this many times larger.
OUTLIER_CHANNEL_FACTORS = (10.0, 20.0, 35.0, 50.0)
# sinks: the first keys' logits this much above log(seqlen_k), so that they take most of the
# probability mass (with 4 sinks, about 4 e^3 / (4 e^3 + e^0.5) ~ 98% of it).
SINK_MARGIN = 3.0


def study_inputs(kind: str, batch: int, seqlen_q: int, nhead_q: int, nhead_k: int, hdim: int, *,
                 seqlen_k: Optional[int] = None, gen: Optional[torch.Generator] = None,
                 device="cpu", n_sink: int = 4) -> tuple:
    """(q, k, v) float32 (batch, seqlen, nhead, hdim) of one kind of the accuracy study, before
    any quantization, drawn on the CPU from `gen` (seed 0 when None), then moved to `device`:

    - "normal": every entry N(0, 1).
    - "fa3_outliers": FlashAttention-3's recipe for its Table 3, every entry of q, k and v
      N(0, 1) + N(0, 100) * Bernoulli(0.001) (variance 100: standard deviation 10).
    - "outlier_channels": as LLM activations have them, four head-dim channels of q
      OUTLIER_CHANNEL_FACTORS (10-50) times larger, and four others of k; v normal. (Other
      channels for q and k: shared ones would multiply the factors into logits of hundreds.)
    - "sinks": the first n_sink keys (attention sinks) get logits about log(seqlen_k) + 3 from
      every query, the others N(0, 1)-distributed ones, so that they take most of each row's
      probability mass: channel 0 of every query and of the sink keys is
      sqrt((log(seqlen_k) + 3) * sqrt(hdim)), of the other keys 0 (for the default
      softmax_scale 1 / sqrt(hdim)).
    """
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k

    def randn(s, h):
        return torch.randn(batch, s, h, hdim, generator=gen)

    q, k, v = randn(seqlen_q, nhead_q), randn(seqlen_k, nhead_k), randn(seqlen_k, nhead_k)
    if kind == "fa3_outliers":
        for x in (q, k, v):
            hit = torch.rand(x.shape, generator=gen) < FA3_OUTLIER_P
            x += FA3_OUTLIER_STD * torch.randn(x.shape, generator=gen) * hit
    elif kind == "outlier_channels":
        channels = torch.randperm(hdim, generator=gen)[:2 * len(OUTLIER_CHANNEL_FACTORS)]
        factors = torch.tensor(OUTLIER_CHANNEL_FACTORS)
        n = len(OUTLIER_CHANNEL_FACTORS)
        q[..., channels[:n]] *= factors
        k[..., channels[n:]] *= factors
    elif kind == "sinks":
        height = math.sqrt((math.log(max(seqlen_k, 1)) + SINK_MARGIN) * math.sqrt(hdim))
        q[..., 0] = height
        k[..., 0] = 0.0
        k[:, :n_sink, :, 0] = height
    elif kind != "normal":
        raise ValueError(f"kind must be one of {STUDY_KINDS}, got {kind!r}")
    return tuple(x.to(device) for x in (q, k, v))


# ---- The cases of one compiled e4m3 forward instance (tests/test_fwd_e4m3_gpu.py) ----------


class _MaskedProblem:
    """What a problem's fields say of its mode and mask (Spec and E4m3Case share them)."""

    @property
    def group(self) -> bool:
        return self.seqlens_q is not None

    @property
    def windowed(self) -> bool:
        return any(w is not None and w >= 0 for w in self.window)

    @property
    def mask(self) -> str:
        return "window" if self.windowed else ("causal" if self.causal else "none")

    def replace(self, **changes):
        """A copy with `changes` (dataclasses.replace)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class E4m3Case(_MaskedProblem):
    """One e4m3 fmha.fwd problem. Batch mode: b, sq, sk; group mode: seqlens_q/seqlens_k
    (sequences packed, cu_seqlens). descale: one of DESCALE_KINDS, for q, k and v alike. kind:
    one of STUDY_KINDS, or "heads" (normal entries times a factor per (sequence, K/V head),
    log-uniform in [1/4, 4] for q and k and [1/16, 16] for v, so that per-head descales
    matter). vcol: V given as V^T (the sequence dim contiguous, what a vlayout-col kernel reads)
    in a buffer whose padding is NaN; else row-major (read in place by a vlayout-row kernel,
    which transposes it). layout "poison": q and k are views into buffers wider in the head
    dim, NaN there."""

    d: int
    dv: int
    hq: int = 4
    hk: int = 1
    b: int = 1
    sq: int = 1
    sk: int = 1
    seqlens_q: Optional[tuple] = None
    seqlens_k: Optional[tuple] = None
    causal: bool = False
    window: tuple = (-1, -1)
    align: str = "top_left"
    lse: bool = False
    vcol: bool = False
    descale: Optional[str] = None
    kind: str = "heads"
    scale: Optional[float] = None
    layout: str = "bshd"

    def describe(self) -> str:
        parts = [f"e4m3 d{self.d}/{self.dv}", f"h{self.hq}/{self.hk}"]
        parts.append(f"q{list(self.seqlens_q)} k{list(self.seqlens_k)}" if self.group
                     else f"b{self.b} {self.sq}x{self.sk}")
        if self.causal:
            parts.append("causal")
        if self.windowed:
            parts.append(f"window{tuple(self.window)}")
        if self.causal or self.windowed:
            parts.append(self.align)
        parts.append(f"descale={self.descale}")
        parts.append(self.kind)
        if self.lse:
            parts.append("lse")
        parts.append("vcol" if self.vcol else "vrow")
        if self.layout != "bshd":
            parts.append(self.layout)
        if self.scale is not None:
            parts.append(f"scale={self.scale:.4g}")
        return " ".join(parts)


@dataclass
class E4m3Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    fwd_kwargs: dict  # fmha.fwd's keyword arguments (descales included; no instance or out)
    ref_kwargs: dict  # fwd_reference_e4m3's (descales included)
    case: Optional[E4m3Case] = None


E4M3_NAN_BYTE = 0x7F  # an e4m3 NaN (torch.float8_e4m3fn has no infinities)


def _e4m3_buffer(shape, device) -> torch.Tensor:
    return torch.full(shape, E4M3_NAN_BYTE, dtype=torch.uint8, device=device).view(
        torch.float8_e4m3fn)


def _e4m3_in_layout(codes: torch.Tensor, *, col: bool, poison: bool) -> torch.Tensor:
    """codes (*lead, s, h, dim) as the call passes them: col, a V^T view (sequence stride 1)
    into a NaN-filled buffer of rows rounded up to 16 bytes and 16 more; poison, a view into a
    NaN-filled buffer 16 columns wider in the head dim; else the contiguous codes."""
    *lead, s, h, dim = codes.shape
    n = len(lead)
    if col:
        buf = _e4m3_buffer((*lead, h, dim, -(-s // 16) * 16 + 16), codes.device)
        inner = buf[..., :s]  # (*lead, h, dim, s)
        inner.copy_(codes.permute(*range(n), n + 1, n + 2, n))
        return inner.permute(*range(n), n + 2, n, n + 1)
    if poison:
        buf = _e4m3_buffer((*lead, s, h, dim + 16), codes.device)
        view = buf[..., :dim]
        view.copy_(codes)
        return view
    return codes.contiguous()


def make_e4m3_inputs(case: E4m3Case, device="cuda", seed: int = 0) -> E4m3Inputs:
    """The e4m3 tensors and keyword arguments of `case`: values drawn (study_inputs, from a
    CPU generator seeded by `seed`) and quantized with descales of case.descale (to_e4m3)."""
    gen = torch.Generator().manual_seed(seed)
    per = case.hq // case.hk
    kind = "normal" if case.kind == "heads" else case.kind
    fwd: dict = {}
    cu_q = cu_k = None
    if case.group:
        cu_q = [0] + list(itertools.accumulate(case.seqlens_q))
        cu_k = [0] + list(itertools.accumulate(case.seqlens_k))
        drawn = study_inputs(kind, 1, cu_q[-1], case.hq, case.hk, case.d, seqlen_k=cu_k[-1],
                             gen=gen)
        drawn = [x[0] for x in drawn]  # (total, nhead, d)
        fwd.update(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                   cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
                   max_seqlen_q=max(case.seqlens_q), max_seqlen_k=max(case.seqlens_k))
        batch = len(case.seqlens_q)
    else:
        drawn = study_inputs(kind, case.b, case.sq, case.hq, case.hk, case.d, seqlen_k=case.sk,
                             gen=gen)
        batch = case.b
    values = dict(q=drawn[0], k=drawn[1], v=drawn[2][..., :case.dv])
    layout = dict(q=(cu_q, per), k=(cu_k, 1), v=(cu_k, 1))  # (cu_seqlens, heads per descale)
    if case.kind == "heads":
        # A magnitude per (sequence, K/V head), the query heads of a K/V head sharing one (they
        # share its q_descale): 2^-2 to 2^2 for q and k (logits of standard deviation up to
        # 16, not beyond: past that the rows are one-hot and the fp8 products' accumulation,
        # not P's rounding, would set the error), 2^-4 to 2^4 for v.
        for name, x in values.items():
            span = 8.0 if name == "v" else 4.0
            table = torch.exp2((torch.rand(batch, case.hk, generator=gen, dtype=torch.float64)
                                - 0.5) * span)
            values[name] = x * _row_factors(table, x, *layout[name]).float()
    codes, descales = {}, {}
    for name, x in values.items():
        cu, heads = layout[name]
        codes[name], descales[name] = to_e4m3(x, case.descale, cu_seqlens=cu,
                                              heads_per_descale=heads)
    poison = case.layout == "poison"
    q8 = _e4m3_in_layout(codes["q"].to(device), col=False, poison=poison)
    k8 = _e4m3_in_layout(codes["k"].to(device), col=False, poison=poison)
    v8 = _e4m3_in_layout(codes["v"].to(device), col=case.vcol, poison=False)
    for name in ("q", "k", "v"):
        if descales[name] is not None:
            fwd[f"{name}_descale"] = descales[name].to(device)
    if case.causal:
        fwd["causal"] = True
    if case.windowed:
        fwd["window_size"] = tuple(case.window)
    if case.causal or case.windowed:
        fwd["mask_align"] = case.align
    if case.scale is not None:
        fwd["softmax_scale"] = case.scale
    ref = dict(fwd)
    if case.lse:
        fwd["return_lse"] = True
    return E4m3Inputs(q8, k8, v8, fwd, ref, case)


def e4m3_lse_shape(case: E4m3Case) -> tuple:
    if case.group:
        return (case.hq, sum(case.seqlens_q))
    return (case.b, case.hq, case.sq)


def check_fwd_e4m3(fwd, case: E4m3Case, *, instance=None, device="cuda", seed: int = 0,
                   what: str = "", out_param: bool = False,
                   inputs: Optional[E4m3Inputs] = None,
                   out_dtype: Optional[torch.dtype] = None) -> E4m3Comparison:
    """Runs `case` through `fwd` (fmha.fwd; forced to `instance` when given) and applies
    compare_e4m3 against fwd_reference_e4m3. out_param: the API takes out=, which gets a
    NaN-filled tensor of the output's dtype the result must be; without it the allocator is
    poisoned with NaN blocks of the output's and lse's sizes (poison_allocator). out_dtype:
    passed to fwd (torch.float16 asks for an fp16 output); None passes nothing (bf16)."""
    inputs = inputs if inputs is not None else make_e4m3_inputs(case, device, seed)
    q, k, v = inputs.q, inputs.k, inputs.v
    what = f"{what or instance or 'dispatcher'} [{case.describe()}]"
    out_shape = (*q.shape[:-1], case.dv)
    kwargs = dict(inputs.fwd_kwargs)
    if instance is not None:
        kwargs["instance"] = instance
    want = E4M3_OUT_DTYPE if out_dtype is None else out_dtype
    if out_dtype is not None:
        kwargs["out_dtype"] = out_dtype
    given = None
    if out_param:
        given = torch.full(out_shape, float("nan"), dtype=want, device=q.device)
        kwargs["out"] = given
    else:
        poison_allocator([(out_shape, want), (e4m3_lse_shape(case), torch.float32)], q.device)
    result = fwd(q, k, v, **kwargs)
    if q.is_cuda:
        torch.cuda.synchronize()  # surfaces asynchronous CUDA errors here
    if case.lse:
        assert isinstance(result, tuple) and len(result) == 2, (
            f"{what}: return_lse=True returns (out, lse)")
        out, lse = result
    else:
        assert isinstance(result, torch.Tensor), f"{what}: return_lse=False returns out alone"
        out, lse = result, None
    assert tuple(out.shape) == out_shape, (
        f"{what}: output shape {tuple(out.shape)}, want {out_shape}")
    assert out.dtype == want and out.device == q.device, (
        f"{what}: output {out.dtype} on {out.device}, want {want} on {q.device}")
    if given is not None:
        assert out.data_ptr() == given.data_ptr(), f"{what}: out= given, another tensor returned"
    ref = fwd_reference_e4m3(q, k, v, **inputs.ref_kwargs)
    return compare_e4m3(out, ref, lse=lse, what=what,
                        cu_seqlens=inputs.fwd_kwargs.get("cu_seqlens_q"))


# Lengths of the e4m3 cases: ragged (1, 127, 200, 1000 keys or queries), seqlen_q != seqlen_k
# both ways, GQA 4:1 and MHA; group mode with an empty sequence of keys and one of queries, and
# packed sequences starting at keys that are not multiples of 16 (0, 1, 18, 154: what TMA
# cannot copy from a V^T, and the row-major V's transpose must handle).
E4M3_BATCH_SHAPES = (
    ("q1_k1000_gqa4", dict(b=2, sq=1, sk=1000, hq=8, hk=2)),
    ("q127_k200_gqa4", dict(b=2, sq=127, sk=200, hq=4, hk=1)),
    ("q1000_k127_gqa4", dict(b=1, sq=1000, sk=127, hq=4, hk=1)),
    ("q200_k1_mha", dict(b=3, sq=200, sk=1, hq=2, hk=2)),
)
E4M3_GROUP_SHAPES = (
    ("varlen_gqa4", dict(seqlens_q=(1, 127, 200, 1000), seqlens_k=(127, 1000, 1, 200), hq=8,
                         hk=2)),
    ("varlen_empty", dict(seqlens_q=(200, 0, 1), seqlens_k=(0, 127, 1000), hq=4, hk=1)),
    ("varlen_one", dict(seqlens_q=(1000,), seqlens_k=(127,), hq=4, hk=1)),
    ("varlen_unaligned_gqa4", dict(seqlens_q=(1, 17, 136, 300), seqlens_k=(1, 17, 136, 300),
                                   hq=8, hk=2)),
)


def e4m3_instance_cases(inst: dict) -> list[tuple[str, E4m3Case]]:
    """The cases of one e4m3 forward instance: its head dims, mode, mask (causal of both
    alignments, windows from WINDOW_CASES) and V layout (row-major, or V^T), each shape with two
    of the descales none, per tensor and per (batch, K/V head) in turn, per-head magnitudes, the
    log-sum-exp where the instance writes it (but in one shape), q and k in NaN-padded views in
    one shape, a softmax_scale of 0.8 / sqrt(d) in one."""
    shapes = E4M3_GROUP_SHAPES if trait(inst, "mode") == "group" else E4M3_BATCH_SHAPES
    cases = []
    for idx, (name, shape) in enumerate(shapes):
        base = E4m3Case(d=inst["hdim_q"], dv=inst["hdim_v"], **shape)
        label = []
        align = ALIGNS[idx % 2]
        short = "tl" if align == "top_left" else "br"
        mask = trait(inst, "mask")
        if mask == "causal":
            base = base.replace(causal=True, align=align)
            label.append(f"causal_{short}")
        elif mask == "window":
            left, right, causal = WINDOW_CASES[idx % len(WINDOW_CASES)]
            base = base.replace(window=(left, right), causal=causal, align=align)
            label.append(f"win{left}_{right}{'_causal' if causal else ''}_{short}")
        if trait(inst, "lse") and idx != 1:
            base = base.replace(lse=True)
            label.append("lse")
        if idx == 1:
            base = base.replace(layout="poison")
            label.append("poison")
        if idx == 2:
            base = base.replace(scale=0.8 / math.sqrt(base.d))
            label.append("scale0.8")
        vcol = trait(inst, "vlayout") == "col"
        for turn in (0, 1):
            descale = DESCALE_KINDS[(idx + 2 * turn) % len(DESCALE_KINDS)]
            case = base.replace(vcol=vcol, descale=descale)
            parts = [name, *label, f"descale_{descale or 'none'}", "vcol" if vcol else "vrow"]
            cases.append(("-".join(parts), case))
    return cases


def e4m3_fits(case: E4m3Case, inst: dict) -> str:
    """Why the e4m3 instance `inst` cannot run `case` ("" when it can): dtype, head dims, mask,
    mode, V's layout (read as given: row-major by vlayout-row instances, V^T by vlayout-col
    ones), lse."""
    if inst.get("dtype") != "e4m3":
        return "dtype"
    if (case.d, case.dv) != (inst["hdim_q"], inst["hdim_v"]):
        return "hdim"
    if case.mask != trait(inst, "mask"):
        return "mask"
    if ("group" if case.group else "batch") != trait(inst, "mode"):
        return "mode"
    if ("col" if case.vcol else "row") != trait(inst, "vlayout"):
        return "vlayout"
    if case.lse and not trait(inst, "lse"):
        return "lse"
    return ""


def e4m3_study_cases(inst: dict, seqlen: int = 1000) -> list[tuple[str, E4m3Case]]:
    """The accuracy study's input kinds (STUDY_KINDS) on one instance, per-tensor and per-head
    descales: seqlen_q = seqlen_k = seqlen (batch mode) or one sequence of them (group mode),
    4 heads, under the instance's mask (causal bottom-right, a window (256, 0))."""
    shape = (dict(seqlens_q=(seqlen,), seqlens_k=(seqlen,)) if trait(inst, "mode") == "group"
             else dict(b=1, sq=seqlen, sk=seqlen))
    base = E4m3Case(d=inst["hdim_q"], dv=inst["hdim_v"], hq=4, hk=4, lse=bool(trait(inst, "lse")),
                    vcol=trait(inst, "vlayout") == "col", **shape)
    mask = trait(inst, "mask")
    if mask == "causal":
        base = base.replace(causal=True, align="bottom_right")
    elif mask == "window":
        base = base.replace(window=(256, 0), align="bottom_right")
    return [(f"{kind}-descale_{descale}", base.replace(kind=kind, descale=descale))
            for kind in STUDY_KINDS for descale in ("tensor", "head")]


# ---------------------------------------------------------------------------------------------
# The backward reference.
# ---------------------------------------------------------------------------------------------


@dataclass
class Gradients:
    """attention_grads()' result: the forward's (out, lse) and the gradients, detached."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: Optional[torch.Tensor] = None


def attention_grads(q, k, v, dout, *, dbias=False, bwd_out=None, compute_dtype=torch.float64,
                    **kwargs) -> Gradients:
    """fmha.bwd's semantics: torch.autograd.grad of attention_reference(q, k, v, **kwargs) at
    dout, computed in compute_dtype (float64: the truth; the input dtype: the same backward in
    the input precision, as PyTorch's autograd runs it, the yardstick of the pass rule).

    q, k, v (and with dbias the elementwise bias: `bias`, or a float `attn_mask`) become leaves
    of compute_dtype, so the gradients have their shapes: dk and dv summed over the query heads
    that share a K/V head, dbias over the dimensions the bias broadcasts. dout has out's shape;
    its rows that no sequence uses are not read (they may be NaN). Rows that no sequence uses,
    query rows that see no key and keys that no row sees get gradient 0.

    bwd_out: the forward's output as the backward reads it (rounded to the input dtype, or a
    forward kernel's). FlashAttention's backward takes D_i = dO_i . O_i from it, in
    dS_ij = P_ij (dP_ij - D_i); the gradients are then those of that D, which differs from the
    exact one by the output's own error (with one visible key, dS is that difference alone).
    """

    def leaf(t):
        return t.detach().to(compute_dtype).requires_grad_()

    q, k, v = leaf(q), leaf(k), leaf(v)
    leaves = [q, k, v]
    if dbias:
        name = "bias" if kwargs.get("bias") is not None else "attn_mask"
        if kwargs.get(name) is None or kwargs[name].dtype == torch.bool:
            raise ValueError("dbias needs a float bias or attn_mask (a bool mask has no "
                             "gradient: pass its 0/-inf bias, as_bias(None, mask, dtype))")
        kwargs = dict(kwargs, **{name: leaf(kwargs[name])})
        leaves.append(kwargs[name])
    out, lse = attention_reference(q, k, v, compute_dtype=compute_dtype, **kwargs)
    used = ~out.isnan()  # rows no sequence uses stay NaN, and their dout is never read
    grad_out = torch.where(used, dout.to(compute_dtype), torch.zeros_like(out))
    # D_i of bwd_out moves dS_ij by -P_ij (D_i(bwd_out) - D_i(out)): the gradient, at s, of
    # -(that difference) * lse_i, since d lse_i / d s_ij = P_ij.
    grad_lse = torch.zeros_like(lse)
    if bwd_out is not None:
        moved = torch.where(used, bwd_out.to(compute_dtype) - out.detach(), torch.zeros_like(out))
        grad_lse = -(grad_out * moved).sum(-1).transpose(-1, -2)
    grads = torch.autograd.grad((out, lse), leaves, (grad_out, grad_lse))
    return Gradients(out.detach(), lse.detach(), *grads)


# ---------------------------------------------------------------------------------------------
# Problems of the GPU tests: a spec, its tensors, and the pass rule.
# ---------------------------------------------------------------------------------------------

BIAS_KINDS = ("11", "attn_bool", "b1", "1h", "full", "key", "attn_float2d")
ALIBI_KINDS = ("head", "batch_head")
# Spec.kramp of the kramp cases: over 700 keys in 80- to 128-key tiles, consecutive tiles' logit
# maxima differ by about 2.5 * 24 / 6 standard deviations, ~15 in log2 units.
KRAMP = 24.0
LAYOUTS = ("bshd", "bhsd", "poison")


@dataclass
class Spec(_MaskedProblem):
    """One fmha.fwd problem.

    Batch mode: b, sq, sk (used_q / used_k: seqused per sequence). Group mode (seqlens_q set):
    the used lengths of each sequence, pad_q / pad_k the physical rows after each (seqused is
    passed when any pad is given). layout: "bshd" (contiguous), "bhsd" (transposes of (b, h, s,
    d) storage) or "poison" (views into NaN-filled buffers that are longer in the sequence and
    the head dim, and NaN in every row a kernel must not use). bias: one of BIAS_KINDS; alibi:
    one of ALIBI_KINDS. qscale multiplies Q. kramp scales K's rows by a ramp along the (packed)
    sequence axis, from 1 up to 1 + kramp, or for kramp < 0 from 1 - kramp down to 1: walked
    the way the logits grow, each key tile's max then passes the running max by several times
    2^8 and by less, so an online softmax rescales O in some steps and keeps a stale max in
    others, whichever way a kernel walks the keys (fa2 first to last, fa3 last to first).
    dbias (the backward only): the gradient of the elementwise bias is asked for too.
    """

    dtype: torch.dtype
    d: int
    dv: int
    hq: int = 1
    hk: int = 1
    b: int = 1
    sq: int = 1
    sk: int = 1
    used_q: Optional[list] = None
    used_k: Optional[list] = None
    seqlens_q: Optional[list] = None
    seqlens_k: Optional[list] = None
    pad_q: Optional[list] = None
    pad_k: Optional[list] = None
    causal: bool = False
    window: tuple = (-1, -1)
    align: str = "top_left"
    bias: Optional[str] = None
    alibi: Optional[str] = None
    softcap: float = 0.0
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    lse: bool = False
    vcol: bool = False
    layout: str = "bshd"
    scale: Optional[float] = None
    qscale: float = 1.0
    kramp: float = 0.0
    dbias: bool = False

    def describe(self) -> str:
        dt = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.dtype, str(self.dtype))
        parts = [dt, f"d{self.d}/{self.dv}", f"h{self.hq}/{self.hk}"]
        if self.group:
            parts.append(f"q{self.seqlens_q}+{self.pad_q} k{self.seqlens_k}+{self.pad_k}")
        else:
            parts.append(f"b{self.b} {self.sq}x{self.sk}")
            if self.used_q or self.used_k:
                parts.append(f"used q{self.used_q} k{self.used_k}")
        if self.causal:
            parts.append("causal")
        if self.windowed:
            parts.append(f"window{tuple(self.window)}")
        if self.causal or self.windowed or self.alibi:
            parts.append(self.align)
        for name in ("bias", "alibi"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        if self.softcap:
            parts.append(f"softcap={self.softcap}")
        if self.dropout_p:
            parts.append(f"dropout={self.dropout_p} seed={self.seed:#x} off={self.offset}")
        if self.lse:
            parts.append("lse")
        if self.vcol:
            parts.append("vcol")
        if self.layout != "bshd":
            parts.append(self.layout)
        if self.scale is not None:
            parts.append(f"scale={self.scale:.4g}")
        if self.kramp:
            parts.append(f"kramp={self.kramp:g}")
        if self.dbias:
            parts.append("dbias")
        return " ".join(parts)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    fwd_kwargs: dict          # fmha.fwd's keyword arguments (no instance)
    ref_kwargs: dict          # attention_reference's (no dropout_keep)
    keep_shape: Optional[tuple] = None  # (batch, nhead, seqlen_q, seqlen_k) of the keep pattern
    spec: Optional[Spec] = None
    extra: dict = field(default_factory=dict)
    dout: Optional[torch.Tensor] = None  # make_inputs(grad=True): the output's gradient


def _round8(x: int) -> int:
    return (x + 7) // 8 * 8


def _tensor(lead: tuple, s: int, h: int, dim: int, *, layout, dtype, device, gen, scale=1.0,
            dead_rows=None, col=False):
    """A (*lead, s, h, dim) view (lead = (b,) in batch mode, () in group mode) in the layout.

    dead_rows: per lead index (batch) or, in group mode, a bool (s,) mask of the rows a kernel
    must not use; NaN in the poison layout, random otherwise (a wrong answer if used).
    col: seq dimension contiguous (V^T storage), its stride rounded up to a multiple of 8.
    """
    poison = layout == "poison"
    if col:
        s_store = _round8(s) + (8 if poison else 0)
        fill = float("nan") if poison else 0.0
        buf = torch.full((*lead, h, dim + (8 if poison else 0), s_store), fill, dtype=dtype,
                         device=device)
        inner = buf[..., :dim, :s]
        n = len(lead)
        view = inner.permute(*range(n), n + 2, n, n + 1)  # (*lead, s, h, dim), seq stride 1
    else:
        view = _layout_view((*lead, s, h, dim), layout, dtype, device)
    values = torch.randn((*lead, s, h, dim), generator=gen, device="cpu", dtype=torch.float32)
    view.copy_((values * scale).to(dtype))
    if dead_rows is not None and poison:  # otherwise they keep their random values
        for idx, rows in dead_rows:
            target = view[idx] if idx is not None else view
            target[rows] = float("nan")
    return view


def _layout_view(shape: tuple, layout: str, dtype, device) -> torch.Tensor:
    """An uninitialized (*lead, s, h, dim) view in the layout (see Spec): "poison" views a
    NaN-filled buffer longer in s and dim."""
    *lead, s, h, dim = shape
    if layout == "bhsd":
        return torch.empty((*lead, h, s, dim), dtype=dtype, device=device).transpose(-3, -2)
    if layout == "poison":
        buf = torch.full((*lead, s + 3, h, dim + 8), float("nan"), dtype=dtype, device=device)
        return buf[..., :s, :, :dim]
    return torch.empty(shape, dtype=dtype, device=device)


def in_layout(values: torch.Tensor, layout: str, dtype=None) -> torch.Tensor:
    """A copy of the (*lead, s, h, dim) `values` (in `dtype`, default theirs) in the layout: the
    output of the forward as the backward's caller holds it."""
    view = _layout_view(tuple(values.shape), layout, dtype or values.dtype, values.device)
    return view.copy_(values)


def _ramp(spec: Spec, rows: int):
    """K's row scale (Spec.kramp): a float, or an (s, 1, 1) ramp over the sequence axis."""
    if not spec.kramp:
        return 1.0
    ramp = torch.linspace(0.0, abs(spec.kramp), rows).view(rows, 1, 1)
    return 1.0 + (ramp if spec.kramp > 0 else ramp.flip(0))


def make_inputs(spec: Spec, device="cuda", seed: int = 0, grad: bool = False) -> Inputs:
    """The tensors and keyword arguments of `spec`, drawn from a CPU generator seeded by seed.
    grad: also the output's gradient dout, in the layout of q (poison: NaN in the rows no
    sequence uses), drawn last so that the forward's tensors are those of grad=False."""
    gen = torch.Generator().manual_seed(seed)
    dt = spec.dtype
    T = dict(dtype=dt, device=device, gen=gen)
    fwd: dict = {}
    ref: dict = {}
    if spec.group:
        nb = len(spec.seqlens_q)
        pad_q = spec.pad_q or [0] * nb
        pad_k = spec.pad_k or [0] * nb
        phys_q = [u + p for u, p in zip(spec.seqlens_q, pad_q)]
        phys_k = [u + p for u, p in zip(spec.seqlens_k, pad_k)]
        cu_q = [0]
        cu_k = [0]
        for a, c in zip(phys_q, phys_k):
            cu_q.append(cu_q[-1] + a)
            cu_k.append(cu_k[-1] + c)
        total_q, total_k = cu_q[-1], cu_k[-1]
        dead_q = torch.zeros(total_q, dtype=torch.bool)
        dead_k = torch.zeros(total_k, dtype=torch.bool)
        for b in range(nb):
            dead_q[cu_q[b] + spec.seqlens_q[b]:cu_q[b + 1]] = True
            dead_k[cu_k[b] + spec.seqlens_k[b]:cu_k[b + 1]] = True
        dq = [(None, dead_q.to(device))] if dead_q.any() else None
        dk = [(None, dead_k.to(device))] if dead_k.any() else None
        q = _tensor((), total_q, spec.hq, spec.d, layout=spec.layout, scale=spec.qscale,
                    dead_rows=dq, **T)
        k = _tensor((), total_k, spec.hk, spec.d, layout=spec.layout, scale=_ramp(spec, total_k),
                    dead_rows=dk, **T)
        v = _tensor((), total_k, spec.hk, spec.dv, layout=spec.layout, dead_rows=dk,
                    col=spec.vcol, **T)
        max_q, max_k = max(phys_q, default=0), max(phys_k, default=0)
        cu = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                  cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
                  max_seqlen_q=max_q, max_seqlen_k=max_k)
        fwd.update(cu)
        ref.update(cu)
        if spec.pad_q is not None or spec.pad_k is not None:
            used = dict(seqused_q=torch.tensor(spec.seqlens_q, dtype=torch.int32, device=device),
                        seqused_k=torch.tensor(spec.seqlens_k, dtype=torch.int32, device=device))
            fwd.update(used)
            ref.update(used)
        nbatch, bias_sq, bias_sk = nb, max_q, max_k
    else:
        nb = spec.b
        dq = dk = None
        if spec.used_q is not None:
            dq = [(b, slice(u, None)) for b, u in enumerate(spec.used_q) if u < spec.sq]
        if spec.used_k is not None:
            dk = [(b, slice(u, None)) for b, u in enumerate(spec.used_k) if u < spec.sk]
        q = _tensor((nb,), spec.sq, spec.hq, spec.d, layout=spec.layout, scale=spec.qscale,
                    dead_rows=dq, **T)
        k = _tensor((nb,), spec.sk, spec.hk, spec.d, layout=spec.layout,
                    scale=_ramp(spec, spec.sk), dead_rows=dk, **T)
        v = _tensor((nb,), spec.sk, spec.hk, spec.dv, layout=spec.layout, dead_rows=dk,
                    col=spec.vcol, **T)
        for name, used in (("seqused_q", spec.used_q), ("seqused_k", spec.used_k)):
            if used is not None:
                t = torch.tensor(used, dtype=torch.int32, device=device)
                fwd[name] = t
                ref[name] = t
        nbatch, bias_sq, bias_sk = nb, spec.sq, spec.sk

    if spec.causal:
        fwd["causal"] = True
        ref["causal"] = True
    if spec.windowed:
        fwd["window_size"] = tuple(spec.window)
        ref["window_size"] = tuple(spec.window)
    if spec.causal or spec.windowed or spec.alibi:
        fwd["mask_align"] = spec.align
        ref["mask_align"] = spec.align
    if spec.scale is not None:
        fwd["softmax_scale"] = spec.scale
        ref["softmax_scale"] = spec.scale

    if spec.bias:
        name, tensor = _bias(spec.bias, nbatch, spec.hq, bias_sq, bias_sk, dt, device, gen)
        fwd[name] = tensor
        ref[name] = tensor
    if spec.alibi:
        shape = (spec.hq,) if spec.alibi == "head" else (nbatch, spec.hq)
        slopes = (torch.rand(shape, generator=gen) * 0.5 + 0.01).to(device)
        fwd["alibi_slopes"] = slopes
        ref["alibi_slopes"] = slopes
    if spec.softcap:
        fwd["softcap"] = spec.softcap
        ref["softcap"] = spec.softcap
    keep_shape = None
    if spec.dropout_p:
        fwd.update(dropout_p=spec.dropout_p, dropout_seed=spec.seed, dropout_offset=spec.offset)
        ref["dropout_p"] = spec.dropout_p
        keep_shape = (nbatch, spec.hq, bias_sq, bias_sk)
    if spec.lse:
        fwd["return_lse"] = True
    dout = None
    if grad:
        lead = () if spec.group else (nb,)
        rows = q.shape[len(lead)]
        dout = _tensor(lead, rows, spec.hq, spec.dv, layout=spec.layout, dead_rows=dq, **T)
    return Inputs(q, k, v, fwd, ref, keep_shape, spec, dout=dout)


def _bias(kind, b, h, sq, sk, dtype, device, gen):
    """(keyword, tensor) of a bias kind; group mode passes the longest lengths as sq, sk."""

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    if kind == "11":
        return "bias", randn(1, 1, sq, sk)
    if kind == "b1":
        return "bias", randn(b, 1, sq, sk)
    if kind == "1h":
        return "bias", randn(1, h, sq, sk)
    if kind == "full":  # a view with a padded row stride: only the key dimension is contiguous
        store = torch.randn((b, h, sq, _round8(sk) + 8), generator=gen).to(dtype).to(device)
        return "bias", store[..., :sk]
    if kind == "key":  # a key-padding bias, broadcast over heads and query rows
        return "bias", randn(b, 1, 1, sk)
    if kind == "attn_bool":
        allowed = torch.rand((b, h, sq, sk), generator=gen) < 0.8
        if sq > 0:
            allowed[:, :, 0, :] = False  # every sequence's first row sees nothing
            allowed[0, 0, sq // 2, :] = False
        return "attn_mask", allowed.to(device)
    if kind == "attn_float2d":
        return "attn_mask", randn(sq, sk)
    raise ValueError(f"unknown bias kind {kind!r}; valid: {BIAS_KINDS}")


def ulp(x: float, dtype) -> float:
    """The spacing of `dtype` numbers at |x|."""
    if x == 0 or not math.isfinite(x):
        return 0.0
    mant = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}[dtype]
    return 2.0 ** (math.floor(math.log2(abs(x))) - mant)


@dataclass
class Comparison:
    err: float       # max |out - truth| over the defined elements
    lowp_err: float  # the same for the input-precision computation
    tol: float       # 2 * lowp_err + atol
    ref_max: float   # max |truth|
    lse_err: float = 0.0

    @property
    def rel(self) -> float:
        return self.err / self.ref_max if self.ref_max > 0 else self.err

    @property
    def ratio(self) -> float:
        return self.err / self.tol if self.tol > 0 else 0.0


def compare(out, ref, lowp, *, dtype, lse=None, ref_lse=None, what: str = "") -> Comparison:
    """The pass rule (FlashAttention-3's and FlexAttention's): the error against the float64
    truth is at most twice the error of the same attention computed in the input precision,
    plus 1e-4 and half an ulp of the largest output (the rounding any output pays once).

    Elements that are NaN in `ref` (rows the kernel leaves untouched) are not compared. Rows
    that see no key must be exactly 0 with lse -inf; lse elsewhere within 1e-3 + 1e-4 |lse|.
    """
    assert out.shape == ref.shape, f"{what}: output shape {tuple(out.shape)} != {tuple(ref.shape)}"
    defined = ~torch.isnan(ref)
    o = out.double()
    bad = torch.isnan(o) & defined
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} NaN output elements in rows the kernel must write "
        f"(first at {tuple(bad.nonzero()[0].tolist())})")
    if defined.any():
        diff = (o - ref).abs()[defined]
        err = diff.max().item()
        lowp_err = (lowp.double() - ref).abs()[defined].max().item()
        ref_max = ref.abs()[defined].max().item()
    else:
        err = lowp_err = ref_max = 0.0
    tol = 2 * lowp_err + 1e-4 + 0.5 * ulp(ref_max, dtype)
    where = ""
    if err > tol:
        full = (o - ref).abs().nan_to_num(0.0)
        idx = tuple(torch.nonzero(full == full.max())[0].tolist())
        where = f" at {idx}: got {o[idx].item():.6g}, want {ref[idx].item():.6g}"
    assert err <= tol, (
        f"{what}: max error {err:.4g} > {tol:.4g} (2 x {lowp_err:.4g} in {dtype} + atol){where}")

    lse_err = 0.0
    if ref_lse is not None:
        assert lse is not None, f"{what}: no lse returned"
        assert lse.shape == ref_lse.shape, (
            f"{what}: lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}")
        assert lse.dtype == torch.float32, f"{what}: lse dtype {lse.dtype}, want float32"
        l = lse.double()
        empty = torch.isneginf(ref_lse)
        finite = torch.isfinite(ref_lse)
        if empty.any():
            got = l[empty]
            wrong = got[~torch.isneginf(got)][:4].tolist()
            assert torch.isneginf(got).all(), (
                f"{what}: rows that see no key must have lse -inf; got {wrong}")
            # Their outputs must be exactly 0.
            rows = empty.permute(0, 2, 1) if out.dim() == 4 else empty.transpose(0, 1)
            zero_rows = o[rows]
            assert (zero_rows == 0).all(), f"{what}: rows that see no key must be 0"
        if finite.any():
            assert not torch.isnan(l[finite]).any(), f"{what}: NaN lse in rows that see keys"
            d = (l[finite] - ref_lse[finite]).abs()
            lse_err = d.max().item()
            tol_l = 1e-3 + 1e-4 * ref_lse[finite].abs()
            bad = d > tol_l
            assert not bad.any(), (
                f"{what}: lse error {lse_err:.4g} (ref {ref_lse[finite][bad][0].item():.6g}, "
                f"got {l[finite][bad][0].item():.6g})")
    return Comparison(err, lowp_err, tol, ref_max, lse_err)


# ---------------------------------------------------------------------------------------------
# The cases of one compiled instance (tests/test_fwd_gpu.py).
# ---------------------------------------------------------------------------------------------

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# (left, right, causal) of the window instances' cases, taken in turn.
WINDOW_CASES = [(37, -1, False), (-1, 5, False), (16, 16, False), (0, 0, False), (64, -1, True),
                (-1, 0, False), (100, 3, False), (2, 50, False), (0, -1, False)]
SOFTCAPS = (5.0, 30.0, 1.0)
DROPOUT_PS = (0.17, 0.5, 0.9)


def trait(inst: dict, key: str):
    """An instance's trait, with the defaults of a manifest that predates the key."""
    defaults = dict(mask="none", bias="none", vlayout="row", mode="batch", lse=False,
                    dropout=False, softcap=False, pad_seqlen=True, pad_hdim=False, dbias=False)
    return inst.get(key, defaults.get(key))


def _floor8(x: int) -> int:
    return max(8, x // 8 * 8)


def _shapes(inst: dict) -> list[tuple[str, dict]]:
    m, n = inst["block_m"], inst["block_n"]
    if trait(inst, "mode") == "group":
        return [
            ("1x1", dict(seqlens_q=[1], seqlens_k=[1])),
            ("varlen_padded", dict(seqlens_q=[77, 130, 1], seqlens_k=[30, 77, 0], pad_q=[3, 0, 5],
                                   pad_k=[16, 1, 4], hq=4, hk=2, layout="poison")),
            ("zeros_gqa8", dict(seqlens_q=[0, 17, 300, 1], seqlens_k=[5, 0, 280, 64], hq=8, hk=1)),
            ("bhsd", dict(seqlens_q=[200, 64], seqlens_k=[64, 200], hq=2, hk=2, layout="bhsd")),
            ("tiles", dict(seqlens_q=[2 * m, m], seqlens_k=[3 * n, n], hq=2, hk=1)),
            ("long", dict(seqlens_q=[4097], seqlens_k=[1000], pad_q=[0], pad_k=[5])),
            ("kramp_up", dict(seqlens_q=[150, 64], seqlens_k=[700, 300], kramp=KRAMP)),
            ("kramp_down", dict(seqlens_q=[150, 64], seqlens_k=[700, 300], kramp=-KRAMP)),
        ]
    if trait(inst, "pad_seqlen"):
        return [
            ("1x1", dict(b=1, sq=1, sk=1)),
            ("q_gt_k", dict(b=1, sq=300, sk=77, hq=2, hk=2, layout="poison")),
            ("q_lt_k_gqa8", dict(b=2, sq=77, sk=300, hq=8, hk=1)),
            ("decode", dict(b=2, sq=1, sk=300, hq=4, hk=2, layout="bhsd")),
            ("seqused", dict(b=3, sq=130, sk=200, used_q=[130, 1, 60], used_k=[200, 65, 0], hq=4,
                             hk=1, layout="poison")),
            ("long", dict(b=1, sq=4097, sk=1000, layout="bhsd")),
            ("tiles", dict(b=2, sq=2 * m, sk=3 * n, hq=2, hk=2)),
            ("kramp_up", dict(b=1, sq=200, sk=700, hq=2, hk=1, kramp=KRAMP)),
            ("kramp_down", dict(b=1, sq=200, sk=700, hq=2, hk=1, kramp=-KRAMP)),
        ]
    return [
        ("tile", dict(b=1, sq=m, sk=n)),
        ("q_gt_k", dict(b=1, sq=3 * m, sk=n, hq=2, hk=2, layout="poison")),
        ("q_lt_k_gqa8", dict(b=2, sq=m, sk=4 * n, hq=8, hk=1)),
        ("bhsd", dict(b=2, sq=2 * m, sk=2 * n, hq=4, hk=2, layout="bhsd")),
        ("long", dict(b=1, sq=m * -(-4097 // m), sk=8 * n)),
        ("kramp_up", dict(b=1, sq=2 * m, sk=8 * n, hq=2, hk=1, kramp=KRAMP)),
        ("kramp_down", dict(b=1, sq=2 * m, sk=8 * n, hq=2, hk=1, kramp=-KRAMP)),
    ]


def _hdim_shapes(inst: dict) -> list[tuple[str, dict]]:
    """Head dims below a pad_hdim instance's, multiples of 8: just below, and about half."""
    dq, dv = inst["hdim_q"], inst["hdim_v"]
    a = dict(d=max(8, dq - 8), dv=max(8, dv - 8))
    b = dict(d=_floor8(dq // 2), dv=max(8, _floor8(dv // 2) - 8))
    if trait(inst, "mode") == "group":
        return [(f"hdim{a['d']}_{a['dv']}", dict(seqlens_q=[100, 30], seqlens_k=[150, 31], hq=2,
                                                 hk=1, **a)),
                (f"hdim{b['d']}_{b['dv']}", dict(seqlens_q=[65], seqlens_k=[33], pad_q=[4],
                                                 pad_k=[9], layout="poison", **b))]
    return [(f"hdim{a['d']}_{a['dv']}", dict(b=2, sq=100, sk=150, hq=2, hk=1, **a)),
            (f"hdim{b['d']}_{b['dv']}", dict(b=1, sq=65, sk=33, layout="poison", **b))]


def apply_traits(spec: Spec, inst: dict, idx: int) -> tuple[Spec, str]:
    """Gives `spec` the functional traits of `inst`, varied by the case index; returns it and a
    short label of the variant."""
    label = []
    align = ALIGNS[idx % 2]
    short = "tl" if align == "top_left" else "br"
    mask = trait(inst, "mask")
    if mask == "causal":
        spec = spec.replace(causal=True, align=align)
        label.append(f"causal_{short}")
    elif mask == "window":
        left, right, causal = WINDOW_CASES[idx % len(WINDOW_CASES)]
        spec = spec.replace(window=(left, right), causal=causal, align=align)
        label.append(f"win{left}_{right}{'_causal' if causal else ''}_{short}")
    bias = trait(inst, "bias")
    if bias == "elementwise":
        spec = spec.replace(bias=BIAS_KINDS[idx % len(BIAS_KINDS)])
        label.append(f"bias_{spec.bias}")
    elif bias == "alibi":
        spec = spec.replace(alibi=ALIBI_KINDS[(idx // 2) % 2], align=align)
        label.append(f"alibi_{spec.alibi}" + ("" if mask != "none" else f"_{short}"))
    if trait(inst, "softcap"):
        spec = spec.replace(softcap=SOFTCAPS[idx % 3], qscale=3.0)
        label.append(f"softcap{spec.softcap:g}")
    if trait(inst, "dropout"):
        # Seeds past 2^32 exercise the key's high word.
        spec = spec.replace(dropout_p=DROPOUT_PS[idx % 3], seed=0x5EED + idx * 0x1_0000_0001,
                            offset=3 * idx)
        label.append(f"dropout{spec.dropout_p:g}")
    if trait(inst, "lse") and idx != 2:  # lse instances also serve calls without lse
        spec = spec.replace(lse=True)
        label.append("lse")
    if trait(inst, "vlayout") == "col":
        spec = spec.replace(vcol=True)
        label.append("vcol")
    if idx % 4 == 3:
        spec = spec.replace(scale=0.8 / math.sqrt(spec.d))
    return spec, "-".join(label)


def instance_specs(inst: dict) -> list[tuple[str, Spec]]:
    """The cases of one instance: (id, spec), every spec within the instance's traits."""
    dtype = DTYPES[inst["dtype"]]
    shapes = _shapes(inst) + (_hdim_shapes(inst) if trait(inst, "pad_hdim") else [])
    cases = []
    for idx, (name, shape) in enumerate(shapes):
        shape = dict(shape)
        spec = Spec(dtype=dtype, d=shape.pop("d", inst["hdim_q"]),
                    dv=shape.pop("dv", inst["hdim_v"]), **shape)
        spec, label = apply_traits(spec, inst, idx)
        cases.append((f"{name}-{label}" if label else name, spec))
    return cases


def fits(spec: Spec, inst: dict) -> str:
    """Why `inst` cannot run `spec` ("" when it can), by the rules of fmha.h and the manifest."""
    if DTYPES[inst["dtype"]] != spec.dtype:
        return "dtype"
    exact = spec.d == inst["hdim_q"] and spec.dv == inst["hdim_v"]
    padded = (spec.d <= inst["hdim_q"] and spec.dv <= inst["hdim_v"] and spec.d % 8 == 0
              and spec.dv % 8 == 0)
    if not (exact or (trait(inst, "pad_hdim") and padded)):
        return "hdim"
    if spec.mask != trait(inst, "mask"):
        return "mask"
    bias = "elementwise" if spec.bias else ("alibi" if spec.alibi else "none")
    if bias != trait(inst, "bias"):
        return "bias"
    if ("col" if spec.vcol else "row") != trait(inst, "vlayout"):
        return "vlayout"
    if ("group" if spec.group else "batch") != trait(inst, "mode"):
        return "mode"
    if spec.lse and not trait(inst, "lse"):
        return "lse"
    if bool(spec.dropout_p) != bool(trait(inst, "dropout")):
        return "dropout"
    if bool(spec.softcap) != bool(trait(inst, "softcap")):
        return "softcap"
    if not trait(inst, "pad_seqlen"):
        if spec.group or spec.used_q or spec.used_k:
            return "pad_seqlen (group mode or seqused)"
        if spec.sq % inst["block_m"] or spec.sk % inst["block_n"]:
            return "pad_seqlen (lengths not tile multiples)"
    return ""


def bwd_instance_specs(inst: dict) -> list[tuple[str, Spec]]:
    """The cases of one backward instance (a row of fmha.bwd_instances()): the forward's shapes
    and trait variants (instance_specs: a backward instance has no V layout or lse trait, so
    no case asks for V^T), each asking for the bias gradient where the instance writes it."""
    cases = instance_specs(inst)
    if trait(inst, "dbias"):
        cases = [(f"{case_id}-dbias", spec.replace(dbias=True)) for case_id, spec in cases]
    return cases


def fits_bwd(spec: Spec, inst: dict) -> str:
    """Why the backward instance `inst` cannot run `spec` ("" when it can)."""
    if spec.dbias != bool(trait(inst, "dbias")):
        return "dbias"
    return fits(spec, inst)


# ---------------------------------------------------------------------------------------------
# One call of fmha.fwd against the reference (the module is passed in: nothing here imports it).
# ---------------------------------------------------------------------------------------------


def split_result(result, spec: Spec):
    """(out, lse) of fmha.fwd's result; lse None when the spec did not ask for it."""
    if spec.lse:
        assert isinstance(result, tuple) and len(result) == 2, "return_lse=True returns (out, lse)"
        return result
    assert isinstance(result, torch.Tensor), "return_lse=False returns the output alone"
    return result, None


def keep_pattern(fmha, spec: Spec, inputs: Inputs) -> torch.Tensor:
    """fmha.dropout_mask's pattern for the spec, after checking it against dropout_keep_mask."""
    b, h, sq, sk = inputs.keep_shape
    keep = fmha.dropout_mask(spec.seed, spec.offset, spec.dropout_p, b, h, sq, sk)
    assert tuple(keep.shape) == (b, h, sq, sk) and keep.dtype == torch.uint8, (
        f"fmha.dropout_mask: {tuple(keep.shape)} {keep.dtype}, want {(b, h, sq, sk)} uint8")
    want = dropout_keep_mask(spec.seed, spec.offset, spec.dropout_p, b, h, sq, sk,
                             device=keep.device)
    assert torch.equal(keep, want), "fmha.dropout_mask differs from reference.dropout_keep_mask"
    return keep


def check_fwd(fmha, spec: Spec, *, instance=None, seed=0, device="cuda", what="",
              inputs: Optional[Inputs] = None) -> Comparison:
    """Runs `spec` through fmha.fwd (forced to `instance` when given) and compares it with the
    float64 reference under the pass rule of compare(); returns the Comparison. `inputs`:
    make_inputs(spec, device, seed) when not given."""
    inputs = inputs if inputs is not None else make_inputs(spec, device, seed)
    keep = keep_pattern(fmha, spec, inputs) if spec.dropout_p else None
    what = f"{what or instance or 'dispatcher'} [{spec.describe()}]"
    result = fmha.fwd(inputs.q, inputs.k, inputs.v, **inputs.fwd_kwargs, instance=instance)
    if inputs.q.is_cuda:
        torch.cuda.synchronize()  # surfaces asynchronous CUDA errors here
    out, lse = split_result(result, spec)
    expect = (*inputs.q.shape[:-1], spec.dv)
    assert tuple(out.shape) == expect, f"{what}: output shape {tuple(out.shape)}, want {expect}"
    assert out.dtype == spec.dtype and out.device == inputs.q.device, (
        f"{what}: output {out.dtype} on {out.device}")
    ref, ref_lse = attention_reference(inputs.q, inputs.k, inputs.v, **inputs.ref_kwargs,
                                       dropout_keep=keep)
    lowp, _ = attention_reference(inputs.q, inputs.k, inputs.v, **inputs.ref_kwargs,
                                  dropout_keep=keep, compute_dtype=spec.dtype)
    return compare(out, ref, lowp, dtype=spec.dtype, lse=lse,
                   ref_lse=ref_lse if spec.lse else None, what=what)


# ---------------------------------------------------------------------------------------------
# One call of fmha.bwd against the reference.
# ---------------------------------------------------------------------------------------------


def grad_kwargs(inputs: Inputs) -> tuple[dict, dict]:
    """(fmha.bwd's keyword arguments, attention_grads') for a problem of make_inputs: fwd's
    less return_lse, with an attn_mask passed as the bias it means (a bool mask as its 0/-inf
    bias, a float one as it is), the tensor whose gradient dbias is."""
    bwd = {name: value for name, value in inputs.fwd_kwargs.items() if name != "return_lse"}
    ref = dict(inputs.ref_kwargs)
    mask = bwd.pop("attn_mask", None)
    if mask is not None:
        del ref["attn_mask"]
        bwd["bias"] = ref["bias"] = (as_bias(None, mask, inputs.q.dtype)
                                     if mask.dtype == torch.bool else mask)
    return bwd, ref


@dataclass
class BwdCase:
    """One backward problem, ready to run: the forward's inputs and dout (make_inputs), the
    forward's output as the backward's caller holds it and its log-sum-exp (bwd_case says
    whose: the reference's are in the spec's layout and NaN in rows no sequence uses),
    fmha.bwd's keyword arguments, and the reference's gradients."""

    spec: Spec
    inputs: Inputs
    out: torch.Tensor
    lse: torch.Tensor
    kwargs: dict
    truth: Gradients
    lowp: Gradients

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.kwargs.get("bias")


def bwd_case(fmha, spec: Spec, device="cuda", seed: int = 0, forward=None) -> BwdCase:
    """The case of `spec`, its tensors drawn as make_inputs(spec, device, seed, grad=True).

    The backward reads the reference's output (rounded to the input dtype) and log-sum-exp, so
    that it is tested alone, whichever forward instances the build has; `forward` (fmha.fwd)
    gives it that forward's instead. The truth takes D_i = dO_i . O_i of the output the
    backward reads (attention_grads' bwd_out)."""
    inputs = make_inputs(spec, device, seed, grad=True)
    keep = keep_pattern(fmha, spec, inputs) if spec.dropout_p else None
    kwargs, ref = grad_kwargs(inputs)
    if forward is None:
        exact, lse = attention_reference(inputs.q, inputs.k, inputs.v, **ref, dropout_keep=keep)
        out, lse = in_layout(exact, spec.layout, spec.dtype), lse.float().contiguous()
    else:
        out, lse = forward(inputs.q, inputs.k, inputs.v, **kwargs, return_lse=True)
    args = (inputs.q, inputs.k, inputs.v, inputs.dout)
    truth = attention_grads(*args, **ref, dropout_keep=keep, dbias=spec.dbias, bwd_out=out)
    lowp = attention_grads(*args, **ref, dropout_keep=keep, dbias=spec.dbias,
                           compute_dtype=spec.dtype)
    return BwdCase(spec, inputs, out, lse, kwargs, truth, lowp)


def poison_allocator(shapes, device) -> None:
    """Frees NaN-filled blocks of each (shape, dtype), so that what a call then allocates with
    torch.empty of those sizes (outputs, scratch) most likely starts as NaN: the caching
    allocator hands a freed block of a fitting size on the same stream back first. A kernel
    that leaves part of an output unwritten, or reads scratch it did not clear, then shows."""
    blocks = [torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
              for shape, dtype in shapes]
    del blocks


GRAD_NAMES = ("dq", "dk", "dv", "dbias")


def run_bwd(fmha, case: BwdCase, **options) -> dict:
    """One fmha.bwd call of the case (options: instance, deterministic) on a poisoned allocator:
    its gradients by name, their shapes, dtypes and devices checked."""
    inp, spec = case.inputs, case.spec
    q, k, v = inp.q, inp.k, inp.v
    # dq, dk, dv; the workspace (an fp32 dQ accumulator and the dO.O row sums, in one block
    # whose size the library pads: that estimate and twice it); dbias, and the full one.
    workspace = q.numel() + case.lse.numel()
    shapes = [(q.shape, q.dtype), (k.shape, q.dtype), (v.shape, q.dtype),
              ((workspace,), torch.float32), ((2 * workspace,), torch.float32)]
    if spec.dbias:
        kw = case.kwargs
        if spec.group:
            full = (len(kw["cu_seqlens_q"]) - 1, q.shape[1], kw["max_seqlen_q"],
                    kw["max_seqlen_k"])
        else:
            full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        shapes += [(case.bias.shape, q.dtype), (full, q.dtype)]
    poison_allocator(shapes, q.device)
    result = fmha.bwd(inp.dout, q, k, v, case.out, case.lse, **case.kwargs,
                      return_dbias=spec.dbias, **options)
    if q.is_cuda:
        torch.cuda.synchronize()  # surfaces asynchronous CUDA errors here
    names = GRAD_NAMES if spec.dbias else GRAD_NAMES[:3]
    assert isinstance(result, tuple) and len(result) == len(names), (
        f"fmha.bwd(return_dbias={spec.dbias}) returns ({', '.join(names)})")
    got = dict(zip(names, result))
    for name, like in zip(names, (q, k, v, case.bias)):
        g = got[name]
        assert (tuple(g.shape), g.dtype, g.device) == (tuple(like.shape), q.dtype, q.device), (
            f"{name}: {tuple(g.shape)} {g.dtype} on {g.device}, want {tuple(like.shape)} "
            f"{q.dtype} on {q.device}")
    return got


def check_grads(case: BwdCase, got: dict, what: str = "") -> dict:
    """compare()'s pass rule on each gradient (the truth against the input-precision backward's
    error), and exact zeros where the truth is zero by the problem's structure: dq of query
    rows that see no key or that no sequence uses, dk and dv of keys that no row sees or no
    sequence uses. Returns the Comparison of each gradient by name."""
    results = {name: compare(value, getattr(case.truth, name), getattr(case.lowp, name),
                             dtype=case.spec.dtype, what=f"{what} {name}")
               for name, value in got.items()}
    lse = case.truth.lse
    no_key = ~torch.isfinite(lse)  # -inf: sees no key; NaN: no sequence uses the row
    no_key = no_key.permute(0, 2, 1) if lse.dim() == 3 else no_key.transpose(0, 1)
    assert (got["dq"][no_key] == 0).all(), (
        f"{what}: dq of query rows that see no key (or that no sequence uses) must be 0")
    unseen = (case.truth.dk == 0).all(-1) & (case.truth.dv == 0).all(-1)
    for name in ("dk", "dv"):
        assert (got[name][unseen] == 0).all(), (
            f"{what}: {name} of keys that no row sees (or no sequence uses) must be 0")
    return results


def check_bwd(fmha, spec: Spec, *, instance=None, seed=0, device="cuda", what="",
              calls: int = 2) -> dict:
    """Runs `spec` through fmha.bwd (forced to `instance` when given) `calls` times, each on a
    poisoned allocator (a second call finds what the first left in any scratch it keeps), and
    checks every call's gradients (check_grads); returns the last call's Comparisons."""
    case = bwd_case(fmha, spec, device, seed)
    what = f"{what or instance or 'dispatcher'} [{spec.describe()}]"
    results = {}
    for call in range(calls):
        results = check_grads(case, run_bwd(fmha, case, instance=instance),
                              f"{what} call {call + 1}")
    return results
