"""Generated FlashAttention kernels for NVIDIA GPUs: forward and backward.

    import fmha
    out = fmha.fwd(q, k, v, causal=True)   # q: (batch, seqlen_q, nheads, headdim), CUDA
    out, lse = fmha.fwd(q, k, v, window_size=(256, 0), return_lse=True)
    fmha.select(q, k, v, causal=True)       # the instance fwd would run
    print(fmha.explain(q, k, v))            # and why
    fmha.instances()                        # what this build compiled

Training: fmha.fwd is differentiable (a torch.library op with an autograd formula, which
torch.compile(fullgraph=True) traces forward and backward):

    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fmha.fwd(q, k, v, causal=True)
    out.sum().backward()                    # q.grad, k.grad, v.grad from the backward kernels
    fmha.select_bwd(q, k, v, causal=True)   # the backward instance it runs
    fmha.bwd_instances()

Frameworks with their own autograd call the backward directly, with the forward's arguments,
its out and log-sum-exp, and the gradient of out:

    out, lse = fmha.fwd(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = fmha.bwd(dout, q, k, v, out, lse, causal=True)

Serving: attention against a KV cache (decode and chunked prefill), with FlashAttention's
flash_attn_with_kvcache conventions; the lengths live on the GPU, so a step replays from a CUDA
graph:

    out = fmha.fwd_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                           block_table=pages, rotary_cos=cos, rotary_sin=sin, causal=True)

An FP8 cache (torch.float8_e4m3fn) halves the bytes a decode step reads; its fp32 dequantization
factors come per tensor, per K/V head or per sequence and K/V head:

    out = fmha.fwd_kvcache(q, k_cache8, v_cache8, k_new, v_new, cache_seqlens=lengths,
                           k_scale=k_scale, v_scale=v_scale)

The kernels come from instances.yaml through ``python -m generator``; a problem that no compiled
instance fits compiles one on demand where the build's CUDA compiler is (fmha.jit; FMHA_JIT=0
turns it off), or raises :class:`MissingInstanceError`, whose message names the filter that
builds one.
"""

import os as _os
import sys as _sys

# Compile on demand (libfmha, on a miss) runs fmha/jit.py with FMHA_PYTHON: this interpreter,
# whose environment holds the generator's packages (a venv's python, not the one it links to).
_os.environ.setdefault("FMHA_PYTHON", _sys.executable)

from fmha._api import (
    MissingInstanceError,
    compiled_targets,
    dropout_mask,
    explain,
    fwd,
    instances,
    select,
)
from fmha._bwd import bwd, bwd_instances, explain_bwd, select_bwd
from fmha._kvcache import explain_kvcache, fwd_kvcache, kvcache_instances, select_kvcache

__all__ = [
    "MissingInstanceError",
    "bwd",
    "bwd_instances",
    "compiled_targets",
    "dropout_mask",
    "explain",
    "explain_bwd",
    "explain_kvcache",
    "fwd",
    "fwd_kvcache",
    "instances",
    "kvcache_instances",
    "select",
    "select_bwd",
    "select_kvcache",
]
