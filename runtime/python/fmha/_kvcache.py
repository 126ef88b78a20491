"""fmha.fwd_kvcache: attention against a KV cache (decode, chunked prefill), after
FlashAttention's flash_attn_with_kvcache.

A decode step runs for microseconds on the GPU, so the host path is a plan per call signature,
as fmha.fwd's (fmha._plans): the first call of a signature runs every check and keeps the
KvcacheArgs it built and the workspace size; a later call allocates out (and the log-sum-exp)
and the workspace, reads its tensors' pointers and crosses into C++ once (KvcacheArgs.run).
The lengths live on the GPU (cache_seqlens), so a captured CUDA graph replays a step with new
lengths and new tokens without host work.

A cache holds q's dtype, or float8 e4m3 (torch.float8_e4m3fn) with k_scale and v_scale, fp32
dequantization factors for the tensor, per K/V head or per sequence and K/V head: half the
bytes a decode step reads. The new tokens k and v stay in q's dtype; the kernel quantizes them
as it appends them.
"""

import math
import warnings
from typing import Optional

import torch

from fmha import _C, _head_dims, _plans
from fmha._api import _ask, _mark_given, _raise_for, _target_cc
from fmha._checks import (
    DTYPE_CODES,
    E4M3,
    E4M3_ROW_PIECE,
    INT_LIMIT,
    ROW_PIECE,
    check_alignment,
    check_devices,
    check_instance,
    kernel_strides,
    rows_readable,
)

_API = "fwd_kvcache"


def _fail(message: str) -> None:
    raise ValueError(f"fmha.{_API}: {message}")


def _check_tensor(name: str, t, ndim: Optional[int], dtype=None) -> None:
    """A tensor of `ndim` dimensions (None: any) and `dtype` (None: any)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fmha.{_API}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        _fail(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")


def _check_rows(name: str, t: torch.Tensor) -> None:
    """fmha._checks.rows_readable, or an error saying which half of it fails (what the C++
    checks ask too): rows of 16-byte pieces, of 8 elements of a 16-bit type and 16 of an e4m3
    cache."""
    piece = E4M3_ROW_PIECE if t.dtype == E4M3 else ROW_PIECE
    if rows_readable(t, piece):
        return
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(f"{name} must have its last (head) dimension contiguous, got strides "
              f"{tuple(t.stride())}; pass {name}.contiguous()")
    _fail(f"{name} has strides {tuple(t.stride())}; every one but the head dim's must be a "
          f"multiple of {piece} elements (its rows move in 16-byte pieces); pass "
          f"{name}.contiguous()")



def _scale_shapes(batch: int, nhead_k: int) -> str:
    return (f"() or (1,) (one for the tensor), ({nhead_k},) (one per K/V head) or ({batch}, "
            f"{nhead_k}) (one per sequence and K/V head)")


def _check_cache_dtypes(q, k_cache, v_cache) -> bool:
    """Both caches hold q's dtype, or both e4m3; whether they are e4m3."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype not in (q.dtype, E4M3):
            _fail(f"{name} must be {q.dtype} (q's dtype) or {E4M3} (an FP8 cache, with k_scale "
                  f"and v_scale), got {cache.dtype}")
    if v_cache.dtype != k_cache.dtype:
        _fail(f"k_cache and v_cache must hold one dtype, got {k_cache.dtype} and "
              f"{v_cache.dtype}")
    return k_cache.dtype == E4M3


def _scale_strides(name: str, scale, e4m3: bool, batch: int, nhead_k: int,
                   cache_dtype) -> tuple:
    """The (batch, head) strides of k_scale or v_scale, (0, 0) without one: a tensor of fp32
    dequantization factors of an e4m3 cache, for the tensor, per K/V head or per sequence and
    K/V head. A cache of q's dtype takes none."""
    if scale is None:
        if e4m3:
            _fail(f"an e4m3 cache ({E4M3}) needs k_scale and v_scale, fp32 tensors of its "
                  f"dequantization factors (a key is k_cache * k_scale, a value v_cache * "
                  f"v_scale) of shape {_scale_shapes(batch, nhead_k)}; {name} is missing")
        return 0, 0
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"fmha.{_API}: {name} must be a torch.Tensor or None, got "
                        f"{type(scale).__name__}")
    if not e4m3:
        _fail(f"{name} dequantizes an e4m3 cache ({E4M3}); a {cache_dtype} cache takes none")
    if scale.dtype != torch.float32:
        _fail(f"{name} must be torch.float32, got {scale.dtype}")
    shape, strides = tuple(scale.shape), kernel_strides(scale)
    if shape in ((), (1,)):
        return 0, 0
    if shape == (nhead_k,):
        return 0, strides[0]
    if shape == (batch, nhead_k):
        return strides
    _fail(f"{name} must have shape {_scale_shapes(batch, nhead_k)}, got {shape}")


def _check_index(name: str, t, shape: tuple) -> None:
    _check_tensor(name, t, len(shape), torch.int32)
    if tuple(t.shape) != shape:
        _fail(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(f"{name} must be contiguous in its last dimension; pass {name}.contiguous()")


def _mask(causal, window_size) -> tuple:
    if not isinstance(causal, bool):
        raise TypeError(f"fmha.{_API}: causal must be a bool, got {type(causal).__name__}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in window_size)):
        raise TypeError(f"fmha.{_API}: window_size must be a (left, right) pair of ints, got "
                        f"{window_size!r}")
    left, right = window_size
    if left < -1 or right < -1 or left >= INT_LIMIT or right >= INT_LIMIT:
        _fail(f"window_size entries must be -1 (unbounded) or in [0, 2**31), got "
              f"{tuple(window_size)}")
    if causal and right > 0:
        _fail(f"causal=True sees no key to the right, so window_size's right must be 0 or -1, "
              f"got {tuple(window_size)}")
    if left == -1 and right == -1:
        return (_C.MASK_CAUSAL if causal else _C.MASK_NONE), -1, -1
    return _C.MASK_WINDOW, left, 0 if causal else right


class _KvcachePlan:
    """A checked call signature: its KvcacheArgs (sizes, strides, options), the shapes of its
    outputs and its workspace's size, on its device."""

    __slots__ = ("args", "out_shape", "lse_shape", "workspace_bytes", "device")

    def __init__(self, args, out_shape, lse_shape, workspace_bytes: int, device: int):
        self.args = args
        self.out_shape = out_shape  # rows of the head dim up to a multiple of 8 (_build_args)
        self.lse_shape = lse_shape
        self.workspace_bytes = workspace_bytes
        self.device = device

    def run(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, rotary_cos, rotary_sin, alibi_slopes, k_scale, v_scale, instance):
        out = q.new_empty(self.out_shape)
        if out.shape[-1] != self.args.hdim_v:
            out = out[..., :self.args.hdim_v]
        lse = None if self.lse_shape is None else q.new_empty(self.lse_shape, dtype=torch.float32)
        workspace = q.new_empty(self.workspace_bytes, dtype=torch.uint8) \
            if self.workspace_bytes else None
        ptr = _pointer
        call = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), ptr(k), ptr(v),
                out.data_ptr(), ptr(lse), cache_seqlens.data_ptr(), ptr(cache_batch_idx),
                ptr(cache_leftpad), ptr(block_table), ptr(rotary_cos), ptr(rotary_sin),
                ptr(alibi_slopes), ptr(k_scale), ptr(v_scale), ptr(workspace),
                torch._C._cuda_getCurrentRawStream(self.device), instance)
        if torch._C._cuda_getDevice() == self.device:
            failed = self.args.run(*call)
        else:
            with torch.cuda.device(self.device):  # the dispatcher picks by the current device
                failed = self.args.run(*call)
        if failed is not None:
            _raise_for(*failed)
        return out, lse


def _pointer(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _layout(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.get_device())


def _call_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
              cache_leftpad, rotary_cos, rotary_sin, alibi_slopes, k_scale, v_scale,
              rotary_interleaved, causal, window_size, softcap, softmax_scale, num_splits,
              return_lse, instance) -> Optional[tuple]:
    """The signature of a call (and of the instance it names, whose workspace may differ from
    the dispatcher's choice's) whose tensors are plain tensors (or None) and whose options have
    their documented types exactly (a bool is no int here), so that two calls with one key pass
    the same checks; None for any other call, which then runs every check and raises what they
    find. A flat tuple: a decode step's host time is mostly this key (about 4 us of the H100
    machine's 30 for the whole call when built operand by operand)."""
    if (q.__class__ is not torch.Tensor or k_cache.__class__ is not torch.Tensor
            or v_cache.__class__ is not torch.Tensor
            or cache_seqlens.__class__ is not torch.Tensor):
        return None
    for t in (k, v, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
              alibi_slopes, k_scale, v_scale):
        if t is not None and t.__class__ is not torch.Tensor:
            return None
    for flag in (rotary_interleaved, causal, return_lse):
        if flag is not True and flag is not False:
            return None
    if not (window_size.__class__ is tuple and len(window_size) == 2
            and window_size[0].__class__ is int and window_size[1].__class__ is int):
        return None
    if not (_plans.is_real(softcap) and (softmax_scale is None or _plans.is_real(softmax_scale))
            and num_splits.__class__ is int):
        return None
    return (_layout(q), _layout(k_cache), _layout(v_cache), _layout(cache_seqlens),
            None if k is None else _layout(k), None if v is None else _layout(v),
            None if block_table is None else _layout(block_table),
            None if cache_batch_idx is None else _layout(cache_batch_idx),
            None if cache_leftpad is None else _layout(cache_leftpad),
            None if rotary_cos is None else _layout(rotary_cos),
            None if rotary_sin is None else _layout(rotary_sin),
            None if alibi_slopes is None else _layout(alibi_slopes),
            None if k_scale is None else _layout(k_scale),
            None if v_scale is None else _layout(v_scale),
            rotary_interleaved, causal, window_size, softcap, softmax_scale, num_splits,
            return_lse, instance)


def _build_args(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, rotary_cos, rotary_sin, rotary_interleaved, causal, window_size,
                softcap, alibi_slopes, softmax_scale, num_splits, return_lse,
                check_device: bool = True, on_copies: bool = False, *, k_scale=None,
                v_scale=None):
    """Every check of a call, then its KvcacheArgs (pointers left 0) and output shapes. Without
    check_device (select/explain for a named GPU), tensors may be on any device. on_copies: the
    call runs on copies of the operands that _head_dims.rows_copied (_fwd_kvcache_on_copies),
    whose rows are the copies' and go unchecked here (never an e4m3 cache's: it is written in
    place)."""
    _check_tensor("q", q, 4)
    if q.dtype not in DTYPE_CODES:
        _fail(f"q must be float16 or bfloat16, got {q.dtype}" + (
            f"; {E4M3} queries have no KV-cache kernel (an FP8 cache is k_cache and v_cache of "
            f"{E4M3}, with k_scale and v_scale, beside 16-bit queries)" if q.dtype == E4M3
            else ""))
    batch, seqlen_q, nhead_q, hdim_q = q.shape
    _check_tensor("k_cache", k_cache, 4)
    _check_tensor("v_cache", v_cache, 4)
    e4m3 = _check_cache_dtypes(q, k_cache, v_cache)
    paged = block_table is not None
    batch_cache, rows_cache, nhead_k, hdim_k = k_cache.shape
    hdim_v = v_cache.shape[3]
    if tuple(v_cache.shape[:3]) != (batch_cache, rows_cache, nhead_k):
        _fail(f"v_cache's shape {tuple(v_cache.shape)} must match k_cache's "
              f"{tuple(k_cache.shape)} in all but the head dim")
    if hdim_k != hdim_q:
        _fail(f"k_cache's head dim {hdim_k} must equal q's {hdim_q}")
    if batch == 0 or seqlen_q == 0 or nhead_q == 0:
        _fail(f"q must have a non-empty batch, sequence and head dimension, got shape "
              f"{tuple(q.shape)}")
    if nhead_k == 0 or nhead_q % nhead_k:
        _fail(f"q's {nhead_q} heads must be a multiple of the cache's {nhead_k} (MQA/GQA)")
    for name, d in (("q", hdim_q), ("v_cache", hdim_v)):
        if d == 0:
            _fail(f"{name}'s head dim must be positive")
    if e4m3 and (hdim_q % E4M3_ROW_PIECE or hdim_v % E4M3_ROW_PIECE):
        _fail(f"an e4m3 cache's head dims must be multiples of {E4M3_ROW_PIECE} (its rows move "
              f"in whole 16-byte pieces of {E4M3_ROW_PIECE} elements, and it is written in "
              f"place, never copied), got {hdim_q} for k_cache and {hdim_v} for v_cache")
    k_scale_strides = _scale_strides("k_scale", k_scale, e4m3, batch, nhead_k, k_cache.dtype)
    v_scale_strides = _scale_strides("v_scale", v_scale, e4m3, batch, nhead_k, k_cache.dtype)
    seqlen_new = 0
    if (k is None) != (v is None):
        _fail("k and v are appended together: pass both or neither")
    if k is not None:
        _check_tensor("k", k, 4, q.dtype)
        _check_tensor("v", v, 4, q.dtype)
        seqlen_new = k.shape[1]
        if tuple(k.shape) != (batch, seqlen_new, nhead_k, hdim_q):
            _fail(f"k must have shape (batch, seqlen_new, nheads_k, headdim) = "
                  f"{(batch, seqlen_new, nhead_k, hdim_q)}, got {tuple(k.shape)}")
        if tuple(v.shape) != (batch, seqlen_new, nhead_k, hdim_v):
            _fail(f"v must have shape {(batch, seqlen_new, nhead_k, hdim_v)}, got "
                  f"{tuple(v.shape)}")
    _check_index("cache_seqlens", cache_seqlens, (batch,))
    if paged:
        if cache_batch_idx is not None:
            _fail("cache_batch_idx selects rows of a contiguous cache; a paged cache is "
                  "addressed through block_table")
        if cache_leftpad is not None:
            _fail("cache_leftpad offsets the keys of a contiguous cache's rows; a paged cache "
                  "takes none (as FlashAttention's)")
        _check_tensor("block_table", block_table, 2, torch.int32)
        if block_table.shape[0] != batch or block_table.shape[1] == 0:
            _fail(f"block_table must have shape (batch, pages_per_sequence) with batch {batch} "
                  f"and at least one page, got {tuple(block_table.shape)}")
        _check_index("block_table", block_table, tuple(block_table.shape))
        page_size = rows_cache
        seqlen_cache = block_table.shape[1] * page_size
    else:
        page_size = 0
        seqlen_cache = rows_cache
        if cache_batch_idx is not None:
            _check_index("cache_batch_idx", cache_batch_idx, (batch,))
        if cache_leftpad is not None:
            _check_index("cache_leftpad", cache_leftpad, (batch,))
        elif batch_cache < batch:
            _fail(f"the cache holds {batch_cache} sequences, q {batch}; pass cache_batch_idx "
                  "to map sequences to cache rows")
    if seqlen_cache >= INT_LIMIT:
        _fail(f"a sequence's cache holds {seqlen_cache} keys; at most 2**31 - 1")
    mask, window_left, window_right = _mask(causal, window_size)
    rotary_dim = 0
    seqlen_rotary = 0
    if (rotary_cos is None) != (rotary_sin is None):
        _fail("rotary_cos and rotary_sin go together: pass both or neither")
    if rotary_cos is not None:
        if k is None:
            _fail("rotary embeddings rotate the appended k (and q): pass k and v")
        _check_tensor("rotary_cos", rotary_cos, 2, q.dtype)
        _check_tensor("rotary_sin", rotary_sin, 2, q.dtype)
        if rotary_cos.shape != rotary_sin.shape:
            _fail(f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin "
                  f"{tuple(rotary_sin.shape)} must have one shape")
        seqlen_rotary, half = rotary_cos.shape
        rotary_dim = 2 * half
        if rotary_dim == 0 or rotary_dim > hdim_q:
            _fail(f"rotary_cos must have shape (seqlen_rotary, rotary_dim / 2) with 0 < rotary_dim "
                  f"<= headdim {hdim_q}, got {tuple(rotary_cos.shape)}")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not t.is_contiguous():
                _fail(f"{name} must be contiguous; pass {name}.contiguous()")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"fmha.{_API}: rotary_interleaved must be a bool")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(hdim_q)
    elif not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"fmha.{_API}: softmax_scale must be a float or None")
    elif not (math.isfinite(softmax_scale) and softmax_scale > 0):
        _fail(f"softmax_scale must be finite and positive, got {softmax_scale}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
        raise TypeError(f"fmha.{_API}: softcap must be a float")
    if not (math.isfinite(softcap) and softcap >= 0):
        _fail(f"softcap must be finite and non-negative (0: off), got {softcap}")
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes, None, torch.float32)  # its shape next
        if tuple(alibi_slopes.shape) not in ((nhead_q,), (batch, nhead_q)):
            _fail(f"alibi_slopes must have shape ({nhead_q},) or ({batch}, {nhead_q}), got "
                  f"{tuple(alibi_slopes.shape)}")
        if alibi_slopes.stride(-1) != 1:
            _fail("alibi_slopes must be contiguous in its last dimension")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise TypeError(f"fmha.{_API}: num_splits must be an int >= 0 (0: chosen from the "
                        f"shapes), got {num_splits!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"fmha.{_API}: return_lse must be a bool")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None and not (on_copies and _head_dims.rows_copied(t)):
            _check_rows(name, t)
    if check_device:
        check_devices(api=_API, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                      cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                      cache_leftpad=cache_leftpad, block_table=block_table,
                      rotary_cos=rotary_cos, rotary_sin=rotary_sin, alibi_slopes=alibi_slopes,
                      k_scale=k_scale, v_scale=v_scale)

    a = _C.KvcacheArgs()
    a.dtype = DTYPE_CODES[q.dtype]
    if e4m3:
        a.kv_dtype = _C.KV_DTYPE_E4M3
        a.k_scale_batch_stride, a.k_scale_head_stride = k_scale_strides
        a.v_scale_batch_stride, a.v_scale_head_stride = v_scale_strides
    a.batch, a.seqlen_q, a.nhead_q, a.hdim_q = batch, seqlen_q, nhead_q, hdim_q
    a.seqlen_new, a.seqlen_cache, a.batch_cache = seqlen_new, seqlen_cache, batch_cache
    a.nhead_k, a.hdim_v = nhead_k, hdim_v
    a.q_batch_stride, a.q_seq_stride, a.q_head_stride = kernel_strides(q)[:3]
    a.k_cache_batch_stride, a.k_cache_seq_stride, a.k_cache_head_stride = k_cache.stride()[:3]
    a.v_cache_batch_stride, a.v_cache_seq_stride, a.v_cache_head_stride = v_cache.stride()[:3]
    if k is not None:
        a.k_new_batch_stride, a.k_new_seq_stride, a.k_new_head_stride = kernel_strides(k)[:3]
        a.v_new_batch_stride, a.v_new_seq_stride, a.v_new_head_stride = kernel_strides(v)[:3]
    # out's rows start 16 bytes apart: a head dim that is no multiple of 8 gets the columns up
    # to one, and the call returns the view of its own.
    pitch = hdim_v + -hdim_v % ROW_PIECE
    out_shape = (batch, seqlen_q, nhead_q, pitch)
    a.o_batch_stride = seqlen_q * nhead_q * pitch
    a.o_seq_stride, a.o_head_stride = nhead_q * pitch, pitch
    lse_shape = (batch, nhead_q, seqlen_q) if return_lse else None
    a.lse_batch_stride, a.lse_head_stride = nhead_q * seqlen_q, seqlen_q
    if paged:
        a.block_table_batch_stride = block_table.stride(0)
        a.page_size = page_size
    a.rotary_dim, a.seqlen_rotary, a.rotary_interleaved = rotary_dim, seqlen_rotary, \
        rotary_interleaved
    a.softmax_scale = float(softmax_scale)
    a.mask, a.window_left, a.window_right = mask, window_left, window_right
    if alibi_slopes is not None:
        a.bias = _C.BIAS_ALIBI
        # A (batch, heads) view may broadcast its heads' slopes over the batch (stride 0).
        a.alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    a.softcap = float(softcap)
    a.num_splits = num_splits
    return a, out_shape, lse_shape


_PLANS = _plans.PlanTable()


def fwd_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                cache_batch_idx=None, cache_leftpad=None, rotary_cos=None, rotary_sin=None,
                rotary_interleaved=False, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, softmax_scale=None, num_splits=0, return_lse=False,
                k_scale=None, v_scale=None, instance=None):
    """Attention of q against a KV cache, FlashAttention's flash_attn_with_kvcache.

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_k, headdim), or with block_table paged: (num_pages, page_size, nheads_k, headdim),
    any page size. k, v (optional): (batch, seqlen_new, nheads_k, headdim), written into the
    cache in place at positions cache_seqlens[b] .. + seqlen_new - 1 before attention (rotated
    by rotary_cos/rotary_sin, (seqlen_rotary, rotary_dim / 2), when given: k at its position,
    q at cache_seqlens + i under a mask, else at cache_seqlens). cache_seqlens: int32 (batch,)
    on the GPU, the keys cached before the call; sequence b attends to cache_seqlens[b] +
    seqlen_new keys (never past the cache's end), from key cache_leftpad[b] on when given
    (int32 (batch,), contiguous caches: a left-padded batch; rotary positions stay the cache's
    row indices). causal and window_size align the query tokens with the last keys
    (bottom-right). num_splits: key splits per sequence and K/V head, 0 to
    choose from the shapes and the GPU. Returns out (batch, seqlen_q, nheads, headdim), and
    with return_lse the log-sum-exp (batch, nheads, seqlen_q) in fp32.

    The caches hold q's dtype, or both torch.float8_e4m3fn (an FP8 cache: half the bytes a
    decode step reads), whose key is k_cache * k_scale and value v_cache * v_scale: k_scale and
    v_scale are fp32 tensors on the caches' GPU of shape () or (1,) (one for the tensor),
    (nheads_k,) (one per K/V head) or (batch, nheads_k) (one per sequence and K/V head, as
    FlashAttention-3's k_descale/v_descale), required with an e4m3 cache and refused with
    another. k and v stay in q's dtype: they are divided by the scales, saturated to +-448 and
    rounded to e4m3 as they are appended. An e4m3 cache's head dims are multiples of 16 and its
    strides (in elements, i.e. bytes) too: it is written in place, never copied.

    Decode steps (a few query tokens) run the split-KV decode kernel. On H100/H200, chunks of
    at least a tile of query tokens (128; 192 at head dim 64) or of 256 query tokens x query
    heads per K/V head (32 tokens at GQA 8:1), on a contiguous cache or on pages of a multiple
    of 8 keys, run the chunked-prefill kernel (the fa3 forward reading the cache by TMA), which
    needs no key splits and ignores num_splits; fmha.select_kvcache says which. So do such
    chunks on an e4m3 cache of head dim 64 or 128: the kernel widens the cache's tiles to fp16
    in shared memory and computes its products in fp16 (bf16 queries converted to fp16 in the
    kernel); at head dim 256 they run the decode kernel.
    """
    check_instance(instance, _API)
    key = _call_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
                    cache_leftpad, rotary_cos, rotary_sin, alibi_slopes, k_scale, v_scale,
                    rotary_interleaved, causal, window_size, softcap, softmax_scale, num_splits,
                    return_lse, instance)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None and _head_dims.kvcache_needs_copies(q, k_cache, v_cache, k, v):
        # Every check first: a bad call fails before anything is copied.
        _build_args(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, rotary_cos, rotary_sin, rotary_interleaved, causal, window_size,
                    softcap, alibi_slopes, softmax_scale, num_splits, return_lse,
                    on_copies=True, k_scale=k_scale, v_scale=v_scale)
        return _fwd_kvcache_on_copies(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, rotary_cos=rotary_cos,
            rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse,
            k_scale=k_scale, v_scale=v_scale, instance=instance)
    if plan is None:
        args, out_shape, lse_shape = _build_args(
            q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
            rotary_cos,
            rotary_sin, rotary_interleaved, causal, window_size, softcap, alibi_slopes,
            softmax_scale, num_splits, return_lse, k_scale=k_scale, v_scale=v_scale)
        check_alignment(_API, q=q, k_cache=k_cache, v_cache=v_cache,
                        **({} if k is None else {"k": k, "v": v}))
        device = q.get_device()
        with torch.cuda.device(device):
            # The workspace's size depends on the instance (its tile) and on which optional
            # operands the call has; run() sets every pointer from the call's tensors.
            _mark_given(args, k_new=k, v_new=v, block_table=block_table,
                        cache_leftpad=cache_leftpad, rotary_cos=rotary_cos,
                        alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale)
            # A miss compiles on demand (fmha.jit), in C++, unless the stream captures a graph.
            code, message, workspace_bytes = _C.kvcache_workspace_size(
                args, instance, torch._C._cuda_getCurrentRawStream(device))
            _raise_for(code, message)
        args.workspace_bytes = workspace_bytes
        plan = _KvcachePlan(args, out_shape, lse_shape, workspace_bytes, device)
        if key is not None:
            _PLANS.put(key, plan)
    out, lse = plan.run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                        block_table, rotary_cos, rotary_sin, alibi_slopes, k_scale, v_scale,
                        instance)
    return (out, lse) if return_lse else out


def _fwd_kvcache_on_copies(q, k_cache, v_cache, k, v, **options):
    """fwd_kvcache of a call with a head dim that is no multiple of 8 in rows that do not start
    on 16-byte boundaries (a contiguous tensor of such a head dim): on copies of the operands
    whose rows are not in place, each the [..., :headdim] view of a buffer zero-padded to a
    multiple of 8 (_head_dims.padded_rows), so that every head dim stays the call's. A cache
    copied here and appended to is copied back: the whole cache each call, which a serving loop
    avoids by allocating its caches as such views (they run in place, as every operand that is
    one)."""
    k_run, v_run = _head_dims.padded_rows(k_cache), _head_dims.padded_rows(v_cache)
    if k_run is not k_cache or v_run is not v_cache:
        warnings.warn(
            f"fmha.{_API}: the caches' rows (head dims {k_cache.shape[-1]} and "
            f"{v_cache.shape[-1]}, strides {tuple(k_cache.stride())}) do not start on 16-byte "
            f"boundaries, so each call copies them zero-padded to a multiple of {ROW_PIECE}"
            f"{' and back' if k is not None else ''}; allocate each cache as the [..., :headdim] "
            f"view of a buffer whose head dim is a multiple of {ROW_PIECE} to run in place",
            stacklevel=3)
    result = fwd_kvcache(_head_dims.padded_rows(q), k_run, v_run, _head_dims.padded_rows(k),
                         _head_dims.padded_rows(v), **options)
    if k is not None:
        if k_run is not k_cache:
            k_cache.copy_(k_run)
        if v_run is not v_cache:
            v_cache.copy_(v_run)
    return result


def _described(q, k_cache, v_cache, k, v, cache_seqlens, options: dict, cc: int):
    defaults = dict(block_table=None, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
                    rotary_sin=None,
                    rotary_interleaved=False, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, softmax_scale=None, num_splits=0, return_lse=False,
                    k_scale=None, v_scale=None)
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"fmha.{_API}: unexpected options {sorted(unknown)}")
    o = {**defaults, **options}
    on_copies = _head_dims.kvcache_needs_copies(q, k_cache, v_cache, k, v)

    def build(q, k_cache, v_cache, k, v, check_device: bool):
        return _build_args(q, k_cache, v_cache, k, v, cache_seqlens, o["cache_batch_idx"],
                           o["cache_leftpad"], o["block_table"], o["rotary_cos"],
                           o["rotary_sin"], o["rotary_interleaved"], o["causal"],
                           o["window_size"], o["softcap"], o["alibi_slopes"],
                           o["softmax_scale"], o["num_splits"], o["return_lse"],
                           check_device=check_device, on_copies=on_copies,
                           k_scale=o["k_scale"], v_scale=o["v_scale"])[0]

    args = build(q, k_cache, v_cache, k, v, check_device=not cc)
    if on_copies:  # described on meta tensors of the copies' shapes and strides, as they run
        args = build(*(_head_dims.padded_rows(t, meta=True) for t in (q, k_cache, v_cache, k, v)),
                     check_device=False)
    _mark_given(args, k_new=k, v_new=v, block_table=o["block_table"],
                cache_batch_idx=o["cache_batch_idx"], cache_leftpad=o["cache_leftpad"],
                rotary_cos=o["rotary_cos"], rotary_sin=o["rotary_sin"],
                alibi_slopes=o["alibi_slopes"], k_scale=o["k_scale"], v_scale=o["v_scale"])
    return args


def select_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, capability=None,
                   **options) -> dict:
    """The instance fwd_kvcache would run for this call, without running it. capability: a
    GPU's (major, minor) to ask for instead of q's, as fmha.select takes it (no GPU needed)."""
    cc = _target_cc(capability, "select_kvcache")
    args = _described(q, k_cache, v_cache, k, v, cache_seqlens, options, cc)
    code, message, chosen = _ask(_C.select_kvcache, args, q, cc)
    _raise_for(code, message)
    return chosen


def explain_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, capability=None,
                    **options) -> str:
    """Why fwd_kvcache picks what it picks for this call, in words (for a GPU of `capability`
    where given)."""
    cc = _target_cc(capability, "explain_kvcache")
    args = _described(q, k_cache, v_cache, k, v, cache_seqlens, options, cc)
    code, message, text = _ask(_C.explain_kvcache, args, q, cc)
    _raise_for(code, message)
    return text


def kvcache_instances() -> list[dict]:
    """Every KV-cache instance, compiled into the build or on demand, in the dispatcher's order
    of preference (origin as fmha.instances())."""
    return _C.kvcache_instances()
