"""The backward's Python API without a GPU: fmha.bwd's checks, the op fmha::bwd's fake
implementation, fmha::fwd's autograd formula, the BwdArgs a call builds, and the C++ checks
reached through the bindings.

As in tests/test_api_checks.py, CPU tensors reach every check but the device check, and fake
CUDA tensors (FakeTensorMode) get past it into the ops' fake implementations. Autograd needs
more: a CPU-only torch cannot make a gradient edge to a (fake) CUDA tensor, so the autograd
tests switch the device check off (no_device_check) and run on meta tensors, whose kernels are
the ops' fake implementations, or trace CPU fake tensors with torch.compile. The GPU tests of
the backward's numbers are tests/*_gpu.py's.
"""

import re

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fmha import _C, _api, _bwd, _head_dims, _plans  # noqa: E402

F16 = torch.float16


def inputs(b=2, sq=16, sk=16, hq=4, hk=4, d=64, dv=64, dtype=F16, device="cpu"):
    """A valid batch-mode fmha.bwd call's tensors: dout, q, k, v, out, lse."""
    def rand(*shape, dt=dtype):
        return torch.randn(*shape, device=device).to(dt)

    return dict(dout=rand(b, sq, hq, dv), q=rand(b, sq, hq, d), k=rand(b, sk, hk, d),
                v=rand(b, sk, hk, dv), out=rand(b, sq, hq, dv),
                lse=rand(b, hq, sq, dt=torch.float32))


def packed_inputs(total_q=40, total_k=48, hq=4, hk=4, d=64, dv=64, batch=2, device="cpu"):
    """A valid group-mode (varlen) call's tensors and group-mode keyword arguments."""
    shapes = dict(dout=(total_q, hq, dv), q=(total_q, hq, d), k=(total_k, hk, d),
                  v=(total_k, hk, dv), out=(total_q, hq, dv))
    t = {name: torch.randn(shape, device=device).to(F16) for name, shape in shapes.items()}
    t["lse"] = torch.randn(hq, total_q, device=device)
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    return t, dict(cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=20, max_seqlen_k=24)


def call(t: dict, **kwargs):
    return fmha.bwd(t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], **kwargs)


@pytest.fixture
def no_device_check(monkeypatch):
    """Lets CPU and meta tensors through the device check (fmha._api's, which bwd's shares)."""
    monkeypatch.setattr(_api, "check_devices", lambda **tensors: None)


class Recorder(TorchDispatchMode):
    """The fmha ops a block runs, with their arguments (below autograd)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("fmha."):
            self.calls.append((str(func), args))
        return func(*args, **(kwargs or {}))

    def args_of(self, name: str) -> list:
        return [args for func, args in self.calls if func == name]


# ---- fmha.bwd's checks -----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(), dict(causal=True, softmax_scale=0.5, window_size=(4, 0), mask_align="bottom_right"),
    dict(dropout_p=0.1, dropout_seed=7, dropout_offset=3), dict(softcap=30.0),
    dict(bias=torch.zeros(4, 1, 16, dtype=F16), return_dbias=True),
    dict(attn_mask=torch.zeros(16, 16, dtype=F16), return_dbias=True),
    dict(attn_mask=torch.ones(16, 16, dtype=torch.bool)), dict(alibi_slopes=torch.ones(4)),
    dict(deterministic=True), dict(instance="some_bwd_instance"),
])
def test_valid_calls_reach_the_device_check(kwargs):
    with pytest.raises(ValueError, match="fmha.bwd: q is on cpu; fmha.bwd needs CUDA tensors"):
        call(inputs(), **kwargs)


def test_valid_gqa_and_group_calls_reach_the_device_check():
    with pytest.raises(ValueError, match="q is on cpu"):
        call(inputs(hq=8, hk=2, d=64, dv=128))
    t, group = packed_inputs(hq=8, hk=2)
    with pytest.raises(ValueError, match="q is on cpu"):
        call(t, **group)


def _strided(shape, strides):
    return torch.empty(20000, dtype=F16).as_strided(shape, strides)


@pytest.mark.parametrize(
    "change,error,message",
    [
        (dict(dout=[1.0]), TypeError, "fmha.bwd: dout must be a torch.Tensor, got list"),
        (dict(out=None), TypeError, "out must be a torch.Tensor, got NoneType"),
        (dict(lse=3), TypeError, "lse must be a torch.Tensor, got int"),
        (dict(out=torch.zeros(2, 16, 4, 64, dtype=torch.bfloat16)), TypeError,
         "out has dtype torch.bfloat16 but q has torch.float16; out is the forward's output"),
        (dict(dout=torch.zeros(2, 16, 4, 64)), TypeError,
         "dout has dtype torch.float32 but out has torch.float16; dout is the gradient of out"),
        (dict(lse=torch.zeros(2, 4, 16, dtype=F16)), TypeError,
         "lse has dtype torch.float16; it must be torch.float32"),
        (dict(out=torch.zeros(2, 16, 4, 128, dtype=F16)), ValueError,
         r"out has shape \(2, 16, 4, 128\); the forward's output has q's shape with v's head "
         r"dim, \(2, 16, 4, 64\)"),
        (dict(dout=torch.zeros(2, 15, 4, 64, dtype=F16)), ValueError,
         r"dout has shape \(2, 15, 4, 64\) but out has \(2, 16, 4, 64\)"),
        (dict(lse=torch.zeros(2, 16, 4)), ValueError,
         r"lse has shape \(2, 16, 4\); the forward's log-sum-exp is \(batch, nheads, seqlen_q\) "
         r"= \(2, 4, 16\)"),
        (dict(lse=torch.zeros(2, 4, 32)[..., ::2]), ValueError,
         r"lse's last \(row\) dimension must be contiguous"),
        (dict(out=torch.zeros(2, 16, 4, 128, dtype=F16)[..., ::2]), ValueError,
         r"out's last \(head\) dimension must be contiguous"),
        (dict(dout=_strided((2, 16, 4, 64), (4160, 260, 64, 1))), ValueError,
         r"dout has strides .* every one but its contiguous dimension's must be a multiple of 8"),
    ],
)
def test_bad_operands(change, error, message):
    t = {**inputs(), **change}
    with pytest.raises(error, match=message):
        call(t)


def test_group_mode_lse_is_per_head_over_all_tokens():
    t, group = packed_inputs()
    t["lse"] = torch.zeros(2, 4, 20)
    with pytest.raises(ValueError, match=r"lse has shape \(2, 4, 20\); the forward's log-sum-exp "
                                         r"is \(nheads, total_q\) = \(4, 40\)"):
        call(t, **group)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(causal=1), TypeError, "fmha.bwd: causal must be a bool, got int"),
        (dict(window_size=(-3, 0)), ValueError, "fmha.bwd: window_size entries must be -1"),
        (dict(bias=torch.zeros(16, 16)), TypeError, "fmha.bwd: bias has dtype torch.float32"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, "fmha.bwd: alibi_slopes must be"),
        (dict(max_seqlen_q=16), ValueError, "fmha.bwd: max_seqlen_q is for group mode"),
        (dict(seqused_q=torch.full((2,), 8)), TypeError, "fmha.bwd: seqused_q has dtype"),
        (dict(instance=3), TypeError, "fmha.bwd: instance must be a str or None, got int"),
        (dict(deterministic=1), TypeError, "fmha.bwd: deterministic must be a bool, got int"),
        (dict(return_dbias="yes"), TypeError, "fmha.bwd: return_dbias must be a bool, got str"),
        (dict(dropout_p=0.1), ValueError,
         r"fmha.bwd: dropout_p > 0 needs dropout_seed, the forward call's"),
        (dict(dropout_p=0.1, dropout_seed=-1), ValueError,
         r"dropout_seed must be in \[0, 2\*\*64\)"),
        (dict(return_dbias=True), ValueError,
         "fmha.bwd: return_dbias=True needs an elementwise bias .* got none"),
        (dict(return_dbias=True, attn_mask=torch.ones(16, 16, dtype=torch.bool)), ValueError,
         "a boolean attn_mask has no gradient"),
        (dict(return_dbias=True, alibi_slopes=torch.ones(4)), ValueError,
         "return_dbias=True needs an elementwise bias"),
    ],
)
def test_bad_options_name_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        call(inputs(), **kwargs)


@pytest.mark.parametrize("name", ["q", "k"])
def test_forward_checks_of_q_k_v_say_bwd(name):
    t = inputs()
    t[name] = t[name].float()
    with pytest.raises(TypeError, match=f"fmha.bwd: {name} has dtype torch.float32"):
        call(t)


def test_head_dims_that_are_not_multiples_of_8_run_padded(monkeypatch, no_device_check):
    """fmha.bwd runs them on copies zero-padded to multiples of 8, with the softmax scale of
    the call's own head dim, and cuts the gradients back to q's, k's and v's shapes."""
    calls = []

    def padded_call(dout, q, k, v, out, lse, causal, softmax_scale, **options):
        calls.append((dout, q, k, v, out, softmax_scale))
        return q + 1, k + 2, v + 3

    bwd = _bwd.bwd
    monkeypatch.setattr(_bwd, "bwd", padded_call)  # the call bwd makes on the padded tensors
    t = inputs(d=36, dv=20)
    grads = bwd(**t)
    (*padded, scale), = calls
    for name, tensor in zip(("dout", "q", "k", "v", "out"), padded):
        width = t[name].shape[-1]
        assert tensor.shape == (*t[name].shape[:-1], 40 if width == 36 else 24), name
        assert torch.equal(tensor[..., :width], t[name]) and not tensor[..., width:].any(), name
    assert scale == 36 ** -0.5
    for grad, name, shift in zip(grads, "qkv", (1, 2, 3)):
        assert grad.is_contiguous() and torch.equal(grad, t[name] + shift), name


@pytest.mark.parametrize("change,message", [
    (dict(lse=torch.zeros(2, 4, 15)), "lse has shape (2, 4, 15)"),
    (dict(out=torch.zeros(2, 16, 4, 24, dtype=F16)), "out has shape (2, 16, 4, 24)"),
    # k's heads expanded (stride 0) past q's: a copy of k would take 2 GiB.
    (dict(k=torch.zeros(1, 1, 1, 36, dtype=F16).expand(2, 16, 2**20, 36)),
     "k has 1048576 heads but v has 4"),
    (dict(), "q is on cpu; fmha.bwd needs CUDA tensors"),  # a valid call
])
def test_a_padded_call_is_checked_before_anything_is_copied(monkeypatch, change, message):
    def copy(x):
        raise AssertionError("copied before the checks")

    monkeypatch.setattr(_head_dims, "pad", copy)
    with pytest.raises(ValueError, match=re.escape(message)):
        call({**inputs(d=36, dv=20), **change})


def test_a_transposed_v_of_a_padded_call_runs_on_a_row_major_copy(monkeypatch, no_device_check):
    """The backward takes no V^T, but a V^T view whose head dim runs padded is copied, and the
    copy is row-major."""
    padded = []
    bwd = _bwd.bwd
    monkeypatch.setattr(_bwd, "bwd", lambda dout, q, k, v, *args, **options:
                        padded.append(v) or (q, k, v))
    t = inputs(dv=20)
    t["v"] = torch.randn(2, 4, 20, 16).to(F16).permute(0, 3, 1, 2)  # (b, sk, hk, dv) of V^T
    bwd(**t)
    assert padded[0].shape == (2, 16, 4, 24) and padded[0].is_contiguous()
    assert torch.equal(padded[0][..., :20], t["v"])


def test_a_transposed_v_is_refused():
    """The forward takes V^T (its sequence dim contiguous); the backward's kernels do not."""
    t = inputs()
    t["v"] = torch.randn(2, 4, 64, 16).to(F16).permute(0, 3, 1, 2)  # (b, sk, hk, dv) view
    with pytest.raises(ValueError, match=r"fmha.bwd: v must be row-major \(its head dimension "
                                         r"contiguous\) .* pass v.contiguous\(\)"):
        call(t)


@pytest.mark.parametrize("name", ["dout", "out", "lse"])
def test_every_bwd_tensor_is_device_checked(name):
    with FakeTensorMode():
        t = inputs(device="cuda")
        t[name] = t[name].to("cpu")
        with pytest.raises(ValueError, match=f"fmha.bwd: {name} is on cpu but q is on cuda:0"):
            call(t)


# ---- the op's fake implementation -------------------------------------------------------------


def test_fake_bwd_returns_gradients_of_the_inputs_shapes():
    with FakeTensorMode():
        t = inputs(b=2, sq=16, sk=24, hq=8, hk=2, d=64, dv=128, device="cuda")
        dq, dk, dv = call(t, causal=True)
        assert (dq.shape, dk.shape, dv.shape) == ((2, 16, 8, 64), (2, 24, 2, 64), (2, 24, 2, 128))
        assert dq.dtype == dk.dtype == dv.dtype == F16
        assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()
        t, group = packed_inputs(hq=8, hk=2, dv=128, device="cuda")
        dq, dk, dv = call(t, **group)
        assert (dq.shape, dk.shape, dv.shape) == ((40, 8, 64), (48, 2, 64), (48, 2, 128))


@pytest.mark.parametrize("shape", [(), (24,), (8, 1, 24), (16, 24), (2, 1, 16, 1), (2, 8, 16, 24)])
def test_dbias_has_the_bias_shape(no_device_check, shape):
    """The op's full (batch, nheads, seqlen_q, seqlen_k) gradient summed to the bias's shape.
    (Meta tensors: a bias broadcast along keys is copied, which fake CUDA tensors cannot be on
    a CPU-only torch.)"""
    t = inputs(b=2, sq=16, sk=24, hq=8, hk=2, device="meta")
    bias = torch.zeros(shape, dtype=F16, device="meta")
    dq, dk, dv, dbias = call(t, bias=bias, return_dbias=True)
    assert dbias.shape == shape and dbias.dtype == F16
    *_, dmask = call(t, attn_mask=bias, return_dbias=True)  # an additive attn_mask
    assert dmask.shape == shape


def test_torch_compile_traces_bwd_fullgraph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def backward(dout, q, k, v, out, lse):
        return fmha.bwd(dout, q, k, v, out, lse, causal=True, dropout_p=0.1, dropout_seed=3)

    torch._dynamo.reset()
    with FakeTensorMode():
        t = inputs(hq=8, hk=2, device="cuda")
        dq, dk, dv = torch.compile(backward, backend=backend, fullgraph=True)(**t)
        assert dq.shape == t["q"].shape and dk.shape == t["k"].shape
    assert graphs[0].code.count("torch.ops.fmha.bwd.default") == 1


# ---- autograd through fmha.fwd ----------------------------------------------------------------


def leaves(device="meta", **shape):
    t = inputs(device=device, **shape)
    return [t[name].requires_grad_() for name in "qkv"]


def test_autograd_gives_every_input_its_gradient(no_device_check):
    q, k, v = leaves(hq=8, hk=2, d=64, dv=128)
    out = fmha.fwd(q, k, v, causal=True)
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    dout = torch.randn(out.shape, dtype=out.dtype, device="meta")
    grads = torch.autograd.grad(fmha.fwd(q, k, v), (q, k, v), dout)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_autograd_forward_computes_the_lse_and_returns_what_was_asked(no_device_check):
    q, k, v = leaves()
    with Recorder() as rec:
        out = fmha.fwd(q, k, v)
        out2, lse = fmha.fwd(q, k, v, return_lse=True)
        with torch.no_grad():
            fmha.fwd(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    return_lse = [args[20] for args in rec.args_of("fmha.fwd.default")]
    assert return_lse == [True, True, False]  # no grad: no log-sum-exp
    assert out.requires_grad and not lse.requires_grad  # lse is not differentiable
    with Recorder() as rec:
        out.sum().backward()
    (bwd_args,) = rec.args_of("fmha.bwd.default")
    assert bwd_args[24] is False  # no bias, no dbias


def test_autograd_keeps_the_seed_an_unseeded_dropout_call_drew(no_device_check):
    q, k, v = leaves()
    with Recorder() as rec:
        out = fmha.fwd(q, k, v, dropout_p=0.3, dropout_offset=5)
        out.sum().backward()
    (fwd_args,) = rec.args_of("fmha.fwd.default")
    (bwd_args,) = rec.args_of("fmha.bwd.default")
    fwd_seed, bwd_seed = fwd_args[18], bwd_args[21]
    assert fwd_seed is not None and bwd_seed is fwd_seed  # the very tensor the forward used
    assert (fwd_args[17], bwd_args[20]) == (0.3, 0.3) and (fwd_args[19], bwd_args[22]) == (5, 5)


def test_autograd_passes_the_options_on(no_device_check):
    q, k, v = leaves()
    slopes = torch.rand(4, device="meta")
    with Recorder() as rec:
        out = fmha.fwd(q, k, v, causal=True, softmax_scale=0.5, window_size=(4, 0),
                       mask_align="bottom_right", alibi_slopes=slopes, softcap=20.0)
        out.sum().backward()
    (fwd_args,) = rec.args_of("fmha.fwd.default")
    (bwd_args,) = rec.args_of("fmha.bwd.default")
    assert bwd_args[7] is fwd_args[4]  # alibi_slopes
    # max_seqlen_q .. dropout_p: the forward's, in the same order.
    assert tuple(bwd_args[12:21]) == tuple(fwd_args[9:18])
    assert bwd_args[15:19] == (_C.MASK_WINDOW, _C.ALIGN_BOTTOM_RIGHT, 4, 0)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_autograd_bias_gradient(no_device_check, requires_grad):
    q, k, v = leaves(sk=24)
    bias = torch.zeros(4, 1, 24, dtype=F16, device="meta", requires_grad=requires_grad)
    with Recorder() as rec:
        fmha.fwd(q, k, v, bias=bias).sum().backward()
    (bwd_args,) = rec.args_of("fmha.bwd.default")
    assert bwd_args[24] is requires_grad  # return_dbias only for a bias that needs a gradient
    assert bwd_args[6].shape == (2, 4, 16, 24)  # the bias operand as the forward read it
    if requires_grad:
        assert bias.grad.shape == bias.shape and bias.grad.dtype == F16
    else:
        assert bias.grad is None


def test_autograd_only_the_bias_needs_grad(no_device_check):
    q, k, v = (x.detach() for x in leaves())
    bias = torch.zeros(16, 16, dtype=F16, device="meta", requires_grad=True)
    out = fmha.fwd(q, k, v, attn_mask=bias)
    out.sum().backward()
    assert bias.grad.shape == (16, 16)


def test_autograd_a_boolean_mask_has_no_gradient(no_device_check):
    q, k, v = leaves()
    mask = torch.ones(16, 16, dtype=torch.bool, device="meta")
    with Recorder() as rec:
        fmha.fwd(q, k, v, attn_mask=mask).sum().backward()
    (bwd_args,) = rec.args_of("fmha.bwd.default")
    assert bwd_args[24] is False and q.grad is not None


def test_autograd_hands_the_kernels_readable_layouts(no_device_check):
    """out.sum()'s gradient is one value expanded (every stride 0): the formula copies it; a
    forward with V^T (column-major) gives the backward a row-major V, and dv V's shape."""
    q, k, _ = leaves()
    vt = torch.randn(2, 4, 64, 16, device="meta").to(F16).requires_grad_()
    v = vt.permute(0, 3, 1, 2)
    with Recorder() as rec:
        fmha.fwd(q, k, v).sum().backward()
    (bwd_args,) = rec.args_of("fmha.bwd.default")
    dout, v_read = bwd_args[0], bwd_args[3]
    assert dout.is_contiguous() and v_read.stride(-1) == 1 and v_read.shape == v.shape
    assert vt.grad.shape == vt.shape
    # A gradient the kernels can read as it is goes through uncopied.
    out = fmha.fwd(q, k, v)
    dout = torch.randn(2, 4, 16, 64, device="meta").to(F16).transpose(1, 2)
    with Recorder() as rec:
        torch.autograd.grad(out, q, dout)
    assert rec.args_of("fmha.bwd.default")[0][0].stride() == dout.stride()


def test_double_backward_is_refused(no_device_check):
    q, k, v = leaves()
    (dq,) = torch.autograd.grad(fmha.fwd(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="fmha::bwd has no derivative"):
        dq.sum().backward()


def test_torch_compile_traces_forward_and_backward_fullgraph(no_device_check):
    """AOTAutograd traces fmha::fwd's formula: the forward graph asks for the log-sum-exp and
    draws the dropout seed, the backward graph runs fmha::bwd with that seed. (CPU fake
    tensors: a CPU-only torch has no autograd for CUDA ones.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def compiler(name):
        def compile_(gm, example_inputs):
            graphs[name] = gm.code
            return make_boxed_func(gm.forward)
        return compile_

    def attention(q, k, v, bias):
        return fmha.fwd(q, k, v, causal=True, dropout_p=0.1, bias=bias)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
    with FakeTensorMode():
        q, k, v = leaves(device="cpu", hq=8, hk=2)
        bias = torch.zeros(8, 1, 16, dtype=F16, requires_grad=True)
        out = torch.compile(attention, backend=backend, fullgraph=True)(q, k, v, bias)
        out.sum().backward()
        assert (q.grad.shape, k.grad.shape, bias.grad.shape) == (q.shape, k.shape, bias.shape)
    fw_call = re.search(r"torch\.ops\.fmha\.fwd\.default\((.*)\)", graphs["fw"]).group(1)
    # return_lse=True, no descale factors and the default out_dtype (e4m3 inputs only),
    # instance=None
    assert fw_call.endswith("True, None, None, None, None, None")
    assert "torch.ops.aten.randint" in graphs["fw"]
    bw_call = re.search(r"torch\.ops\.fmha\.bwd\.default\((.*)\)", graphs["bw"]).group(1)
    assert "randint" in bw_call and bw_call.endswith("False, True, None")  # dbias wanted


# ---- what a call builds ----------------------------------------------------------------------


def build(t: dict, deterministic=False, return_dbias=False, **kwargs):
    """The BwdArgs of a call on CPU tensors, with gradients allocated as the plans do."""
    options = {**_api._OPTION_DEFAULTS, **kwargs, "return_lse": True}
    causal, scale = options.pop("causal", False), options.pop("softmax_scale", None)
    ops = _api._prepare(t["q"], t["k"], t["v"], causal, scale, **options, materialize=True)
    plan = _plans.make_bwd(ops, return_dbias)
    dq, dk, dv, dbias = plan.outputs(ops.q, ops.k, ops.v)
    args = _bwd._make_bwd_args(ops, t["dout"], t["out"], t["lse"], dq, dk, dv, dbias,
                               deterministic, return_dbias)
    return args, plan, (dq, dk, dv, dbias)


def test_args_of_a_batch_call(no_device_check):
    t = inputs(b=2, sq=16, sk=24, hq=8, hk=2, d=64, dv=128)
    t["dout"] = torch.randn(2, 8, 16, 128).to(F16).transpose(1, 2)  # a (b, h, s, d) view
    a, plan, (dq, dk, dv, dbias) = build(t, deterministic=True, causal=True)
    f = a.fwd
    assert (f.batch, f.seqlen_q, f.seqlen_k, f.nhead_q, f.nhead_k, f.hdim_q, f.hdim_v) == (
        2, 16, 24, 8, 2, 64, 128)
    assert (f.o, f.lse, f.mask) == (t["out"].data_ptr(), t["lse"].data_ptr(), _C.MASK_CAUSAL)
    assert (f.lse_batch_stride, f.lse_head_stride) == (8 * 16, 16)
    assert (a.dout, a.dout_batch_stride, a.dout_seq_stride, a.dout_head_stride) == (
        t["dout"].data_ptr(), 8 * 16 * 128, 128, 16 * 128)
    assert (a.dq, a.dq_batch_stride, a.dq_seq_stride, a.dq_head_stride) == (
        dq.data_ptr(), 16 * 8 * 64, 8 * 64, 64)
    assert (a.dk_batch_stride, a.dk_seq_stride, a.dk_head_stride) == (24 * 2 * 64, 2 * 64, 64)
    assert (a.dv, a.dv_batch_stride, a.dv_seq_stride, a.dv_head_stride) == (
        dv.data_ptr(), 24 * 2 * 128, 2 * 128, 128)
    assert dk.shape == t["k"].shape and dbias is None and a.dbias == 0
    assert a.deterministic and not plan.zero_grads and not plan.varlen
    assert a.traits() == dict(dtype=_C.DTYPE_FP16, hdim_q=64, hdim_v=128, mask=_C.MASK_CAUSAL,
                              bias=_C.BIAS_NONE, mode=_C.MODE_BATCH, dbias=False, dropout=False,
                              softcap=False)


def test_args_of_a_bias_gradient(no_device_check):
    t = inputs(sq=16, sk=24)
    bias = torch.randn(4, 1, 24, dtype=F16)
    a, plan, (*_, dbias) = build(t, return_dbias=True, bias=bias)
    assert dbias.shape == (2, 4, 16, 24) and torch.count_nonzero(dbias) == 0  # zeroed
    assert (a.dbias, a.dbias_batch_stride, a.dbias_head_stride, a.dbias_seq_stride) == (
        dbias.data_ptr(), 4 * 16 * 24, 16 * 24, 24)
    assert (a.fwd.bias_ptr, a.fwd.bias_batch_stride, a.fwd.bias_seq_stride) == (
        bias.data_ptr(), 0, 0)
    assert a.traits()["dbias"] and a.traits()["bias"] == _C.BIAS_ELEMENTWISE


def test_args_of_a_group_call(no_device_check):
    t, group = packed_inputs(total_q=40, total_k=48, hq=4, hk=2)
    a, plan, (dq, dk, dv, _) = build(t, **group)
    f = a.fwd
    assert (f.mode, f.batch, f.seqlen_q, f.seqlen_k, f.total_q, f.total_k) == (
        _C.MODE_GROUP, 2, 20, 24, 40, 48)
    assert (a.dout_batch_stride, a.dout_seq_stride, a.dout_head_stride) == (0, 4 * 64, 64)
    assert (a.dk_batch_stride, a.dk_seq_stride, a.dk_head_stride) == (0, 2 * 64, 64)
    assert (f.lse_batch_stride, f.lse_head_stride) == (0, 40)
    # Keys past cu_seqlens_k[-1] belong to no sequence, so no kernel writes them: dk and dv
    # start zeroed (the kernels write every row of dq).
    assert plan.varlen and plan.zero_grads
    assert torch.count_nonzero(dk) == 0 and torch.count_nonzero(dv) == 0


def test_only_group_mode_zeroes_the_gradients(no_device_check):
    # The kernels write every row of dq and every key a sequence owns in dk and dv, zeros
    # past seqused and where nothing is seen: batch mode allocates without a fill.
    used = torch.full((2,), 8, dtype=torch.int32)
    assert not build(inputs(), seqused_k=used)[1].zero_grads
    assert not build(inputs(sk=0))[1].zero_grads and not build(inputs(sq=0))[1].zero_grads
    assert not build(inputs())[1].zero_grads


def test_select_bwd_describes_the_layouts_bwd_uses(no_device_check):
    t = inputs(hq=8, hk=2)
    bias = torch.zeros(16, 16, dtype=F16)
    a = _bwd._described_bwd("select_bwd", t["q"], t["k"], t["v"], True, None,
                            dict(bias=bias, return_dbias=True, deterministic=True), 0)
    assert a.fwd.lse != 0 and a.dbias != 0 and a.deterministic  # wanted, never read
    assert (a.fwd.o_seq_stride, a.dout_seq_stride, a.dq_seq_stride, a.dk_seq_stride) == (
        8 * 64, 8 * 64, 8 * 64, 2 * 64)
    assert (a.fwd.lse_batch_stride, a.fwd.lse_head_stride) == (8 * 16, 16)
    assert a.traits()["dbias"] and a.traits()["mask"] == _C.MASK_CAUSAL


@pytest.mark.parametrize("api", [fmha.select_bwd, fmha.explain_bwd])
def test_select_bwd_and_explain_bwd_describe_the_padded_call(api):
    """Head dims that bwd runs zero-padded are described as bwd runs them: on contiguous copies
    of the padded head dims (and gradients of those), with the call's own softmax scale."""
    t = inputs(d=36, dv=20)
    a = _bwd._described_bwd(api.__name__, t["q"], t["k"], t["v"], True, None, {}, 90)
    assert (a.fwd.hdim_q, a.fwd.hdim_v) == (40, 24)
    assert (a.fwd.q_seq_stride, a.fwd.v_seq_stride, a.fwd.o_seq_stride) == (4 * 40, 4 * 24, 4 * 24)
    assert (a.dq_seq_stride, a.dv_seq_stride, a.dout_seq_stride) == (4 * 40, 4 * 24, 4 * 24)
    assert a.fwd.softmax_scale == pytest.approx(36 ** -0.5)
    try:  # the answer for a GPU of that capability, or the miss that says what it asked for
        api(t["q"], t["k"], t["v"], causal=True, capability=(9, 0))
    except fmha.MissingInstanceError as miss:
        assert "hdim_q=40 hdim_v=24" in str(miss)


@pytest.mark.parametrize("api", [fmha.select_bwd, fmha.explain_bwd])
def test_select_bwd_and_explain_bwd_check_like_bwd(api):
    t = inputs()
    q, k, v = t["q"], t["k"], t["v"]
    name = api.__name__
    with pytest.raises(ValueError, match=f"fmha.{name}: window_size entries must be -1"):
        api(q, k, v, window_size=(-3, 0))
    with pytest.raises(ValueError, match=f"fmha.{name}: v must be row-major"):
        api(q, k, torch.randn(2, 4, 64, 16).to(F16).permute(0, 3, 1, 2))
    with pytest.raises(ValueError, match="return_dbias=True needs an elementwise bias"):
        api(q, k, v, return_dbias=True)
    with pytest.raises(ValueError, match=f"fmha.{name}: q is on cpu"):  # no seed needed here
        api(q, k, v, causal=True, dropout_p=0.1, deterministic=True)
    for bad in ("instance", "return_lse", "dout", "casual"):
        with pytest.raises(TypeError, match=f"fmha.{name}: unexpected keyword argument '{bad}'"):
            api(q, k, v, **{bad: None})


# ---- plans -----------------------------------------------------------------------------------


def _bwd_key(t: dict, group: dict, softmax_scale=0.125):
    ops = _api._Operands(t["q"], t["k"], t["v"], None, None, group.get("cu_seqlens_q"),
                         group.get("cu_seqlens_k"), None, None, group.get("max_seqlen_q", 0),
                         group.get("max_seqlen_k", 0), softmax_scale, 0, 0, -1, -1, 0.0, 0.0,
                         None, 0, True)
    return _plans.bwd_op_key(t["dout"], t["out"], t["lse"], ops, False, False, None)


def test_only_plain_eager_cuda_calls_have_a_bwd_plan_key():
    """CPU tensors, fake tensors and traced calls take the op and its checks every time."""
    t = inputs()
    args = (t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], False, None, (-1, -1),
            "top_left", None, None, None, 0.0, 0.0, None, 0, None, None, None, None, None, None,
            False, False, None)
    assert _plans.bwd_call_key(*args) is None
    with FakeTensorMode():
        t = inputs(device="cuda")
        assert _plans.bwd_call_key(t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"],
                                   *args[6:]) is None


def test_bwd_plan_keys_leave_varlen_token_counts_to_the_call():
    a, group = packed_inputs(total_q=40, total_k=48)
    b, other = packed_inputs(total_q=33, total_k=90)
    other.update(max_seqlen_q=7, max_seqlen_k=90)
    assert _bwd_key(a, group) == _bwd_key(b, other)
    assert _bwd_key(a, group, 0.5) != _bwd_key(a, group, 0.25)
    b["dout"] = torch.randn(33, 4, 128).to(F16)[..., :64]  # another layout
    assert _bwd_key(a, group) != _bwd_key(b, other)
    # Batch mode keys by shape.
    assert _bwd_key(inputs(), {}) == _bwd_key(inputs(), {}) != _bwd_key(inputs(sq=32), {})


class FakeBwdArgs:
    """Stands in for a plan's _C.BwdArgs: records what BwdPlan passes to C++."""

    def __init__(self, workspace_bytes=1000):
        self.sizes_asked, self.runs, self.workspace_bytes = [], [], workspace_bytes
        self.instances_asked, self.streams_asked = [], []

    def workspace_size(self, seqlen_q, seqlen_k, total_q, total_k, instance, stream):
        self.sizes_asked.append((seqlen_q, seqlen_k, total_q, total_k))
        self.instances_asked.append(instance)
        self.streams_asked.append(stream)  # the launch's: a miss compiles unless it captures
        return _C.STATUS_OK, "", self.workspace_bytes

    def run(self, *args):
        self.runs.append(args)
        return None


@pytest.fixture
def cpu_plans(monkeypatch):
    """BwdPlan.launch on CPU tensors: the current device is theirs (-1), the stream 0."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)


def run_plan(plan, t, group, seed=5, offset=2, instance=None):
    return plan.run(t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], None, None,
                    group.get("cu_seqlens_q"), group.get("cu_seqlens_k"), None, None,
                    group.get("max_seqlen_q", 0), group.get("max_seqlen_k", 0), seed, offset,
                    instance)


def test_a_batch_plan_asks_for_its_workspace_once(no_device_check, cpu_plans):
    t = inputs(hq=8, hk=2)
    _, plan, _ = build(t)
    plan.args = fake = FakeBwdArgs()
    for _ in range(3):
        dq, dk, dv, dbias, failed = run_plan(plan, t, {})
        assert failed is None and dbias is None
        assert (dq.shape, dk.shape, dv.shape) == (t["q"].shape, t["k"].shape, t["v"].shape)
    assert fake.sizes_asked == [(-1, -1, -1, -1)] and plan.workspace_bytes == 1000
    assert fake.instances_asked == [None]  # the dispatcher's choice sizes it
    assert fake.streams_asked == [0]  # the stream the launch runs on
    run = fake.runs[-1]
    assert run[:6] == tuple(t[n].data_ptr() for n in ("dout", "q", "k", "v", "out", "lse"))
    assert run[12:14] == (5, 2)  # the call's dropout seed and offset
    assert run[14:17] == (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    assert run[18] != 0 and run[19] == 1000  # a workspace of the size asked for
    assert run[20:] == (-1, -1, -1, -1, -1, 0, None)  # the plan's sizes; stream 0


def test_a_plan_of_a_named_instance_asks_for_that_instance_s_workspace(no_device_check,
                                                                       cpu_plans):
    # A named instance of larger head dims than the dispatcher's choice needs a larger dQ
    # accumulator (its own head dim), so the size asked for must be that instance's.
    t = inputs()
    _, plan, _ = build(t)
    plan.args = fake = FakeBwdArgs()
    *_, failed = run_plan(plan, t, {}, instance="bwd_fp16_d128_fa2_sm90a_m64n128_pad_hpad")
    assert failed is None
    assert fake.instances_asked == ["bwd_fp16_d128_fa2_sm90a_m64n128_pad_hpad"]
    assert fake.runs[-1][-1] == "bwd_fp16_d128_fa2_sm90a_m64n128_pad_hpad"


def test_a_varlen_plan_asks_for_its_workspace_per_call(no_device_check, cpu_plans):
    t, group = packed_inputs(total_q=40, total_k=48)
    _, plan, _ = build(t, **group)
    plan.args = fake = FakeBwdArgs(workspace_bytes=0)
    run_plan(plan, t, group)
    t, other = packed_inputs(total_q=10, total_k=90)
    other.update(max_seqlen_q=30, max_seqlen_k=50)
    dq, dk, dv, _, failed = run_plan(plan, t, other)
    assert failed is None and dq.shape == (10, 4, 64) and dk.shape == (90, 4, 64)
    # Zeroed: group mode's keys past cu_seqlens_k[-1] belong to no sequence, which the kernels
    # leave alone (dq they write whole).
    assert torch.count_nonzero(dk) == 0 and torch.count_nonzero(dv) == 0
    # (min(max_seqlen_q, total_q), min(max_seqlen_k, total_k), total_q, total_k)
    assert fake.sizes_asked == [(20, 24, 40, 48), (10, 50, 10, 90)]
    assert fake.runs[-1][18:25] == (0, 0, 10, 50, 10, 90, 10)  # no workspace; lse head stride
    assert plan.workspace_bytes is None


def test_a_failed_plan_launch_reports_the_status(no_device_check, cpu_plans):
    t = inputs()
    _, plan, _ = build(t)
    plan.args = fake = FakeBwdArgs()
    fake.workspace_size = lambda *sizes: (_C.STATUS_NO_INSTANCE, "no bwd instance", 0)
    *_, failed = run_plan(plan, t, {})
    assert failed == (_C.STATUS_NO_INSTANCE, "no bwd instance") and not fake.runs
    with pytest.raises(fmha.MissingInstanceError, match="no bwd instance"):
        _bwd._raise_for_bwd_plan(failed, t["dout"], t["q"], t["k"], t["v"], t["out"])


# ---- the C++ checks, through the bindings ------------------------------------------------------

# A head dim no instance has, so that a call passing every check stops at the dispatcher
# (kNoInstance, or kCudaError without a GPU) and never launches.
UNSERVED_HDIM = 4


def cpp_bwd_args(**overrides) -> "_C.BwdArgs":
    """A valid batch-mode backward problem at fake, aligned addresses (nothing reads them)."""
    a = _C.BwdArgs()
    f = a.fwd
    fields = dict(
        dtype=_C.DTYPE_FP16, q=4096, k=4096, v=4096, o=4096, lse=4096, batch=1, seqlen_q=16,
        seqlen_k=16, nhead_q=2, nhead_k=2, hdim_q=64, hdim_v=64, q_batch_stride=2048,
        q_seq_stride=128, q_head_stride=64, k_batch_stride=2048, k_seq_stride=128,
        k_head_stride=64, v_batch_stride=2048, v_seq_stride=128, v_head_stride=64,
        o_batch_stride=2048, o_seq_stride=128, o_head_stride=64, lse_batch_stride=32,
        lse_head_stride=16, softmax_scale=0.125)
    grads = dict(dout=4096, dq=4096, dk=4096, dv=4096)
    for g in list(grads):
        grads.update({f"{g}_batch_stride": 2048, f"{g}_seq_stride": 128, f"{g}_head_stride": 64})
    for name, value in overrides.items():
        (grads if name in grads or name.startswith(("dbias", "deterministic", "workspace"))
         else fields)[name] = value
    for name, value in fields.items():
        setattr(f, name, value)
    for name, value in grads.items():
        setattr(a, name, value)
    return a


def test_cpp_bwd_args_fields():
    a = _C.BwdArgs()
    assert (a.dout, a.dq, a.dbias, a.workspace, a.workspace_bytes, a.deterministic) == (
        0, 0, 0, 0, 0, False)
    assert a.fwd.v_dim_stride == 1 and a.fwd.window_left == -1
    a.fwd.q, a.fwd.hdim_q, a.dbias = 2**40, 64, 4096  # a.fwd is a view into a, not a copy
    assert (a.fwd.q, a.fwd.hdim_q) == (2**40, 64)
    assert a.traits() == dict(dtype=0, hdim_q=64, hdim_v=0, mask=0, bias=0, mode=0, dbias=True,
                              dropout=False, softcap=False)
    f = _C.FwdArgs()
    f.hdim_v = 128
    a.fwd = f  # assigning copies
    f.hdim_v = 8
    assert a.fwd.hdim_v == 128 and a.fwd.q == 0
    a.workspace_bytes = 2**40
    assert a.workspace_bytes == 2**40


def passes_checks(code: int, text: str) -> bool:
    return code in (_C.STATUS_NO_INSTANCE, _C.STATUS_CUDA_ERROR) and "fmha::bwd:" not in text


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(vlayout=_C.VLAYOUT_COL_MAJOR, v_seq_stride=1, v_dim_stride=16), "row-major V"),
        (dict(dbias=4096), "dbias is set but the bias type is not"),
        (dict(lse=0), "lse is a null pointer"),
        (dict(dq=4098), "dq must be 16-byte aligned"),
        (dict(dout=0), "dout is a null pointer"),
        (dict(dk_seq_stride=132), "dk seq stride is 132"),
        (dict(hdim_v=0), "hdim_q and hdim_v must be positive"),  # the forward's checks
    ],
)
def test_cpp_bwd_rejects_bad_arguments_before_any_cuda_call(overrides, message):
    code, text, chosen = _C.bwd(cpp_bwd_args(**overrides), 0, None)
    assert code == _C.STATUS_INVALID_ARGUMENT, text
    assert text.startswith("fmha::bwd: ") and re.search(message, text), text
    assert chosen == ""


@pytest.mark.parametrize("overrides", [
    dict(), dict(bias=_C.BIAS_ELEMENTWISE, bias_ptr=4096, dbias=4096, dbias_seq_stride=16),
    dict(deterministic=True), dict(batch=0, dq=0, dk=0, dv=0, dout=0, lse=0),
])
def test_cpp_bwd_accepts_valid_arguments(overrides):
    args = cpp_bwd_args(hdim_q=UNSERVED_HDIM, hdim_v=UNSERVED_HDIM, **overrides)
    code, text, _ = _C.bwd(args, 0, None)
    assert passes_checks(code, text), text
    code, text, _ = _C.bwd_workspace_size(args)
    assert passes_checks(code, text), text
    code, text, _ = args.workspace_size(-1, -1, -1, -1)
    assert passes_checks(code, text), text


def planned_run(args, dout=4096, lse=4096, dq=4096, seqlen_q=-1):
    """BwdArgs.run with every pointer at 4096 but those given, and no bias, ALiBi, varlen or
    workspace."""
    return args.run(dout, 4096, 4096, 4096, 4096, lse, 0, 0, 0, 0, 0, 0, 7, 0, dq, 4096, 4096,
                    0, 0, 0, seqlen_q, -1, -1, -1, -1, 0, None)


def test_cpp_planned_bwd_run_takes_the_calls_pointers_and_sizes():
    args = cpp_bwd_args(q=0, k=0, v=0, o=0, lse=0, dout=0, dq=0, dk=0, dv=0,
                        hdim_q=UNSERVED_HDIM, hdim_v=UNSERVED_HDIM)
    code, text = planned_run(args)
    assert passes_checks(code, text), text
    for kwargs, message in ((dict(dq=4098), "dq must be 16-byte aligned"),
                            (dict(lse=0), "lse is a null pointer"),
                            (dict(dout=0), "dout is a null pointer"),
                            (dict(seqlen_q=2**30), r"seqlen_q \+ seqlen_k must be below 2\^30")):
        code, text = planned_run(args, **kwargs)
        assert code == _C.STATUS_INVALID_ARGUMENT and re.search(message, text), text
    assert args.fwd.q == 0 and args.dq == 0  # the plan is left as it was


def test_cpp_select_bwd_and_explain_bwd_read_no_pointers():
    args = cpp_bwd_args(q=0, k=0, v=0, o=0, lse=0, dout=0, dq=0, dk=0, dv=0,
                        hdim_q=UNSERVED_HDIM, hdim_v=UNSERVED_HDIM)
    code, text, info = _C.select_bwd(args)
    assert passes_checks(code, text) and info is None, text
    code, text, _ = _C.explain_bwd(args)
    assert code in (_C.STATUS_OK, _C.STATUS_CUDA_ERROR), text
    args.fwd.mask = 9
    assert _C.select_bwd(args)[0] == _C.STATUS_INVALID_ARGUMENT
    assert _C.explain_bwd(args)[0] == _C.STATUS_INVALID_ARGUMENT
    assert _C.bwd_workspace_size(args)[0] == _C.STATUS_INVALID_ARGUMENT


def test_cpp_reports_the_compiled_bwd_matrix():
    keys = {"name", "dtype", "hdim_q", "hdim_v", "mask", "bias", "mode", "dbias", "dropout",
            "softcap", "pipeline", "arch", "arch_cc", "arch_exact", "block_m", "block_n",
            "pad_seqlen", "pad_hdim", "origin"}
    instances = fmha.bwd_instances()
    assert len({i["name"] for i in instances}) == len(instances)
    for inst in instances:
        assert set(inst) == keys
        assert inst["arch"] in fmha.compiled_targets()
        assert inst["dtype"] in ("fp16", "bf16") and inst["mode"] in ("batch", "group")
        assert inst["mask"] in ("none", "causal", "window")
        assert inst["bias"] in ("none", "elementwise", "alibi")


def test_the_package_exports_the_backward():
    for name in ("bwd", "bwd_instances", "select_bwd", "explain_bwd"):
        assert name in fmha.__all__ and getattr(fmha, name).__doc__
    assert "out.sum().backward()" in fmha.__doc__


# ---- on a GPU: the eager, planned and autograd paths agree -------------------------------------
# The backward's numbers against the float64 reference are the GPU test modules'; these check
# only that every path into the kernels passes them the same problem. They skip without a GPU,
# or without a compiled backward instance for the problem.

GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


def gpu_problem(seed=0, **options):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, 200, h, 64, device="cuda", generator=gen).to(F16)
               for h in (4, 2, 2))
    try:
        fmha.select(q, k, v, return_lse=True, **options)  # the forward autograd runs
        fmha.select_bwd(q, k, v, **options)
    except fmha.MissingInstanceError as exc:
        pytest.skip(f"no instance for this problem in this build: {str(exc)[:80]}")
    dout = torch.randn(2, 200, 4, 64, device="cuda", generator=gen).to(F16)
    return q, k, v, dout


def autograd_grads(q, k, v, dout, **options):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(fmha.fwd(*leaves, **options), leaves, dout)


@GPU
@pytest.mark.parametrize("options", [dict(), dict(causal=True),
                                     dict(window_size=(32, 0), softcap=20.0)])
def test_gpu_fmha_bwd_gives_autograds_gradients_and_plans_once(options):
    q, k, v, dout = gpu_problem(**options)
    with torch.no_grad():
        out, lse = fmha.fwd(q, k, v, return_lse=True, **options)
    _bwd._BWD_PLANS.clear()
    eager = [fmha.bwd(dout, q, k, v, out, lse, deterministic=True, **options) for _ in range(2)]
    assert len(_bwd._BWD_PLANS) == 1, "a call of a known signature made a plan of its own"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        grads = autograd_grads(q, k, v, dout, **options)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b, c in zip(eager[0], eager[1], grads):
        assert torch.equal(a, b) and torch.equal(a, c)


@GPU
def test_gpu_autograd_differentiates_the_dropout_pattern_it_drew():
    options = dict(causal=True, dropout_p=0.2)
    q, k, v, dout = gpu_problem(**options)
    torch.manual_seed(11)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        grads = autograd_grads(q, k, v, dout, **options)  # draws its seed
    finally:
        torch.use_deterministic_algorithms(False)
    torch.manual_seed(11)
    seed = int(torch.randint(2**63 - 1, ()))
    out, lse = fmha.fwd(q, k, v, return_lse=True, dropout_seed=seed, **options)
    eager = fmha.bwd(dout, q, k, v, out, lse, dropout_seed=seed, deterministic=True, **options)
    assert all(torch.equal(a, b) for a, b in zip(eager, grads))


@GPU
def test_gpu_the_ops_backward_plans_serve_fresh_tensors():
    gpu_problem()  # skips without an instance
    _bwd._BWD_OP_PLANS.clear()
    for seed in (1, 2, 3):
        autograd_grads(*gpu_problem(seed=seed))
    assert len(_bwd._BWD_OP_PLANS) == 1


@GPU
def test_gpu_torch_compile_runs_forward_and_backward_as_eager_autograd():
    q, k, v, dout = gpu_problem(causal=True)

    def attention(q, k, v):
        return fmha.fwd(q, k, v, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        eager = autograd_grads(q, k, v, dout, causal=True)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        traced = torch.autograd.grad(compiled(*leaves), leaves, dout)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(eager, traced))
