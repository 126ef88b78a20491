"""Head dims that are not multiples of 8: the kernels move rows in 16-byte pieces of 8 elements,
so fmha.fwd and fmha.bwd run such a call (fmha._checks.runs_padded) on copies of its tensors
zero-padded to the next multiple of 8 (FlashAttention-2 does the same), with the softmax scale
of the call's own head dim. Zero columns of q and k change no dot product, zero columns of v
make output columns of zeros, and the results are cut back to the call's head dims. A view into
a wider buffer is copied too: the columns past its head dim hold whatever the buffer holds, and
the kernels would read them.

fmha.fwd_kvcache's kernels take a partial last piece (they read and write nothing past a row's
head dim), so its operands need copies only where their rows do not start on 16-byte
boundaries (rows_in_place): a [..., :headdim] view of a buffer padded to a multiple of 8 runs
in place, a contiguous tensor of such a head dim runs on a copy that is such a view. An FP8
(e4m3) cache is never copied: its head dims are multiples of 16 and its rows must be in place,
which fwd_kvcache's checks say where they are not.

Every check that needs no copy comes first: the callers check the call as it will run, but for
the layouts of the tensors it copies (fmha._checks.Problem.copies, rows_copied), before they
copy. select and explain (and their backward and KV-cache forms) describe the call on the
copies, through meta tensors of the copies' shapes and strides (`meta=True`): nothing is
copied."""

from typing import Optional

import torch
import torch.nn.functional as F

from fmha._checks import ALIGN_BYTES, MAX_HEAD_DIM, ROW_PIECE, kernel_strides, runs_padded


def needs_padding(q, v) -> bool:
    """Whether a call with q's and v's head dims runs padded (fmha._checks.runs_padded).
    Non-tensors fall through to the checks."""
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    shape_q, shape_v = q.shape, v.shape
    return bool(shape_q and shape_v) and runs_padded(shape_q[-1], shape_v[-1])


def rows_in_place(t: torch.Tensor) -> bool:
    """Whether each row of t (its last dim) starts on a 16-byte boundary: the head dim
    contiguous, every other stride a multiple of 8 elements and the data 16-byte aligned."""
    strides = kernel_strides(t)
    return (strides[-1] in (0, 1) and all(s % ROW_PIECE == 0 for s in strides[:-1])
            and t.data_ptr() % ALIGN_BYTES == 0)


def rows_copied(t: Optional[torch.Tensor]) -> bool:
    """Whether fwd_kvcache runs on a copy of operand t (padded_rows): a tensor whose head dim
    is no multiple of 8 and whose rows are not in place; never an e4m3 cache, which the kernel
    writes in place and reads in 16-byte pieces of 16 elements (the checks refuse its other
    layouts)."""
    return (t is not None and t.dtype != torch.float8_e4m3fn and t.shape[-1] % ROW_PIECE != 0
            and not rows_in_place(t))


def kvcache_needs_copies(*operands) -> bool:
    """Whether a fwd_kvcache call (its tensors or None) runs on copies: head dims within what
    the kernels take, and an operand that rows_copied. Anything else falls through to the
    checks."""
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    if len(tensors) != sum(t is not None for t in operands) or any(t.dim() == 0 for t in tensors):
        return False
    return (all(0 < t.shape[-1] <= MAX_HEAD_DIM for t in tensors)
            and any(rows_copied(t) for t in tensors))


def padded_rows(t: Optional[torch.Tensor], meta: bool = False) -> Optional[torch.Tensor]:
    """t itself where fwd_kvcache runs it in place (not rows_copied), else a copy whose rows
    start 16 bytes apart: the [..., :headdim] view of pad(t). meta: as pad's."""
    return pad(t, meta)[..., :t.shape[-1]] if rows_copied(t) else t


def pad(x, meta: bool = False):
    """x with its last (head) dim zero-padded to a multiple of 8: a contiguous copy, whatever
    x's layout (that of a V^T view, whose sequence dim is contiguous, included), or x itself
    where the head dim is one (also what is no tensor, for the checks to name). meta: a meta
    tensor of the copy's shape and strides instead of the copy, which select and explain
    describe without copying anything."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] % ROW_PIECE == 0:
        return x
    if x.dtype == torch.float8_e4m3fn:
        # A copy of a cache would take the appends the kernel writes; fwd_kvcache's checks
        # refuse such an e4m3 cache before this.
        raise ValueError(f"an e4m3 (FP8) tensor of head dim {x.shape[-1]} is never padded or "
                         f"copied: its head dim must be a multiple of 16")
    missing = -x.shape[-1] % ROW_PIECE
    if meta:
        return torch.empty((*x.shape[:-1], x.shape[-1] + missing), dtype=x.dtype, device="meta")
    # F.pad keeps a channels-last layout, a V^T view's, whose strides (the sequence length)
    # need not be multiples of 8; the copy is row-major whatever x's layout.
    return F.pad(x, (0, missing)).contiguous()


def default_scale(q: torch.Tensor, softmax_scale: Optional[float]) -> float:
    """The scale of the call's own head dim: 1/sqrt(headdim), not of the padded one."""
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
