"""fmha.fwd and friends: torch tensors in, one generated kernel instance launched.

fmha::fwd is a torch.library custom op with a fake (meta) implementation, so torch.compile
traces it with fullgraph=True; the op turns its tensors into an fmha._C.FwdArgs (pointers,
strides) and launches on the current stream. A plain eager call skips the op's dispatch: its
first call of a signature checks it and keeps the FwdArgs as a plan, and the later ones only
fill in their pointers (fmha._plans). select and explain check and describe the same call
through the same FwdArgs, without launching. The op's autograd formula, the backward's op
fmha::bwd and fmha.bwd are in fmha._bwd.
"""

from typing import NamedTuple, Optional

import torch

from fmha import _C, _head_dims, _plans
from fmha._checks import (
    DESCALES,
    DTYPE_CODES,
    E4M3,
    FWD_DTYPE_CODES,
    INT_LIMIT,
    OFFSET_LIMIT,
    SEED_LIMIT,
    Options,
    Problem,
    bias_target,
    check_alignment,
    check_bias,
    check_descales,
    check_devices,
    check_inputs,
    check_instance,
    check_mode,
    check_options,
    check_out_dtype,
    check_seqused,
    descale_strides,
    kernel_strides,
    out_dtype,
    v_layout,
)


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


# The seeds an unseeded dropout call draws: [0, 2**63 - 1), what torch.randint's int64 takes.
_DRAWN_SEED_LIMIT = 2**63 - 1


class _Operands(NamedTuple):
    """A checked call: the arguments of fmha::fwd's custom op but the last (instance), in its
    order, and the forward call's part of fmha::bwd's (fmha._bwd). The ops' schemas derive
    from these annotations (_schema)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: Optional[torch.Tensor]  # elementwise, a (batch, nheads, seqlen_q, seqlen_k) view
    alibi_slopes: Optional[torch.Tensor]
    cu_seqlens_q: Optional[torch.Tensor]  # given: group mode
    cu_seqlens_k: Optional[torch.Tensor]
    seqused_q: Optional[torch.Tensor]
    seqused_k: Optional[torch.Tensor]
    max_seqlen_q: int  # group mode only; 0 in batch mode
    max_seqlen_k: int
    softmax_scale: float
    mask: int
    mask_align: int
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float
    # A CPU int64 scalar holding the uint64 seed's bits; None without dropout, and in
    # select/explain, which draw no seed.
    dropout_seed: Optional[torch.Tensor]
    dropout_offset: int
    return_lse: bool
    # e4m3 inputs only: fp32 dequantization factors, (batch, nheads_k) or broadcast to it; None
    # is 1. Last, with defaults: fmha::bwd's record of the forward call leaves them out
    # (FORWARD_RECORD), as there is no FP8 backward.
    q_descale: Optional[torch.Tensor] = None
    k_descale: Optional[torch.Tensor] = None
    v_descale: Optional[torch.Tensor] = None
    # The output's dtype where it is not the default (fmha._checks.check_out_dtype): float16 of
    # e4m3 inputs; None otherwise.
    out_dtype: Optional[torch.dtype] = None


# The fields of a forward call that fmha::bwd's arguments repeat: _Operands' up to return_lse.
FORWARD_RECORD = _Operands._fields.index("return_lse")


def _bias_operand(bias, attn_mask, dtype: torch.dtype, p: Problem, materialize: bool):
    """The elementwise bias as a (batch, nheads, seqlen_q, seqlen_k) view: broadcast dims get
    stride 0, and only a key dimension that is not contiguous is copied. A boolean attn_mask
    becomes an additive 0/-inf bias. Without `materialize` (select, explain: nothing runs, no
    pointer is read) neither copy nor conversion happens."""
    t = bias if bias is not None else attn_mask
    if t is None:
        return None
    if materialize and t.dtype == torch.bool:
        t = torch.zeros_like(t, dtype=dtype).masked_fill_(t.logical_not(), float("-inf"))
    batch, nhead, seqlen_q, seqlen_k = bias_target(p)
    rows = t.expand(*t.shape[:-1], seqlen_k) if t.dim() else t.expand(seqlen_k)
    if materialize and rows.stride(-1) != 1 and seqlen_k > 1:
        rows = rows.contiguous()  # the kernels read a row of keys in one piece
    return rows.expand(batch, nhead, seqlen_q, seqlen_k)  # new leading dims get stride 0


def _seed_operand(seed: Optional[int]) -> torch.Tensor:
    """The dropout seed as a CPU int64 tensor. A tensor, not an int, so that torch.compile keeps
    the draw of an unseeded call in the graph (a fresh seed per call, from torch's default
    generator, so torch.manual_seed makes it reproducible) and never merges two such calls."""
    if seed is None:
        return torch.randint(_DRAWN_SEED_LIMIT, (), dtype=torch.int64)
    return torch.tensor(seed - SEED_LIMIT if seed >= SEED_LIMIT // 2 else seed, dtype=torch.int64)


def _prepare(q, k, v, causal, softmax_scale, window_size, mask_align, bias, attn_mask,
             alibi_slopes, softcap, dropout_p, dropout_seed, dropout_offset, return_lse,
             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
             materialize: bool, api: str = "fwd", more_checks=None,
             check_device: bool = True, fp8: bool = False, q_descale=None, k_descale=None,
             v_descale=None, out_dtype=None) -> _Operands:
    """Every check of a call, then its operands: what fwd, select and explain share, and bwd,
    select_bwd and explain_bwd (`api` names the caller in messages). more_checks(p, o): the
    caller's own checks of the Problem and Options, run before the device check; it returns
    the further tensors (by name) whose device to check. Without check_device (select and
    explain for a named GPU), tensors may be on any device, meta tensors included. fp8: the
    forward's, whose inputs may be float8_e4m3fn with q_descale, k_descale and v_descale, and
    whose out_dtype may ask for a float16 output of them."""
    group = check_mode(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, api)
    p = check_inputs(q, k, v, group, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     api, fp8)
    o: Options = check_options(causal, softmax_scale, window_size, mask_align, softcap,
                               dropout_p, dropout_seed, dropout_offset, return_lse, p.hdim_q,
                               api)
    check_bias(bias, attn_mask, alibi_slopes, q.dtype, p, api)
    check_seqused(seqused_q, seqused_k, p, api)
    descales = dict(zip(DESCALES, (q_descale, k_descale, v_descale)))
    check_descales(descales, q.dtype, p, api)
    out_dtype = check_out_dtype(out_dtype, q.dtype, api)
    if q.dtype == E4M3 and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(
            f"fmha.{api}: {E4M3} inputs have no backward (there is no FP8 training here), but "
            f"q, k or v requires grad; pass them detached, or call under torch.no_grad()")
    more = {} if more_checks is None else more_checks(p, o)
    if check_device:
        check_devices(api=api, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                      bias=bias, attn_mask=attn_mask, alibi_slopes=alibi_slopes, **descales,
                      **more)
    if materialize and alibi_slopes is not None and alibi_slopes.stride(-1) != 1:
        alibi_slopes = alibi_slopes.contiguous()  # slope (b, h) is at b * batch stride + h
    seed = _seed_operand(o.dropout_seed) if materialize and o.dropout_p > 0 else None
    return _Operands(
        q, k, v, _bias_operand(bias, attn_mask, q.dtype, p, materialize), alibi_slopes,
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        max_seqlen_q if group else 0, max_seqlen_k if group else 0,
        o.softmax_scale, o.mask, o.mask_align, o.window_left, o.window_right, o.softcap,
        o.dropout_p, seed, o.dropout_offset, o.return_lse, q_descale, k_descale, v_descale,
        out_dtype,
    )


def _make_args(ops: _Operands, out: Optional[torch.Tensor],
               lse: Optional[torch.Tensor]) -> "_C.FwdArgs":
    """The one translation of a checked call into fmha::FwdArgs (pointers, sizes, strides)."""
    q, k, v = ops.q, ops.k, ops.v
    a = _C.FwdArgs()
    a.dtype = FWD_DTYPE_CODES[q.dtype]
    a.q, a.k, a.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    a.nhead_q, a.nhead_k = q.shape[-2], k.shape[-2]
    a.hdim_q, a.hdim_v = q.shape[-1], v.shape[-1]
    qs, ks, vs = kernel_strides(q), kernel_strides(k), kernel_strides(v)
    group = ops.cu_seqlens_q is not None
    if group:
        a.mode = _C.MODE_GROUP
        a.batch = ops.cu_seqlens_q.shape[0] - 1
        # No sequence is longer than all tokens together; this also makes a call without
        # tokens an empty problem.
        a.seqlen_q = min(ops.max_seqlen_q, q.shape[0])
        a.seqlen_k = min(ops.max_seqlen_k, k.shape[0])
        a.cu_seqlens_q, a.cu_seqlens_k = ops.cu_seqlens_q.data_ptr(), ops.cu_seqlens_k.data_ptr()
        a.total_q, a.total_k = q.shape[0], k.shape[0]
    else:
        a.mode = _C.MODE_BATCH
        a.batch, a.seqlen_q, a.seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        a.q_batch_stride, a.k_batch_stride, a.v_batch_stride = qs[0], ks[0], vs[0]
    # (seq, head) are the last dims but one of every mode's layout; batch is dim 0 of batch mode.
    a.q_seq_stride, a.q_head_stride = qs[-3], qs[-2]
    a.k_seq_stride, a.k_head_stride = ks[-3], ks[-2]
    a.vlayout, a.v_seq_stride, a.v_dim_stride = v_layout(v)
    a.v_head_stride = vs[-2]
    if out is not None:
        outs = kernel_strides(out)
        a.o = out.data_ptr()
        a.o_seq_stride, a.o_head_stride = outs[-3], outs[-2]
        a.o_batch_stride = 0 if group else outs[0]
    if ops.out_dtype is not None:
        a.o_dtype = DTYPE_CODES[ops.out_dtype]
    if ops.seqused_q is not None:
        a.seqused_q = ops.seqused_q.data_ptr()
    if ops.seqused_k is not None:
        a.seqused_k = ops.seqused_k.data_ptr()

    a.softmax_scale = ops.softmax_scale
    a.mask, a.mask_align = ops.mask, ops.mask_align
    a.window_left, a.window_right = ops.window_left, ops.window_right
    if ops.bias is not None:
        a.bias = _C.BIAS_ELEMENTWISE
        a.bias_ptr = ops.bias.data_ptr()
        a.bias_batch_stride, a.bias_head_stride, a.bias_seq_stride = ops.bias.stride()[:3]
    elif ops.alibi_slopes is not None:
        a.bias = _C.BIAS_ALIBI
        a.alibi_slopes = ops.alibi_slopes.data_ptr()
        a.alibi_batch_stride = ops.alibi_slopes.stride(0) if ops.alibi_slopes.dim() == 2 else 0
    a.softcap = ops.softcap
    a.dropout_p = ops.dropout_p
    if ops.dropout_seed is not None:
        a.dropout_seed = int(ops.dropout_seed.item()) % SEED_LIMIT
    a.dropout_offset = ops.dropout_offset
    if lse is not None:
        a.lse = lse.data_ptr()
        a.lse_head_stride = lse.stride(-2)
        a.lse_batch_stride = 0 if group else lse.stride(0)
    # The descale factors' strides; their pointers are the call's (a plan passes them per call,
    # as it does q's), set here where the tensors have memory.
    if ops.q_descale is not None:
        a.q_descale_batch_stride, a.q_descale_head_stride = descale_strides(ops.q_descale)
    if ops.k_descale is not None:
        a.k_descale_batch_stride, a.k_descale_head_stride = descale_strides(ops.k_descale)
    if ops.v_descale is not None:
        a.v_descale_batch_stride, a.v_descale_head_stride = descale_strides(ops.v_descale)
    return a


# The schema types of the annotations the ops' argument records use.
_SCHEMA_TYPES = {torch.Tensor: "Tensor", Optional[torch.Tensor]: "Tensor?", int: "SymInt",
                 float: "float", bool: "bool", Optional[str]: "str?",
                 Optional[torch.dtype]: "ScalarType?"}


def _schema(name: str, arguments: dict, returns: str) -> str:
    """A torch.library schema of `arguments`, {name: annotation} in the op's order."""
    typed = ", ".join(f"{_SCHEMA_TYPES[kind]} {arg}" for arg, kind in arguments.items())
    return f"{name}({typed}) -> {returns}"


# fmha::fwd's arguments: the checked call, then the instance to run (None: the dispatcher's).
FWD_ARGUMENTS = {**_Operands.__annotations__, "instance": Optional[str]}

# fmha::fwd, declared through torch.library's low-level API. @torch.library.custom_op declares
# the same op but wraps every call in Python (an autograd layer, an output-aliasing check):
# 69 us of fwd's 199 us of host time per call on the H100 machine of docs/perf-notes.md v5,
# where a 2k-token causal call's kernel takes ~250 us.
_LIBRARY = torch.library.Library("fmha", "DEF")
_LIBRARY.define(_schema("fwd", FWD_ARGUMENTS, "(Tensor, Tensor)"),
                tags=(torch.Tag.pt2_compliant_tag,))


def _fwd_impl(*arguments) -> tuple[torch.Tensor, torch.Tensor]:
    """fmha::fwd (FWD_ARGUMENTS): returns (out, lse); lse has no elements unless return_lse. A
    signature's later calls reuse its first call's FwdArgs (fmha._plans), as fwd's eager calls
    do."""
    ops, instance = _Operands(*arguments[:-1]), arguments[-1]
    key = _plans.op_key(ops, instance)
    plan = _OP_PLANS.get(key)
    if plan is None:
        check_alignment(q=ops.q, k=ops.k, v=ops.v)  # before any allocation; C++ checks it again
        plan = _plans.make(ops, bias_from_mask=False, draws_seed=False)
        out, lse = _first_call(_OP_PLANS, key, plan, ops, ops.bias, None, instance)
    else:
        seed = 0 if ops.dropout_seed is None else int(ops.dropout_seed.item()) % SEED_LIMIT
        out, lse, failed = plan.run(ops.q, ops.k, ops.v, ops.bias, None, ops.alibi_slopes,
                                    ops.cu_seqlens_q, ops.cu_seqlens_k, ops.seqused_q,
                                    ops.seqused_k, ops.max_seqlen_q, ops.max_seqlen_k, seed,
                                    ops.dropout_offset, instance, ops.q_descale, ops.k_descale,
                                    ops.v_descale)
        if failed is not None:
            _raise_for_plan(failed, ops.q, ops.k, ops.v)
    return out, lse if lse is not None else ops.q.new_empty((0,), dtype=torch.float32)


# Plans of the op's calls (a torch.compile'd graph's, or fwd's under a dispatch mode or with
# tensors that need grad), by the op's arguments (fmha._plans.op_key).
_OP_PLANS = _plans.PlanTable()


def _fwd_fake(*arguments):
    ops = _Operands(*arguments[:-1])
    q = ops.q
    out = q.new_empty((*q.shape[:-1], ops.v.shape[-1]), dtype=out_dtype(q.dtype, ops.out_dtype))
    lse_shape = _plans.lse_shape(q, ops.cu_seqlens_q is not None) if ops.return_lse else (0,)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    return out, lse


_LIBRARY.impl("fwd", _fwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake("fmha::fwd", _fwd_fake, lib=_LIBRARY)
_fwd_op = torch.ops.fmha.fwd.default


def fwd(q, k, v, causal=False, softmax_scale=None, *, window_size=(-1, -1),
        mask_align="top_left", bias=None, attn_mask=None, alibi_slopes=None, softcap=0.0,
        dropout_p=0.0, dropout_seed=None, dropout_offset=0, return_lse=False, cu_seqlens_q=None,
        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None,
        q_descale=None, k_descale=None, v_descale=None, out_dtype=None, instance=None):
    """Attention forward: softmax(q k^T * softmax_scale + bias, masked) v, per head.

    Batch mode: q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim),
    v (batch, seqlen_k, nheads_k, headdim_v); returns out (batch, seqlen_q, nheads, headdim_v).
    Group mode (varlen, when cu_seqlens_q/cu_seqlens_k are given): sequences packed along the
    first dim, q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim[_v]); cu_seqlens_*
    are int32 CUDA tensors of batch + 1 non-decreasing offsets from 0 (not checked: they live on
    the GPU), max_seqlen_q/max_seqlen_k the longest sequence's lengths; out (total_q, nheads,
    headdim_v). float16 or bfloat16 CUDA tensors; q and k with the head dim contiguous (other
    strides any multiple of 8 elements, e.g. a (b, h, s, d) tensor's transpose(1, 2)); v
    likewise, or with its sequence dim contiguous (v = vt.transpose(-1, -2) of a V^T); each
    starting on a 16-byte boundary. nheads a multiple of nheads_k. Head dims up to 256; one that
    is not a multiple of 8 runs on copies of q, k and v zero-padded to the next multiple
    (FlashAttention-2's way; softmax_scale still defaults to the call's own 1/sqrt(headdim)),
    and out is then a view of the padded output's first headdim_v columns.

    Mask: causal=True sees keys j <= i (+ seqlen_k - seqlen_q with mask_align="bottom_right",
    FlashAttention's causal; "top_left" is torch SDPA's is_causal). window_size=(left, right):
    keys i - left <= j <= i + right (same alignment), -1 unbounded; with causal=True right must
    be 0 or -1 (the window (left, 0), FlashAttention's convention). A row that sees no key
    returns 0 (and log-sum-exp -inf).
    bias: an additive bias of q's dtype broadcastable to (batch, nheads, seqlen_q, seqlen_k)
    (group mode: (batch, nheads, max_seqlen_q, max_seqlen_k), indexed per sequence).
    attn_mask: torch SDPA's: bool (True takes part) or an additive bias of q's dtype.
    alibi_slopes: float32 (nheads,) or (batch, nheads); the logit of (i, j) gets
    -slope * |i + offset - j|. softcap > 0: logits become softcap * tanh(logits / softcap).
    dropout_p: drop probabilities with this chance (kept ones scaled by 1 / (1 - dropout_p));
    the pattern is fmha.dropout_mask(dropout_seed, dropout_offset, ...). dropout_seed None draws
    int(torch.randint(2**63 - 1, ())) from torch's default generator, so torch.manual_seed makes
    a call reproducible.
    seqused_q/seqused_k: int32 CUDA (batch,): sequence b uses only its first seqused_q[b] rows
    and seqused_k[b] keys; the other rows of out are 0 and of lse -inf.
    softmax_scale defaults to 1/sqrt(headdim). instance: run this compiled instance (a name from
    fmha.instances()) instead of the dispatcher's choice.

    FP8: q, k and v all torch.float8_e4m3fn (FlashAttention-3's FP8 forward; H100/H200, fa3),
    out bfloat16, or float16 with out_dtype=torch.float16 (of the same shape as otherwise; one
    kernel writes either, rounding its fp32 result to the dtype asked). q_descale, k_descale,
    v_descale: float32 CUDA tensors of shape (batch, nheads_k), FlashAttention-3's, or one that
    broadcasts to it ((), (1,), (nheads_k,), (1, 1), (batch, 1), (1, nheads_k)); None is 1. The
    logits are q k^T * q_descale * k_descale * softmax_scale (query head h takes K/V head
    h // (nheads / nheads_k)'s factors), out is softmax(...) v * v_descale; in group mode row b
    of a descale is sequence b's. v is read as it is given, never copied: with its head dim
    contiguous (what models hold; the kernel transposes it in shared memory), in batch and group
    mode, or with its sequence dim contiguous (a V^T view), in batch mode only (a ValueError in
    group mode: TMA cannot copy V^T tiles of packed sequences that start at a key not a multiple
    of 16). Strides are multiples of 16 elements and head dims multiples of 16 (never padded);
    the e4m3 instances have 64, 128 and 256, no bias, ALiBi, dropout or soft-capping, with every
    mask and MQA/GQA. No backward: e4m3 inputs that require grad are refused.
    The descales with inputs of another dtype are an error, and so is an out_dtype other than
    q's dtype for them (None means q's).

    Returns out, or (out, lse) with return_lse=True: the natural-log log-sum-exp of every row's
    logits, float32 (batch, nheads, seqlen_q), or (nheads, total_q) in group mode.

    Differentiable: with grad enabled and q, k, v or an elementwise bias (bias, or an additive
    attn_mask) requiring grad, autograd records the call and its backward runs the backward
    kernels (fmha.bwd's; a boolean attn_mask and ALiBi slopes get no gradient, lse is not
    differentiable). Such a call computes the log-sum-exp for autograd whatever return_lse
    says, and an unseeded dropout call keeps the seed it drew for the backward.
    """
    if instance is not None:
        check_instance(instance)
    descales = (q_descale, k_descale, v_descale)
    key = _plans.call_key(q, k, v, causal, softmax_scale, window_size, mask_align, bias,
                          attn_mask, alibi_slopes, softcap, dropout_p, dropout_seed,
                          dropout_offset, return_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, seqused_q, seqused_k, instance, descales, out_dtype)
    plan = None if key is None else _PLANS.get(key)
    if plan is not None:  # a signature seen before: its checks passed then
        if plan.draws_seed:
            _refuse_drawn_seed_in_capture()
            dropout_seed = int(_seed_operand(None).item()) % SEED_LIMIT
        if plan.backward is not None:  # autograd records the call
            out, lse = _planned_attention(q, k, v, plan, (
                None, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                max_seqlen_q, max_seqlen_k, dropout_seed or 0, dropout_offset, instance))
            return (out, lse) if return_lse else out
        out, lse, failed = plan.run(q, k, v, bias, attn_mask, alibi_slopes, cu_seqlens_q,
                                    cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                    max_seqlen_k, dropout_seed or 0, dropout_offset, instance,
                                    *descales)
        if failed is not None:
            _raise_for_plan(failed, q, k, v)
        return (out, lse) if return_lse else out

    if _head_dims.needs_padding(q, v):  # no plan: the padded call keeps its own
        # Every check first: a bad call fails before q, k or v is copied (an e4m3 one, whose
        # head dims are never padded, fails here).
        _prepare(q, k, v, causal, softmax_scale, window_size, mask_align, bias, attn_mask,
                 alibi_slopes, softcap, dropout_p, dropout_seed, dropout_offset, return_lse,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                 materialize=False, fp8=True, q_descale=q_descale, k_descale=k_descale,
                 v_descale=v_descale, out_dtype=out_dtype)
        result = fwd(_head_dims.pad(q), _head_dims.pad(k), _head_dims.pad(v), causal,
                     _head_dims.default_scale(q, softmax_scale), window_size=window_size,
                     mask_align=mask_align, bias=bias, attn_mask=attn_mask,
                     alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                     dropout_seed=dropout_seed, dropout_offset=dropout_offset,
                     return_lse=return_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
                     seqused_k=seqused_k, out_dtype=out_dtype, instance=instance)
        head_dim_v = v.shape[-1]
        return (result[0][..., :head_dim_v], result[1]) if return_lse else \
            result[..., :head_dim_v]

    ops = _prepare(q, k, v, causal, softmax_scale, window_size, mask_align, bias, attn_mask,
                   alibi_slopes, softcap, dropout_p, dropout_seed, dropout_offset, return_lse,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                   materialize=True, fp8=True, q_descale=q_descale, k_descale=k_descale,
                   v_descale=v_descale, out_dtype=out_dtype)
    if dropout_p and dropout_seed is None and not torch.compiler.is_compiling():
        _refuse_drawn_seed_in_capture()
    if key is None or not _plans.reusable(ops, bias, attn_mask, alibi_slopes):
        if not ops.return_lse and _needs_grad(ops):
            # The backward reads the log-sum-exp: the op computes it for autograd to keep.
            return _fwd_op(*ops._replace(return_lse=True), instance)[0]
        out, lse = _fwd_op(*ops, instance)
        return (out, lse) if return_lse else out
    trains = _needs_grad(ops)  # then the key ruled out a bias (fmha._plans.call_key)
    if trains:
        ops = ops._replace(return_lse=True)  # the backward reads the log-sum-exp
    plan = _plans.make(ops, bias_from_mask=bias is None and attn_mask is not None,
                       draws_seed=ops.dropout_p > 0 and dropout_seed is None, trains=trains)
    if trains:
        out, lse = _planned_attention(q, k, v, plan, (
            (_PLANS, key, ops), ops.alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q,
            seqused_k, max_seqlen_q, max_seqlen_k, 0, dropout_offset, instance))
    else:
        out, lse = _first_call(_PLANS, key, plan, ops, bias, attn_mask, instance)
    return (out, lse) if return_lse else out


# Plans of the eager calls fwd has checked, by call signature (fmha._plans).
_PLANS = _plans.PlanTable()

# fmha._bwd._PlannedAttention.apply, the autograd Function of a planned call that trains; set
# by fmha._bwd, which imports this module.
_planned_attention = None


def _needs_grad(ops: _Operands) -> bool:
    """Whether autograd records this call of the op, whose formula (fmha._bwd) differentiates
    q, k, v and an elementwise bias (a boolean attn_mask's bias, made here, needs none)."""
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (ops.q, ops.k, ops.v, ops.bias))


def _first_call(table, key, plan, ops: _Operands, bias, attn_mask, instance) -> tuple:
    """The first call of a signature: the plan's FwdArgs take this call's outputs, it launches,
    and `table` keeps it once it ran (a miss or a CUDA error leaves no plan behind). `bias`
    and `attn_mask`: the tensors the caller gave, whose pointers the plan passes."""
    out, lse = plan.outputs(ops.q)
    plan.args = _make_args(ops, out, lse)
    def launch():
        return plan.launch(ops.q, ops.k, ops.v, out, lse, bias, attn_mask, ops.alibi_slopes,
                           ops.cu_seqlens_q, ops.cu_seqlens_k, ops.seqused_q, ops.seqused_k,
                           ops.max_seqlen_q, ops.max_seqlen_k, plan.args.dropout_seed,
                           ops.dropout_offset, instance, ops.q_descale, ops.k_descale,
                           ops.v_descale)
    failed = launch()  # a miss compiles on demand (fmha.jit), in C++
    if failed is not None:
        _raise_for_plan(failed, ops.q, ops.k, ops.v)
    table.put(key, plan)
    return out, lse


def _raise_for_plan(failed: tuple, q, k, v) -> None:
    """A planned call that launched nothing: what C++ checks per call is the pointers'
    alignment, said here as the op's checks say it; else the status as an exception."""
    check_alignment(q=q, k=k, v=v)
    _raise_for(*failed)


def _refuse_drawn_seed_in_capture() -> None:
    """The seed of an unseeded dropout call would be drawn on the CPU once, at capture, and
    every replay would repeat that one pattern: a silent change of meaning, so refuse it.
    (Traced by torch.compile, the draw is an op of the graph instead.)"""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            "fmha.fwd: dropout without dropout_seed cannot be captured in a CUDA graph (the "
            "seed is drawn once, at capture, so every replay would drop the same elements); "
            "pass dropout_seed (and dropout_offset) explicitly, one graph per value")


# The keyword options of fwd that select and explain share.
_OPTION_DEFAULTS = dict(
    window_size=(-1, -1), mask_align="top_left", bias=None, attn_mask=None, alibi_slopes=None,
    softcap=0.0, dropout_p=0.0, dropout_seed=None, dropout_offset=0, return_lse=False,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
    seqused_k=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
)

# The one stand-in pointer of select(), explain() and their bwd and kvcache counterparts
# (the log-sum-exp or the bias gradient wanted, seqused, a bias, a paged cache's table, ...):
# they read no pointer, but the C++ arguments say that an optional operand is given by its
# pointer being set, so any non-null, aligned value says so, also for tensors without memory
# (meta tensors). Never dereferenced.
_PLACEHOLDER_POINTER = 16


def _mark_given(args, **operands) -> None:
    """Sets the pointer field of each operand given (not None) to _PLACEHOLDER_POINTER."""
    for name, operand in operands.items():
        if operand is not None:
            setattr(args, name, _PLACEHOLDER_POINTER)


def _target_cc(capability, api: str) -> int:
    """The compute capability (major * 10 + minor) that select/explain answer for: 0, the
    current device's, for None."""
    if capability is None:
        return 0
    if (not isinstance(capability, tuple) or len(capability) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in capability)):
        raise TypeError(
            f"fmha.{api}: capability must be a (major, minor) pair of ints, as "
            f"torch.cuda.get_device_capability() returns, e.g. (9, 0) for an H100; got "
            f"{capability!r}")
    major, minor = capability
    if not (1 <= major and 0 <= minor <= 9):
        raise ValueError(f"fmha.{api}: capability must be a GPU's (major, minor), e.g. (8, 0) "
                         f"or (9, 0); got {capability!r}")
    return major * 10 + minor


def _ask(query, args, q: torch.Tensor, cc: int):
    """query(args, cc) of fmha._C (select*, explain*): for a GPU of compute capability cc,
    or with cc 0 for q's GPU."""
    if cc:
        return query(args, cc)
    with torch.cuda.device(q.device):
        return query(args, 0)


def _described(api: str, q, k, v, causal, softmax_scale, options: dict,
               cc: int) -> "_C.FwdArgs":
    unknown = sorted(set(options) - set(_OPTION_DEFAULTS))
    if unknown:
        raise TypeError(f"fmha.{api}: unexpected keyword argument {unknown[0]!r}; it takes "
                        f"fmha.fwd's, without instance, and capability")
    ops = _prepare(q, k, v, causal, softmax_scale, **{**_OPTION_DEFAULTS, **options},
                   materialize=False, check_device=not cc, fp8=True)
    args = _make_args(_padded_as_described(ops), out=None, lse=None)
    if ops.return_lse:
        args.lse = _PLACEHOLDER_POINTER
    _mark_given(args, bias_ptr=ops.bias, alibi_slopes=ops.alibi_slopes,
                cu_seqlens_q=ops.cu_seqlens_q, cu_seqlens_k=ops.cu_seqlens_k,
                seqused_q=ops.seqused_q, seqused_k=ops.seqused_k, q_descale=ops.q_descale,
                k_descale=ops.k_descale, v_descale=ops.v_descale)
    return args


def _padded_as_described(ops: _Operands) -> _Operands:
    """A checked call as fwd and bwd run it: on copies with head dims padded to multiples of 8
    where it runs padded, as meta tensors of the copies' shapes and strides (nothing copied;
    select and explain read no pointer)."""
    if not _head_dims.needs_padding(ops.q, ops.v):
        return ops
    pad = _head_dims.pad
    return ops._replace(q=pad(ops.q, meta=True), k=pad(ops.k, meta=True),
                        v=pad(ops.v, meta=True))


def select(q, k, v, causal=False, softmax_scale=None, *, capability=None, **options) -> dict:
    """The compiled instance fwd would run for these arguments (fwd's, without instance) on q's
    GPU, without running it: a dict as fmha.instances() lists them.

    capability: a GPU's (major, minor), as torch.cuda.get_device_capability() gives it, to ask
    for that GPU instead of q's: then q, k, v and the other tensors may be on any device (meta
    tensors need no memory), and no GPU is needed.

    Raises MissingInstanceError, naming the filter that would build a fitting instance.
    """
    cc = _target_cc(capability, "select")
    args = _described("select", q, k, v, causal, softmax_scale, options, cc)
    code, message, info = _ask(_C.select, args, q, cc)
    _raise_for(code, message)
    return info


def explain(q, k, v, causal=False, softmax_scale=None, *, capability=None, **options) -> str:
    """Why fwd would run the instance it runs for these arguments (fwd's, without instance) on
    q's GPU, or on a GPU of `capability` as select() takes it: the instance, the rule that ranks
    it before every other instance that could run the call, and the instances that come close;
    or, when none fits, the nearest ones and the generator filter that would build one. Raises
    only for invalid arguments."""
    cc = _target_cc(capability, "explain")
    args = _described("explain", q, k, v, causal, softmax_scale, options, cc)
    code, message, text = _ask(_C.explain, args, q, cc)
    _raise_for(code, message)
    return text


def dropout_mask(seed, offset, dropout_p, batch, nhead, seqlen_q, seqlen_k,
                 device=None) -> torch.Tensor:
    """The dropout pattern fwd applies with dropout_seed=seed, dropout_offset=offset and this
    dropout_p: a uint8 CUDA tensor (batch, nhead, seqlen_q, seqlen_k), 1 where the probability
    of query row i and key j of head h of sequence b is kept. device: a CUDA device of this
    machine (a torch.device, a str such as "cuda:1", or an index), default the current one."""
    # fmha::dropout_mask takes the sizes as int.
    ints = dict(seed=(seed, SEED_LIMIT, "2**64"), offset=(offset, OFFSET_LIMIT, "2**32"),
                batch=(batch, INT_LIMIT, "2**31"), nhead=(nhead, INT_LIMIT, "2**31"),
                seqlen_q=(seqlen_q, INT_LIMIT, "2**31"), seqlen_k=(seqlen_k, INT_LIMIT, "2**31"))
    for name, (value, limit, limit_text) in ints.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"fmha.dropout_mask: {name} must be an int, got {type(value).__name__}")
        if not 0 <= value < limit:
            raise ValueError(f"fmha.dropout_mask: {name} must be in [0, {limit_text}), got {value}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(
            f"fmha.dropout_mask: dropout_p must be a float, got {type(dropout_p).__name__}"
        )
    if not 0 <= dropout_p < 1:
        raise ValueError(f"fmha.dropout_mask: dropout_p must be in [0, 1), got {dropout_p}")
    device = _dropout_mask_device(device)
    keep = torch.empty((batch, nhead, seqlen_q, seqlen_k), dtype=torch.uint8, device=device)
    with torch.cuda.device(keep.device):
        code, message = _C.dropout_mask(seed, offset, float(dropout_p), batch, nhead, seqlen_q,
                                        seqlen_k, keep.data_ptr(),
                                        torch.cuda.current_stream(keep.device).cuda_stream)
    _raise_for(code, message)
    return keep


def _dropout_mask_device(device) -> torch.device:
    """dropout_mask's `device` as a CUDA device of this machine, with its index: a torch.device,
    a str torch parses ("cuda", "cuda:1"), an int (an index, as torch.cuda's functions take it),
    or None for the current one."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int, type(None))):
        raise TypeError(f"fmha.dropout_mask: device must be a torch.device, a str, an int or "
                        f"None, got {type(device).__name__}")
    if isinstance(device, int):  # checked here: torch.device keeps an index's low byte only
        index = device
    else:
        try:
            parsed = torch.device("cuda" if device is None else device)
        except RuntimeError:  # a str that names no device
            raise ValueError(f"fmha.dropout_mask: device must be a CUDA device, got "
                             f"{device!r}") from None
        if parsed.type != "cuda":
            raise ValueError(f"fmha.dropout_mask: device must be a CUDA device, got {parsed}")
        index = parsed.index
    count = torch.cuda.device_count()  # 0 on a torch without CUDA, which has no current device
    if index is None and count:
        index = torch.cuda.current_device()
    if index is None or not 0 <= index < count:
        given = "None (the current device)" if device is None else repr(device)
        raise ValueError(f"fmha.dropout_mask: device must be a CUDA device of this machine, "
                         f"which has {count} (torch.cuda.device_count()), got {given}")
    return torch.device("cuda", index)


def instances() -> list[dict]:
    """Every instance, compiled into the build or on demand (fmha.jit), in the dispatcher's
    order of preference: a dict of its traits (name, dtype, hdim_q, hdim_v, mask, bias,
    vlayout, mode, lse, dropout, softcap), pipeline, arch, tile (block_m, block_n), padding
    (pad_seqlen, pad_hdim) and origin (None: built in; else the cached shared object it was
    loaded from)."""
    return _C.instances()


def compiled_targets() -> list[str]:
    """The GPU targets this build holds machine code for, e.g. ['sm80', 'sm90a']."""
    return _C.compiled_targets()
