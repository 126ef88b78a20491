"""Every compiled instance against a float64 reference, on the GPU.

The cases come from what the build compiled (fmha.instances()), so a build with another filter
tests exactly its own instances. Each instance is forced by name, so the sm80 instances run on
a Hopper GPU too. Pass rule (FlashAttention-3's and FlexAttention's): the error against the
float64 reference is at most twice the error of the same attention computed in the input
precision with PyTorch ops, plus a small absolute term.
"""

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")
from fmha._api import _launch  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CC = torch.cuda.get_device_capability()
DEVICE_CC = CC[0] * 10 + CC[1]


def runs_here(inst):
    return DEVICE_CC == 90 if inst["arch"] == "sm90a" else DEVICE_CC >= 80


INSTANCES = [i for i in fmha.instances() if runs_here(i)]

# (seqlen_q, seqlen_k): odd lengths, one-row problems, q != k both ways, past 4096.
PADDED_SHAPES = [(1, 1), (17, 17), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17), (4097, 1)]


def unpadded_shapes(inst):
    m, n = inst["block_m"], inst["block_n"]
    return [(m, n), (2 * m, 8 * n), (8 * m, 8 * n), (4 * m, n)]


def cases():
    for inst in INSTANCES:
        shapes = PADDED_SHAPES if inst["pad_seqlen"] else unpadded_shapes(inst)
        for sq, sk in shapes:
            yield pytest.param(inst, sq, sk, id=f"{inst['name']}-{sq}x{sk}")


def attention(q, k, v, causal, scale, dtype):
    """Reference on (b, s, h, d) tensors, every op in `dtype` (P rounded before P @ V)."""
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))  # (b, h, s, d)
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(dtype)
    return (p @ v).transpose(1, 2)


def random_qkv(b, sq, sk, hq, hk, d, dv, dtype, layout):
    """q, k, v as (b, s, h, d) views; 'bhsd' makes them transposes of (b, h, s, d) storage."""

    def make(s, h, dim):
        if layout == "bhsd":
            return torch.randn(b, h, s, dim, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(b, s, h, dim, device="cuda", dtype=dtype)

    return make(sq, hq, d), make(sk, hk, d), make(sk, hk, dv)


def check(inst, sq, sk, layout="bshd", hq=4, hk=2, b=2):
    dtype = DTYPES[inst["dtype"]]
    causal = inst["mask"] == "causal"
    d, dv = inst["hdim_q"], inst["hdim_v"]
    scale = 1.0 / math.sqrt(d)
    q, k, v = random_qkv(b, sq, sk, hq, hk, d, dv, dtype, layout)
    out = torch.full((b, sq, hq, dv), float("nan"), dtype=dtype, device="cuda")  # poison
    name = _launch(q, k, v, out, causal, scale, inst["name"])
    torch.cuda.synchronize()
    assert name == inst["name"]

    ref = attention(q, k, v, causal, scale, torch.float64)
    lowp = attention(q, k, v, causal, scale, dtype)
    assert not out.isnan().any(), "the kernel left output elements unwritten (NaN poison)"
    err = (out.double() - ref).abs().max().item()
    lowp_err = (lowp.double() - ref).abs().max().item()
    assert err <= 2 * lowp_err + 1e-4, f"max error {err:.3g} vs {lowp_err:.3g} in {dtype}"


@pytest.mark.gpu
@pytest.mark.parametrize("inst,sq,sk", list(cases()))
def test_instance_matches_float64(inst, sq, sk):
    check(inst, sq, sk)


@pytest.mark.gpu
@pytest.mark.parametrize("inst", [pytest.param(i, id=i["name"]) for i in INSTANCES])
def test_bhsd_strides_without_copies(inst):
    shape = (1000, 1000) if inst["pad_seqlen"] else (2 * inst["block_m"], 4 * inst["block_n"])
    check(inst, *shape, layout="bhsd", hq=4, hk=4)


@pytest.mark.gpu
def test_dispatcher_prefers_unpadded_and_this_arch():
    for inst in INSTANCES:
        dtype = DTYPES[inst["dtype"]]
        q, k, v = random_qkv(1, 1024, 1024, 2, 2, inst["hdim_q"], inst["hdim_v"], dtype, "bshd")
        chosen = fmha.select(q, k, v, causal=inst["mask"] == "causal")
        assert not chosen["pad_seqlen"], "1024 fits every tile: the unpadded instance wins"
        assert chosen["arch"] == ("sm90a" if DEVICE_CC == 90 and "sm90a" in fmha.compiled_targets() else "sm80")
        q, k, v = random_qkv(1, 1000, 1000, 2, 2, inst["hdim_q"], inst["hdim_v"], dtype, "bshd")
        assert fmha.select(q, k, v, causal=inst["mask"] == "causal")["pad_seqlen"]


@pytest.mark.gpu
def test_public_fwd_matches_reference_and_compiles():
    inst = INSTANCES[0]
    dtype = DTYPES[inst["dtype"]]
    causal = inst["mask"] == "causal"
    q, k, v = random_qkv(2, 333, 333, 4, 4, inst["hdim_q"], inst["hdim_v"], dtype, "bshd")
    out = fmha.fwd(q, k, v, causal=causal)
    ref = attention(q, k, v, causal, 1.0 / math.sqrt(inst["hdim_q"]), torch.float64)
    assert (out.double() - ref).abs().max().item() < 2e-2

    compiled = torch.compile(lambda a, b, c: fmha.fwd(a, b, c, causal=causal) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), out * 2)


@pytest.mark.gpu
def test_missing_head_dim_names_the_filter():
    q = torch.randn(1, 64, 2, 40, device="cuda", dtype=torch.float16)  # no hdim-40 instance
    with pytest.raises(fmha.MissingInstanceError, match=r"hdim_q=40.*--filter"):
        fmha.fwd(q, q, q)


@pytest.mark.gpu
def test_empty_batch_returns_empty_without_launch():
    inst = INSTANCES[0]
    dtype = DTYPES[inst["dtype"]]
    q = torch.randn(0, 16, 2, inst["hdim_q"], device="cuda", dtype=dtype)
    v = torch.randn(0, 16, 2, inst["hdim_v"], device="cuda", dtype=dtype)
    out = fmha.fwd(q, q, v, causal=inst["mask"] == "causal")
    assert out.shape == (0, 16, 2, inst["hdim_v"])
