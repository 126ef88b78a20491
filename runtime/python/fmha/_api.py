"""fmha.fwd and friends: torch tensors in, one generated kernel instance launched.

fwd is a torch.library custom op with a fake (meta) implementation, so torch.compile traces
it with fullgraph=True; the op passes pointers, strides and the current stream to fmha._C.
"""

from typing import Optional

import torch

from fmha import _C
from fmha._checks import DTYPE_CODES, Problem, check_devices, check_inputs, check_options


class MissingInstanceError(ValueError):
    """No compiled kernel instance fits the problem; the message names the filter to build one."""


def _raise_for(code: int, message: str) -> None:
    if code == _C.STATUS_OK:
        return
    if code == _C.STATUS_INVALID_ARGUMENT:
        raise ValueError(message)
    if code == _C.STATUS_NO_INSTANCE:
        raise MissingInstanceError(message)
    raise RuntimeError(message)


def _mask_code(causal: bool) -> int:
    return _C.MASK_CAUSAL if causal else _C.MASK_NONE


def _strides(t: torch.Tensor) -> tuple:
    """(batch, seq, head) strides in elements of a (batch, seq, head, dim) tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def _output_shape(q: torch.Tensor, v: torch.Tensor) -> tuple:
    return q.shape[0], q.shape[1], q.shape[2], v.shape[3]


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    instance: Optional[str],
) -> str:
    """Runs the kernel into `out` on the current stream; returns the instance's name."""
    p = Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    with torch.cuda.device(q.device):  # the dispatcher picks by the current device's arch
        code, message, name = _C.fwd(
            DTYPE_CODES[q.dtype],
            _mask_code(causal),
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            out.data_ptr(),
            p.batch,
            p.seqlen_q,
            p.seqlen_k,
            p.nhead_q,
            p.nhead_k,
            p.hdim_q,
            p.hdim_v,
            _strides(q),
            _strides(k),
            _strides(v),
            _strides(out),
            softmax_scale,
            torch.cuda.current_stream(q.device).cuda_stream,
            instance,
        )
    _raise_for(code, message)
    return name


@torch.library.custom_op("fmha::fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    instance: Optional[str],
) -> torch.Tensor:
    out = torch.empty(_output_shape(q, v), dtype=q.dtype, device=q.device)
    _launch(q, k, v, out, causal, softmax_scale, instance)
    return out


@_fwd_op.register_fake
def _fwd_fake(q, k, v, causal, softmax_scale, instance):
    return q.new_empty(_output_shape(q, v))


def fwd(q, k, v, causal=False, softmax_scale=None, *, instance=None):
    """Attention forward: softmax(q k^T * softmax_scale) v, per head.

    q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_k, headdim);
    v: (batch, seqlen_k, nheads_k, headdim_v); float16 or bfloat16 CUDA tensors whose last
    dimension is contiguous (any other strides, e.g. a (b, h, s, d) tensor's transpose(1, 2)).
    nheads must be a multiple of nheads_k (MQA/GQA). causal: top-left aligned (query i sees
    keys 0..i). softmax_scale defaults to 1/sqrt(headdim). instance: run this compiled
    instance (a name from fmha.instances()) instead of the dispatcher's choice.
    Returns (batch, seqlen_q, nheads, headdim_v), contiguous.
    """
    problem = check_inputs(q, k, v)
    scale = check_options(causal, softmax_scale, problem.hdim_q)
    if instance is not None and not isinstance(instance, str):
        raise TypeError(f"fmha.fwd: instance must be a str or None, got {type(instance).__name__}")
    check_devices(q, k, v)
    return _fwd_op(q, k, v, causal, scale, instance)


def select(q, k, v, causal=False, softmax_scale=None) -> dict:
    """The compiled instance fwd would run for these inputs on their GPU, without running it.

    Raises MissingInstanceError, naming the filter that would build a fitting instance.
    """
    p = check_inputs(q, k, v)
    scale = check_options(causal, softmax_scale, p.hdim_q)
    check_devices(q, k, v)
    with torch.cuda.device(q.device):
        code, message, info = _C.select(
            DTYPE_CODES[q.dtype], _mask_code(causal), p.batch, p.seqlen_q, p.seqlen_k,
            p.nhead_q, p.nhead_k, p.hdim_q, p.hdim_v, scale,
        )
    _raise_for(code, message)
    return info


def instances() -> list[dict]:
    """Every compiled instance, in the dispatcher's order of preference."""
    return _C.instances()


def compiled_targets() -> list[str]:
    """The GPU targets this build holds machine code for, e.g. ['sm80', 'sm90a']."""
    return _C.compiled_targets()
