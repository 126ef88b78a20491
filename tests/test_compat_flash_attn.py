"""fmha.compat.flash_attn and fmha.compat.flash_attn_interface without a GPU.

What is checked here: the functions' signatures and defaults against FlashAttention's
documented ones (the tables below, written from FlashAttention-2's and -3's docstrings), every
name FlashAttention-2's own test suite imports, the arguments refused before anything runs,
bert_padding and the rotary embedding (plain torch, on the CPU), and how each function maps its
arguments onto fmha: with fmha.fwd, fmha.bwd, fmha.fwd_kvcache and fmha.dropout_mask swapped for
tests/reference.py's float64 attention, the results are compared with attention written here
from FlashAttention's definitions (bottom-right causal and windows, ALiBi, soft-capping, the
dropout pattern in S_dmask). The kernels themselves: tests/test_compat_flash_attn_gpu.py, and
FlashAttention-2's suite run against this package (../shared/peer-tests).
"""

import inspect
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")

import fmha.compat.flash_attn as fa2  # noqa: E402
import fmha.compat.flash_attn_interface as fa3  # noqa: E402
from fmha.compat.flash_attn import bert_padding, flash_attn_interface  # noqa: E402
from fmha.compat.flash_attn.layers.rotary import apply_rotary_emb  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference as R  # noqa: E402

EMPTY = inspect.Parameter.empty

# ---- the documented signatures ---------------------------------------------------------------

# FlashAttention-2 (flash_attn/flash_attn_interface.py): (name, default) in order.
_FA2_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
                ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                ("deterministic", False), ("return_attn_probs", False)]
FA2_SIGNATURES = {
    "flash_attn_func": [("q", EMPTY), ("k", EMPTY), ("v", EMPTY)] + _FA2_OPTIONS,
    "flash_attn_qkvpacked_func": [("qkv", EMPTY)] + _FA2_OPTIONS,
    "flash_attn_kvpacked_func": [("q", EMPTY), ("kv", EMPTY)] + _FA2_OPTIONS,
    "flash_attn_varlen_func": [
        ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("cu_seqlens_q", EMPTY),
        ("cu_seqlens_k", EMPTY), ("max_seqlen_q", EMPTY), ("max_seqlen_k", EMPTY)]
        + _FA2_OPTIONS + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", EMPTY), ("cu_seqlens", EMPTY),
                                         ("max_seqlen", EMPTY)] + _FA2_OPTIONS,
    "flash_attn_varlen_kvpacked_func": [
        ("q", EMPTY), ("kv", EMPTY), ("cu_seqlens_q", EMPTY), ("cu_seqlens_k", EMPTY),
        ("max_seqlen_q", EMPTY), ("max_seqlen_k", EMPTY)] + _FA2_OPTIONS,
    "flash_attn_with_kvcache": [
        ("q", EMPTY), ("k_cache", EMPTY), ("v_cache", EMPTY), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
        ("num_splits", 0), ("return_softmax_lse", False)],
}

# FlashAttention-3 (hopper/flash_attn_interface.py).
_FA3_ATTENTION = [("softmax_scale", None), ("causal", False), ("qv", None), ("q_descale", None),
                  ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
                  ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1),
                  ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0),
                  ("return_attn_probs", False)]
FA3_SIGNATURES = {
    "flash_attn_func": [("q", EMPTY), ("k", EMPTY), ("v", EMPTY)] + _FA3_ATTENTION,
    "flash_attn_varlen_func": [
        ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("cu_seqlens_q", EMPTY),
        ("cu_seqlens_k", EMPTY), ("max_seqlen_q", EMPTY), ("max_seqlen_k", EMPTY),
        ("seqused_q", None), ("seqused_k", None)] + _FA3_ATTENTION,
    "flash_attn_combine": [("out_partial", EMPTY), ("lse_partial", EMPTY), ("out", None),
                           ("out_dtype", None)],
    "flash_attn_with_kvcache": [
        ("q", EMPTY), ("k_cache", EMPTY), ("v_cache", EMPTY), ("k", None), ("v", None),
        ("qv", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("page_table", None),
        ("cu_seqlens_q", None), ("cu_seqlens_k_new", None), ("max_seqlen_q", None),
        ("rotary_seqlens", None), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
        ("rotary_interleaved", True), ("scheduler_metadata", None), ("num_splits", 0),
        ("pack_gqa", None), ("sm_margin", 0), ("return_softmax_lse", False)],
}

OTHER_SIGNATURES = [
    (bert_padding.unpad_input, [("hidden_states", EMPTY), ("attention_mask", EMPTY),
                                ("unused_mask", None)]),
    (bert_padding.pad_input, [("hidden_states", EMPTY), ("indices", EMPTY), ("batch", EMPTY),
                              ("seqlen", EMPTY)]),
    (apply_rotary_emb, [("x", EMPTY), ("cos", EMPTY), ("sin", EMPTY), ("interleaved", False),
                        ("inplace", False), ("seqlen_offsets", 0), ("cu_seqlens", None),
                        ("max_seqlen", None)]),
    (flash_attn_interface._get_block_size_n, [("device", EMPTY), ("head_dim", EMPTY),
                                             ("is_dropout", EMPTY), ("is_causal", EMPTY)]),
]


def parameters(function) -> list:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", sorted(FA2_SIGNATURES))
def test_flash_attn_2_signatures_are_the_documented_ones(name):
    assert parameters(getattr(fa2, name)) == FA2_SIGNATURES[name]
    assert getattr(flash_attn_interface, name) is getattr(fa2, name)


@pytest.mark.parametrize("name", sorted(FA3_SIGNATURES))
def test_flash_attn_3_signatures_are_the_documented_ones(name):
    assert parameters(getattr(fa3, name)) == FA3_SIGNATURES[name]


@pytest.mark.parametrize("function,expected", OTHER_SIGNATURES,
                         ids=lambda x: getattr(x, "__name__", ""))
def test_helper_signatures_are_the_documented_ones(function, expected):
    assert parameters(function) == expected


def test_every_name_the_peer_suite_imports_exists():
    import importlib
    imports = {
        "fmha.compat.flash_attn": list(FA2_SIGNATURES),
        "fmha.compat.flash_attn.bert_padding": ["pad_input", "unpad_input"],
        "fmha.compat.flash_attn.flash_attn_interface": ["_get_block_size_n", "USE_TRITON_ROCM"],
        "fmha.compat.flash_attn.layers.rotary": ["apply_rotary_emb"],
        "fmha.compat.flash_attn_interface": list(FA3_SIGNATURES),
    }
    for module, names in imports.items():
        loaded = importlib.import_module(module)
        for name in names:
            assert hasattr(loaded, name), f"{module}.{name}"
    assert flash_attn_interface.USE_TRITON_ROCM is False


def test_block_size_n_spans_every_key():
    # S_dmask's rows are scaled by their largest logit over all keys: one block of keys.
    assert flash_attn_interface._get_block_size_n("cuda", 128, True, False) >= 2**30


# ---- arguments refused before anything runs ----------------------------------------------------


def cpu(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("call,error,words", [
    (lambda: fa2.flash_attn_qkvpacked_func(cpu(2, 8, 2, 4, 16)), ValueError, "qkv"),
    (lambda: fa2.flash_attn_kvpacked_func(cpu(2, 8, 4, 16), cpu(2, 8, 3, 4, 16)), ValueError,
     "kv"),
    (lambda: fa2.flash_attn_varlen_qkvpacked_func(cpu(8, 3, 4), None, 8), ValueError, "qkv"),
    (lambda: fa2.flash_attn_func("q", cpu(1, 8, 4, 16), cpu(1, 8, 4, 16)), TypeError, "q"),
    (lambda: fa2.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3, window_size=3), TypeError,
     "window_size"),
    (lambda: fa2.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3, window_size=(1.5, 0)), TypeError,
     "window_size"),
    (lambda: fa2.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3, softcap="50"), TypeError, "softcap"),
    (lambda: fa2.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3, dropout_p="0.1"), TypeError,
     "dropout_p"),
    (lambda: fa2.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3, deterministic=1), TypeError,
     "deterministic"),
    (lambda: fa2.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3, return_attn_probs=None), TypeError,
     "return_attn_probs"),
    (lambda: fa2.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3, causal=1), TypeError, "causal"),
    (lambda: fa2.flash_attn_varlen_func(
        cpu(8, 4, 16), cpu(2, 256, 4, 16), cpu(2, 256, 4, 16), torch.tensor([0, 8]),
        torch.tensor([0, 8], dtype=torch.int32), 8, 8,
        block_table=torch.zeros(1, 1)), ValueError, "block_table"),
    (lambda: fa2.flash_attn_with_kvcache(cpu(1, 1, 4, 16), cpu(1, 8, 4, 16), cpu(1, 8, 4, 16),
                                         cpu(1, 1, 4, 16), cpu(1, 1, 4, 16)), ValueError,
     "cache_seqlens"),
    (lambda: fa2.flash_attn_with_kvcache(cpu(1, 1, 4, 16), cpu(8, 4, 16), cpu(8, 4, 16),
                                         cache_seqlens=1), ValueError, "k_cache"),
    (lambda: fa3.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3, qv=cpu(1, 8, 4, 16)),
     NotImplementedError, "qv"),
    (lambda: fa3.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3, attention_chunk=64),
     NotImplementedError, "attention_chunk"),
    # FP8's descales go on to fmha.fwd, which refuses them with 16-bit inputs.
    (lambda: fa3.flash_attn_varlen_func(*[cpu(8, 4, 16)] * 3,
                                        *[torch.tensor([0, 8], dtype=torch.int32)] * 2, 8, 8,
                                        k_descale=torch.ones(1)),
     ValueError, "k_descale is for torch.float8_e4m3fn"),
    (lambda: fa3.flash_attn_with_kvcache(cpu(1, 1, 4, 16), cpu(1, 8, 4, 16), cpu(1, 8, 4, 16),
                                         cache_seqlens=1,
                                         cu_seqlens_q=torch.zeros(2, dtype=torch.int32)),
     NotImplementedError, "cu_seqlens_q"),
    (lambda: fa3.flash_attn_combine(torch.zeros(2, 1, 4, 4, 8), torch.zeros(2, 1, 4, 4),
                                    out=torch.zeros(1, 4, 4, 4)), ValueError, "out"),
    (lambda: fa3.flash_attn_combine(torch.zeros(2, 1, 4, 4, 8, dtype=torch.float16),
                                    torch.zeros(2, 1, 4, 4)), TypeError, "out_partial"),
    (lambda: fa3.flash_attn_combine(torch.zeros(2, 1, 4, 4, 8), torch.zeros(2, 1, 4)),
     ValueError, "lse_partial"),
    (lambda: apply_rotary_emb(torch.zeros(8, 2, 16), torch.zeros(8, 4), torch.zeros(8, 4),
                              cu_seqlens=torch.tensor([0, 8])), ValueError, "max_seqlen"),
    (lambda: apply_rotary_emb(torch.zeros(1, 8, 2, 16), torch.zeros(8, 10), torch.zeros(8, 10)),
     ValueError, "rotary_dim"),
    (lambda: apply_rotary_emb(torch.zeros(1, 8, 2, 16), torch.zeros(4, 4), torch.zeros(4, 4)),
     ValueError, "rows"),
])
def test_bad_arguments_are_refused_before_any_launch(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_fmha_checks_the_rest_on_cpu_tensors():
    # Everything the compatibility layer passes on is checked by fmha, also without a GPU.
    with pytest.raises(ValueError, match="CUDA"):
        fa2.flash_attn_func(*[cpu(1, 8, 4, 16)] * 3)
    with pytest.raises(TypeError, match="dtype"):
        fa2.flash_attn_func(*[cpu(1, 8, 4, 16, dtype=torch.float32)] * 3)


# ---- bert_padding ------------------------------------------------------------------------------


def randn(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_unpad_and_pad_round_trip():
    lengths = [5, 2, 7, 0]
    mask = torch.arange(7).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    x = randn(4, 7, 3, 2)
    packed, indices, cu_seqlens, max_seqlen, seqused = bert_padding.unpad_input(x, mask)
    assert packed.shape == (sum(lengths), 3, 2)
    assert indices.dtype == torch.int64 and cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 5, 7, 14, 14]
    assert max_seqlen == 7 and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == lengths
    assert torch.equal(packed, x[mask])
    padded = bert_padding.pad_input(packed, indices, 4, 7)
    assert torch.equal(padded, x * mask.view(4, 7, 1, 1))


def test_unpad_packs_unused_slots_but_does_not_count_them_as_used():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.int32)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.int32)
    x = randn(2, 4, 5)
    packed, indices, cu_seqlens, max_seqlen, seqused = bert_padding.unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu_seqlens.tolist() == [0, 3, 6] and max_seqlen == 3
    assert seqused.tolist() == [2, 1]
    assert torch.equal(packed, x.reshape(8, 5)[indices])


def test_pad_and_unpad_are_differentiable():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    x = randn(2, 4, 3).requires_grad_()
    packed, indices, *_ = bert_padding.unpad_input(x, mask)
    back = bert_padding.pad_input(packed * 2, indices, 2, 4)
    back.sum().backward()
    assert torch.equal(x.grad, 2.0 * mask.unsqueeze(-1).expand(2, 4, 3))


def test_index_first_axis_and_its_inverse():
    x = randn(6, 2)
    indices = torch.tensor([4, 0, 3])
    rows = bert_padding.index_first_axis(x, indices)
    assert torch.equal(rows, x[indices])
    back = bert_padding.index_put_first_axis(rows, indices, 6)
    assert torch.equal(back[indices], rows) and not back[[1, 2, 5]].any()


# ---- the rotary embedding ----------------------------------------------------------------------


def rotated_by_complex_numbers(x, cos, sin, positions, interleaved):
    """The rotation as complex multiplication, written independently of apply_rotary_emb: the
    pair (a, b) at position p is a + ib times cos[p] + i sin[p]."""
    half = cos.shape[1]
    out = x.clone()
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        a, b = x[..., :half], x[..., half:2 * half]
    turned = torch.complex(a, b) * torch.complex(cos[positions], sin[positions]).unsqueeze(-2)
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = turned.real, turned.imag
    else:
        out[..., :half], out[..., half:2 * half] = turned.real, turned.imag
    return out


def rotary_table(rows, half, seed=5):
    angle = randn(rows, half, seed=seed) * math.pi
    return torch.cos(angle), torch.sin(angle)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_rotary_matches_complex_rotation(interleaved, rotary_dim):
    x = randn(2, 6, 3, 16)
    cos, sin = rotary_table(12, rotary_dim // 2)
    offsets = torch.tensor([0, 5])
    positions = torch.arange(6).unsqueeze(0) + offsets.unsqueeze(1)
    expected = rotated_by_complex_numbers(x, cos, sin, positions, interleaved)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    shifted = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=3)
    torch.testing.assert_close(
        shifted, rotated_by_complex_numbers(x, cos, sin, positions * 0 + torch.arange(6) + 3,
                                            interleaved), rtol=1e-6, atol=1e-6)


def test_rotary_varlen_matches_batch_and_positions_past_the_table_stay():
    cos, sin = rotary_table(8, 4)
    x = randn(2, 6, 2, 8)
    offsets = torch.tensor([1, 4])
    batch = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
    lengths = [6, 3]
    packed = torch.cat([x[0, :6], x[1, :3]])
    cu_seqlens = torch.tensor([0, 6, 9], dtype=torch.int32)
    varlen = apply_rotary_emb(packed, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                              max_seqlen=max(lengths))
    torch.testing.assert_close(varlen[:6], batch[0])
    # Sequence 1 starts at position 4: its tokens 4 and 5 fall past the 8 rows of the table and
    # pass through unrotated (FlashAttention's kernel reads cos 1, sin 0 there).
    torch.testing.assert_close(varlen[6:9], batch[1, :3])
    torch.testing.assert_close(batch[1, 4:], x[1, 4:])


def test_rotary_in_place_and_in_low_precision():
    cos, sin = rotary_table(8, 4)
    x = randn(1, 8, 2, 12).to(torch.bfloat16)
    expected = rotated_by_complex_numbers(x.double(), cos, sin, torch.arange(8).unsqueeze(0),
                                          False).to(torch.bfloat16)
    out = apply_rotary_emb(x, cos.to(torch.bfloat16), sin.to(torch.bfloat16), inplace=True)
    assert out is x and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    assert torch.equal(out[..., 8:], x[..., 8:])


def test_rotary_is_differentiable():
    cos, sin = rotary_table(4, 2)
    x = randn(1, 4, 1, 4).requires_grad_()
    apply_rotary_emb(x, cos, sin).pow(2).sum().backward()
    # A rotation keeps lengths: the gradient of the squared norm is 2x.
    torch.testing.assert_close(x.grad, 2 * x.detach())


# ---- how the functions map onto fmha (kernels swapped for the float64 reference) ------------


class Kernels:
    """fmha.fwd, fmha.bwd, fmha.fwd_kvcache and fmha.dropout_mask as tests/reference.py's
    float64 attention; `calls` records each call's keywords."""

    def __init__(self):
        self.calls = []

    def fwd(self, q, k, v, causal=False, softmax_scale=None, *, return_lse=False,
            dropout_seed=None, dropout_offset=0, **options):
        self.calls.append(dict(api="fwd", causal=causal, softmax_scale=softmax_scale,
                               dropout_seed=dropout_seed, dropout_offset=dropout_offset,
                               return_lse=return_lse, **options))
        out, lse = R.attention_reference(
            q, k, v, causal=causal, softmax_scale=softmax_scale,
            dropout_keep=self._keep(q, k, options, dropout_seed, dropout_offset), **options)
        out = out.to(q.dtype)
        return (out, lse.float()) if return_lse else out

    def bwd(self, dout, q, k, v, out, lse, causal=False, softmax_scale=None, *,
            deterministic=False, dropout_seed=None, dropout_offset=0, **options):
        self.calls.append(dict(api="bwd", deterministic=deterministic,
                               dropout_seed=dropout_seed, **options))
        keep = self._keep(q, k, options, dropout_seed, dropout_offset)
        # In a thread of its own: autograd runs a Function's backward with grad mode off.
        with ThreadPoolExecutor(1) as thread:
            grads = thread.submit(R.attention_grads, q, k, v, dout, causal=causal,
                                  softmax_scale=softmax_scale, dropout_keep=keep,
                                  **options).result()
        return grads.dq.to(q.dtype), grads.dk.to(k.dtype), grads.dv.to(v.dtype)

    def fwd_kvcache(self, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                    return_lse=False, num_splits=0, **options):
        self.calls.append(dict(api="fwd_kvcache", cache_seqlens=cache_seqlens,
                               num_splits=num_splits, return_lse=return_lse, **options))
        out, lse, k_new, v_new = R.kvcache_reference(q, k_cache, v_cache, k, v,
                                                     cache_seqlens=cache_seqlens, **options)
        k_cache.copy_(k_new)
        v_cache.copy_(v_new)
        out = out.to(q.dtype)
        return (out, lse.float()) if return_lse else out

    @staticmethod
    def dropout_mask(seed, offset, dropout_p, batch, nhead, seqlen_q, seqlen_k, device=None):
        return R.dropout_keep_mask(seed, offset, dropout_p, batch, nhead, seqlen_q, seqlen_k,
                                   device=device)

    def _keep(self, q, k, options, seed, offset):
        if not options.get("dropout_p"):
            return None
        group = options.get("cu_seqlens_q") is not None
        batch = options["cu_seqlens_q"].shape[0] - 1 if group else q.shape[0]
        seqlen_q = options["max_seqlen_q"] if group else q.shape[1]
        seqlen_k = max(options["max_seqlen_k"], k.shape[0]) if group else k.shape[1]
        return self.dropout_mask(seed, offset, options["dropout_p"], batch, q.shape[-2],
                                 seqlen_q, seqlen_k)


@pytest.fixture
def kernels(monkeypatch):
    swapped = Kernels()
    for name in ("fwd", "bwd", "fwd_kvcache", "dropout_mask"):
        monkeypatch.setattr(fmha, name, getattr(swapped, name))
    return swapped


def flash_attention(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
                    scale=None):
    """FlashAttention-2's attention as its docstrings define it, per batch row: (out, lse,
    probabilities). Query i sits at key i + seqlen_k - seqlen_q; causal sees keys up to it, a
    window [i' - left, i' + right] around it; ALiBi adds -slope * |i' - j|; softcap > 0 caps the
    logits; GQA query head h reads K/V head h // (heads / heads_k)."""
    seqlen_q, heads, dim = q.shape[1:]
    seqlen_k, heads_k = k.shape[1:3]
    k = k.repeat_interleave(heads // heads_k, dim=2)
    v = v.repeat_interleave(heads // heads_k, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q, k) * (dim ** -0.5 if scale is None else scale)
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    diagonal = torch.arange(seqlen_q).view(-1, 1) + seqlen_k - seqlen_q
    keys = torch.arange(seqlen_k).view(1, -1)
    if slopes is not None:
        logits = logits - slopes.view(-1, heads, 1, 1) * (diagonal - keys).abs()
    left, right = window
    sees = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        sees &= keys <= diagonal
    if left >= 0:
        sees &= keys >= diagonal - left
    if right >= 0:
        sees &= keys <= diagonal + right
    logits = logits.masked_fill(~sees, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", probs, v), lse, probs


def test_causal_is_bottom_right_and_lse_is_per_row(kernels):
    q, k, v = randn(2, 3, 4, 16, seed=1), randn(2, 7, 2, 16, seed=2), randn(2, 7, 2, 16, seed=3)
    out, lse, s_dmask = fa2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    expected, expected_lse, _ = flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, expected)
    assert lse.shape == (2, 4, 3) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, expected_lse.float())
    assert s_dmask.numel() == 0  # no dropout, no probabilities (FlashAttention-2 alike)
    assert kernels.calls[-1]["mask_align"] == "bottom_right"


def test_window_as_flash_attention_spells_it(kernels):
    q, k, v = randn(1, 6, 2, 8, seed=1), randn(1, 9, 2, 8, seed=2), randn(1, 9, 2, 8, seed=3)
    # A tensor of two sizes (torch.randint's), and causal with a right side: FlashAttention
    # takes the window's left side and 0 on the right.
    window = torch.tensor([2, 5])
    out = fa2.flash_attn_func(q, k, v, causal=True, window_size=window)
    torch.testing.assert_close(out, flash_attention(q, k, v, causal=True, window=(2, 0))[0])
    assert kernels.calls[-1]["window_size"] == (2, 0)
    out = fa2.flash_attn_func(q, k, v, window_size=(torch.tensor(1), -5))
    torch.testing.assert_close(out, flash_attention(q, k, v, window=(1, -1))[0])
    assert kernels.calls[-1]["window_size"] == (1, -1)


def test_softcap_alibi_and_a_negative_softcap_being_off(kernels):
    q, k, v = randn(2, 5, 4, 8, seed=1) * 4, randn(2, 5, 4, 8, seed=2), randn(2, 5, 4, 8, seed=3)
    slopes = randn(2, 4, seed=4).abs()
    out = fa2.flash_attn_func(q, k, v, softcap=2.0, alibi_slopes=slopes)
    torch.testing.assert_close(out, flash_attention(q, k, v, softcap=2.0, slopes=slopes)[0])
    out = fa2.flash_attn_func(q, k, v, softcap=-1.0)
    torch.testing.assert_close(out, flash_attention(q, k, v)[0])
    assert kernels.calls[-1]["softcap"] == 0.0


def test_packed_functions_unstack_and_their_gradients_stack(kernels):
    qkv = randn(2, 6, 3, 2, 8).requires_grad_()
    out = fa2.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    dout = randn(*out.shape, seed=9)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(dim=2))
    expected = flash_attention(q, k, v, causal=True)[0]
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(expected, (q, k, v), dout)
    torch.testing.assert_close(dqkv, torch.stack(grads, dim=2))
    assert kernels.calls[-1] == dict(kernels.calls[-1], api="bwd", deterministic=True)

    q = randn(2, 4, 4, 8, seed=5).requires_grad_()
    kv = randn(2, 6, 2, 2, 8, seed=6).requires_grad_()
    out = fa2.flash_attn_kvpacked_func(q, kv)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout[:, :4].repeat(1, 1, 2, 1))
    k, v = (t.detach().requires_grad_() for t in kv.unbind(dim=2))
    expected = flash_attention(q, k, v)[0]
    torch.testing.assert_close(out, expected)
    assert dkv.shape == kv.shape and kernels.calls[-1]["deterministic"] is False


def test_no_autograd_record_without_gradients(kernels):
    q, k, v = randn(1, 4, 2, 8), randn(1, 4, 2, 8), randn(1, 4, 2, 8)
    out = fa2.flash_attn_func(q, k, v)
    assert out.grad_fn is None
    assert kernels.calls[-1]["return_lse"] is False  # inference asks for no log-sum-exp


def varlen(lengths_q, lengths_k, heads=2, heads_k=2, dim=8, seed=0):
    """Packed q, k, v and their cu_seqlens, plus each sequence's own (1, len, heads, dim)."""
    q = randn(sum(lengths_q), heads, dim, seed=seed)
    k = randn(sum(lengths_k), heads_k, dim, seed=seed + 1)
    v = randn(sum(lengths_k), heads_k, dim, seed=seed + 2)
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0).to(torch.int32)
    return q, k, v, cu_q, cu_k


def test_varlen_uses_each_sequences_own_lengths(kernels):
    lengths_q, lengths_k = [3, 5, 1], [6, 2, 4]
    q, k, v, cu_q, cu_k = varlen(lengths_q, lengths_k)
    slopes = randn(3, 2, seed=7).abs()
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True,
                                             alibi_slopes=slopes, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, q.shape[0])
    for b in range(3):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        expected, expected_lse, _ = flash_attention(q[None, rows], k[None, keys], v[None, keys],
                                                    causal=True, slopes=slopes[b])
        torch.testing.assert_close(out[rows], expected[0])
        torch.testing.assert_close(lse[:, rows], expected_lse[0].float())


def test_varlen_on_a_paged_cache_reads_each_sequences_pages(kernels):
    lengths_q, lengths_k = [2, 3], [5, 7]
    q, k, v, cu_q, cu_k = varlen(lengths_q, lengths_k)
    page_size = 4
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    k_pages = randn(5, page_size, 2, 8, seed=11)
    v_pages = randn(5, page_size, 2, 8, seed=12)
    for b in range(2):
        for t in range(lengths_k[b]):
            page = int(table[b, t // page_size])
            k_pages[page, t % page_size] = k[int(cu_k[b]) + t]
            v_pages[page, t % page_size] = v[int(cu_k[b]) + t]
    paged = fa2.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 3, 7, causal=True,
                                       block_table=table)
    packed = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 7, causal=True)
    torch.testing.assert_close(paged, packed)
    call = kernels.calls[-2]
    assert call["cu_seqlens_k"].tolist() == [0, 8, 16] and call["seqused_k"].tolist() == [5, 7]


def test_varlen_packed_forms(kernels):
    q, k, v, cu, _ = varlen([4, 2], [4, 2])
    qkv = torch.stack([q, k, v], dim=1)
    out = fa2.flash_attn_varlen_qkvpacked_func(qkv, cu, 4, causal=True)
    torch.testing.assert_close(out, fa2.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4,
                                                               causal=True))
    out = fa2.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], dim=1), cu, cu, 4, 4)
    torch.testing.assert_close(out, fa2.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4))


def decoded(s_dmask, lse, row_max):
    """S_dmask's magnitudes as probabilities: each row was scaled by exp(-its largest logit)."""
    return s_dmask.abs().double() * torch.exp(row_max - lse.double()).unsqueeze(-1)


def test_s_dmask_encodes_the_applied_dropout_pattern_and_the_probabilities(kernels):
    torch.manual_seed(3)
    q, k, v = randn(2, 5, 4, 8, seed=1), randn(2, 9, 2, 8, seed=2), randn(2, 9, 2, 8, seed=3)
    out, lse, s_dmask = fa2.flash_attn_func(q, k, v, 0.3, causal=True, return_attn_probs=True)
    seed = kernels.calls[-1]["dropout_seed"]
    assert isinstance(seed, int) and kernels.calls[-1]["dropout_offset"] == 0
    _, expected_lse, probs = flash_attention(q, k, v, causal=True)
    keep = R.dropout_keep_mask(seed, 0, 0.3, 2, 4, 5, 9).bool()
    assert s_dmask.shape == (2, 4, 5, 9) and s_dmask.dtype == q.dtype
    visible = probs > 0
    assert torch.equal(~torch.signbit(s_dmask) | ~visible, keep | ~visible)
    logits_max = torch.where(visible, torch.log(probs) + expected_lse.unsqueeze(-1),
                             float("-inf")).amax(-1)
    torch.testing.assert_close(decoded(s_dmask, expected_lse, logits_max), probs)
    # The output is the one of that pattern (kept probabilities scaled by 1 / (1 - p)).
    dropped = probs * keep / 0.7
    expected = torch.einsum("bhij,bjhd->bihd", dropped, v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(out, expected)
    # The same torch seed, the same call.
    torch.manual_seed(3)
    again = fa2.flash_attn_func(q, k, v, 0.3, causal=True)
    assert torch.equal(again, out) and kernels.calls[-1]["dropout_seed"] == seed


def test_s_dmask_of_varlen_holds_each_sequence_from_row_and_key_zero(kernels):
    lengths_q, lengths_k = [3, 5], [6, 2]
    q, k, v, cu_q, cu_k = varlen(lengths_q, lengths_k, heads=2, heads_k=1)
    _, _, s_dmask = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, 0.25,
                                               return_attn_probs=True)
    seed = kernels.calls[-1]["dropout_seed"]
    keep = R.dropout_keep_mask(seed, 0, 0.25, 2, 2, 5, 6).bool()
    assert s_dmask.shape == (2, 2, 5, 6)
    for b in range(2):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        _, lse, probs = flash_attention(q[None, rows], k[None, keys], v[None, keys])
        block = s_dmask[b, :, :lengths_q[b], :lengths_k[b]]
        assert torch.equal(~torch.signbit(block), keep[b, :, :lengths_q[b], :lengths_k[b]])
        logits_max = (torch.log(probs) + lse.unsqueeze(-1)).amax(-1)
        torch.testing.assert_close(decoded(block.unsqueeze(0), lse, logits_max), probs)
        assert not s_dmask[b, :, lengths_q[b]:].any() and not s_dmask[b, :, :, lengths_k[b]:].any()


def test_dropout_gradients_use_the_forwards_seed(kernels):
    q, k, v = (randn(1, 4, 2, 8, seed=s).requires_grad_() for s in (1, 2, 3))
    out = fa2.flash_attn_func(q, k, v, 0.5)
    out.sum().backward()
    forward, backward = kernels.calls[-2], kernels.calls[-1]
    assert backward["api"] == "bwd" and backward["dropout_seed"] == forward["dropout_seed"]
    assert backward["dropout_p"] == 0.5


def test_with_kvcache_maps_flash_attentions_defaults(kernels):
    q = randn(2, 1, 4, 8)
    k_cache, v_cache = randn(2, 10, 2, 8, seed=1), randn(2, 10, 2, 8, seed=2)
    k, v = randn(2, 1, 2, 8, seed=3), randn(2, 1, 2, 8, seed=4)
    cos, sin = rotary_table(10, 4)
    out, lse = fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin,
                                           cache_seqlens=6, causal=True,
                                           window_size=(3, 3), return_softmax_lse=True)
    call = kernels.calls[-1]
    assert call["cache_seqlens"].dtype == torch.int32 and call["cache_seqlens"].tolist() == [6, 6]
    assert call["rotary_interleaved"] is True and call["window_size"] == (3, 0)
    assert out.shape == (2, 1, 4, 8) and lse.shape == (2, 4, 1)
    # The appended keys are in the cache, rotated at their position, interleaved.
    expected_k = rotated_by_complex_numbers(k, cos, sin, torch.full((2, 1), 6), True)
    torch.testing.assert_close(k_cache[:, 6:7], expected_k)
    # Without cache_seqlens and new keys, the whole cache is attended to.
    fa2.flash_attn_with_kvcache(q, k_cache, v_cache)
    assert kernels.calls[-1]["cache_seqlens"].tolist() == [10, 10]
    fa2.flash_attn_with_kvcache(q, k_cache.view(4, 5, 2, 8), v_cache.view(4, 5, 2, 8),
                                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    assert kernels.calls[-1]["cache_seqlens"].tolist() == [10, 10]


def test_flash_attn_3_functions(kernels):
    q, k, v = randn(2, 3, 4, 8, seed=1), randn(2, 7, 2, 8, seed=2), randn(2, 7, 2, 8, seed=3)
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, num_splits=4, pack_gqa=True,
                                   return_attn_probs=True)
    expected, expected_lse, _ = flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse.float())
    assert fa3.flash_attn_func(q, k, v, softcap=-2.0).shape == out.shape

    qs, ks, vs, cu_q, cu_k = varlen([3, 2], [4, 6])
    used = torch.tensor([2, 5], dtype=torch.int32)
    out = fa3.flash_attn_varlen_func(qs, ks, vs, cu_q, cu_k, 3, 6, seqused_k=used,
                                     causal=True)
    for b in range(2):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b]) + int(used[b]))
        torch.testing.assert_close(out[rows], flash_attention(
            qs[None, rows], ks[None, keys], vs[None, keys], causal=True)[0][0])

    q1 = randn(2, 1, 4, 8)
    k_pages, v_pages = randn(4, 4, 2, 8, seed=5), randn(4, 4, 2, 8, seed=6)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    fa3.flash_attn_with_kvcache(q1, k_pages, v_pages, cache_seqlens=torch.tensor(
        [5, 8], dtype=torch.int32), page_table=table, scheduler_metadata=object())
    assert kernels.calls[-1]["block_table"] is table


def test_flash_attn_combine_merges_splits_by_their_lse():
    keys = randn(2, 3, 4, 12, seed=1)
    values = randn(2, 3, 4, 12, 8, seed=2)  # (batch, seqlen, heads, keys, dim)
    splits = [slice(0, 5), slice(5, 9), slice(9, 12)]
    out_partial = torch.stack([
        (torch.softmax(keys[..., s], -1).unsqueeze(-1) * values[..., s, :]).sum(-2)
        for s in splits]).float()
    lse_partial = torch.stack([torch.logsumexp(keys[..., s], -1) for s in splits]).float()
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial)
    whole = (torch.softmax(keys, -1).unsqueeze(-1) * values).sum(-2)
    torch.testing.assert_close(out, whole.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(keys, -1).float())
    # A split that saw no key (lse -inf) adds nothing, and a row of such splits is 0.
    lse_partial[2] = float("-inf")
    lse_partial[:, 0, 0] = float("-inf")
    into = torch.empty(2, 3, 4, 8, dtype=torch.bfloat16)
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out=into)
    assert out is into and not out[0, 0].any() and torch.isinf(lse[0, 0]).all()
    assert torch.isfinite(out.float()).all()


# ---- FlashAttention-3's FP8 flash_attn_with_kvcache on fmha.fwd_kvcache's e4m3 cache ---------

E4M3 = torch.float8_e4m3fn


def e4m3(*shape, seed=0):
    return (4 * randn(*shape, seed=seed)).to(E4M3)


def fp8_call(batch=2, heads=4, heads_k=2, dim=16, new=True):
    """An FP8 call's tensors: e4m3 q, caches and (with `new`) new tokens, GQA heads:heads_k."""
    kw = dict(q=e4m3(batch, 1, heads, dim, seed=1), k_cache=e4m3(batch, 8, heads_k, dim, seed=2),
              v_cache=e4m3(batch, 8, heads_k, dim, seed=3),
              cache_seqlens=torch.tensor([3, 5], dtype=torch.int32)[:batch])
    if new:
        kw.update(k=e4m3(batch, 1, heads_k, dim, seed=4), v=e4m3(batch, 1, heads_k, dim, seed=5))
    return kw


@pytest.fixture
def captured(monkeypatch):
    """fmha.fwd_kvcache recording its arguments and returning zeros of q's dtype."""
    calls = []

    def fwd_kvcache(q, k_cache, v_cache, k=None, v=None, **options):
        calls.append(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, **options))
        return torch.zeros(q.shape, dtype=q.dtype)

    monkeypatch.setattr(fmha, "fwd_kvcache", fwd_kvcache)
    return calls


def test_fp8_kvcache_dequantizes_q_and_new_tokens_and_passes_the_descales_as_scales(captured):
    kw = fp8_call()
    q_descale = torch.tensor([[0.5, 3.0], [0.25, 7.0]])
    k_descale = torch.tensor([[0.125, 2.0], [1.5, 0.0625]])
    v_descale = torch.tensor([[0.75], [4.0]])  # (batch, 1): one per sequence
    out = fa3.flash_attn_with_kvcache(**kw, q_descale=q_descale, k_descale=k_descale,
                                      v_descale=v_descale)
    assert out.dtype == torch.bfloat16
    call = captured[-1]
    assert call["k_cache"] is kw["k_cache"] and call["v_cache"] is kw["v_cache"]
    # Query head h takes K/V head h // 2's descale (GQA 4:2).
    per_query_head = q_descale.repeat_interleave(2, dim=1)
    expected_q = (kw["q"].float() * per_query_head[:, None, :, None]).to(torch.bfloat16)
    assert call["q"].dtype == torch.bfloat16 and torch.equal(call["q"], expected_q)
    assert torch.equal(call["k"], (kw["k"].float() * k_descale[:, None, :, None]).bfloat16())
    assert torch.equal(call["v"], (kw["v"].float() * v_descale[:, None, :, None]).bfloat16())
    assert torch.equal(call["k_scale"], k_descale)
    assert call["v_scale"].shape == (2, 2)
    assert torch.equal(call["v_scale"], v_descale.expand(2, 2))
    # What fwd_kvcache appends (tests/reference.py's quantize_e4m3, the kernel's arithmetic):
    # the codes FlashAttention-3's caller gave.
    for name, scale in (("k", call["k_scale"]), ("v", call["v_scale"])):
        appended = R.quantize_e4m3(call[name], scale)
        assert torch.equal(appended.view(torch.uint8), kw[name].view(torch.uint8))


def test_fp8_kvcache_descales_default_to_one(captured):
    kw = fp8_call(new=False)
    fa3.flash_attn_with_kvcache(**kw, k_descale=torch.full((2,), 0.5))
    call = captured[-1]
    assert torch.equal(call["q"], kw["q"].to(torch.bfloat16))  # exact: e4m3 is in bf16
    assert call["k"] is None and call["v"] is None
    assert torch.equal(call["k_scale"], torch.full((2, 2), 0.5))
    assert torch.equal(call["v_scale"], torch.ones(2, 2))
    for name in ("k_scale", "v_scale"):
        assert call[name].dtype == torch.float32


def test_sixteen_bit_kvcache_calls_take_no_scales(captured):
    q = randn(2, 1, 4, 16, dtype=torch.bfloat16)
    k_cache = randn(2, 8, 2, 16, dtype=torch.bfloat16)
    fa3.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=3)
    call = captured[-1]
    assert call["q"] is q and "k_scale" not in call and "v_scale" not in call


@pytest.mark.parametrize("overrides,error,words", [
    (dict(q_descale=torch.ones(2, 2), q=randn(2, 1, 4, 16, dtype=torch.bfloat16),
          k_cache=randn(2, 8, 2, 16, dtype=torch.bfloat16),
          v_cache=randn(2, 8, 2, 16, dtype=torch.bfloat16), k=None, v=None), ValueError,
     "q_descale dequantizes FP8"),
    (dict(k_descale=torch.ones(2, 2), q=randn(2, 1, 4, 16, dtype=torch.bfloat16), k=None,
          v=None), ValueError, "k_descale dequantizes FP8"),
    (dict(k_cache=randn(2, 8, 2, 16, dtype=torch.bfloat16)), ValueError,
     "k_cache must be torch.float8_e4m3fn with a torch.float8_e4m3fn q"),
    (dict(v_cache=randn(2, 8, 2, 16, dtype=torch.bfloat16)), ValueError, "v_cache must be"),
    (dict(k=randn(2, 1, 2, 16, dtype=torch.bfloat16)), ValueError, "k must be"),
    (dict(v=randn(2, 1, 2, 16, dtype=torch.bfloat16)), ValueError, "v must be"),
    (dict(k=e4m3(2, 1, 4, 16)), ValueError, "k must be \\(batch, seqlen_new, nheads_k"),
    (dict(q_descale=torch.ones(2, 2, dtype=torch.float16)), TypeError,
     "q_descale must be torch.float32"),
    (dict(v_descale=[[1.0, 1.0]] * 2), TypeError, "v_descale must be a torch.Tensor"),
    (dict(k_descale=torch.ones(3)), ValueError,
     "k_descale must have shape \\(batch, nheads_k\\) = \\(2, 2\\)"),
    (dict(q=e4m3(2, 1, 3, 16)), ValueError, "nheads a multiple of nheads_k"),
], ids=["q_descale, bf16", "k_descale, bf16 q", "bf16 k_cache", "bf16 v_cache", "bf16 k",
        "bf16 v", "k heads", "fp16 descale", "list descale", "descale shape", "heads"])
def test_fp8_kvcache_refusals(captured, overrides, error, words):
    with pytest.raises(error, match=words):
        fa3.flash_attn_with_kvcache(**{**fp8_call(), **overrides})
    assert not captured


@pytest.mark.parametrize("scale", [1.0, 1 / 448, 0.0123, 3.7, 100.0, 1e-6, 1e6, 2.0**-117,
                                   2.0**119])
def test_e4m3_codes_survive_the_bf16_round_trip(scale):
    """An e4m3 code times an fp32 descale, rounded to bf16, then divided by the descale and
    rounded to e4m3 (what fwd_kvcache does as it appends) is the code again, for every finite
    code, where each product is a normal bf16 (descales in [2**-117, 2**119])."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = torch.isfinite(codes.view(E4M3).float())
    codes = codes[finite].view(E4M3)
    assert codes.numel() == 254  # all but the two NaN codes
    descale = torch.full((1, 1), scale)
    dequantized = (codes.float() * descale[0, 0]).to(torch.bfloat16)
    back = R.quantize_e4m3(dequantized.view(1, -1, 1, 1), descale).flatten()
    assert torch.equal(back.view(torch.uint8), codes.view(torch.uint8))


def test_register_points_flash_attn_imports_here(monkeypatch):
    import fmha.compat
    for name in fmha.compat.ALIASES:  # put back (or removed) after the test, whatever it sets
        monkeypatch.setitem(sys.modules, name, None)
    fmha.compat.register()
    import flash_attn
    import flash_attn_interface as hopper
    from flash_attn.bert_padding import unpad_input
    from flash_attn.flash_attn_interface import _get_block_size_n
    from flash_attn.layers.rotary import apply_rotary_emb as rotary
    assert flash_attn is fa2 and hopper is fa3
    assert _get_block_size_n is flash_attn_interface._get_block_size_n
    assert unpad_input is bert_padding.unpad_input and rotary is apply_rotary_emb
