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


# ---- an FP8 (e4m3) cache ----------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn


def e4m3_call(b=2, hk=2, d=64, k_scale="head", v_scale="head", **overrides):
    """A valid call on an e4m3 cache (bf16 queries): scales per K/V head unless said, "tensor"
    for one scale, "sequence" for one per sequence and K/V head, None for none."""
    def scale(kind):
        return {"head": torch.ones(hk), "tensor": torch.ones(()), "sequence": torch.ones(b, hk),
                None: None}[kind] if isinstance(kind, (str, type(None))) else kind
    kw = call(b=b, hk=hk, d=d, dtype=torch.bfloat16, **overrides)
    for name in ("k_cache", "v_cache"):
        if name not in overrides:
            kw[name] = kw[name].to(E4M3)
    kw.update(k_scale=scale(k_scale), v_scale=scale(v_scale))
    return kw


E4M3_BAD_CALLS = [
    ("no scales", dict(k_scale=None, v_scale=None), ValueError,
     "an e4m3 cache (torch.float8_e4m3fn) needs k_scale and v_scale"),
    ("no v_scale", dict(v_scale=None), ValueError, "v_scale is missing"),
    ("scale a float", dict(k_scale=1.0), TypeError, "k_scale must be a torch.Tensor or None"),
    ("scale fp16", dict(v_scale=torch.ones(2).half()), ValueError,
     "v_scale must be torch.float32, got torch.float16"),
    ("scale per query head", dict(k_scale=torch.ones(8)), ValueError,
     "k_scale must have shape () or (1,) (one for the tensor), (2,) (one per K/V head) or (2, 2) "
     "(one per sequence and K/V head), got (8,)"),
    ("scale 3-d", dict(k_scale=torch.ones(2, 2, 1)), ValueError, "got (2, 2, 1)"),
    ("one cache e4m3", dict(v_cache=torch.randn(2, 128, 2, 64).bfloat16()), ValueError,
     "k_cache and v_cache must hold one dtype, got torch.float8_e4m3fn and torch.bfloat16"),
    ("a cache of another dtype", dict(k_cache=torch.randn(2, 128, 2, 64).to(torch.float8_e5m2)),
     ValueError, "k_cache must be torch.bfloat16 (q's dtype) or torch.float8_e4m3fn (an FP8 "
                 "cache, with k_scale and v_scale), got torch.float8_e5m2"),
    ("head dim 40", dict(d=40), ValueError,
     "an e4m3 cache's head dims must be multiples of 16 (its rows move in whole 16-byte pieces "
     "of 16 elements, and it is written in place, never copied), got 40 for k_cache and 40"),
    ("head dim 60", dict(d=60), ValueError, "an e4m3 cache's head dims must be multiples of 16"),
    ("rows 8 bytes apart", dict(k_cache=torch.empty(2, 128, 2, 72, dtype=E4M3)[..., :64]),
     ValueError, "k_cache has strides (18432, 144, 72, 1); every one but the head dim's must be "
                 "a multiple of 16 elements (its rows move in 16-byte pieces)"),
    ("new keys in e4m3", dict(k=torch.randn(2, 1, 2, 64).to(E4M3),
                              v=torch.randn(2, 1, 2, 64).to(E4M3)), ValueError,
     "k must be torch.bfloat16, got torch.float8_e4m3fn"),
]


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in E4M3_BAD_CALLS],
                         ids=[c[0] for c in E4M3_BAD_CALLS])
def test_bad_e4m3_call(overrides, error, message):
    kw = {**e4m3_call(d=overrides.pop("d", 64)), **overrides}
    with pytest.raises(error) as info:
        run(kw)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("scale", [torch.ones(()), torch.ones(1), torch.ones(2, 2)])
def test_a_cache_of_the_queries_dtype_takes_no_scale(scale):
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"{name} dequantizes an e4m3 cache "
                                             r"\(torch.float8_e4m3fn\); a torch.float16 cache "
                                             "takes none"):
            run(call(**{name: scale}))


@pytest.mark.parametrize("scales", ["tensor", "head", "sequence"])
@pytest.mark.parametrize("paged", [False, True])
def test_good_e4m3_calls_get_through_the_checks(scales, paged):
    # As far as a CPU goes: the device check, the last one.
    for new in (0, 3):
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            run(e4m3_call(k_scale=scales, v_scale=scales, paged=paged, new=new))


def test_e4m3_scales_are_checked_on_the_caches_device():
    # Fake CUDA tensors (shapes, dtypes and devices without memory) reach the device check.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        def cuda(shape, dtype=torch.float32):
            return torch.empty(shape, dtype=dtype, device="cuda")
        kw = dict(q=cuda((2, 1, 8, 64), torch.bfloat16), k_cache=cuda((2, 128, 2, 64), E4M3),
                  v_cache=cuda((2, 128, 2, 64), E4M3),
                  cache_seqlens=cuda((2,), torch.int32), k_scale=cuda((2,)),
                  v_scale=torch.ones(2))
        with pytest.raises(ValueError, match="v_scale is on cpu but q is on cuda:0"):
            run(kw)


def described(kw, cc=90):
    q, k_cache, v_cache = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache")
    k, v = kw.pop("k", None), kw.pop("v", None)
    return _kvcache._described(q, k_cache, v_cache, k, v, kw.pop("cache_seqlens"), kw, cc=cc)


@pytest.mark.parametrize("scale, strides", [
    (torch.ones(()), (0, 0)), (torch.ones(1), (0, 0)), (torch.ones(2), (0, 1)),
    (torch.ones(2, 2), (2, 1)),
    (torch.ones(2).expand(2, 2), (0, 1)),  # per head, broadcast over the batch
    (torch.ones(2, 4)[:, ::2], (4, 2)),  # a strided view
])
def test_scales_become_batch_and_head_strides(scale, strides):
    a = described(e4m3_call(k_scale=scale, v_scale=torch.ones(2, 2)))
    assert a.kv_dtype == fmha._C.KV_DTYPE_E4M3 == a.traits()["kv_dtype"]
    assert (a.k_scale_batch_stride, a.k_scale_head_stride) == strides
    assert (a.v_scale_batch_stride, a.v_scale_head_stride) == (2, 1)
    # select and explain mark them given, as a call has them.
    assert a.k_scale != 0 and a.v_scale != 0
    # The cache's strides are in its elements (bytes).
    assert (a.k_cache_batch_stride, a.k_cache_seq_stride, a.k_cache_head_stride) == (
        128 * 2 * 64, 2 * 64, 64)


def test_a_cache_of_the_queries_dtype_keeps_its_args():
    a = described(call())
    assert a.kv_dtype == fmha._C.KV_DTYPE_SAME == a.traits()["kv_dtype"]
    assert (a.k_scale, a.v_scale, a.k_scale_batch_stride, a.v_scale_head_stride) == (0, 0, 0, 0)


@pytest.mark.parametrize("api", [fmha.select_kvcache, fmha.explain_kvcache])
def test_select_and_explain_kvcache_name_the_cache_dtype(api):
    """Their answer (an instance, or the miss of a build without one) names kv_dtype."""
    kw = e4m3_call(d=128)
    q, k_cache, v_cache = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache")
    try:
        answer = api(q, k_cache, v_cache, capability=(9, 0), **kw)
    except fmha.MissingInstanceError as miss:
        assert "dtype=bf16 kv_dtype=e4m3 hdim_q=128 hdim_v=128" in str(miss)
        assert "FMHA_FILTER='kvcache,bf16,hdim128,kv_dtype=e4m3," in str(miss)
        return
    if api is fmha.select_kvcache:
        assert answer["kv_dtype"] == "e4m3" and "_kve4m3_" in answer["name"]
        assert answer["pipeline"] == "fa2" and not answer["pad_hdim"]
    else:
        assert "kv_dtype=e4m3" in answer


def test_the_plan_key_holds_the_scales_layouts():
    def key(**scales):
        kw = e4m3_call(**scales)
        return _kvcache._call_key(
            kw["q"], kw["k_cache"], kw["v_cache"], None, None, kw["cache_seqlens"], None, None,
            None, None, None, None, kw["k_scale"], kw["v_scale"], False, False, (-1, -1), 0.0,
            None, 0, False, None)
    assert key() == key() is not None
    # Per head, for the tensor, per sequence and head, per head broadcast over the sequences,
    # and per sequence and head transposed: five layouts, five plans.
    assert len({key(), key(k_scale="tensor"), key(v_scale="sequence"),
                key(k_scale=torch.ones(2).expand(2, 2)), key(k_scale=torch.ones(2, 2).t())}) == 5
    assert key(k_scale=None) != key()
    # A scale that is no plain tensor gets no key: the call runs every check.
    assert key(k_scale=1.0) is None


class FakeKvcacheArgs:
    """Stands in for a plan's _C.KvcacheArgs: records what _KvcachePlan.run passes to C++."""

    hdim_v = 64

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)
        return None


def test_a_plan_passes_the_scales_pointers_per_call(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    plan = _kvcache._KvcachePlan(FakeKvcacheArgs(), (2, 1, 8, 64), None, 0, -1)
    for scales in ("head", "sequence"):
        kw = e4m3_call(k_scale=scales, v_scale=scales)
        plan.run(kw["q"], kw["k_cache"], kw["v_cache"], None, None, kw["cache_seqlens"], None,
                 None, None, None, None, None, kw["k_scale"], kw["v_scale"], None)
        run_args = plan.args.runs[-1]
        # ..., alibi_slopes, k_scale, v_scale, workspace, stream, instance
        assert run_args[-5:] == (kw["k_scale"].data_ptr(), kw["v_scale"].data_ptr(), 0, 0, None)
    kw = call()
    plan.run(kw["q"], kw["k_cache"], kw["v_cache"], None, None, kw["cache_seqlens"], None, None,
             None, None, None, None, None, None, None)
    assert plan.args.runs[-1][-5:-3] == (0, 0)  # no scales: null pointers


def test_an_e4m3_cache_is_never_copied():
    """A head dim that is no multiple of 8 runs the other operands on padded copies, but never a
    cache of e4m3, which the kernel writes in place: the checks refuse it first."""
    cache = torch.empty(2, 64, 2, 60, dtype=E4M3)
    assert not _head_dims.rows_copied(cache)
    assert not _head_dims.kvcache_needs_copies(cache)
    with pytest.raises(ValueError, match="is never padded or copied"):
        _head_dims.pad(cache)
    with pytest.raises(ValueError, match="an e4m3 cache's head dims must be multiples of 16"):
        run(e4m3_call(d=60))
