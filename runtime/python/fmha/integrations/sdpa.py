"""fmha behind torch SDPA's flash backend.

    import fmha.integrations.sdpa
    fmha.integrations.sdpa.register()     # F.scaled_dot_product_attention's flash backend: fmha
    fmha.integrations.sdpa.unregister()   # torch's own FlashAttention-2 again

register() goes through torch's registry of flash attention implementations
(torch.nn.attention.register_flash_attention_impl and activate_flash_attention_impl, where
torch's FA3 and FA4 are registered too): activating "fmha" installs CUDA kernels for the two
aten operators behind SDPA's flash backend, _scaled_dot_product_flash_attention and its
backward, in place of torch's. SDPA still chooses its backend as before (the flash backend
when its checks pass: fp16/bf16, head dims up to 256, which SDPA pads to multiples of 8 before
the operator, no attn_mask; torch.nn.attention.sdpa_kernel forces it); the operator then runs
fmha.fwd and fmha.bwd, with is_causal top-left aligned (SDPA's, fmha's default). What fmha
does not serve runs torch's own kernel, which register() keeps: a problem no compiled fmha
instance fits (fmha.MissingInstanceError), and dropout, whose backward must redraw the
forward's pattern and so must run on the kernel that drew it.

Needs torch 2.11 or newer: the registry came in 2.10, but restoring torch's kernel
(restore_flash_attention_impl, which unregister() calls) and reaching it from a kernel that
replaced it (torch.library.get_kernel) in 2.11. Written against torch 2.13, run on 2.11.
"""

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.attention

import fmha
from fmha._checks import rows_readable

# The name of fmha's implementation in torch's registry.
NAME = "fmha"

MIN_TORCH = (2, 11)

# The aten operators behind SDPA's flash backend: the forward, and the backward that its
# autograd formula calls.
_FORWARD = "_scaled_dot_product_flash_attention"
_BACKWARD = "_scaled_dot_product_flash_attention_backward"


def register() -> None:
    """Makes fmha the implementation of SDPA's flash backend on CUDA, until unregister()
    (activating another implementation, e.g. torch's "FA4", also replaces it). Raises
    RuntimeError on a torch older than MIN_TORCH. On a torch built without CUDA, whose SDPA
    never reaches the CUDA operators (as torch's own FA3 and FA4 are never reached there), it
    only warns that it registers nothing: code that registers fmha runs there unchanged, on
    torch's CPU kernels."""
    attention = _registry()
    if not torch.backends.cuda.is_built():
        warnings.warn(
            f"fmha.integrations.sdpa.register(): torch {torch.__version__} is built without "
            "CUDA, so SDPA has no CUDA flash operators for fmha to serve; nothing is registered",
            stacklevel=2)
        return
    attention.register_flash_attention_impl(NAME, register_fn=install)
    attention.activate_flash_attention_impl(NAME)


def unregister() -> None:
    """Gives SDPA's flash backend back to torch's own kernels, if fmha has it."""
    attention = _registry()
    if attention.current_flash_attention_impl() == NAME:
        attention.restore_flash_attention_impl()


def _registry():
    """torch.nn.attention, where it has what register() and unregister() use."""
    attention = torch.nn.attention
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if version < MIN_TORCH or not hasattr(attention, "restore_flash_attention_impl"):
        raise RuntimeError(
            f"fmha.integrations.sdpa needs torch >= {'.'.join(map(str, MIN_TORCH))}, which has "
            "torch.nn.attention.register_flash_attention_impl (added in 2.10), "
            "restore_flash_attention_impl and torch.library.get_kernel (added in 2.11); this is "
            f"torch {torch.__version__}")
    return attention


@dataclass
class Installed:
    """What install() registered; torch's registry calls remove() to restore torch's kernels."""

    library: Optional[torch.library.Library]

    def remove(self) -> None:
        # The library's last reference: its finalizer takes its kernels out of the dispatcher
        # (as torch's own FA3/FA4 handles do it).
        self.library = None


def install(dispatch_key: str = "CUDA") -> Installed:
    """The register_fn of fmha's entry in torch's registry: registers fmha's kernels for SDPA's
    flash operators under dispatch_key, each falling back to the kernel it replaces (taken
    from the dispatcher first). register() installs them for CUDA; the tests also for the CPU,
    over a stand-in kernel, to check the operators' contract without a GPU."""
    replaced_forward = torch.library.get_kernel(f"aten::{_FORWARD}", dispatch_key)
    replaced_backward = torch.library.get_kernel(f"aten::{_BACKWARD}", dispatch_key)

    def forward(keyset, query, key, value, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
        # Not e4m3: fmha's FP8 forward returns bfloat16, where SDPA's operator returns the
        # query's dtype; torch's kernel answers such a call in its own terms.
        if dropout_p == 0 and not return_debug_mask and query.dtype != torch.float8_e4m3fn:
            try:
                out, lse = fmha.fwd(*_kernel_layout(query, key, value), causal=is_causal,
                                    softmax_scale=scale, return_lse=True)
            except fmha.MissingInstanceError:
                pass
            else:
                # Undefined cumulative lengths (dense inputs), the lengths, and a seed and an
                # offset (no dropout: never read), as torch's kernel returns them.
                seed = torch.empty((2,), dtype=torch.uint64, device=query.device)
                offset = torch.empty((), dtype=torch.uint64, device=query.device)
                debug_mask = torch.empty((0,), dtype=query.dtype, device=query.device)
                return (out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2],
                        seed, offset, debug_mask)
        return replaced_forward.call_boxed(keyset, query, key, value, dropout_p, is_causal,
                                           return_debug_mask, scale=scale)

    def backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                 max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        # Either forward's log-sum-exp serves either backward: both are FlashAttention's,
        # float32 (batch, heads, seqlen_q) in natural log, and without dropout nothing else
        # of the forward is read.
        if dropout_p == 0:
            try:
                grads = fmha.bwd(*_kernel_layout(grad_out, query, key, value, out), logsumexp,
                                 causal=is_causal, softmax_scale=scale,
                                 deterministic=torch.are_deterministic_algorithms_enabled())
            except fmha.MissingInstanceError:
                pass
            else:
                return tuple(grad.transpose(1, 2) for grad in grads)
        return replaced_backward.call_boxed(keyset, grad_out, query, key, value, out, logsumexp,
                                            cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                            is_causal, philox_seed, philox_offset, scale=scale)

    library = torch.library.Library("aten", "IMPL", dispatch_key)
    # allow_override: replacing a kernel registered from Python too (torch 2.11 refuses that
    # by default; 2.13 allows it), whichever kernel it is being the fallback taken above.
    library.impl(_FORWARD, forward, dispatch_key, with_keyset=True, allow_override=True)
    library.impl(_BACKWARD, backward, dispatch_key, with_keyset=True, allow_override=True)
    return Installed(library)


def _kernel_layout(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """SDPA's (batch, heads, seqlen, head_dim) tensors as fmha's (batch, seqlen, heads,
    head_dim) views, copied where fmha's kernels cannot read them: a head dim that is not
    contiguous (e.g. an expanded gradient), another stride that is not a multiple of 8
    elements, or a start off a 16-byte boundary."""
    fitted = []
    for t in tensors:
        t = t.transpose(1, 2)
        if not rows_readable(t) or t.data_ptr() % 16:
            t = t.contiguous()
        fitted.append(t)
    return tuple(fitted)
