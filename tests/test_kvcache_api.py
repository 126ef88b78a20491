"""fmha.fwd_kvcache's argument checks: every bad call fails with a TypeError or ValueError that
names the argument, before anything reaches a GPU. They run without one: the checks come
before the device check, so CPU tensors reach every one of them, and the last check says the
tensors must be on a GPU."""

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")
from fmha import _head_dims, _kvcache  # noqa: E402


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
    ("alibi type", dict(alibi_slopes=True), TypeError, "alibi_slopes must be a torch.Tensor"),
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


# ---- head dims that are no multiple of 8 ------------------------------------------------------


def rows_of(width: int, *shape):
    """A tensor of `shape` whose rows lie `width` elements apart: the [..., :headdim] view of a
    wider buffer, which fwd_kvcache runs in place where `width` is a multiple of 8."""
    return torch.randn(*shape[:-1], width).half()[..., :shape[-1]]


def test_copies_keep_every_head_dim(monkeypatch):
    """Operands whose rows are not 16-byte aligned run on copies that are the [..., :headdim]
    views of zero-padded buffers, so that they keep their head dims: those of the operands that
    run in place (the caches here) must still match them."""
    monkeypatch.setattr(_kvcache, "check_devices", lambda **tensors: None)
    ran = []
    fwd_kvcache = _kvcache.fwd_kvcache
    monkeypatch.setattr(_kvcache, "fwd_kvcache", lambda *operands, **options: ran.append(
        (operands, options)) or operands[0])
    q, k, v = rows_of(235, 2, 1, 8, 235), rows_of(235, 2, 3, 2, 235), rows_of(235, 2, 3, 2, 235)
    k_cache, v_cache = rows_of(240, 2, 64, 2, 235), rows_of(240, 2, 64, 2, 235)
    seqlens = torch.zeros(2, dtype=torch.int32)
    fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    (operands, options), = ran
    for given, run in zip((q, k_cache, v_cache, k, v), operands):
        assert run.shape == given.shape and torch.equal(run, given)
        assert all(stride % 8 == 0 for stride in run.stride()[:-1])
    assert operands[1] is k_cache and operands[2] is v_cache  # in place
    _kvcache._build_args(*operands, seqlens, None, None, None, None, None, False, False,
                         (-1, -1), 0.0, None, None, 0, False, check_device=False)


@pytest.mark.parametrize("change,message", [
    # k's heads expanded (stride 0) past the cache's: a copy of k would take 2 GiB.
    (dict(k=torch.zeros(1, 1, 1, 60).half().expand(2, 16, 2**20, 60)), "k must have shape"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), "cache_seqlens must have shape"),
    (dict(), "needs CUDA tensors"),  # a valid call
])
def test_copies_come_after_every_check(monkeypatch, change, message):
    def copy(*args, **kwargs):
        raise AssertionError("copied before the checks")

    monkeypatch.setattr(_head_dims, "pad", copy)
    with pytest.raises(ValueError, match=message):
        run({**call(d=60, new=16), **change})


@pytest.mark.parametrize("api", [fmha.select_kvcache, fmha.explain_kvcache])
def test_select_and_explain_kvcache_describe_the_copies(api):
    """They describe the call fwd_kvcache runs: on the copies, rows 56 elements apart, of the
    operands whose rows are not in place (q's and the caches' here), without copying."""
    kw = call(hq=4, d=53)
    a = _kvcache._described(kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"), None, None,
                            kw.pop("cache_seqlens"), kw, cc=90)
    assert (a.hdim_q, a.hdim_v) == (53, 53)
    assert (a.q_batch_stride, a.q_head_stride, a.k_cache_seq_stride) == (4 * 56, 56, 2 * 56)
    kw = call(hq=4, d=53)
    try:  # the answer for a GPU of that capability, or the miss that says what it asked for
        api(kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"), capability=(9, 0), **kw)
    except fmha.MissingInstanceError as miss:
        assert "hdim_q=53 hdim_v=53" in str(miss)
