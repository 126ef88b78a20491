"""fmha.fwd_kvcache's argument checks: every bad call fails with a TypeError or ValueError that
names the argument, before anything reaches a GPU. They run without one: the checks come
before the device check, so CPU tensors reach every one of them, and the last check says the
tensors must be on a GPU."""

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")


def call(b=2, sq=1, hq=8, hk=2, d=64, capacity=128, new=0, paged=False, page_size=16,
         dtype=torch.float16, **overrides):
    """A valid call's arguments on the CPU, with `overrides` replacing any of them."""
    if paged:
        pages = capacity // page_size
        k_cache = torch.randn(b * pages, page_size, hk, d).to(dtype)
        block_table = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
    else:
        k_cache = torch.randn(b, capacity, hk, d).to(dtype)
        block_table = None
    kw = dict(q=torch.randn(b, sq, hq, d).to(dtype), k_cache=k_cache,
              v_cache=torch.randn_like(k_cache), cache_seqlens=torch.zeros(b, dtype=torch.int32),
              block_table=block_table)
    if new:
        kw["k"] = torch.randn(b, new, hk, d).to(dtype)
        kw["v"] = torch.randn(b, new, hk, d).to(dtype)
    kw.update(overrides)
    return kw


def run(kw):
    q, k_cache, v_cache = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache")
    return fmha.fwd_kvcache(q, k_cache, v_cache, **kw)


BAD_CALLS = [
    ("q 3-d", dict(q=torch.randn(2, 8, 64).half()), ValueError, "q must have 4 dimensions"),
    ("q fp32", dict(q=torch.randn(2, 1, 8, 64)), ValueError, "float16 or bfloat16"),
    ("cache dtype", dict(k_cache=torch.randn(2, 128, 2, 64).bfloat16()), ValueError,
     "k_cache must be torch.float16"),
    ("head dims", dict(q=torch.randn(2, 1, 8, 32).half()), ValueError, "head dim 64 must equal"),
    ("gqa", dict(q=torch.randn(2, 1, 3, 64).half()), ValueError, "multiple of the cache's 2"),
    ("k without v", dict(k=torch.randn(2, 1, 2, 64).half()), ValueError, "pass both or neither"),
    ("k shape", dict(k=torch.randn(2, 1, 4, 64).half(), v=torch.randn(2, 1, 4, 64).half()),
     ValueError, "k must have shape"),
    ("seqlens dtype", dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), ValueError,
     "cache_seqlens must be torch.int32"),
    ("seqlens shape", dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError,
     "cache_seqlens must have shape (2,)"),
    ("seqlens int", dict(cache_seqlens=5), TypeError, "cache_seqlens must be a torch.Tensor"),
    ("small cache", dict(k_cache=torch.randn(1, 128, 2, 64).half(),
                         v_cache=torch.randn(1, 128, 2, 64).half()), ValueError,
     "pass cache_batch_idx"),
    ("window right causal", dict(causal=True, window_size=(8, 4)), ValueError,
     "right must be 0 or -1"),
    ("window type", dict(window_size=8), TypeError, "window_size must be a (left, right)"),
    ("softcap", dict(softcap=-1.0), ValueError, "softcap must be finite and non-negative"),
    ("scale", dict(softmax_scale=0.0), ValueError, "softmax_scale must be finite and positive"),
    ("splits", dict(num_splits=-1), TypeError, "num_splits must be an int >= 0"),
    ("alibi shape", dict(alibi_slopes=torch.rand(4)), ValueError, "alibi_slopes must have shape"),
    ("rotary without k", dict(rotary_cos=torch.rand(128, 16).half(),
                              rotary_sin=torch.rand(128, 16).half()), ValueError,
     "rotate the appended k"),
    ("q strides", dict(q=torch.randn(2, 1, 8, 68).half()[..., :64]), ValueError, "strides"),
    ("leftpad dtype", dict(cache_leftpad=torch.zeros(2, dtype=torch.int64)), ValueError,
     "cache_leftpad must be torch.int32"),
    ("leftpad shape", dict(cache_leftpad=torch.zeros(1, dtype=torch.int32)), ValueError,
     "cache_leftpad must have shape (2,)"),
    ("cpu", dict(), ValueError, "needs CUDA tensors"),
]


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_call(overrides, error, message):
    with pytest.raises(error) as info:
        run(call(**overrides))
    assert message in str(info.value), str(info.value)


def test_rotary_checks():
    kw = call(new=1, rotary_cos=torch.rand(128, 40).half(), rotary_sin=torch.rand(128, 40).half())
    with pytest.raises(ValueError, match="rotary_dim"):
        run(kw)
    kw = call(new=1, rotary_cos=torch.rand(128, 16).half())
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin go together"):
        run(kw)


def test_paged_checks():
    kw = call(paged=True, cache_batch_idx=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="addressed through block_table"):
        run(kw)
    kw = call(paged=True, cache_leftpad=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="a paged cache takes none"):
        run(kw)
    kw = call(paged=True, block_table=torch.zeros(3, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table must have shape"):
        run(kw)
    # A valid paged call gets as far as the device check.
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        run(call(paged=True, new=1))


def test_alibi_slopes_broadcast_over_the_batch_read_their_own_stride():
    """(batch, heads) slopes expanded from (heads,) have a batch stride of 0: the kernel must
    read that one, not a dense (batch, heads) one past the heads' floats."""
    from fmha import _kvcache
    kw = call(alibi_slopes=torch.rand(8).expand(2, 8))
    q, k_cache, v_cache = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache")
    args = _kvcache._described(q, k_cache, v_cache, None, None, kw.pop("cache_seqlens"), kw,
                               cc=90)
    assert args.alibi_batch_stride == 0
    kw = call(alibi_slopes=torch.rand(2, 8))
    q, k_cache, v_cache = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache")
    args = _kvcache._described(q, k_cache, v_cache, None, None, kw.pop("cache_seqlens"), kw,
                               cc=90)
    assert args.alibi_batch_stride == 8
