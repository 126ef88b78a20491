"""Bad calls fail with a clear TypeError/ValueError before anything reaches a GPU.

These run without a GPU: the checks come before the device check (Python) and before any
CUDA call (C++), so CPU tensors and bare integers reach every one of them.
"""

import re

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")
from fmha import _C  # noqa: E402


def qkv(b=2, sq=16, sk=16, hq=4, hk=4, d=64, dv=64, dtype=torch.float16, device="cpu"):
    return (
        torch.randn(b, sq, hq, d, device=device).to(dtype),
        torch.randn(b, sk, hk, d, device=device).to(dtype),
        torch.randn(b, sk, hk, dv, device=device).to(dtype),
    )


def test_non_tensor_is_a_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        fmha.fwd(q, [1, 2], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_unsupported_dtype(dtype):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(TypeError, match="float16 and torch.bfloat16"):
        fmha.fwd(q, k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="v has dtype torch.bfloat16 but q has torch.float16"):
        fmha.fwd(q, k, v.bfloat16())


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must be 4-D .* got shape \(2, 16, 256\)"):
        fmha.fwd(q.flatten(2), k, v)


@pytest.mark.parametrize(
    "shapes,message",
    [
        (dict(), None),
        (dict(k_batch=3), "batch sizes differ: q 2, k 3, v 2"),
        (dict(v_seq=17), "k has seqlen 16 but v has 17"),
        (dict(v_heads=2), "k has 4 heads but v has 2"),
        (dict(k_dim=128), "q has head dim 64 but k has 128"),
    ],
)
def test_mismatched_shapes(shapes, message):
    q, k, v = qkv()
    k = torch.randn(shapes.get("k_batch", 2), 16, 4, shapes.get("k_dim", 64), dtype=q.dtype)
    v = torch.randn(2, shapes.get("v_seq", 16), shapes.get("v_heads", 4), 64, dtype=q.dtype)
    if message is None:  # the valid shapes get as far as the device check
        message = "q is on cpu; fmha.fwd needs CUDA tensors"
    with pytest.raises(ValueError, match=message):
        fmha.fwd(q, k, v)


def test_heads_not_a_multiple_of_kv_heads():
    q, k, v = qkv(hq=6, hk=4)
    with pytest.raises(ValueError, match="q's 6 heads must be a multiple of k/v's 4 heads"):
        fmha.fwd(q, k, v)


def test_last_dim_not_contiguous():
    q, k, v = qkv()
    q_strided = torch.randn(2, 16, 4, 128, dtype=q.dtype)[..., ::2]
    with pytest.raises(ValueError, match="q's last \\(head\\) dimension must be contiguous"):
        fmha.fwd(q_strided, k, v)


def test_transposed_bhsd_views_pass_the_checks():
    b, h, s, d = 2, 4, 16, 64
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    with pytest.raises(ValueError, match="needs CUDA tensors"):  # only the device is wrong
        fmha.fwd(q, k, v)


def test_meta_tensors_are_not_cuda():
    q, k, v = qkv(device="meta")
    with pytest.raises(ValueError, match="q is on meta"):
        fmha.fwd(q, k, v)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(causal=1), TypeError, "causal must be a bool, got int"),
        (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float or None, got str"),
        (dict(softmax_scale=0.0), ValueError, "softmax_scale must be finite and positive, got 0.0"),
        (dict(softmax_scale=float("nan")), ValueError, "finite and positive"),
        (dict(instance=3), TypeError, "instance must be a str or None, got int"),
    ],
)
def test_bad_options(kwargs, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=message):
        fmha.fwd(q, k, v, **kwargs)


# The C++ checks, reached through the bindings with integers: they run before any CUDA call.
def cpp_fwd(**overrides):
    args = dict(
        dtype=_C.DTYPE_FP16, mask=_C.MASK_NONE, q=4096, k=4096, v=4096, o=4096, batch=1,
        seqlen_q=16, seqlen_k=16, nhead_q=2, nhead_k=2, hdim_q=64, hdim_v=64,
        q_strides=(2048, 128, 64), k_strides=(2048, 128, 64), v_strides=(2048, 128, 64),
        o_strides=(2048, 128, 64), softmax_scale=0.125, stream=0, instance=None,
    )
    args.update(overrides)
    return _C.fwd(*args.values())


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(q=4098), "q must be 16-byte aligned"),
        (dict(o=0), "o is a null pointer"),
        (dict(k_strides=(2048, 132, 64)), "k seq stride is 132; it must be a non-negative multiple of 8"),
        (dict(nhead_k=3), r"nhead_q \(2\) must be a positive multiple of nhead_k \(3\)"),
        (dict(softmax_scale=-1.0), "softmax_scale must be finite and positive"),
        (dict(hdim_v=0), "hdim_q and hdim_v must be positive"),
        (dict(batch=70000), "batch and nhead_q must be at most 65535"),
        (dict(seqlen_k=-1), "must be non-negative"),
    ],
)
def test_cpp_rejects_bad_arguments_before_any_cuda_call(overrides, message):
    code, text, _ = cpp_fwd(**overrides)
    assert code == _C.STATUS_INVALID_ARGUMENT
    assert re.search(message, text), text


def test_cpp_reports_the_compiled_matrix():
    names = [i["name"] for i in fmha.instances()]
    assert names and len(names) == len(set(names))
    assert set(fmha.compiled_targets()) <= {"sm80", "sm90a"}
    for inst in fmha.instances():
        assert inst["arch"] in fmha.compiled_targets()
        assert inst["dtype"] in ("fp16", "bf16") and inst["mask"] in ("none", "causal")
