"""What the FlashAttention layers of fmha.compat share: FlashAttention's arguments in fmha's
spelling, one attention call through fmha.fwd and fmha.bwd with FlashAttention's per-call
`deterministic` flag, one KV-cache call through fmha.fwd_kvcache, and the `S_dmask` that
return_attn_probs hands back.

FlashAttention's conventions as fmha takes them:
- causal and windows are aligned bottom-right (fmha's mask_align="bottom_right"), and so is
  ALiBi's distance, -slope * |i + seqlen_k - seqlen_q - j| with each sequence's own lengths;
- with causal=True the window's right side is 0 whatever window_size says, a negative side is
  unbounded, and window_size may be any pair of integers, tensors included (the tests draw it
  with torch.randint(0, seqlen_k, (2,)));
- softcap <= 0 turns soft-capping off;
- dropout draws its seed from torch's default generator, once per call (torch.manual_seed makes
  a call reproducible), and passes it to fmha.fwd as dropout_seed with dropout_offset 0, so the
  backward and S_dmask see the pattern the forward applied.
"""

import operator
from typing import Optional

import torch

import fmha
from fmha._checks import ALIGN_BYTES, rows_readable

# The seeds a dropout call draws: [0, 2**63 - 1), what torch.randint's int64 takes (fmha.fwd's
# own range for a call without dropout_seed).
_SEED_LIMIT = 2**63 - 1

# S_dmask holds each row's probabilities scaled by exp(-m), m the row's largest logit over all
# of its keys: FlashAttention's encoding with one key block per row. flash_attn_interface.
# _get_block_size_n answers this, more keys than any call has (fmha takes seqlen_q + seqlen_k
# below 2**30), so decoders that rescale block by block see one block.
S_DMASK_BLOCK_N = 2**30


def check_tensor(api: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{api}: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_bool(api: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{api}: {name} must be a bool, got {type(value).__name__}")


def check_packed(api: str, name: str, t, dim: int, count: int) -> None:
    """A packed operand (qkv or kv): a tensor of `dim` dimensions with `count` at dim -3."""
    check_tensor(api, name, t)
    if t.dim() != dim or t.shape[-3] != count:
        raise ValueError(f"{api}: {name} must have {dim} dimensions with {count} at dimension "
                         f"{dim - 3} (the {'q, k, v' if count == 3 else 'k, v'} stack), got "
                         f"shape {tuple(t.shape)}")


def maybe_contiguous(t):
    """FlashAttention's rule for its operands: a copy where the last (head) dim is strided."""
    return t.contiguous() if isinstance(t, torch.Tensor) and t.stride(-1) != 1 else t


def window(api: str, window_size, causal) -> tuple[int, int]:
    """FlashAttention's window_size as fmha takes it (see the module docstring)."""
    try:  # any pair: a tuple, a list, a 1-D integer tensor of 2 (torch.randint's)
        left, right = window_size
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise TypeError(f"{api}: window_size must be a (left, right) pair of ints, got "
                        f"{window_size!r}") from None
    left, right = max(left, -1), max(right, -1)
    if causal is True and (left, right) != (-1, -1):
        right = 0
    return left, right


def softcap_value(api: str, softcap) -> float:
    """FlashAttention's softcap as fmha takes it: anything <= 0 is off (0.0)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{api}: softcap must be a float, got {type(softcap).__name__}")
    return float(softcap) if softcap > 0 else 0.0


def dropout_seed(api: str, dropout_p) -> Optional[int]:
    """The seed of a dropout call, drawn here so that the call's backward and S_dmask know it;
    None without dropout. A seed drawn on the host while a CUDA graph is captured would repeat
    one pattern at every replay, so that is refused."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{api}: dropout_p must be a float, got {type(dropout_p).__name__}")
    if not dropout_p > 0:
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            f"{api}: dropout cannot be captured in a CUDA graph here (its seed is drawn on the "
            f"host at capture, so every replay would drop the same elements); call fmha.fwd "
            f"with an explicit dropout_seed instead, one graph per seed")
    return int(torch.randint(_SEED_LIMIT, (), dtype=torch.int64))


def fwd_options(causal, softmax_scale, window_size, alibi_slopes=None, softcap=0.0,
                dropout_p=0.0, seed=None, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None) -> dict:
    """The keyword arguments of fmha.fwd (and fmha.bwd) for a FlashAttention call whose
    options are already in fmha's spelling (window, softcap_value, dropout_seed)."""
    return dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                mask_align="bottom_right", alibi_slopes=alibi_slopes, softcap=softcap,
                dropout_p=dropout_p, dropout_seed=seed, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k)


def attend_kvcache(api, q, k_cache, v_cache, k, v, *, cache_seqlens, block_table,
                   cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
                   return_lse, **scales):
    """The body of FlashAttention-2's and -3's flash_attn_with_kvcache (FlashAttention-3 calls
    block_table page_table and has no ALiBi): their checks, then one fmha.fwd_kvcache call.
    scales: an e4m3 cache's k_scale and v_scale (FlashAttention-3's FP8 call), or none."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(api, name, t)
    if k_cache.dim() != 4:
        raise ValueError(f"{api}: k_cache must have 4 dimensions, got shape "
                         f"{tuple(k_cache.shape)}")
    check_bool(api, "causal", causal)
    check_bool(api, "return_softmax_lse", return_lse)
    q, k, v = maybe_contiguous(q), maybe_contiguous(k), maybe_contiguous(v)
    return fmha.fwd_kvcache(
        q, k_cache, v_cache, k, v,
        cache_seqlens=_cache_lengths(api, cache_seqlens, q, k_cache, k, block_table),
        block_table=block_table, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        causal=causal, window_size=window(api, window_size, causal),
        softcap=softcap_value(api, softcap), alibi_slopes=alibi_slopes,
        softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse, **scales)


def _cache_lengths(api, cache_seqlens, q, k_cache, k, block_table):
    """FlashAttention's cache_seqlens as fmha.fwd_kvcache takes it: an int becomes an int32
    tensor of the batch's size, None the whole cache (refused with k and v, which would have
    no position to go to); a tensor goes to fmha's checks as it is."""
    if isinstance(cache_seqlens, bool):
        raise TypeError(f"{api}: cache_seqlens must be an int or an int32 tensor, got bool")
    if cache_seqlens is None:
        if k is not None:
            raise ValueError(f"{api}: k and v are appended at cache_seqlens; pass it")
        if block_table is not None:
            check_tensor(api, "block_table", block_table)
        cache_seqlens = (k_cache.shape[1] if block_table is None
                         else k_cache.shape[1] * block_table.shape[-1])
    if isinstance(cache_seqlens, int):
        batch = q.shape[0] if q.dim() else 0
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    return cache_seqlens


def _kernel_readable(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where fmha's kernels cannot read it: autograd hands a gradient
    over in any layout (out.sum()'s is one value expanded)."""
    if rows_readable(t) and t.data_ptr() % ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class _Attention(torch.autograd.Function):
    """fmha.fwd forward and fmha.bwd backward, with the backward's `deterministic` chosen per
    call as FlashAttention chooses it (fmha.fwd's own autograd formula asks
    torch.are_deterministic_algorithms_enabled() instead)."""

    @staticmethod
    def forward(ctx, q, k, v, options: dict, deterministic: bool):
        out, lse = fmha.fwd(q, k, v, return_lse=True, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
        dq, dk, dv = fmha.bwd(_kernel_readable(dout), q, k, v, out, lse,
                              deterministic=deterministic, **ctx.options)
        return dq, dk, dv, None, None


def attend(q, k, v, options: dict, deterministic: bool, return_lse: bool):
    """out, or (out, lse) with return_lse: one fmha.fwd call, differentiable through
    fmha.bwd with `deterministic` where autograd records it. An e4m3 v goes as it is: fmha.fwd
    reads a row-major v and a V^T view alike in place (the kernel transposes a row-major one),
    so a V^T view is not copied to row-major."""
    e4m3_v = isinstance(v, torch.Tensor) and v.dtype == torch.float8_e4m3fn
    q, k, v = maybe_contiguous(q), maybe_contiguous(k), v if e4m3_v else maybe_contiguous(v)
    records = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    if not records:  # inference: fmha.fwd's planned path, the log-sum-exp only when asked
        return fmha.fwd(q, k, v, return_lse=return_lse, **options)
    out, lse = _Attention.apply(q, k, v, options, deterministic)
    return (out, lse) if return_lse else out


# The most logits S_dmask computes at once (fp32, 256 MiB): a batch's rows in chunks of it.
_LOGITS_PER_CHUNK = 2**26


def _row_scaled_probabilities(q, k, slopes, options: dict) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) fp32: exp(logit - the row's largest logit) of q
    (batch, seqlen_q, heads, d) against k (batch, seqlen_k, heads_k, d), 0 where the mask
    hides a key; slopes: ALiBi's (batch, heads) or None."""
    seqlen_q, heads = q.shape[1], q.shape[2]
    seqlen_k = k.shape[1]
    k = k.float().repeat_interleave(heads // k.shape[2], dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q.float(), k) * options["softmax_scale"]
    if options["softcap"] > 0:
        logits = options["softcap"] * torch.tanh(logits / options["softcap"])
    rows = torch.arange(seqlen_q, device=q.device).unsqueeze(1)
    keys = torch.arange(seqlen_k, device=q.device).unsqueeze(0)
    aligned = rows + (seqlen_k - seqlen_q)  # the key each query row sits at (bottom-right)
    if slopes is not None:
        logits = logits - slopes.float()[:, :, None, None] * (aligned - keys).abs()
    left, right = options["window_size"]
    if options["causal"] and right < 0:
        right = 0
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= keys >= aligned - left
    if right >= 0:
        visible &= keys <= aligned + right
    logits = logits.masked_fill(~visible, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # rows that see no key
    return torch.exp(logits - row_max)


def _sequences(q, k, options: dict):
    """(q rows, k rows, batch index) of each sequence of a varlen call, and the longest query
    and key lengths. Reads the offsets back to the host: return_attn_probs is for tests."""
    starts_q = options["cu_seqlens_q"].tolist()
    starts_k = options["cu_seqlens_k"].tolist()
    used_k = options["seqused_k"]
    lengths_k = used_k.tolist() if used_k is not None else [
        end - start for start, end in zip(starts_k, starts_k[1:])]
    sequences = [(slice(starts_q[b], starts_q[b + 1]),
                  slice(starts_k[b], starts_k[b] + lengths_k[b]), b)
                 for b in range(len(starts_q) - 1)]
    longest_q = max([options["max_seqlen_q"]] + [rows.stop - rows.start
                                                 for rows, _, _ in sequences])
    longest_k = max([options["max_seqlen_k"]] + lengths_k)
    return sequences, longest_q, longest_k


def dropout_probabilities(q, k, options: dict) -> torch.Tensor:
    """FlashAttention's S_dmask of a dropout call: (batch, nheads, seqlen_q, seqlen_k) in q's
    dtype (varlen: the longest lengths, each sequence from row and key 0, zeros past its own
    lengths), each row's probabilities scaled by exp(-its largest logit) (S_DMASK_BLOCK_N),
    negative where dropout dropped the element. The pattern is fmha.dropout_mask's for the
    call's seed and offset 0, the one its kernel applied; the probabilities are computed here
    in fp32 from q and k."""
    slopes = options["alibi_slopes"]
    heads = q.shape[-2]
    if options["cu_seqlens_q"] is None:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        if slopes is not None:
            slopes = slopes.expand(batch, heads)
        rows_per_chunk = max(1, _LOGITS_PER_CHUNK // max(1, heads * seqlen_q * seqlen_k))
        parts = [slice(start, start + rows_per_chunk)
                 for start in range(0, batch, rows_per_chunk)]
        chunks = [(q[part], k[part], part) for part in parts]
    else:
        sequences, seqlen_q, seqlen_k = _sequences(q, k, options)
        batch = len(sequences)
        if slopes is not None:
            slopes = slopes.expand(batch, heads)
        # Each sequence as a batch of one.
        chunks = [(q[None, rows], k[None, keys], slice(b, b + 1)) for rows, keys, b in sequences]
    keep = fmha.dropout_mask(options["dropout_seed"], 0, options["dropout_p"], batch, heads,
                             seqlen_q, seqlen_k, device=q.device)
    s_dmask = q.new_zeros((batch, heads, seqlen_q, seqlen_k))
    with torch.no_grad():
        for q_part, k_part, part in chunks:
            probs = _row_scaled_probabilities(q_part, k_part,
                                              None if slopes is None else slopes[part], options)
            length_q, length_k = probs.shape[2:]
            kept = keep[part, :, :length_q, :length_k].bool()
            s_dmask[part, :, :length_q, :length_k] = torch.where(kept, probs, -probs)
    return s_dmask
