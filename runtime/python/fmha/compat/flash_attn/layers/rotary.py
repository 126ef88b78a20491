"""FlashAttention-2's flash_attn.layers.rotary.apply_rotary_emb, in plain torch.

Rotary position embedding (RoFormer) of the first rotary_dim dims of each head: the pair
(x1, x2) at position p becomes (x1 cos - x2 sin, x1 sin + x2 cos) with cos, sin the table's row
p. Computed in fp32 (or x's dtype where wider) and rounded to x's dtype once; runs on any device
and is differentiable.
"""

from typing import Optional, Union

import torch


def _positions(x, seqlen_offsets, cu_seqlens) -> torch.Tensor:
    """The position of every token of x, int64: (batch, seqlen), or (total,) with cu_seqlens
    (each token's index in its sequence), shifted by its sequence's seqlen_offsets."""
    device = x.device
    if cu_seqlens is None:
        positions = torch.arange(x.shape[1], device=device).unsqueeze(0)
        if isinstance(seqlen_offsets, torch.Tensor):
            return positions + seqlen_offsets.to(device=device, dtype=torch.int64).unsqueeze(1)
        return (positions + seqlen_offsets).expand(x.shape[0], -1)
    tokens = torch.arange(x.shape[0], device=device)
    starts = cu_seqlens.to(device=device, dtype=torch.int64)
    sequence = torch.searchsorted(starts[1:], tokens, right=True)
    positions = tokens - starts[sequence]
    if isinstance(seqlen_offsets, torch.Tensor):
        return positions + seqlen_offsets.to(device=device, dtype=torch.int64)[sequence]
    return positions + seqlen_offsets


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False,
                     seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None,
                     max_seqlen: Optional[int] = None):
    """x with its first rotary_dim dims rotated by position; the other dims pass through.

    x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens (int32
    (batch + 1,), where each sequence's tokens start and the end) and max_seqlen (the longest
    sequence's length). cos, sin: (seqlen_rotary, rotary_dim / 2), rotary_dim <= headdim, row p
    for position p. interleaved: rotate dims (2j, 2j + 1) (GPT-J) instead of (j, j +
    rotary_dim / 2) (GPT-NeoX). seqlen_offsets: an int or a (batch,) tensor added to every
    position of a sequence (a KV cache's length); positions past the table are not rotated.
    inplace: write the result into x and return x.

    Returns a tensor of x's shape and dtype."""
    api = "apply_rotary_emb"
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{api}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if cu_seqlens is not None and max_seqlen is None:
        raise ValueError(f"{api}: cu_seqlens needs max_seqlen, the longest sequence's length")
    if x.dim() != (3 if cu_seqlens is not None else 4):
        layout = ("(total, nheads, headdim) with cu_seqlens" if cu_seqlens is not None
                  else "(batch, seqlen, nheads, headdim)")
        raise ValueError(f"{api}: x must be {layout}, got shape {tuple(x.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"{api}: cos and sin must be (seqlen_rotary, rotary_dim / 2) of one "
                         f"shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    seqlen_rotary, half = cos.shape
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"{api}: rotary_dim {rotary_dim} (cos's 2 * {half}) exceeds headdim "
                         f"{x.shape[-1]}")
    seqlen = max_seqlen if cu_seqlens is not None else x.shape[1]
    if seqlen_rotary < seqlen:
        raise ValueError(f"{api}: cos and sin have {seqlen_rotary} rows, fewer than the "
                         f"sequence length {seqlen}")

    compute = torch.promote_types(x.dtype, torch.float32)  # fp16 and bf16 in fp32
    positions = _positions(x, seqlen_offsets, cu_seqlens)
    in_table = (positions < seqlen_rotary).unsqueeze(-1)
    rows = positions.clamp(0, seqlen_rotary - 1)
    # (..., 1, rotary_dim / 2): one row per token, the same for every head
    cos_rows = torch.where(in_table, cos.to(compute)[rows], 1.0).unsqueeze(-2)
    sin_rows = torch.where(in_table, sin.to(compute)[rows], 0.0).unsqueeze(-2)
    part = x[..., :rotary_dim].to(compute)
    if interleaved:
        first, second = part[..., 0::2], part[..., 1::2]
    else:
        first, second = part[..., :half], part[..., half:]
    rotated_first = first * cos_rows - second * sin_rows
    rotated_second = first * sin_rows + second * cos_rows
    if interleaved:
        rotated = torch.stack((rotated_first, rotated_second), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((rotated_first, rotated_second), dim=-1)
    rotated = rotated.to(x.dtype)
    if inplace:
        x[..., :rotary_dim] = rotated
        return x
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
