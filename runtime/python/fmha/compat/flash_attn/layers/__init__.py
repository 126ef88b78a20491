"""FlashAttention-2's flash_attn.layers: the rotary embedding (flash_attn.layers.rotary)."""

from fmha.compat.flash_attn.layers import rotary

__all__ = ["rotary"]
