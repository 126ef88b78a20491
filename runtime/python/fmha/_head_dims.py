"""Head dims that are not multiples of 8: the kernels move rows in 16-byte pieces of 8 elements,
so fmha.fwd and fmha.bwd run such a call on copies of its tensors zero-padded to the next
multiple of 8 (FlashAttention-2 does the same), with the softmax scale of the call's own head
dim. Zero columns of q and k change no dot product, zero columns of v make output columns of
zeros, and the results are cut back to the call's head dims. A view into a wider buffer is
copied too: the columns past its head dim hold whatever the buffer holds, and the kernels would
read them."""

from typing import Optional

import torch
import torch.nn.functional as F

from fmha._checks import ROW_PIECE

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
