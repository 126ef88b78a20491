"""Other libraries' attention APIs, same names and conventions, on fmha's kernels.

    import fmha.compat.flash_attn as flash_attn            # FlashAttention-2's package
    out = flash_attn.flash_attn_func(q, k, v, causal=True)
    from fmha.compat import flash_attn_interface           # FlashAttention-3's (hopper/)
    out = flash_attn_interface.flash_attn_func(q, k, v, causal=True)

Code written for FlashAttention imports `flash_attn` (or `flash_attn_interface`); to run it on
fmha unchanged, make those names resolve to these modules before it imports them:

    import sys
    import fmha.compat.flash_attn, fmha.compat.flash_attn_interface
    sys.modules["flash_attn"] = fmha.compat.flash_attn
    sys.modules["flash_attn.flash_attn_interface"] = fmha.compat.flash_attn.flash_attn_interface
    sys.modules["flash_attn.bert_padding"] = fmha.compat.flash_attn.bert_padding
    sys.modules["flash_attn.layers"] = fmha.compat.flash_attn.layers
    sys.modules["flash_attn.layers.rotary"] = fmha.compat.flash_attn.layers.rotary
    sys.modules["flash_attn_interface"] = fmha.compat.flash_attn_interface

Each function is a thin layer over fmha.fwd, fmha.bwd, fmha.fwd_kvcache and
fmha.dropout_mask: it maps FlashAttention's arguments onto fmha's and its results back. Where
the two differ, the module docstrings say how.
"""
