"""Bad calls fail with a clear TypeError/ValueError before anything reaches a GPU.

These run without a GPU: the checks come before the device check (Python) and before any
CUDA call (C++), so CPU tensors and bare integers reach every one of them. Where a test needs
a call to get past the device check, it uses fake CUDA tensors (FakeTensorMode: shapes,
strides and devices without memory), which run the custom op's fake implementation, or it
switches the device check off and reads the FwdArgs the call would pass to C++.
"""

import math
import os
import re
import resource
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from fmha import _C, _api, _head_dims  # noqa: E402
from fmha._checks import check_alignment, check_options  # noqa: E402
from generator.schema import ARCH  # noqa: E402

CPU_ONLY = not torch.cuda.is_available()


def qkv(b=2, sq=16, sk=16, hq=4, hk=4, d=64, dv=64, dtype=torch.float16, device="cpu"):
    return (
        torch.randn(b, sq, hq, d, device=device).to(dtype),
        torch.randn(b, sk, hk, d, device=device).to(dtype),
        torch.randn(b, sk, hk, dv, device=device).to(dtype),
    )


def packed(total_q=40, total_k=48, hq=4, hk=4, d=64, dv=64, batch=2, dtype=torch.float16):
    """Group-mode (varlen) inputs on the CPU: q, k, v and the group-mode keyword arguments."""
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    return (
        torch.randn(total_q, hq, d).to(dtype),
        torch.randn(total_k, hk, d).to(dtype),
        torch.randn(total_k, hk, dv).to(dtype),
        dict(cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=20, max_seqlen_k=24),
    )


# ---- q, k, v -------------------------------------------------------------------------------


def test_non_tensor_is_a_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        fmha.fwd(q, [1, 2], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_unsupported_dtype(dtype):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(TypeError, match="float16 and torch.bfloat16"):
        fmha.fwd(q, k, v)


@pytest.mark.parametrize("name", ["k", "v"])
def test_mixed_dtypes(name):
    tensors = dict(zip("qkv", qkv()))
    tensors[name] = tensors[name].bfloat16()
    with pytest.raises(TypeError, match=f"{name} has dtype torch.bfloat16 but q has torch.float16"):
        fmha.fwd(**tensors)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_wrong_rank(name):
    tensors = dict(zip("qkv", qkv()))
    tensors[name] = tensors[name].flatten(2)
    with pytest.raises(ValueError, match=rf"{name} must be 4-D .* got shape \(2, 16, 256\)"):
        fmha.fwd(**tensors)


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


@pytest.mark.parametrize("name", ["q", "k"])
def test_last_dim_not_contiguous(name):
    tensors = dict(zip("qkv", qkv()))
    tensors[name] = torch.randn(2, 16, 4, 128, dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match=rf"{name}'s last \(head\) dimension must be contiguous"):
        fmha.fwd(**tensors)


@pytest.mark.parametrize("d,dv", [(0, 64), (64, 0), (260, 260), (36, 300)])
def test_head_dims_must_be_positive_and_past_256_multiples_of_8(d, dv):
    q, k, v = qkv(d=d, dv=dv)
    with pytest.raises(ValueError, match=f"head dims must be positive, and multiples of 8 past "
                                         f"256 .* got {d} for q and k and {dv} for v"):
        fmha.fwd(q, k, v)


@pytest.mark.parametrize("d,dv", [(36, 36), (64, 12), (100, 256)])
def test_head_dims_that_are_not_multiples_of_8_run_padded(monkeypatch, no_device_check, d, dv):
    """fmha.fwd runs them on copies zero-padded to multiples of 8 (fmha._head_dims), with the
    softmax scale of the call's own head dim, and cuts out back to v's head dim."""
    calls = []

    def padded_call(q, k, v, causal, softmax_scale, **options):
        calls.append((q, k, v, softmax_scale, options))
        out = torch.ones(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        return (out, torch.zeros(2, 4, 16)) if options["return_lse"] else out

    fwd = _api.fwd
    monkeypatch.setattr(_api, "fwd", padded_call)  # the call fwd makes on the padded tensors
    q, k, v = qkv(d=d, dv=dv)
    out, lse = fwd(q, k, v, causal=True, return_lse=True)
    (pq, pk, pv, scale, options), = calls
    for given, padded in ((q, pq), (k, pk), (v, pv)):
        width = given.shape[-1]
        assert padded.shape == (*given.shape[:-1], (width + 7) // 8 * 8)
        assert torch.equal(padded[..., :width], given) and not padded[..., width:].any()
    assert scale == d ** -0.5 and options["return_lse"]
    assert out.shape == (*q.shape[:-1], dv) and lse.shape == (2, 4, 16)


def test_a_column_major_v_is_padded_into_a_row_major_copy(monkeypatch, no_device_check):
    """The copy of a V^T view (its sequence dim contiguous) is row-major: a column-major copy
    would have V's head-dim stride of seqlen_k (229 here), no multiple of 8, which fwd's own
    checks refuse."""
    padded = []
    fwd = _api.fwd
    monkeypatch.setattr(_api, "fwd", lambda q, k, v, *args, **options: padded.append(v) or q)
    q, k, _ = qkv(sk=229, d=32)
    v = torch.randn(2, 4, 50, 229, dtype=q.dtype).permute(0, 3, 1, 2)  # (b, sk, hk, dv) of V^T
    fwd(q, k, v)
    assert padded[0].shape == (2, 229, 4, 56) and padded[0].is_contiguous()
    assert torch.equal(padded[0][..., :50], v) and not padded[0][..., 50:].any()


@pytest.mark.parametrize("change,message", [
    # k's heads expanded (stride 0) past v's: a copy of k would take 2 GiB.
    (dict(k=torch.zeros(1, 1, 1, 36, dtype=torch.float16).expand(2, 16, 2**20, 36)),
     "k has 1048576 heads but v has 4"),
    (dict(v=torch.zeros(2, 8, 4, 36, dtype=torch.float16)), "k has seqlen 16 but v has 8"),
    (dict(), "q is on cpu; fmha.fwd needs CUDA tensors"),  # a valid call
])
def test_a_padded_call_is_checked_before_anything_is_copied(monkeypatch, change, message):
    def copy(x):
        raise AssertionError("copied before the checks")

    monkeypatch.setattr(_head_dims, "pad", copy)
    with pytest.raises(ValueError, match=re.escape(message)):
        fmha.fwd(**{**dict(zip("qkv", qkv(d=36, dv=36))), **change})


@pytest.mark.parametrize(
    "name,make",
    [
        # (b, s, h, d) cut out of a wider head dim: the head stride 68 is no multiple of 8.
        ("q", lambda: torch.randn(2, 16, 4, 68, dtype=torch.float16)[..., :64]),
        ("k", lambda: torch.empty(20000, dtype=torch.float16).as_strided(
            (2, 16, 4, 64), (8320, 260, 64, 1))),  # the sequence stride 260
        # V^T (b, h, dv, s) cut out of longer rows: V's head-dim stride 20.
        ("v", lambda: torch.randn(2, 4, 64, 20, dtype=torch.float16)[..., :16].permute(0, 3, 1, 2)),
    ],
)
def test_strides_must_be_multiples_of_8(name, make):
    tensors = dict(zip("qkv", qkv()))
    tensors[name] = make()
    with pytest.raises(ValueError, match=rf"{name} has strides .* every one but its contiguous "
                                         rf"dimension's must be a multiple of 8 elements"):
        fmha.fwd(**tensors)


def test_sizes_must_fit_an_int():
    q, k, v = (torch.empty(1, s, 1, 8, dtype=torch.float16, device="meta")
               for s in (2**31, 16, 16))
    with pytest.raises(ValueError, match=r"q has shape \(1, 2147483648, 1, 8\); every size must "
                                         r"be below 2\*\*31"):
        fmha.fwd(q, k, v)


def test_transposed_bhsd_views_pass_the_checks():
    b, h, s, d = 2, 4, 16, 64
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    with pytest.raises(ValueError, match="needs CUDA tensors"):  # only the device is wrong
        fmha.fwd(q, k, v)


def test_v_with_its_sequence_contiguous_passes_the_checks():
    q, k, _ = qkv()
    vt = torch.randn(2, 4, 64, 16, dtype=q.dtype)  # (b, hk, dv, sk): V^T stored
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fmha.fwd(q, k, vt.permute(0, 3, 1, 2))


def test_v_with_neither_dim_contiguous():
    q, k, _ = qkv()
    v = torch.randn(2, 32, 4, 128, dtype=q.dtype)[:, ::2, :, ::2]
    with pytest.raises(ValueError, match="v must have its head dimension .* or its sequence"):
        fmha.fwd(q, k, v)


def test_cpu_tensors_are_not_cuda():
    with pytest.raises(ValueError, match="q is on cpu; fmha.fwd needs CUDA tensors"):
        fmha.fwd(*qkv())


def test_meta_tensors_are_not_cuda():
    q, k, v = qkv(device="meta")
    with pytest.raises(ValueError, match="q is on meta"):
        fmha.fwd(q, k, v)


# ---- group mode (varlen) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,error,message",
    [
        (dict(cu_seqlens_k=None), ValueError,
         "needs both cu_seqlens_q and cu_seqlens_k, got only cu_seqlens_q"),
        (dict(max_seqlen_q=None), ValueError, "group mode needs max_seqlen_q"),
        (dict(max_seqlen_k=7.0), TypeError, "max_seqlen_k must be an int, got float"),
        (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int, got bool"),
        (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be non-negative, got -1"),
        (dict(cu_seqlens_q=[0, 20, 40]), TypeError,
         "cu_seqlens_q must be a torch.Tensor, got list"),
        (dict(cu_seqlens_k=torch.zeros(3, dtype=torch.int64)), TypeError,
         "cu_seqlens_k has dtype torch.int64; it must be torch.int32"),
        (dict(cu_seqlens_q=torch.zeros(3, 1, dtype=torch.int32)), ValueError,
         r"cu_seqlens_q must be 1-D with batch \+ 1 entries, got shape \(3, 1\)"),
        (dict(cu_seqlens_q=torch.zeros(0, dtype=torch.int32)), ValueError,
         r"cu_seqlens_q must be 1-D with batch \+ 1 entries, got shape \(0,\)"),
        (dict(cu_seqlens_k=torch.zeros(4, dtype=torch.int32)), ValueError,
         "cu_seqlens_q has 3 entries but cu_seqlens_k has 4"),
        # The kernels read entry b at offset b.
        (dict(cu_seqlens_k=torch.zeros(6, dtype=torch.int32)[::2]), ValueError,
         "cu_seqlens_k must be contiguous, got stride 2"),
    ],
)
def test_group_mode_arguments(change, error, message):
    q, k, v, group = packed()
    with pytest.raises(error, match=message):
        fmha.fwd(q, k, v, **{**group, **change})


def test_max_seqlen_without_cu_seqlens():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="max_seqlen_q is for group mode"):
        fmha.fwd(q, k, v, max_seqlen_q=16)


def test_group_mode_needs_3d_tensors():
    q, k, v = qkv()
    _, _, _, group = packed()
    with pytest.raises(ValueError, match=r"in group mode q must be 3-D \(total_tokens, nheads"):
        fmha.fwd(q, k, v, **group)


def test_non_monotonic_cu_seqlens_are_the_callers_contract():
    """The entries live on the GPU: reading them would synchronize with the stream, so their
    order is not checked (fmha.fwd's docstring says so)."""
    q, k, v, group = packed()
    group.update(cu_seqlens_q=torch.tensor([0, 30, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="q is on cpu"):  # every check passes
        fmha.fwd(q, k, v, **group)
    assert "not checked: they live on" in " ".join(fmha.fwd.__doc__.split())


def test_group_mode_token_counts_of_k_and_v():
    q, k, v, group = packed()
    with pytest.raises(ValueError, match="k has 48 tokens but v has 47"):
        fmha.fwd(q, k, v[:47], **group)


def test_group_mode_cu_seqlens_device_is_checked_last():
    q, k, v, group = packed()
    with pytest.raises(ValueError, match="q is on cpu"):
        fmha.fwd(q, k, v, **group)
    with FakeTensorMode():
        q, k, v = (torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in (q, k, v))
        with pytest.raises(ValueError, match="cu_seqlens_q is on cpu but q is on cuda:0"):
            fmha.fwd(q, k, v, **group)


# ---- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(causal=1), TypeError, "causal must be a bool, got int"),
        (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float or None, got str"),
        (dict(softmax_scale=0.0), ValueError, "softmax_scale must be finite and positive, got 0.0"),
        (dict(softmax_scale=float("nan")), ValueError, "finite and positive"),
        (dict(instance=3), TypeError, "instance must be a str or None, got int"),
        (dict(window_size=4), TypeError, r"window_size must be a \(left, right\) pair of ints"),
        (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a"),
        (dict(window_size=(1.0, 2)), TypeError, "window_size must be a"),
        (dict(window_size=(-2, 0)), ValueError,
         r"entries must be -1 \(unbounded\) or non-negative"),
        (dict(window_size=(0, -5)), ValueError, "entries must be -1"),
        (dict(window_size=(2**31, 0)), ValueError,
         r"window_size entries must be below 2\*\*31 .* got \(2147483648, 0\); -1 is an "
         r"unbounded side"),
        (dict(causal=True, window_size=(16, 4)), ValueError,
         "causal=True sees no key to the right, so window_size's right must be 0 or -1"),
        (dict(mask_align=0), TypeError, "mask_align must be a str, got int"),
        (dict(mask_align="bottom-right"), ValueError, "mask_align must be 'top_left'"),
        (dict(softcap="30"), TypeError, "softcap must be a float, got str"),
        (dict(softcap=-1.0), ValueError, "softcap must be finite and non-negative"),
        (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
        (dict(dropout_p=None), TypeError, "dropout_p must be a float, got NoneType"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
        (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p=float("nan")), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_seed=1.5), TypeError, "dropout_seed must be an int or None, got float"),
        (dict(dropout_seed=-1), ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
        (dict(dropout_seed=2**64), ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
        (dict(dropout_offset=None), TypeError, "dropout_offset must be an int, got NoneType"),
        (dict(dropout_offset=2**32), ValueError, r"dropout_offset must be in \[0, 2\*\*32\)"),
        (dict(return_lse=1), TypeError, "return_lse must be a bool, got int"),
    ],
)
def test_bad_options(kwargs, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=message):
        fmha.fwd(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(window_size=(128, 0), mask_align="bottom_right"), dict(dropout_seed=2**64 - 1),
     dict(dropout_offset=2**32 - 1, dropout_p=0.5), dict(softcap=0), dict(softmax_scale=1)],
)
def test_good_options_reach_the_device_check(kwargs):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fmha.fwd(q, k, v, **kwargs)


# (causal, window_size) -> (mask, window_left, window_right), FlashAttention's conventions.
@pytest.mark.parametrize(
    "causal,window,expected",
    [
        (False, (-1, -1), (_C.MASK_NONE, -1, -1)),
        (True, (-1, -1), (_C.MASK_CAUSAL, -1, -1)),
        (False, (-1, 0), (_C.MASK_WINDOW, -1, 0)),  # any size given makes a window
        (True, (-1, 0), (_C.MASK_WINDOW, -1, 0)),
        (True, (64, -1), (_C.MASK_WINDOW, 64, 0)),  # causal + window = window (left, 0)
        (True, (64, 0), (_C.MASK_WINDOW, 64, 0)),
        (False, (64, 8), (_C.MASK_WINDOW, 64, 8)),
        (False, (-1, 8), (_C.MASK_WINDOW, -1, 8)),
        (False, (0, 0), (_C.MASK_WINDOW, 0, 0)),
    ],
)
def test_causal_and_window_make_the_mask(causal, window, expected):
    o = check_options(causal, None, window, "bottom_right", 0.0, 0.0, None, 0, False, 64)
    assert (o.mask, o.window_left, o.window_right) == expected
    assert o.mask_align == _C.ALIGN_BOTTOM_RIGHT
    assert math.isclose(o.softmax_scale, 0.125)


# ---- bias, attn_mask, ALiBi, seqused ----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(bias=1.0), TypeError, "bias must be a torch.Tensor, got float"),
        (dict(bias=torch.zeros(16, 16)), TypeError,
         "bias has dtype torch.float32; it must be q's dtype torch.float16"),
        (dict(bias=torch.zeros(16, 15, dtype=torch.float16)), ValueError,
         r"bias of shape \(16, 15\) does not broadcast to \(batch, nheads, seqlen_q, seqlen_k\) "
         r"= \(2, 4, 16, 16\)"),
        (dict(bias=torch.zeros(3, 4, 16, 16, dtype=torch.float16)), ValueError,
         "does not broadcast"),
        (dict(bias=torch.zeros(1, 2, 4, 16, 16, dtype=torch.float16)), ValueError,
         "does not broadcast"),
        (dict(attn_mask=torch.zeros(16, 16, dtype=torch.int32)), TypeError,
         r"attn_mask has dtype torch.int32; it must be torch.bool .* or q's dtype"),
        (dict(attn_mask=torch.ones(2, 16, 16, dtype=torch.bool)), ValueError,
         r"attn_mask of shape \(2, 16, 16\) does not broadcast"),
        (dict(bias=torch.zeros(16, 16, dtype=torch.float16),
              attn_mask=torch.ones(16, 16, dtype=torch.bool)), ValueError,
         "pass bias or attn_mask, not both"),
        (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a torch.Tensor, got list"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError,
         "alibi_slopes has dtype torch.float16; it must be torch.float32"),
        (dict(alibi_slopes=torch.ones(2)), ValueError,
         r"alibi_slopes must be \(nheads,\) = \(4,\) or \(batch, nheads\) = \(2, 4\), "
         r"got shape \(2,\)"),
        (dict(alibi_slopes=torch.ones(3, 4)), ValueError, "alibi_slopes must be"),
        (dict(alibi_slopes=torch.ones(4), bias=torch.zeros(16, 16, dtype=torch.float16)),
         ValueError, "alibi_slopes cannot be combined with bias or attn_mask"),
        (dict(seqused_k=(16, 16)), TypeError, "seqused_k must be a torch.Tensor, got tuple"),
        (dict(seqused_q=torch.full((2,), 16)), TypeError,
         "seqused_q has dtype torch.int64; it must be torch.int32"),
        (dict(seqused_q=torch.full((3,), 16, dtype=torch.int32)), ValueError,
         r"seqused_q must be \(batch,\) = \(2,\), got shape \(3,\)"),
        (dict(seqused_k=torch.full((4,), 16, dtype=torch.int32)[::2]), ValueError,
         "seqused_k must be contiguous, got stride 2"),
    ],
)
def test_bad_bias_and_lengths(kwargs, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=message):
        fmha.fwd(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bias=torch.zeros(16, 16, dtype=torch.float16)),
        dict(bias=torch.zeros(4, 1, 16, dtype=torch.float16)),
        dict(bias=torch.zeros(2, 1, 16, 1, dtype=torch.float16)),
        dict(attn_mask=torch.ones(16, 16, dtype=torch.bool)),
        dict(attn_mask=torch.zeros(2, 4, 16, 16, dtype=torch.float16)),
        dict(alibi_slopes=torch.ones(4)),
        dict(alibi_slopes=torch.ones(2, 4)),
        dict(seqused_q=torch.full((2,), 8, dtype=torch.int32),
             seqused_k=torch.full((2,), 8, dtype=torch.int32)),
    ],
)
def test_good_bias_and_lengths_reach_the_device_check(kwargs):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q is on cpu"):
        fmha.fwd(q, k, v, **kwargs)


def test_group_mode_bias_broadcasts_to_the_longest_sequences():
    q, k, v, group = packed()
    bias = torch.zeros(1, 4, 20, 24, dtype=torch.float16)
    with pytest.raises(ValueError, match="q is on cpu"):
        fmha.fwd(q, k, v, bias=bias, **group)
    with pytest.raises(ValueError, match=r"\(batch, nheads, max_seqlen_q, max_seqlen_k\) = "
                                         r"\(2, 4, 20, 24\)"):
        fmha.fwd(q, k, v, bias=bias[..., :20, :20], **group)


# Without a GPU, fake CUDA tensors can sit on any device index, so a second GPU needs no second
# GPU. With one, FakeTensorMode initializes every device it meets, and a missing cuda:1 fails.
ANOTHER_GPU = pytest.param("cuda:1", marks=pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="fake tensors on cuda:1 need either no GPU or two"))


@pytest.mark.parametrize("device", ["cpu", ANOTHER_GPU])
@pytest.mark.parametrize(
    "name", ["k", "v", "bias", "attn_mask", "alibi_slopes", "seqused_q", "seqused_k"])
def test_every_tensor_is_device_checked(name, device):
    with FakeTensorMode():
        q, k, v = qkv(device="cuda")
        used = torch.full((2,), 8, dtype=torch.int32, device="cuda")
        kwargs = dict(k=k, v=v, bias=torch.zeros(16, 16, dtype=q.dtype, device="cuda"),
                      alibi_slopes=None, seqused_q=used, seqused_k=used)
        if name == "attn_mask":
            kwargs["bias"] = None
            kwargs["attn_mask"] = torch.ones(16, 16, dtype=torch.bool, device="cuda")
        if name == "alibi_slopes":
            kwargs["bias"] = None
            kwargs["alibi_slopes"] = torch.ones(4, device="cuda")
        kwargs[name] = kwargs[name].to(device)
        with pytest.raises(ValueError, match=f"{name} is on {device} but q is on cuda:0; all "
                                             f"tensors must be on one GPU"):
            fmha.fwd(q, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="fake tensors on cuda:1 need either no GPU or two")
@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_on_another_gpu(name):
    q, k, v, group = packed()
    with FakeTensorMode():
        q, k, v = (torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in (q, k, v))
        group = {**group, **{key: torch.zeros(3, dtype=torch.int32, device="cuda")
                             for key in ("cu_seqlens_q", "cu_seqlens_k")}}
        group[name] = torch.zeros(3, dtype=torch.int32, device="cuda:1")
        with pytest.raises(ValueError, match=f"{name} is on cuda:1 but q is on cuda:0"):
            fmha.fwd(q, k, v, **group)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_a_view_off_a_16_byte_boundary_is_rejected_before_the_launch(no_device_check, name):
    """torch.empty(n + 1)[1:].view(...): 2 bytes past the allocation's (aligned) start. The op's
    implementation checks it, before allocating the outputs."""
    tensors = dict(zip("qkv", qkv()))
    t = tensors[name]
    tensors[name] = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    with pytest.raises(ValueError, match=f"{name} starts 2 bytes past a 16-byte boundary; .* "
                                         f"pass {name}.clone()"):
        fmha.fwd(**tensors)


def test_views_on_16_byte_boundaries_and_empty_problems_pass_the_alignment_check():
    q, k, v = qkv()
    check_alignment(q=torch.empty(q.numel() + 8, dtype=q.dtype)[8:].view(q.shape), k=k, v=v)
    empty = torch.empty(1, dtype=q.dtype)[1:].view(0, 16, 4, 64)
    check_alignment(q=empty, k=torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape), v=v)


def test_fake_tensors_have_no_data_pointer_to_check():
    """Under torch.compile the checks see fake tensors; the alignment is checked at run time."""
    with FakeTensorMode():
        q, k, v = qkv(device="cuda")
        q = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda").as_strided(
            q.shape, q.stride(), 1)  # one element in
        assert fmha.fwd(q, k, v).shape == q.shape


@pytest.mark.parametrize("b,sq,sk", [(0, 16, 16), (2, 0, 16), (2, 16, 0), (0, 0, 0)])
def test_empty_problems_have_empty_or_zero_outputs(b, sq, sk):
    """The op's fake implementation: outputs of the documented shapes. The real one needs a GPU
    (tests/test_fwd_gpu.py runs an empty batch); its C++ side reads no pointer of an empty
    problem and returns before the launch (test_cpp_empty_problem_needs_no_pointers)."""
    with FakeTensorMode():
        q, k, v = qkv(b=b, sq=sq, sk=sk, device="cuda")
        out, lse = fmha.fwd(q, k, v, return_lse=True)
        assert out.shape == (b, sq, 4, 64) and lse.shape == (b, 4, sq)
        qg, kg, vg = (torch.empty(0, 4, 64, dtype=q.dtype, device="cuda") for _ in range(3))
        cu = torch.zeros(3, dtype=torch.int32, device="cuda")
        out = fmha.fwd(qg, kg, vg, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=0,
                       max_seqlen_k=0)
        assert out.shape == (0, 4, 64)


def test_status_codes_become_exceptions():
    _api._raise_for(_C.STATUS_OK, "")
    with pytest.raises(ValueError, match="bad") as caught:
        _api._raise_for(_C.STATUS_INVALID_ARGUMENT, "bad")
    assert type(caught.value) is ValueError
    # A head dim no compiled instance has is a miss, still a ValueError: on CPU the dispatcher
    # cannot be reached (it asks the device for its arch); tests/test_fwd_gpu.py makes one.
    with pytest.raises(fmha.MissingInstanceError, match="build one"):
        _api._raise_for(_C.STATUS_NO_INSTANCE, "no instance; build one")
    assert issubclass(fmha.MissingInstanceError, ValueError)
    with pytest.raises(RuntimeError, match="launch failed"):
        _api._raise_for(_C.STATUS_CUDA_ERROR, "launch failed")


# ---- what a valid call builds ----------------------------------------------------------------


def test_fake_call_returns_the_documented_shapes():
    with FakeTensorMode():
        q, k, v = qkv(b=2, sq=16, sk=24, hq=8, hk=2, d=64, dv=128, device="cuda")
        out = fmha.fwd(q, k, v, causal=True)
        assert out.shape == (2, 16, 8, 128) and out.dtype == q.dtype
        out, lse = fmha.fwd(q, k, v, return_lse=True, dropout_p=0.1, softcap=30.0)
        assert out.shape == (2, 16, 8, 128)
        assert lse.shape == (2, 8, 16) and lse.dtype == torch.float32
        qg, kg, vg = (torch.empty(n, h, d, dtype=q.dtype, device="cuda")
                      for n, h, d in ((40, 8, 64), (48, 2, 64), (48, 2, 128)))
        cu = torch.zeros(3, dtype=torch.int32, device="cuda")
        out, lse = fmha.fwd(qg, kg, vg, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=20,
                            max_seqlen_k=24, return_lse=True)
        assert out.shape == (40, 8, 128) and lse.shape == (8, 40)


def test_torch_compile_traces_the_op_fullgraph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attention(q, k, v, slopes):
        out, lse = fmha.fwd(q, k, v, causal=True, return_lse=True, dropout_p=0.1)
        return out + fmha.fwd(q, k, v, window_size=(8, 0), alibi_slopes=slopes), lse

    torch._dynamo.reset()
    with FakeTensorMode():
        q, k, v = qkv(device="cuda")
        out, lse = torch.compile(attention, backend=backend, fullgraph=True)(
            q, k, v, torch.ones(4, device="cuda"))
        assert out.shape == q.shape and lse.shape == (2, 4, 16)
    code = graphs[0].code
    assert code.count("torch.ops.fmha.fwd.default") == 2
    assert "torch.randint" in code  # the unseeded dropout draws its seed inside the graph


@pytest.fixture
def no_device_check(monkeypatch):
    """Lets CPU tensors through the device check, to read the FwdArgs a call would build."""
    monkeypatch.setattr(_api, "check_devices", lambda **tensors: None)


def build_args(q, k, v, lse=False, **kwargs) -> "_C.FwdArgs":
    options = {**_api._OPTION_DEFAULTS, **kwargs}
    ops = _api._prepare(q, k, v, options.pop("causal", False), options.pop("softmax_scale", None),
                        **options, materialize=True)
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
    lse_t = torch.empty(_api._plans.lse_shape(q, ops.cu_seqlens_q is not None)) if lse else None
    return _api._make_args(ops, out, lse_t), ops, out, lse_t


def test_args_of_a_batch_call(no_device_check):
    b, h, s, d = 2, 4, 16, 64
    q = torch.randn(b, h, s, d, dtype=torch.bfloat16).transpose(1, 2)  # (b, s, h, d) view
    k, v = torch.randn(b, s, 2, d, dtype=q.dtype), torch.randn(b, s, 2, 128, dtype=q.dtype)
    a, _, out, lse = build_args(q, k, v, lse=True, causal=True, mask_align="bottom_right")
    assert (a.dtype, a.mode, a.mask, a.mask_align) == (
        _C.DTYPE_BF16, _C.MODE_BATCH, _C.MASK_CAUSAL, _C.ALIGN_BOTTOM_RIGHT)
    assert (a.batch, a.seqlen_q, a.seqlen_k, a.nhead_q, a.nhead_k, a.hdim_q, a.hdim_v) == (
        2, 16, 16, 4, 2, 64, 128)
    assert (a.q_batch_stride, a.q_seq_stride, a.q_head_stride) == (h * s * d, d, s * d)
    assert (a.v_batch_stride, a.v_seq_stride, a.v_head_stride, a.v_dim_stride) == (
        s * 2 * 128, 2 * 128, 128, 1)
    assert a.vlayout == _C.VLAYOUT_ROW_MAJOR
    assert (a.o, a.o_batch_stride, a.o_seq_stride, a.o_head_stride) == (
        out.data_ptr(), 16 * 4 * 128, 4 * 128, 128)
    assert (a.lse, a.lse_batch_stride, a.lse_head_stride) == (lse.data_ptr(), 4 * 16, 16)
    assert (a.q, a.k, a.v) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert a.softmax_scale == pytest.approx(0.125)
    assert a.traits() == dict(dtype=_C.DTYPE_BF16, hdim_q=64, hdim_v=128, mask=_C.MASK_CAUSAL,
                              bias=_C.BIAS_NONE, vlayout=_C.VLAYOUT_ROW_MAJOR,
                              mode=_C.MODE_BATCH, lse=True, dropout=False, softcap=False)


def test_size_one_dimensions_pass_as_stride_zero(no_device_check):
    # A size-1 dimension is never stepped over: its stride, odd here, is not the kernels' business.
    q = torch.randn(1, 16, 2, 64, dtype=torch.float16).as_strided((1, 16, 2, 64), (3, 128, 64, 1))
    k = torch.randn(1, 1, 2, 64, dtype=q.dtype).as_strided((1, 1, 2, 64), (5, 7, 64, 1))
    v = torch.randn(1, 1, 2, 64, dtype=q.dtype)
    a, _, _, _ = build_args(q, k, v)
    assert (a.q_batch_stride, a.q_seq_stride, a.q_head_stride) == (0, 128, 64)
    assert (a.k_batch_stride, a.k_seq_stride, a.k_head_stride) == (0, 0, 64)
    assert (a.v_batch_stride, a.v_seq_stride, a.v_dim_stride) == (0, 0, 1)


def test_args_of_a_group_call(no_device_check):
    q, k, v, group = packed(total_q=40, total_k=16)  # max_seqlen_k 24 > 16 tokens
    a, ops, out, lse = build_args(q, k, v, lse=True, **group)
    assert (a.mode, a.batch, a.seqlen_q, a.seqlen_k) == (_C.MODE_GROUP, 2, 20, 16)
    assert (a.total_q, a.total_k) == (40, 16)
    assert (a.cu_seqlens_q, a.cu_seqlens_k) == (
        group["cu_seqlens_q"].data_ptr(), group["cu_seqlens_k"].data_ptr())
    assert (a.q_batch_stride, a.q_seq_stride, a.q_head_stride) == (0, 4 * 64, 64)
    assert (a.o_batch_stride, a.o_seq_stride, a.o_head_stride) == (0, 4 * 64, 64)
    assert lse.shape == (4, 40) and (a.lse_batch_stride, a.lse_head_stride) == (0, 40)


def test_args_of_a_column_major_v(no_device_check):
    q, k, _ = qkv()
    vt = torch.randn(2, 4, 64, 16, dtype=q.dtype)  # (b, hk, dv, sk)
    a, *_ = build_args(q, k, vt.permute(0, 3, 1, 2))
    assert a.vlayout == _C.VLAYOUT_COL_MAJOR
    assert (a.v_batch_stride, a.v_seq_stride, a.v_head_stride, a.v_dim_stride) == (
        4 * 64 * 16, 1, 64 * 16, 16)


def test_args_of_a_broadcast_bias_without_copies(no_device_check):
    q, k, v = qkv(sq=16, sk=24)
    bias = torch.randn(4, 1, 24, dtype=q.dtype)  # (h, 1, sk): every query row alike
    a, ops, *_ = build_args(q, k, v, bias=bias)
    assert a.bias == _C.BIAS_ELEMENTWISE and a.bias_ptr == bias.data_ptr()
    assert (a.bias_batch_stride, a.bias_head_stride, a.bias_seq_stride) == (0, 24, 0)
    assert ops.bias.shape == (2, 4, 16, 24)


def test_args_of_a_bias_broadcast_along_keys_copy_one_row(no_device_check):
    q, k, v = qkv(sq=16, sk=24)
    bias = torch.randn(16, 1, dtype=q.dtype)  # one value per query row
    a, ops, *_ = build_args(q, k, v, bias=bias)
    assert ops.bias.stride() == (0, 0, 24, 1)
    assert torch.equal(ops.bias[1, 2], bias.expand(16, 24))


def test_args_of_a_boolean_attn_mask(no_device_check):
    q, k, v = qkv()
    mask = torch.rand(16, 16) > 0.5
    a, ops, *_ = build_args(q, k, v, attn_mask=mask)
    assert ops.bias.dtype == q.dtype and a.bias == _C.BIAS_ELEMENTWISE
    expected = torch.zeros(16, 16, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    assert torch.equal(ops.bias[0, 0], expected)


@pytest.mark.parametrize("shape,batch_stride", [((4,), 0), ((2, 4), 4)])
def test_args_of_alibi(no_device_check, shape, batch_stride):
    q, k, v = qkv()
    slopes = torch.rand(shape)
    a, *_ = build_args(q, k, v, alibi_slopes=slopes, window_size=(4, 4))
    assert (a.bias, a.alibi_slopes, a.alibi_batch_stride) == (
        _C.BIAS_ALIBI, slopes.data_ptr(), batch_stride)
    assert (a.mask, a.window_left, a.window_right) == (_C.MASK_WINDOW, 4, 4)


def test_args_of_dropout_and_softcap(no_device_check):
    q, k, v = qkv()
    a, *_ = build_args(q, k, v, dropout_p=0.25, dropout_seed=2**64 - 1, dropout_offset=7,
                       softcap=30.0)
    assert (a.dropout_p, a.dropout_seed, a.dropout_offset, a.softcap) == (0.25, 2**64 - 1, 7, 30.0)
    assert a.traits()["dropout"] and a.traits()["softcap"]
    torch.manual_seed(0)
    first = build_args(q, k, v, dropout_p=0.25)[0].dropout_seed
    torch.manual_seed(0)
    assert build_args(q, k, v, dropout_p=0.25)[0].dropout_seed == first  # manual_seed repeats it


def test_args_of_seqused(no_device_check):
    q, k, v = qkv()
    used = torch.full((2,), 8, dtype=torch.int32)
    a, *_ = build_args(q, k, v, seqused_q=used, seqused_k=used)
    assert a.seqused_q == a.seqused_k == used.data_ptr()


# ---- select, explain, dropout_mask -----------------------------------------------------------


@pytest.mark.parametrize("api", [fmha.select, fmha.explain])
def test_select_and_explain_check_like_fwd(api):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window_size entries must be -1"):
        api(q, k, v, window_size=(-3, 0))
    with pytest.raises(TypeError, match="bias has dtype torch.float32"):
        api(q, k, v, bias=torch.zeros(16, 16))
    with pytest.raises(ValueError, match="q is on cpu"):
        api(q, k, v, causal=True, return_lse=True, dropout_p=0.1)
    name = api.__name__
    with pytest.raises(TypeError, match=f"fmha.{name}: unexpected keyword argument 'instance'"):
        api(q, k, v, instance="x")
    with pytest.raises(TypeError, match=f"fmha.{name}: unexpected keyword argument 'casual'"):
        api(q, k, v, casual=True)


@pytest.mark.parametrize("api", [fmha.select, fmha.explain])
def test_select_and_explain_describe_the_padded_call(api):
    """A head dim that fwd runs zero-padded (fmha._head_dims) is described as fwd runs it: on
    row-major copies of the padded head dims, whatever the given layouts; nothing is copied."""
    q, k, _ = qkv(d=60)
    v = torch.randn(2, 4, 12, 16, dtype=q.dtype).permute(0, 3, 1, 2)  # V^T: (b, sk, hk, 12)
    a = _api._described(api.__name__, q, k, v, True, None, {}, cc=80)
    assert (a.hdim_q, a.hdim_v, a.vlayout) == (64, 16, _C.VLAYOUT_ROW_MAJOR)
    assert (a.q_seq_stride, a.k_head_stride, a.v_seq_stride, a.v_dim_stride) == (
        4 * 64, 64, 4 * 16, 1)
    assert a.softmax_scale == pytest.approx(60 ** -0.5)  # the call's own head dim's
    try:  # the answer for a GPU of that capability, or the miss that says what it asked for
        api(q, k, v, causal=True, capability=(8, 0))
    except fmha.MissingInstanceError as miss:
        assert "hdim_q=64 hdim_v=16" in str(miss)


@pytest.mark.parametrize(
    "args,error,message",
    [
        ((1.5, 0, 0.1, 1, 1, 1, 1), TypeError, "seed must be an int, got float"),
        ((2**64, 0, 0.1, 1, 1, 1, 1), ValueError, r"seed must be in \[0, 2\*\*64\)"),
        ((0, -1, 0.1, 1, 1, 1, 1), ValueError, r"offset must be in \[0, 2\*\*32\)"),
        ((0, 0, "0.1", 1, 1, 1, 1), TypeError, "dropout_p must be a float, got str"),
        ((0, 0, 1.0, 1, 1, 1, 1), ValueError, r"dropout_p must be in \[0, 1\)"),
        ((0, 0, 0.1, -1, 1, 1, 1), ValueError, r"batch must be in \[0, 2\*\*31\), got -1"),
        ((0, 0, 0.1, 1, 1, 1, 2.0), TypeError, "seqlen_k must be an int, got float"),
    ],
)
def test_dropout_mask_arguments(args, error, message):
    with pytest.raises(error, match=message):
        fmha.dropout_mask(*args)


def test_dropout_mask_needs_a_cuda_device():
    with pytest.raises(ValueError, match="device must be a CUDA device, got cpu"):
        fmha.dropout_mask(0, 0, 0.1, 1, 1, 4, 4, device="cpu")


@pytest.mark.parametrize(
    "device,error,message",
    [
        (1.5, TypeError, "device must be a torch.device, a str, an int or None, got float"),
        (True, TypeError, "got bool"),
        ("xyz", ValueError, "device must be a CUDA device, got 'xyz'"),
        ("cuda:-1", ValueError, "device must be a CUDA device, got 'cuda:-1'"),
        (torch.device("meta"), ValueError, "device must be a CUDA device, got meta"),
        (-1, ValueError, r"device must be a CUDA device of this machine, which has \d+ "
                         r"\(torch.cuda.device_count\(\)\), got -1"),
        (4096, ValueError, "of this machine, .* got 4096"),  # no GPU 0: torch.device's low byte
        ("cuda:128", ValueError, "of this machine, .* got 'cuda:128'"),  # cuda:-128 to torch
    ],
)
def test_dropout_mask_device_is_checked_before_anything_is_allocated(monkeypatch, device, error,
                                                                     message):
    monkeypatch.setattr(torch, "empty", None)  # nothing may be allocated
    with pytest.raises(error, match=message):
        fmha.dropout_mask(0, 0, 0.1, 1, 1, 4, 4, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the current device of a torch with CUDA")
def test_dropout_mask_default_device_on_a_torch_without_cuda():
    with pytest.raises(ValueError, match=r"must be a CUDA device of this machine, which has 0 "
                                         r".*, got None \(the current device\)"):
        fmha.dropout_mask(0, 0, 0.1, 1, 1, 4, 4)


@pytest.mark.parametrize("name", ["batch", "nhead", "seqlen_q", "seqlen_k"])
def test_dropout_mask_sizes_must_fit_an_int(monkeypatch, name):
    sizes = {**dict(batch=1, nhead=1, seqlen_q=1, seqlen_k=1), name: 2**31}
    monkeypatch.setattr(torch, "empty", None)  # nothing may be allocated
    with pytest.raises(ValueError, match=rf"{name} must be in \[0, 2\*\*31\), got 2147483648"):
        fmha.dropout_mask(0, 0, 0.1, **sizes, device="cuda:0")


# ---- the C++ checks, reached through the bindings with an FwdArgs of integers ----------------

# Head dims no instance has (not a multiple of 8), so that a call passing every check stops at
# the dispatcher (kNoInstance, or kCudaError without a GPU) and never launches.
UNSERVED_HDIM = 4


def cpp_args(**overrides) -> "_C.FwdArgs":
    """A valid batch-mode problem at fake, aligned addresses (nothing dereferences them)."""
    a = _C.FwdArgs()
    fields = dict(
        dtype=_C.DTYPE_FP16, mask=_C.MASK_NONE, q=4096, k=4096, v=4096, o=4096, batch=1,
        seqlen_q=16, seqlen_k=16, nhead_q=2, nhead_k=2, hdim_q=64, hdim_v=64,
        q_batch_stride=2048, q_seq_stride=128, q_head_stride=64,
        k_batch_stride=2048, k_seq_stride=128, k_head_stride=64,
        v_batch_stride=2048, v_seq_stride=128, v_head_stride=64,
        o_batch_stride=2048, o_seq_stride=128, o_head_stride=64, softmax_scale=0.125,
    )
    for name, value in {**fields, **overrides}.items():
        setattr(a, name, value)
    return a


def cpp_fwd(**overrides):
    return _C.fwd(cpp_args(**overrides), 0, None)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(q=4098), "q must be 16-byte aligned"),
        (dict(k=4104), "k must be 16-byte aligned"),
        (dict(v=4100), "v must be 16-byte aligned"),
        (dict(o=0), "o is a null pointer"),
        (dict(k_seq_stride=132), "k seq stride is 132; it must be a non-negative multiple of 8"),
        (dict(v_head_stride=-8), "v head stride is -8"),
        (dict(nhead_k=3), r"nhead_q \(2\) must be a positive multiple of nhead_k \(3\)"),
        (dict(softmax_scale=-1.0), "softmax_scale must be finite and positive"),
        (dict(hdim_v=0), "hdim_q and hdim_v must be positive"),
        (dict(batch=70000), "batch and nhead_q must be at most 65535"),
        (dict(nhead_q=70000, nhead_k=70000), "batch and nhead_q must be at most 65535"),
        (dict(hdim_q=65544), "hdim_q and hdim_v must be at most 65536"),
        (dict(seqlen_q=2**29, seqlen_k=2**29),
         r"seqlen_q \+ seqlen_k must be below 2\^30, got 536870912 \+ 536870912"),
        # One CTA per (query tile, head, sequence) in a 1-D grid: 65535^2 pairs are too many
        # whatever the tile.
        (dict(mask=_C.MASK_CAUSAL, batch=65535, nhead_q=65535, nhead_k=1),
         r"a causal call launches ceil\(seqlen_q / block_m\) \* batch \* nhead_q CTAs in a "
         r"1-D grid, at most 2\^31 - 1; with the largest compiled block_m of \d+ that is "
         r"ceil\(16 / \d+\) \* 65535 \* 65535 = 4294836225"),
        (dict(seqlen_k=-1), "must be non-negative"),
        (dict(dtype=3), "unknown dtype 3; valid: kFP16, kBF16, kE4M3"),
        (dict(mode=-1), "unknown mode -1"),
        (dict(mask=3), "unknown mask type 3"),
        (dict(mask_align=2), "unknown mask alignment 2"),
        (dict(bias=3), "unknown bias type 3"),
        (dict(vlayout=5), "unknown V layout 5"),
        (dict(mask=_C.MASK_WINDOW, window_left=-2),
         r"window_left and window_right must be -1 \(unbounded\) or non-negative, got \(-2, -1\)"),
        (dict(softcap=-1.0), "softcap must be finite and non-negative"),
        (dict(softcap=float("nan")), "softcap must be finite"),
        (dict(dropout_p=1.0), r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p=float("nan")), r"dropout_p must be in \[0, 1\)"),
        (dict(cu_seqlens_q=4096), "batch mode must not get them"),
        (dict(bias_ptr=4096), "bias_ptr is set but the bias type is not BiasType::kElementwise"),
        (dict(bias=_C.BIAS_ELEMENTWISE, bias_ptr=4096, alibi_slopes=4096),
         "alibi_slopes is set but the bias type is not BiasType::kAlibi"),
        (dict(mode=_C.MODE_GROUP), "cu_seqlens_q is a null pointer; Mode::kGroup needs"),
        (dict(mode=_C.MODE_GROUP, cu_seqlens_q=4096, cu_seqlens_k=4098),
         "cu_seqlens_k must be 4-byte aligned"),
        (dict(seqused_q=4097), "seqused_q must be 4-byte aligned"),
        (dict(total_q=16, total_k=16), "total_q/total_k are for Mode::kGroup"),
        (dict(mode=_C.MODE_GROUP, cu_seqlens_q=4096, cu_seqlens_k=4100),
         "Mode::kGroup needs total_q >= seqlen_q and total_k >= seqlen_k"),
        (dict(mode=_C.MODE_GROUP, cu_seqlens_q=4096, cu_seqlens_k=4100, total_q=16, total_k=8),
         r"got total_q=16, total_k=8"),
        (dict(bias=_C.BIAS_ELEMENTWISE), "BiasType::kElementwise needs bias_ptr"),
        (dict(bias=_C.BIAS_ELEMENTWISE, bias_ptr=4097), "bias_ptr must be aligned to its 2-byte"),
        (dict(bias=_C.BIAS_ELEMENTWISE, bias_ptr=4098, bias_seq_stride=-1),
         "bias_seq_stride is -1; it must be non-negative"),
        (dict(bias=_C.BIAS_ALIBI), "BiasType::kAlibi needs alibi_slopes"),
        (dict(bias=_C.BIAS_ALIBI, alibi_slopes=4098), "alibi_slopes must be 4-byte aligned"),
        (dict(bias=_C.BIAS_ALIBI, alibi_slopes=4096, alibi_batch_stride=-2),
         "alibi_batch_stride is -2"),
        (dict(lse=4098), "lse must be 4-byte aligned"),
        (dict(lse=4096, lse_head_stride=-16), "lse_head_stride is -16"),
        (dict(v_dim_stride=2), "v_dim_stride is 2; VLayout::kRowMajor needs 1"),
        (dict(vlayout=_C.VLAYOUT_COL_MAJOR), "v_seq_stride is 128; VLayout::kColMajor needs 1"),
        (dict(vlayout=_C.VLAYOUT_COL_MAJOR, v_seq_stride=1, v_dim_stride=12),
         "v_dim_stride is 12; VLayout::kColMajor needs a positive multiple of 8"),
        (dict(vlayout=_C.VLAYOUT_COL_MAJOR, v_seq_stride=1, v_dim_stride=16, v_head_stride=4),
         "v head stride is 4"),
    ],
)
def test_cpp_rejects_bad_arguments_before_any_cuda_call(overrides, message):
    code, text, chosen = cpp_fwd(**overrides)
    assert code == _C.STATUS_INVALID_ARGUMENT, text
    assert re.search(message, text), text
    assert chosen == ""


def passes_checks(code: int, text: str) -> bool:
    """Past every argument check: the dispatcher found nothing (UNSERVED_HDIM), or there is no
    GPU to ask."""
    return code in (_C.STATUS_NO_INSTANCE, _C.STATUS_CUDA_ERROR) and "fmha::fwd:" not in text


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        # The window sizes are read for MaskType::kWindow only.
        dict(mask=_C.MASK_CAUSAL, window_left=-7, window_right=-9),
        dict(mask=_C.MASK_WINDOW, mask_align=_C.ALIGN_BOTTOM_RIGHT, window_left=0,
             window_right=-1),
        # Group mode ignores batch strides.
        dict(mode=_C.MODE_GROUP, cu_seqlens_q=4096, cu_seqlens_k=4100, total_q=16, total_k=40,
             q_batch_stride=3, o_batch_stride=-1, lse=4096, lse_batch_stride=-5, lse_head_stride=64),
        dict(vlayout=_C.VLAYOUT_COL_MAJOR, v_seq_stride=1, v_dim_stride=16),
        dict(bias=_C.BIAS_ELEMENTWISE, bias_ptr=4098),  # 2-byte aligned is enough
        dict(bias=_C.BIAS_ALIBI, alibi_slopes=4100),
        dict(seqused_q=4100, seqused_k=4104, dropout_p=0.5, softcap=50.0),
        dict(seqlen_k=0, k=0, v=0),  # no keys: K and V are not read
        # Windows wider than the sequences are unbounded; the kernels clamp them.
        dict(mask=_C.MASK_WINDOW, window_left=2**31 - 1, window_right=2**31 - 1),
        dict(seqlen_q=2**30 - 17, seqlen_k=16),
        # Without a causal mask the grid is 3-D: (query tiles, heads, sequences).
        dict(batch=65535, nhead_q=65535, nhead_k=1),
        dict(mask=_C.MASK_CAUSAL, batch=65535, nhead_q=32768, nhead_k=1, seqlen_q=1),
    ],
)
def test_cpp_accepts_valid_arguments(overrides):
    code, text, _ = cpp_fwd(hdim_q=UNSERVED_HDIM, hdim_v=UNSERVED_HDIM, **overrides)
    assert passes_checks(code, text), text


@pytest.mark.parametrize("empty", [dict(batch=0), dict(seqlen_q=0), dict(nhead_q=0)])
def test_cpp_empty_problem_needs_no_pointers(empty):
    code, text, _ = cpp_fwd(q=0, k=0, v=0, o=0, hdim_q=UNSERVED_HDIM, hdim_v=UNSERVED_HDIM,
                            **empty)
    assert passes_checks(code, text), text


def test_cpp_select_checks_the_causal_grid_too():
    args = cpp_args(mask=_C.MASK_CAUSAL, batch=65535, nhead_q=65535, nhead_k=1)
    code, text, _ = _C.select(args)
    assert code == _C.STATUS_INVALID_ARGUMENT and "1-D grid" in text, text


def test_cpp_select_and_explain_read_no_pointers():
    args = cpp_args(q=0, k=0, v=0, o=0, hdim_q=UNSERVED_HDIM, hdim_v=UNSERVED_HDIM,
                    mode=_C.MODE_GROUP, bias=_C.BIAS_ALIBI)
    code, text, info = _C.select(args)
    assert passes_checks(code, text) and info is None, text
    code, text, explanation = _C.explain(args)
    if CPU_ONLY:
        assert code == _C.STATUS_CUDA_ERROR, text
    else:  # a miss is explained, not an error
        assert code == _C.STATUS_OK and "hdim_q=4" in explanation and "--filter" in explanation
    args.mask = 9
    assert _C.select(args)[0] == _C.STATUS_INVALID_ARGUMENT
    assert _C.explain(args)[0] == _C.STATUS_INVALID_ARGUMENT


def test_cpp_fwd_args_fields():
    a = _C.FwdArgs()
    assert (a.q, a.lse, a.v_dim_stride, a.window_left, a.window_right) == (0, 0, 1, -1, -1)
    assert a.traits() == dict(dtype=0, hdim_q=0, hdim_v=0, mask=0, bias=0, vlayout=0, mode=0,
                              lse=False, dropout=False, softcap=False)
    a.lse, a.dropout_p, a.softcap, a.mask = 2**40, 0.1, 1.0, _C.MASK_WINDOW
    assert a.lse == 2**40
    assert a.traits() == dict(dtype=0, hdim_q=0, hdim_v=0, mask=_C.MASK_WINDOW, bias=0,
                              vlayout=0, mode=0, lse=True, dropout=True, softcap=True)
    a.dropout_seed = 2**64 - 1
    assert a.dropout_seed == 2**64 - 1
    with pytest.raises(TypeError):
        a.dropout_offset = 2**32


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 0, 1.0, 1, 1, 4, 4, 4096, 0), r"dropout_p must be in \[0, 1\)"),
        ((0, 0, float("nan"), 1, 1, 4, 4, 4096, 0), r"dropout_p must be in \[0, 1\)"),
        ((0, 0, 0.1, 1, -1, 4, 4, 4096, 0), "must be non-negative"),
        ((0, 0, 0.1, 70000, 1, 4, 4, 4096, 0), "at most 65535"),
        ((0, 0, 0.1, 1, 1, 4, 4, 0, 0), "keep is a null pointer"),
    ],
)
def test_cpp_dropout_mask_checks(args, message):
    code, text = _C.dropout_mask(*args)
    assert code == _C.STATUS_INVALID_ARGUMENT and re.search(message, text), text


def test_cpp_empty_dropout_mask_launches_nothing():
    assert _C.dropout_mask(0, 0, 0.5, 2, 4, 0, 16, 0, 0) == (_C.STATUS_OK, "")


def test_cpp_reports_the_compiled_matrix():
    names = [i["name"] for i in fmha.instances()]
    assert names and len(names) == len(set(names))
    assert set(fmha.compiled_targets()) <= {"sm80", "sm90a"}
    keys = {"name", "dtype", "hdim_q", "hdim_v", "mask", "bias", "vlayout", "mode", "lse",
            "dropout", "softcap", "pipeline", "arch", "arch_cc", "arch_exact", "block_m",
            "block_n", "pad_seqlen", "pad_hdim", "origin"}
    for inst in fmha.instances():
        assert set(inst) == keys
        # Built in (origin None), or compiled on demand by an earlier call of this process
        # (FMHA_JIT=1) and loaded from the object it names.
        assert inst["origin"] is None or Path(inst["origin"]).is_file(), inst
        assert inst["arch"] in fmha.compiled_targets() or inst["origin"] is not None
        # The target's compute capability and whether it runs only there: the generator's
        # schema says it once, and the runtime must report the same.
        arch = ARCH.get(inst["arch"])
        assert (inst["arch_cc"], inst["arch_exact"]) == (arch.cc, arch.exact)
        assert inst["dtype"] in ("fp16", "bf16", "e4m3")
        assert inst["mask"] in ("none", "causal", "window")
        assert inst["bias"] in ("none", "elementwise", "alibi")
        assert inst["vlayout"] in ("row", "col") and inst["mode"] in ("batch", "group")


# ---- planned calls (fmha._plans) ------------------------------------------------------------


def _key(q, k, v, **options):
    """fmha._plans.call_key of fwd(q, k, v, **options)."""
    kw = {**_api._OPTION_DEFAULTS, "causal": False, "softmax_scale": None, "instance": None,
          **options}
    return _api._plans.call_key(
        q, k, v, kw["causal"], kw["softmax_scale"], kw["window_size"], kw["mask_align"],
        kw["bias"], kw["attn_mask"], kw["alibi_slopes"], kw["softcap"], kw["dropout_p"],
        kw["dropout_seed"], kw["dropout_offset"], kw["return_lse"], kw["cu_seqlens_q"],
        kw["cu_seqlens_k"], kw["max_seqlen_q"], kw["max_seqlen_k"], kw["seqused_q"],
        kw["seqused_k"], kw["instance"])


def test_only_plain_eager_cuda_calls_have_a_plan_key():
    """CPU tensors, fake tensors (torch.compile's, FakeTensorMode's) and traced calls take the
    op and its checks every time; tests/test_plans_gpu.py covers the calls that plan."""
    assert _key(*qkv()) is None
    with FakeTensorMode():
        q, k, v = qkv(device="cuda")
        assert _key(q, k, v) is None


def test_plan_table_drops_the_oldest_plan_first():
    table = _api._plans.PlanTable(limit=3)
    for key in "abcd":
        table.put(key, key.upper())
    assert len(table) == 3 and table.get("a") is None
    assert [table.get(key) for key in "bcd"] == ["B", "C", "D"]


# ---- the example programs --------------------------------------------------------------------

# Where fmha_fwd and fmha_bwd are: FMHA_EXAMPLES_DIR, else the build directory fmha was imported
# from (BUILD/python/fmha).
EXAMPLES_DIR = Path(os.environ.get("FMHA_EXAMPLES_DIR") or Path(fmha.__file__).parents[2])
# The programs' data segment (malloc) is capped, as tests/fuzz_surface.py caps it, so that a
# problem too large for the host fails to allocate instead of taking the machine's memory.
EXAMPLE_MEMORY_LIMIT = 8 << 30


@pytest.mark.parametrize("program", ["fmha_fwd", "fmha_bwd"])
@pytest.mark.parametrize(
    "argv,message",
    [
        (["-h=1000000"], "fmha::fwd: batch and nhead_q must be at most 65535"),
        (["-b=3", "-s=100", "-d=100000"], "fmha::fwd: hdim_q and hdim_v must be at most 65536"),
        # Within the library's limits, past the host's: Q alone has 3 * 100000 * 8 * 65536
        # elements, kept on the host for the reference too.
        (["-b=3", "-s=100000", "-d=65536", "-v=0"],
         "out of host memory for the problem's buffers; choose smaller sizes"),
        # Past the host's before the library sees the sizes: 8 GiB of per-sequence lengths.
        (["-b=2147483647"], "out of host memory for the problem's buffers"),
    ],
)
def test_examples_refuse_sizes_they_cannot_hold(program, argv, message):
    """Sizes the library refuses fail its checks before anything is allocated, and host buffers
    that cannot be allocated end the program with a message: exit status 1 either way, not a
    std::bad_alloc out of main (SIGABRT)."""
    path = EXAMPLES_DIR / program
    if not path.is_file():
        pytest.skip(f"{path} is not built (FMHA_EXAMPLES_DIR names the build directory)")

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_DATA, (EXAMPLE_MEMORY_LIMIT, EXAMPLE_MEMORY_LIMIT))

    done = subprocess.run([str(path), *argv], capture_output=True, text=True, timeout=60,
                          preexec_fn=cap_memory)
    assert done.returncode == 1 and message in done.stderr, (done.returncode, done.stderr)
