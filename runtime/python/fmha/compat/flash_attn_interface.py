"""FlashAttention-3's Hopper API (the `flash_attn_interface` module of its hopper/ package) on
fmha: flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache and
flash_attn_combine, with FlashAttention-3's names, signatures and defaults.

They map onto fmha.fwd (fmha.bwd as the backward), fmha.fwd_kvcache and, for the combine, torch
as fmha.compat.flash_attn's functions do (fmha.compat._attention): causal and windows aligned
bottom-right, softcap <= 0 off. FlashAttention-3 has no dropout and no ALiBi, and neither have
these.

FP8: flash_attn_func and flash_attn_varlen_func take torch.float8_e4m3fn q, k and v with
q_descale, k_descale and v_descale (fp32, (batch, nheads_k) or broadcast to it) and return
bfloat16, as FlashAttention-3's do, through fmha.fwd's e4m3 forward (forward only; descales
with 16-bit inputs are an error).

flash_attn_with_kvcache takes FlashAttention-3's FP8 call too (e4m3 q, caches and new tokens,
descales, bfloat16 out) on fmha.fwd_kvcache's e4m3 cache, whose queries are 16-bit (its kernel
dequantizes the cache): q is dequantized to bfloat16 here, one small elementwise op per call.

What FlashAttention-3 has and fmha does not raises NotImplementedError: qv, attention_chunk
other than 0, and in flash_attn_with_kvcache varlen queries (cu_seqlens_q), varlen appended
keys (cu_seqlens_k_new) and rotary_seqlens.
Knobs that only tune FlashAttention-3's kernels (num_splits of flash_attn_func and
flash_attn_varlen_func, pack_gqa, sm_margin, scheduler_metadata) are accepted and have no
effect; flash_attn_with_kvcache's num_splits is fmha.fwd_kvcache's. Bad arguments raise
ValueError or TypeError before anything runs; a row that sees no key has log-sum-exp -inf.
"""

from typing import Optional, Union

import torch

from fmha._checks import E4M3, _broadcasts, _descale_shapes
from fmha.compat._attention import (
    attend,
    attend_kvcache,
    check_bool,
    check_tensor,
    fwd_options,
    softcap_value,
    window,
)


def _refuse(api: str, **given) -> None:
    """NotImplementedError naming the first FlashAttention-3 feature of `given` (name: whether
    the call uses it) that fmha lacks."""
    for name, used in given.items():
        if used:
            raise NotImplementedError(f"{api}: {name} is a FlashAttention-3 feature fmha does "
                                      f"not have")


def _attention(api, q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
               return_attn_probs, descales, **varlen):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(api, name, t)
    check_bool(api, "causal", causal)
    check_bool(api, "deterministic", deterministic)
    check_bool(api, "return_attn_probs", return_attn_probs)
    options = fwd_options(causal, softmax_scale, window(api, window_size, causal),
                          softcap=softcap_value(api, softcap), **varlen)
    # FP8 (e4m3) inputs' descale factors, to fmha.fwd as they are (it checks them); only those
    # given, so that the options stay fmha.bwd's too.
    options.update({name: t for name, t in descales.items() if t is not None})
    return attend(q, k, v, options, deterministic, return_lse=return_attn_probs)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False):
    """Attention of q (batch, seqlen_q, nheads, headdim) against k, v (batch, seqlen_k,
    nheads_k, headdim[_v]), FlashAttention-3's flash_attn_func: causal, window_size, softcap,
    softmax_scale and deterministic as in FlashAttention-2's (fmha.compat.flash_attn). FP8:
    q, k, v torch.float8_e4m3fn with q_descale, k_descale, v_descale (fp32 (batch, nheads_k),
    or broadcast to it; None is 1), out bfloat16, no backward (fmha.fwd's e4m3 forward).

    Returns out (batch, seqlen_q, nheads, headdim_v), differentiable in q, k and v (16-bit
    inputs); with return_attn_probs (out, softmax_lse), softmax_lse (batch, nheads, seqlen_q)
    fp32."""
    api = "flash_attn_func"
    _refuse(api, qv=qv is not None, attention_chunk=attention_chunk != 0)
    return _attention(api, q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                      return_attn_probs, dict(q_descale=q_descale, k_descale=k_descale,
                                              v_descale=v_descale))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False):
    """flash_attn_func of sequences packed along the tokens: q (total_q, nheads, headdim), k, v
    (total_k, nheads_k, headdim[_v]), cu_seqlens_q, cu_seqlens_k int32 (batch + 1,),
    max_seqlen_q, max_seqlen_k ints; seqused_q, seqused_k (optional, int32 (batch,)): sequence
    b uses only its first seqused_q[b] queries and seqused_k[b] keys. FP8 (e4m3) inputs and
    their descales as flash_attn_func's, batch being the sequences (len(cu_seqlens_q) - 1):
    a descale's row b is sequence b's; v row-major (fmha.fwd's e4m3 V^T runs batch mode only).

    Returns out (total_q, nheads, headdim_v); with return_attn_probs (out, softmax_lse),
    softmax_lse (nheads, total_q) fp32."""
    api = "flash_attn_varlen_func"
    _refuse(api, qv=qv is not None, attention_chunk=attention_chunk != 0)
    return _attention(api, q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                      return_attn_probs, dict(q_descale=q_descale, k_descale=k_descale,
                                              v_descale=v_descale),
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
                      seqused_k=seqused_k)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Partial attention results over disjoint sets of keys merged by their log-sum-exp (the
    combine step of split-KV attention), in torch.

    out_partial: fp32 (num_splits, batch, seqlen, nheads, headdim) or (num_splits, total,
    nheads, headdim); lse_partial: fp32 of out_partial's shape less headdim. out (optional):
    where to write the result; out_dtype: its dtype otherwise (default out_partial's).

    Returns (out, softmax_lse): out of out_partial's shape less num_splits, softmax_lse fp32 of
    lse_partial's shape less num_splits. A split whose lse is -inf contributes nothing."""
    api = "flash_attn_combine"
    check_tensor(api, "out_partial", out_partial)
    check_tensor(api, "lse_partial", lse_partial)
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if t.dtype != torch.float32:
            raise TypeError(f"{api}: {name} must be torch.float32, got {t.dtype}")
    if out_partial.dim() not in (4, 5) or lse_partial.shape != out_partial.shape[:-1]:
        raise ValueError(f"{api}: out_partial must be (num_splits, batch, seqlen, nheads, "
                         f"headdim) or (num_splits, total, nheads, headdim) and lse_partial its "
                         f"shape less headdim, got {tuple(out_partial.shape)} and "
                         f"{tuple(lse_partial.shape)}")
    lse = torch.logsumexp(lse_partial, dim=0)
    weights = torch.exp(lse_partial - lse)
    # A row whose splits all have lse -inf gives exp(-inf + inf) = nan: it takes nothing.
    weights = weights.masked_fill(~torch.isfinite(weights), 0.0)
    combined = (weights.unsqueeze(-1) * out_partial).sum(dim=0)
    if out is None:
        return combined.to(out_partial.dtype if out_dtype is None else out_dtype), lse
    check_tensor(api, "out", out)
    if out.shape != combined.shape:
        raise ValueError(f"{api}: out must have shape {tuple(combined.shape)}, got "
                         f"{tuple(out.shape)}")
    out.copy_(combined)
    return out, lse


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                            rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            page_table: Optional[torch.Tensor] = None,
                            cu_seqlens_q: Optional[torch.Tensor] = None,
                            cu_seqlens_k_new: Optional[torch.Tensor] = None,
                            max_seqlen_q: Optional[int] = None,
                            rotary_seqlens: Optional[torch.Tensor] = None,
                            q_descale: Optional[torch.Tensor] = None,
                            k_descale: Optional[torch.Tensor] = None,
                            v_descale: Optional[torch.Tensor] = None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                            pack_gqa=None, sm_margin=0, return_softmax_lse=False):
    """Attention of q against a KV cache, FlashAttention-3's flash_attn_with_kvcache, on
    fmha.fwd_kvcache: the arguments of FlashAttention-2's (fmha.compat.flash_attn), with the
    paged cache's table named page_table (any page size). No backward.

    FP8: q, k_cache, v_cache (and k, v if given) torch.float8_e4m3fn, with q_descale,
    k_descale, v_descale fp32 of shape (batch, nheads_k) or one that broadcasts to it (None is
    1): a key is k_cache * k_descale. fmha.fwd_kvcache's e4m3 cache takes bfloat16 queries, so
    q is dequantized to bfloat16 (q * q_descale, rounded) before the call, and k, v likewise
    (fwd_kvcache quantizes them back with k_descale, v_descale as it appends: the codes
    appended are k's and v's own for every descale in [2**-117, 2**119], rotary aside).
    Descales without e4m3 inputs, and an e4m3 q with 16-bit caches or new tokens, are a
    ValueError.

    Returns out (batch, seqlen_q, nheads, headdim_v) (bfloat16 for FP8), with
    return_softmax_lse (out, softmax_lse), softmax_lse (batch, nheads, seqlen_q) fp32."""
    api = "flash_attn_with_kvcache"
    _refuse(api, qv=qv is not None, cu_seqlens_q=cu_seqlens_q is not None,
            cu_seqlens_k_new=cu_seqlens_k_new is not None,
            rotary_seqlens=rotary_seqlens is not None, attention_chunk=attention_chunk != 0)
    q, k, v, scales = _fp8_kvcache(api, q, k_cache, v_cache, k, v, q_descale, k_descale,
                                   v_descale)
    return attend_kvcache(
        api, q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=page_table,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=None, num_splits=num_splits, return_lse=return_softmax_lse, **scales)


def _fp8_kvcache(api, q, k_cache, v_cache, k, v, q_descale, k_descale, v_descale):
    """FlashAttention-3's FP8 KV-cache call as fmha.fwd_kvcache takes it: (q, k, v, scales),
    q (and k, v) dequantized to bfloat16 and scales fwd_kvcache's k_scale and v_scale, each
    descale expanded to (batch, nheads_k) (None: 1). A 16-bit call passes unchanged, with no
    scales."""
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    for name, t in descales.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{api}: {name} must be a torch.Tensor or None, got "
                            f"{type(t).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(api, name, t)
    if q.dtype != E4M3:
        for name, t in descales.items():
            if t is not None:
                raise ValueError(f"{api}: {name} dequantizes FP8 ({E4M3}) inputs; q has dtype "
                                 f"{q.dtype}, whose calls take no descale factors")
        return q, k, v, {}
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != E4M3):
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{api}: {name} must be {E4M3} with a {E4M3} q "
                             f"(FlashAttention-3's FP8 call), got {got}")
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape[2] == 0 \
            or q.shape[2] % k_cache.shape[2]:
        raise ValueError(f"{api}: q must be (batch, seqlen_q, nheads, headdim) and k_cache (..., "
                         f"nheads_k, headdim) with nheads a multiple of nheads_k, got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    batch, heads_k = q.shape[0], k_cache.shape[2]
    for name, t in (("k", k), ("v", v)):
        if t is not None and (t.dim() != 4 or (t.shape[0], t.shape[2]) != (batch, heads_k)):
            raise ValueError(f"{api}: {name} must be (batch, seqlen_new, nheads_k, headdim) "
                             f"with batch {batch} and nheads_k {heads_k}, got {tuple(t.shape)}")
    table = {}
    for name, t in descales.items():
        if t is None:
            t = torch.ones((), dtype=torch.float32, device=k_cache.device)
        if t.dtype != torch.float32:
            raise TypeError(f"{api}: {name} must be torch.float32, got {t.dtype}")
        if not _broadcasts(tuple(t.shape), (batch, heads_k)):
            raise ValueError(f"{api}: {name} must have shape "
                             f"{_descale_shapes(batch, heads_k)}; got {tuple(t.shape)}")
        table[name] = t.expand(batch, heads_k)

    def dequantized(x, descale):  # (batch, seqlen, heads, headdim) e4m3 -> bfloat16
        per_head = descale.repeat_interleave(x.shape[2] // heads_k, dim=1)
        return (x.float() * per_head[:, None, :, None]).to(torch.bfloat16)

    q = dequantized(q, table["q_descale"])
    # fwd_kvcache divides k and v by the same scales and rounds to e4m3 as it appends: with each
    # code x descale a normal bf16 (descales in [2**-117, 2**119]) that returns the codes given
    # (tests/test_compat_flash_attn.py checks all 254 finite codes).
    if k is not None:
        k = dequantized(k, table["k_descale"])
    if v is not None:
        v = dequantized(v, table["v_descale"])
    return q, k, v, dict(k_scale=table["k_descale"], v_scale=table["v_descale"])
