"""Other libraries' attention APIs, same names and conventions, on fmha's kernels.

    import fmha.compat.flash_attn as flash_attn            # FlashAttention-2's package
    out = flash_attn.flash_attn_func(q, k, v, causal=True)
    from fmha.compat import flash_attn_interface           # FlashAttention-3's (hopper/)
    out = flash_attn_interface.flash_attn_func(q, k, v, causal=True)

Code written for FlashAttention imports `flash_attn` (or `flash_attn_interface`); to run it on
fmha unchanged, call register() before that code imports them:

    import fmha.compat
    fmha.compat.register()   # `import flash_attn` (and its submodules) now loads these modules

Each function is a thin layer over fmha.fwd, fmha.bwd, fmha.fwd_kvcache and
fmha.dropout_mask: it maps FlashAttention's arguments onto fmha's and its results back. Where
the two differ, the module docstrings say how.
"""

import importlib
import sys

# The modules register() puts in place of FlashAttention's: FlashAttention-2's package and its
# submodules, FlashAttention-3's Hopper module.
ALIASES = {
    "flash_attn": "fmha.compat.flash_attn",
    "flash_attn.flash_attn_interface": "fmha.compat.flash_attn.flash_attn_interface",
    "flash_attn.bert_padding": "fmha.compat.flash_attn.bert_padding",
    "flash_attn.layers": "fmha.compat.flash_attn.layers",
    "flash_attn.layers.rotary": "fmha.compat.flash_attn.layers.rotary",
    "flash_attn_interface": "fmha.compat.flash_attn_interface",
}


def register() -> None:
    """Make `import flash_attn`, its submodules above and `import flash_attn_interface` load
    fmha.compat's modules (through sys.modules), whether FlashAttention is installed or not.
    Code that imported FlashAttention's own modules before the call keeps them."""
    for name, module in ALIASES.items():
        sys.modules[name] = importlib.import_module(module)
