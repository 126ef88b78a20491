"""fmha.fwd on float8 e4m3 inputs (FlashAttention-3's FP8 forward), without a GPU: the checks
of q, k, v and the descale factors (TypeError/ValueError before anything reaches a GPU, naming
the argument), the FwdArgs a call builds (dtype, v read in place, row-major or V^T, in batch
and group mode (V^T refused there), the descale strides of every broadcast shape), the bf16
output of the op's fake implementation (fp16 with out_dtype, and out_dtype's checks), the
refusals of the entry points without FP8 (backward, KV-cache queries, autograd), the FA3
compat layer, and the C++ API's checks through a driver built against a rendered table."""

import re

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from conftest import repository  # noqa: E402
from fmha import _C, _api  # noqa: E402
from fmha.compat import flash_attn_interface as fa3  # noqa: E402
from test_generator_render import (CUDA_LIB, fwd_stub, needs_cpp,  # noqa: E402
                                   run_runtime_driver)

E4M3 = torch.float8_e4m3fn


def qkv(b=2, sq=16, sk=16, hq=4, hk=2, d=128, dv=128, dtype=E4M3, device="cpu"):
    return (torch.randn(b, sq, hq, d, device=device).to(dtype),
            torch.randn(b, sk, hk, d, device=device).to(dtype),
            torch.randn(b, sk, hk, dv, device=device).to(dtype))


def fake_qkvt(b=2, sq=16, sk=16, hq=4, hk=2, d=128):
    """Fake CUDA q, k and a V^T view (keys contiguous), for FakeTensorMode."""
    return (torch.empty(b, sq, hq, d, dtype=E4M3, device="cuda"),
            torch.empty(b, sk, hk, d, dtype=E4M3, device="cuda"),
            torch.empty(b, hk, d, sk, dtype=E4M3, device="cuda").permute(0, 3, 1, 2))


def packed(total_q=40, total_k=48, hq=4, hk=2, d=128, batch=3):
    cu = torch.tensor([0, 10, 20, 40][:batch + 1], dtype=torch.int32)
    return (torch.randn(total_q, hq, d).to(E4M3), torch.randn(total_k, hk, d).to(E4M3),
            torch.randn(total_k, hk, d).to(E4M3),
            dict(cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=20, max_seqlen_k=20))


@pytest.fixture
def no_device_check(monkeypatch):
    """Lets CPU tensors through the device check, to read the FwdArgs a call would build."""
    monkeypatch.setattr(_api, "check_devices", lambda **tensors: None)


def build_args(q, k, v, **kwargs) -> "_C.FwdArgs":
    """The FwdArgs fwd builds for a call."""
    options = {**_api._OPTION_DEFAULTS, **kwargs}
    ops = _api._prepare(q, k, v, options.pop("causal", False),
                        options.pop("softmax_scale", None), **options, materialize=True,
                        fp8=True)
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=torch.bfloat16)
    return _api._make_args(ops, out, None), ops


# ---- q, k, v -------------------------------------------------------------------------------

@pytest.mark.parametrize("other", ["k", "v"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_mixed_dtypes_are_a_type_error(other, dtype):
    tensors = dict(zip("qkv", qkv()))
    tensors[other] = tensors[other].to(dtype)
    with pytest.raises(TypeError, match=f"fmha.fwd: {other} has dtype {dtype} but q has "
                                        f"torch.float8_e4m3fn; q, k and v must share one dtype"):
        fmha.fwd(**tensors)


def test_e5m2_is_no_input_dtype():
    with pytest.raises(TypeError, match=r"q has dtype torch.float8_e5m2; supported are "
                                        r"torch.float16 and torch.bfloat16, and "
                                        r"torch.float8_e4m3fn \(the forward's FP8 inputs\)"):
        fmha.fwd(*qkv(dtype=torch.float8_e5m2))


@pytest.mark.parametrize("d, dv", [(72, 72), (128, 120), (8, 8)])
def test_e4m3_head_dims_are_multiples_of_16_and_never_padded(d, dv):
    with pytest.raises(ValueError, match=rf"fmha.fwd: torch.float8_e4m3fn head dims must be "
                                         rf"positive multiples of 16 .* got {d} for q and k and "
                                         rf"{dv} for v"):
        fmha.fwd(*qkv(d=d, dv=dv))


def test_e4m3_strides_are_multiples_of_16_elements():
    q, k, v = qkv()
    wide = torch.randn(2, 16, 4, 136).to(E4M3)[..., :128]  # strides multiples of 8, not 16
    with pytest.raises(ValueError, match=r"fmha.fwd: q has strides \(8704, 544, 136, 1\); every "
                                         r"one but its contiguous dimension's must be a multiple "
                                         r"of 16 elements"):
        fmha.fwd(wide, k, v)
    # A V^T view whose rows of keys are 24 apart: given as V^T, it is read as it is.
    vt = torch.randn(2, 2, 128, 24).to(E4M3)[..., :16].permute(0, 3, 1, 2)
    with pytest.raises(ValueError, match=r"fmha.fwd: v has strides .*multiple of 16 elements"):
        fmha.fwd(q, k, vt)


def test_e4m3_inputs_that_require_grad_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"fmha.fwd: torch.float8_e4m3fn inputs have no backward "
                                         r".* pass them detached, or call under "
                                         r"torch.no_grad\(\)"):
        fmha.fwd(q, k, v.requires_grad_())
    with torch.no_grad():  # then the checks go on, to the device
        with pytest.raises(ValueError, match="q is on cpu"):
            fmha.fwd(q, k, v)


# ---- the descale factors -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_descales_of_16_bit_inputs_are_a_value_error(name):
    q, k, v = qkv(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"fmha.fwd: {name} is for torch.float8_e4m3fn inputs "
                                         rf"\(it dequantizes them\); q has dtype torch.bfloat16, "
                                         rf"whose calls take no descale factors"):
        fmha.fwd(q, k, v, **{name: torch.ones(2, 2)})


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
@pytest.mark.parametrize("value, error, message", [
    ([1.0], TypeError, "must be a torch.Tensor or None, got list"),
    (torch.ones(2, 2, dtype=torch.float16), TypeError, "must be torch.float32, got torch.float16"),
    (torch.ones(2, 4), ValueError, r"must have shape \(batch, nheads_k\) = \(2, 2\), "
                                   r"FlashAttention-3's, or one that broadcasts to it: \(\), "
                                   r"\(1,\), \(2,\), \(1, 1\), \(2, 1\) or \(1, 2\); got \(2, 4\)"),
    (torch.ones(3), ValueError, r"must have shape .*; got \(3,\)"),
    (torch.ones(1, 2, 2), ValueError, r"must have shape .*; got \(1, 2, 2\)"),
])
def test_bad_descales_name_the_argument(name, value, error, message):
    with pytest.raises(error, match=f"fmha.fwd: {name} {message}"):
        fmha.fwd(*qkv(), **{name: value})


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_descales_are_device_checked(name):
    with FakeTensorMode():
        q, k, v = fake_qkvt()
        with pytest.raises(ValueError, match=f"{name} is on cpu but q is on cuda:0; all tensors "
                                             f"must be on one GPU"):
            fmha.fwd(q, k, v, **{name: torch.ones(2, 2)})


@pytest.mark.parametrize("shape, strides", [
    ((), (0, 0)), ((1,), (0, 0)), ((2,), (0, 1)), ((1, 1), (0, 0)), ((2, 1), (1, 0)),
    ((1, 2), (0, 1)), ((2, 2), (2, 1))])
def test_descale_strides_broadcast_to_batch_and_kv_heads(no_device_check, shape, strides):
    q, k, v = qkv()
    scale = torch.ones(shape)
    a, _ = build_args(q, k, v, q_descale=scale, k_descale=scale, v_descale=scale)
    for name in ("q", "k", "v"):
        assert (getattr(a, f"{name}_descale_batch_stride"),
                getattr(a, f"{name}_descale_head_stride")) == strides
    # The pointers are the call's: a plan passes them with q's (FwdArgs.run).
    assert (a.q_descale, a.k_descale, a.v_descale) == (0, 0, 0)


def test_a_transposed_descale_view_keeps_its_strides(no_device_check):
    q, k, v = qkv()
    a, _ = build_args(q, k, v, v_descale=torch.ones(2, 2).t())
    assert (a.v_descale_batch_stride, a.v_descale_head_stride) == (1, 2)


# ---- out_dtype: bf16 or fp16 from one e4m3 instance ----------------------------------------

@pytest.mark.parametrize("out_dtype, o_dtype", [(None, None), (torch.bfloat16, None),
                                                (torch.float16, _C.DTYPE_FP16)])
def test_out_dtype_sets_o_dtype_of_the_fwd_args(no_device_check, out_dtype, o_dtype):
    """FwdArgs.o_dtype: unset for the default (bf16), DTYPE_FP16 when fp16 is asked."""
    a, ops = build_args(*qkv(), out_dtype=out_dtype)
    assert a.o_dtype == o_dtype
    assert ops.out_dtype == (torch.float16 if o_dtype is not None else None)
    assert a.traits() == build_args(*qkv())[0].traits()  # one instance serves both


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_out_dtype_is_theirs(no_device_check, dtype):
    a, ops = build_args(*qkv(dtype=dtype), out_dtype=dtype)
    assert (a.o_dtype, ops.out_dtype) == (None, None)
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    with pytest.raises(ValueError, match=rf"fmha.fwd: out_dtype of {dtype} inputs must be "
                                         rf"{dtype} \(None means it\): the output is q's dtype, "
                                         rf"and only torch.float8_e4m3fn inputs choose theirs; "
                                         rf"got {other}"):
        fmha.fwd(*qkv(dtype=dtype), out_dtype=other)


@pytest.mark.parametrize("value, error, message", [
    (torch.float32, ValueError, r"out_dtype of torch.float8_e4m3fn inputs must be torch.bfloat16 "
                                r"\(None means it\) or torch.float16, got torch.float32"),
    (E4M3, ValueError, r"out_dtype of torch.float8_e4m3fn inputs must be torch.bfloat16 "
                       r"\(None means it\) or torch.float16, got torch.float8_e4m3fn"),
    ("float16", TypeError, "out_dtype must be a torch.dtype or None, got str"),
])
def test_bad_out_dtypes_name_the_argument(value, error, message):
    with pytest.raises(error, match=f"fmha.fwd: {message}"):
        fmha.fwd(*qkv(), out_dtype=value)
    with pytest.raises(error, match=f"fmha.fwd: {message}"):  # select checks as fwd does
        fmha.select(*(t.to("meta") for t in qkv()), out_dtype=value, capability=(9, 0))


def test_the_op_returns_fp16_when_asked():
    """The fake implementation (torch.compile's view) follows out_dtype, in both modes."""
    with FakeTensorMode():
        q, k, v = fake_qkvt()
        scale = torch.empty(2, 2, device="cuda")
        out, lse = fmha.fwd(q, k, v, causal=True, return_lse=True, q_descale=scale,
                            out_dtype=torch.float16)
        assert (out.dtype, out.shape, lse.dtype) == (torch.float16, (2, 16, 4, 128),
                                                     torch.float32)
        assert fmha.fwd(q, k, v, out_dtype=torch.bfloat16).dtype == torch.bfloat16
        q, k, v, group = packed()
        q, k, v = (torch.empty(t.shape, dtype=E4M3, device="cuda") for t in (q, k, v))
        group = {**group, **{key: torch.zeros(4, dtype=torch.int32, device="cuda")
                             for key in ("cu_seqlens_q", "cu_seqlens_k")}}
        assert fmha.fwd(q, k, v, out_dtype=torch.float16, **group).dtype == torch.float16


def test_the_op_traces_out_dtype_under_torch_compile():
    """The op's schema takes out_dtype, and a compiled graph's fake run gives its dtype."""
    assert "ScalarType? out_dtype" in str(torch.ops.fmha.fwd.default._schema)
    with FakeTensorMode():
        q, k, v = fake_qkvt()
        out = torch.compile(lambda q, k, v: fmha.fwd(q, k, v, out_dtype=torch.float16),
                            fullgraph=True, backend="eager")(q, k, v)
        assert out.dtype == torch.float16


def test_select_bwd_takes_no_out_dtype():
    q, k, v = qkv(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fmha.select_bwd: unexpected keyword argument "
                                        "'out_dtype'"):
        fmha.select_bwd(q, k, v, out_dtype=torch.bfloat16, capability=(9, 0))


# ---- the FwdArgs of an e4m3 call: v row-major or V^T, read in place ------------------------

def test_a_row_major_v_is_read_as_it_is(no_device_check):
    """What models hold: no copy, the row-major layout (the kernel transposes V itself)."""
    s, hk, d = 20, 2, 128
    q, k, v = qkv(sk=s)
    a, ops = build_args(q, k, v, causal=True)
    assert a.dtype == _C.DTYPE_E4M3 == 2
    assert a.traits()["dtype"] == _C.DTYPE_E4M3
    assert ops.v is v
    assert (a.vlayout, a.traits()["vlayout"]) == (_C.VLAYOUT_ROW_MAJOR, _C.VLAYOUT_ROW_MAJOR)
    assert (a.v_seq_stride, a.v_dim_stride, a.v_head_stride, a.v_batch_stride) == (
        hk * d, 1, d, s * hk * d)
    assert (a.q_seq_stride, a.k_head_stride) == (4 * d, d)


def test_a_row_major_vs_strides_are_multiples_of_16_elements():
    """Read in place, a row-major v's strides are checked as q's and k's are."""
    q, k, _ = qkv()
    v = torch.randn(2, 16, 2, 136).to(E4M3)[..., :128]  # strides multiples of 8, not 16
    with pytest.raises(ValueError, match=r"fmha.fwd: v has strides \(4352, 272, 136, 1\); every "
                                         r"one but its contiguous dimension's must be a multiple "
                                         r"of 16 elements"):
        fmha.fwd(q, k, v)


def test_a_v_transposed_input_runs_as_it_is(no_device_check):
    q, k, _ = qkv()
    vt = torch.randn(2, 2, 128, 16).to(E4M3).permute(0, 3, 1, 2)  # (b, sk, hk, d), keys first
    a, ops = build_args(q, k, vt)
    assert ops.v is vt
    assert (a.vlayout, a.v_seq_stride, a.v_dim_stride) == (_C.VLAYOUT_COL_MAJOR, 1, 16)


def test_group_mode_gqa_and_descales_per_sequence(no_device_check):
    """Group mode reads a row-major v in place; the descales' rows are the sequences."""
    q, k, v, group = packed()
    scale = torch.ones(3, 2)
    a, ops = build_args(q, k, v, q_descale=scale, k_descale=scale[:, :1],
                        v_descale=scale.t().contiguous().t(), **group)
    assert (a.mode, a.batch, a.nhead_q, a.nhead_k) == (_C.MODE_GROUP, 3, 4, 2)
    assert ops.v is v
    assert (a.vlayout, a.v_seq_stride, a.v_dim_stride, a.v_head_stride, a.v_batch_stride) == (
        _C.VLAYOUT_ROW_MAJOR, 2 * 128, 1, 128, 0)
    assert (a.q_descale_batch_stride, a.q_descale_head_stride) == (2, 1)
    assert (a.k_descale_batch_stride, a.k_descale_head_stride) == (2, 0)
    assert (a.v_descale_batch_stride, a.v_descale_head_stride) == (1, 3)
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, nheads_k\) = "
                                         r"\(3, 2\)"):
        fmha.fwd(q, k, v, q_descale=torch.ones(2, 2), **group)


def packed_vt(total_k=48, hk=2, d=128):
    """A V^T view of a packed v: (total_k, hk, d) with the keys contiguous."""
    return torch.randn(hk, d, total_k).to(E4M3).permute(2, 0, 1)


def test_v_transposed_in_group_mode_is_refused_naming_why():
    q, k, _, group = packed()
    message = (r"fmha.fwd: in group mode \(varlen\) a torch.float8_e4m3fn v must have its head "
               r"dimension contiguous \(row-major, which the kernel transposes\), got a V\^T "
               r"view \(strides \(1, 6144, 48\)\): TMA copies V\^T tiles with the keys innermost "
               r"and cannot copy one of a packed sequence whose first key is not a multiple of "
               r"16; pass v.contiguous\(\), or call batch mode")
    with pytest.raises(ValueError, match=message):
        fmha.fwd(q, k, packed_vt(), **group)
    meta = {**group, **{key: group[key].to("meta") for key in ("cu_seqlens_q", "cu_seqlens_k")}}
    with pytest.raises(ValueError, match=message):  # select checks as fwd does
        fmha.select(q.to("meta"), k.to("meta"), packed_vt().to("meta"), capability=(9, 0),
                    **meta)
    with pytest.raises(ValueError, match=message):  # FlashAttention-3's varlen: through fmha.fwd
        fa3.flash_attn_varlen_func(q, k, packed_vt(), group["cu_seqlens_q"],
                                   group["cu_seqlens_k"], 20, 20)


def test_the_op_returns_bf16():
    """The op's fake implementation (torch.compile's view of the call): out in bfloat16, of q's
    shape with v's head dim, the log-sum-exp fp32."""
    with FakeTensorMode():
        q, k, v = fake_qkvt()
        scale = torch.empty(2, 2, device="cuda")
        out, lse = fmha.fwd(q, k, v, causal=True, return_lse=True, q_descale=scale,
                            k_descale=scale, v_descale=torch.empty((), device="cuda"))
        assert (out.dtype, out.shape, lse.dtype, lse.shape) == (
            torch.bfloat16, (2, 16, 4, 128), torch.float32, (2, 4, 16))
        q, k, v, group = packed()
        q, k, v = (torch.empty(t.shape, dtype=E4M3, device="cuda") for t in (q, k, v))
        group = {**group, **{key: torch.zeros(4, dtype=torch.int32, device="cuda")
                             for key in ("cu_seqlens_q", "cu_seqlens_k")}}
        assert fmha.fwd(q, k, v, **group).dtype == torch.bfloat16


def test_the_ops_schema_takes_the_descales_and_the_backwards_does_not():
    schema = str(torch.ops.fmha.fwd.default._schema)
    assert ("Tensor? q_descale, Tensor? k_descale, Tensor? v_descale, ScalarType? out_dtype, "
            "str? instance") in schema
    assert "descale" not in str(torch.ops.fmha.bwd.default._schema)


# ---- select and explain --------------------------------------------------------------------

TRAITS_NOTE = ("the e4m3 (FP8) forward has instances on fa3 (sm90a) only, for row-major V in "
               "batch and group mode and V^T (VLayout::kColMajor) in batch mode, and not every "
               "trait: python -m generator --preset all --filter e4m3 --list names them")


@pytest.mark.parametrize("api", [fmha.select, fmha.explain])
@pytest.mark.parametrize("vlayout", ["row", "col"])
def test_select_and_explain_describe_the_call_as_given(api, vlayout):
    q, k, v = (t.to("meta") for t in qkv())
    if vlayout == "col":
        v = torch.empty(2, 2, 128, 16, dtype=E4M3, device="meta").permute(0, 3, 1, 2)
    a = _api._described(api.__name__, q, k, v, True, None,
                        dict(q_descale=torch.ones(2, 2, device="meta")), cc=90)
    assert (a.dtype, a.vlayout, a.v_seq_stride, a.v_dim_stride) == (
        (_C.DTYPE_E4M3, _C.VLAYOUT_ROW_MAJOR, 2 * 128, 1) if vlayout == "row"
        else (_C.DTYPE_E4M3, _C.VLAYOUT_COL_MAJOR, 1, 16))
    assert a.q_descale != 0 and a.k_descale == 0  # marked given, never read
    assert (a.q_descale_batch_stride, a.q_descale_head_stride) == (2, 1)
    names = {i["name"] for i in fmha.instances()}
    spelled = "col_" if vlayout == "col" else ""
    if any(name.startswith(f"fwd_e4m3_d128_causal_{spelled}") and
           ("_col_" in name) == (vlayout == "col") for name in names):
        return  # a build with an instance that serves it (with or without the LSE) answers
    with pytest.raises(fmha.MissingInstanceError) as miss:
        fmha.select(q, k, v, causal=True, capability=(9, 0))
    message = str(miss.value)
    assert "dtype=e4m3 hdim_q=128 hdim_v=128 mask=causal" in message
    assert f"FMHA_FILTER='e4m3,hdim128,mask=causal,bias=none,vlayout={vlayout}," in message
    assert TRAITS_NOTE in message


def test_select_bwd_takes_no_descales():
    q, k, v = qkv(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fmha.select_bwd: unexpected keyword argument "
                                        "'q_descale'"):
        fmha.select_bwd(q, k, v, q_descale=torch.ones(2, 2), capability=(9, 0))


# ---- the entry points without FP8 ----------------------------------------------------------

def test_the_backward_refuses_e4m3():
    q, k, v = qkv()
    out, lse = torch.empty(2, 16, 4, 128, dtype=torch.bfloat16), torch.empty(2, 4, 16)
    for call in (lambda: fmha.bwd(out, q, k, v, out, lse),
                 lambda: fmha.select_bwd(q, k, v, capability=(9, 0))):
        with pytest.raises(TypeError, match=r"q has dtype torch.float8_e4m3fn, an input type of "
                                            r"the forward only \(fmha.fwd\): there is no FP8 "
                                            r"backward"):
            call()


def test_kv_cache_queries_are_16_bit():
    q = torch.randn(2, 1, 4, 128).to(E4M3)
    cache = torch.zeros(2, 64, 2, 128).to(E4M3)
    with pytest.raises(ValueError, match=r"fmha.fwd_kvcache: q must be float16 or bfloat16, got "
                                         r"torch.float8_e4m3fn; torch.float8_e4m3fn queries have "
                                         r"no KV-cache kernel"):
        fmha.fwd_kvcache(q, cache, cache, cache_seqlens=torch.zeros(2, dtype=torch.int32))


def test_the_ops_backward_refuses_e4m3():
    """A direct call of the op on e4m3 tensors that require grad (fmha.fwd refuses them before)
    fails in its backward, not silently."""
    from fmha._bwd import _fwd_backward

    class Ctx:
        saved_tensors = (torch.empty(0), torch.empty(0),
                         *(t for t in (*qkv(), None, None, None, None, None, None, None, None,
                                       None)))
        needs_input_grad = (True,) * 30
    ops = _api._Operands(*qkv(), None, None, None, None, None, None, 0, 0, 0.1, 0, 0, -1, -1,
                         0.0, 0.0, None, 0, True)
    Ctx.ops = ops
    from fmha._bwd import _TENSOR_OPERANDS
    Ctx.saved_tensors = (torch.empty(0), torch.empty(0),
                         *(getattr(ops, name) for name in _TENSOR_OPERANDS))
    with pytest.raises(RuntimeError, match="fmha::fwd has no backward for torch.float8_e4m3fn"):
        _fwd_backward(Ctx, torch.empty(0), None)


# ---- FlashAttention-3's API ----------------------------------------------------------------

def test_fa3_flash_attn_func_passes_the_descales_on():
    q, k, v = qkv()
    # Through fmha.fwd's checks: a bad descale is named, a good one reaches the device check.
    with pytest.raises(ValueError, match=r"fmha.fwd: k_descale must have shape"):
        fa3.flash_attn_func(q, k, v, k_descale=torch.ones(5))
    with pytest.raises(ValueError, match="fmha.fwd: q is on cpu"):
        fa3.flash_attn_func(q, k, v, q_descale=torch.ones(2, 2), k_descale=torch.ones(2, 2),
                            v_descale=torch.ones(2, 2), causal=True)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    with pytest.raises(ValueError, match="fmha.fwd: v_descale is for torch.float8_e4m3fn"):
        fa3.flash_attn_func(q16, k16, v16, v_descale=torch.ones(2, 2))
    with FakeTensorMode():
        q, k, v = fake_qkvt()
        scale = torch.empty(2, 2, device="cuda")
        out = fa3.flash_attn_func(q, k, v, q_descale=scale, k_descale=scale, v_descale=scale)
        assert out.dtype == torch.bfloat16 and out.shape == (2, 16, 4, 128)


def test_fa3_varlen_passes_the_descales_on():
    q, k, v, group = packed()
    with pytest.raises(ValueError, match=r"fmha.fwd: q_descale must have shape \(batch, "
                                         r"nheads_k\) = \(3, 2\)"):
        fa3.flash_attn_varlen_func(q, k, v, group["cu_seqlens_q"], group["cu_seqlens_k"], 20, 20,
                                   q_descale=torch.ones(4, 2))


def test_fa3_kvcache_refuses_descales_of_16_bit_queries():
    # FP8 calls (e4m3 q and caches) map onto fwd_kvcache's e4m3 cache:
    # tests/test_compat_flash_attn.py covers them.
    q = torch.randn(1, 1, 4, 128).to(torch.bfloat16)
    cache = torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_descale"):
        fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=1, q_descale=torch.ones(1))


# ---- the C++ API's checks ------------------------------------------------------------------

# fmha::fwd's, bwd's and fwd_kvcache's checks of e4m3 calls, and explain_selection() of two on
# an H100, against a rendered table of the e4m3 d128 instances with stub launchers: no GPU.
DRIVER = """\
#include <iostream>

#include "dispatcher.h"

namespace fmha::detail::instances {
%s
}  // namespace fmha::detail::instances

alignas(16) static char memory[1 << 16] = {};
static const float scale = 1.f;

fmha::FwdArgs call(fmha::DataType dtype = fmha::DataType::kE4M3) {
  fmha::FwdArgs a;
  a.dtype = dtype;
  a.batch = 2;
  a.seqlen_q = a.seqlen_k = 128;
  a.nhead_q = 4;
  a.nhead_k = 2;
  a.hdim_q = a.hdim_v = 128;
  a.q = a.k = a.v = a.o = memory;
  a.q_seq_stride = 4 * 128;
  a.q_head_stride = a.k_head_stride = a.o_head_stride = 128;
  a.k_seq_stride = 2 * 128;
  a.o_seq_stride = 4 * 128;
  a.vlayout = fmha::VLayout::kColMajor;
  a.v_seq_stride = 1;
  a.v_dim_stride = 128;
  a.v_head_stride = 128 * 128;
  a.softmax_scale = 0.125f;
  return a;
}

int main() {
  fmha::FwdArgs bf16 = call(fmha::DataType::kBF16);
  bf16.q_descale = &scale;
  std::cout << fmha::fwd(bf16, nullptr).message << "\\n----\\n";
  fmha::FwdArgs strides = call(fmha::DataType::kFP16);
  strides.v_descale_head_stride = 1;
  std::cout << fmha::fwd(strides, nullptr).message << "\\n----\\n";
  fmha::FwdArgs negative = call();
  negative.k_descale = &scale;
  negative.k_descale_batch_stride = -1;
  std::cout << fmha::fwd(negative, nullptr).message << "\\n----\\n";
  fmha::FwdArgs unaligned = call();
  unaligned.v_descale = reinterpret_cast<const float*>(memory + 2);
  std::cout << fmha::fwd(unaligned, nullptr).message << "\\n----\\n";
  fmha::FwdArgs q_stride = call();
  q_stride.q_head_stride = 136;  // a multiple of 8, not 16
  std::cout << fmha::fwd(q_stride, nullptr).message << "\\n----\\n";
  fmha::FwdArgs v_stride = call();
  v_stride.v_dim_stride = 136;
  std::cout << fmha::fwd(v_stride, nullptr).message << "\\n----\\n";
  fmha::FwdArgs o_stride = call();  // O is bf16: multiples of 8
  o_stride.o_head_stride = 136;
  o_stride.o_seq_stride = 4 * 136;
  std::cout << fmha::detail::explain_selection(o_stride, 90) << "----\\n";
  fmha::FwdArgs unknown = call();
  unknown.dtype = static_cast<fmha::DataType>(3);
  std::cout << fmha::fwd(unknown, nullptr).message << "\\n----\\n";
  fmha::BwdArgs backward;
  backward.fwd = call();
  std::cout << fmha::bwd(backward, nullptr).message << "\\n----\\n";
  fmha::KvcacheArgs cache;
  cache.dtype = fmha::DataType::kE4M3;
  std::cout << fmha::fwd_kvcache(cache, nullptr).message << "\\n----\\n";
  fmha::FwdArgs row = call();
  row.vlayout = fmha::VLayout::kRowMajor;
  row.v_seq_stride = 2 * 128;
  row.v_dim_stride = 1;
  row.v_head_stride = 128;
  std::cout << fmha::detail::explain_selection(row, 90) << "----\\n";
  fmha::FwdArgs d96 = call();
  d96.hdim_q = d96.hdim_v = 96;
  std::cout << fmha::detail::explain_selection(d96, 90) << "----\\n";
  fmha::FwdArgs group_vt = call();
  group_vt.mode = fmha::Mode::kGroup;
  group_vt.cu_seqlens_q = group_vt.cu_seqlens_k = reinterpret_cast<const int32_t*>(memory);
  group_vt.total_q = group_vt.total_k = 256;
  std::cout << fmha::fwd(group_vt, nullptr).message << "\\n----\\n";
  std::cout << fmha::detail::explain_selection(group_vt, 90) << "----\\n";
  fmha::FwdArgs group_row = row;
  group_row.mode = fmha::Mode::kGroup;
  group_row.cu_seqlens_q = group_row.cu_seqlens_k = reinterpret_cast<const int32_t*>(memory);
  group_row.total_q = group_row.total_k = 256;
  group_row.lse = reinterpret_cast<float*>(memory);
  group_row.lse_head_stride = 256;
  std::cout << fmha::detail::explain_selection(group_row, 90) << "----\\n";
  fmha::FwdArgs fp16_out = call();
  fp16_out.o_dtype = fmha::DataType::kFP16;
  std::cout << fmha::fwd(fp16_out, nullptr).message << "\\n----\\n";
  std::cout << fmha::detail::explain_selection(fp16_out, 90) << "----\\n";
  fmha::FwdArgs e4m3_out = call();
  e4m3_out.o_dtype = fmha::DataType::kE4M3;
  std::cout << fmha::fwd(e4m3_out, nullptr).message << "\\n----\\n";
  fmha::FwdArgs unknown_out = call();
  unknown_out.o_dtype = static_cast<fmha::DataType>(7);
  std::cout << fmha::fwd(unknown_out, nullptr).message << "\\n----\\n";
  fmha::FwdArgs bf16_fp16_out = call(fmha::DataType::kBF16);
  bf16_fp16_out.o_dtype = fmha::DataType::kFP16;
  std::cout << fmha::fwd(bf16_fp16_out, nullptr).message << "\\n----\\n";
  fmha::FwdArgs bf16_out = call(fmha::DataType::kBF16);
  bf16_out.o_dtype = fmha::DataType::kBF16;  // its own dtype: valid
  std::cout << fmha::fwd(bf16_out, nullptr).message;
}
"""


@needs_cpp
@pytest.mark.skipif(not (CUDA_LIB / "libcudart.so").exists(), reason="needs libcudart")
def test_cpp_checks_and_explains_e4m3_calls(tmp_path):
    selection = repository().select("all", "e4m3,hdim128,mode=batch,mask=none|causal")
    stdout = run_runtime_driver(tmp_path, "e4m3", DRIVER, selection, fwd_stub)
    (bf16, strides, negative, unaligned, q_stride, v_stride, o_stride, unknown, backward, cache,
     row, d96, group_vt, group_vt_explained, group_row, fp16_out, fp16_out_explained, e4m3_out,
     unknown_out, bf16_fp16_out, bf16_out) = stdout.split("----\n")
    assert bf16 == ("fmha::fwd: q_descale/k_descale/v_descale are for dtype kE4M3 (they "
                    "dequantize e4m3 inputs); a kBF16 call takes none\n")
    assert strides == ("fmha::fwd: v_descale_head_stride is 1; the descale strides are for "
                       "dtype kE4M3, and a kFP16 call must leave them 0\n")
    assert negative == "fmha::fwd: k_descale_batch_stride is -1; it must be non-negative\n"
    assert unaligned == "fmha::fwd: v_descale must be 4-byte aligned (fp32)\n"
    assert q_stride == ("fmha::fwd: q head stride is 136; it must be a non-negative multiple of "
                        "16 elements (rows move in 16-byte pieces)\n")
    assert v_stride == ("fmha::fwd: v_dim_stride is 136; VLayout::kColMajor needs a positive "
                        "multiple of 16 elements\n")
    assert "Runs fwd_e4m3_d128_col_fa3_sm90a_m128n128_pad (fa3, sm90a," in o_stride
    assert unknown == "fmha::fwd: unknown dtype 3; valid: kFP16, kBF16, kE4M3\n"
    assert backward == ("fmha::bwd: dtype kE4M3 (float8 e4m3) is an input type of the forward "
                        "only: there is no FP8 backward; differentiate a kFP16 or kBF16 forward\n")
    assert cache == ("fmha::fwd_kvcache: dtype is the queries' (q, k_new, v_new and o): kFP16 or "
                     "kBF16; DataType::kE4M3 is an input type of fmha::fwd only. An FP8 cache is "
                     "kv_dtype KvCacheDtype::kE4M3, with 16-bit queries\n")
    # Row-major V: the kernel transposes it (batch mode here, group mode below).
    assert "Runs fwd_e4m3_d128_fa3_sm90a_m128n128_pad (fa3, sm90a," in row
    # A head dim of no e4m3 instance: built exactly, never padded.
    assert "FMHA_FILTER='e4m3,hdim96,mask=none,bias=none,vlayout=col," in d96
    assert "hpad" not in d96.split("FMHA_FILTER=")[1].split("'")[1]
    assert f"; {TRAITS_NOTE}." in d96
    # V^T in group mode: refused before any launch (the copy would trap), and in explain too.
    why = ("dtype kE4M3 takes V^T (VLayout::kColMajor) in Mode::kBatch only: TMA copies V^T tiles "
           "with the keys innermost, and a packed sequence whose first key (cu_seqlens_k) is not "
           "a multiple of 16 cannot be copied; in Mode::kGroup pass V row-major "
           "(VLayout::kRowMajor), which the kernel transposes")
    assert group_vt == f"fmha::fwd: {why}\n"
    assert f"; {TRAITS_NOTE}." in group_vt_explained
    # The table holds batch-mode instances only: group mode with a row-major V is a miss of
    # its traits, whose filter builds the group instance.
    assert "no instance has these traits" in group_row
    assert "FMHA_FILTER='e4m3,hdim128,mask=none,bias=none,vlayout=row,mode=group," in group_row
    # O's dtype: fp16 of e4m3 inputs passes the checks of it (what may stop it here is the want
    # of a GPU) and runs the bf16 output's instance; a 16-bit call may name its own dtype; the
    # others are refused.
    assert "o_dtype" not in fp16_out, fp16_out
    assert "Runs fwd_e4m3_d128_col_fa3_sm90a_m128n128_pad (fa3, sm90a," in fp16_out_explained
    assert e4m3_out == ("fmha::fwd: o_dtype kE4M3 for dtype kE4M3: valid: kBF16 (unset means it) "
                        "or kFP16\n")
    assert unknown_out == ("fmha::fwd: o_dtype 7 for dtype kE4M3: valid: kBF16 (unset means it) "
                           "or kFP16\n")
    assert bf16_fp16_out == ("fmha::fwd: o_dtype kFP16 for dtype kBF16: valid: kBF16 (unset "
                             "means it); kBF16 or kFP16 are for dtype kE4M3 only\n")
    assert "o_dtype" not in bf16_out, bf16_out


# ---- compile on demand ---------------------------------------------------------------------

LEAN, WITH_LSE = ("fwd_e4m3_d128_causal_fa3_sm90a_m128n128_pad",
                  "fwd_e4m3_d128_causal_lse_fa3_sm90a_m128n128_pad")


@pytest.mark.parametrize("given, lse, names", [(dict(), False, [LEAN, WITH_LSE]),
                                               (dict(return_lse=True), True, [WITH_LSE])])
def test_an_e4m3_miss_compiles_its_fa3_instance(given, lse, names):
    """The recipe of a miss of an e4m3 call (v row-major, as models hold it) selects the fa3
    instances that serve it for sm90a (both, without the log-sum-exp), and none for sm80
    (nothing is compiled here)."""
    from fmha import jit
    q, k, v = (t.to("meta") for t in qkv())
    args = _api._described("select", q, k, v, True, None, given, cc=90)
    filter_text, target = _C.instance_recipe(args, 90)
    assert target == "sm90a"
    assert {"e4m3", "vlayout=row"} <= set(filter_text.split(","))
    assert ("lse=true" in filter_text.split(",")) == lse
    assert [i.name for i in jit._selection(filter_text, target).instances] == names
    filter_text, target = _C.instance_recipe(args, 80)
    assert target == "sm80"
    with pytest.raises(Exception, match="matches none"):
        jit._selection(filter_text, target)


# ---- the C++ checks through the bindings ---------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (dict(q_descale=4096), "fmha::fwd: q_descale/k_descale/v_descale are for dtype kE4M3 \\(they "
                           "dequantize e4m3 inputs\\); a kFP16 call takes none"),
    (dict(k_descale_batch_stride=1), "k_descale_batch_stride is 1; the descale strides are for "
                                     "dtype kE4M3"),
    (dict(dtype=_C.DTYPE_E4M3, k_descale=4098), "k_descale must be 4-byte aligned \\(fp32\\)"),
    (dict(dtype=_C.DTYPE_E4M3, v_descale=4096, v_descale_head_stride=-1),
     "v_descale_head_stride is -1; it must be non-negative"),
    (dict(dtype=_C.DTYPE_E4M3, k_seq_stride=136),
     "k seq stride is 136; it must be a non-negative multiple of 16 elements"),
    (dict(dtype=3), "unknown dtype 3; valid: kFP16, kBF16, kE4M3"),
    (dict(dtype=_C.DTYPE_E4M3, mode=_C.MODE_GROUP, vlayout=_C.VLAYOUT_COL_MAJOR),
     "dtype kE4M3 takes V\\^T \\(VLayout::kColMajor\\) in Mode::kBatch only: TMA copies"),
    (dict(dtype=_C.DTYPE_E4M3, o_dtype=_C.DTYPE_E4M3),
     "o_dtype kE4M3 for dtype kE4M3: valid: kBF16 \\(unset means it\\) or kFP16"),
    (dict(o_dtype=_C.DTYPE_BF16),
     "o_dtype kBF16 for dtype kFP16: valid: kFP16 \\(unset means it\\); kBF16 or kFP16 are "
     "for dtype kE4M3 only"),
])
def test_cpp_checks_of_e4m3_calls_through_the_bindings(overrides, message):
    from test_api_checks import cpp_fwd
    code, text, chosen = cpp_fwd(**overrides)
    assert code == _C.STATUS_INVALID_ARGUMENT, text
    assert re.search(message, text), text


def test_cpp_takes_a_well_formed_e4m3_call_to_the_dispatcher():
    from test_api_checks import cpp_fwd, passes_checks
    # Head dim 32, which no e4m3 instance has: on a GPU machine whose build holds e4m3 d64
    # instances the call would otherwise launch one at these fake addresses.
    scale = dict(q_descale=4096, k_descale=4100, v_descale=4104, q_descale_batch_stride=2,
                 q_descale_head_stride=1, hdim_q=32, hdim_v=32)
    # O (bf16) keeps strides of 8 elements; e4m3's are multiples of 16 here.
    assert passes_checks(*cpp_fwd(dtype=_C.DTYPE_E4M3, o_head_stride=72, o_seq_stride=144,
                                  o_batch_stride=16 * 144, **scale)[:2])
    # O in fp16 (FwdArgs.o_dtype), or bf16 named: the same checks and instance as unset.
    for o_dtype in (_C.DTYPE_FP16, _C.DTYPE_BF16):
        assert passes_checks(*cpp_fwd(dtype=_C.DTYPE_E4M3, o_dtype=o_dtype, **scale)[:2])
    # A 16-bit call may name its own dtype.
    assert passes_checks(*cpp_fwd(o_dtype=_C.DTYPE_FP16)[:2])
    assert _C.FwdArgs().o_dtype is None
