"""The backward pass: fmha.bwd, the op fmha::bwd, and fmha::fwd's autograd formula.

fmha::bwd is a torch.library op, declared as fmha::fwd is (fmha._api) and with a fake
implementation, so torch.compile traces it. fmha::fwd's autograd formula saves q, k, v, the
forward's out and log-sum-exp, the bias operands, the dropout seed tensor and the options, and
its backward calls fmha::bwd: `fmha.fwd(q, k, v, causal=True).sum().backward()` runs the
forward's kernel once and the backward's once, eager or compiled (fullgraph=True traces both).
fmha.fwd asks the op for the log-sum-exp whenever autograd will need it, and returns only what
the caller asked for.

fmha.bwd is the same backward for frameworks that keep their own autograd: the forward's
arguments, its out and lse, and dout in; dq, dk, dv (and dbias) out. It checks its arguments as
fmha.fwd does (fmha._checks, through fmha._api._prepare) and then some, and calls the op.

The op's implementation keeps plans (fmha._plans.BwdPlan) by its operands' layouts, as fmha::fwd's
does: a signature's first call checks and builds the BwdArgs, later calls allocate the gradients
and the workspace and fill in pointers (see BwdPlan for what a call costs on the host).
"""

from typing import Optional

import torch

from fmha import _C, _api, _head_dims, _plans
from fmha._api import (
    FORWARD_RECORD,
    _LIBRARY,
    _OPTION_DEFAULTS,
    _PLACEHOLDER_POINTER,
    _ask,
    _first_call,
    _make_args,
    _mark_given,
    _Operands,
    _padded_as_described,
    _prepare,
    _raise_for,
    _raise_for_plan,
    _schema,
    _seed_operand,
    _target_cc,
)
from fmha._checks import (
    DESCALES,
    E4M3,
    SEED_LIMIT,
    check_alignment,
    check_bwd_operands,
    check_bwd_options,
    check_instance,
    kernel_strides,
    rows_readable,
    v_layout,
    ROW_PIECE,
)

def _contiguous_strides(shape) -> tuple:
    """kernel_strides of a contiguous tensor of `shape`: what the plans allocate, and what
    select_bwd/explain_bwd describe for tensors they are not given."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(0 if size <= 1 else step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _bsh(strides: tuple, group: bool) -> tuple:
    """(batch, seq, head) strides of a (batch, seq, head, dim) or, in group mode, a (tokens,
    head, dim) layout; group mode has no batch stride."""
    return (0 if group else strides[0], strides[-3], strides[-2])


def _make_bwd_args(ops: _Operands, dout, out, lse, dq, dk, dv, dbias, deterministic: bool,
                   dbias_wanted: bool) -> "_C.BwdArgs":
    """The one translation of a checked backward call into fmha::BwdArgs: `ops` is the forward
    call (with its log-sum-exp), the tensors are this call's. select_bwd/explain_bwd pass None
    for every tensor: out, dout and the gradients then have the layouts fmha.fwd and the plans
    give them (contiguous), and lse and (dbias_wanted) dbias are marked as set."""
    q, k, v = ops.q, ops.k, ops.v
    group = ops.cu_seqlens_q is not None
    out_shape = (*q.shape[:-1], v.shape[-1])
    b = _C.BwdArgs()
    b.fwd = _make_args(ops, out, lse)
    if out is None:
        f = b.fwd  # a reference into b: its fields are b's
        f.o_batch_stride, f.o_seq_stride, f.o_head_stride = _bsh(
            _contiguous_strides(out_shape), group)
        lse_strides = _contiguous_strides(_plans.lse_shape(q, group))
        f.lse = _PLACEHOLDER_POINTER
        f.lse_head_stride = lse_strides[-2]
        f.lse_batch_stride = 0 if group else lse_strides[0]
    dout_strides = _contiguous_strides(out_shape) if dout is None else kernel_strides(dout)
    b.dout_batch_stride, b.dout_seq_stride, b.dout_head_stride = _bsh(dout_strides, group)
    # The gradients' layouts: the plans' (fmha._plans.grad_like), here without memory.
    dq_like, dk_like, dv_like = (
        (dq, dk, dv) if dq is not None else
        (_plans.grad_like(t.to("meta"), group) for t in (q, k, v)))
    b.dq_batch_stride, b.dq_seq_stride, b.dq_head_stride = _bsh(kernel_strides(dq_like), group)
    b.dk_batch_stride, b.dk_seq_stride, b.dk_head_stride = _bsh(kernel_strides(dk_like), group)
    b.dv_batch_stride, b.dv_seq_stride, b.dv_head_stride = _bsh(kernel_strides(dv_like), group)
    if dout is not None:
        b.dout = dout.data_ptr()
    if dq is not None:
        b.dq, b.dk, b.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    if dbias is not None or dbias_wanted:
        # The full (batch, nheads, seqlen_q, seqlen_k) gradient, contiguous.
        b.dbias = _PLACEHOLDER_POINTER if dbias is None else dbias.data_ptr()
        b.dbias_batch_stride, b.dbias_head_stride, b.dbias_seq_stride = _contiguous_strides(
            ops.bias.shape)[:3]
    b.deterministic = deterministic
    return b


# ---- the op fmha::bwd ---------------------------------------------------------------------------

# fmha::bwd's arguments: dout and the forward's out and log-sum-exp, the forward's checked call
# up to return_lse (FORWARD_RECORD: the backward always reads the log-sum-exp, and there is no
# FP8 backward, whose descale factors come after), then the backward's flags.
BWD_ARGUMENTS = {
    "dout": torch.Tensor, "out": torch.Tensor, "lse": torch.Tensor,
    **{name: _Operands.__annotations__[name] for name in _Operands._fields[:FORWARD_RECORD]},
    "deterministic": bool, "return_dbias": bool, "instance": Optional[str],
}
_FORWARD_PART = slice(3, -3)  # of BWD_ARGUMENTS: _Operands' fields up to return_lse

_LIBRARY.define(_schema("bwd", BWD_ARGUMENTS, "(Tensor, Tensor, Tensor, Tensor)"),
                tags=(torch.Tag.pt2_compliant_tag,))


def _forward_call(arguments: tuple) -> _Operands:
    """The forward call's record in fmha::bwd's arguments (no descale factors)."""
    return _Operands(*arguments[_FORWARD_PART], True)


def _bwd_impl(*arguments) -> tuple:
    """fmha::bwd (BWD_ARGUMENTS): returns (dq, dk, dv, dbias), in q's, k's and v's layouts
    (fmha._plans.grad_like); dbias of bias's (batch, nheads, seqlen_q, seqlen_k) shape with
    return_dbias, else without elements. A signature's later calls reuse its first call's
    BwdArgs (fmha._plans.BwdPlan)."""
    dout, out, lse = arguments[:3]
    deterministic, return_dbias, instance = arguments[-3:]
    ops = _forward_call(arguments)
    key = _plans.bwd_op_key(dout, out, lse, ops, deterministic, return_dbias, instance)
    plan = _BWD_OP_PLANS.get(key)
    if plan is None:
        if return_dbias and ops.bias is None:
            raise ValueError("fmha::bwd: return_dbias=True needs an elementwise bias")
        dq, dk, dv, dbias = _bwd_first_call(_BWD_OP_PLANS, key, ops, dout, out, lse,
                                            deterministic, return_dbias, ops.bias, instance)
    else:
        seed = 0 if ops.dropout_seed is None else int(ops.dropout_seed.item()) % SEED_LIMIT
        dq, dk, dv, dbias, failed = plan.run(
            dout, ops.q, ops.k, ops.v, out, lse, ops.bias, ops.alibi_slopes, ops.cu_seqlens_q,
            ops.cu_seqlens_k, ops.seqused_q, ops.seqused_k, ops.max_seqlen_q, ops.max_seqlen_k,
            seed, ops.dropout_offset, instance)
        if failed is not None:
            _raise_for_bwd_plan(failed, dout, ops.q, ops.k, ops.v, out)
    return dq, dk, dv, dbias if dbias is not None else ops.q.new_empty((0,))


# Plans of the op's calls, by the op's arguments (fmha._plans.bwd_op_key).
_BWD_OP_PLANS = _plans.PlanTable()


def _bwd_first_call(table, key, ops: _Operands, dout, out, lse, deterministic: bool,
                    return_dbias: bool, bias, instance) -> tuple:
    """A signature's first call, the op's or fmha.bwd's: the plan's BwdArgs take this call's
    gradients, it launches, and `table` keeps it once it ran (a miss or a CUDA error leaves no
    plan behind). `bias`: the tensor whose pointer the plan passes (the caller's)."""
    q, k, v = ops.q, ops.k, ops.v
    check_alignment(api="bwd", q=q, k=k, v=v, out=out, dout=dout)  # C++ checks it again
    plan = _plans.make_bwd(ops, return_dbias)
    dq, dk, dv, dbias = plan.outputs(q, k, v)
    plan.args = _make_bwd_args(ops, dout, out, lse, dq, dk, dv, dbias, deterministic,
                               return_dbias)
    def launch():
        return plan.launch(dout, q, k, v, out, lse, bias, ops.alibi_slopes, ops.cu_seqlens_q,
                           ops.cu_seqlens_k, ops.seqused_q, ops.seqused_k, ops.max_seqlen_q,
                           ops.max_seqlen_k, plan.args.fwd.dropout_seed, ops.dropout_offset, dq,
                           dk, dv, dbias, instance)
    failed = launch()  # a miss compiles on demand (fmha.jit), in C++
    if failed is not None:
        _raise_for_bwd_plan(failed, dout, q, k, v, out)
    table.put(key, plan)
    return dq, dk, dv, dbias


def _raise_for_bwd_plan(failed: tuple, dout, q, k, v, out) -> None:
    """A call that launched nothing: what C++ checks per call is the pointers' alignment, said
    here in the checks' words; else the status as an exception."""
    check_alignment(api="bwd", q=q, k=k, v=v, out=out, dout=dout)
    _raise_for(*failed)


def _bwd_fake(*arguments):
    ops, return_dbias = _forward_call(arguments), arguments[-2]
    q, group = ops.q, ops.cu_seqlens_q is not None
    dbias = q.new_empty(ops.bias.shape if return_dbias and ops.bias is not None else (0,))
    return (_plans.grad_like(q, group), _plans.grad_like(ops.k, group),
            _plans.grad_like(ops.v, group), dbias)


def _bwd_backward(ctx, *grads):
    raise RuntimeError(
        "fmha::bwd has no derivative: a second backward through fmha.fwd (double backward, "
        "create_graph=True and differentiating the gradients) is not supported")


_LIBRARY.impl("bwd", _bwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake("fmha::bwd", _bwd_fake, lib=_LIBRARY)
# Without an autograd formula torch would only warn, and a double backward would be silently
# wrong; this one raises when a gradient of the gradients is asked for.
torch.library.register_autograd("fmha::bwd", _bwd_backward, lib=_LIBRARY)
_bwd_op = torch.ops.fmha.bwd.default


# ---- fmha::fwd's autograd formula -------------------------------------------------------------


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where the kernels cannot read it: its head dim contiguous, its
    other strides multiples of 8 elements, and its storage offset too (so that a tensor of
    torch's allocator starts on a 16-byte boundary). Autograd hands gradients over in any
    layout: out.sum()'s is one value expanded, every stride 0. No data_ptr: under torch.compile
    this is traced on fake tensors."""
    readable = rows_readable(t) and t.storage_offset() % ROW_PIECE == 0
    return t if readable else t.clone(memory_format=torch.contiguous_format)


# The tensors of a forward call's record, which its autograd context saves as tensors (the
# dropout seed among them: the one an unseeded call drew).
_TENSOR_OPERANDS = tuple(name for name, kind in _Operands.__annotations__.items()
                         if kind in (torch.Tensor, Optional[torch.Tensor]))


def _fwd_setup_context(ctx, inputs, output):
    ops = _Operands(*inputs[:-1])
    out, lse = output
    ctx.mark_non_differentiable(lse)  # the backward takes no gradient of the log-sum-exp
    ctx.save_for_backward(out, lse, *(getattr(ops, name) for name in _TENSOR_OPERANDS))
    ctx.ops = ops._replace(**dict.fromkeys(_TENSOR_OPERANDS))


def _fwd_backward(ctx, dout, _dlse):
    out, lse, *tensors = ctx.saved_tensors
    ops = ctx.ops._replace(**dict(zip(_TENSOR_OPERANDS, tensors)))
    if ops.q.dtype == E4M3 or any(getattr(ops, name) is not None for name in DESCALES):
        raise RuntimeError(
            f"fmha::fwd has no backward for {E4M3} inputs (there is no FP8 backward); run the "
            f"e4m3 forward on tensors that do not require grad")
    if not ops.return_lse:
        raise RuntimeError(
            "fmha::fwd ran with return_lse=False, so its backward has no log-sum-exp to read; "
            "call fmha.fwd, which asks for it whenever autograd records the call, or pass "
            "return_lse=True to the op")
    needs = ctx.needs_input_grad
    return_dbias = ops.bias is not None and needs[3]
    if v_layout(ops.v)[0] != _C.VLAYOUT_ROW_MAJOR:
        # The backward takes row-major V only; dv has v's shape either way.
        ops = ops._replace(v=ops.v.contiguous())
    dq, dk, dv, dbias = _bwd_op(
        _kernel_layout(dout), out, lse, *ops[:FORWARD_RECORD],
        torch.are_deterministic_algorithms_enabled(), return_dbias, None)
    # One gradient per argument of fmha::fwd: q, k, v and bias have one, the others none.
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            dbias if return_dbias else None) + (None,) * (len(_api.FWD_ARGUMENTS) - 4)


torch.library.register_autograd("fmha::fwd", _fwd_backward, setup_context=_fwd_setup_context,
                                lib=_LIBRARY)


# ---- eager training: fmha.fwd's planned calls under autograd ----------------------------------


class _PlannedAttention(torch.autograd.Function):
    """fmha::fwd's autograd formula for an eager call that takes a plan that trains
    (fmha._plans.Plan.backward; fmha._api.fwd): the forward runs the plan, the backward a
    BwdPlan of it, each a signature's checks once and then pointers, as the untraced
    inference path does. The op's formula above stays for torch.compile and export, for calls
    with a bias, and for every call that takes the op."""

    @staticmethod
    def forward(ctx, q, k, v, plan, call):
        # One tuple for the rest: Function.apply's cost grows with its argument count.
        (first, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
         max_seqlen_k, dropout_seed, dropout_offset, instance) = call
        if first is not None:  # the signature's first call: (its table, key and checked ops)
            table, key, ops = first
            out, lse = _first_call(table, key, plan, ops, None, None, instance)
            dropout_seed = plan.args.dropout_seed  # drawn by the checks of an unseeded call
        else:
            out, lse, failed = plan.run(q, k, v, None, None, alibi_slopes, cu_seqlens_q,
                                        cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                        max_seqlen_k, dropout_seed, dropout_offset, instance)
            if failed is not None:
                _raise_for_plan(failed, q, k, v)
        ctx.mark_non_differentiable(lse)
        # No zeros for lse's gradient, which the backward never reads: a fill kernel a step.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                              seqused_q, seqused_k)
        ctx.plan = plan
        ctx.call = (max_seqlen_q, max_seqlen_k, dropout_seed, dropout_offset)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        if dout is None:  # no gradient reached out (lse takes none)
            return None, None, None, None, None
        (q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q,
         seqused_k) = ctx.saved_tensors
        plan = ctx.plan
        max_seqlen_q, max_seqlen_k, dropout_seed, dropout_offset = ctx.call
        dout = _kernel_layout(dout)
        if plan.args.vlayout != _C.VLAYOUT_ROW_MAJOR:
            v = v.contiguous()  # the backward takes row-major V only; dv has v's shape either way
        deterministic = torch.are_deterministic_algorithms_enabled()
        key = (_plans.output_layout(dout, plan.varlen), deterministic)
        bwd_plan = plan.backward.get(key)
        if bwd_plan is None:
            a = plan.args
            seed = _seed_operand(dropout_seed) if a.dropout_p > 0 else None
            ops = _Operands(q, k, v, None, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q,
                            seqused_k, max_seqlen_q, max_seqlen_k, a.softmax_scale, a.mask,
                            a.mask_align, a.window_left, a.window_right, a.softcap, a.dropout_p,
                            seed, dropout_offset, True)
            dq, dk, dv, _ = _bwd_first_call(plan.backward, key, ops, dout, out, lse,
                                            deterministic, False, None, None)
        else:
            dq, dk, dv, _, failed = bwd_plan.run(dout, q, k, v, out, lse, None, alibi_slopes,
                                                 cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                 seqused_k, max_seqlen_q, max_seqlen_k,
                                                 dropout_seed, dropout_offset, None)
            if failed is not None:
                _raise_for_bwd_plan(failed, dout, q, k, v, out)
        return dq, dk, dv, None, None


_api._planned_attention = _PlannedAttention.apply


# ---- the public API -----------------------------------------------------------------------------


def bwd(dout, q, k, v, out, lse, causal=False, softmax_scale=None, *, window_size=(-1, -1),
        mask_align="top_left", bias=None, attn_mask=None, alibi_slopes=None, softcap=0.0,
        dropout_p=0.0, dropout_seed=None, dropout_offset=0, cu_seqlens_q=None,
        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
        seqused_k=None, deterministic=False, return_dbias=False, instance=None):
    """Attention backward: the gradients of fmha.fwd(q, k, v, ...) given dout, the gradient of
    its output; for frameworks that keep their own autograd (with torch's, out.backward() after
    fmha.fwd runs this for you).

    q, k, v and every option are the forward call's, with fmha.fwd's meaning and checks, and
    must be the same values (the backward recomputes the attention probabilities from them):
    causal, softmax_scale, window_size, mask_align, bias/attn_mask, alibi_slopes, softcap,
    dropout_p with dropout_seed and dropout_offset, cu_seqlens_*/max_seqlen_* (group mode),
    seqused_*. out and lse are what the forward returned with return_lse=True: out (q's shape
    with v's head dim, q's dtype) and lse (float32, (batch, nheads, seqlen_q), or (nheads,
    total_q) in group mode). dout: out's shape and dtype. On q's device, with the layouts
    fmha.fwd takes (head dim contiguous, other strides multiples of 8 elements, 16-byte
    aligned); v row-major only (a V^T view runs forward only). Head dims that are not multiples
    of 8 run zero-padded, as in fmha.fwd. dropout_p > 0 needs the forward's dropout_seed: an
    unseeded forward drew its own, which only autograd keeps.

    deterministic=True: gradients bitwise identical from run to run (dQ summed in a fixed
    order), at a cost in memory and time. return_dbias=True (with an elementwise bias, or an
    additive attn_mask) also returns dbias, the gradient of the bias in its own shape: the
    kernel writes the full (batch, nheads, seqlen_q, seqlen_k) gradient and it is summed over
    the dimensions the bias broadcasts. instance: a name from fmha.bwd_instances() to run
    instead of the dispatcher's choice.

    Returns (dq, dk, dv), or (dq, dk, dv, dbias): new tensors of q's, k's, v's (and the
    bias's) shapes and q's dtype, each in its tensor's strides where that tensor is dense (a
    (b, h, s, d) tensor's transpose(1, 2) gets a gradient laid out alike; group mode and other
    views get contiguous ones); with MQA/GQA dk and dv are summed over the query heads that
    share a K/V head. Runs on torch.cuda.current_stream(q.device).
    """
    if instance is not None:
        check_instance(instance, "bwd")
    given = bias if bias is not None else attn_mask
    key = _plans.bwd_call_key(dout, q, k, v, out, lse, causal, softmax_scale, window_size,
                              mask_align, bias, attn_mask, alibi_slopes, softcap, dropout_p,
                              dropout_seed, dropout_offset, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, deterministic,
                              return_dbias, instance)
    plan = None if key is None else _BWD_PLANS.get(key)
    if plan is not None:  # a signature seen before: its checks passed then
        dq, dk, dv, dbias, failed = plan.run(dout, q, k, v, out, lse, given, alibi_slopes,
                                             cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                             max_seqlen_q, max_seqlen_k, dropout_seed or 0,
                                             dropout_offset, instance)
        if failed is not None:
            _raise_for_bwd_plan(failed, dout, q, k, v, out)
        return (dq, dk, dv, dbias.sum_to_size(given.shape)) if return_dbias else (dq, dk, dv)

    def more_checks(p, o):
        check_bwd_options(v, p, bias, attn_mask, deterministic, return_dbias, "bwd")
        check_bwd_operands(dout, q, k, v, out, lse, p, o, "bwd")
        return dict(dout=dout, out=out, lse=lse)

    if _head_dims.needs_padding(q, v):  # no plan: the padded call keeps its own
        # Every check first: a bad call fails before anything is copied.
        _prepare(q, k, v, causal, softmax_scale, window_size, mask_align, bias, attn_mask,
                 alibi_slopes, softcap, dropout_p, dropout_seed, dropout_offset, True,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                 materialize=False, api="bwd", more_checks=more_checks)
        pad = _head_dims.pad
        grads = bwd(pad(dout), pad(q), pad(k), pad(v), pad(out), lse, causal,
                    _head_dims.default_scale(q, softmax_scale), window_size=window_size,
                    mask_align=mask_align, bias=bias, attn_mask=attn_mask,
                    alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                    dropout_seed=dropout_seed, dropout_offset=dropout_offset,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
                    seqused_k=seqused_k, deterministic=deterministic,
                    return_dbias=return_dbias, instance=instance)
        cut = tuple(grad[..., :like.shape[-1]].contiguous()
                    for grad, like in zip(grads[:3], (q, k, v)))
        return cut + tuple(grads[3:])

    ops = _prepare(q, k, v, causal, softmax_scale, window_size, mask_align, bias, attn_mask,
                   alibi_slopes, softcap, dropout_p, dropout_seed, dropout_offset, True,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                   materialize=True, api="bwd", more_checks=more_checks)
    if key is not None and _plans.reusable(ops, bias, attn_mask, alibi_slopes):
        dq, dk, dv, dbias = _bwd_first_call(_BWD_PLANS, key, ops, dout, out, lse, deterministic,
                                            return_dbias, given, instance)
    else:
        dq, dk, dv, dbias = _bwd_op(dout, out, lse, *ops[:FORWARD_RECORD], deterministic,
                                    return_dbias, instance)
    return (dq, dk, dv, dbias.sum_to_size(given.shape)) if return_dbias else (dq, dk, dv)


# Plans of the eager fmha.bwd calls, by call signature (fmha._plans.bwd_call_key): a later
# call of a signature skips every Python check, as fmha.fwd's do, and runs the plan.
_BWD_PLANS = _plans.PlanTable()


# The keyword options of bwd that select_bwd and explain_bwd take: fwd's, less return_lse (the
# backward always reads the log-sum-exp) and the descale factors and output dtype of e4m3
# inputs (which have no backward), plus the backward's own.
_BWD_OPTION_DEFAULTS = {
    **{name: value for name, value in _OPTION_DEFAULTS.items()
       if name not in ("return_lse", "out_dtype") and name not in DESCALES},
    "deterministic": False,
    "return_dbias": False,
}


def _described_bwd(api: str, q, k, v, causal, softmax_scale, options: dict,
                   cc: int) -> "_C.BwdArgs":
    unknown = sorted(set(options) - set(_BWD_OPTION_DEFAULTS))
    if unknown:
        raise TypeError(f"fmha.{api}: unexpected keyword argument {unknown[0]!r}; it takes "
                        f"fmha.bwd's, without dout, out, lse and instance, and capability")
    kwargs = {**_BWD_OPTION_DEFAULTS, **options}
    deterministic, return_dbias = kwargs.pop("deterministic"), kwargs.pop("return_dbias")

    def more_checks(p, o):
        check_bwd_options(v, p, kwargs["bias"], kwargs["attn_mask"], deterministic,
                          return_dbias, api)
        return {}

    ops = _prepare(q, k, v, causal, softmax_scale, return_lse=True, materialize=False, api=api,
                   more_checks=more_checks, check_device=not cc, **kwargs)
    args = _make_bwd_args(_padded_as_described(ops), None, None, None, None, None, None, None,
                          deterministic, return_dbias)
    _mark_given(args.fwd, bias_ptr=ops.bias, alibi_slopes=ops.alibi_slopes,
                cu_seqlens_q=ops.cu_seqlens_q, cu_seqlens_k=ops.cu_seqlens_k,
                seqused_q=ops.seqused_q, seqused_k=ops.seqused_k)
    return args


def select_bwd(q, k, v, causal=False, softmax_scale=None, *, capability=None,
               **options) -> dict:
    """The compiled backward instance fmha.bwd (and autograd through fmha.fwd) would run for
    these arguments on q's GPU, without running it: fmha.bwd's arguments without dout, out, lse
    and instance (the keyword options: fwd's without return_lse, plus deterministic and
    return_dbias). A dict as fmha.bwd_instances() lists them. capability: a GPU's (major,
    minor) to ask for instead of q's, as fmha.select takes it (no GPU needed).

    Raises MissingInstanceError, naming the filter that would build a fitting instance.
    """
    cc = _target_cc(capability, "select_bwd")
    args = _described_bwd("select_bwd", q, k, v, causal, softmax_scale, options, cc)
    code, message, info = _ask(_C.select_bwd, args, q, cc)
    _raise_for(code, message)
    return info


def explain_bwd(q, k, v, causal=False, softmax_scale=None, *, capability=None,
                **options) -> str:
    """Why fmha.bwd would run the backward instance it runs for these arguments (select_bwd's)
    on q's GPU, or on a GPU of `capability`: the instance and the rule that ranks it first, or,
    when none fits, the nearest ones and the generator filter that would build one. Raises only
    for invalid arguments."""
    cc = _target_cc(capability, "explain_bwd")
    args = _described_bwd("explain_bwd", q, k, v, causal, softmax_scale, options, cc)
    code, message, text = _ask(_C.explain_bwd, args, q, cc)
    _raise_for(code, message)
    return text


def bwd_instances() -> list[dict]:
    """Every backward instance, compiled into the build or on demand, in the dispatcher's order
    of preference: a dict of its traits (name, dtype, hdim_q, hdim_v, mask, bias, mode, dbias,
    dropout, softcap), pipeline, arch (arch, arch_cc, arch_exact), tile (block_m: query rows
    per step, block_n: keys per CTA), padding (pad_seqlen, pad_hdim) and origin (as
    fmha.instances())."""
    return _C.bwd_instances()
