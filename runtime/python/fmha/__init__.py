"""Generated FlashAttention forward kernels for NVIDIA GPUs.

    import fmha
    out = fmha.fwd(q, k, v, causal=True)   # q: (batch, seqlen_q, nheads, headdim), CUDA
    out, lse = fmha.fwd(q, k, v, window_size=(256, 0), return_lse=True)
    fmha.select(q, k, v, causal=True)       # the instance fwd would run
    print(fmha.explain(q, k, v))            # and why
    fmha.instances()                        # what this build compiled

The kernels come from instances.yaml through ``python -m generator``; a problem that no compiled
instance fits raises :class:`MissingInstanceError`, whose message names the filter that builds one.
"""

from fmha._api import (
    MissingInstanceError,
    compiled_targets,
    dropout_mask,
    explain,
    fwd,
    instances,
    select,
)

__all__ = [
    "MissingInstanceError",
    "compiled_targets",
    "dropout_mask",
    "explain",
    "fwd",
    "instances",
    "select",
]
