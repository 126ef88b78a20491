"""The float64 reference of the GPU tests (tests/reference.py), checked on the CPU.

Against torch SDPA where SDPA has the feature (no mask, top-left causal, attn_mask, GQA), against
element-by-element loops written from fmha.h's wording where it has not (windows, bottom-right
alignment, ALiBi, soft-capping, dropout), group mode against per-sequence batch calls, and its
Philox against Random123's known-answer vectors and against philox.cuh compiled on the host.
The backward reference's gradients against SDPA's autograd where SDPA has the feature, and
against central differences of the forward reference for every feature; the GPU backward
tests' cases and pass rule against a CPU stand-in for fmha.bwd.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference as R  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
PHILOX_HEADER = REPO_ROOT / "runtime" / "include" / "fmha" / "kernels" / "philox.cuh"
f64 = torch.float64


def rand(*shape, seed=0, dtype=f64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def qkv(b=2, sq=7, sk=9, hq=4, hk=2, d=16, dv=12, seed=0, dtype=f64):
    return (rand(b, sq, hq, d, seed=seed, dtype=dtype),
            rand(b, sk, hk, d, seed=seed + 1, dtype=dtype),
            rand(b, sk, hk, dv, seed=seed + 2, dtype=dtype))


def to_bhsd(t):
    return t.transpose(1, 2)


def sdpa(q, k, v, **kw):
    """SDPA on (b, s, h, d) tensors, K/V heads repeated for GQA."""
    hq, hk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(hq // hk, dim=2)
    v = v.repeat_interleave(hq // hk, dim=2)
    return to_bhsd(F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), **kw))


# ------------------------------------------------------------------------------------------
# Philox4x32-10 and the keep pattern
# ------------------------------------------------------------------------------------------

# Random123's kat_vectors for philox4x32_10: counter, key, expected output words.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    words = R.philox4x32_10(counter, key)
    assert tuple(int(w) for w in words) == expected


def test_philox_vectorized_equals_scalar():
    # The three KAT counters as one batch (same key per call, so one key at a time).
    for counter, key, expected in KAT:
        cols = [torch.tensor([c, c]) for c in counter]
        words = R.philox4x32_10(cols, key)
        assert [w.tolist() for w in words] == [[e, e] for e in expected]


def test_mulhilo_is_exact():
    g = torch.Generator().manual_seed(1)
    b = torch.randint(0, 2**32, (1000,), generator=g, dtype=torch.int64)
    b = torch.cat([b, torch.tensor([0, 1, 0xFFFFFFFF, 0x80000000, 0xFFFF, 0x10000])])
    for a in (R.PHILOX_M0, R.PHILOX_M1, 0xFFFFFFFF, 1, 0):
        hi, lo = R._mulhilo32(a, b)
        for bi, h, l in zip(b.tolist(), hi.tolist(), lo.tolist()):
            assert (h, l) == ((a * bi) >> 32, (a * bi) & 0xFFFFFFFF)


def test_threshold_rule():
    assert R.dropout_threshold(0.0) == 0
    assert R.dropout_threshold(0.5) == 2**31
    assert R.dropout_threshold(1.0) == 0xFFFFFFFF
    p32 = torch.tensor(0.1, dtype=torch.float32).item()  # the float the C++ API receives
    assert R.dropout_threshold(0.1) == int(p32 * 2**32)


def test_keep_pattern_is_the_spec_word_by_word():
    seed, offset, p = (7 << 32) | 0x1234, 5, 0.37
    b, h, sq, sk = 2, 3, 21, 11  # rows past one 16-row block, both halves of it
    keep = R.dropout_keep_mask(seed, offset, p, b, h, sq, sk)
    assert keep.shape == (b, h, sq, sk) and keep.dtype == torch.uint8
    thr = R.dropout_threshold(p)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                for j in range(sk):
                    words = R.philox4x32_10((j // 2, (i // 16) * 8 + i % 8, bi * h + hi, offset),
                                            (seed & 0xFFFFFFFF, seed >> 32))
                    word = 2 * ((i // 8) % 2) + j % 2
                    assert keep[bi, hi, i, j].item() == int(int(words[word]) >= thr)


def test_keep_depends_on_seed_offset_and_position():
    base = R.dropout_keep_mask(1, 0, 0.5, 2, 2, 16, 16)
    assert not torch.equal(base, R.dropout_keep_mask(2, 0, 0.5, 2, 2, 16, 16))
    assert not torch.equal(base, R.dropout_keep_mask(1 + (1 << 32), 0, 0.5, 2, 2, 16, 16))
    assert not torch.equal(base, R.dropout_keep_mask(1, 1, 0.5, 2, 2, 16, 16))
    # A function of (b, h, i, j): a larger request contains the smaller one.
    big = R.dropout_keep_mask(1, 0, 0.5, 2, 2, 20, 23)
    assert torch.equal(big[:, :, :16, :16], base)
    assert not torch.equal(base[0, 0], base[0, 1]) and not torch.equal(base[0, 0], base[1, 0])


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_keep_fraction(p):
    keep = R.dropout_keep_mask(12345, 0, p, 2, 4, 128, 129)
    n = keep.numel()
    frac = keep.double().mean().item()
    if p == 0:
        assert frac == 1.0
    else:
        assert abs(frac - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


def test_keep_of_p_one_keeps_almost_nothing():
    assert R.dropout_keep_mask(3, 0, 1.0, 1, 1, 64, 64).sum().item() == 0


PHILOX_PROGRAM = r"""
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include "fmha/kernels/philox.cuh"
int main(int argc, char** argv) {
  uint64_t seed = strtoull(argv[1], nullptr, 0);
  uint32_t offset = strtoul(argv[2], nullptr, 0);
  float p = strtof(argv[3], nullptr);
  int b = atoi(argv[4]), h = atoi(argv[5]), sq = atoi(argv[6]), sk = atoi(argv[7]);
  uint32_t thr = fmha::philox::drop_threshold(p);
  for (int bh = 0; bh < b * h; ++bh)
    for (int i = 0; i < sq; ++i)
      for (int j = 0; j < sk; ++j) {
        fmha::philox::Words w = fmha::philox::dropout_words(seed, offset, bh, i, j);
        putchar(w.w[fmha::philox::dropout_word(i, j)] >= thr ? '1' : '0');
      }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler")
@pytest.mark.parametrize("seed,offset,p", [(0, 0, 0.5), ((0xDEADBEEF << 32) | 99, 7, 0.17),
                                           (2**64 - 1, 2**32 - 1, 0.9)])
def test_keep_matches_philox_header(tmp_path, seed, offset, p):
    """The torch pattern equals the one philox.cuh's host path computes."""
    if not PHILOX_HEADER.exists():
        pytest.skip(f"{PHILOX_HEADER} is missing")
    src = tmp_path / "philox.cpp"
    src.write_text(PHILOX_PROGRAM)
    exe = tmp_path / "philox"
    subprocess.run(["c++", "-std=c++17", "-O1", "-I", str(REPO_ROOT / "runtime" / "include"),
                    str(src), "-o", str(exe)], check=True, capture_output=True, timeout=120)
    b, h, sq, sk = 2, 3, 19, 13
    out = subprocess.run([str(exe), str(seed), str(offset), repr(p), str(b), str(h), str(sq),
                          str(sk)], check=True, capture_output=True, text=True, timeout=60).stdout
    want = torch.tensor([int(c) for c in out], dtype=torch.uint8).reshape(b, h, sq, sk)
    assert torch.equal(R.dropout_keep_mask(seed, offset, p, b, h, sq, sk), want)


# ------------------------------------------------------------------------------------------
# Against torch SDPA
# ------------------------------------------------------------------------------------------


def test_matches_sdpa_plain():
    q, k, v = qkv(hq=4, hk=4, d=16, dv=16)
    out, _ = R.attention_reference(q, k, v)
    torch.testing.assert_close(out, sdpa(q, k, v), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 5)])
def test_matches_sdpa_causal_top_left(sq, sk):
    q, k, v = qkv(sq=sq, sk=sk, hq=4, hk=4, d=16, dv=16)
    out, _ = R.attention_reference(q, k, v, causal=True)
    if sq > sk:  # SDPA's rows that see nothing are NaN or 0 by version: compare the others
        torch.testing.assert_close(out[:, :sk], sdpa(q, k, v, is_causal=True)[:, :sk])
    else:
        torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(2, 4, 7, 9), (1, 1, 7, 9), (2, 1, 7, 9), (1, 4, 7, 9), (7, 9),
                                   (2, 1, 1, 9)])
def test_matches_sdpa_float_attn_mask(shape):
    q, k, v = qkv(sq=7, sk=9, hq=4, hk=4, d=16, dv=16)
    mask = rand(*shape, seed=9)
    out, lse = R.attention_reference(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)
    out_b, lse_b = R.attention_reference(q, k, v, bias=mask)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b)


def test_matches_sdpa_bool_attn_mask():
    q, k, v = qkv(sq=7, sk=9, hq=4, hk=4, d=16, dv=16)
    mask = torch.rand(2, 4, 7, 9, generator=torch.Generator().manual_seed(3)) < 0.7
    mask[..., 0] = True  # SDPA gives NaN for rows that see nothing
    out, _ = R.attention_reference(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hq,hk", [(8, 1), (8, 2), (6, 3)])
def test_matches_sdpa_gqa(hq, hk):
    q, k, v = qkv(hq=hq, hk=hk, d=16, dv=16)
    out, _ = R.attention_reference(q, k, v, causal=True)
    try:
        want = to_bhsd(F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v),
                                                      is_causal=True, enable_gqa=True))
    except TypeError:  # torch < 2.5 has no enable_gqa
        want = sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_softmax_scale():
    q, k, v = qkv(hq=2, hk=2)
    out, _ = R.attention_reference(q, k, v, softmax_scale=0.3)
    torch.testing.assert_close(out, sdpa(q, k, v, scale=0.3), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------
# Against loops written from fmha.h
# ------------------------------------------------------------------------------------------


def naive(q, k, v, *, scale=None, causal=False, window=(-1, -1), align="top_left", bias=None,
          slopes=None, softcap=0.0, keep=None, p_drop=0.0):
    """Element by element, batch mode, float64: (out (b, sq, hq, dv), lse (b, hq, sq))."""
    b, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(d) if scale is None else scale
    off = 0 if align == "top_left" else sk - sq
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(b, sq, hq, dv, dtype=f64)
    lse = torch.zeros(b, hq, sq, dtype=f64)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(sq):
                logits = {}
                for j in range(sk):
                    if left >= 0 and j < i + off - left:
                        continue
                    if right >= 0 and j > i + off + right:
                        continue
                    x = scale * float(q[bi, i, h] @ k[bi, j, kh])
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if bias is not None:
                        x += float(bias[bi, h, i, j])
                    if slopes is not None:
                        x -= float(slopes[bi, h]) * abs(i + off - j)
                    if x != -math.inf:
                        logits[j] = x
                if not logits:
                    lse[bi, h, i] = -math.inf
                    continue
                m = max(logits.values())
                total = sum(math.exp(x - m) for x in logits.values())
                lse[bi, h, i] = m + math.log(total)
                for j, x in logits.items():
                    pj = math.exp(x - m) / total
                    if keep is not None:
                        pj = pj * float(keep[bi, h, i, j]) / (1 - p_drop)
                    out[bi, i, h] += pj * v[bi, j, kh]
    return out, lse


def check_naive(q, k, v, ref_kw, naive_kw):
    out, lse = R.attention_reference(q, k, v, **ref_kw)
    want, want_lse = naive(q, k, v, **naive_kw)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-12)
    return out, lse


WINDOWS = [(2, -1), (-1, 1), (2, 3), (0, 0), (-1, 0), (0, -1), (20, 20)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("align", R.ALIGNS)
@pytest.mark.parametrize("sq,sk", [(6, 9), (9, 6), (7, 7)])
def test_window_matches_loops(window, align, sq, sk):
    q, k, v = qkv(b=1, sq=sq, sk=sk, hq=2, hk=1, d=8, dv=8, seed=sq * 31 + sk)
    check_naive(q, k, v, dict(window_size=window, mask_align=align),
                dict(window=window, align=align))


@pytest.mark.parametrize("window", [(-1, -1), (3, -1), (3, 5)])
@pytest.mark.parametrize("align", R.ALIGNS)
def test_causal_with_window(window, align):
    q, k, v = qkv(b=1, sq=8, sk=6, hq=2, hk=2, d=8, dv=8, seed=4)
    check_naive(q, k, v, dict(causal=True, window_size=window, mask_align=align),
                dict(causal=True, window=window, align=align))
    out_a, _ = R.attention_reference(q, k, v, causal=True, window_size=window, mask_align=align)
    out_b, _ = R.attention_reference(q, k, v, window_size=(window[0], 0), mask_align=align)
    assert torch.equal(out_a, out_b), "causal is window (left, 0)"


@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5)])
def test_bottom_right_causal(sq, sk):
    q, k, v = qkv(b=2, sq=sq, sk=sk, hq=2, hk=2, d=8, dv=8, seed=5)
    out, lse = check_naive(q, k, v, dict(causal=True, mask_align="bottom_right"),
                           dict(causal=True, align="bottom_right"))
    if sk >= sq:  # FlashAttention >= 2.1's causal: the last query row sees every key
        full, _ = R.attention_reference(q[:, -1:], k, v)
        torch.testing.assert_close(out[:, -1:], full)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("align", R.ALIGNS)
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_matches_loops(per_batch, align, causal):
    q, k, v = qkv(b=2, sq=5, sk=8, hq=3, hk=1, d=8, dv=8, seed=6)
    slopes = torch.rand(2 if per_batch else 1, 3, dtype=torch.float64) + 0.1
    arg = slopes if per_batch else slopes[0]
    check_naive(q, k, v, dict(alibi_slopes=arg, mask_align=align, causal=causal),
                dict(slopes=slopes.expand(2, 3), align=align, causal=causal))


def test_alibi_fp32_slopes_of_the_api():
    q, k, v = qkv(b=1, sq=5, sk=5, hq=2, hk=2, d=8, dv=8, seed=7)
    slopes = torch.tensor([0.25, 0.5], dtype=torch.float32)
    check_naive(q, k, v, dict(alibi_slopes=slopes), dict(slopes=slopes.double().view(1, 2)))


@pytest.mark.parametrize("softcap", [0.5, 2.0, 30.0])
def test_softcap_before_bias(softcap):
    q, k, v = qkv(b=2, sq=4, sk=6, hq=2, hk=2, d=8, dv=8, seed=8)
    q = q * 4
    bias = rand(2, 2, 4, 6, seed=10)
    slopes = torch.full((2, 2), 0.3, dtype=f64)
    check_naive(q, k, v, dict(softcap=softcap, bias=bias, alibi_slopes=slopes),
                dict(softcap=softcap, bias=bias, slopes=slopes))
    # Softcap bounds the q.k logits, the bias is added after: with a zero bias all logits
    # stay within (-softcap, softcap), so lse <= softcap + log(sk).
    _, lse = R.attention_reference(q, k, v, softcap=softcap)
    assert (lse <= softcap + math.log(6) + 1e-12).all()


def test_lse_is_logsumexp_of_scaled_logits():
    q, k, v = qkv(b=2, sq=5, sk=7, hq=2, hk=2, d=8, dv=8, seed=11)
    _, lse = R.attention_reference(q, k, v, softmax_scale=0.7)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * 0.7
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_dropout_matches_loops_and_leaves_lse(p):
    q, k, v = qkv(b=2, sq=5, sk=7, hq=2, hk=1, d=8, dv=8, seed=12)
    keep = R.dropout_keep_mask(99, 3, p, 2, 2, 5, 7)
    out, lse = check_naive(q, k, v, dict(dropout_p=p, dropout_keep=keep),
                           dict(keep=keep, p_drop=p))
    _, lse0 = R.attention_reference(q, k, v)
    assert torch.equal(lse, lse0), "dropout does not change the log-sum-exp"
    with pytest.raises(ValueError, match="dropout_keep"):
        R.attention_reference(q, k, v, dropout_p=p)
    # A larger keep pattern (group mode's (b, h, max_sq, max_sk)) is sliced.
    big = R.dropout_keep_mask(99, 3, p, 2, 2, 8, 11)
    out_big, _ = R.attention_reference(q, k, v, dropout_p=p, dropout_keep=big)
    assert torch.equal(out, out_big)


# ------------------------------------------------------------------------------------------
# Rows that see no key
# ------------------------------------------------------------------------------------------


def assert_empty_rows(out, lse, rows):
    """rows: bool (b, sq) of query rows that see nothing, for every head."""
    assert torch.isneginf(lse.permute(0, 2, 1)[rows]).all()
    assert (out[rows] == 0).all()
    assert torch.isfinite(lse.permute(0, 2, 1)[~rows]).all()
    assert not out.isnan().any()


def test_bottom_right_causal_with_more_queries_empties_rows():
    q, k, v = qkv(b=2, sq=9, sk=4, hq=2, hk=2, d=8, dv=8)
    out, lse = R.attention_reference(q, k, v, causal=True, mask_align="bottom_right")
    rows = torch.zeros(2, 9, dtype=torch.bool)
    rows[:, :5] = True  # row i sees j <= i - 5
    assert_empty_rows(out, lse, rows)


def test_window_empties_rows():
    q, k, v = qkv(b=1, sq=9, sk=4, hq=2, hk=2, d=8, dv=8)
    out, lse = R.attention_reference(q, k, v, window_size=(0, 0))
    rows = torch.zeros(1, 9, dtype=torch.bool)
    rows[:, 4:] = True
    assert_empty_rows(out, lse, rows)


def test_bool_mask_empties_rows():
    q, k, v = qkv(b=2, sq=6, sk=5, hq=2, hk=2, d=8, dv=8)
    mask = torch.ones(2, 1, 6, 5, dtype=torch.bool)
    mask[0, :, 2] = False
    mask[1, :, 5] = False
    out, lse = R.attention_reference(q, k, v, attn_mask=mask)
    rows = torch.zeros(2, 6, dtype=torch.bool)
    rows[0, 2] = rows[1, 5] = True
    assert_empty_rows(out, lse, rows)


def test_no_keys_at_all():
    q, k, v = qkv(b=1, sq=3, sk=0, hq=2, hk=2, d=8, dv=8)
    out, lse = R.attention_reference(q, k, v)
    assert_empty_rows(out, lse, torch.ones(1, 3, dtype=torch.bool))


# ------------------------------------------------------------------------------------------
# seqused and group mode
# ------------------------------------------------------------------------------------------


def test_batch_seqused_is_per_batch_slicing():
    q, k, v = qkv(b=3, sq=8, sk=10, hq=4, hk=2, d=8, dv=8, seed=13)
    used_q, used_k = [8, 3, 0], [10, 2, 5]
    slopes = torch.rand(3, 4, dtype=f64)
    bias = rand(3, 1, 8, 10, seed=14)
    keep = R.dropout_keep_mask(5, 0, 0.3, 3, 4, 8, 10)
    kw = dict(causal=True, mask_align="bottom_right", alibi_slopes=slopes, bias=bias,
              dropout_p=0.3, dropout_keep=keep)
    out, lse = R.attention_reference(q, k, v, seqused_q=torch.tensor(used_q, dtype=torch.int32),
                                     seqused_k=torch.tensor(used_k, dtype=torch.int32), **kw)
    for b, (uq, uk) in enumerate(zip(used_q, used_k)):
        o, l = R.attention_reference(
            q[b:b + 1, :uq], k[b:b + 1, :uk], v[b:b + 1, :uk], causal=True,
            mask_align="bottom_right", alibi_slopes=slopes[b:b + 1],
            bias=bias[b:b + 1, :, :uq, :uk],
            dropout_p=0.3, dropout_keep=keep[b:b + 1, :, :uq, :uk])
        assert torch.equal(out[b, :uq], o[0]) and torch.equal(lse[b, :, :uq], l[0])
        assert out[b, uq:].isnan().all() and lse[b, :, uq:].isnan().all(), "untouched rows"


@pytest.mark.parametrize("with_seqused", [False, True])
def test_group_mode_is_per_sequence_batch_calls(with_seqused):
    used_q, used_k = [3, 0, 7, 1], [5, 4, 0, 6]
    pad_q, pad_k = ([2, 1, 0, 3], [0, 2, 1, 4]) if with_seqused else ([0] * 4, [0] * 4)
    phys_q = [u + p for u, p in zip(used_q, pad_q)]
    phys_k = [u + p for u, p in zip(used_k, pad_k)]
    cu_q = torch.tensor([0] + torch.tensor(phys_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(phys_k).cumsum(0).tolist(), dtype=torch.int32)
    hq, hk, d, dv = 4, 2, 8, 8
    q = rand(int(cu_q[-1]) + 2, hq, d, seed=20)  # 2 rows past the last sequence
    k = rand(int(cu_k[-1]), hk, d, seed=21)
    v = rand(int(cu_k[-1]), hk, dv, seed=22)
    mq, mk = max(phys_q), max(phys_k)
    bias = rand(4, 1, mq, mk, seed=23)
    slopes = torch.rand(4, hq, dtype=f64)
    keep = R.dropout_keep_mask(77, 1, 0.25, 4, hq, mq, mk)
    kw = dict(window_size=(2, 1), mask_align="bottom_right", bias=bias, alibi_slopes=slopes,
              softcap=3.0, dropout_p=0.25, dropout_keep=keep)
    extra = {}
    if with_seqused:
        extra = dict(seqused_q=torch.tensor(used_q, dtype=torch.int32),
                     seqused_k=torch.tensor(used_k, dtype=torch.int32))
    out, lse = R.attention_reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=mq, max_seqlen_k=mk, **kw, **extra)
    assert out.shape == (q.shape[0], hq, dv) and lse.shape == (hq, q.shape[0])
    defined = torch.zeros(q.shape[0], dtype=torch.bool)
    for b in range(4):
        q0, k0, uq, uk = int(cu_q[b]), int(cu_k[b]), used_q[b], used_k[b]
        defined[q0:q0 + uq] = True
        o, l = R.attention_reference(
            q[None, q0:q0 + uq], k[None, k0:k0 + uk], v[None, k0:k0 + uk], window_size=(2, 1),
            mask_align="bottom_right", bias=bias[b:b + 1, :, :uq, :uk],
            alibi_slopes=slopes[b:b + 1], softcap=3.0, dropout_p=0.25,
            dropout_keep=keep[b:b + 1, :, :uq, :uk])
        assert torch.equal(out[q0:q0 + uq], o[0]) and torch.equal(lse[:, q0:q0 + uq], l[0])
    assert out[~defined].isnan().all() and lse[:, ~defined].isnan().all()
    assert not out[defined].isnan().any()
    # Sequence 1 has no keys when seqused, sequence 2 none either way: rows of lse -inf.
    s2 = slice(int(cu_q[2]), int(cu_q[2]) + used_q[2])
    assert torch.isneginf(lse[:, s2]).all() and (out[s2] == 0).all()


# ------------------------------------------------------------------------------------------
# Layouts and precision
# ------------------------------------------------------------------------------------------


def test_column_major_v_and_transposed_views_change_nothing():
    q, k, v = qkv(b=2, sq=5, sk=7, hq=2, hk=2, d=8, dv=8, seed=30)
    out, lse = R.attention_reference(q, k, v, causal=True)
    vt = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # (b, sk, hk, dv), seq stride 1
    assert vt.stride(1) == 1
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    out2, lse2 = R.attention_reference(qt, k, vt, causal=True)
    torch.testing.assert_close(out2, out, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_close_but_rounded(dtype):
    q, k, v = qkv(b=1, sq=16, sk=40, hq=2, hk=2, d=32, dv=32, seed=31, dtype=dtype)
    truth, lse = R.attention_reference(q, k, v)
    lowp, lse_lowp = R.attention_reference(q, k, v, compute_dtype=dtype)
    assert lowp.dtype == dtype and lse_lowp.dtype == torch.float32
    err = (lowp.double() - truth).abs().max().item()
    eps = torch.finfo(dtype).eps
    assert 0 < err < 8 * eps, err
    assert (lse_lowp.double() - lse).abs().max().item() < 0.05


# ------------------------------------------------------------------------------------------
# The problem builder and the pass rule of the GPU tests
# ------------------------------------------------------------------------------------------


def contract_strides_ok(t, seq_dim_contig=False):
    strides = list(t.stride())
    contig = t.dim() - 3 if seq_dim_contig else t.dim() - 1
    return strides[contig] == 1 and all(s % 8 == 0 for i, s in enumerate(strides) if i != contig)


SPECS = [
    R.Spec(torch.float16, 64, 64, hq=4, hk=2, b=2, sq=17, sk=30, causal=True,
           align="bottom_right", layout="poison", bias="full", lse=True),
    R.Spec(torch.bfloat16, 48, 56, hq=8, hk=1, b=3, sq=20, sk=33, used_q=[20, 1, 0],
           used_k=[33, 0, 5], layout="poison", vcol=True, alibi="batch_head", lse=True),
    R.Spec(torch.bfloat16, 32, 32, hq=2, hk=2, b=2, sq=9, sk=5, layout="bhsd", bias="attn_bool",
           window=(3, -1), dropout_p=0.3, seed=2**40 + 1),
    R.Spec(torch.float16, 40, 24, hq=4, hk=2, seqlens_q=[0, 17, 3], seqlens_k=[5, 0, 30],
           pad_q=[2, 0, 1], pad_k=[3, 8, 0], layout="poison", vcol=True, bias="key",
           softcap=5.0, qscale=3.0, lse=True),
    R.Spec(torch.float16, 64, 64, hq=2, hk=1, seqlens_q=[7, 12], seqlens_k=[12, 7],
           layout="bhsd", bias="attn_float2d", causal=True, align="bottom_right"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_make_inputs_follows_the_contract(spec):
    inp = R.make_inputs(spec, device="cpu", seed=1)
    q, k, v = inp.q, inp.k, inp.v
    assert contract_strides_ok(q) and contract_strides_ok(k)
    assert contract_strides_ok(v, seq_dim_contig=spec.vcol)
    for t in (q, k, v):
        assert t.data_ptr() % 16 == 0 and t.dtype == spec.dtype
    if spec.group:
        assert q.dim() == 3 and inp.fwd_kwargs["cu_seqlens_q"].dtype == torch.int32
        assert inp.fwd_kwargs["max_seqlen_q"] == max(a + b for a, b in zip(spec.seqlens_q,
                                                                           spec.pad_q or [0] * 9))
    else:
        assert q.shape == (spec.b, spec.sq, spec.hq, spec.d)
    if spec.layout == "poison" and (spec.used_k or spec.pad_k):
        assert k.isnan().any(), "rows past seqused_k are NaN in the poison layout"
    keep = None
    if spec.dropout_p:
        keep = R.dropout_keep_mask(spec.seed, spec.offset, spec.dropout_p, *inp.keep_shape)
    ref, ref_lse = R.attention_reference(q, k, v, **inp.ref_kwargs, dropout_keep=keep)
    lowp, _ = R.attention_reference(q, k, v, **inp.ref_kwargs, dropout_keep=keep,
                                    compute_dtype=spec.dtype)
    # The reference never reads the poison: every defined row is a number.
    defined = ~ref.isnan().all(-1)
    assert defined.any() and not ref[defined].isnan().any()
    # The pass rule accepts the input-precision result itself and rejects a perturbed one.
    R.compare(lowp, ref, lowp, dtype=spec.dtype, lse=ref_lse.float(), ref_lse=ref_lse, what="self")
    bad = lowp.clone()
    bad[defined.nonzero()[0].tolist()[0]] += 0.25  # one row of one sequence
    with pytest.raises(AssertionError, match="max error"):
        R.compare(bad, ref, lowp, dtype=spec.dtype, what="perturbed")


def test_compare_catches_nan_and_wrong_empty_rows():
    q, k, v = qkv(b=1, sq=6, sk=3, hq=2, hk=2, d=8, dv=8, dtype=torch.float16)
    ref, lse = R.attention_reference(q, k, v, causal=True, mask_align="bottom_right")
    lowp, _ = R.attention_reference(q, k, v, causal=True, mask_align="bottom_right",
                                    compute_dtype=torch.float16)
    nan = lowp.clone()
    nan[0, 5, 1, 2] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        R.compare(nan, ref, lowp, dtype=torch.float16)
    finite_lse = lse.float().clone()
    finite_lse[torch.isneginf(finite_lse)] = 0.0
    with pytest.raises(AssertionError, match="-inf"):
        R.compare(lowp, ref, lowp, dtype=torch.float16, lse=finite_lse, ref_lse=lse)
    shifted = lse.float() + 0.01
    with pytest.raises(AssertionError, match="lse error"):
        R.compare(lowp, ref, lowp, dtype=torch.float16, lse=shifted, ref_lse=lse)


# ------------------------------------------------------------------------------------------
# The cases test_fwd_gpu.py derives from a manifest
# ------------------------------------------------------------------------------------------


def synthetic_manifest():
    """Instances with every trait value, shaped like fmha.instances()' rows."""
    rows = []
    variants = [dict(bias="none", vlayout="row", dropout=False, softcap=False),
                dict(bias="elementwise", vlayout="row", dropout=False, softcap=False),
                dict(bias="alibi", vlayout="row", dropout=True, softcap=True),
                dict(bias="none", vlayout="col", dropout=False, softcap=False)]
    for (hq, hv, m, n) in ((64, 64, 128, 64), (192, 128, 128, 64), (256, 256, 64, 64)):
        for mask in ("none", "causal", "window"):
            for mode, pad in (("batch", False), ("batch", True), ("group", True)):
                for var in variants:
                    rows.append(dict(name=f"i{len(rows)}", dtype="bf16", hdim_q=hq, hdim_v=hv,
                                     mask=mask, mode=mode, lse=True, pipeline="fa2", arch="sm80",
                                     block_m=m, block_n=n, pad_seqlen=pad, pad_hdim=pad, **var))
    return rows


def empty_rows_somewhere(spec):
    inp = R.make_inputs(spec, device="cpu", seed=0)
    keep = None
    if spec.dropout_p:
        keep = R.dropout_keep_mask(spec.seed, spec.offset, spec.dropout_p, *inp.keep_shape)
    _, lse = R.attention_reference(inp.q, inp.k, inp.v, **inp.ref_kwargs, dropout_keep=keep)
    return bool(torch.isneginf(lse).any())


@pytest.mark.parametrize("inst", synthetic_manifest(), ids=lambda i: "-".join(
    str(i[k]) for k in ("hdim_q", "mask", "mode", "pad_seqlen", "bias", "vlayout", "dropout")))
def test_instance_cases_fit_and_cover_the_traits(inst):
    cases = R.instance_specs(inst)
    ids = [case_id for case_id, _ in cases]
    assert len(set(ids)) == len(ids), ids
    specs = [spec for _, spec in cases]
    for case_id, spec in cases:
        assert not R.fits(spec, inst), f"{case_id}: {R.fits(spec, inst)}"
        # The instance next to it (other mask, other mode) must not fit: the cases carry the
        # traits, not just shapes.
        other_mask = {"none": "causal", "causal": "window", "window": "none"}[inst["mask"]]
        other = dict(inst, mask=other_mask)
        assert R.fits(spec, other) == "mask"
    lens = [(s.sq, s.sk) for s in specs if not s.group]
    if inst["mode"] == "batch":
        assert any(q > k for q, k in lens) and any(q < k for q, k in lens)
    if inst["pad_seqlen"] and inst["mode"] == "batch":
        assert any(s.sq == 1 for s in specs), "a one-row problem"
        assert any(s.sq % inst["block_m"] or s.sk % inst["block_n"] for s in specs)
        assert any(s.used_q for s in specs), "seqused in batch mode"
    if inst["mode"] == "group":
        assert any(0 in s.seqlens_q for s in specs) and any(0 in s.seqlens_k for s in specs)
        assert any(s.pad_q for s in specs), "physical padding (seqused)"
    assert any(s.hq == 8 * s.hk for s in specs), "GQA 8:1"
    assert {s.layout for s in specs} == set(R.LAYOUTS)
    if inst["pad_hdim"]:
        assert any(s.d < inst["hdim_q"] and s.dv < inst["hdim_v"] for s in specs)
    if inst["bias"] == "elementwise":
        kinds = {s.bias for s in specs}
        assert {"11", "b1", "1h", "attn_bool"} <= kinds
    if inst["bias"] == "alibi":
        pairs = {(s.alibi, s.align) for s in specs}
        assert pairs >= {("head", "top_left"), ("batch_head", "bottom_right")}
    if inst["mask"] != "none":
        assert {s.align for s in specs} == set(R.ALIGNS)
    if inst["dropout"]:
        assert len({s.dropout_p for s in specs}) > 1 and any(s.seed >= 2**32 for s in specs)
    assert any(s.lse for s in specs) and any(not s.lse for s in specs)
    if inst["mask"] != "none" or inst["bias"] == "elementwise" or inst["mode"] == "group":
        small = [s for s in specs
                 if max(s.sq, s.sk, *(s.seqlens_q or [0]), *(s.seqlens_k or [0])) < 1000]
        assert any(empty_rows_somewhere(s) for s in small), "a case whose mask empties rows"


# ------------------------------------------------------------------------------------------
# The backward reference (attention_grads)
# ------------------------------------------------------------------------------------------


def grads_of(fn, inputs, dout):
    """torch.autograd.grad of fn(*leaves) at dout, the leaves float64 copies of inputs."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, dout)


def assert_grads(got: R.Gradients, want, names=("dq", "dk", "dv", "dbias")):
    for name, w in zip(names, want):
        torch.testing.assert_close(getattr(got, name), w, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_grads_match_sdpa_plain_and_scaled():
    q, k, v = qkv(hq=4, hk=4, d=16, dv=16)
    dout = rand(2, 7, 4, 16, seed=3)
    for scale in (None, 0.3):
        got = R.attention_grads(q, k, v, dout, softmax_scale=scale)
        assert_grads(got, grads_of(lambda a, b, c: sdpa(a, b, c, scale=scale), (q, k, v), dout))


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9)])
def test_grads_match_sdpa_causal_top_left(sq, sk):
    q, k, v = qkv(sq=sq, sk=sk, hq=4, hk=4, d=16, dv=16)
    dout = rand(2, sq, 4, 16, seed=4)
    got = R.attention_grads(q, k, v, dout, causal=True)
    assert_grads(got, grads_of(lambda a, b, c: sdpa(a, b, c, is_causal=True), (q, k, v), dout))


@pytest.mark.parametrize("shape", [(2, 4, 7, 9), (1, 1, 7, 9), (2, 1, 1, 9), (1, 4, 7, 9),
                                   (7, 9)])
@pytest.mark.parametrize("name", ["bias", "attn_mask"])
def test_dbias_matches_sdpa_summed_over_broadcast_dims(shape, name):
    q, k, v = qkv(sq=7, sk=9, hq=4, hk=4, d=16, dv=16)
    mask = rand(*shape, seed=9)
    dout = rand(2, 7, 4, 16, seed=5)
    got = R.attention_grads(q, k, v, dout, dbias=True, **{name: mask})
    assert got.dbias.shape == mask.shape
    want = grads_of(lambda a, b, c, m: sdpa(a, b, c, attn_mask=m), (q, k, v, mask), dout)
    assert_grads(got, want)


@pytest.mark.parametrize("hq,hk", [(8, 1), (6, 3)])
def test_gqa_grads_are_summed_over_the_heads_of_a_kv_head(hq, hk):
    q, k, v = qkv(hq=hq, hk=hk, d=16, dv=16)
    dout = rand(2, 7, hq, 16, seed=6)
    got = R.attention_grads(q, k, v, dout, causal=True)
    assert got.dk.shape == k.shape and got.dv.shape == v.shape
    # sdpa() repeats K/V heads: autograd sums the repeated heads' gradients.
    assert_grads(got, grads_of(lambda a, b, c: sdpa(a, b, c, is_causal=True), (q, k, v), dout))


def test_dbias_needs_a_float_bias():
    q, k, v = qkv(hq=2, hk=2)
    dout = rand(2, 7, 2, 12, seed=7)
    with pytest.raises(ValueError, match="dbias"):
        R.attention_grads(q, k, v, dout, dbias=True)
    with pytest.raises(ValueError, match="bool"):
        R.attention_grads(q, k, v, dout, dbias=True, attn_mask=torch.ones(7, 9, dtype=torch.bool))


def directional_check(q, k, v, dout, *, dbias=False, step=1e-5, seed=0, **kw) -> R.Gradients:
    """attention_grads' gradients against central differences of attention_reference along a
    random direction e of each leaf x: <dx, e> = <dout, f(x + step e) - f(x - step e)> / 2 step,
    dout read only in the rows that the output defines. Returns the gradients."""
    got = R.attention_grads(q, k, v, dout, dbias=dbias, **kw)
    used = ~got.out.isnan()
    weights = torch.where(used, dout, torch.zeros_like(dout))
    bias_name = "bias" if kw.get("bias") is not None else "attn_mask"
    leaves = {"dq": q, "dk": k, "dv": v}
    if dbias:
        leaves["dbias"] = kw[bias_name]
    gen = torch.Generator().manual_seed(seed)

    def loss(name, x):
        args, options = dict(q=q, k=k, v=v), dict(kw)
        if name == "dbias":
            options[bias_name] = x
        else:
            args[name[1]] = x
        out, _ = R.attention_reference(args["q"], args["k"], args["v"], **options)
        return (torch.where(used, out, torch.zeros_like(out)) * weights).sum().item()

    for name, x in leaves.items():
        e = torch.randn(x.shape, generator=gen, dtype=f64)
        numeric = (loss(name, x + step * e) - loss(name, x - step * e)) / (2 * step)
        grad = getattr(got, name)
        analytic = (grad * e).sum().item()
        assert not grad.isnan().any(), f"{name} has NaN"
        assert abs(numeric - analytic) <= 1e-7 * (1 + grad.norm().item() * e.norm().item()), (
            f"{name}: <grad, e> = {analytic:.12g}, central differences {numeric:.12g}")
    return got


def group_problem(used_q, used_k, pad_q, pad_k, hq, hk, d, dv, seed):
    """Packed q, k, v of sequences with these used lengths and padding after each, and the
    cu_seqlens / seqused / max_seqlen arguments of the call."""
    phys_q = [u + p for u, p in zip(used_q, pad_q)]
    phys_k = [u + p for u, p in zip(used_k, pad_k)]
    cu_q = torch.tensor([0] + torch.tensor(phys_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(phys_k).cumsum(0).tolist(), dtype=torch.int32)
    q = rand(int(cu_q[-1]), hq, d, seed=seed)
    k = rand(int(cu_k[-1]), hk, d, seed=seed + 1)
    v = rand(int(cu_k[-1]), hk, dv, seed=seed + 2)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(phys_q),
              max_seqlen_k=max(phys_k), seqused_q=torch.tensor(used_q, dtype=torch.int32),
              seqused_k=torch.tensor(used_k, dtype=torch.int32))
    return q, k, v, kw


def feature_cases():
    """(id, q, k, v, keyword arguments) of problems with every feature the reference has."""
    cases = []
    for align in R.ALIGNS:
        short = "tl" if align == "top_left" else "br"
        q, k, v = qkv(b=1, sq=6, sk=9, hq=2, hk=1, d=8, dv=8, seed=40)
        cases.append((f"window_{short}", q, k, v, dict(window_size=(2, 1), mask_align=align)))
        q, k, v = qkv(b=2, sq=9, sk=6, hq=2, hk=2, d=8, dv=4, seed=41)
        cases.append((f"causal_more_queries_{short}", q, k, v,
                      dict(causal=True, window_size=(3, -1), mask_align=align)))
        q, k, v = qkv(b=2, sq=5, sk=8, hq=3, hk=1, d=8, dv=8, seed=42)
        cases.append((f"alibi_{short}", q, k, v,
                      dict(alibi_slopes=torch.rand(2, 3, dtype=f64) + 0.1, mask_align=align)))
    q, k, v = qkv(b=2, sq=4, sk=6, hq=2, hk=2, d=8, dv=8, seed=43)
    cases.append(("softcap_bias_dbias", q * 4, k, v,
                  dict(softcap=2.0, bias=rand(2, 1, 4, 6, seed=44), dbias=True)))
    q, k, v = qkv(b=2, sq=5, sk=7, hq=2, hk=1, d=8, dv=8, seed=45)
    cases.append(("dropout", q, k, v, dict(dropout_p=0.3, causal=True, mask_align="bottom_right",
                                           dropout_keep=R.dropout_keep_mask(99, 3, 0.3, 2, 2, 5,
                                                                            7))))
    q, k, v = qkv(b=1, sq=6, sk=5, hq=2, hk=2, d=8, dv=8, seed=46)
    mask = torch.rand(1, 2, 6, 5, generator=torch.Generator().manual_seed(1)) < 0.6
    mask[0, :, 2] = False  # a row that sees nothing, through the bias alone
    cases.append(("bool_mask", q, k, v, dict(attn_mask=mask)))
    q, k, v = qkv(b=1, sq=6, sk=5, hq=2, hk=2, d=8, dv=8, seed=47)
    cases.append(("key_bias_dbias", q, k, v, dict(bias=rand(1, 1, 1, 5, seed=48), dbias=True)))
    q, k, v = qkv(b=3, sq=8, sk=10, hq=4, hk=2, d=8, dv=8, seed=49)
    cases.append(("seqused", q, k, v, dict(
        causal=True, seqused_q=torch.tensor([8, 3, 0], dtype=torch.int32),
        seqused_k=torch.tensor([10, 2, 5], dtype=torch.int32), bias=rand(3, 1, 8, 10, seed=50),
        dbias=True)))
    q, k, v, kw = group_problem([3, 0, 7, 1], [5, 4, 0, 6], [2, 1, 0, 3], [0, 2, 1, 4], 4, 2, 8,
                                8, seed=51)
    cases.append(("group", q, k, v, dict(
        kw, window_size=(2, 1), mask_align="bottom_right", softcap=3.0,
        bias=rand(4, 1, kw["max_seqlen_q"], kw["max_seqlen_k"], seed=54), dbias=True,
        alibi_slopes=torch.rand(4, 4, dtype=f64), dropout_p=0.25,
        dropout_keep=R.dropout_keep_mask(77, 1, 0.25, 4, 4, kw["max_seqlen_q"],
                                         kw["max_seqlen_k"]))))
    return cases


@pytest.mark.parametrize("case", feature_cases(), ids=lambda c: c[0])
def test_grads_are_central_differences(case):
    _, q, k, v, kw = case
    out, _ = R.attention_reference(q, k, v, **{n: x for n, x in kw.items() if n != "dbias"})
    directional_check(q, k, v, rand(*out.shape, seed=60), **kw)


def structural_zeros(q, k, v, kw):
    """(gradients at a dout that is NaN in the rows the output leaves undefined, query rows that
    see no key or that no sequence uses (as dq's rows), keys that no row sees or no sequence
    uses (as dk's rows))."""
    kw = {n: x for n, x in kw.items() if n != "dbias"}
    out, lse = R.attention_reference(q, k, v, **kw)
    dout = rand(*out.shape, seed=61).masked_fill(out.isnan(), float("nan"))
    got = R.attention_grads(q, k, v, dout, **kw)
    no_key = ~torch.isfinite(lse)
    no_key = no_key.permute(0, 2, 1) if lse.dim() == 3 else no_key.transpose(0, 1)
    # A key that no row sees: sum_i P_ij = 0 without dropout (that sum is dv at dout = 1).
    visible_kw = {n: x for n, x in kw.items() if n not in ("dropout_p", "dropout_keep")}
    unseen = R.attention_grads(q, k, v, torch.ones_like(dout), **visible_kw).dv.sum(-1) == 0
    return got, no_key, unseen


@pytest.mark.parametrize("case", feature_cases(), ids=lambda c: c[0])
def test_grads_are_zero_where_nothing_is_seen(case):
    """dq of those rows and dk, dv of those keys are exactly 0, and nothing is NaN: the poison
    in dout's undefined rows, and the -inf of rows that see nothing, reach no gradient."""
    got, no_key, unseen = structural_zeros(*case[1:])
    for name in ("dq", "dk", "dv"):
        assert not getattr(got, name).isnan().any(), name
    assert (got.dq[no_key] == 0).all()
    assert (got.dk[unseen] == 0).all() and (got.dv[unseen] == 0).all()


def test_feature_cases_have_empty_rows_and_unseen_keys():
    found = [structural_zeros(*case[1:])[1:] for case in feature_cases()]
    assert any(no_key.any() for no_key, _ in found) and any(unseen.any() for _, unseen in found)


def test_group_grads_are_per_sequence_batch_grads():
    used_q, used_k = [3, 0, 7, 1], [5, 4, 0, 6]
    q, k, v, kw = group_problem(used_q, used_k, [2, 1, 0, 3], [0, 2, 1, 4], 4, 2, 8, 8, seed=70)
    cu_q, cu_k = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    bias = rand(4, 1, kw["max_seqlen_q"], kw["max_seqlen_k"], seed=71)
    slopes = torch.rand(4, 4, dtype=f64)
    options = dict(causal=True, mask_align="bottom_right", softcap=3.0, alibi_slopes=slopes)
    dout = rand(q.shape[0], 4, 8, seed=72)
    got = R.attention_grads(q, k, v, dout, bias=bias, dbias=True, **kw, **options)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbias = torch.zeros_like(bias)
    for b in range(4):
        q0, k0, uq, uk = cu_q[b], cu_k[b], used_q[b], used_k[b]
        one = R.attention_grads(
            q[None, q0:q0 + uq], k[None, k0:k0 + uk], v[None, k0:k0 + uk],
            dout[None, q0:q0 + uq], bias=bias[b:b + 1, :, :uq, :uk], dbias=True,
            causal=True, mask_align="bottom_right", softcap=3.0, alibi_slopes=slopes[b:b + 1])
        dq[q0:q0 + uq], dk[k0:k0 + uk], dv[k0:k0 + uk] = one.dq[0], one.dk[0], one.dv[0]
        dbias[b:b + 1, :, :uq, :uk] = one.dbias
    assert_grads(got, (dq, dk, dv, dbias))


def test_bwd_out_gives_d_of_the_output_the_backward_reads():
    """dS_ij = P_ij (dP_ij - D_i) with D_i = dO_i . O_i of the output given as bwd_out:
    FlashAttention's backward written out with the probabilities, GQA heads summed."""
    q, k, v = qkv(b=1, sq=5, sk=7, hq=4, hk=2, d=8, dv=8, seed=80)
    dout = rand(1, 5, 4, 8, seed=81)
    kw = dict(causal=True, mask_align="bottom_right", softmax_scale=0.3)
    out, _ = R.attention_reference(q, k, v, **kw)
    exact = R.attention_grads(q, k, v, dout, **kw)
    assert_grads(R.attention_grads(q, k, v, dout, **kw, bwd_out=out),
                 (exact.dq, exact.dk, exact.dv))
    given = out + 1e-3 * rand(*out.shape, seed=82)
    got = R.attention_grads(q, k, v, dout, **kw, bwd_out=given)
    qh, doh, oh = (t.transpose(1, 2) for t in (q, dout, given))
    kh, vh = (t.transpose(1, 2).repeat_interleave(2, dim=1) for t in (k, v))
    s = (qh @ kh.transpose(-1, -2) * 0.3).masked_fill(
        ~R.visible(5, 7, -1, 0, "bottom_right"), float("-inf"))
    p = torch.softmax(s, -1)
    ds = p * (doh @ vh.transpose(-1, -2) - (doh * oh).sum(-1, keepdim=True))
    dk = (0.3 * ds.transpose(-1, -2) @ qh).view(1, 2, 2, 7, 8).sum(2)  # GQA: 2 heads a K/V head
    dv = (p.transpose(-1, -2) @ doh).view(1, 2, 2, 7, 8).sum(2)
    assert_grads(got, [t.transpose(1, 2) for t in (0.3 * ds @ kh, dk, dv)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_grads_are_close_but_rounded(dtype):
    q, k, v = qkv(b=1, sq=16, sk=40, hq=2, hk=1, d=32, dv=32, seed=73, dtype=dtype)
    bias = rand(1, 2, 16, 40, seed=74, dtype=dtype)
    dout = rand(1, 16, 2, 32, seed=75, dtype=dtype)
    truth = R.attention_grads(q, k, v, dout, bias=bias, dbias=True, causal=True)
    lowp = R.attention_grads(q, k, v, dout, bias=bias, dbias=True, causal=True,
                             compute_dtype=dtype)
    eps = torch.finfo(dtype).eps
    for name in ("dq", "dk", "dv", "dbias"):
        t, lp = getattr(truth, name), getattr(lowp, name)
        assert t.dtype == f64 and lp.dtype == dtype
        err = (lp.double() - t).abs().max().item()
        assert 0 < err < 16 * eps * t.abs().max().item(), (name, err)


# ------------------------------------------------------------------------------------------
# The cases and the pass rule test_bwd_gpu.py derives from the backward instances
# ------------------------------------------------------------------------------------------


def synthetic_bwd_manifest():
    """Backward instances with every trait value, shaped like fmha.bwd_instances()' rows (no
    vlayout or lse trait; dbias)."""
    rows = []
    variants = [dict(bias="none", dbias=False, dropout=False, softcap=False),
                dict(bias="elementwise", dbias=False, dropout=False, softcap=False),
                dict(bias="elementwise", dbias=True, dropout=True, softcap=False),
                dict(bias="alibi", dbias=False, dropout=True, softcap=True)]
    for (hq, hv, m, n) in ((64, 64, 64, 128), (128, 128, 64, 128), (256, 256, 64, 64)):
        for mask in ("none", "causal", "window"):
            for mode, pad in (("batch", False), ("batch", True), ("group", True)):
                for var in variants:
                    rows.append(dict(name=f"bwd{len(rows)}", dtype="fp16", hdim_q=hq,
                                     hdim_v=hv, mask=mask, mode=mode, pipeline="fa2",
                                     arch="sm80", block_m=m, block_n=n, pad_seqlen=pad,
                                     pad_hdim=pad, **var))
    return rows


@pytest.mark.parametrize("inst", synthetic_bwd_manifest(), ids=lambda i: "-".join(
    str(i[k]) for k in ("hdim_q", "mask", "mode", "pad_seqlen", "bias", "dbias", "dropout")))
def test_bwd_instance_cases_fit_and_cover_the_traits(inst):
    cases = R.bwd_instance_specs(inst)
    ids = [case_id for case_id, _ in cases]
    assert len(set(ids)) == len(ids), ids
    specs = [spec for _, spec in cases]
    for case_id, spec in cases:
        assert not R.fits_bwd(spec, inst), f"{case_id}: {R.fits_bwd(spec, inst)}"
        assert R.fits_bwd(spec, dict(inst, dbias=not inst["dbias"])) == "dbias"
        assert not spec.vcol and not spec.lse, "the backward takes row-major V and always an lse"
    assert all(s.dbias == inst["dbias"] for s in specs)
    if inst["dbias"]:
        assert {"11", "b1", "1h", "key", "full"} <= {s.bias for s in specs}, "broadcast dbias"
    assert any(s.hq == 8 * s.hk for s in specs), "GQA 8:1"
    assert {s.layout for s in specs} == set(R.LAYOUTS)


class FakeFmha:
    """A CPU stand-in for fmha's backward API: bwd() checks that out and lse are the forward's
    (the truth rounded to the input dtype, NaN in rows no sequence uses) and returns the
    input-precision reference's gradients, which `spoil` may change as a faulty kernel would."""

    def __init__(self, spoil=None):
        self.spoil = spoil
        self.options = []

    @staticmethod
    def dropout_mask(seed, offset, dropout_p, batch, nhead, seqlen_q, seqlen_k):
        return R.dropout_keep_mask(seed, offset, dropout_p, batch, nhead, seqlen_q, seqlen_k)

    def bwd(self, dout, q, k, v, out, lse, causal=False, softmax_scale=None, *,
            window_size=(-1, -1), mask_align="top_left", bias=None, alibi_slopes=None,
            softcap=0.0, dropout_p=0.0, dropout_seed=None, dropout_offset=0, cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
            seqused_k=None, deterministic=False, return_dbias=False, instance=None):
        self.options.append(dict(deterministic=deterministic, instance=instance))
        kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                  mask_align=mask_align, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap,
                  dropout_p=dropout_p, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
                  seqused_k=seqused_k)
        if dropout_p:
            group = cu_seqlens_q is not None
            shape = ((len(cu_seqlens_q) - 1, q.shape[-2], max_seqlen_q, max_seqlen_k) if group
                     else (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
            kw["dropout_keep"] = R.dropout_keep_mask(dropout_seed, dropout_offset, dropout_p,
                                                     *shape)
        want_out, want_lse = R.attention_reference(q, k, v, **kw)
        assert torch.equal(out.isnan(), want_out.isnan()) and torch.equal(lse.isnan(),
                                                                          want_lse.isnan())
        used = ~want_out.isnan()
        assert torch.equal(out[used], want_out[used].to(out.dtype))
        assert torch.equal(lse.nan_to_num(), want_lse.float().nan_to_num())
        g = R.attention_grads(q, k, v, dout, dbias=return_dbias, compute_dtype=q.dtype, **kw)
        grads = [g.dq, g.dk, g.dv] + ([g.dbias] if return_dbias else [])
        return tuple(self.spoil(grads) if self.spoil else grads)


BWD_SPECS = [
    R.Spec(torch.float16, 64, 64, hq=4, hk=2, b=2, sq=17, sk=30, causal=True,
           align="bottom_right", layout="poison", bias="full", dbias=True),
    R.Spec(torch.bfloat16, 48, 56, hq=8, hk=1, b=3, sq=20, sk=33, used_q=[20, 1, 0],
           used_k=[33, 0, 5], layout="poison", alibi="batch_head", window=(4, 2)),
    R.Spec(torch.bfloat16, 32, 32, hq=2, hk=2, b=2, sq=9, sk=5, layout="bhsd", bias="attn_bool",
           window=(3, -1), dropout_p=0.3, seed=2**40 + 1, offset=5),
    R.Spec(torch.bfloat16, 32, 32, hq=2, hk=2, b=2, sq=9, sk=5, bias="attn_bool", dbias=True),
    R.Spec(torch.float16, 40, 24, hq=4, hk=2, seqlens_q=[0, 17, 3], seqlens_k=[5, 0, 30],
           pad_q=[2, 0, 1], pad_k=[3, 8, 0], layout="poison", bias="key", dbias=True,
           softcap=5.0, qscale=3.0, dropout_p=0.17, seed=3),
    R.Spec(torch.float16, 64, 64, hq=2, hk=1, seqlens_q=[7, 12], seqlens_k=[12, 7],
           layout="bhsd", bias="attn_float2d", dbias=True, causal=True, align="bottom_right"),
]


@pytest.mark.parametrize("spec", BWD_SPECS, ids=lambda s: s.describe())
def test_check_bwd_accepts_the_input_precision_backward(spec):
    fake = FakeFmha()
    results = R.check_bwd(fake, spec, device="cpu", seed=2, instance="bwd_x")
    assert set(results) == ({"dq", "dk", "dv", "dbias"} if spec.dbias else {"dq", "dk", "dv"})
    assert fake.options == [dict(deterministic=False, instance="bwd_x")] * 2
    inputs = R.make_inputs(spec, device="cpu", seed=2, grad=True)
    assert inputs.dout.shape == inputs.q.shape[:-1] + (spec.dv,)
    assert contract_strides_ok(inputs.dout)
    if spec.layout == "poison" and (spec.used_q or spec.pad_q):
        assert inputs.dout.isnan().any(), "dout is NaN in rows no sequence uses"
    plain = R.make_inputs(spec, device="cpu", seed=2)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in ((inputs.q, plain.q), (inputs.k, plain.k), (inputs.v, plain.v))), (
        "drawing dout leaves the forward's tensors as they were")


def spoil_first(name, change):
    """A spoil of FakeFmha: `change` applied in place to gradient `name` of each call."""

    def spoil(grads):
        change(grads[("dq", "dk", "dv", "dbias").index(name)])
        return grads

    return spoil


# Rows 0-4 of every sequence see no key (bottom-right causal, 9 queries, 4 keys); in the
# second problem keys 4-8 are seen by no row (top-left causal, 4 queries, 9 keys).
EMPTY_ROWS = R.Spec(torch.float16, 32, 32, hq=2, hk=1, b=2, sq=9, sk=4, causal=True,
                    align="bottom_right")
UNSEEN_KEYS = R.Spec(torch.float16, 32, 32, hq=2, hk=1, b=2, sq=4, sk=9, causal=True,
                     bias="1h", dbias=True)


@pytest.mark.parametrize("spec,spoil,match", [
    (BWD_SPECS[0], spoil_first("dq", lambda g: g[0, 3, 1].fill_(float("nan"))), "NaN"),
    (BWD_SPECS[4], spoil_first("dk", lambda g: g[7, 0].add_(0.25)), "dk: max error"),
    (BWD_SPECS[4], spoil_first("dbias", lambda g: g[1, 0, 0, 3].add_(0.25)), "dbias: max err"),
    (EMPTY_ROWS, spoil_first("dq", lambda g: g[:, 0].add_(1e-6)), "dq of query rows"),
    (UNSEEN_KEYS, spoil_first("dv", lambda g: g[:, -1].add_(1e-6)), "dv of keys"),
    (UNSEEN_KEYS, lambda grads: [g.float() for g in grads], "want"),
])
def test_check_bwd_rejects_what_a_faulty_kernel_returns(spec, spoil, match):
    with pytest.raises(AssertionError, match=match):
        R.check_bwd(FakeFmha(spoil), spec, device="cpu")


# ---------------------------------------------------------------------------------------------
# The KV-cache reference (fmha.fwd_kvcache).
# ---------------------------------------------------------------------------------------------

def test_rotary_matches_complex_multiplication():
    """GPT-J pairs (2j, 2j + 1) and GPT-NeoX pairs (j, j + r/2) are complex numbers rotated by
    the angle of their pair; dims past rotary_dim pass through."""
    x = rand(2, 3, 2, 10)
    angles = rand(8, 3, seed=5)
    positions = torch.tensor([[0, 4, 7], [1, 2, 3]])
    theta = angles[positions].unsqueeze(2)
    rot = torch.polar(torch.ones_like(theta), theta)
    gptj = R.rotary(x, angles.cos(), angles.sin(), positions, interleaved=True)
    want = torch.view_as_real(torch.view_as_complex(x[..., :6].reshape(2, 3, 2, 3, 2).contiguous())
                              * rot).reshape(2, 3, 2, 6)
    assert torch.allclose(gptj[..., :6], want) and torch.equal(gptj[..., 6:], x[..., 6:])
    neox = R.rotary(x, angles.cos(), angles.sin(), positions, interleaved=False)
    z = torch.complex(x[..., :3], x[..., 3:6]) * rot
    assert torch.allclose(neox[..., :3], z.real) and torch.allclose(neox[..., 3:6], z.imag)
    assert torch.equal(neox[..., 6:], x[..., 6:])


def _kvcache_case(paged: bool, seed=0):
    b, sq, hq, hk, d, page, pages = 3, 2, 4, 2, 8, 4, 5
    q = rand(b, sq, hq, d, seed=seed)
    contiguous_k = rand(b, page * pages, hk, d, seed=seed + 1)
    contiguous_v = rand(b, page * pages, hk, d, seed=seed + 2)
    kw = dict(cache_seqlens=torch.tensor([0, 7, 18], dtype=torch.int32),
              k=rand(b, sq, hk, d, seed=seed + 3), v=rand(b, sq, hk, d, seed=seed + 4))
    if not paged:
        return q, contiguous_k, contiguous_v, kw
    # The same caches cut into pages and stored in a shuffled order.
    order = torch.randperm(b * pages, generator=torch.Generator().manual_seed(seed))
    k_pages = torch.empty(b * pages, page, hk, d, dtype=f64)
    v_pages = torch.empty_like(k_pages)
    k_pages[order] = contiguous_k.reshape(b * pages, page, hk, d)
    v_pages[order] = contiguous_v.reshape(b * pages, page, hk, d)
    kw["block_table"] = order.view(b, pages).to(torch.int32)
    return q, k_pages, v_pages, kw


@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_paged_is_the_contiguous_cache(causal):
    q, k, v, kw = _kvcache_case(paged=False)
    out, lse, k_after, _ = R.kvcache_reference(q, k, v, causal=causal, **kw)
    qp, kp, vp, kwp = _kvcache_case(paged=True)
    out_p, lse_p, kp_after, _ = R.kvcache_reference(qp, kp, vp, causal=causal, **kwp)
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
    table = kwp["block_table"].long()
    assert torch.equal(kp_after[table].reshape(k_after.shape), k_after)


def test_kvcache_appends_then_attends_bottom_right():
    """The new keys land at cache_seqlens[b] and the query tokens are the last positions: the
    same as attention_reference over the first cache_seqlens + seqlen_new keys."""
    q, k, v, kw = _kvcache_case(paged=False)
    out, lse, k_after, v_after = R.kvcache_reference(q, k, v, causal=True, **kw)
    for b, n in enumerate(kw["cache_seqlens"].tolist()):
        assert torch.equal(k_after[b, n:n + 2], kw["k"][b])
        assert torch.equal(k_after[b, :n], k[b, :n]) and torch.equal(k_after[b, n + 2:], k[b, n + 2:])
        want, want_lse = R.attention_reference(q[b:b + 1], k_after[b:b + 1, :n + 2],
                                               v_after[b:b + 1, :n + 2], causal=True,
                                               mask_align="bottom_right")
        assert torch.allclose(out[b:b + 1], want) and torch.allclose(lse[b:b + 1], want_lse)


def test_kvcache_rotates_q_per_token_only_under_a_mask():
    q, k, v, kw = _kvcache_case(paged=False)
    angles = rand(32, 4, seed=9)
    kw.update(rotary_cos=angles.cos(), rotary_sin=angles.sin())
    lengths = kw["cache_seqlens"].long()
    for causal, steps in ((True, torch.arange(2)), (False, torch.zeros(2, dtype=torch.long))):
        out, _, k_after, _ = R.kvcache_reference(q, k, v, causal=causal, **kw)
        positions = lengths[:, None] + steps
        q_rot = R.rotary(q, angles.cos(), angles.sin(), positions, False)
        k_rot = R.rotary(kw["k"], angles.cos(), angles.sin(), lengths[:, None] + torch.arange(2),
                         False)
        for b, n in enumerate(lengths.tolist()):
            assert torch.equal(k_after[b, n:n + 2], k_rot[b])
        want, _ = R.attention_reference(q_rot, k_after, _appended(v, kw), causal=causal,
                                        mask_align="bottom_right", seqused_k=lengths + 2)
        assert torch.allclose(out, want)


def _appended(v, kw):
    """The contiguous cache v with kw's new values written at each sequence's length."""
    out = v.clone()
    for b, n in enumerate(kw["cache_seqlens"].tolist()):
        out[b, n:n + 2] = kw["v"][b]
    return out


# ---- the e4m3 KV-cache reference -------------------------------------------------------------

def test_quantize_e4m3_rounds_to_nearest_even_and_saturates():
    scale = torch.tensor([[2.0]])
    x = torch.tensor([1.0, 1.125 * 2 * 1.0, 2.0 * 1.0625, 1000.0, -1000.0, 0.0, 2.0 * 2 ** -9])
    codes = R.quantize_e4m3(x.view(1, -1, 1, 1), scale).float().flatten()
    # 0.5, 1.125 (exact), 1.0625 halfway between 1 and 1.125: even mantissa 1.0, saturated
    # +-448, zero, and the smallest subnormal 2^-9.
    assert codes.tolist() == [0.5, 1.125, 1.0, 448.0, -448.0, 0.0, 2.0 ** -9]


def test_e4m3_scales_of_every_accepted_shape():
    per_tensor, per_head = torch.tensor(0.5), torch.tensor([1.0, 2.0])
    table = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert torch.equal(R.e4m3_scales(per_tensor, 3, 2), torch.full((3, 2), 0.5))
    assert torch.equal(R.e4m3_scales(per_tensor.view(1), 3, 2), torch.full((3, 2), 0.5))
    assert torch.equal(R.e4m3_scales(per_head, 3, 2), per_head.expand(3, 2))
    assert torch.equal(R.e4m3_scales(table, 3, 2), table)


@pytest.mark.parametrize("paged", [False, True])
def test_e4m3_reference_is_the_16_bit_one_on_dequantized_caches(paged):
    """Appending to e4m3 caches with per-(sequence, head) scales writes the quantized tokens
    where the 16-bit reference writes them, and attends as the 16-bit reference does over the
    caches dequantized (float64) and the appended tokens quantized and dequantized."""
    gen = torch.Generator().manual_seed(0)
    batch, hk, d, capacity, page = 2, 2, 16, 32, 8
    scale_k = 0.01 + torch.rand(batch, hk, generator=gen) * 0.02
    scale_v = 0.01 + torch.rand(hk, generator=gen) * 0.02
    rows = batch * capacity // page if paged else batch
    keys_per_row = page if paged else capacity
    k8 = (torch.randn(rows, keys_per_row, hk, d, generator=gen) * 30).to(torch.float8_e4m3fn)
    v8 = (torch.randn(rows, keys_per_row, hk, d, generator=gen) * 30).to(torch.float8_e4m3fn)
    kw = dict(cache_seqlens=torch.tensor([5, 20], dtype=torch.int32), causal=True)
    if paged:
        kw["block_table"] = torch.randperm(rows, generator=gen).view(batch, -1).int()
    q = torch.randn(batch, 3, 4, d, generator=gen).bfloat16()
    k_new = torch.randn(batch, 3, hk, d, generator=gen).bfloat16()
    v_new = torch.randn(batch, 3, hk, d, generator=gen).bfloat16()
    out, lse, k_after, v_after = R.kvcache_reference_e4m3(
        q, k8, v8, k_new, v_new, k_scale=scale_k, v_scale=scale_v, **kw)

    k_table, v_table = scale_k, R.e4m3_scales(scale_v, batch, hk)
    k_dq = R.quantize_e4m3(k_new, k_table).double() * k_table.double()[:, None, :, None]
    v_dq = R.quantize_e4m3(v_new, v_table).double() * v_table.double()[:, None, :, None]
    caches = []
    for cache, table in ((k8, k_table), (v8, v_table)):
        gathered = R.gather_cache(cache, batch, block_table=kw.get("block_table"))
        caches.append(gathered.double() * table.double()[:, None, :, None])
    want, want_lse, k_written, _ = R.kvcache_reference(
        q, caches[0], caches[1], k_dq, v_dq, cache_seqlens=kw["cache_seqlens"], causal=True)
    assert torch.allclose(out, want) and torch.allclose(lse, want_lse)
    k_codes = R.gather_cache(k_after, batch, block_table=kw.get("block_table"))
    assert torch.equal(k_codes.double() * k_table.double()[:, None, :, None], k_written)
    assert torch.equal(R.gather_cache(v_after, batch, block_table=kw.get("block_table"))[0, :5],
                       R.gather_cache(v8, batch, block_table=kw.get("block_table"))[0, :5])


# ---- the e4m3 forward's references (fwd_reference_e4m3) --------------------------------------

E4M3 = torch.float8_e4m3fn


def test_round_e4m3_is_torchs_cast_on_float32_values():
    gen = torch.Generator().manual_seed(0)
    exponents = torch.randint(-14, 10, (20000,), generator=gen).float()
    x = torch.randn(20000, generator=gen) * exponents.exp2()
    # Every midpoint between neighbouring e4m3 values (exact in float32): ties to even.
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = codes[codes.isfinite()].unique()
    mids = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([x, grid, mids, torch.tensor([449.0, 463.9, 464.0, 1e6, -1e6, 0.0, -0.0])])
    want = x.clamp(-448, 448).to(E4M3).double()
    got = R.round_e4m3(x.double())
    assert torch.equal(got, want)
    assert torch.equal(R.round_e4m3(x), want.float())  # in float32 too


def test_round_e4m3_known_values():
    x = torch.tensor([1.0625, 1.1875, 3.3, 232.0, 240.0, 450.0, -1000.0, 2.0 ** -10,
                      3 * 2.0 ** -11, 0.0117, 0.0009, float("inf")], dtype=torch.float64)
    want = [1.0, 1.25, 3.25, 224.0, 240.0, 448.0, -448.0, 0.0, 2.0 ** -9, 6 * 2.0 ** -9, 0.0,
            448.0]
    assert R.round_e4m3(x).tolist() == want
    assert R.round_e4m3(torch.tensor([float("nan")])).isnan().all()
    # Rounded once from float64: just above a tie goes up, where float32 would land on the tie
    # and round it to even.
    above = torch.tensor([1.0625 + 2.0 ** -30], dtype=torch.float64)
    assert R.round_e4m3(above).item() == 1.125
    assert above.float().to(E4M3).item() == 1.0


def test_descale_table_takes_the_shapes_that_broadcast():
    b, hk = 3, 2
    for shape in ((), (1,), (1, 1), (b, 1), (1, hk), (hk,), (b, hk)):
        t = torch.rand(shape) + 0.5
        assert torch.equal(R.descale_table(t, b, hk), t.double().expand(b, hk))
    assert torch.equal(R.descale_table(None, b, hk), torch.ones(b, hk, dtype=torch.float64))
    for shape in ((hk, b), (b, 4), (b + 1, hk), (1, 1, 1)):
        with pytest.raises(ValueError):
            R.descale_table(torch.ones(shape), b, hk)


def test_dequantize_indexes_descales_by_sequence_and_kv_head():
    gen = torch.Generator().manual_seed(1)
    b, s, hq, hk, d = 3, 5, 4, 2, 8
    x = torch.randn(b, s, hq, d, generator=gen)
    table = torch.rand(b, hk, generator=gen) + 0.5
    got = R.dequantize_e4m3(x, table, heads_per_descale=hq // hk)
    for h in range(hq):
        want = x[:, :, h].double() * table[:, h // 2].double()[:, None, None]
        assert torch.equal(got[:, :, h], want)
    # Group mode: sequences of 2, 0 and 3 rows packed, descale row b for sequence b's rows.
    packed = x[0]  # (5, hq, d)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    got = R.dequantize_e4m3(packed, table, cu_seqlens=cu, heads_per_descale=hq // hk)
    for row, seq in enumerate([0, 0, 2, 2, 2]):
        for h in range(hq):
            assert torch.equal(got[row, h], packed[row, h].double() * table[seq, h // 2].double())


@pytest.mark.parametrize("group", [False, True])
def test_to_e4m3_maps_each_groups_largest_magnitude_to_448(group):
    gen = torch.Generator().manual_seed(2)
    b, s, hq, hk, d = 2, 6, 4, 2, 16
    x = torch.randn(b, s, hq, d, generator=gen) * torch.tensor([0.01, 3.0, 0.5, 70.0])[:, None]
    cu = None
    if group:
        x, cu = x.reshape(b * s, hq, d), torch.tensor([0, 4, 4, b * s], dtype=torch.int32)
    codes, descale = R.to_e4m3(x, "tensor", cu_seqlens=cu, heads_per_descale=2)
    assert codes.dtype == E4M3 and descale.shape == (1, 1) and descale.dtype == torch.float32
    assert codes.float().abs().max().item() == 448.0
    codes, descale = R.to_e4m3(x, "head", cu_seqlens=cu, heads_per_descale=2)
    assert descale.shape == (3 if group else b, hk)
    if group:
        assert descale[1].tolist() == [1.0, 1.0]  # an empty sequence
        groups = [codes[0:4, 0:2], codes[0:4, 2:4], codes[4:, 0:2], codes[4:, 2:4]]
    else:
        groups = [codes[i, :, 2 * j:2 * j + 2] for i in range(b) for j in range(hk)]
    assert all(g.float().abs().max().item() == 448.0 for g in groups)
    back = R.dequantize_e4m3(codes, descale, cu_seqlens=cu, heads_per_descale=2)
    rel = (back - x.double()).abs() / x.double().abs()
    assert rel[x.abs() > descale.max() * 2 ** -6].max() <= 2 ** -4  # normal codes: half a step
    codes, descale = R.to_e4m3(x, None)
    assert descale is None and torch.equal(codes, x.clamp(-448, 448).to(E4M3))


def e4m3_problem(seed=0, b=2, sq=40, sk=300, hq=4, hk=2, d=32, kind="normal", group=False):
    """Codes, descales (per head) and the reference's keyword arguments of a small problem."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = R.study_inputs(kind, b, sq, hq, hk, d, seqlen_k=sk, gen=gen)
    kw = {}
    if group:
        q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
        kw.update(cu_seqlens_q=torch.tensor([0, sq, 2 * sq], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, sk, 2 * sk], dtype=torch.int32),
                  max_seqlen_q=sq, max_seqlen_k=sk)
    cu_q, cu_k = kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")
    (q8, qd), (k8, kd), (v8, vd) = (R.to_e4m3(x, "head", cu_seqlens=cu, heads_per_descale=per)
                                    for x, cu, per in ((q, cu_q, hq // hk), (k, cu_k, 1),
                                                       (v, cu_k, 1)))
    return q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd, **kw)


E4M3_MASKS = [dict(), dict(causal=True, mask_align="bottom_right"),
              dict(window_size=(37, 5), mask_align="top_left")]


@pytest.mark.parametrize("group", [False, True])
@pytest.mark.parametrize("mask", E4M3_MASKS, ids=["none", "causal_br", "window"])
def test_e4m3_truth_is_attention_of_the_dequantized_inputs(mask, group):
    q8, k8, v8, kw = e4m3_problem(group=group)
    ref = R.fwd_reference_e4m3(q8, k8, v8, **kw, **mask)
    cu = dict(cu_seqlens=kw.get("cu_seqlens_q"))
    qd = R.dequantize_e4m3(q8, kw["q_descale"], heads_per_descale=2, **cu)
    kd, vd = (R.dequantize_e4m3(x, kw[f"{n}_descale"], cu_seqlens=kw.get("cu_seqlens_k"))
              for x, n in ((k8, "k"), (v8, "v")))
    rest = {key: value for key, value in kw.items() if not key.endswith("descale")}
    want, want_lse = R.attention_reference(qd, kd, vd, **rest, **mask)
    assert torch.equal(ref.truth, want) and torch.equal(ref.lse, want_lse)
    assert ref.truth.dtype == torch.float64


@pytest.mark.parametrize("p_max", ["final", "running"])
@pytest.mark.parametrize("group", [False, True])
@pytest.mark.parametrize("mask", E4M3_MASKS, ids=["none", "causal_br", "window"])
def test_e4m3_unrounded_p_is_the_truth(mask, group, p_max):
    q8, k8, v8, kw = e4m3_problem(group=group)
    ref = R.fwd_reference_e4m3(q8, k8, v8, **kw, **mask, p_max=p_max, round_p=False)
    torch.testing.assert_close(ref.quantized, ref.truth, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("p_max", ["final", "running"])
@pytest.mark.parametrize("mask", E4M3_MASKS, ids=["none", "causal_br", "window"])
def test_e4m3_rounding_p_moves_the_output_within_its_bound(mask, p_max):
    """Rounding P (times 256) to e4m3 moves each weight by at most 2^-4 of itself (a normal
    code: half a step of 3 mantissa bits) or 2^-10 (a subnormal, half of 2^-9), relative to
    the row sum; so |O_quantized - O| <= sum_j (2^-4 p_j + 2^-10 / l) |v_j| per element. It
    moves it: the quantizing reference is not the truth."""
    q8, k8, v8, kw = e4m3_problem(seed=3)
    ref = R.fwd_reference_e4m3(q8, k8, v8, **kw, **mask, p_max=p_max)
    moved = (ref.quantized - ref.truth).abs()
    assert moved.max() > 1e-4 * ref.truth.abs().max()
    # The bound, from the truth's probabilities and the row sums (in units of P * 256).
    b, sq, hq, _ = q8.shape
    qd = R.dequantize_e4m3(q8, kw["q_descale"], heads_per_descale=2)
    kd = R.dequantize_e4m3(k8, kw["k_descale"]).repeat_interleave(2, dim=2)
    vd = R.dequantize_e4m3(v8, kw["v_descale"]).repeat_interleave(2, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) / math.sqrt(q8.shape[-1])
    left, right = R.window_bounds(mask.get("causal", False), mask.get("window_size"))
    vis = R.visible(sq, k8.shape[1], left, right, mask.get("mask_align", "top_left"))
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    rowsum = 256 * torch.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True)
    # A running max only makes the weights' codes larger (never subnormal where the final max
    # leaves them normal), so the final max's bound holds for both.
    slack = 2.0 ** -4 * p + torch.where(vis, 2.0 ** -10 / rowsum, torch.zeros_like(p))
    bound = torch.einsum("bhqk,bkhd->bqhd", slack.nan_to_num(0.0), vd.abs())
    assert (moved <= bound * (1 + 1e-9) + 1e-15).all()


def test_e4m3_p_is_rounded_at_known_values():
    """One query, keys whose logits put 256 * P at 256, 3.3, 0.0117 and 0.0009 (d = 1, q = 1,
    softmax_scale 1, float64 values): the codes are 256, 3.25, 6 * 2^-9 and 0, over the
    unrounded row sum."""
    p = torch.tensor([256.0, 3.3, 0.0117, 0.0009], dtype=torch.float64)
    logits = torch.log(p / 256)
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = logits.view(1, 4, 1, 1)
    v = torch.eye(4, dtype=torch.float64).view(1, 4, 1, 4)
    ref = R.fwd_reference_e4m3(q, k, v, softmax_scale=1.0)
    want = torch.tensor([256.0, 3.25, 6 * 2.0 ** -9, 0.0], dtype=torch.float64) / p.sum()
    torch.testing.assert_close(ref.quantized.flatten(), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(ref.truth.flatten(), p / p.sum(), rtol=1e-12, atol=0)
    torch.testing.assert_close(ref.lse.flatten(), torch.logsumexp(logits, 0).view(1),
                               rtol=1e-12, atol=0)


def online_softmax_e4m3(q, k, v, *, scale, block_n=128, p_scale=256.0, visible=None,
                        order="last_to_first"):
    """The kernel's loop as docs/design/fp8.md and the issue describe it, one (query head)
    row block in float64: key tiles of block_n visited last to first (or first to last), the
    exact running max, P = round_e4m3(p_scale * exp(s - m)) into the output, rescaled by
    exp(m_old - m_new) when the max grows, the row sum of the unrounded values; q (sq, d),
    k (sk, d), v (sk, dv)."""
    sq, sk = q.shape[0], k.shape[0]
    acc = torch.zeros(sq, v.shape[1], dtype=torch.float64)
    m = torch.full((sq, 1), float("-inf"), dtype=torch.float64)
    rowsum = torch.zeros(sq, 1, dtype=torch.float64)
    starts = range(0, sk, block_n)
    for start in (reversed(starts) if order == "last_to_first" else starts):
        s = (q @ k[start:start + block_n].T) * scale
        if visible is not None:
            s = s.masked_fill(~visible[:, start:start + block_n], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        grow = torch.where(torch.isfinite(m), torch.exp(m - safe), torch.zeros_like(m))
        p = p_scale * torch.exp(s - safe)
        acc = acc * grow + R.round_e4m3(p) @ v[start:start + block_n]
        rowsum = rowsum * grow + p.sum(-1, keepdim=True)
        m = m_new
    return torch.where(rowsum > 0, acc / rowsum.clamp(min=1e-300), torch.zeros_like(acc))


# (p_scale, order): the kernel's (the reference's defaults), and the others it can be given.
E4M3_P_VARIANTS = [dict(), dict(order="first_to_last"), dict(p_scale=1.0),
                   dict(p_scale=448.0, order="first_to_last")]


@pytest.mark.parametrize("variant", E4M3_P_VARIANTS, ids=["kernel", "fl", "scale1", "448fl"])
@pytest.mark.parametrize("kind", ["normal", "sinks", "outlier_channels"])
@pytest.mark.parametrize("mask", E4M3_MASKS[:2], ids=["none", "causal_br"])
def test_e4m3_running_max_reference_is_the_kernels_loop(mask, kind, variant):
    q8, k8, v8, kw = e4m3_problem(seed=4, b=1, sq=70, sk=333, kind=kind)
    ref = R.fwd_reference_e4m3(q8, k8, v8, **kw, **mask, p_max="running", **variant)
    qd = R.dequantize_e4m3(q8, kw["q_descale"], heads_per_descale=2)[0]
    kd = R.dequantize_e4m3(k8, kw["k_descale"])[0]
    vd = R.dequantize_e4m3(v8, kw["v_descale"])[0]
    left, right = R.window_bounds(mask.get("causal", False), None)
    vis = R.visible(70, 333, left, right, mask.get("mask_align", "top_left"))
    for h in range(q8.shape[2]):
        want = online_softmax_e4m3(qd[:, h], kd[:, h // 2], vd[:, h // 2],
                                   scale=1 / math.sqrt(q8.shape[-1]), visible=vis, **variant)
        torch.testing.assert_close(ref.quantized[0, :, h], want, rtol=1e-10, atol=1e-13)


def running_weights(s, order=None, p_scale=256.0):
    """e4m3_p_weights with the running max (order None: the default) on logits s."""
    options = {} if order is None else dict(order=order)
    return R.e4m3_p_weights(p_scale, "running", **options)(s, torch.logsumexp(s, -1))


def test_e4m3_an_order_is_the_final_max_where_its_first_tile_holds_the_max():
    """Where the tile an order visits first holds the row max, its running max is the final
    max from the start: the weights are the final max's, bit for bit. With the max in both the
    first and the last tile the two orders agree; with it in the first tile only (sinks) they
    do not. The default order is the kernel's, last to first."""
    gen = torch.Generator().manual_seed(7)
    s = torch.randn(2, 3, 5, 1000, generator=gen, dtype=torch.float64)  # 8 tiles, the last 104
    final = R.e4m3_p_weights(p_max="final")
    first, last, both = s.clone(), s.clone(), s.clone()
    first[..., 3] += 10.0
    last[..., 990] += 10.0
    both[..., 3] += 10.0
    both[..., 990] = both[..., 3]
    assert torch.equal(running_weights(last, "last_to_first"),
                       final(last, torch.logsumexp(last, -1)))
    assert torch.equal(running_weights(first, "first_to_last"),
                       final(first, torch.logsumexp(first, -1)))
    assert torch.equal(running_weights(both, "last_to_first"),
                       running_weights(both, "first_to_last"))
    assert not torch.equal(running_weights(first, "last_to_first"),
                           running_weights(first, "first_to_last"))
    for x in (s, first, last):
        assert torch.equal(running_weights(x), running_weights(x, "last_to_first"))


@pytest.mark.parametrize("kind", ["normal", "sinks"])
def test_e4m3_first_to_last_is_last_to_first_on_reversed_keys(kind):
    """With whole tiles and no mask, visiting the tiles first to last is visiting those of the
    reversed keys (and values) last to first: the same outputs, up to the order of P V's sums.
    The reversal matters: the default order on the reversed keys differs."""
    q8, k8, v8, kw = e4m3_problem(seed=8, sk=384, kind=kind)

    def flip(x):  # float8 codes reversed along the keys (through their bytes)
        return x.view(torch.uint8).flip(1).view(E4M3)

    fl = R.fwd_reference_e4m3(q8, k8, v8, **kw, p_max="running", order="first_to_last")
    lf = R.fwd_reference_e4m3(q8, flip(k8), flip(v8), **kw, p_max="running")
    torch.testing.assert_close(fl.quantized, lf.quantized, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(fl.truth, lf.truth, rtol=1e-12, atol=1e-15)
    kernel = R.fwd_reference_e4m3(q8, k8, v8, **kw, p_max="running")
    assert (kernel.quantized - fl.quantized).abs().max() > 1e-6 * fl.truth.abs().max()


def test_e4m3_p_scale_1_rounds_small_probabilities_to_0():
    """P unscaled (p_scale 1) takes e4m3's own codes: relative to the row max, P of 2^-6 on is
    a normal code, between 2^-10 and 2^-9 it rounds up to the smallest subnormal 2^-9, and at
    or below 2^-10 (half of it: the tie goes to even, 0) it is lost. 256 keeps every one."""
    p = torch.tensor([1.0, 2.0 ** -6, 1.5 * 2.0 ** -9, 0.75 * 2.0 ** -9, 2.0 ** -10,
                      2.0 ** -11, 2.0 ** -16], dtype=torch.float64)
    s = torch.log(p).view(1, 1, 1, -1)
    codes = torch.tensor([1.0, 2.0 ** -6, 2.0 ** -8, 2.0 ** -9, 0.0, 0.0, 0.0],
                         dtype=torch.float64)
    w = running_weights(s, p_scale=1.0).flatten()
    torch.testing.assert_close(w, codes / p.sum(), rtol=1e-14, atol=0)
    assert w[4:].eq(0).all() and w[:4].gt(0).all()
    w = running_weights(s, p_scale=256.0).flatten()
    assert w.gt(0).all()
    assert ((w - p / p.sum()).abs() <= 2.0 ** -4 * p / p.sum()).all()  # normal codes


def test_e4m3_p_scale_448_is_the_largest_that_cannot_saturate():
    """Relative to the exact running max P <= 1, so P x 448 is at most e4m3's largest value:
    the max key's code is 448 exactly. P x 512 saturates it to 448, an eighth low."""
    p = torch.tensor([1.0, 0.999, 0.5, 0.01], dtype=torch.float64)
    s = torch.log(p).view(1, 1, 1, -1)
    for scale in (256.0, 448.0, 512.0):
        w = running_weights(s, p_scale=scale).flatten()
        want = R.round_e4m3(scale * p) / (scale * p.sum())
        torch.testing.assert_close(w, want, rtol=1e-14, atol=0)
        code = w[0].item() * scale * p.sum().item()
        assert code == pytest.approx(448.0 if scale > 256 else 256.0, rel=1e-14)
        assert (code / scale == pytest.approx(1.0, rel=1e-14)) == (scale <= 448.0)


def test_e4m3_order_must_be_one_of_two():
    with pytest.raises(ValueError, match="order"):
        R.e4m3_p_weights(order="middle_out")
    q8, k8, v8, kw = e4m3_problem()
    with pytest.raises(ValueError, match="order"):
        R.fwd_reference_e4m3(q8, k8, v8, **kw, p_max="running", order="backwards")


def test_e4m3_running_max_keeps_small_p_out_of_the_subnormals_with_sinks():
    """Four sink keys in the first tile (visited last) with logits 12 above the others: relative
    to the final max the other keys' P * 256 fall among e4m3's subnormals or to 0 (relative
    errors far past 2^-4); relative to the running max they stay normal codes, within 2^-4."""
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(1, 1, 1, 1024, generator=gen, dtype=torch.float64)
    s[..., :4] += 12.0
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    others = slice(128, None)  # keys outside the sinks' tile
    for p_max, worst in (("final", None), ("running", 2.0 ** -4)):
        w = R.e4m3_p_weights(p_max=p_max)(s, lse)
        rel = ((w - p).abs() / p)[..., others].max().item()
        if worst is None:
            assert rel > 0.2, f"{p_max}: {rel}"
        else:
            assert rel <= worst * (1 + 1e-9), f"{p_max}: {rel}"


def test_study_inputs_are_what_they_say():
    gen = torch.Generator().manual_seed(6)
    q, k, v = R.study_inputs("normal", 2, 100, 4, 2, 64, seqlen_k=50, gen=gen)
    assert q.shape == (2, 100, 4, 64) and k.shape == v.shape == (2, 50, 2, 64)
    q, k, v = R.study_inputs("fa3_outliers", 1, 4096, 4, 4, 128, gen=gen)
    for x in (q, k, v):
        big = (x.abs() > 6).double().mean().item()  # N(0, 1) alone: 2e-9 of them
        assert 0.0005 < big < 0.0015
    q, k, v = R.study_inputs("outlier_channels", 1, 512, 2, 2, 64, gen=gen)
    std_q, std_k = q.std(dim=(0, 1, 2)), k.std(dim=(0, 1, 2))
    assert (std_q > 5).sum() == 4 and (std_k > 5).sum() == 4
    assert not ((std_q > 5) & (std_k > 5)).any()
    q, k, v = R.study_inputs("sinks", 1, 256, 2, 2, 64, seqlen_k=1024, gen=gen)
    _, lse = R.attention_reference(q.double(), k.double(), v.double())
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 8
    sink_mass = torch.exp(s[..., :4] - lse[..., None]).sum(-1)
    assert sink_mass.min() > 0.8 and sink_mass.mean() > 0.95
    with pytest.raises(ValueError):
        R.study_inputs("uniform", 1, 8, 1, 1, 8)


def e4m3_stand_in(q, k, v, *, return_lse=False, out=None, instance=None, p_max="running",
                  spoil=None, out_dtype=None, **kw):
    """A CPU stand-in for fmha.fwd's e4m3 forward: the quantizing reference with the kernel's
    running max, rounded to bf16 or out_dtype (spoil(out, lse) breaks it in a chosen way)."""
    ref = R.fwd_reference_e4m3(q, k, v, p_max=p_max, **kw)
    o = ref.quantized.to(torch.bfloat16 if out_dtype is None else out_dtype)
    lse = ref.lse.float()
    if spoil is not None:
        o, lse = spoil(o, lse, ref)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o


def e4m3_manifest():
    """Rows of e4m3 instances as fmha.instances() lists them: V^T (vlayout col) in batch mode,
    row-major V in batch and group mode."""
    return [dict(name=f"fwd_e4m3_d{d}_{mask}_{mode}_{vlayout}{'_lse' if lse else ''}",
                 dtype="e4m3", hdim_q=d, hdim_v=d, mask=mask, mode=mode, lse=lse, bias="none",
                 vlayout=vlayout, dropout=False, softcap=False, pipeline="fa3", arch="sm90a",
                 block_m=128, block_n=128, pad_seqlen=True, pad_hdim=False)
            for d in (64, 128, 256) for mask in ("none", "causal", "window")
            for mode, vlayout in (("batch", "col"), ("batch", "row"), ("group", "row"))
            for lse in (False, True)]


@pytest.mark.parametrize("inst", e4m3_manifest(), ids=lambda i: i["name"])
def test_e4m3_instance_cases_fit_and_cover_the_issue(inst):
    cases = R.e4m3_instance_cases(inst)
    ids = [case_id for case_id, _ in cases]
    assert len(set(ids)) == len(ids), ids
    specs = [case for _, case in cases]
    for case_id, case in cases:
        assert not R.e4m3_fits(case, inst), f"{case_id}: {R.e4m3_fits(case, inst)}"
        other = dict(inst, mask={"none": "causal", "causal": "window", "window": "none"}[
            inst["mask"]])
        assert R.e4m3_fits(case, other) == "mask"
        other = dict(inst, vlayout={"row": "col", "col": "row"}[inst["vlayout"]])
        assert R.e4m3_fits(case, other) == "vlayout"
    assert {c.descale for c in specs} == set(R.DESCALE_KINDS)
    assert {c.vcol for c in specs} == {inst["vlayout"] == "col"}
    assert any(c.hq == 4 * c.hk for c in specs), "GQA 4:1"
    lengths = ([(q, k) for c in specs for q, k in zip(c.seqlens_q, c.seqlens_k)] if
               inst["mode"] == "group" else [(c.sq, c.sk) for c in specs])
    assert any(q < k for q, k in lengths) and any(q > k for q, k in lengths)
    assert {1, 127, 200, 1000} <= {n for pair in lengths for n in pair}
    if inst["mode"] == "group":  # packed sequences starting at keys not multiples of 16
        starts = {sum(c.seqlens_k[:i]) for c in specs for i in range(len(c.seqlens_k))}
        assert {1, 18, 154} <= starts
    if inst["lse"]:
        assert any(c.lse for c in specs) and any(not c.lse for c in specs)
    if inst["mask"] != "none":
        assert {c.align for c in specs} == set(R.ALIGNS)


def sees_no_key_somewhere(case) -> bool:
    """Whether a query row of the case sees no key, by its lengths and mask alone."""
    left, right = R.window_bounds(case.causal, case.window)
    pairs = (list(zip(case.seqlens_q, case.seqlens_k)) if case.group else [(case.sq, case.sk)])
    return any(sq and not R.visible(sq, sk, left, right, case.align).any(-1).all()
               for sq, sk in pairs)


def test_e4m3_cases_have_rows_that_see_no_key():
    for inst in e4m3_manifest():
        if inst["mask"] == "none" and inst["mode"] == "batch":
            continue  # every row sees every key
        assert any(sees_no_key_somewhere(case) for _, case in R.e4m3_instance_cases(inst)), (
            f"{inst['name']}: no case whose mask or lengths empty a row")
    # The structural test above agrees with the reference's lse on one case.
    inst = e4m3_manifest()[-1]  # d256, window, group, row-major V, lse
    _, case = next((i, c) for i, c in R.e4m3_instance_cases(inst) if sees_no_key_somewhere(c))
    inputs = R.make_e4m3_inputs(case.replace(d=16, dv=16), "cpu")
    ref = R.fwd_reference_e4m3(inputs.q, inputs.k, inputs.v, **inputs.ref_kwargs)
    assert torch.isneginf(ref.lse).any()


@pytest.mark.parametrize("case_index", [1, 3, 5, 7])
def test_check_fwd_e4m3_accepts_the_kernels_algorithm(case_index):
    """The whole GPU check on the CPU stand-in: inputs in their layouts (V^T views into
    NaN-padded buffers, q and k in NaN-padded views), descales, the returned out= tensor, the
    pass rule. Cases of a causal batch instance and a window group one, at head dim 64."""
    batch = [i for i in e4m3_manifest() if i["name"] == "fwd_e4m3_d64_causal_batch_col_lse"][0]
    group = [i for i in e4m3_manifest() if i["name"] == "fwd_e4m3_d64_window_group_row_lse"][0]
    cases = R.e4m3_instance_cases(batch) + R.e4m3_instance_cases(group)
    case_id, case = cases[case_index % len(cases)]
    for out_param in (False, True):
        result = R.check_fwd_e4m3(e4m3_stand_in, case, device="cpu", seed=case_index,
                                  out_param=out_param, what=case_id)
        assert result.ratio <= 1


@pytest.mark.parametrize("case_index", [0, 5])
def test_check_fwd_e4m3_takes_an_fp16_output(case_index):
    """out_dtype=torch.float16 (passed to fwd): the output must be fp16, and the pass rule's
    floor is fp16's rounding; a bf16 output where fp16 was asked fails."""
    group = [i for i in e4m3_manifest() if i["name"] == "fwd_e4m3_d64_window_group_row_lse"][0]
    case_id, case = R.e4m3_instance_cases(group)[case_index]
    for out_param in (False, True):
        result = R.check_fwd_e4m3(e4m3_stand_in, case, device="cpu", seed=case_index,
                                  out_param=out_param, what=case_id, out_dtype=torch.float16)
        assert result.ratio <= 1
    ignores = lambda *a, out_dtype=None, **kw: e4m3_stand_in(*a, **kw)  # noqa: E731
    with pytest.raises(AssertionError, match="output torch.bfloat16 on cpu, want torch.float16"):
        R.check_fwd_e4m3(ignores, case, device="cpu", out_dtype=torch.float16)


def test_the_output_rounding_floor_follows_the_output_dtype():
    """compare_e4m3's floor stands for the output's own rounding: fp16's is an eighth of
    bf16's (3 more mantissa bits) in the normal range, and a subnormal's spacing below it."""
    truth = torch.tensor([[0.75, -3.0, 40.0, 2.0 ** -20]], dtype=torch.float64)
    floors = {dtype: R._errors(truth.to(dtype).double(), truth, truth, 2.0, 2.0, dtype)
              for dtype in (torch.bfloat16, torch.float16)}
    assert floors[torch.bfloat16]["floor_max"] == 8 * floors[torch.float16]["floor_max"]
    assert floors[torch.float16]["floor_max"] == 2 * 2.0 ** (5 - 10)
    half_ulps = torch.tensor([2.0 ** -12, 2.0 ** -10, 2.0 ** -6, 2.0 ** -25])  # fp16's
    assert floors[torch.float16]["floor_rms"] == pytest.approx(2 * R.rms(half_ulps))


def spoiled(spoil, p_max="running"):
    return lambda *a, **kw: e4m3_stand_in(*a, **kw, p_max=p_max, spoil=spoil)


def _shifted(o, ref, by):
    return (o.double() + by).to(o.dtype)


@pytest.mark.parametrize("spoil,match", [
    (lambda o, lse, ref: (o.index_fill(1, torch.tensor([900]), 0.5), lse), "max error"),
    (lambda o, lse, ref: (_shifted(o, ref, 3 * R.rms(ref.quantized - ref.truth)), lse),
     "RMS error"),
    (lambda o, lse, ref: (o.index_fill(1, torch.tensor([3]), float("nan")), lse), "NaN output"),
    (lambda o, lse, ref: (o, lse + 0.05), "lse error"),
    (lambda o, lse, ref: (o + (lse.transpose(1, 2).unsqueeze(-1).isneginf() * 1e-3).to(o.dtype),
                          lse), "no key must be exactly 0"),
    (lambda o, lse, ref: (o, lse.nan_to_num(neginf=0.0)), "no key must have lse -inf"),
], ids=["element", "rms", "nan", "lse", "empty_row", "empty_lse"])
def test_check_fwd_e4m3_rejects_a_faulty_kernel(spoil, match):
    """A wrong element, all elements shifted by 3x the reference's RMS error (within 2x its max
    error), a NaN, lse off by 0.05, rows that see no key not 0
    or their lse not -inf: each fails check_fwd_e4m3 with its own message. (1000 queries on
    127 keys, causal bottom-right: the first 873 rows see no key.)"""
    inst = [i for i in e4m3_manifest() if i["name"] == "fwd_e4m3_d64_causal_batch_row_lse"][0]
    _, case = R.e4m3_instance_cases(inst)[4]
    assert (case.sq, case.sk) == (1000, 127)
    case = case.replace(align="bottom_right", lse=True)
    with pytest.raises(AssertionError, match=match):
        R.check_fwd_e4m3(spoiled(spoil), case, device="cpu")


def test_final_max_reference_is_a_fair_yardstick_for_the_running_max():
    """The pass rule's 2x holds with room for the kernel's algorithm (running max, bf16
    output) against the final-max reference, on every input kind of the study."""
    for kind in R.STUDY_KINDS:
        q8, k8, v8, kw = e4m3_problem(seed=7, b=1, sq=128, sk=640, hq=2, hk=2, d=64, kind=kind)
        ref = R.fwd_reference_e4m3(q8, k8, v8, **kw)
        out = e4m3_stand_in(q8, k8, v8, **kw)
        result = R.compare_e4m3(out, ref, what=kind)
        assert result.ratio < 0.75, (kind, result)
