"""Argument checks for fmha.fwd and fmha.bwd (and select/explain, which describe a call): every
bad call fails here, before anything reaches the GPU. A message starts with the API called
(`api`: "fwd", "bwd", "select_bwd", ...) and names the argument that is wrong.

Order matters for the messages: types, dtypes, ranks, shapes, strides, options, then devices, so
a problem is described in the terms of the first thing wrong with it, and CPU or meta tensors
reach every check but the last. The entries of cu_seqlens_* and seqused_* live on the GPU and
are the caller's contract (cu_seqlens non-decreasing from 0 within the packed lengths, seqused
within each sequence's length): reading them would synchronize with the stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from fmha import _C

DTYPE_CODES = {torch.float16: _C.DTYPE_FP16, torch.bfloat16: _C.DTYPE_BF16}
# float8 e4m3 (torch.float8_e4m3fn: no infinities, largest finite 448): the forward's inputs
# (fmha.fwd, select, explain; the e4m3 kernel is fa3's, H100/H200), with fp32 descale factors,
# and its output in bfloat16 (float16 with out_dtype); and an FP8 KV cache's elements
# (fmha.fwd_kvcache). No backward, no e4m3 KV-cache queries.
E4M3 = torch.float8_e4m3fn
E4M3_OUT_DTYPE = torch.bfloat16
# What out_dtype may ask of e4m3 inputs: one instance writes either (only its rounding differs).
E4M3_OUT_DTYPES = (torch.bfloat16, torch.float16)
FWD_DTYPE_CODES = {**DTYPE_CODES, E4M3: _C.DTYPE_E4M3}
DESCALES = ("q_descale", "k_descale", "v_descale")
MASK_ALIGNS = {"top_left": _C.ALIGN_TOP_LEFT, "bottom_right": _C.ALIGN_BOTTOM_RIGHT}
SEED_LIMIT = 2**64  # dropout_seed is a uint64_t
OFFSET_LIMIT = 2**32  # dropout_offset is a uint32_t
INT_LIMIT = 2**31  # sizes and window sizes are ints in fmha::FwdArgs
# The kernels move rows in 16-byte pieces of 8 elements: Q, K and V start on a 16-byte boundary
# and every stride but the contiguous one is a multiple of 8 elements.
ALIGN_BYTES = 16
ROW_PIECE = 8
# The same 16 bytes of an FP8 (e4m3) KV cache hold 16 elements (fmha.fwd_kvcache), and of the
# forward's e4m3 inputs.
E4M3_ROW_PIECE = 16
# The largest head dim any kernel takes: beyond it there is nothing to pad to, and the checks
# say so in their own words.
MAX_HEAD_DIM = 256


def runs_padded(hdim_q: int, hdim_v: int) -> bool:
    """Whether fmha.fwd and fmha.bwd run a call of these head dims on copies of its tensors
    zero-padded to multiples of 8 (fmha._head_dims): a head dim that is no multiple of 8, and
    both within what the kernels take."""
    return (bool((hdim_q | hdim_v) % ROW_PIECE) and 0 < hdim_q <= MAX_HEAD_DIM
            and 0 < hdim_v <= MAX_HEAD_DIM)


@dataclass(frozen=True)
class Problem:
    """The shape of one forward call. In group mode batch is len(cu_seqlens_q) - 1 and the
    sequence lengths are max_seqlen_q / max_seqlen_k."""

    group: bool
    batch: int
    seqlen_q: int
    seqlen_k: int
    nhead_q: int
    nhead_k: int
    hdim_q: int
    hdim_v: int

    def copies(self, t: torch.Tensor) -> bool:
        """Whether fwd and bwd run the call on a zero-padded copy of t (q, k, v, out or dout:
        one of a head dim that is no multiple of 8, in a call that runs padded), whose layout
        is then the copy's, whatever t's."""
        return runs_padded(self.hdim_q, self.hdim_v) and t.shape[-1] % ROW_PIECE != 0


@dataclass(frozen=True)
class Options:
    """The scalar options of a call, as fmha::FwdArgs takes them."""

    softmax_scale: float
    mask: int
    mask_align: int
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float
    dropout_seed: Optional[int]  # None: drawn from torch's default generator at call time
    dropout_offset: int
    return_lse: bool


def _is_int(x) -> bool:
    # SymInt: under torch.compile an int argument may be traced symbolically.
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool)


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def row_piece(dtype: torch.dtype) -> int:
    """The elements of 16 bytes of `dtype`: what every stride but the contiguous one of an
    operand of that dtype is a multiple of."""
    return E4M3_ROW_PIECE if dtype == E4M3 else ROW_PIECE


def out_dtype(dtype: torch.dtype, requested: Optional[torch.dtype] = None) -> torch.dtype:
    """The output's dtype of a forward of inputs of `dtype`: `requested` (a checked out_dtype,
    check_out_dtype), else theirs, bfloat16 of e4m3."""
    if requested is not None:
        return requested
    return E4M3_OUT_DTYPE if dtype == E4M3 else dtype


def check_out_dtype(requested, dtype: torch.dtype, api: str = "fwd") -> Optional[torch.dtype]:
    """fwd's out_dtype for inputs of `dtype`: None or the default (q's dtype; bfloat16 of e4m3)
    gives None, and e4m3's float16 itself, what the FwdArgs' o_dtype then names."""
    if requested is None:
        return None
    if not isinstance(requested, torch.dtype):
        raise TypeError(f"fmha.{api}: out_dtype must be a torch.dtype or None, got "
                        f"{type(requested).__name__}")
    if dtype == E4M3:
        if requested not in E4M3_OUT_DTYPES:
            raise ValueError(f"fmha.{api}: out_dtype of {E4M3} inputs must be torch.bfloat16 "
                             f"(None means it) or torch.float16, got {requested}")
    elif requested != dtype:
        raise ValueError(f"fmha.{api}: out_dtype of {dtype} inputs must be {dtype} (None means "
                         f"it): the output is q's dtype, and only {E4M3} inputs choose theirs; "
                         f"got {requested}")
    return None if requested == out_dtype(dtype) else requested


def v_layout(v: torch.Tensor) -> tuple[int, int, int]:
    """(vlayout, seq stride, head-dim stride) of a (..., seqlen_k, nheads_k, headdim_v) V:
    row-major when its head dim is contiguous, column-major (V^T stored) when its sequence dim
    is; None for the layout when neither. A dimension of size 1 counts as contiguous."""
    seq_stride = v.stride(-3) if v.size(-3) > 1 else 1
    dim_stride = v.stride(-1) if v.size(-1) > 1 else 1
    if dim_stride == 1:
        return _C.VLAYOUT_ROW_MAJOR, kernel_strides(v)[-3], 1
    if seq_stride == 1:
        return _C.VLAYOUT_COL_MAJOR, 1, dim_stride
    return None, seq_stride, dim_stride


def check_mode(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, api: str = "fwd") -> bool:
    """Whether the call is in group mode (varlen), and that its group arguments are complete."""
    group = cu_seqlens_q is not None or cu_seqlens_k is not None
    if group and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError(
            f"fmha.{api}: group mode (varlen) needs both cu_seqlens_q and cu_seqlens_k, got only "
            + ("cu_seqlens_q" if cu_seqlens_k is None else "cu_seqlens_k")
        )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not group:
            if value is not None:
                raise ValueError(
                    f"fmha.{api}: {name} is for group mode (with cu_seqlens_q/cu_seqlens_k); "
                    "batch mode takes the lengths from the tensors"
                )
            continue
        if value is None:
            raise ValueError(f"fmha.{api}: group mode needs {name} (the longest sequence's length)")
        if not _is_int(value):
            raise TypeError(f"fmha.{api}: {name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"fmha.{api}: {name} must be non-negative, got {value}")
    return group


def check_inputs(q, k, v, group: bool, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, api: str = "fwd", fp8: bool = False) -> Problem:
    """fp8: the call may take float8_e4m3fn inputs (the forward's: fwd, select, explain)."""
    named = (("q", q), ("k", k), ("v", v))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fmha.{api}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dtype == E4M3 and not fp8:
        raise TypeError(
            f"fmha.{api}: q has dtype {q.dtype}, an input type of the forward only (fmha.fwd): "
            f"there is no FP8 backward; supported are torch.float16 and torch.bfloat16"
        )
    if q.dtype not in DTYPE_CODES and q.dtype != E4M3:
        raise TypeError(
            f"fmha.{api}: q has dtype {q.dtype}; supported are torch.float16 and torch.bfloat16"
            + (f", and {E4M3} (the forward's FP8 inputs)" if fp8 else "")
        )
    for name, t in named[1:]:
        if t.dtype != q.dtype:
            raise TypeError(
                f"fmha.{api}: {name} has dtype {t.dtype} but q has {q.dtype}; "
                "q, k and v must share one dtype"
            )
    cu_named = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    if group:
        for name, t in cu_named:
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"fmha.{api}: {name} must be a torch.Tensor, got {type(t).__name__}"
                )
            if t.dtype != torch.int32:
                raise TypeError(f"fmha.{api}: {name} has dtype {t.dtype}; it must be torch.int32")
    for name, t in named:
        if group and t.dim() != 3:
            raise ValueError(
                f"fmha.{api}: in group mode {name} must be 3-D (total_tokens, nheads, headdim), "
                f"got shape {_shape(t)}"
            )
        if not group and t.dim() != 4:
            raise ValueError(
                f"fmha.{api}: {name} must be 4-D (batch, seqlen, nheads, headdim), "
                f"got shape {_shape(t)}"
            )
    for name, t in named:
        if t.dim() and max(t.shape) >= INT_LIMIT:
            raise ValueError(
                f"fmha.{api}: {name} has shape {_shape(t)}; every size must be below 2**31 "
                "(fmha::FwdArgs holds them as int)"
            )
    if group:
        for name, t in cu_named:
            if t.dim() != 1 or t.shape[0] < 1:
                raise ValueError(
                    f"fmha.{api}: {name} must be 1-D with batch + 1 entries, got shape {_shape(t)}"
                )
            _check_entries_contiguous(name, t, api)
        if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
            raise ValueError(
                f"fmha.{api}: cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but cu_seqlens_k "
                f"has {cu_seqlens_k.shape[0]}; both are batch + 1"
            )
        (sq, hq, dq), (sk, hk, dk), (sv, hv, dv) = q.shape, k.shape, v.shape
        b = cu_seqlens_q.shape[0] - 1
        if sv != sk:
            raise ValueError(f"fmha.{api}: k has {sk} tokens but v has {sv}")
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
    else:
        (b, sq, hq, dq), (bk, sk, hk, dk), (bv, sv, hv, dv) = q.shape, k.shape, v.shape
        if not (bk == b and bv == b):
            raise ValueError(f"fmha.{api}: batch sizes differ: q {b}, k {bk}, v {bv}")
        if sv != sk:
            raise ValueError(f"fmha.{api}: k has seqlen {sk} but v has {sv}")
        seqlen_q, seqlen_k = sq, sk
    if hv != hk:
        raise ValueError(f"fmha.{api}: k has {hk} heads but v has {hv}")
    if dk != dq:
        raise ValueError(f"fmha.{api}: q has head dim {dq} but k has {dk}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"fmha.{api}: q's {hq} heads must be a multiple of k/v's {hk} heads (MQA/GQA)"
        )
    e4m3 = q.dtype == E4M3
    if e4m3 and (dq % E4M3_ROW_PIECE or dv % E4M3_ROW_PIECE or not dq or not dv):
        raise ValueError(
            f"fmha.{api}: {E4M3} head dims must be positive multiples of {E4M3_ROW_PIECE} (rows "
            f"move in 16-byte pieces of {E4M3_ROW_PIECE} elements, and e4m3 inputs are never "
            f"padded), got {dq} for q and k and {dv} for v"
        )
    p = Problem(group, b, seqlen_q, seqlen_k, hq, hk, dq, dv)
    layout = v_layout(v)[0]
    # The layouts of the tensors the kernels read: a tensor the call copies (p.copies) has the
    # copy's. (An e4m3 V is read as it is given, row-major or V^T.)
    laid_out = [(name, t) for name, t in named if not p.copies(t)]
    for name, t in laid_out:
        if name != "v" and t.stride(-1) != 1 and t.size(-1) > 1:
            raise ValueError(
                f"fmha.{api}: {name}'s last (head) dimension must be contiguous, got strides "
                f"{tuple(t.stride())}; pass {name}.contiguous() or a view of a contiguous tensor"
            )
    if e4m3 and group and layout == _C.VLAYOUT_COL_MAJOR:
        raise ValueError(
            f"fmha.{api}: in group mode (varlen) a {E4M3} v must have its head dimension "
            "contiguous (row-major, which the kernel transposes), got a V^T view (strides "
            f"{tuple(v.stride())}): TMA copies V^T tiles with the keys innermost and cannot copy "
            "one of a packed sequence whose first key is not a multiple of 16; pass "
            "v.contiguous(), or call batch mode"
        )
    if layout is None and not p.copies(v):
        raise ValueError(
            f"fmha.{api}: v must have its head dimension (last) or its sequence dimension "
            f"contiguous, got shape {_shape(v)} and strides {tuple(v.stride())}; pass "
            "v.contiguous(), or a transpose of a contiguous V^T for the column-major layout"
        )
    # fwd and bwd pad head dims up to 256 to multiples of 8 (runs_padded); past 256 such a head
    # dim would also make the strides of a contiguous tensor odd: say what is wrong in its own
    # terms.
    if not runs_padded(dq, dv) and (dq == 0 or dv == 0 or dq % ROW_PIECE or dv % ROW_PIECE):
        raise ValueError(
            f"fmha.{api}: head dims must be positive, and multiples of {ROW_PIECE} past 256 (the "
            f"kernels move rows in 16-byte pieces; smaller ones run zero-padded), got {dq} for "
            f"q and k and {dv} for v"
        )
    for name, t in laid_out:
        contiguous = -3 if name == "v" and layout == _C.VLAYOUT_COL_MAJOR else -1
        _check_strides(name, t, contiguous % t.dim(), api, row_piece(t.dtype))
    return p


def _descale_shapes(batch: int, nhead_k: int) -> str:
    return (f"(batch, nheads_k) = ({batch}, {nhead_k}), FlashAttention-3's, or one that "
            f"broadcasts to it: (), (1,), ({nhead_k},), (1, 1), ({batch}, 1) or (1, {nhead_k})")


def check_descales(descales: dict, dtype: torch.dtype, p: Problem, api: str = "fwd") -> None:
    """q_descale, k_descale, v_descale (name: tensor or None): what dequantizes e4m3 inputs,
    fp32 tensors of shape (batch, nheads_k) or one that broadcasts to it (a dimension of 1 is
    passed with stride 0); None is a factor of 1. Inputs of another dtype take none. Devices are
    checked with the others, last."""
    for name, t in descales.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fmha.{api}: {name} must be a torch.Tensor or None, got "
                            f"{type(t).__name__}")
        if dtype != E4M3:
            raise ValueError(
                f"fmha.{api}: {name} is for {E4M3} inputs (it dequantizes them); q has dtype "
                f"{dtype}, whose calls take no descale factors"
            )
        if t.dtype != torch.float32:
            raise TypeError(f"fmha.{api}: {name} must be torch.float32, got {t.dtype}")
        if not _broadcasts(_shape(t), (p.batch, p.nhead_k)):
            raise ValueError(f"fmha.{api}: {name} must have shape "
                             f"{_descale_shapes(p.batch, p.nhead_k)}; got {_shape(t)}")


def descale_strides(t: Optional[torch.Tensor]) -> tuple[int, int]:
    """The (batch, K/V head) strides of a checked descale tensor (check_descales), 0 on a
    dimension it broadcasts over (absent, or of size 1); (0, 0) for None."""
    if t is None or t.dim() == 0:
        return 0, 0
    strides = kernel_strides(t)
    return (0, strides[0]) if t.dim() == 1 else (strides[0], strides[1])


def kernel_strides(t: torch.Tensor) -> tuple:
    """The strides the kernels get: 0 for a dimension of size 0 or 1, which is never stepped
    over, so that its (arbitrary) stride cannot fail the alignment rule; e.g. x[:, :1] of an
    odd-strided tensor. One call per tensor: a call is fwd's host cost, paid on every call."""
    return tuple([0 if size <= 1 else stride for size, stride in zip(t.shape, t.stride())])


def rows_readable(t: torch.Tensor, piece: int = ROW_PIECE) -> bool:
    """Whether the kernels read t's rows as it is laid out: its head (last) dim contiguous and
    every other stride a multiple of `piece` elements (those of 16 bytes: ROW_PIECE of a 16-bit
    type, E4M3_ROW_PIECE of an FP8 cache), so that each row starts on a 16-byte boundary as a
    row does in memory. Where t starts is the caller's to check: by data_ptr() where it has
    one, by storage_offset() under torch.compile's fake tensors."""
    return ((t.stride(-1) == 1 or t.shape[-1] <= 1)
            and all(s % piece == 0 for s in kernel_strides(t)[:-1]))


def _check_strides(name: str, t: torch.Tensor, contiguous: int, api: str = "fwd",
                   piece: int = ROW_PIECE) -> None:
    """Every stride but the contiguous dimension's a multiple of `piece` elements (those of 16
    bytes: 8 of a 16-bit type, 16 of e4m3), so that each row starts on a 16-byte boundary: what
    the C++ checks ask of every stride they are given."""
    for dim, stride in enumerate(kernel_strides(t)):
        if dim == contiguous or stride % piece == 0:
            continue
        raise ValueError(
            f"fmha.{api}: {name} has strides {tuple(t.stride())}; every one but its contiguous "
            f"dimension's must be a multiple of {piece} elements (the kernels move rows in "
            f"16-byte pieces); pass {name}.contiguous()"
        )


def _check_entries_contiguous(name: str, t: torch.Tensor, api: str = "fwd") -> None:
    """The kernels read entry b of a per-sequence int32 array at offset b."""
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(
            f"fmha.{api}: {name} must be contiguous, got stride {t.stride(0)}; pass "
            f"{name}.contiguous()"
        )


def check_alignment(api: str = "fwd", **tensors: torch.Tensor) -> None:
    """Q, K and V start on a 16-byte boundary; a view at an element offset that is not a
    multiple of 8 does not. Called by the op's implementation, on real tensors: under
    torch.compile the checks above see fake ones, which have no data pointer. As in the C++
    checks, an empty problem (q without elements) reads no memory."""
    if next(iter(tensors.values())).numel() == 0:
        return
    for name, t in tensors.items():
        offset = t.data_ptr() % ALIGN_BYTES
        if t.numel() and offset:
            raise ValueError(
                f"fmha.{api}: {name} starts {offset} bytes past a 16-byte boundary; the kernels "
                f"load rows in 16-byte pieces, so it must start on one (a view at an element "
                f"offset that is not a multiple of {row_piece(t.dtype)} does not); pass "
                f"{name}.clone()"
            )


def _mask(causal: bool, window_size, api: str = "fwd") -> tuple[int, int, int]:
    """(mask type, window_left, window_right) in FlashAttention's conventions."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(
            f"fmha.{api}: window_size must be a (left, right) pair of ints, got {window_size!r}"
        )
    left, right = window_size
    if not (_is_int(left) and _is_int(right)):
        raise TypeError(
            f"fmha.{api}: window_size must be a (left, right) pair of ints, got {window_size!r}"
        )
    if left < -1 or right < -1:
        raise ValueError(
            f"fmha.{api}: window_size entries must be -1 (unbounded) or non-negative, got "
            f"{tuple(window_size)}"
        )
    if left >= INT_LIMIT or right >= INT_LIMIT:
        raise ValueError(
            f"fmha.{api}: window_size entries must be below 2**31 (fmha::FwdArgs holds them as "
            f"int), got {tuple(window_size)}; -1 is an unbounded side"
        )
    if causal and right > 0:
        raise ValueError(
            f"fmha.{api}: causal=True sees no key to the right, so window_size's right must be "
            f"0 or -1, got {tuple(window_size)}"
        )
    if left == -1 and right == -1:
        return (_C.MASK_CAUSAL if causal else _C.MASK_NONE), -1, -1
    # A window: with causal=True it is (left, 0), FlashAttention's convention.
    return _C.MASK_WINDOW, left, 0 if causal else right


def check_options(causal, softmax_scale, window_size, mask_align, softcap, dropout_p,
                  dropout_seed, dropout_offset, return_lse, hdim_q: int,
                  api: str = "fwd") -> Options:
    if not isinstance(causal, bool):
        raise TypeError(f"fmha.{api}: causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(hdim_q) if hdim_q > 0 else 1.0
    elif not _is_real(softmax_scale):
        raise TypeError(
            f"fmha.{api}: softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        )
    elif not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(
            f"fmha.{api}: softmax_scale must be finite and positive, got {softmax_scale}"
        )
    else:
        scale = float(softmax_scale)
    mask, window_left, window_right = _mask(causal, window_size, api)
    if not isinstance(mask_align, str):
        raise TypeError(f"fmha.{api}: mask_align must be a str, got {type(mask_align).__name__}")
    if mask_align not in MASK_ALIGNS:
        raise ValueError(
            f"fmha.{api}: mask_align must be 'top_left' (torch SDPA's is_causal) or 'bottom_right' "
            f"(FlashAttention's causal), got {mask_align!r}"
        )
    if not _is_real(softcap):
        raise TypeError(f"fmha.{api}: softcap must be a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(
            f"fmha.{api}: softcap must be finite and non-negative (0: off), got {softcap}"
        )
    if not _is_real(dropout_p):
        raise TypeError(f"fmha.{api}: dropout_p must be a float, got {type(dropout_p).__name__}")
    if not (math.isfinite(dropout_p) and 0 <= dropout_p < 1):
        raise ValueError(f"fmha.{api}: dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_seed is not None:
        if not _is_int(dropout_seed):
            raise TypeError(
                f"fmha.{api}: dropout_seed must be an int or None, got "
                f"{type(dropout_seed).__name__}"
            )
        if not 0 <= dropout_seed < SEED_LIMIT:
            raise ValueError(f"fmha.{api}: dropout_seed must be in [0, 2**64), got {dropout_seed}")
    if not _is_int(dropout_offset):
        raise TypeError(
            f"fmha.{api}: dropout_offset must be an int, got {type(dropout_offset).__name__}"
        )
    if not 0 <= dropout_offset < OFFSET_LIMIT:
        raise ValueError(f"fmha.{api}: dropout_offset must be in [0, 2**32), got {dropout_offset}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"fmha.{api}: return_lse must be a bool, got {type(return_lse).__name__}")
    return Options(scale, mask, MASK_ALIGNS[mask_align], window_left, window_right,
                   float(softcap), float(dropout_p), dropout_seed, int(dropout_offset),
                   return_lse)


def _broadcasts(shape: tuple, target: tuple) -> bool:
    return len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target))
    )


def bias_target(p: Problem) -> tuple:
    """The shape an elementwise bias broadcasts to; in group mode it is indexed per sequence."""
    return (p.batch, p.nhead_q, p.seqlen_q, p.seqlen_k)


def check_bias(bias, attn_mask, alibi_slopes, dtype: torch.dtype, p: Problem,
               api: str = "fwd") -> None:
    if bias is not None and attn_mask is not None:
        raise ValueError(f"fmha.{api}: pass bias or attn_mask, not both (attn_mask is a bias)")
    dims = "(batch, nheads, max_seqlen_q, max_seqlen_k)" if p.group else (
        "(batch, nheads, seqlen_q, seqlen_k)")
    for name, t in (("bias", bias), ("attn_mask", attn_mask)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fmha.{api}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if name == "bias" and t.dtype != dtype:
            raise TypeError(f"fmha.{api}: bias has dtype {t.dtype}; it must be q's dtype {dtype}")
        if name == "attn_mask" and t.dtype not in (torch.bool, dtype):
            raise TypeError(
                f"fmha.{api}: attn_mask has dtype {t.dtype}; it must be torch.bool (True: take "
                f"part) or q's dtype {dtype} (an additive bias)"
            )
        if not _broadcasts(_shape(t), bias_target(p)):
            raise ValueError(
                f"fmha.{api}: {name} of shape {_shape(t)} does not broadcast to {dims} = "
                f"{bias_target(p)}"
            )
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(
            f"fmha.{api}: alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}"
        )
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(
            f"fmha.{api}: alibi_slopes has dtype {alibi_slopes.dtype}; it must be torch.float32"
        )
    if _shape(alibi_slopes) not in ((p.nhead_q,), (p.batch, p.nhead_q)):
        raise ValueError(
            f"fmha.{api}: alibi_slopes must be (nheads,) = ({p.nhead_q},) or (batch, nheads) = "
            f"({p.batch}, {p.nhead_q}), got shape {_shape(alibi_slopes)}"
        )
    if bias is not None or attn_mask is not None:
        raise ValueError(
            f"fmha.{api}: alibi_slopes cannot be combined with bias or attn_mask (one bias per "
            "call)"
        )


def check_seqused(seqused_q, seqused_k, p: Problem, api: str = "fwd") -> None:
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fmha.{api}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"fmha.{api}: {name} has dtype {t.dtype}; it must be torch.int32")
        if _shape(t) != (p.batch,):
            raise ValueError(
                f"fmha.{api}: {name} must be (batch,) = ({p.batch},), got shape {_shape(t)}"
            )
        _check_entries_contiguous(name, t, api)


def check_bwd_options(v, p: Problem, bias, attn_mask, deterministic, return_dbias,
                      api: str = "bwd") -> None:
    """What fmha.bwd (and select_bwd/explain_bwd) asks beyond a forward call: a row-major V
    (the backward's kernels take no V^T; a copy, p.copies, is row-major), its two flags, and a
    bias for return_dbias."""
    if v_layout(v)[0] != _C.VLAYOUT_ROW_MAJOR and not p.copies(v):
        raise ValueError(
            f"fmha.{api}: v must be row-major (its head dimension contiguous) for the backward, "
            f"got strides {tuple(v.stride())}; a V^T view (sequence dimension contiguous) runs "
            "forward only: pass v.contiguous()"
        )
    for name, value in (("deterministic", deterministic), ("return_dbias", return_dbias)):
        if not isinstance(value, bool):
            raise TypeError(f"fmha.{api}: {name} must be a bool, got {type(value).__name__}")
    if not return_dbias:
        return
    if bias is None and (attn_mask is None or attn_mask.dtype == torch.bool):
        raise ValueError(
            f"fmha.{api}: return_dbias=True needs an elementwise bias (bias, or an additive "
            + ("attn_mask; a boolean attn_mask has no gradient)" if attn_mask is not None
               else "attn_mask), got none")
        )


def check_bwd_operands(dout, q, k, v, out, lse, p: Problem, o: Options,
                       api: str = "bwd") -> None:
    """fmha.bwd's operands beyond the forward's: out and lse as the forward returned them
    (fmha.fwd(..., return_lse=True)), dout of out's shape and dtype, both in layouts the kernels
    take where the call does not copy them (p.copies), and the forward's dropout seed. Devices
    are checked with the others, last."""
    for name, t in (("dout", dout), ("out", out), ("lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fmha.{api}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if out.dtype != q.dtype:
        raise TypeError(
            f"fmha.{api}: out has dtype {out.dtype} but q has {q.dtype}; out is the forward's "
            "output"
        )
    if dout.dtype != out.dtype:
        raise TypeError(
            f"fmha.{api}: dout has dtype {dout.dtype} but out has {out.dtype}; dout is the "
            "gradient of out"
        )
    if lse.dtype != torch.float32:
        raise TypeError(
            f"fmha.{api}: lse has dtype {lse.dtype}; it must be torch.float32, the log-sum-exp "
            "fmha.fwd(..., return_lse=True) returns"
        )
    out_shape = (*q.shape[:-1], v.shape[-1])
    if _shape(out) != out_shape:
        raise ValueError(
            f"fmha.{api}: out has shape {_shape(out)}; the forward's output has q's shape with "
            f"v's head dim, {out_shape}"
        )
    if _shape(dout) != _shape(out):
        raise ValueError(
            f"fmha.{api}: dout has shape {_shape(dout)} but out has {_shape(out)}; dout is the "
            "gradient of out"
        )
    lse_shape = (p.nhead_q, q.shape[0]) if p.group else (p.batch, p.nhead_q, p.seqlen_q)
    if _shape(lse) != lse_shape:
        dims = "(nheads, total_q)" if p.group else "(batch, nheads, seqlen_q)"
        raise ValueError(
            f"fmha.{api}: lse has shape {_shape(lse)}; the forward's log-sum-exp is {dims} = "
            f"{lse_shape}"
        )
    if lse.size(-1) > 1 and lse.stride(-1) != 1:
        raise ValueError(
            f"fmha.{api}: lse's last (row) dimension must be contiguous, got strides "
            f"{tuple(lse.stride())}; pass lse.contiguous()"
        )
    for name, t in (("out", out), ("dout", dout)):
        if p.copies(t):
            continue
        if t.stride(-1) != 1 and t.size(-1) > 1:
            raise ValueError(
                f"fmha.{api}: {name}'s last (head) dimension must be contiguous, got strides "
                f"{tuple(t.stride())}; pass {name}.contiguous()"
            )
        _check_strides(name, t, t.dim() - 1, api)
    if o.dropout_p > 0 and o.dropout_seed is None:
        raise ValueError(
            f"fmha.{api}: dropout_p > 0 needs dropout_seed, the forward call's (the backward "
            "regenerates its dropout pattern from the seed and offset); a forward without one "
            "drew its own, which only autograd through fmha.fwd keeps"
        )


def check_instance(instance, api: str = "fwd") -> None:
    if instance is not None and not isinstance(instance, str):
        raise TypeError(
            f"fmha.{api}: instance must be a str or None, got {type(instance).__name__}"
        )


def check_devices(api: str = "fwd", **tensors: Optional[torch.Tensor]) -> None:
    """Last of the checks, so that CPU and meta tensors reach every other one first. `tensors`
    starts with q; None stands for an argument not given."""
    q = next(iter(tensors.values()))
    if q.device.type != "cuda":
        raise ValueError(f"fmha.{api}: q is on {q.device}; fmha.{api} needs CUDA tensors")
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(
                f"fmha.{api}: {name} is on {t.device} but q is on {q.device}; "
                "all tensors must be on one GPU"
            )
