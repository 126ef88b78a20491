"""Argument checks for fmha.fwd: every bad call fails here, before anything reaches the GPU.

Order matters for the messages: type, dtype, rank, shapes, strides, options, then devices, so
a problem is described in the terms of the first thing wrong with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fmha import _C

DTYPE_CODES = {torch.float16: _C.DTYPE_FP16, torch.bfloat16: _C.DTYPE_BF16}


@dataclass(frozen=True)
class Problem:
    """The shape of one forward call, as the C++ API takes it."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nhead_q: int
    nhead_k: int
    hdim_q: int
    hdim_v: int


def check_inputs(q, k, v) -> Problem:
    named = (("q", q), ("k", k), ("v", v))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fmha.fwd: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in DTYPE_CODES:
        raise TypeError(
            f"fmha.fwd: q has dtype {q.dtype}; supported are torch.float16 and torch.bfloat16"
        )
    for name, t in named[1:]:
        if t.dtype != q.dtype:
            raise TypeError(
                f"fmha.fwd: {name} has dtype {t.dtype} but q has {q.dtype}; "
                "q, k and v must share one dtype"
            )
    for name, t in named:
        if t.dim() != 4:
            raise ValueError(
                f"fmha.fwd: {name} must be 4-D (batch, seqlen, nheads, headdim), "
                f"got shape {tuple(t.shape)}"
            )
    b, sq, hq, dq = q.shape
    bk, sk, hk, dk = k.shape
    bv, sv, hv, dv = v.shape
    if not (bk == b and bv == b):
        raise ValueError(f"fmha.fwd: batch sizes differ: q {b}, k {bk}, v {bv}")
    if sv != sk:
        raise ValueError(f"fmha.fwd: k has seqlen {sk} but v has {sv}")
    if hv != hk:
        raise ValueError(f"fmha.fwd: k has {hk} heads but v has {hv}")
    if dk != dq:
        raise ValueError(f"fmha.fwd: q has head dim {dq} but k has {dk}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"fmha.fwd: q's {hq} heads must be a multiple of k/v's {hk} heads (MQA/GQA)"
        )
    for name, t in named:
        if t.stride(-1) != 1 and t.size(-1) > 1:
            raise ValueError(
                f"fmha.fwd: {name}'s last (head) dimension must be contiguous, got strides "
                f"{tuple(t.stride())}; pass {name}.contiguous() or a view of a contiguous tensor"
            )
    return Problem(b, sq, sk, hq, hk, dq, dv)


def check_devices(q, k, v) -> None:
    """Last of the checks, so that CPU and meta tensors reach every other one first."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"fmha.fwd: {name} is on {t.device}; fmha.fwd needs CUDA tensors")
        if t.device != q.device:
            raise ValueError(
                f"fmha.fwd: {name} is on {t.device} but q is on {q.device}; "
                "all tensors must be on one GPU"
            )


def check_options(causal, softmax_scale, hdim_q: int) -> float:
    """Returns the softmax scale to use (1/sqrt(hdim_q) when None)."""
    if not isinstance(causal, bool):
        raise TypeError(f"fmha.fwd: causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(hdim_q) if hdim_q > 0 else 1.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"fmha.fwd: softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        )
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"fmha.fwd: softmax_scale must be finite and positive, got {softmax_scale}")
    return float(softmax_scale)
