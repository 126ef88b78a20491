"""Planned calls: fmha.fwd's host path for a call signature it has seen before.

Every check of a call depends on its signature alone: the class, dtype, shape, strides, device
and requires_grad of each tensor, and the values of its options. The first call of a signature
runs every check (fmha._checks) and keeps what they built, a plan: the FwdArgs with each size,
stride and option filled in, and the shapes of the outputs. A later call with the same signature
allocates its outputs, reads its tensors' pointers and crosses into C++ once, where the C++ API
checks what depends on the pointers (16-byte alignment) and picks the instance for the device.
The pointers, the dropout seed and the dropout offset are values of the call, not of its
signature: a training loop that passes a new seed per step keeps its one plan. So are, in group
mode (varlen), the token counts and the longest lengths, which change with every packed batch.

Only plain eager calls take this path (call_key says which); under torch.compile, a dispatch
or function mode, torch.func transforms or tensor subclasses, fmha.fwd calls its torch.library
op as before, and the op's implementation keeps plans of its own, by the op's arguments
(op_key). A call autograd records takes a plan too, one that trains: fmha._bwd's autograd
Function runs the forward's plan and, in the backward, a BwdPlan the forward's plan keeps
(Plan.backward), with none of the op's per-call dispatch and argument handling (its autograd
wrapper costs several hundred microseconds a step).

The backward's op fmha::bwd keeps plans the same way (BwdPlan, bwd_op_key): a key of its
operands' layouts and its options, the BwdArgs built on a signature's first call, and a later
call that allocates dq, dk, dv (and dbias) and the workspace and crosses into C++ once.
"""

from typing import Optional

import torch

from fmha import _C
from fmha._checks import INT_LIMIT, OFFSET_LIMIT, SEED_LIMIT, out_dtype

# Plans kept at once, the oldest dropped first. A model has a handful of call signatures (its
# attention layers' shapes); the bound keeps a caller whose shapes never repeat from growing the
# table without end.
MAX_PLANS = 512


class Plan:
    """A checked call signature: everything fwd passes to C++ but the call's own values."""

    __slots__ = ("args", "out_shape", "lse_shape", "varlen", "seqused", "bias_from_mask",
                 "draws_seed", "device", "backward", "out_dtype")

    def __init__(self, out_shape: tuple, lse_shape: Optional[tuple], varlen: bool, seqused: bool,
                 bias_from_mask: bool, draws_seed: bool, device: int, trains: bool = False,
                 out_dtype: Optional[torch.dtype] = None):
        self.args: Optional["_C.FwdArgs"] = None  # the first call's; fwd sets it
        # The output's dtype: None for q's; bfloat16 for e4m3 inputs, or the float16 out_dtype
        # asked (fmha._checks.out_dtype).
        self.out_dtype = out_dtype
        # The first call's; in varlen the token count (out's first dim, lse's last) is the call's.
        self.out_shape = out_shape
        self.lse_shape = lse_shape  # None: the call returns no log-sum-exp
        self.varlen = varlen  # token counts and longest lengths are the call's (is_varlen)
        # Rows past a sequence's used length stay as allocated: 0, and lse -inf.
        self.seqused = seqused
        self.bias_from_mask = bias_from_mask  # the elementwise bias is attn_mask, not bias
        self.draws_seed = draws_seed  # dropout without a seed: one is drawn per call
        self.device = device
        # A call autograd records (trains): the plans of its backward, by dout's layout and the
        # deterministic flag (fmha._bwd._PlannedAttention); None for a call without grad.
        self.backward: Optional[PlanTable] = PlanTable() if trains else None

    def outputs(self, q: torch.Tensor) -> tuple:
        """The call's out and log-sum-exp (None without return_lse), on q's device, contiguous:
        their strides, which the plan's FwdArgs hold, follow from their shapes alone. (Not
        torch.empty_like(q), whose strides follow q's where q is dense: a q without elements
        counts as dense whatever its strides, and a varlen plan serves such a call too.)"""
        out_shape, lse_shape = self.out_shape, self.lse_shape
        if self.varlen:
            tokens = q.shape[0]
            out_shape = (tokens, *out_shape[1:])
            lse_shape = None if lse_shape is None else (lse_shape[0], tokens)
        if self.seqused:  # the kernel leaves rows past seqused_q alone: an empty row's values
            out = q.new_zeros(out_shape, dtype=self.out_dtype)
            lse = None if lse_shape is None else q.new_full(lse_shape, float("-inf"),
                                                            dtype=torch.float32)
        else:
            out = q.new_empty(out_shape, dtype=self.out_dtype)
            lse = None if lse_shape is None else q.new_empty(lse_shape, dtype=torch.float32)
        return out, lse

    def launch(self, q, k, v, out, lse, bias, attn_mask, alibi_slopes, cu_seqlens_q,
               cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
               dropout_seed: int, dropout_offset: int, instance, q_descale=None, k_descale=None,
               v_descale=None):
        """Runs the plan on this call's tensors on the current stream of q's device; returns
        None, or (status code, message) when nothing was launched. The descale factors: an e4m3
        call's, None for 1 (and for every 16-bit call)."""
        mask = attn_mask if self.bias_from_mask else bias
        sizes = _KEEP_SIZES
        if self.varlen:  # as fmha._api._make_args derives them
            total_q, total_k = q.shape[0], k.shape[0]
            sizes = (min(max_seqlen_q, total_q), min(max_seqlen_k, total_k), total_q, total_k,
                     -1 if lse is None else lse.stride(-2))
        call = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                0 if lse is None else lse.data_ptr(), 0 if mask is None else mask.data_ptr(),
                0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
                0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
                0 if seqused_q is None else seqused_q.data_ptr(),
                0 if seqused_k is None else seqused_k.data_ptr(),
                0 if q_descale is None else q_descale.data_ptr(),
                0 if k_descale is None else k_descale.data_ptr(),
                0 if v_descale is None else v_descale.data_ptr(), dropout_seed, dropout_offset,
                *sizes, torch._C._cuda_getCurrentRawStream(self.device), instance)
        if torch._C._cuda_getDevice() == self.device:
            return self.args.run(*call)
        with torch.cuda.device(self.device):  # the dispatcher picks by the current device's arch
            return self.args.run(*call)

    def run(self, q, k, v, bias, attn_mask, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
            seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, dropout_seed: int,
            dropout_offset: int, instance, q_descale=None, k_descale=None,
            v_descale=None) -> tuple:
        """outputs() and launch() of a later call: (out, lse, None), or (out, lse, (status
        code, message)) when nothing was launched."""
        out, lse = self.outputs(q)
        return out, lse, self.launch(q, k, v, out, lse, bias, attn_mask, alibi_slopes,
                                     cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                     max_seqlen_q, max_seqlen_k, dropout_seed, dropout_offset,
                                     instance, q_descale, k_descale, v_descale)


# FwdArgs.run's seqlen_q, seqlen_k, total_q, total_k and lse_head_stride: -1 keeps the plan's.
_KEEP_SIZES = (-1, -1, -1, -1, -1)


def _signature(t: torch.Tensor) -> tuple:
    return (t.__class__, t.shape, t.stride(), t.dtype, t.get_device(), t.requires_grad)


def is_varlen(cu_seqlens_q, bias) -> bool:
    """Whether a call's plan leaves its token counts and longest lengths to the call: group mode
    (varlen), where they change from one batch of packed sequences to the next while nothing
    checked depends on them but sizes checked per call (_varlen_sizes_pass); not with an
    elementwise bias, which must broadcast to the longest lengths."""
    return cu_seqlens_q is not None and bias is None


def _packed_layout(t: torch.Tensor) -> tuple:
    """A packed (tokens, heads, dim) tensor's layout, its token count left out but for whether
    it is above 1 (a dimension of size 1 passes as stride 0: _checks.kernel_strides)."""
    return (t.shape[1:], t.stride(), t.shape[0] > 1, t.dtype, t.get_device())


def _sizes_key(q, k, v, varlen: bool, max_seqlen_q, max_seqlen_k) -> tuple:
    """What q, k, v and the longest lengths add to a key: their layouts; in varlen without the
    token counts and longest lengths, which are the call's (Plan.launch passes them)."""
    if varlen:
        return (_packed_layout(q), _packed_layout(k), _packed_layout(v))
    return (q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype,
            k.get_device(), v.shape, v.stride(), v.dtype, v.get_device(), max_seqlen_q,
            max_seqlen_k)


def _varlen_sizes_pass(q, k, v, max_seqlen_q, max_seqlen_k) -> bool:
    """The checks of a varlen call that read its sizes (fmha._checks.check_mode and
    check_inputs): packed 3-D tensors, as many K as V tokens, counts below 2^31, non-negative
    longest lengths. A call that fails one takes the op, whose checks say which."""
    return (q.dim() == 3 and k.dim() == 3 and v.dim() == 3 and k.shape[0] == v.shape[0]
            and q.shape[0] < INT_LIMIT and k.shape[0] < INT_LIMIT
            and max_seqlen_q is not None and max_seqlen_k is not None
            and max_seqlen_q >= 0 and max_seqlen_k >= 0)


def is_real(x) -> bool:
    # Exact types: a bool equals 0 or 1 and would match a plan made for an int or a float.
    return x.__class__ is float or x.__class__ is int


def call_key(q, k, v, causal, softmax_scale, window_size, mask_align, bias, attn_mask,
             alibi_slopes, softcap, dropout_p, dropout_seed, dropout_offset, return_lse,
             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
             instance, descales: tuple = (None, None, None),
             out_dtype=None) -> Optional[tuple]:
    """The signature of a call that may take a plan, or None for a call that takes the
    torch.library op. Options must have their documented types exactly (a bool is no int here),
    so that two calls with one key pass the same checks; any other value takes the op, whose
    checks accept or reject it as they always did. A call that autograd records (grad on, q, k
    or v needing it) has a key of its own, whose plan trains (Plan.backward), unless it has a
    bias or attn_mask: the op's autograd formula differentiates those."""
    if torch.compiler.is_compiling():
        return None
    if (q.__class__ is not torch.Tensor or k.__class__ is not torch.Tensor
            or v.__class__ is not torch.Tensor or not q.is_cuda
            or torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return None
    trains = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not (causal is True or causal is False) or not (return_lse is True or return_lse is False):
        return None
    if not (softmax_scale is None or is_real(softmax_scale)) or not is_real(softcap):
        return None
    if not is_real(dropout_p) or mask_align.__class__ is not str:
        return None
    if not (window_size.__class__ is tuple and len(window_size) == 2
            and window_size[0].__class__ is int and window_size[1].__class__ is int):
        return None
    if not (max_seqlen_q is None or max_seqlen_q.__class__ is int) or not (
            max_seqlen_k is None or max_seqlen_k.__class__ is int):
        return None
    # Values of the call: an invalid one takes the op, whose checks say what is wrong.
    if not (dropout_seed is None or (dropout_seed.__class__ is int
                                     and 0 <= dropout_seed < SEED_LIMIT)):
        return None
    if not (dropout_offset.__class__ is int and 0 <= dropout_offset < OFFSET_LIMIT):
        return None
    optional = (bias, attn_mask, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    if not all(t is None or isinstance(t, torch.Tensor) for t in optional):
        return None  # a list where a tensor belongs: the op's checks name it
    # An e4m3 call's descale factors (16-bit calls have none: no cost on their path).
    descaled = None
    if descales[0] is not None or descales[1] is not None or descales[2] is not None:
        if not all(t is None or isinstance(t, torch.Tensor) for t in descales):
            return None
        descaled = tuple(None if t is None else _signature(t) for t in descales)
    if not (out_dtype is None or out_dtype.__class__ is torch.dtype):
        return None  # the op's checks name it
    if trains and (bias is not None or attn_mask is not None):
        return None  # a bias's gradient, or its absence, is the op's autograd formula's work
    varlen = is_varlen(cu_seqlens_q, bias if bias is not None else attn_mask)
    if varlen and not _varlen_sizes_pass(q, k, v, max_seqlen_q, max_seqlen_k):
        return None
    # Hashable by construction: the checks above leave no list or other unhashable value. q,
    # k and v are plain tensors, and need no grad or run with grad off (checked above), so
    # their class and requires_grad go without saying; each optional tensor states them.
    return (_sizes_key(q, k, v, varlen, max_seqlen_q, max_seqlen_k), causal, softmax_scale,
            window_size, mask_align, softcap, dropout_p, dropout_seed is None, return_lse,
            instance, trains,
            None if bias is None else _signature(bias),
            None if attn_mask is None else _signature(attn_mask),
            None if alibi_slopes is None else _signature(alibi_slopes),
            None if cu_seqlens_q is None else _signature(cu_seqlens_q),
            None if cu_seqlens_k is None else _signature(cu_seqlens_k),
            None if seqused_q is None else _signature(seqused_q),
            None if seqused_k is None else _signature(seqused_k), descaled, out_dtype)


def lse_shape(q: torch.Tensor, group: bool) -> tuple:
    """The log-sum-exp's shape: (batch, nheads, seqlen_q), or (nheads, total_q) in group mode."""
    return (q.shape[1], q.shape[0]) if group else (q.shape[0], q.shape[2], q.shape[1])


def _layout(t: Optional[torch.Tensor]):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def op_key(ops, *flags) -> tuple:
    """The signature of a call of the op fmha::fwd (`ops`, fmha._api._Operands, and the op's
    further arguments, `flags`), or of fmha::bwd's forward part: the op gets operands that
    fwd's checks (or torch.compile's trace of them) already made final, so only their layouts
    and the values of its other arguments decide its FwdArgs; the dropout seed's and offset's
    values are the call's own, and in varlen the token counts and longest lengths too
    (is_varlen)."""
    varlen = is_varlen(ops.cu_seqlens_q, ops.bias)
    return (_sizes_key(ops.q, ops.k, ops.v, varlen, ops.max_seqlen_q, ops.max_seqlen_k),
            _layout(ops.bias), _layout(ops.alibi_slopes), _layout(ops.cu_seqlens_q),
            _layout(ops.cu_seqlens_k), _layout(ops.seqused_q), _layout(ops.seqused_k),
            ops.dropout_seed is None, ops.softmax_scale, ops.mask, ops.mask_align,
            ops.window_left, ops.window_right, ops.softcap, ops.dropout_p, ops.return_lse,
            _layout(ops.q_descale), _layout(ops.k_descale), _layout(ops.v_descale),
            ops.out_dtype, flags)


def reusable(ops, bias, attn_mask, alibi_slopes) -> bool:
    """Whether a later fwd call of this signature can take the plan of this checked one (`ops`,
    fmha._api._Operands, and the arguments fwd got): not when a tensor is of another class or
    one besides q, k and v needs grad (their grad is the key's, call_key), nor when the checks
    made a bias or ALiBi operand anew (a boolean mask turned into a bias, a copy made
    contiguous), whose pointer a later call would not have."""
    if any(t.__class__ is not torch.Tensor for t in (ops.q, ops.k, ops.v)):
        return False
    given = (bias, attn_mask, alibi_slopes, ops.cu_seqlens_q, ops.cu_seqlens_k, ops.seqused_q,
             ops.seqused_k, ops.q_descale, ops.k_descale, ops.v_descale)
    for t in given:
        if t is not None and (t.__class__ is not torch.Tensor or t.requires_grad):
            return False
    mask = bias if bias is not None else attn_mask
    if ops.bias is not None and ops.bias.data_ptr() != mask.data_ptr():
        return False
    return ops.alibi_slopes is alibi_slopes


def make(ops, bias_from_mask: bool, draws_seed: bool, trains: bool = False) -> Plan:
    """The plan of a checked call (`ops`, fmha._api._Operands), its FwdArgs still to come: they
    take the first call's outputs, which the plan allocates (the caller sets them). trains: a
    call autograd records (its ops ask for the log-sum-exp, which the backward reads)."""
    q, v = ops.q, ops.v
    out_shape = (*q.shape[:-1], v.shape[-1])
    dtype = out_dtype(q.dtype, ops.out_dtype)
    return Plan(out_shape, lse_shape(q, ops.cu_seqlens_q is not None) if ops.return_lse else None,
                is_varlen(ops.cu_seqlens_q, ops.bias), ops.seqused_q is not None, bias_from_mask,
                draws_seed, q.get_device(), trains, None if dtype == q.dtype else dtype)


class PlanTable:
    """The plans by call signature, at most MAX_PLANS of them, the oldest dropped first."""

    def __init__(self, limit: int = MAX_PLANS):
        self._plans: dict = {}
        self._limit = limit
        self.get = self._plans.get  # the dict's own: one call less on every fwd call

    def put(self, key, plan: Plan) -> None:
        # Calls on several threads may evict at once: a key another thread took out already,
        # or a table it emptied, is no error.
        while len(self._plans) >= self._limit:
            oldest = next(iter(self._plans), None)
            if oldest is None:
                break
            self._plans.pop(oldest, None)
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


class BwdPlan:
    """A checked backward call signature (the op fmha::bwd's): its BwdArgs with every size,
    stride and option, and what a call allocates. A later call of the signature costs, on the
    host: the key (bwd_op_key: a tuple of each operand's shape, strides, dtype and device),
    three or four allocations from torch's caching allocator (dq, dk, dv, dbias) and one for
    the workspace, reading ~20 data pointers, and one crossing into C++ (BwdArgs.run), which
    checks alignment, picks the instance and launches its kernels; in group mode (varlen) one
    more crossing asks for the workspace's size, which follows the call's token counts."""

    __slots__ = ("args", "varlen", "zero_grads", "dbias_shape", "workspace_bytes", "device")

    def __init__(self, varlen: bool, zero_grads: bool, dbias_shape: Optional[tuple],
                 device: int):
        self.args: Optional["_C.BwdArgs"] = None  # the first call's; the op sets it
        self.varlen = varlen  # token counts and longest lengths are the call's (is_varlen)
        # The kernels write every row of dq, and every key a sequence owns in dk and dv (zeros
        # where no query sees it, past seqused_k too); only group mode's keys past
        # cu_seqlens_k[-1] belong to no sequence, so there dk and dv start zeroed.
        self.zero_grads = zero_grads
        self.dbias_shape = dbias_shape  # None: no dbias; else the bias operand's (b, h, sq, sk)
        # None until the first launch asks; in varlen asked on every call (its sizes vary).
        self.workspace_bytes: Optional[int] = None
        self.device = device

    def outputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """(dq, dk, dv, dbias or None): grad_like q, k and v (their strides, which the plan's
        BwdArgs hold, follow from the layouts in the key); dbias zeroed, as the kernels write
        only the tiles the mask lets them visit."""
        group = self.zero_grads
        dq, dk, dv = grad_like(q, group), grad_like(k, group), grad_like(v, group)
        if group:
            dk.zero_()
            dv.zero_()
        dbias = None if self.dbias_shape is None else q.new_zeros(self.dbias_shape)
        return dq, dk, dv, dbias

    def launch(self, dout, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
               seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, dropout_seed: int,
               dropout_offset: int, dq, dk, dv, dbias, instance):
        """Allocates the workspace and runs the plan on this call's tensors on the current
        stream of q's device; returns None, or (status code, message) when nothing was
        launched."""
        if torch._C._cuda_getDevice() == self.device:
            return self._launch_here(dout, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q,
                                     cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                     max_seqlen_k, dropout_seed, dropout_offset, dq, dk, dv,
                                     dbias, instance)
        with torch.cuda.device(self.device):  # the dispatcher picks by the current device's arch
            return self._launch_here(dout, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q,
                                     cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                     max_seqlen_k, dropout_seed, dropout_offset, dq, dk, dv,
                                     dbias, instance)

    def _launch_here(self, dout, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q,
                     cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                     dropout_seed, dropout_offset, dq, dk, dv, dbias, instance):
        sizes = _KEEP_SIZES
        if self.varlen:  # as fmha._api._make_args derives them
            total_q, total_k = q.shape[0], k.shape[0]
            sizes = (min(max_seqlen_q, total_q), min(max_seqlen_k, total_k), total_q, total_k,
                     lse.stride(-2))
        workspace_bytes = self.workspace_bytes
        if workspace_bytes is None:
            # A named instance may be larger than the dispatcher's choice: it sizes its own.
            # A miss compiles on demand (fmha.jit) unless the stream captures a graph.
            code, message, workspace_bytes = self.args.workspace_size(
                *sizes[:4], instance, torch._C._cuda_getCurrentRawStream(self.device))
            if code != _C.STATUS_OK:
                return code, message
            if not self.varlen:
                self.workspace_bytes = workspace_bytes
        # The caching allocator's blocks start 512-byte aligned (BwdArgs asks for 256), and
        # are reused only in the current stream's order, where the kernels run.
        workspace = None  # the tensor lives until the launch is queued: enough (see above)
        if workspace_bytes:
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
        return self.args.run(
            dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
            lse.data_ptr(), 0 if bias is None else bias.data_ptr(),
            0 if alibi_slopes is None else alibi_slopes.data_ptr(),
            0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
            0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
            0 if seqused_q is None else seqused_q.data_ptr(),
            0 if seqused_k is None else seqused_k.data_ptr(), dropout_seed, dropout_offset,
            dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), 0 if dbias is None else dbias.data_ptr(),
            0 if workspace is None else workspace.data_ptr(), workspace_bytes, *sizes,
            torch._C._cuda_getCurrentRawStream(self.device), instance)

    def run(self, dout, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
            seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, dropout_seed: int,
            dropout_offset: int, instance) -> tuple:
        """outputs() and launch() of a later call: (dq, dk, dv, dbias, None), or with (status
        code, message) last when nothing was launched."""
        dq, dk, dv, dbias = self.outputs(q, k, v)
        return dq, dk, dv, dbias, self.launch(
            dout, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q,
            seqused_k, max_seqlen_q, max_seqlen_k, dropout_seed, dropout_offset, dq, dk, dv,
            dbias, instance)


def grad_like(t: torch.Tensor, group: bool) -> torch.Tensor:
    """An uninitialized gradient for t, in t's layout where t is dense (a (b, h, s, d) leaf seen
    through transpose(1, 2) gets a gradient that is its own layout again after autograd's
    transpose back, which AccumulateGrad then keeps without a copy), else contiguous. Group
    mode's packed tensors get contiguous ones: a varlen plan serves other token counts, and a
    dense permuted layout's strides would change with them."""
    return t.new_empty(t.shape) if group else torch.empty_like(t)


def output_layout(t: torch.Tensor, varlen: bool) -> tuple:
    """The layout of an operand shaped like the output (out, dout): in varlen without its token
    count, which is the call's."""
    return _packed_layout(t) if varlen else _layout(t)


def _grads_layout(dout, out, lse, varlen: bool) -> tuple:
    """What dout, out and lse add to a backward call's key."""
    return (output_layout(dout, varlen), output_layout(out, varlen),
            _lse_layout(lse) if varlen else _layout(lse))


def _lse_layout(lse: torch.Tensor) -> tuple:
    """A group-mode log-sum-exp's layout, (nheads, total_q), its token count (and with it the
    head stride of a contiguous one) left out: BwdPlan.launch passes the head stride."""
    return (lse.shape[:-1], lse.stride(-1), lse.shape[-1] > 1, lse.dtype, lse.get_device())


def bwd_op_key(dout, out, lse, ops, *flags) -> tuple:
    """The signature of a call of the op fmha::bwd: op_key of its forward part (`ops`) and its
    flags, and the layouts of dout, out and lse (in varlen without token counts)."""
    return (op_key(ops, *flags),
            _grads_layout(dout, out, lse, is_varlen(ops.cu_seqlens_q, ops.bias)))


def bwd_call_key(dout, q, k, v, out, lse, causal, softmax_scale, window_size, mask_align, bias,
                 attn_mask, alibi_slopes, softcap, dropout_p, dropout_seed, dropout_offset,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                 deterministic, return_dbias, instance) -> Optional[tuple]:
    """The signature of an fmha.bwd call that may take a plan, or None for one that takes the
    op fmha::bwd: call_key of its forward arguments (with the log-sum-exp), the layouts of dout,
    out and lse, and its two flags, by the same rules (exact types; plain tensors; none that
    needs grad while grad is on, whose call the op's autograd kernel must see)."""
    if not (deterministic is True or deterministic is False) or not (
            return_dbias is True or return_dbias is False):
        return None
    if (dout.__class__ is not torch.Tensor or out.__class__ is not torch.Tensor
            or lse.__class__ is not torch.Tensor):
        return None
    if torch.is_grad_enabled() and (dout.requires_grad or out.requires_grad
                                    or lse.requires_grad):
        return None
    key = call_key(q, k, v, causal, softmax_scale, window_size, mask_align, bias, attn_mask,
                   alibi_slopes, softcap, dropout_p, dropout_seed, dropout_offset, True,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                   instance)
    if key is None:
        return None
    varlen = is_varlen(cu_seqlens_q, bias if bias is not None else attn_mask)
    # The checks that read token counts (fmha._checks.check_bwd_operands): out and dout have
    # q's, lse is (nheads, q's); a call that fails one takes the op, which says so.
    if varlen and not (out.dim() == 3 and out.shape[0] == q.shape[0]
                       and dout.shape == out.shape and lse.dim() == 2
                       and lse.shape[1] == q.shape[0]):
        return None
    return key, _grads_layout(dout, out, lse, varlen), deterministic, return_dbias


def make_bwd(ops, return_dbias: bool) -> BwdPlan:
    """The plan of a backward call of the forward `ops` (fmha._api._Operands), its BwdArgs still
    to come: they take the first call's gradients, which the plan allocates."""
    q = ops.q
    group = ops.cu_seqlens_q is not None
    dbias_shape = tuple(ops.bias.shape) if return_dbias and ops.bias is not None else None
    return BwdPlan(is_varlen(ops.cu_seqlens_q, ops.bias), group, dbias_shape,
                   q.get_device())
