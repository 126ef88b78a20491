"""fmha.compat.flash_attn and fmha.compat.flash_attn_interface on the GPU: the kernels behind the
FlashAttention APIs against tests/reference.py's float64 attention in FlashAttention's
conventions (bottom-right causal, varlen, a paged KV cache), the dropout pattern S_dmask
reports against the one the kernel applied, and deterministic gradients. The calls are the
default build's (bf16, head dim 128); a call the build lacks compiles on demand where the suite
allows it, else the test skips naming the missing instance. FlashAttention-2's own suite runs
against the same package from ../shared/peer-tests (its README says how).
"""

import functools

import pytest

import reference as R
from gpu_support import device_cc, import_fmha, runs_here

torch, fmha = import_fmha()
import fmha.compat.flash_attn as fa2  # noqa: E402
import fmha.compat.flash_attn_interface as fa3  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16


def skips_missing_instances(test):
    """A call outside this build (and compile on demand) skips the test, naming what it lacks."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except fmha.MissingInstanceError as miss:
            pytest.skip(f"not in this build: {miss}")
    return run


def randn(*shape, seed=0, dtype=DTYPE):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=generator, device="cuda", dtype=dtype)


def assert_close_to_reference(got, exact, low_precision, what=""):
    """FlashAttention's rule: at most twice the error of the same attention computed in the
    input precision, plus a small absolute slack."""
    error = (got.double() - exact.double()).abs().max().item()
    yardstick = (low_precision.double() - exact.double()).abs().max().item()
    assert error <= 2 * yardstick + 1e-3, f"{what}: error {error} against {yardstick}"


@skips_missing_instances
def test_flash_attn_func_forward_and_backward_bottom_right_causal():
    q = randn(2, 100, 8, 128, seed=1).requires_grad_()
    k = randn(2, 300, 2, 128, seed=2).requires_grad_()
    v = randn(2, 300, 2, 128, seed=3).requires_grad_()
    out, lse, _ = fa2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    reference = dict(causal=True, mask_align="bottom_right")
    exact, exact_lse = R.attention_reference(q, k, v, **reference)
    low, _ = R.attention_reference(q, k, v, compute_dtype=DTYPE, **reference)
    assert_close_to_reference(out, exact, low, "out")
    assert lse.shape == (2, 8, 100)
    torch.testing.assert_close(lse.double(), exact_lse.double(), rtol=1e-3, atol=1e-3)
    dout = randn(*out.shape, seed=4)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    exact_grads = R.attention_grads(q, k, v, dout, **reference)
    low_grads = R.attention_grads(q, k, v, dout, compute_dtype=DTYPE, **reference)
    for name, got, exact_grad, low_grad in zip(
            "qkv", grads, (exact_grads.dq, exact_grads.dk, exact_grads.dv),
            (low_grads.dq, low_grads.dk, low_grads.dv)):
        assert_close_to_reference(got, exact_grad, low_grad, f"d{name}")


@skips_missing_instances
def test_varlen_func_per_sequence_lengths():
    lengths_q, lengths_k = [37, 128, 5], [200, 128, 64]
    q = randn(sum(lengths_q), 4, 128, seed=1)
    k = randn(sum(lengths_k), 4, 128, seed=2)
    v = randn(sum(lengths_k), 4, 128, seed=3)
    cu_q = torch.tensor([0] + lengths_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lengths_k, device="cuda").cumsum(0).to(torch.int32)
    out, lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 128, 200, causal=True,
                                             return_attn_probs=True)
    assert lse.shape == (4, sum(lengths_q))
    reference = dict(causal=True, mask_align="bottom_right", cu_seqlens_q=cu_q,
                     cu_seqlens_k=cu_k, max_seqlen_q=128, max_seqlen_k=200)
    exact, _ = R.attention_reference(q, k, v, **reference)
    low, _ = R.attention_reference(q, k, v, compute_dtype=DTYPE, **reference)
    assert_close_to_reference(out, exact, low, "out")


@skips_missing_instances
def test_deterministic_gradients_are_bitwise_repeatable():
    q, k, v = (randn(2, 256, 4, 128, seed=s).requires_grad_() for s in (1, 2, 3))
    out = fa2.flash_attn_func(q, k, v, causal=True, deterministic=True)
    dout = randn(*out.shape, seed=4)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(5):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@skips_missing_instances
def test_s_dmask_carries_the_pattern_the_kernel_applied():
    q, k, v = randn(2, 64, 4, 128, seed=1), randn(2, 96, 4, 128, seed=2), randn(
        2, 96, 4, 128, seed=3)
    torch.manual_seed(7)
    out, lse, s_dmask = fa2.flash_attn_func(q, k, v, 0.2, causal=True, return_attn_probs=True)
    torch.manual_seed(7)
    seed = int(torch.randint(2**63 - 1, (), dtype=torch.int64))  # the draw the call made
    keep = fmha.dropout_mask(seed, 0, 0.2, 2, 4, 64, 96).bool()
    visible = R.visible(64, 96, -1, 0, "bottom_right", device="cuda")
    assert s_dmask.shape == (2, 4, 64, 96) and s_dmask.dtype == DTYPE
    assert torch.equal(~torch.signbit(s_dmask) & visible, keep & visible)
    exact, _ = R.attention_reference(q, k, v, causal=True, mask_align="bottom_right",
                                     dropout_p=0.2, dropout_keep=keep.to(torch.uint8))
    low, _ = R.attention_reference(q, k, v, causal=True, mask_align="bottom_right",
                                   dropout_p=0.2, dropout_keep=keep.to(torch.uint8),
                                   compute_dtype=DTYPE)
    assert_close_to_reference(out, exact, low, "out with dropout")


@skips_missing_instances
def test_with_kvcache_decodes_on_a_paged_cache():
    batch, page_size = 2, 256
    q = randn(batch, 1, 8, 128, seed=1)
    k_pages, v_pages = randn(8, page_size, 2, 128, seed=2), randn(8, page_size, 2, 128, seed=3)
    table = torch.tensor([[5, 0, 7], [2, 6, 1]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([300, 700], dtype=torch.int32, device="cuda")
    k, v = randn(batch, 1, 2, 128, seed=4), randn(batch, 1, 2, 128, seed=5)
    expected, _, k_after, _ = R.kvcache_reference(q, k_pages, v_pages, k, v,
                                                  cache_seqlens=lengths, block_table=table,
                                                  causal=True)
    out, lse = fa2.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=lengths,
                                           block_table=table, causal=True,
                                           return_softmax_lse=True)
    assert lse.shape == (batch, 8, 1)
    assert torch.equal(k_pages, k_after.to(DTYPE))
    torch.testing.assert_close(out.double(), expected.double(), rtol=2e-2, atol=2e-2)


@skips_missing_instances
def test_flash_attention_3_api_runs_the_same_kernels():
    q, k, v = randn(2, 128, 4, 128, seed=1), randn(2, 128, 4, 128, seed=2), randn(
        2, 128, 4, 128, seed=3)
    out3, lse3 = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out2, lse2, _ = fa2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out3, out2) and torch.equal(lse3, lse2)


@skips_missing_instances
def test_flash_attention_3_fp8_kvcache_is_fwd_kvcache_on_the_dequantized_queries():
    if not any(i["kv_dtype"] == "e4m3" and runs_here(i, device_cc(torch))
               for i in fmha.kvcache_instances()):
        pytest.skip("no e4m3-cache kvcache instance in this build runs on this GPU")
    e4m3 = torch.float8_e4m3fn
    batch, heads, heads_k = 2, 8, 2
    q8 = (4 * randn(batch, 1, heads, 128, seed=1)).to(e4m3)
    k_cache = (4 * randn(batch, 512, heads_k, 128, seed=2)).to(e4m3)
    v_cache = (4 * randn(batch, 512, heads_k, 128, seed=3)).to(e4m3)
    k8, v8 = ((4 * randn(batch, 1, heads_k, 128, seed=s)).to(e4m3) for s in (4, 5))
    q_descale = torch.tensor([[0.02, 0.05], [0.03, 0.01]], device="cuda")
    k_descale = torch.tensor([[0.1, 0.2], [0.05, 0.3]], device="cuda")
    v_descale = torch.tensor([[0.5, 0.25], [1.5, 0.75]], device="cuda")
    lengths = torch.tensor([300, 511], dtype=torch.int32, device="cuda")

    def dequantized(x, descale, exact=False):  # bf16 as the compat layer rounds it, or fp64
        per_head = descale.repeat_interleave(x.shape[2] // heads_k, dim=1)[:, None, :, None]
        return x.double() * per_head.double() if exact else (x.float() * per_head).to(DTYPE)

    caches = (k_cache.clone(), v_cache.clone())
    expected = fmha.fwd_kvcache(dequantized(q8, q_descale), *caches, dequantized(k8, k_descale),
                                dequantized(v8, v_descale), cache_seqlens=lengths,
                                causal=True, k_scale=k_descale, v_scale=v_descale)
    out = fa3.flash_attn_with_kvcache(q8, k_cache, v_cache, k8, v8, cache_seqlens=lengths,
                                      causal=True, q_descale=q_descale, k_descale=k_descale,
                                      v_descale=v_descale)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    # The new tokens' codes went into the cache as given, at each sequence's length.
    assert torch.equal(k_cache.view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), caches[1].view(torch.uint8))
    for b in range(batch):
        row = int(lengths[b])
        assert torch.equal(k_cache[b, row].view(torch.uint8), k8[b, 0].view(torch.uint8))
        assert torch.equal(v_cache[b, row].view(torch.uint8), v8[b, 0].view(torch.uint8))
    exact, _, _, _ = R.kvcache_reference_e4m3(
        dequantized(q8, q_descale, exact=True), caches[0], caches[1], cache_seqlens=lengths + 1,
        k_scale=k_descale, v_scale=v_descale, causal=True)
    torch.testing.assert_close(out.double(), exact.double(), rtol=2e-2, atol=2e-2)
