"""GPU correctness of every compiled KV-cache instance (fmha.fwd_kvcache) against the float64
reference (tests/reference.py's kvcache_reference), on fresh random inputs and a poisoned
allocator: decode (one query token) and several query tokens, MQA/GQA/MHA, contiguous caches
(with cache_batch_idx) and paged ones (pages of 1 to 256 tokens in shuffled order), empty and
full caches, k/v appended in place with and without rotary (both layouts), forced and chosen
key splits, a step whose sequences and heads alone fill every SM (an instance's full-grid
tile), and each instance's own mask, ALiBi and soft-cap, and a NaN in the cache reaching
exactly the rows it reaches in the reference. Head-dim-padded instances also run head dims
below their own: a multiple of 8 and one that is not, in place where the rows start on 16-byte
boundaries and on the copies fwd_kvcache makes where they do not. The cache the call leaves is
checked too: appended rows as the reference rotates them, every other row untouched.

e4m3 caches (instances of kv_dtype e4m3) run the same cases: codes drawn over e4m3's whole
exponent range (subnormals included), scales per tensor, per K/V head or per sequence and K/V
head, appends quantized (and saturated) by the kernel; the truth is the float64 attention of
the dequantized caches, and the appended codes must be the reference's exactly (within one e4m3
step where rotary rounds k first). Chunked prefill from an e4m3 cache (fa3 on sm90a, head dims
64 and 128: the cache widened to fp16 in shared memory) runs the prefill cases too, and chunks
of 128, 200 and 512 query tokens on ragged caches through the dispatcher, which must choose it
(test_e4m3_chunked_prefill)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import pytest

from gpu_support import device_cc, import_fmha, runs_here
from reference import (DTYPES, compare, kvcache_reference, kvcache_reference_e4m3,
                       poison_allocator, ulp)

torch, fmha = import_fmha()
if not hasattr(fmha, "fwd_kvcache"):
    pytest.skip("this fmha build predates fwd_kvcache; rebuild it", allow_module_level=True)

CC = device_cc(torch)
INSTANCES = [i for i in fmha.kvcache_instances() if runs_here(i, CC)]
# The decode instances run every call; the prefill ones chunks of at least block_m tokens.
DECODE_INSTANCES = [i for i in INSTANCES if not i["prefill"]]
PADDED_INSTANCES = [i for i in DECODE_INSTANCES if i["pad_hdim"]]
SAME_DTYPE_DECODE_INSTANCES = [i for i in DECODE_INSTANCES if i["kv_dtype"] == "same"]
# Where a NaN in the cache stays a NaN: every instance but e4m3's built for sm80, which has no
# e4m3 conversion and reads a NaN code as 480 x scale (e4m3_cache.cuh).
NAN_KEEPING_INSTANCES = [i for i in DECODE_INSTANCES
                         if i["kv_dtype"] == "same" or i["arch"] != "sm80"]


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    nhead_q: int
    nhead_k: int
    capacity: int           # keys a sequence's cache holds
    lengths: tuple          # cache_seqlens, before the append
    seqlen_new: int = 0     # k/v appended
    rotary: Optional[str] = None  # None, "neox" or "gptj" (interleaved)
    rotary_fraction: float = 1.0  # rotary_dim / headdim
    num_splits: int = 0
    page_size: int = 0      # paged instances' page size (contiguous ones take the capacity)
    batch_idx: bool = False  # contiguous instances: map sequences to shuffled cache rows
    leftpad: tuple = ()     # contiguous instances: cache_leftpad, where each sequence's keys start
    cache_layout: str = "nhd"  # the caches' memory order (_cache_tensor)
    head_dims: tuple = ()   # the call's (q and k, v) head dims; (): the instance's own
    q_scale: float = 1.0    # q times this power of two, the softmax scale divided by it

    def describe(self) -> str:
        return (f"b{self.batch} sq{self.seqlen_q} h{self.nhead_q}/{self.nhead_k} "
                f"cap{self.capacity} len{list(self.lengths)} new{self.seqlen_new} "
                f"rot={self.rotary} splits={self.num_splits} page={self.page_size} "
                f"leftpad={list(self.leftpad)} layout={self.cache_layout}"
                f"{f' d{self.head_dims}' if self.head_dims else ''}"
                f"{f' q_scale={self.q_scale:g}' if self.q_scale != 1.0 else ''}")


CASES = (
    # Decode, GQA 8:1: an empty cache, one key, a long one; splits chosen.
    Case(3, 1, 8, 1, 512, (0, 1, 300), page_size=16),
    # Decode with the new token appended and rotated (GPT-NeoX, half the head dim), 3 splits.
    Case(2, 1, 8, 2, 384, (17, 250), seqlen_new=1, rotary="neox", rotary_fraction=0.5,
         num_splits=3, page_size=64, batch_idx=True),
    # Several query tokens (speculative decoding, chunked prefill), MHA, interleaved rotary.
    Case(3, 5, 4, 4, 640, (0, 100, 377), seqlen_new=5, rotary="gptj", num_splits=1,
         page_size=7),
    # 28 packed rows (two row blocks), a cache filled to its last key by the append.
    Case(2, 7, 8, 2, 320, (313, 64), seqlen_new=7, page_size=256, batch_idx=True),
    # Long caches: many splits from the heuristic.
    Case(2, 1, 16, 2, 4096, (4000, 1234), page_size=16),
    # More splits than a short sequence has key tiles: idle splits.
    Case(2, 3, 2, 1, 1024, (5, 1000), seqlen_new=3, rotary="neox", num_splits=9, page_size=64),
    # Twenty forced splits of a few key tiles each, more than the heuristic picks.
    Case(1, 2, 8, 1, 2048, (1900,), num_splits=20, page_size=16),
    # Pages of one key (64 table entries a key tile) and of 12 (a thread's run of 8 rows at
    # d128 crosses pages; one of 4 at d64 does not), the new token appended.
    Case(2, 1, 4, 1, 300, (299, 40), seqlen_new=1, page_size=1),
    Case(2, 1, 8, 2, 600, (431, 590), seqlen_new=1, page_size=12),
    # Left-padded sequences (cache_leftpad, contiguous caches): one whose only key is the
    # appended token, 3 splits over the rest; then several query tokens, rotated (positions stay
    # the cache's rows), in shuffled cache rows.
    Case(3, 1, 8, 2, 700, (650, 300, 64), seqlen_new=1, num_splits=3, leftpad=(100, 0, 64)),
    Case(2, 4, 8, 1, 512, (400, 37), seqlen_new=4, rotary="neox", batch_idx=True,
         leftpad=(123, 30)),
)

# Chunked prefill: the prefill instances (fa3 on sm90a) take calls of at least block_m query
# tokens (192 at d64) on pages of a multiple of 8 keys; the decode instances run them too.
PREFILL_CASES = (
    # A sequence's first chunk (an empty cache) beside a later one, GQA 4:1, pages of 16: a
    # 128-key tile spans 8 pages.
    Case(2, 200, 8, 2, 1024, (0, 500), seqlen_new=200, page_size=16),
    # The last chunk fills the cache to its end, rotated (GPT-NeoX, half the head dim), MHA;
    # contiguous caches in shuffled rows.
    Case(1, 256, 4, 4, 768, (512,), seqlen_new=256, rotary="neox", rotary_fraction=0.5,
         page_size=64, batch_idx=True),
    # No append, MQA, pages of 48 (16-key boxes): under a causal mask the first rows of the
    # sequence with 100 keys see none (output 0, log-sum-exp -inf).
    Case(3, 193, 8, 1, 640, (100, 0, 447), page_size=48),
    # Several query tiles against long caches, interleaved rotary, pages of 256 (two 128-key
    # tiles a page).
    Case(2, 300, 16, 2, 2048, (1500, 700), seqlen_new=300, rotary="gptj", page_size=256),
    # The caches' memory orders, each a TMA map of its own on the fa3 pipeline
    # (cached_kv_sm90.cuh's CacheFold): head-major pages of 16 (heads fold into pages) and a
    # contiguous cache of 1001 keys a row (a length no 8-row group divides: boxes of 8 rows);
    # head-major rows of 512 keys; rows padded past the head dim (no dimensions merge).
    Case(2, 200, 8, 2, 1001, (600, 0), seqlen_new=200, page_size=16, cache_layout="hnd"),
    Case(2, 256, 4, 2, 512, (256, 100), page_size=64, cache_layout="hnd", batch_idx=True),
    Case(1, 256, 8, 2, 1024, (640,), seqlen_new=256, rotary="neox", page_size=32,
         cache_layout="padded"),
)

MASK_WINDOWS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)),
                "window": (False, (37, 0))}
SOFTCAP = 5.0


def _cache_tensor(randn, layout: str, rows: int, keys: int, heads: int, d: int):
    """A (rows, keys, heads, d) cache in memory order `layout`: "nhd" packed in that order;
    "hnd" a row's heads one after another (a (rows, heads, keys, d) tensor, transposed);
    "padded" each key's heads in a row of d + 64 columns (no two dimensions merge); "pitched"
    rows of d up to a multiple of 8 (a head dim that is none, read in place)."""
    if layout == "hnd":
        return randn(rows, heads, keys, d).transpose(1, 2)
    if layout == "padded":
        return randn(rows, keys, heads, d + 64)[..., :d]
    return _operand(randn, layout, rows, keys, heads, d)


def _operand(randn, layout: str, *shape):
    """q, k or v (and an "nhd" or "pitched" cache): rows of the head dim up to a multiple of 8
    where the layout is "pitched", else packed."""
    if layout == "pitched":
        return randn(*shape[:-1], shape[-1] + -shape[-1] % 8)[..., :shape[-1]]
    return randn(*shape)


def _e4m3_codes(gen: torch.Generator):
    """A maker of e4m3 tensors whose codes span the format's exponents, subnormals to 448."""
    def codes(*shape):
        exponents = torch.randint(-9, 7, shape, generator=gen, device="cuda").float()
        x = torch.randn(*shape, generator=gen, device="cuda") * exponents.exp2()
        return x.clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes


def _e4m3_scales(case: Case, gen: torch.Generator) -> tuple:
    """k_scale and v_scale, per tensor, per K/V head or per sequence and K/V head (as the
    generator draws), small enough that some appended values saturate at 448."""
    shape = ((), (case.nhead_k,), (case.batch, case.nhead_k))[
        int(torch.randint(3, (1,), generator=gen, device="cuda"))]
    return tuple(0.003 + 0.03 * torch.rand(shape, generator=gen, device="cuda")
                 for _ in range(2))


def _inputs(inst: dict, case: Case, gen: torch.Generator):
    dtype = DTYPES[inst["dtype"]]
    d, dv = case.head_dims or (inst["hdim_q"], inst["hdim_v"])
    dev = "cuda"

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    cached = _e4m3_codes(gen) if inst["kv_dtype"] == "e4m3" else randn

    b, hk = case.batch, case.nhead_k
    kw = {}
    if inst["paged"]:
        pages_per_seq = math.ceil(case.capacity / case.page_size)
        num_pages = b * pages_per_seq + 3  # spare pages no sequence owns
        k_cache = _cache_tensor(cached, case.cache_layout, num_pages, case.page_size, hk, d)
        v_cache = _cache_tensor(cached, case.cache_layout, num_pages, case.page_size, hk, dv)
        order = torch.randperm(num_pages, generator=gen, device=dev)[:b * pages_per_seq]
        kw["block_table"] = order.view(b, pages_per_seq).to(torch.int32)
        capacity = pages_per_seq * case.page_size
    else:
        rows = b + 2 if case.batch_idx else b
        k_cache = _cache_tensor(cached, case.cache_layout, rows, case.capacity, hk, d)
        v_cache = _cache_tensor(cached, case.cache_layout, rows, case.capacity, hk, dv)
        if case.batch_idx:
            kw["cache_batch_idx"] = torch.randperm(rows, generator=gen, device=dev)[:b].to(
                torch.int32)
        capacity = case.capacity
        if case.leftpad:
            kw["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32, device=dev)
    assert all(n + case.seqlen_new <= capacity for n in case.lengths), case
    kw["cache_seqlens"] = torch.tensor(case.lengths, dtype=torch.int32, device=dev)
    q = _operand(randn, case.cache_layout, b, case.seqlen_q, case.nhead_q, d)
    if case.q_scale != 1.0:  # a power of two: exact in q's dtype, and the logits unchanged
        q = q * case.q_scale
        kw["softmax_scale"] = 1.0 / (math.sqrt(d) * case.q_scale)
    if case.seqlen_new:
        kw["k"] = _operand(randn, case.cache_layout, b, case.seqlen_new, hk, d)
        kw["v"] = _operand(randn, case.cache_layout, b, case.seqlen_new, hk, dv)
    if case.rotary:
        rotary_dim = int(d * case.rotary_fraction) // 2 * 2
        angles = torch.rand(capacity, rotary_dim // 2, generator=gen, device=dev) * 2 * math.pi
        kw["rotary_cos"] = angles.cos().to(dtype)
        kw["rotary_sin"] = angles.sin().to(dtype)
        kw["rotary_interleaved"] = case.rotary == "gptj"
    causal, window = MASK_WINDOWS[inst["mask"]]
    kw["causal"], kw["window_size"] = causal, window
    if inst["bias"] == "alibi":
        kw["alibi_slopes"] = torch.rand(case.nhead_q, generator=gen, device=dev) * 0.3
    if inst["softcap"]:
        kw["softcap"] = SOFTCAP
    if inst["kv_dtype"] == "e4m3":
        kw["k_scale"], kw["v_scale"] = _e4m3_scales(case, gen)
    return q, k_cache, v_cache, kw


def _check_cache_e4m3(name: str, got, want, before, rotated: bool, what: str):
    """An e4m3 cache as the call leaves it: codes outside the append untouched, appended codes
    the reference's (one e4m3 step apart at most where k was rotated: the kernel's fp32
    rotation and the reference's float64 one may round to neighbouring 16-bit values)."""
    g, w, b = (t.view(torch.uint8) for t in (got, want, before))
    changed = (w != b).any(-1, keepdim=True).expand_as(w)
    assert torch.equal(g[~changed], w[~changed]), f"{what}: {name} rows outside the append moved"
    if not rotated:
        assert torch.equal(g[changed], w[changed]), f"{what}: {name} appended codes differ"
        return
    gv, wv = got.float()[changed], want.float()[changed]
    step = (wv.abs().clamp(min=2.0 ** -6).log2().floor() - 3).exp2()
    assert ((gv - wv).abs() <= step).all(), f"{what}: {name} appended codes off by more than a step"


def _check(inst: dict, case: Case, instance: Optional[str], seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k_cache, v_cache, kw = _inputs(inst, case, gen)
    dtype = q.dtype
    e4m3 = inst["kv_dtype"] == "e4m3"
    reference = kvcache_reference_e4m3 if e4m3 else kvcache_reference
    before_k, before_v = k_cache.clone(), v_cache.clone()
    new = {name: kw.pop(name) for name in ("k", "v") if name in kw}
    truth, truth_lse, want_k, want_v = reference(
        q, before_k, before_v, new.get("k"), new.get("v"), **kw)
    lowp, _, _, _ = reference(q, before_k, before_v, new.get("k"), new.get("v"), **kw,
                              compute_dtype=dtype)
    dv = v_cache.shape[-1]
    out_shape = (case.batch, case.seqlen_q, case.nhead_q, dv + -dv % 8)  # rows 16 bytes apart
    poison_allocator([(out_shape, dtype), ((case.batch, case.nhead_q, case.seqlen_q),
                                           torch.float32)], q.device)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        out, lse = fmha.fwd_kvcache(q, k_cache, v_cache, new.get("k"), new.get("v"), **kw,
                                    num_splits=case.num_splits, return_lse=True,
                                    instance=instance)
    torch.cuda.synchronize()
    # Copies of the caches are what a serving loop must hear of; caches whose rows start 16
    # bytes apart run in place.
    copied = any("copies them" in str(w.message) for w in warned)
    piece = 16 // k_cache.element_size()  # elements of a 16-byte piece
    in_place = all(t.stride(-1) == 1 and all(s % piece == 0 for s in t.stride()[:-1])
                   for t in (k_cache, v_cache))
    assert copied != in_place, f"caches in place: {in_place}, warned of copies: {copied}"
    assert out.shape == truth.shape, (out.shape, truth.shape)
    what = f"{instance or 'dispatcher'} [{case.describe()}]"
    compare(out, truth, lowp, dtype=dtype, lse=lse, ref_lse=truth_lse, what=what)
    if e4m3:
        rotated = case.rotary is not None and case.seqlen_new > 0
        _check_cache_e4m3("k_cache", k_cache, want_k, before_k, rotated, what)
        _check_cache_e4m3("v_cache", v_cache, want_v, before_v, False, what)
        return
    # The cache: appended rows within one rounding of the reference's (the kernel rotates in
    # fp32, the reference in float64, each rounding once), every other row bitwise untouched.
    for name, got, want in (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)):
        changed = (want != before_k if name == "k_cache" else want != before_v)
        same = ~changed.any(-1, keepdim=True).expand_as(want)
        assert torch.equal(got[same], want[same]), f"{what}: {name} rows outside the append moved"
        diff = (got.double() - want.double()).abs().max().item()
        assert diff <= 2 * ulp(want.double().abs().max().item(), dtype), (
            f"{what}: {name} appended rows off by {diff}")


@pytest.mark.gpu
@pytest.mark.parametrize("case_index", range(len(CASES)))
@pytest.mark.parametrize("inst", DECODE_INSTANCES, ids=lambda i: i["name"])
def test_instance(inst, case_index):
    case = CASES[case_index]
    if case.leftpad and inst["paged"]:
        pytest.skip("cache_leftpad offsets a contiguous cache's rows; paged caches take none")
    _check(inst, case, inst["name"], seed=case_index)


def _full_grid_case() -> Case:
    """A decode step of more sequences x K/V heads than the GPU has SMs: an instance with a
    full-grid tile (instances.yaml's `full_grid`) runs it on that one. Lengths from 0 to the
    capacity, the new token appended and rotated, pages of 16."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = sms // 4 + 1
    return Case(batch, 1, 16, 4, 400, tuple(i * 53 % 400 for i in range(batch)), seqlen_new=1,
                rotary="neox", page_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("inst", DECODE_INSTANCES, ids=lambda i: i["name"])
def test_a_step_that_fills_every_sm(inst):
    _check(inst, _full_grid_case(), inst["name"], seed=300)


# Head dims below a padded instance's own: the next multiple of 8 down, one that is no
# multiple of 8 (a partial last 16-byte piece), and a narrower v (as (192, 128) runs on d192's),
# in place ("pitched" rows) and on the copies fwd_kvcache makes of packed tensors ("nhd").
# Cases of CASES: appended and rotated (NeoX on half the head dim), several rotated query
# tokens on pages of 7, pages of 12, left padding.
PADDED_CASES = (1, 2, 8, 9)


def _padded_dims(inst: dict) -> tuple:
    own = inst["hdim_q"]
    return (own - 8, own - 8), (own // 2 + 3, own // 2 + 3), (own, own // 2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["pitched", "nhd"])
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("case_index", PADDED_CASES)
@pytest.mark.parametrize("inst", PADDED_INSTANCES, ids=lambda i: i["name"])
def test_padded_head_dims(inst, case_index, which, layout):
    case = CASES[case_index]
    if case.leftpad and inst["paged"]:
        pytest.skip("cache_leftpad offsets a contiguous cache's rows; paged caches take none")
    head_dims = _padded_dims(inst)[which]
    if layout == "nhd" and all(d % 8 == 0 for d in head_dims):
        pytest.skip("packed rows of a multiple of 8 are in place: the pitched case covers it")
    case = dataclasses.replace(case, head_dims=head_dims, cache_layout=layout)
    _check(inst, case, inst["name"], seed=100 + case_index)


@pytest.mark.gpu
@pytest.mark.parametrize("poisoned", ["k", "v"])
@pytest.mark.parametrize("inst", NAN_KEEPING_INSTANCES, ids=lambda i: i["name"])
def test_nan_in_the_cache_stays_in_its_rows(inst, poisoned):
    """A NaN in one cached key (or value) of one sequence and K/V head makes NaN exactly the
    output rows the float64 reference makes NaN (the query heads of that K/V head, and their
    log-sum-exps where it is a key), through the key splits, the warps' merge and the combine;
    every other row matches the reference."""
    case = Case(2, 1, 4, 2, 512, (300, 300), num_splits=3, page_size=16)
    gen = torch.Generator(device="cuda").manual_seed(77)
    q, k_cache, v_cache, kw = _inputs(inst, case, gen)
    key = 280  # inside every mask's view of the last query (the window keeps 37 keys back)
    cache = k_cache if poisoned == "k" else v_cache
    if inst["paged"]:
        page = int(kw["block_table"][0, key // case.page_size])
        cache[page, key % case.page_size, 0, 0] = float("nan")
    else:
        cache[0, key, 0, 0] = float("nan")
    reference = kvcache_reference_e4m3 if inst["kv_dtype"] == "e4m3" else kvcache_reference
    truth, truth_lse, _, _ = reference(q, k_cache, v_cache, **kw)
    lowp, _, _, _ = reference(q, k_cache, v_cache, **kw, compute_dtype=q.dtype)
    out, lse = fmha.fwd_kvcache(q, k_cache, v_cache, **kw, num_splits=case.num_splits,
                                return_lse=True, instance=inst["name"])
    torch.cuda.synchronize()
    what = f"{inst['name']} [NaN in the {poisoned} cache]"
    assert truth.isnan().any(), f"{what}: the reference never sees the poisoned key"
    assert torch.equal(out.isnan(), truth.isnan()), f"{what}: NaN rows differ from the reference"
    assert torch.equal(lse.isnan(), truth_lse.isnan()), f"{what}: NaN log-sum-exps differ"
    # compare() skips the reference's NaN elements; the log-sum-exps' NaNs were checked above.
    compare(out, truth, lowp, dtype=q.dtype, lse=lse.nan_to_num(0.0),
            ref_lse=truth_lse.nan_to_num(0.0), what=what)


@pytest.mark.gpu
@pytest.mark.parametrize("case_index", range(len(PREFILL_CASES)))
@pytest.mark.parametrize("inst", INSTANCES, ids=lambda i: i["name"])
def test_chunked_prefill(inst, case_index):
    """Every instance on chunks of many query tokens: the prefill ones are made for them, the
    decode ones run them where no prefill instance is built (sm80, ALiBi, soft-cap)."""
    case = PREFILL_CASES[case_index]
    if case.seqlen_q < inst["block_m"] and inst["prefill"]:
        pytest.skip(f"{inst['name']} takes chunks of at least {inst['block_m']} query tokens")
    _check(inst, case, inst["name"], seed=100 + case_index)


# Chunked prefill from an e4m3 cache (fa3 on sm90a at head dims 64 and 128; d256 chunks run the
# decode kernel): chunks of 128, 200 and 512 query tokens on caches of 700 and 1500 keys (a
# 128-token chunk at d64 is under its 192-row tile, but 512 or 1024 packed rows choose prefill
# all the same), with and without the chunk appended, GQA 4:1 and 8:1, pages of 16 and 64 keys
# (a paged instance) or a contiguous cache; and bf16 queries past fp16's range (x 2^20, the
# softmax scale divided by it), which the kernel converts to fp16 times a power of two.
E4M3_PREFILL_CASES = (
    Case(2, 128, 16, 2, 2048, (700, 1500), seqlen_new=128, page_size=16),
    Case(2, 128, 8, 2, 2048, (700, 1500), page_size=64),
    Case(2, 200, 8, 2, 2048, (700, 1500), seqlen_new=200, page_size=64),
    Case(2, 200, 16, 2, 2048, (1500, 700), page_size=16),
    Case(2, 512, 8, 2, 2048, (700, 1500), seqlen_new=512, page_size=16),
    Case(2, 512, 16, 2, 2048, (700, 1500), page_size=64),
    Case(2, 200, 8, 2, 2048, (700, 1500), seqlen_new=200, page_size=64, q_scale=2.0 ** 20),
)


def _e4m3_prefill_instance(dtype: str, hdim: int, mask: str, paged: bool) -> Optional[dict]:
    """The chunked-prefill instance of an e4m3 cache with these traits that runs on this GPU
    (no ALiBi, no soft-cap), or None where the build has none."""
    return next((i for i in INSTANCES
                 if i["prefill"] and i["kv_dtype"] == "e4m3" and i["dtype"] == dtype
                 and i["hdim_q"] == i["hdim_v"] == hdim and i["mask"] == mask
                 and i["paged"] == paged and i["bias"] == "none" and not i["softcap"]), None)


@pytest.mark.gpu
@pytest.mark.parametrize("case_index", range(len(E4M3_PREFILL_CASES)))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_e4m3_chunked_prefill(dtype, hdim, mask, paged, case_index):
    """A chunk from an e4m3 cache runs the chunked-prefill instance of its traits where the
    build has one (fmha.select_kvcache says so), through the dispatcher, against the float64
    attention of the dequantized cache (codes x k_scale, v_scale) within twice the error of the
    same attention in q's dtype, on a poisoned output; the appended codes are the reference's."""
    case = E4M3_PREFILL_CASES[case_index]
    if case.q_scale != 1.0 and dtype != "bf16":
        pytest.skip("only bf16 queries pass fp16's range")
    inst = _e4m3_prefill_instance(dtype, hdim, mask, paged)
    if inst is None:
        pytest.skip(f"the build has no chunked-prefill instance of an e4m3 cache for {dtype} "
                    f"d{hdim} mask={mask} {'paged' if paged else 'contiguous'} on this GPU "
                    f"(sm{CC}): such chunks run a decode instance where the build has one, else "
                    f"what compile on demand builds")
    seed = 400 + case_index
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k_cache, v_cache, kw = _inputs(inst, case, gen)
    assert fmha.select_kvcache(q, k_cache, v_cache, **kw)["name"] == inst["name"]
    _check(inst, case, None, seed=seed)


@pytest.mark.gpu
def test_prefill_dispatch():
    """The dispatcher runs a chunk on a prefill instance where one fits, a decode step on a
    decode instance, and a prefill instance named for a decode step says why it cannot."""
    traits = ("dtype", "kv_dtype", "hdim_q", "mask", "bias", "paged", "softcap", "arch")
    pairs = [(p, d) for p in INSTANCES if p["prefill"] and p["paged"]
             for d in SAME_DTYPE_DECODE_INSTANCES if all(p[t] == d[t] for t in traits)]
    if not pairs:
        pytest.skip("no prefill instance with a decode instance of its traits runs on this GPU")
    inst, decode = pairs[0]
    gen = torch.Generator(device="cuda").manual_seed(5)
    chunk = PREFILL_CASES[3]
    q, k_cache, v_cache, kw = _inputs(inst, chunk, gen)
    for appended_or_rotary in ("k", "v", "rotary_cos", "rotary_sin", "rotary_interleaved"):
        kw.pop(appended_or_rotary)
    assert fmha.select_kvcache(q, k_cache, v_cache, **kw)["name"] == inst["name"]
    step = q[:, :1].contiguous()
    assert fmha.select_kvcache(step, k_cache, v_cache, **kw)["name"] == decode["name"]
    with pytest.raises(ValueError, match="prefill instance"):
        fmha.fwd_kvcache(step, k_cache, v_cache, **kw, instance=inst["name"])


@pytest.mark.gpu
def test_dispatcher_and_explain():
    """Without `instance` the dispatcher picks a fitting instance, which select_kvcache names
    and explain_kvcache describes."""
    if not DECODE_INSTANCES:
        pytest.skip("no decode kvcache instance runs on this GPU")
    inst = DECODE_INSTANCES[0]
    case = CASES[1]
    _check(inst, case, None, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k_cache, v_cache, kw = _inputs(inst, case, gen)
    chosen = fmha.select_kvcache(q, k_cache, v_cache, **kw)
    assert chosen["name"] in {i["name"] for i in INSTANCES}
    text = fmha.explain_kvcache(q, k_cache, v_cache, **kw)
    assert chosen["name"] in text


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["same", "e4m3"])
def test_graph_replay_with_new_lengths(kv_dtype):
    """A decode step captured in a CUDA graph replays with new lengths and tokens in place
    (and an e4m3 cache with new scales)."""
    instances = [i for i in DECODE_INSTANCES if i["kv_dtype"] == kv_dtype]
    if not instances:
        pytest.skip(f"no decode kvcache instance of kv_dtype {kv_dtype} runs on this GPU")
    inst = next((i for i in instances if i["mask"] == "causal"), instances[0])
    reference = kvcache_reference_e4m3 if kv_dtype == "e4m3" else kvcache_reference
    case = Case(2, 1, 8, 2, 512, (100, 7), seqlen_new=1, rotary="neox", page_size=16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k_cache, v_cache, kw = _inputs(inst, case, gen)
    k_new, v_new = kw.pop("k"), kw.pop("v")
    fmha.fwd_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, **kw)  # plan, warm-up
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = fmha.fwd_kvcache(q, k_cache, v_cache, k_new, v_new, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    for step, lengths in enumerate(((300, 12), (0, 511))):
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        k_new.copy_(torch.randn(k_new.shape, generator=gen, device="cuda"))
        kw["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        if kv_dtype == "e4m3":
            for name in ("k_scale", "v_scale"):
                kw[name].uniform_(0.003, 0.03, generator=gen)
        before_k, before_v = k_cache.clone(), v_cache.clone()
        truth, _, _, _ = reference(q, before_k, before_v, k_new, v_new, **kw)
        lowp, _, _, _ = reference(q, before_k, before_v, k_new, v_new, **kw,
                                  compute_dtype=q.dtype)
        graph.replay()
        torch.cuda.synchronize()
        compare(out, truth, lowp, dtype=q.dtype, what=f"graph replay {step} {lengths}")
