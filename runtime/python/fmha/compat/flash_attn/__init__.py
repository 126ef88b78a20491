"""FlashAttention-2's `flash_attn` package on fmha's kernels.

    from fmha.compat.flash_attn import flash_attn_func, flash_attn_varlen_func
    out = flash_attn_func(q, k, v, causal=True)

The functions FlashAttention-2 exports, with its names, signatures, defaults and results
(flash_attn_interface says how each maps onto fmha and where the two differ), and its
submodules flash_attn_interface, bert_padding (unpad_input, pad_input) and layers.rotary
(apply_rotary_emb). fmha.compat's docstring shows how to make `import flash_attn` load it.
"""

from fmha.compat.flash_attn import bert_padding, flash_attn_interface, layers
from fmha.compat.flash_attn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "bert_padding",
    "flash_attn_func",
    "flash_attn_interface",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "layers",
]
