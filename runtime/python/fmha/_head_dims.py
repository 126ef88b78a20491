"""Head dims that are not multiples of 8: the kernels move rows in 16-byte pieces of 8 elements,
so fmha.fwd and fmha.bwd run such a call on copies of its tensors zero-padded to the next
multiple of 8 (FlashAttention-2 does the same), with the softmax scale of the call's own head
dim. Zero columns of q and k change no dot product, zero columns of v make output columns of
zeros, and the results are cut back to the call's head dims. A view into a wider buffer is
copied too: the columns past its head dim hold whatever the buffer holds, and the kernels would
read them.

fmha.fwd_kvcache's kernels take a partial last piece (they read and write nothing past a row's
head dim), so its operands need copies only where their rows do not start on 16-byte
boundaries (rows_in_place): a [..., :headdim] view of a buffer padded to a multiple of 8 runs
in place, a contiguous tensor of such a head dim is copied."""

from typing import Optional

import torch
import torch.nn.functional as F

from fmha._checks import ALIGN_BYTES, ROW_PIECE, kernel_strides

# The largest head dim any kernel takes: beyond it there is nothing to pad to, and the checks
# say so in their own words.
MAX_HEAD_DIM = 256


def needs_padding(q, v) -> bool:
    """Whether a call with q's and v's head dims runs padded: a head dim that is no multiple of
    8, and padded, within what the kernels take. Non-tensors fall through to the checks."""
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    shape_q, shape_v = q.shape, v.shape
    if not (shape_q and shape_v):
        return False
    dq, dv = shape_q[-1], shape_v[-1]
    return bool((dq | dv) % ROW_PIECE) and 0 < dq <= MAX_HEAD_DIM and 0 < dv <= MAX_HEAD_DIM


def rows_in_place(t: torch.Tensor) -> bool:
    """Whether each row of t (its last dim) starts on a 16-byte boundary: the head dim
    contiguous, every other stride a multiple of 8 elements and the data 16-byte aligned."""
    strides = kernel_strides(t)
    return (strides[-1] in (0, 1) and all(s % ROW_PIECE == 0 for s in strides[:-1])
            and t.data_ptr() % ALIGN_BYTES == 0)


def kvcache_needs_copies(*operands) -> bool:
    """Whether a fwd_kvcache call has an operand (tensors or None) whose head dim is no multiple
    of 8, within what the kernels take, and whose rows are not in place (rows_in_place).
    Anything else falls through to the checks."""
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    if len(tensors) != sum(t is not None for t in operands) or any(t.dim() == 0 for t in tensors):
        return False
    dims = [t.shape[-1] for t in tensors]
    return (all(0 < d <= MAX_HEAD_DIM for d in dims) and any(d % ROW_PIECE for d in dims)
            and not all(rows_in_place(t) for t in tensors))


def padded_rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """t itself where its rows are in place, else a copy zero-padded to a multiple of 8."""
    return t if t is None or rows_in_place(t) else pad(t)


def pad(x):
    """x with its last (head) dim zero-padded to a multiple of 8 (a copy), or x itself (also
    what is no tensor, for the checks to name)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    missing = -x.shape[-1] % ROW_PIECE
    return F.pad(x, (0, missing)) if missing else x


def default_scale(q: torch.Tensor, softmax_scale: Optional[float]) -> float:
    """The scale of the call's own head dim: 1/sqrt(headdim), not of the padded one."""
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
