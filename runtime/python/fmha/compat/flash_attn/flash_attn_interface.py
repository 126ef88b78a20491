"""FlashAttention-2's functions (flash_attn.flash_attn_interface) on fmha.

Same names, signatures, defaults and results as FlashAttention-2's; each maps its arguments
onto fmha.fwd (with fmha.bwd as the backward) or fmha.fwd_kvcache, as fmha.compat._attention
describes: causal, windows and ALiBi aligned bottom-right, softcap <= 0 off, dropout seeded
from torch's default generator.

Where fmha differs from FlashAttention-2:
- bad arguments raise ValueError or TypeError (fmha's checks) before anything runs, where
  FlashAttention raises RuntimeError from its C++ checks or AssertionError;
- a row that sees no key has log-sum-exp -inf (FlashAttention-2 returns +inf);
- softcap and dropout work together, and rotary_dim need not be a multiple of 16;
- S_dmask (return_attn_probs=True with dropout) is computed on the side in fp32, with the
  dropout pattern the kernel applied, each row scaled by its largest logit over all keys (one
  key block: _get_block_size_n), shaped (batch, nheads, seqlen_q, seqlen_k) without rounding
  the lengths up to 128; without dropout it is an empty tensor, as FlashAttention-2's;
- flash_attn_varlen_func with block_table gathers each sequence's pages into a packed copy of
  its keys and values, then runs the varlen forward on it;
- flash_attn_with_kvcache never reads past a paged cache's block_table (cache_seqlens beyond
  it are cut to its capacity instead of raising, which would read the lengths back to the host
  every step); cache_seqlens=None with k and v is refused (there is no position to append at);
- dropout under CUDA graph capture is refused (the seed is drawn on the host).
"""

from typing import Optional, Union

import torch

from fmha.compat._attention import (
    S_DMASK_BLOCK_N,
    attend,
    attend_kvcache,
    check_bool,
    check_packed,
    check_tensor,
    dropout_probabilities,
    dropout_seed,
    fwd_options,
    softcap_value,
    window,
)

# Imported by FlashAttention-2's tests: True where its Triton kernels for AMD GPUs run instead of
# the CUDA ones; fmha runs CUDA only.
USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal) -> int:
    """The key block by which S_dmask's rows are scaled (fmha.compat._attention.S_DMASK_BLOCK_N):
    a row is scaled by its largest logit over the whole block, here every key of the row. The
    arguments are FlashAttention-2's, whose block depends on them; this one does not."""
    return S_DMASK_BLOCK_N


def _attention(api, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
               alibi_slopes, deterministic, return_attn_probs, **varlen):
    """The forward functions' one path: out, or (out, softmax_lse, S_dmask)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(api, name, t)
    check_bool(api, "causal", causal)
    check_bool(api, "deterministic", deterministic)
    check_bool(api, "return_attn_probs", return_attn_probs)
    if softmax_scale is None and q.dim() and q.shape[-1] > 0:
        softmax_scale = q.shape[-1] ** -0.5
    options = fwd_options(causal, softmax_scale, window(api, window_size, causal), alibi_slopes,
                          softcap_value(api, softcap), dropout_p, dropout_seed(api, dropout_p),
                          **varlen)
    if not return_attn_probs:
        return attend(q, k, v, options, deterministic, return_lse=False)
    out, softmax_lse = attend(q, k, v, options, deterministic, return_lse=True)
    if options["dropout_seed"] is None:
        s_dmask = q.new_empty((0,))
    else:
        s_dmask = dropout_probabilities(q.detach(), k.detach(), options)
    return out, softmax_lse, s_dmask


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash_attn_func of q, k, v stacked in one tensor.

    qkv: (batch, seqlen, 3, nheads, headdim); its gradient comes back as one tensor of that
    shape. Returns out (batch, seqlen, nheads, headdim), or with return_attn_probs
    (out, softmax_lse, S_dmask) as flash_attn_func does."""
    api = "flash_attn_qkvpacked_func"
    check_packed(api, "qkv", qkv, 5, 3)
    q, k, v = qkv.unbind(dim=2)
    return _attention(api, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash_attn_func with k and v stacked in one tensor.

    q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim), nheads
    a multiple of nheads_k (MQA/GQA). Returns as flash_attn_func."""
    api = "flash_attn_kvpacked_func"
    check_packed(api, "kv", kv, 5, 2)
    k, v = kv.unbind(dim=2)
    return _attention(api, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """Attention of q against k and v, FlashAttention-2's flash_attn_func.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), fp16 or
    bf16 on one GPU, nheads a multiple of nheads_k (query head h reads K/V head
    h // (nheads / nheads_k)). dropout_p: the probability of dropping an attention probability
    (0.0 for evaluation). softmax_scale: default 1 / sqrt(headdim). causal: query i sees keys
    j <= i + seqlen_k - seqlen_q (aligned bottom-right; a row that sees none gives 0).
    window_size (left, right): query i sees keys in [i + seqlen_k - seqlen_q - left,
    i + seqlen_k - seqlen_q + right], -1 unbounded. softcap > 0: logits become
    softcap * tanh(logits / softcap). alibi_slopes: fp32 (nheads,) or (batch, nheads), adds
    -slope * |i + seqlen_k - seqlen_q - j| to the logit of (i, j). deterministic: the
    backward's gradients are bitwise reproducible.

    Returns out (batch, seqlen_q, nheads, headdim), differentiable in q, k and v; with
    return_attn_probs (out, softmax_lse, S_dmask): softmax_lse (batch, nheads, seqlen_q) fp32
    the natural log of each row's softmax denominator, S_dmask (module docstring) for tests."""
    return _attention("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func of q, k, v stacked in one tensor.

    qkv: (total, 3, nheads, headdim), sequences packed along the tokens; cu_seqlens: int32
    (batch + 1,), where each sequence starts and the end; max_seqlen: the longest's length.
    Returns as flash_attn_varlen_func."""
    api = "flash_attn_varlen_qkvpacked_func"
    check_packed(api, "qkv", qkv, 4, 3)
    q, k, v = qkv.unbind(dim=1)
    return _attention(api, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, cu_seqlens_q=cu_seqlens,
                      cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """flash_attn_varlen_func with k and v stacked in one tensor: kv (total_k, 2, nheads_k,
    headdim). Returns as flash_attn_varlen_func."""
    api = "flash_attn_varlen_kvpacked_func"
    check_packed(api, "kv", kv, 4, 2)
    k, v = kv.unbind(dim=1)
    return _attention(api, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash_attn_func of sequences of different lengths packed along the tokens.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q,
    cu_seqlens_k: int32 (batch + 1,), where each sequence's tokens start and then the end;
    max_seqlen_q, max_seqlen_k: the longest sequence's lengths (ints). Every mask, window and
    ALiBi distance uses each sequence's own lengths. block_table: int32 (batch,
    max_pages_per_sequence) to read k and v as a paged cache, (num_pages, page_size, nheads_k,
    headdim), sequence b's keys on its table row's pages (cu_seqlens_k then only gives the
    lengths). Other arguments as flash_attn_func.

    Returns out (total_q, nheads, headdim); with return_attn_probs (out, softmax_lse,
    S_dmask), softmax_lse (nheads, total_q) fp32, S_dmask (batch, nheads, max_seqlen_q,
    max_seqlen_k)."""
    api = "flash_attn_varlen_func"
    seqused_k = None
    if block_table is not None:
        k, v, cu_seqlens_k, seqused_k = _pages_as_sequences(api, k, v, block_table,
                                                            cu_seqlens_q, cu_seqlens_k)
    return _attention(api, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)


def _pages_as_sequences(api, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k):
    """A paged cache as fmha.fwd's varlen operands: each table row's pages gathered into one
    slot of max_pages_per_sequence * page_size keys (a copy), the slots back to back, and
    (k, v, cu_seqlens_k of the slots, seqused_k: each sequence's keys in its slot)."""
    for name, t in (("k", k_cache), ("v", v_cache), ("block_table", block_table),
                    ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(api, name, t)
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"{api}: block_table must be int32 (batch, max_pages_per_sequence), "
                         f"got {block_table.dtype} of shape {tuple(block_table.shape)}")
    if cu_seqlens_k.dtype != torch.int32 or cu_seqlens_k.dim() != 1:
        raise ValueError(f"{api}: cu_seqlens_k must be int32 (batch + 1,), got "
                         f"{cu_seqlens_k.dtype} of shape {tuple(cu_seqlens_k.shape)}")
    batch = block_table.shape[0]
    if cu_seqlens_k.shape[0] != batch + 1:
        raise ValueError(f"{api}: block_table has {batch} rows, so cu_seqlens_k must have "
                         f"{batch + 1} entries, got {cu_seqlens_k.shape[0]}")
    for name, t in (("k", k_cache), ("v", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{api}: with block_table, {name} must be a paged cache (num_pages, "
                             f"page_size, nheads_k, headdim), got shape {tuple(t.shape)}")
    pages = block_table.long()
    k = k_cache[pages].flatten(0, 2)
    v = v_cache[pages].flatten(0, 2)
    slot = block_table.shape[1] * k_cache.shape[1]
    slots = torch.arange(0, (batch + 1) * slot, slot, dtype=torch.int32,
                         device=cu_seqlens_k.device)
    return k, v, slots, cu_seqlens_k[1:] - cu_seqlens_k[:-1]


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Attention of q against a KV cache (decode, chunked prefill), on fmha.fwd_kvcache. No
    backward.

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_k, headdim), or with block_table (int32 (batch, max_pages_per_sequence)) paged,
    (num_pages, page_size, nheads_k, headdim). k, v (optional): (batch, seqlen_new, nheads_k,
    headdim), written into the cache in place from position cache_seqlens[b] before attention.
    rotary_cos, rotary_sin: (seqlen_rotary, rotary_dim / 2), rotate k at its positions and q at
    cache_seqlens + i (causal or windowed) or cache_seqlens (otherwise); rotary_interleaved
    pairs dims (2j, 2j + 1), else (j, j + rotary_dim / 2). cache_seqlens: an int or int32
    (batch,), the keys cached before the call (None: the whole cache, without k and v).
    cache_batch_idx: int32 (batch,), the cache row of each sequence. cache_leftpad: int32
    (batch,), where each sequence's keys start (contiguous caches). num_splits: key splits per
    sequence, 0 chooses. causal, window_size, softcap, alibi_slopes: as flash_attn_func, the
    queries aligned with the last keys.

    Returns out (batch, seqlen_q, nheads, headdim), with return_softmax_lse also softmax_lse
    (batch, nheads, seqlen_q) fp32."""
    return attend_kvcache(
        "flash_attn_with_kvcache", q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
        block_table=block_table, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, num_splits=num_splits, return_lse=return_softmax_lse)
