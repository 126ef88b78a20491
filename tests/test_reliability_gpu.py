"""Reliability of fmha.fwd on the GPU, against tests/reference.py's float64 reference.

- Big tensors (marker `bigmem`, skipped when the GPU lacks 1.5x the memory a case needs): Q and
  O of more than 2^31 elements, K and V of more than 2^31 elements, a (1, h, s_q, s_k) bias of
  more than 2^31 elements, and a varlen batch whose packed tokens start sequences past 2^31
  elements, in (b, s, h, d) and (b, h, s, d) storage. Only sampled rows are checked (the first
  and last, rows around the 2^30- and 2^31-element offsets of every operand, a few random
  ones): the reference of a row needs that row of Q and the keys it sees.
- Concurrency and CUDA graphs: problems of different traits on 4 streams at once (from one
  thread, and from 4 threads), some identical and sharing inputs, give bitwise the results of
  serial calls; a CUDA graph captured around fmha.fwd replays bitwise like an eager call after
  its inputs changed in place (batch and varlen problems, cu_seqlens changed in place too, a
  bool attn_mask re-converted, dropout with a fixed seed); an unseeded dropout call under
  capture draws its seed once, at capture, so every replay repeats that pattern (documented by
  test_graph_unseeded_dropout_freezes_its_seed). Five runs of the same call are bitwise
  identical, with and without dropout, for instances of every mask kind.
- NaN and Inf: a NaN in a Q row, a NaN in a K row, +-Inf in V, a bias row of -inf or a bool
  attn_mask row of False, and a +inf bias element, under every compiled kind of mask and bias
  (plain, causal both alignments, window, ALiBi, elementwise bias, soft-cap): the NaN and +-Inf
  positions of the output must be those of the float64 reference, the finite values within
  the usual pass rule (reference.compare), and (separately, test_nonfinite_lse) the
  log-sum-exp's too. Where the IEEE reference depends on the tiling (0 * Inf for a key a row
  does not see, +inf logits), the test says what the kernel does and checks that.
- Window sizes near INT_MAX behave as unbounded ones (they used to wrap around in the mask).
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import zlib
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import device_cc, import_fmha  # noqa: E402
from gpu_support import runs_here as _runs_on  # noqa: E402

torch, fmha = import_fmha()
import reference as R  # noqa: E402

DEVICE = "cuda"
DEVICE_CC = device_cc(torch)
# The 16-bit instances (the e4m3 forward's are test_fwd_e4m3_gpu.py's).
INSTANCES = [i for i in fmha.instances() if _runs_on(i, DEVICE_CC) and i["dtype"] in R.DTYPES]
GiB = 2**30
BIG = 2**31  # elements: past int32 offsets


# ---------------------------------------------------------------------------------------------
# Picking instances, running them, comparing results
# ---------------------------------------------------------------------------------------------

PLAIN = dict(mode="batch", mask="none", bias="none", vlayout="row", dropout=False, softcap=False)
HDIM_ORDER = (128, 64, 256, 96, 192, 32)


def _preference(inst) -> tuple:
    hd = inst["hdim_q"]
    return (not R.trait(inst, "pad_seqlen"), not R.trait(inst, "lse"), inst["dtype"] != "bf16",
            HDIM_ORDER.index(hd) if hd in HDIM_ORDER else len(HDIM_ORDER),
            bool(R.trait(inst, "pad_hdim")), inst["hdim_q"] != inst["hdim_v"])


def candidates(**want) -> list:
    """Runnable instances with these traits (unnamed functional traits plain), best first:
    padded sequences, with lse, bf16, hdim 128 then 64, exact head dims."""
    want = {**PLAIN, **want}
    found = [i for i in INSTANCES if all(R.trait(i, k) == v for k, v in want.items())]
    return sorted(found, key=_preference)


def pick(**want):
    found = candidates(**want)
    return found[0] if found else None


def pick_or_skip(**want):
    inst = pick(**want)
    if inst is None:
        traits = ", ".join(f"{k}={v}" for k, v in want.items()) or "plain"
        pytest.skip(f"no runnable instance with {traits} in this build")
    return inst


def spread(insts: list, n: int) -> list:
    """Up to n of `insts`, chosen so that each adds the most trait values not yet covered."""
    keys = ("dtype", "hdim_q", "hdim_v", "bias", "vlayout", "mode", "lse", "softcap",
            "pad_seqlen", "pad_hdim")
    chosen, covered, rest = [], set(), list(insts)
    while rest and len(chosen) < n:
        best = max(rest, key=lambda i: len({(k, R.trait(i, k)) for k in keys} - covered))
        chosen.append(best)
        covered |= {(k, R.trait(best, k)) for k in keys}
        rest.remove(best)
    return chosen


def base_spec(inst, *, padded=dict(b=2, sq=150, sk=130), hq=4, hk=2, **changes) -> "R.Spec":
    """A small batch-mode problem the instance runs: ragged lengths (s_q > s_k, so that a
    bottom-right causal mask leaves rows empty) when it pads, else tile multiples (2 query
    tiles against 1 key tile)."""
    if R.trait(inst, "pad_seqlen"):
        shape = dict(padded)
    else:
        shape = dict(b=padded.get("b", 2), sq=2 * inst["block_m"], sk=inst["block_n"])
    return R.Spec(R.DTYPES[inst["dtype"]], inst["hdim_q"], inst["hdim_v"], hq=hq, hk=hk,
                  **shape).replace(**changes)


def moderate_spec(inst, idx: int) -> "R.Spec":
    """A problem of a few hundred microseconds with the instance's traits (varied by idx), big
    enough that problems on several streams overlap."""
    dtype = R.DTYPES[inst["dtype"]]
    if R.trait(inst, "mode") == "group":
        spec = R.Spec(dtype, inst["hdim_q"], inst["hdim_v"], hq=8, hk=2,
                      seqlens_q=[700, 0, 1000, 1], seqlens_k=[1000, 5, 900, 64])
    elif R.trait(inst, "pad_seqlen"):
        spec = R.Spec(dtype, inst["hdim_q"], inst["hdim_v"], hq=8, hk=2, b=2, sq=1000, sk=1100)
    else:
        spec = R.Spec(dtype, inst["hdim_q"], inst["hdim_v"], hq=8, hk=2, b=2,
                      sq=8 * inst["block_m"], sk=16 * inst["block_n"])
    spec, _ = R.apply_traits(spec, inst, idx)
    reason = R.fits(spec, inst)
    assert not reason, f"{inst['name']}: {spec.describe()} does not fit ({reason})"
    return spec


def run(inst, spec, inputs, **changes):
    """(out, lse) of one forced call; lse None unless the spec asks for it."""
    kwargs = {**inputs.fwd_kwargs, **changes}
    result = fmha.fwd(inputs.q, inputs.k, inputs.v, **kwargs, instance=inst["name"])
    return R.split_result(result, spec)


def keep_of(spec, inputs):
    if not spec.dropout_p:
        return None
    b, h, sq, sk = inputs.keep_shape
    return R.dropout_keep_mask(spec.seed, spec.offset, spec.dropout_p, b, h, sq, sk,
                               device=inputs.q.device)


def check_reference(spec, inputs, out, lse, what):
    """out (and lse) against the float64 reference under reference.compare's pass rule."""
    keep = keep_of(spec, inputs)
    ref, ref_lse = R.attention_reference(inputs.q, inputs.k, inputs.v, **inputs.ref_kwargs,
                                         dropout_keep=keep)
    lowp, _ = R.attention_reference(inputs.q, inputs.k, inputs.v, **inputs.ref_kwargs,
                                    dropout_keep=keep, compute_dtype=spec.dtype)
    return R.compare(out, ref, lowp, dtype=spec.dtype, lse=lse,
                     ref_lse=ref_lse if spec.lse else None, what=f"{what} [{spec.describe()}]")


_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bitwise(got, want, what):
    """Bit-for-bit equality (NaN payloads included)."""
    if want is None:
        assert got is None, f"{what}: unexpected lse"
        return
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: shape/dtype differ"
    gi = got.contiguous().view(_INT_VIEW[got.element_size()])
    wi = want.contiguous().view(_INT_VIEW[want.element_size()])
    if not torch.equal(gi, wi):
        diff = (gi != wi).nonzero()
        idx = tuple(diff[0].tolist())
        raise AssertionError(f"{what}: {diff.shape[0]} elements differ bitwise, first at {idx}: "
                             f"{got[idx].item()!r} vs {want[idx].item()!r}")


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Big tensors: offsets past 2^31 elements
# ---------------------------------------------------------------------------------------------

BIG_HEADS = 16


def _need_memory(nbytes: int, what: str):
    if DEVICE != "cuda":
        return
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < 1.5 * nbytes:
        pytest.skip(f"{what} needs {1.5 * nbytes / GiB:.1f} GiB of free GPU memory "
                    f"(1.5 x {nbytes / GiB:.1f} GiB), {free / GiB:.1f} GiB free")


@pytest.fixture
def release_memory():
    yield
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _rows_past(sq: int, row_offset, heads: int, sample_seed: int) -> list:
    """Rows of a sequence of sq rows to check: the first and last two, the rows on either side
    of every element offset 2^30 (2^31 bytes) and 2^31 of any head, and four random ones.
    row_offset(row, head) is the element offset of (row, head, 0) in its tensor."""
    rows = {0, 1, sq - 2, sq - 1}
    for boundary in (BIG // 2, BIG):
        for h in range(heads):
            lo, hi = 0, sq - 1  # the last row whose offset is <= boundary
            if row_offset(0, h) > boundary:
                continue
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if row_offset(mid, h) <= boundary:
                    lo = mid
                else:
                    hi = mid - 1
            rows |= {lo - 1, lo, lo + 1}
    rng = random.Random(sample_seed)
    rows |= {rng.randrange(sq) for _ in range(4)}
    return sorted(r for r in rows if 0 <= r < sq)


def _check_rows(q, k, v, out, lse, rows, key_range, *, dtype, what, heads=None):
    """Compares rows `rows` of a (b = 1 or group-mode) problem with the float64 reference.

    q: (s_q, h, d) rows of one sequence, or of the packed tokens; k, v: (s_k, h_k, d) of the
    rows' sequence(s); key_range(row) -> (start, end) of the keys that row sees (the mask, or
    its sequence), rows with the same range being compared together. out (s_q, h, dv), lse
    (h, s_q) or None. heads: compare only these query heads (with their K/V heads)."""
    groups = defaultdict(list)
    for r in rows:
        groups[key_range(r)].append(r)
    hq, hk = q.shape[1], k.shape[1]
    for (k0, k1), rs in groups.items():
        idx = torch.tensor(rs, device=q.device)
        head_sets = [None] if heads is None else [[h] for h in heads]
        for hs in head_sets:
            qs, os_ = q.index_select(0, idx), out.index_select(0, idx)
            ks, vs = k[k0:k1], v[k0:k1]
            ls = lse.index_select(1, idx) if lse is not None else None
            if hs is not None:
                kvh = hs[0] // (hq // hk)
                qs, os_ = qs[:, hs], os_[:, hs]
                ks, vs = ks[:, kvh:kvh + 1], vs[:, kvh:kvh + 1]
                ls = ls[hs] if ls is not None else None
            ref, ref_lse = R.attention_reference(qs[None], ks[None], vs[None])
            lowp, _ = R.attention_reference(qs[None], ks[None], vs[None], compute_dtype=dtype)
            R.compare(os_[None], ref, lowp, dtype=dtype,
                      lse=ls[None] if ls is not None else None,
                      ref_lse=ref_lse if ls is not None else None,
                      what=f"{what} rows {rs}" + (f" head {hs[0]}" if hs else ""))


def _big_instance(**want):
    inst = pick_or_skip(pad_seqlen=True, **want)
    return inst, R.DTYPES[inst["dtype"]], inst["hdim_q"], inst["hdim_v"]


def _randn(shape, dtype, layout):
    """A (b, s, h, d) tensor of standard normals, stored (b, s, h, d) or (b, h, s, d)."""
    if layout == "bhsd":
        b, s, h, d = shape
        return torch.randn((b, h, s, d), dtype=dtype, device=DEVICE).transpose(1, 2)
    return torch.randn(shape, dtype=dtype, device=DEVICE)


def _offset_fn(t):
    """row_offset(row, head) of a (s, h, d) view, in elements of its storage."""
    s_stride, h_stride = t.stride(0), t.stride(1)
    return lambda r, h: r * s_stride + h * h_stride


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_big_q_and_out(mask, layout, release_memory):
    """Q and O of more than 2^31 elements (s_q ~ 2^31 / (h d) + 67, 16 heads), short K/V."""
    inst, dtype, d, dv = _big_instance(mask=mask)
    h = BIG_HEADS
    sq = max(-(-BIG // (h * d)), -(-BIG // (h * dv))) + 67
    sk = 256
    lse_on = bool(R.trait(inst, "lse"))
    _need_memory(2 * sq * h * (d + dv) + 4 * h * sq * lse_on + 2 * 2 * sk * h * (d + dv),
                 f"q {(1, sq, h, d)}")
    torch.manual_seed(0)
    q = _randn((1, sq, h, d), dtype, layout)
    k = _randn((1, sk, h, d), dtype, layout)
    v = _randn((1, sk, h, dv), dtype, layout)
    assert q.numel() > BIG and sq * h * dv > BIG
    result = fmha.fwd(q, k, v, causal=mask == "causal", return_lse=lse_on, instance=inst["name"])
    out, lse = result if lse_on else (result, None)
    _sync()
    rows = _rows_past(sq, _offset_fn(q[0]), h, sample_seed=1)
    rows = sorted(set(rows) | set(_rows_past(sq, _offset_fn(out[0]), h, sample_seed=2)))
    # Causal, top-left: row i sees keys 0..i.
    key_range = (lambda r: (0, min(r + 1, sk))) if mask == "causal" else (lambda r: (0, sk))
    _check_rows(q[0], k[0], v[0], out[0], lse[0] if lse is not None else None, rows, key_range,
                dtype=dtype, what=f"{inst['name']} q {tuple(q.shape)} {layout}")


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_big_k_and_v(mask, release_memory):
    """K and V of more than 2^31 elements (s_k ~ 2^31 / (h d) + 67), a few query rows; the
    reference is taken per head (a head's K/V in float64 is ~1 GB)."""
    inst, dtype, d, dv = _big_instance(mask=mask)
    h = BIG_HEADS
    sk = max(-(-BIG // (h * d)), -(-BIG // (h * dv))) + 67
    sq = 67
    lse_on = bool(R.trait(inst, "lse"))
    _need_memory(2 * sk * h * (d + dv) + 3 * 8 * sk * (d + dv), f"k {(1, sk, h, d)}")
    torch.manual_seed(1)
    q = _randn((1, sq, h, d), dtype, "bshd")
    k = _randn((1, sk, h, d), dtype, "bshd")
    v = _randn((1, sk, h, dv), dtype, "bshd")
    assert k.numel() > BIG and v.numel() > BIG
    # Bottom-right causal: row i sees keys 0 .. i + sk - sq.
    result = fmha.fwd(q, k, v, causal=mask == "causal", mask_align="bottom_right",
                      return_lse=lse_on, instance=inst["name"])
    out, lse = result if lse_on else (result, None)
    _sync()
    key_range = ((lambda r: (0, r + sk - sq + 1)) if mask == "causal" else (lambda r: (0, sk)))
    _check_rows(q[0], k[0], v[0], out[0], lse[0] if lse is not None else None, [0, 1, 33, 66],
                key_range, dtype=dtype, what=f"{inst['name']} k {tuple(k.shape)}",
                heads=[0, h - 1])


@pytest.mark.gpu
@pytest.mark.bigmem
def test_big_bias(release_memory):
    """An elementwise bias (1, h, s_q, s_k) of more than 2^31 elements (per-head offsets past
    int32), with Q of fewer."""
    inst, dtype, d, dv = _big_instance(bias="elementwise")
    h, sk = BIG_HEADS, 256
    sq = BIG // (h * sk) + 67
    lse_on = bool(R.trait(inst, "lse"))
    _need_memory(2 * (h * sq * sk + sq * h * (d + dv)) + 4 * h * sq, f"bias {(1, h, sq, sk)}")
    torch.manual_seed(2)
    q = _randn((1, sq, h, d), dtype, "bshd")
    k = _randn((1, sk, h, d), dtype, "bshd")
    v = _randn((1, sk, h, dv), dtype, "bshd")
    bias = torch.randn((1, h, sq, sk), dtype=dtype, device=DEVICE)
    assert bias.numel() > BIG
    result = fmha.fwd(q, k, v, bias=bias, return_lse=lse_on, instance=inst["name"])
    out, lse = result if lse_on else (result, None)
    _sync()
    row_offset = lambda r, hh: hh * sq * sk + r * sk  # noqa: E731  (the bias's own offsets)
    rows = _rows_past(sq, row_offset, h, sample_seed=3)
    for r in rows:  # one row at a time: each has its own bias row
        idx = torch.tensor([r], device=q.device)
        b_rows = bias[:, :, r:r + 1]  # (1, h, 1, sk)
        qs = q[:, r:r + 1]
        ref, ref_lse = R.attention_reference(qs, k, v, bias=b_rows)
        lowp, _ = R.attention_reference(qs, k, v, bias=b_rows, compute_dtype=dtype)
        R.compare(out.index_select(1, idx), ref, lowp, dtype=dtype,
                  lse=lse.index_select(2, idx) if lse is not None else None,
                  ref_lse=ref_lse if lse is not None else None,
                  what=f"{inst['name']} bias {tuple(bias.shape)} row {r}")


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_big_varlen(mask, layout, release_memory):
    """Group mode whose packed Q/O pass 2^31 elements: one sequence straddles the 2^31-element
    offset, the last starts past it; an empty sequence and one without keys between."""
    inst, dtype, d, dv = _big_instance(mode="group", mask=mask)
    h = BIG_HEADS
    edge = max(-(-BIG // (h * d)), -(-BIG // (h * dv)))  # the first token past 2^31 elements
    first = min(700, edge // 4)
    seqlens_q = [first, edge // 2 - first + 5, 0, edge // 2 + 300, 77, 1000]
    seqlens_k = [256, 100, 5, 300, 0, 64]
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    lse_on = bool(R.trait(inst, "lse"))
    _need_memory(2 * total_q * h * (d + dv) + 4 * h * total_q, f"{total_q} packed query tokens")
    torch.manual_seed(3)

    def packed(s, dim):
        if layout == "bhsd":
            return torch.randn((h, s, dim), dtype=dtype, device=DEVICE).transpose(0, 1)
        return torch.randn((s, h, dim), dtype=dtype, device=DEVICE)

    q, k, v = packed(total_q, d), packed(total_k, d), packed(total_k, dv)
    assert q.numel() > BIG
    cu_q = [0]
    cu_k = [0]
    for a, b in zip(seqlens_q, seqlens_k):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    assert cu_q[4] * h * d > BIG, "the fifth sequence starts past 2^31 elements"
    result = fmha.fwd(q, k, v, causal=mask == "causal", mask_align="bottom_right",
                      return_lse=lse_on, instance=inst["name"],
                      cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=DEVICE),
                      cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=DEVICE),
                      max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k))
    out, lse = result if lse_on else (result, None)
    _sync()
    rows = set(_rows_past(total_q, _offset_fn(q), h, sample_seed=4))
    rows |= set(_rows_past(total_q, _offset_fn(out), h, sample_seed=5))
    for b, n in enumerate(seqlens_q):  # every sequence's first and last rows
        if n:
            rows |= {cu_q[b], cu_q[b + 1] - 1}
    for b in range(len(seqlens_q)):
        mine = sorted(r for r in rows if cu_q[b] <= r < cu_q[b + 1])
        if not mine:
            continue
        sq_b, sk_b = seqlens_q[b], seqlens_k[b]

        def key_range(r, b=b, sq_b=sq_b, sk_b=sk_b):
            i = r - cu_q[b]
            end = min(sk_b, max(i + sk_b - sq_b + 1, 0)) if mask == "causal" else sk_b
            return (cu_k[b], cu_k[b] + end)

        _check_rows(q, k, v, out, lse, mine, key_range, dtype=dtype,
                    what=f"{inst['name']} varlen {layout} sequence {b}")


# ---------------------------------------------------------------------------------------------
# Concurrency, CUDA graphs, determinism
# ---------------------------------------------------------------------------------------------

CONCURRENCY_TRAITS = (dict(mask="causal"), dict(), dict(mask="window"), dict(mode="group"),
                      dict(dropout=True), dict(bias="elementwise"), dict(bias="alibi"),
                      dict(softcap=True))


def _problems(limit=6):
    """(instance, spec, inputs) of different traits, each a moderate problem."""
    problems = []
    for want in CONCURRENCY_TRAITS:
        inst = pick(**want)
        if inst is None or any(inst["name"] == p[0]["name"] for p in problems):
            continue
        spec = moderate_spec(inst, len(problems))
        if R.trait(inst, "bias") == "elementwise":
            spec = spec.replace(bias="attn_bool")  # converted inside the call (and the graph)
        problems.append((inst, spec, R.make_inputs(spec, DEVICE, seed=len(problems))))
        if len(problems) == limit:
            break
    if len(problems) < 2:
        pytest.skip("fewer than two kinds of instance run here")
    return problems


# Four streams; each runs these problems (indices modulo their number) in order: the same
# problem on several streams at once, reading the same inputs, and different ones side by side.
STREAM_PLAN = [[0, 1, 2], [1, 0, 3], [2, 2, 0], [3, 1, 1]]


def _serial(problems):
    results = [run(*p) for p in problems]
    _sync()
    for (inst, spec, inputs), (out, lse) in zip(problems, results):
        check_reference(spec, inputs, out, lse, f"{inst['name']} serial")
    return results


@pytest.mark.gpu
def test_streams_match_serial_bitwise():
    problems = _problems()
    serial = _serial(problems)
    n = len(problems)
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in STREAM_PLAN]
    for s in streams:
        s.wait_stream(main)
    results = []  # kept alive until compared: no output reuses another's memory
    for _ in range(3):
        for s, plan in zip(streams, STREAM_PLAN):
            with torch.cuda.stream(s):
                for i in plan:
                    results.append((i % n, run(*problems[i % n])))
    for s in streams:
        main.wait_stream(s)
    torch.cuda.synchronize()
    for i, (out, lse) in results:
        what = f"{problems[i][0]['name']} on a side stream"
        assert_bitwise(out, serial[i][0], what)
        assert_bitwise(lse, serial[i][1], what + " (lse)")


@pytest.mark.gpu
def test_threads_with_own_streams_match_serial_bitwise():
    problems = _problems()
    serial = _serial(problems)
    n = len(problems)
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in STREAM_PLAN]
    for s in streams:
        s.wait_stream(main)
    results = [[] for _ in STREAM_PLAN]
    errors = []
    start = threading.Barrier(len(STREAM_PLAN))

    def work(t):
        try:
            start.wait()
            with torch.cuda.stream(streams[t]):
                for _ in range(3):
                    for i in STREAM_PLAN[t]:
                        results[t].append((i % n, run(*problems[i % n])))
            streams[t].synchronize()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(STREAM_PLAN))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    torch.cuda.synchronize()
    for t, rs in enumerate(results):
        for i, (out, lse) in rs:
            what = f"{problems[i][0]['name']} from thread {t}"
            assert_bitwise(out, serial[i][0], what)
            assert_bitwise(lse, serial[i][1], what + " (lse)")


# A thread whose first CUDA call is fmha's: the autograd engine's device thread in a training
# step (its first backward), or a new thread of the caller's. Run in a process of its own, so
# that a launch with a broken TMA descriptor (the bug this guards) fails the test, not the run.
FIRST_CALL_SCRIPT = """
import threading, torch, fmha
q, k, v, dout = (torch.randn(2, 256, 4, 128, dtype=torch.bfloat16, device="cuda")
                 for _ in range(4))
def step():
    out, lse = fmha.fwd(q, k, v, causal=True, return_lse=True)
    return (out,) + fmha.bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)
want = step()  # the plans exist: the thread's calls reach C++ with no torch CUDA call first
got = []
thread = threading.Thread(target=lambda: got.extend(step()))
thread.start()
thread.join()
torch.cuda.synchronize()
assert len(got) == 4 and all(torch.equal(g, w) for g, w in zip(got, want)), "results differ"
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
fmha.fwd(*leaves, causal=True).backward(dout)
torch.cuda.synchronize()
print("OUTCOME ok")
"""


@pytest.mark.gpu
def test_a_threads_first_cuda_call_may_be_fmhas():
    try:
        fmha.select(*(torch.empty(2, 256, 4, 128, dtype=torch.bfloat16, device=DEVICE)
                      for _ in range(3)), causal=True)
        fmha.select_bwd(*(torch.empty(2, 256, 4, 128, dtype=torch.bfloat16, device=DEVICE)
                          for _ in range(3)), causal=True)
    except fmha.MissingInstanceError as exc:
        pytest.skip(f"no bf16 d128 causal instance in the build: {str(exc)[:80]}")
    done = subprocess.run([sys.executable, "-c", FIRST_CALL_SCRIPT], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "OUTCOME ok" in done.stdout, (
        f"exit {done.returncode}:\n{done.stdout[-1000:]}\n{done.stderr[-2000:]}")


def _capture(fn):
    """(graph, fn's result captured in it), after two warm-up calls on a side stream (as
    torch.cuda.graphs asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


def _refill(inputs, fresh):
    """Copies the values of `fresh` (make_inputs of the same spec, another seed) into the
    tensors of `inputs` in place: q, k, v and the tensor options (bias, attn_mask, slopes)."""
    inputs.q.copy_(fresh.q)
    inputs.k.copy_(fresh.k)
    inputs.v.copy_(fresh.v)
    for name, t in inputs.fwd_kwargs.items():
        if isinstance(t, torch.Tensor) and name not in ("cu_seqlens_q", "cu_seqlens_k",
                                                        "seqused_q", "seqused_k"):
            t.copy_(fresh.fwd_kwargs[name])


@pytest.mark.gpu
def test_graph_replays_like_eager_after_inputs_change():
    """One graph with a call of every problem kind (batch, varlen, bool attn_mask, ALiBi,
    dropout with a fixed seed...): after each in-place change of every input, a replay gives
    bitwise what an eager call gives, and that is right."""
    problems = _problems(limit=8)
    graph, static = _capture(lambda: [run(*p) for p in problems])
    for trial in range(2):
        for i, (inst, spec, inputs) in enumerate(problems):
            _refill(inputs, R.make_inputs(spec, DEVICE, seed=100 + 10 * trial + i))
        graph.replay()
        torch.cuda.synchronize()
        eager = [run(*p) for p in problems]
        torch.cuda.synchronize()
        for (inst, spec, inputs), (s_out, s_lse), (e_out, e_lse) in zip(problems, static, eager):
            what = f"{inst['name']} graph replay {trial}"
            assert_bitwise(s_out, e_out, what)
            assert_bitwise(s_lse, e_lse, what + " (lse)")
            check_reference(spec, inputs, s_out, s_lse, what)


@pytest.mark.gpu
def test_graph_varlen_with_cu_seqlens_changed_in_place():
    """A varlen graph captured with max_seqlen_q/k as bounds: cu_seqlens changed in place (the
    same number of sequences, none longer than the bounds) replay like an eager call."""
    inst = None
    for want in (dict(mode="group", mask="causal"), dict(mode="group"),
                 dict(mode="group", mask="window"), dict(mode="group", bias="alibi")):
        inst = pick(**want)
        if inst is not None:
            break
    if inst is None:
        pytest.skip("no runnable group-mode instance without bias tensor or dropout")
    spec = R.Spec(R.DTYPES[inst["dtype"]], inst["hdim_q"], inst["hdim_v"], hq=4, hk=2,
                  seqlens_q=[300, 1, 599, 300], seqlens_k=[500, 0, 600, 200])
    spec, _ = R.apply_traits(spec, inst, 1)
    assert not R.fits(spec, inst), R.fits(spec, inst)
    inputs = R.make_inputs(spec, DEVICE, seed=7)
    bounds = dict(max_seqlen_q=600, max_seqlen_k=600)
    inputs.fwd_kwargs.update(bounds)
    inputs.ref_kwargs.update(bounds)
    graph, static = _capture(lambda: run(inst, spec, inputs))
    layouts = [([0, 100, 600, 600, 1200], [0, 50, 600, 1150, 1300]),
               ([0, 0, 1, 601, 1200], [0, 600, 600, 1200, 1300])]
    for trial, (cu_q, cu_k) in enumerate(layouts):
        _refill(inputs, R.make_inputs(spec, DEVICE, seed=20 + trial))
        inputs.fwd_kwargs["cu_seqlens_q"].copy_(torch.tensor(cu_q, dtype=torch.int32))
        inputs.fwd_kwargs["cu_seqlens_k"].copy_(torch.tensor(cu_k, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        e_out, e_lse = run(inst, spec, inputs)
        torch.cuda.synchronize()
        check_reference(spec, inputs, static[0], static[1], f"{inst['name']} replay {trial}")
        # Rows outside every sequence are not written: compare the written ones.
        rows = torch.zeros(static[0].shape[0], dtype=torch.bool, device=DEVICE)
        for b in range(len(cu_q) - 1):
            rows[cu_q[b]:cu_q[b + 1]] = True
        assert_bitwise(static[0][rows], e_out[rows], f"{inst['name']} varlen replay {trial}")
        if static[1] is not None:
            assert_bitwise(static[1][:, rows], e_lse[:, rows], f"{inst['name']} lse {trial}")


@pytest.mark.gpu
def test_graph_dropout_with_fixed_seed():
    inst = pick_or_skip(dropout=True)
    spec = moderate_spec(inst, 0).replace(dropout_p=0.3, seed=2**40 + 5, offset=9)
    inputs = R.make_inputs(spec, DEVICE, seed=3)
    graph, static = _capture(lambda: run(inst, spec, inputs))
    for trial in range(2):
        _refill(inputs, R.make_inputs(spec, DEVICE, seed=30 + trial))
        graph.replay()
        torch.cuda.synchronize()
        eager = run(inst, spec, inputs)
        torch.cuda.synchronize()
        assert_bitwise(static[0], eager[0], f"{inst['name']} dropout replay {trial}")
        assert_bitwise(static[1], eager[1], f"{inst['name']} dropout replay {trial} (lse)")
        check_reference(spec, inputs, static[0], static[1], f"{inst['name']} dropout replay")


@pytest.mark.gpu
def test_graph_capture_refuses_unseeded_dropout():
    """fmha.fwd without dropout_seed draws the seed from torch's CPU generator when the call is
    made. Under CUDA graph capture that would happen once, and every replay would repeat one
    dropout pattern (unlike torch's own dropout, whose graph-safe Philox offsets advance per
    replay), so the capture refuses it with an error that says to pass the seed."""
    inst = pick_or_skip(dropout=True)
    spec = moderate_spec(inst, 0).replace(dropout_p=0.3)
    inputs = R.make_inputs(spec, DEVICE, seed=4)
    kwargs = {k: v for k, v in inputs.fwd_kwargs.items() if k != "dropout_seed"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fmha.fwd(inputs.q, inputs.k, inputs.v, **kwargs, instance=inst["name"])  # eager: fine
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="dropout_seed"):
        with torch.cuda.graph(graph):
            fmha.fwd(inputs.q, inputs.k, inputs.v, **kwargs, instance=inst["name"])


def _determinism_cases():
    for mask in ("none", "causal", "window"):
        for dropout in (False, True):
            insts = [i for i in INSTANCES if R.trait(i, "mask") == mask
                     and bool(R.trait(i, "dropout")) == dropout]
            for inst in spread(insts, 3):
                yield pytest.param(inst, id=inst["name"])


@pytest.mark.gpu
@pytest.mark.parametrize("inst", list(_determinism_cases()))
def test_five_runs_are_bitwise_identical(inst):
    spec = moderate_spec(inst, 1)
    inputs = R.make_inputs(spec, DEVICE, seed=11)
    results = [run(inst, spec, inputs) for _ in range(5)]  # all alive: distinct outputs
    _sync()
    check_reference(spec, inputs, results[0][0], results[0][1], f"{inst['name']} run 0")
    for n, (out, lse) in enumerate(results[1:], 1):
        assert_bitwise(out, results[0][0], f"{inst['name']} run {n}")
        assert_bitwise(lse, results[0][1], f"{inst['name']} run {n} (lse)")


# ---------------------------------------------------------------------------------------------
# NaN and Inf in the inputs
# ---------------------------------------------------------------------------------------------

# name: (instance traits, spec changes)
SCENARIOS = {
    "plain": (dict(), dict()),
    "causal_tl": (dict(mask="causal"), dict(causal=True, align="top_left")),
    "causal_br": (dict(mask="causal"), dict(causal=True, align="bottom_right")),
    "window": (dict(mask="window"), dict(window=(24, 8), align="top_left")),
    "alibi": (dict(bias="alibi"), dict(alibi="head")),
    "bias": (dict(bias="elementwise"), dict(bias="11")),
    "bias_causal": (dict(bias="elementwise", mask="causal"),
                    dict(bias="11", causal=True, align="bottom_right")),
    "softcap": (dict(softcap=True), dict(softcap=20.0)),
}
BIAS_SCENARIOS = ("bias", "bias_causal")
KINDS = {
    "nan_q": tuple(SCENARIOS),
    "nan_k": tuple(SCENARIOS),
    "inf_v": tuple(SCENARIOS),
    "neginf_bias_row": BIAS_SCENARIOS,
    "false_mask_row": BIAS_SCENARIOS,
    "posinf_bias": BIAS_SCENARIOS,
}


def _nonfinite_cases():
    for kind, scenarios in KINDS.items():
        for sc in scenarios:
            yield pytest.param(kind, sc, id=f"{kind}-{sc}")


class Poisoned:
    """One scenario's problem with one kind of non-finite input planted: the instance, spec,
    inputs, the planted positions, and the kernel's and the reference's results."""

    def __init__(self, kind, scenario):
        want, changes = SCENARIOS[scenario]
        self.inst = pick_or_skip(**want)
        self.kind = kind
        # Logits of moderate size, so that no visible probability underflows (0 * Inf).
        self.spec = base_spec(self.inst, qscale=0.5, **changes)
        if self.spec.lse is False and R.trait(self.inst, "lse"):
            self.spec = self.spec.replace(lse=True)
        reason = R.fits(self.spec, self.inst)
        assert not reason, f"{self.inst['name']}: {reason}"
        self.inputs = inp = R.make_inputs(self.spec, DEVICE,
                                          seed=zlib.crc32(f"{kind}-{scenario}".encode()))
        sp = self.spec
        if "alibi_slopes" in inp.fwd_kwargs:
            inp.fwd_kwargs["alibi_slopes"].mul_(0.02)  # shared with ref_kwargs
        vis = self.visible().cpu()
        seeing = vis.any(dim=1).nonzero().flatten().tolist()
        assert len(seeing) >= 9, f"{self.inst['name']}: too few rows see keys"
        self.q_row = seeing[-1]  # the last row that sees keys
        row_keys = vis[self.q_row].nonzero().flatten().tolist()
        self.pos_key = row_keys[len(row_keys) // 2]  # a key it sees
        self.key = sp.sk // 2
        self.bias_rows = (seeing[-5], seeing[-7], seeing[-9])  # rows that see keys
        self.inf_keys = {}  # V column -> the keys with an Inf in it
        nan = float("nan")
        inf = float("inf")
        if kind == "nan_q":
            inp.q[1, self.q_row, 1, 3] = nan
            inp.q[0, 0, 0, 0] = nan  # row 0: sees no key under causal_br (output 0)
        elif kind == "nan_k":
            inp.k[1, self.key, 1, 0] = nan
        elif kind == "inf_v":
            j = sp.sk // 3
            inp.v[0, j, 0, 5] = inf
            inp.v[0, j + 1, 0, 6] = -inf
            inp.v[0, j, 0, 7] = inf  # + and - Inf in one column: NaN
            inp.v[0, j + 2, 0, 7] = -inf
            self.inf_keys = {5: [j], 6: [j + 1], 7: [j, j + 2]}
        elif kind == "neginf_bias_row":
            inp.fwd_kwargs["bias"][0, 0, self.bias_rows[0], :] = -inf
        elif kind == "false_mask_row":
            gen = torch.Generator().manual_seed(5)
            allowed = (torch.rand((sp.b, sp.hq, sp.sq, sp.sk), generator=gen) < 0.9).to(DEVICE)
            allowed[1, 2, self.bias_rows[1], :] = False
            allowed[:, :, self.bias_rows[2], :] = False
            for kw in (inp.fwd_kwargs, inp.ref_kwargs):
                kw.pop("bias")
                kw["attn_mask"] = allowed
        elif kind == "posinf_bias":
            inp.fwd_kwargs["bias"][0, 0, self.q_row, self.pos_key] = inf
        else:
            raise ValueError(kind)
        out, lse = run(self.inst, self.spec, inp)
        _sync()
        self.out, self.lse = out, lse
        self.ref, self.ref_lse = R.attention_reference(inp.q, inp.k, inp.v, **inp.ref_kwargs)
        self.lowp, _ = R.attention_reference(inp.q, inp.k, inp.v, **inp.ref_kwargs,
                                             compute_dtype=self.spec.dtype)
        self.what = f"{kind} {self.inst['name']} [{self.spec.describe()}]"

    def visible(self):
        """bool (s_q, s_k): which keys each row sees under the scenario's mask."""
        sp = self.spec
        left, right = R.window_bounds(sp.causal, sp.window)
        return R.visible(sp.sq, sp.sk, left, right, sp.align, device=self.inputs.q.device)


def _positions(mask: torch.Tensor, limit=4) -> str:
    idx = mask.nonzero()
    return f"{idx.shape[0]} at {[tuple(i) for i in idx[:limit].tolist()]}"


def assert_same_nonfinite(got, want, what, region=None):
    """NaN, +inf and -inf at exactly the same elements (within `region` when given)."""
    for name, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        g, w = test(got), test(want)
        if region is not None:
            g, w = g & region, w & region
        if not torch.equal(g, w):
            only_ref = w & ~g
            got_there = ""
            if only_ref.any():
                first = tuple(only_ref.nonzero()[0].tolist())
                got_there = f" (there the kernel has {got[first].item()!r})"
            raise AssertionError(
                f"{what}: {name} positions differ from the float64 reference: kernel only "
                f"{_positions(g & ~w)}; reference only {_positions(only_ref)}{got_there}")


def compare_finite(got, ref, lowp, dtype, what, region=None):
    """reference.compare on the elements that are finite in both (and in `region`)."""
    keep = torch.isfinite(ref) & torch.isfinite(got.double())
    if region is not None:
        keep &= region
    nan = float("nan")
    R.compare(got.double().masked_fill(~keep, nan), ref.masked_fill(~keep, nan),
              lowp.double().masked_fill(~keep, nan), dtype=dtype, what=what)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,scenario", list(_nonfinite_cases()))
def test_nonfinite_output(kind, scenario):
    """The output's NaN and +-Inf are where the float64 reference has them; finite values pass
    the usual rule. Semantics checked on top, in words:
      nan_q: that row's output is NaN in every column; a NaN row that sees no key gives 0.
      nan_k: every row that sees the key is NaN, rows the mask hides it from are untouched.
      inf_v: rows that see the key get +-Inf in its columns (NaN where + and - meet).
      neginf_bias_row / false_mask_row: a row whose logits are all -inf gives 0, not NaN.
      posinf_bias: see test_posinf_bias (here: the other rows)."""
    p = Poisoned(kind, scenario)
    out, ref, sp = p.out, p.ref, p.spec
    if kind == "posinf_bias":
        others = torch.ones_like(ref, dtype=torch.bool)
        others[:, p.q_row] = False
        assert_same_nonfinite(out, ref, p.what, region=others)
        compare_finite(out, ref, p.lowp, sp.dtype, p.what, region=others)
        return
    if kind == "inf_v" and not all(bool(p.visible()[:, keys].all())
                                   for keys in p.inf_keys.values()):
        _check_inf_v_masked(p)
        return
    assert_same_nonfinite(out, ref, p.what)
    compare_finite(out, ref, p.lowp, sp.dtype, p.what)
    vis = p.visible()
    if kind == "nan_q":
        assert torch.isnan(out[1, p.q_row, 1]).all(), f"{p.what}: the NaN row is not all NaN"
        if not vis[0].any():
            assert (out[0, 0, 0] == 0).all(), f"{p.what}: a NaN row that sees no key must be 0"
    elif kind == "nan_k":
        heads = list(range(sp.hq))[sp.hq // sp.hk:2 * sp.hq // sp.hk]  # the K head's q heads
        sees = vis[:, p.key]
        assert torch.isnan(out[1][sees][:, heads]).all(), f"{p.what}: a row that sees it is not NaN"
        assert not torch.isnan(out[1][~sees]).any(), f"{p.what}: a row that cannot see it is NaN"
    elif kind == "neginf_bias_row":
        r = p.bias_rows[0]
        assert (out[:, r] == 0).all(), f"{p.what}: the all -inf row {r} must be 0, not NaN"
    elif kind == "false_mask_row":
        r1, r2 = p.bias_rows[1:]
        assert (out[1, r1, 2] == 0).all(), f"{p.what}: the all-False row {r1} must be 0"
        assert (out[:, r2] == 0).all(), f"{p.what}: the all-False row {r2} must be 0"


def _check_inf_v_masked(p: "Poisoned"):
    """Inf in V at keys some rows do not see. The float64 reference computes P @ V with
    P = 0 at hidden keys, and 0 * Inf = NaN: every row that does not see an Inf key is NaN in
    its column. The kernel skips the key tiles the mask hides entirely and multiplies by 0 only
    inside the edge tiles it visits: a hidden Inf gives NaN there and nothing elsewhere, so which
    rows get NaN depends on the tiling. Checked, per (row, column) of batch 0 and the K head's
    query heads: a row that sees every Inf key of the column exactly as the reference; a row
    that sees none of them NaN or, where finite, the reference without the Inf (the hidden
    keys' true contribution, nothing); a row that sees some of them non-finite. Everything else
    exactly as the reference."""
    sp, out, inp = p.spec, p.out, p.inputs
    vis = p.visible()
    group = sp.hq // sp.hk
    strict = torch.ones_like(out, dtype=torch.bool)
    hidden = torch.zeros_like(out, dtype=torch.bool)
    partial = torch.zeros_like(out, dtype=torch.bool)
    for col, keys in p.inf_keys.items():
        sees = vis[:, keys]
        all_, none_ = sees.all(dim=1), ~sees.any(dim=1)
        strict[0, :, :group, col] = all_.view(-1, 1)
        hidden[0, :, :group, col] = none_.view(-1, 1)
        partial[0, :, :group, col] = (~all_ & ~none_).view(-1, 1)
    assert_same_nonfinite(out, p.ref, p.what, region=strict)
    compare_finite(out, p.ref, p.lowp, sp.dtype, p.what, region=strict)
    assert not (torch.isinf(out) & hidden).any(), (
        f"{p.what}: Inf in a row that sees no Inf key: {_positions(torch.isinf(out) & hidden)}")
    assert not (torch.isfinite(out) & partial).any(), (
        f"{p.what}: finite where a row sees some Inf keys: "
        f"{_positions(torch.isfinite(out) & partial)}")
    v_clean = inp.v.clone()
    v_clean[~torch.isfinite(v_clean)] = 0
    ref0, _ = R.attention_reference(inp.q, inp.k, v_clean, **inp.ref_kwargs)
    low0, _ = R.attention_reference(inp.q, inp.k, v_clean, **inp.ref_kwargs,
                                    compute_dtype=sp.dtype)
    compare_finite(out, ref0, low0, sp.dtype, p.what + " (rows that see no Inf key)",
                   region=hidden)


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", BIAS_SCENARIOS)
def test_posinf_bias(scenario):
    """A +inf logit makes the softmax inf / inf: undefined. The kernel gives NaN in the whole row
    (the running max becomes +inf and exp2(inf - inf) is NaN), like torch.softmax; reference.py
    computes P = exp(s - 0) once its log-sum-exp is not finite and returns +-Inf in that row
    (log-sum-exp +inf). Both are non-finite; the kernel's row must be all NaN."""
    p = Poisoned("posinf_bias", scenario)
    assert p.visible()[p.q_row, p.pos_key], "the +inf key must be visible to its row"
    row = p.out[:, p.q_row]
    assert torch.isnan(row).all(), (
        f"{p.what}: a row with a +inf logit must be NaN (softmax of inf), got "
        f"{_positions(~torch.isnan(row))} non-NaN")
    assert not torch.isfinite(p.ref[:, p.q_row]).any(), "the reference row is non-finite too"
    s = torch.tensor([float("inf"), 1.0, -2.0], dtype=torch.float64)
    assert torch.isnan(torch.softmax(s, 0)).all(), "torch.softmax of a +inf logit is NaN"


@pytest.mark.gpu
@pytest.mark.parametrize("kind,scenario", list(_nonfinite_cases()))
def test_nonfinite_lse(kind, scenario):
    """The log-sum-exp of rows with non-finite logits: NaN where the reference has NaN (a NaN
    logit the row sees), -inf only for rows that see no finite logit (all -inf); a +inf logit
    may give +inf (the reference) or NaN (undefined), never -inf, which would claim the row
    saw no key. Other rows as the reference."""
    p = Poisoned(kind, scenario)
    if p.lse is None:
        pytest.skip(f"{p.inst['name']} has no lse")
    lse, ref = p.lse, p.ref_lse
    if kind == "posinf_bias":
        row = lse[:, :, p.q_row]
        assert not torch.isneginf(row).any(), (
            f"{p.what}: lse -inf for a row with a +inf logit (it says 'no key seen'); "
            f"want +inf or NaN, got {row.flatten()[:4].tolist()}")
        assert (torch.isnan(row) | torch.isposinf(row)).all(), f"{p.what}: lse {row}"
        region = torch.ones_like(ref, dtype=torch.bool)
        region[:, :, p.q_row] = False
    else:
        region = None
    assert_same_nonfinite(lse, ref, p.what + " (lse)", region=region)
    keep = torch.isfinite(ref) & torch.isfinite(lse)
    if region is not None:
        keep &= region
    d = (lse.double() - ref).abs()[keep]
    tol = 1e-3 + 1e-4 * ref.abs()[keep]
    assert (d <= tol).all(), f"{p.what}: lse error {d.max().item():.3g}"


# ---------------------------------------------------------------------------------------------
# Window sizes at the top of int
# ---------------------------------------------------------------------------------------------

INT_MAX = 2**31 - 1


@pytest.mark.gpu
@pytest.mark.parametrize("window,align", [
    ((INT_MAX, INT_MAX), "top_left"),
    ((INT_MAX, INT_MAX), "bottom_right"),
    ((INT_MAX, 0), "bottom_right"),
    ((0, INT_MAX), "top_left"),
    ((INT_MAX - 5, 3), "bottom_right"),
])
def test_huge_window_sizes_act_unbounded(window, align):
    """window_size entries near INT_MAX see like -1 (unbounded): row + offset +- size must not
    wrap around in the mask (it hid every key before mask.cuh clamped the sizes)."""
    inst = pick_or_skip(mask="window")
    spec = base_spec(inst, window=window, align=align)
    if R.trait(inst, "lse"):
        spec = spec.replace(lse=True)
    inputs = R.make_inputs(spec, DEVICE, seed=12)
    out, lse = run(inst, spec, inputs)
    _sync()
    check_reference(spec, inputs, out, lse, f"{inst['name']} window {window} {align}")
