"""fmha.integrations without a GPU: the kernel calls swapped for the float64 reference.

fmha.fwd (and fmha.bwd) are replaced, per test, by tests/reference.py's float64 attention with
the same keywords, so what is checked is what the integrations hand the kernels: the tokens a
padding mask keeps packed into group mode and laid back out, the causal alignment of prefill,
chunk and decode steps, sliding windows, soft-capping, head dims padded to multiples of 8,
sequences packed into one row, and SDPA's operator contract. The expected outputs are computed
row by row on each sequence's own tokens, from the definitions of the callers (transformers'
and SDPA's), with the same reference. Tests of whole transformers models need transformers
(not installed in CI) and skip without it; everything else needs torch and a built fmha only.
"""

import copy
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")
import torch.nn.functional as F  # noqa: E402

from fmha.integrations import _flash, sdpa  # noqa: E402
from fmha.integrations import transformers as hf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference as R  # noqa: E402

# float64 all the way: the swapped kernel and the expected values differ by rounding only.
ATOL = 1e-12


def reference_fwd(q, k, v, causal=False, softmax_scale=None, *, return_lse=False, **options):
    """fmha.fwd's signature on the float64 reference, in q's dtype; every call is recorded."""
    reference_fwd.calls.append(dict(q=q, k=k, v=v, causal=causal, **options))
    out, lse = R.attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                     **options)
    out = out.to(q.dtype)
    return (out, lse.float()) if return_lse else out


def reference_fwd_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, **options):
    """fmha.fwd_kvcache's signature on the float64 reference, in q's dtype; every call is
    recorded in reference_fwd.calls, marked kvcache=True."""
    reference_fwd.calls.append(dict(q=q, k=k_cache, v=v_cache, cache_seqlens=cache_seqlens,
                                    kvcache=True, **options))
    out, _, _, _ = R.kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                       **options)
    return out.to(q.dtype)


def reference_bwd(dout, q, k, v, out, lse, causal=False, softmax_scale=None, *,
                  deterministic=False, **options):
    """fmha.bwd's signature on the reference's gradients (autograd in float64), in q's dtype.

    It runs in a thread of its own: called from SDPA's backward operator, it is inside an
    operator's kernel, where the dispatcher has autograd off for the calling thread."""
    for t in (dout, q, k, v, out):
        assert t.stride(-1) == 1, "fmha.bwd takes a contiguous head dim"
    with ThreadPoolExecutor(1) as thread:
        grads = thread.submit(R.attention_grads, q, k, v, dout, causal=causal,
                              softmax_scale=softmax_scale, **options).result()
    return grads.dq.to(q.dtype), grads.dk.to(k.dtype), grads.dv.to(v.dtype)


@pytest.fixture
def kernels(monkeypatch):
    """fmha.fwd, fmha.fwd_kvcache and fmha.bwd as the float64 reference; reference_fwd.calls
    lists the calls."""
    reference_fwd.calls = []
    monkeypatch.setattr(fmha, "fwd", reference_fwd)
    monkeypatch.setattr(fmha, "fwd_kvcache", reference_fwd_kvcache)
    monkeypatch.setattr(fmha, "bwd", reference_bwd)
    return reference_fwd.calls


def randn(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def qkv(batch=3, seqlen_q=7, seqlen_k=7, heads=4, heads_k=2, head_dim=16, head_dim_v=None):
    """(batch, seqlen, heads, head_dim) q, k, v: the layout flash_attention takes."""
    return (randn(batch, seqlen_q, heads, head_dim, seed=1),
            randn(batch, seqlen_k, heads_k, head_dim, seed=2),
            randn(batch, seqlen_k, heads_k, head_dim_v or head_dim, seed=3))


def left_padded(lengths, seqlen):
    """The (batch, seqlen) bool mask of left-padded rows of these lengths."""
    return torch.stack([torch.arange(seqlen) >= seqlen - n for n in lengths])


def expected_rows(q, k, v, padding_mask=None, *, causal=True, scale=None, sliding_window=None,
                  softcap=0.0):
    """What a padded batch's attention means to transformers, row by row on its own tokens.

    Row b's tokens are the keys its padding mask keeps (all keys without one), numbered 0..n-1;
    its queries are the last seqlen_q columns, each the token of its column. A query at token
    position p sees the token at position j where j <= p (causal) and p - j < sliding_window
    (both sides when not causal): transformers' causal and sliding-window mask functions.
    Rows of padding queries are 0.
    """
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    if padding_mask is None:
        padding_mask = torch.ones(batch, seqlen_k, dtype=torch.bool)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for b in range(batch):
        kept = padding_mask[b].nonzero().flatten()
        position = torch.full((seqlen_k,), -1)
        position[kept] = torch.arange(kept.numel())
        query_columns = torch.arange(seqlen_k - seqlen_q, seqlen_k)
        query_rows = (position[query_columns] >= 0).nonzero().flatten()
        p = position[query_columns[query_rows]].view(-1, 1)
        j = torch.arange(kept.numel()).view(1, -1)
        sees = torch.ones(p.shape[0], j.shape[1], dtype=torch.bool)
        if causal:
            sees &= j <= p
        if sliding_window is not None:
            sees &= (p - j < sliding_window) & (causal or (j - p < sliding_window))
        rows, _ = R.attention_reference(q[b:b + 1, query_rows], k[b:b + 1, kept],
                                        v[b:b + 1, kept], attn_mask=sees, softmax_scale=scale,
                                        softcap=softcap)
        out[b, query_rows] = rows[0]
    return out


# ---- packing a padded batch -----------------------------------------------------------------


def test_pack_padding_mask_keeps_the_tokens_in_order():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    packed = _flash.pack_padding_mask(mask)
    assert packed.indices.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 14]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 8, 9]
    assert packed.max_seqlen == 5


def test_pack_padding_mask_of_an_empty_row():
    packed = _flash.pack_padding_mask(torch.tensor([[False, False], [True, True]]))
    assert packed.indices.tolist() == [2, 3]
    assert packed.cu_seqlens.tolist() == [0, 0, 2]


def test_scatter_undoes_gather_and_zeros_the_padding():
    mask = left_padded([5, 2, 4], 5)
    x = randn(3, 5, 2, 8)
    packed = _flash.pack_padding_mask(mask)
    tokens = _flash.gather_tokens(x, packed.indices)
    assert torch.equal(tokens, x[mask])
    restored = _flash.scatter_tokens(tokens, packed.indices, 3, 5)
    assert torch.equal(restored, x * mask.view(3, 5, 1, 1))


def test_pack_positions_splits_a_row_where_positions_restart():
    cu_seqlens, max_seqlen = _flash.pack_positions(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 3, 5, 9]
    assert max_seqlen == 4
    # RoBERTa-style ids start past 0; a row of one sequence is no packing.
    assert _flash.pack_positions(torch.tensor([[2, 3, 4, 2, 3]]))[0].tolist() == [0, 3, 5]
    assert _flash.pack_positions(torch.tensor([[5, 6, 7, 8]])) is None


def test_a_forwards_layers_pack_its_positions_once(monkeypatch):
    # Every layer of a forward gets the same position ids: the first layer's reads back to the
    # host serve the others; new ids, or ids written in place, are read again.
    reads = []
    original = _flash._pack_positions
    monkeypatch.setattr(_flash, "_pack_positions", lambda ids: reads.append(1) or original(ids))
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    answers = [_flash.pack_positions(positions) for _ in range(3)]
    assert len(reads) == 1 and all(a[0].tolist() == [0, 3, 5] for a in answers)
    positions[0, 3] = 3  # in place: one sequence now
    assert _flash.pack_positions(positions) is None and len(reads) == 2
    assert _flash.pack_positions(torch.tensor([[0, 0]]))[0].tolist() == [0, 1, 2]
    assert len(reads) == 3


def test_pad_head_dim_zero_pads_to_a_multiple_of_8():
    x = randn(2, 3, 4, 60)
    padded = _flash.pad_head_dim(x)
    assert padded.shape == (2, 3, 4, 64)
    assert torch.equal(padded[..., :60], x)
    assert not padded[..., 60:].any()
    assert _flash.pad_head_dim(padded) is padded


@pytest.mark.parametrize("sliding_window,causal,seqlen_k,expected", [
    (None, True, 10, (-1, -1)),
    (4, True, 10, (3, 0)),
    (4, False, 10, (3, 3)),
    (10, True, 10, (-1, -1)),  # sees every key anyway: the instances without a window run it
])
def test_window_size_counts_the_query_in_the_window(sliding_window, causal, seqlen_k, expected):
    assert _flash.window_size(sliding_window, causal, seqlen_k) == expected


# ---- flash_attention: one kernel call per padded batch --------------------------------------


def holed(mask):
    """The mask with row 0's fifth key made padding: no longer left padding."""
    mask = mask.clone()
    mask[0, 4] = False
    return mask


@pytest.mark.parametrize("seqlen_q,mask", [
    (7, left_padded([7, 4, 6], 7)),  # a prefill
    (3, holed(left_padded([7, 4, 6], 7))),  # a chunk against keys with a hole
    (3, left_padded([7, 2, 6], 7)),  # a row with fewer tokens than queries
], ids=["prefill", "holed", "short-row"])
def test_padding_mask_runs_group_mode_aligned_bottom_right(kernels, seqlen_q, mask):
    q, k, v = qkv(seqlen_q=seqlen_q)
    out = _flash.flash_attention(q, k, v, causal=True, softmax_scale=0.3, padding_mask=mask)
    expected = expected_rows(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)
    (call,) = kernels
    lengths = mask.sum(dim=-1)
    assert call["k"].shape[0] == lengths.sum() and "kvcache" not in call
    assert call["cu_seqlens_k"].tolist() == [0, *lengths.cumsum(0).tolist()]
    assert call["mask_align"] == "bottom_right"


@pytest.mark.parametrize("seqlen_q", [3, 1], ids=["chunk", "decode"])
def test_left_padded_decode_runs_the_kvcache_kernel_from_each_rows_first_token(kernels,
                                                                              seqlen_q):
    # generate()'s steps: each row padding, then at least its queries' tokens.
    q, k, v = qkv(seqlen_q=seqlen_q)
    mask = left_padded([7, 4, 6], 7)
    out = _flash.flash_attention(q, k, v, causal=True, softmax_scale=0.3, padding_mask=mask)
    expected = expected_rows(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)
    (call,) = kernels
    assert call["kvcache"] and call["cache_seqlens"].tolist() == [7, 7, 7]
    assert call["cache_leftpad"].tolist() == [0, 3, 1]


def test_a_steps_layers_read_its_left_padding_back_once(kernels, monkeypatch):
    # Every layer of a decode step gets the same mask: the first layer's check (a read back to
    # the host) serves the others; a new mask, one written in place, or another query count
    # is checked again, and the answer follows it.
    q, k, v = qkv(seqlen_q=1)
    checks = []
    original_bool = bool
    monkeypatch.setattr(_flash, "bool", lambda x: checks.append(1) or original_bool(x),
                        raising=False)
    mask = left_padded([7, 4, 6], 7)
    for _ in range(3):
        _flash.flash_attention(q, k, v, causal=True, padding_mask=mask)
    assert len(checks) == 1
    assert [call["cache_leftpad"].tolist() for call in kernels] == [[0, 3, 1]] * 3
    mask[1, 5] = False  # in place: row 1 has a hole now, which the kvcache kernel cannot take
    _flash.flash_attention(q, k, v, causal=True, padding_mask=mask)
    assert len(checks) == 2 and "kvcache" not in kernels[-1]
    _flash.flash_attention(q, k, v, causal=True, padding_mask=left_padded([7, 5, 6], 7))
    assert len(checks) == 3 and kernels[-1]["cache_leftpad"].tolist() == [0, 2, 1]
    # Row 1's 2 tokens are fewer than 3 queries (group mode), not than 1 (the kvcache kernel).
    mask = left_padded([7, 2, 6], 7)
    q3, k3, v3 = qkv(seqlen_q=3)
    _flash.flash_attention(q3, k3, v3, causal=True, padding_mask=mask)
    assert len(checks) == 4 and "kvcache" not in kernels[-1]
    _flash.flash_attention(q, k, v, causal=True, padding_mask=mask)
    assert len(checks) == 5 and kernels[-1]["cache_leftpad"].tolist() == [0, 5, 1]


def test_a_forwards_layers_pack_its_padding_mask_once(kernels, monkeypatch):
    # Group mode: the first layer packs the mask (a read back to the host each for the keys and
    # the queries), the others reuse the packing; a mask written in place, or another query
    # count, is packed again.
    packs = []
    original = _flash.pack_padding_mask
    monkeypatch.setattr(_flash, "pack_padding_mask",
                        lambda mask: packs.append(mask.shape[1]) or original(mask))
    mask = left_padded([7, 4, 6], 7)
    q, k, v = qkv(seqlen_q=7)
    for _ in range(3):
        _flash.flash_attention(q, k, v, causal=True, padding_mask=mask)
    assert packs == [7]  # a prefill's queries are its keys
    assert all(torch.equal(call["cu_seqlens_k"], kernels[0]["cu_seqlens_k"]) for call in kernels)
    mask[0, 0] = False  # in place
    out = _flash.flash_attention(q, k, v, causal=True, padding_mask=mask)
    assert packs == [7, 7] and kernels[-1]["cu_seqlens_k"].tolist() == [0, 6, 10, 16]
    torch.testing.assert_close(out, expected_rows(q, k, v, mask), rtol=0, atol=ATOL)
    q3, k3, v3 = qkv(seqlen_q=3)
    mask = holed(left_padded([7, 4, 6], 7))  # no left padding: group mode for a chunk
    for _ in range(2):
        _flash.flash_attention(q3, k3, v3, causal=True, padding_mask=mask)
    assert packs == [7, 7, 7, 3]


def test_padding_rows_of_a_prefill_are_zero(kernels):
    q, k, v = qkv()
    mask = left_padded([7, 2, 5], 7)
    out = _flash.flash_attention(q, k, v, causal=True, padding_mask=mask)
    assert not out[~mask].any()
    assert out[mask].abs().min() > 0


def test_no_mask_runs_batch_mode_aligned_bottom_right(kernels):
    q, k, v = qkv(seqlen_q=_flash.DECODE_MAX_QUERIES + 1, seqlen_k=40)
    out = _flash.flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, expected_rows(q, k, v), rtol=0, atol=ATOL)
    assert "cu_seqlens_q" not in kernels[0] and "kvcache" not in kernels[0]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_decode_without_padding_runs_the_kvcache_kernel(kernels, causal, seqlen_q):
    q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=9)
    out = _flash.flash_attention(q, k, v, causal=causal, sliding_window=5, softcap=3.0)
    expected = expected_rows(q, k, v, causal=causal, sliding_window=5, softcap=3.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)
    (call,) = kernels
    assert call["kvcache"] and call["cache_seqlens"].tolist() == [9, 9, 9]
    assert call["window_size"] == ((4, 0) if causal else (4, 4))


def test_decode_falls_back_to_fwd_without_a_kvcache_instance(kernels, monkeypatch):
    def missing(*args, **options):
        raise fmha.MissingInstanceError("no kvcache instance; build with --filter kvcache")
    monkeypatch.setattr(fmha, "fwd_kvcache", missing)
    q, k, v = qkv(seqlen_q=1, seqlen_k=9)
    out = _flash.flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, expected_rows(q, k, v), rtol=0, atol=ATOL)
    assert "kvcache" not in kernels[0]


def test_decode_that_needs_a_backward_runs_fwd(kernels):
    q, k, v = (t.requires_grad_() for t in qkv(seqlen_q=1, seqlen_k=9))
    _flash.flash_attention(q, k, v, causal=True)
    assert "kvcache" not in kernels[0]


def test_decode_under_torch_compile_runs_fwd(kernels, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v = qkv(seqlen_q=1, seqlen_k=9)
    _flash.flash_attention(q, k, v, causal=True)
    assert "kvcache" not in kernels[0]


def test_not_causal(kernels):
    q, k, v = qkv(seqlen_q=3)
    mask = left_padded([7, 4, 6], 7)
    out = _flash.flash_attention(q, k, v, causal=False, padding_mask=mask)
    torch.testing.assert_close(out, expected_rows(q, k, v, mask, causal=False), rtol=0,
                               atol=ATOL)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q", [9, 1])
def test_sliding_window_counts_the_query(kernels, causal, seqlen_q):
    q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=9)
    mask = left_padded([9, 7, 3], 9)
    out = _flash.flash_attention(q, k, v, causal=causal, sliding_window=3, padding_mask=mask)
    expected = expected_rows(q, k, v, mask, causal=causal, sliding_window=3)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)
    assert kernels[0]["window_size"] == ((2, 0) if causal else (2, 2))


def test_softcap(kernels):
    q, k, v = qkv()
    q = q * 4  # logits past the cap, where tanh bends
    mask = left_padded([7, 4, 6], 7)
    out = _flash.flash_attention(q, k, v, causal=True, softcap=2.0, padding_mask=mask)
    torch.testing.assert_close(out, expected_rows(q, k, v, mask, softcap=2.0), rtol=0, atol=ATOL)
    capped_nowhere = expected_rows(q, k, v, mask)
    assert (out - capped_nowhere).abs().max() > 1e-3


@pytest.mark.parametrize("head_dim,head_dim_v", [(12, 12), (12, 20), (60, 60)])
def test_head_dims_off_multiples_of_8_are_padded(kernels, head_dim, head_dim_v):
    q, k, v = qkv(head_dim=head_dim, head_dim_v=head_dim_v)
    mask = left_padded([7, 4, 6], 7)
    out = _flash.flash_attention(q, k, v, causal=True, padding_mask=mask)
    # The scale stays the unpadded head dim's: 1/sqrt(head_dim).
    expected = expected_rows(q, k, v, mask, scale=head_dim ** -0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)
    call = kernels[0]
    assert call["q"].shape[-1] % 8 == 0 and call["v"].shape[-1] % 8 == 0


def test_keys_past_a_short_mask_are_never_read(kernels):
    """A static cache: 9 slots of which 6 are written; the unwritten ones hold NaN."""
    q, k, v = qkv(seqlen_q=1, seqlen_k=9)
    k[:, 6:], v[:, 6:] = float("nan"), float("nan")
    mask = left_padded([6, 3, 5], 6)
    out = _flash.flash_attention(q, k, v, causal=True, padding_mask=mask)
    expected = expected_rows(q, k[:, :6], v[:, :6], mask)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)


def test_sequences_packed_into_rows(kernels):
    q, k, v = qkv(batch=1, seqlen_q=9, seqlen_k=9)
    cu_seqlens = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    out = _flash.flash_attention(q, k, v, causal=True, cu_seqlens_q=cu_seqlens,
                                 cu_seqlens_k=cu_seqlens, max_seqlen_q=4, max_seqlen_k=4)
    for start, end in [(0, 3), (3, 5), (5, 9)]:
        alone = expected_rows(q[:, start:end], k[:, start:end], v[:, start:end])
        torch.testing.assert_close(out[:, start:end], alone, rtol=0, atol=ATOL)


def test_gradients_reach_q_k_v_through_the_packing(kernels):
    q, k, v = (t.requires_grad_() for t in qkv())
    mask = left_padded([7, 4, 6], 7)
    dout = randn(*q.shape, seed=4)
    _flash.flash_attention(q, k, v, causal=True, padding_mask=mask).backward(dout)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected_rows(q2, k2, v2, mask).backward(dout)
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


# ---- the transformers adapter, without transformers ---------------------------------------

CAUSAL_MODULE = SimpleNamespace(is_causal=True)


def as_module_layout(*tensors):
    """(batch, seqlen, heads, head_dim) -> the attention modules' (batch, heads, seqlen, dim)."""
    return tuple(t.transpose(1, 2) for t in tensors)


def test_attention_forward_takes_the_modules_layout_and_options(kernels):
    q, k, v = qkv(seqlen_q=1)
    mask = left_padded([7, 4, 6], 7)
    out, weights = hf.attention_forward(CAUSAL_MODULE, *as_module_layout(q, k, v), mask,
                                        scaling=0.2, sliding_window=4, softcap=3.0)
    assert weights is None
    expected = expected_rows(q, k, v, mask, scale=0.2, sliding_window=4, softcap=3.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)


def test_attention_forward_takes_is_causal_over_the_modules(kernels):
    q, k, v = qkv()
    out, _ = hf.attention_forward(CAUSAL_MODULE, *as_module_layout(q, k, v), None,
                                  is_causal=False)
    torch.testing.assert_close(out, expected_rows(q, k, v, causal=False), rtol=0, atol=ATOL)


def test_attention_forward_passes_dropout_on(kernels, monkeypatch):
    seen = []
    monkeypatch.setattr(fmha, "fwd", lambda q, k, v, **options: seen.append(options) or q)
    hf.attention_forward(CAUSAL_MODULE, *as_module_layout(*qkv()), None, dropout=0.1)
    assert seen[0]["dropout_p"] == 0.1


def test_attention_forward_runs_float32_in_the_autocast_dtype(kernels):
    q, k, v = (t.float() for t in qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = hf.attention_forward(CAUSAL_MODULE, *as_module_layout(q, k, v), None)
    assert out.dtype == torch.bfloat16
    assert kernels[0]["q"].dtype == kernels[0]["k"].dtype == kernels[0]["v"].dtype == torch.bfloat16


def test_attention_forward_splits_sequences_packed_by_position_ids(kernels):
    q, k, v = qkv(batch=1, seqlen_q=9, seqlen_k=9)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    out, _ = hf.attention_forward(CAUSAL_MODULE, *as_module_layout(q, k, v), None,
                                  position_ids=position_ids)
    assert kernels[0]["cu_seqlens_q"].tolist() == [0, 3, 5, 9]
    for start, end in [(0, 3), (3, 5), (5, 9)]:
        alone = expected_rows(q[:, start:end], k[:, start:end], v[:, start:end])
        torch.testing.assert_close(out[:, start:end], alone, rtol=0, atol=ATOL)


def test_attention_forward_takes_flash_attention_kwargs(kernels):
    q, k, v = qkv(batch=1, seqlen_q=9, seqlen_k=9)
    cu_seqlens = torch.tensor([0, 4, 9])
    out, _ = hf.attention_forward(CAUSAL_MODULE, *as_module_layout(q, k, v), None,
                                  cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                                  max_length_q=5, max_length_k=5)
    assert kernels[0]["cu_seqlens_k"].dtype == torch.int32
    for start, end in [(0, 4), (4, 9)]:
        alone = expected_rows(q[:, start:end], k[:, start:end], v[:, start:end])
        torch.testing.assert_close(out[:, start:end], alone, rtol=0, atol=ATOL)


def test_attention_forward_refuses_what_it_cannot_run():
    q, k, v = as_module_layout(*qkv())
    with pytest.raises(NotImplementedError, match="attention sinks"):
        hf.attention_forward(CAUSAL_MODULE, q, k, v, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="2D padding mask .* got 4 dimensions"):
        hf.attention_forward(CAUSAL_MODULE, q, k, v, torch.zeros(3, 1, 7, 7))


def hf_call(**changes):
    """attention_forward's arguments, valid (q 3 x 4 heads x 7 tokens, k and v 2 heads x 7,
    a left-padding mask), with `changes` replacing any."""
    q, k, v = as_module_layout(*qkv())
    return {**dict(query=q, key=k, value=v, attention_mask=left_padded([7, 4, 6], 7)), **changes}


@pytest.mark.parametrize("changes,error,message", [
    (dict(query=randn(3, 4, 7)), ValueError,
     r"fmha: query must be 4-D \(batch, heads, seqlen, head_dim\), got shape \(3, 4, 7\)"),
    (dict(key=[1, 2]), TypeError, "fmha: key must be a torch.Tensor, got list"),
    (dict(key=randn(0, 2, 7, 16)), ValueError, "fmha: q, k and v must have one batch size, got "
                                               "3, 0 and 3"),
    (dict(value=randn(3, 2, 6, 16)), ValueError, "fmha: k and v must have one seqlen"),
    (dict(query=randn(3, 3, 7, 16)), ValueError, "fmha: q's 3 heads must be a multiple of k's "
                                                 "and v's 2"),
    (dict(key=randn(3, 2, 7, 8)), ValueError, "fmha: q has head dim 16 but k has 8"),
    # Consistent, but too long: a copy of the padded query would take 1 TiB.
    (dict(query=randn(1, 1, 1, 12).expand(3, 4, 2**31 + 8, 12), key=randn(3, 2, 7, 12),
          value=randn(3, 2, 7, 12), attention_mask=None), ValueError,
     r"fmha: q has shape \(3, 2147483656, 4, 12\); every size must be below 2\*\*31"),
    (dict(query=randn(3, 4, 7, 0), key=randn(3, 2, 7, 0)), ValueError,
     "fmha: head dims must be positive, got 0 for q and k and 16 for v"),
    (dict(attention_mask=left_padded([7, 4, 6, 1], 7)), ValueError,
     r"fmha: padding_mask must be \(batch, seqlen\) with batch 3 .* got shape \(4, 7\)"),
    (dict(attention_mask=left_padded([7, 4, 6], 9)), ValueError,  # longer than the keys
     r"seqlen_q 7 <= seqlen <= seqlen_k 7 .* got shape \(3, 9\)"),
    (dict(attention_mask=left_padded([7, 4, 6], 7).float()), TypeError,
     "fmha: padding_mask must be bool or of an integer dtype"),
    (dict(attention_mask=torch.ones(3, 7, dtype=torch.bool, device="meta")), ValueError,
     "fmha: attention_mask is on meta but query is on cpu; query, key, value and "
     "attention_mask must be on one device"),
    (dict(attention_mask=None, max_length_q=torch.tensor(7, device="meta"),
          cu_seq_lens_q=torch.tensor([0, 7]), cu_seq_lens_k=torch.tensor([0, 7]), max_length_k=7),
     ValueError, "fmha: max_length_q is on meta; fmha needs CUDA tensors"),
])
def test_attention_forward_checks_its_arguments_first(kernels, changes, error, message):
    """Before any indexing, packing or padding: a call that fails here would otherwise fail in
    torch's own terms (index_select, nonzero, a division by a head dim of 0)."""
    with pytest.raises(error, match=message):
        hf.attention_forward(CAUSAL_MODULE, **hf_call(**changes))
    assert kernels == []


def test_attention_forward_needs_one_position_per_token(kernels):
    q, k, v = as_module_layout(*qkv(batch=1))
    with pytest.raises(ValueError, match=r"fmha: position_ids must hold one position per token, "
                                         r"\(1, seqlen\) = \(1, 7\), got shape \(2, 7\)"):
        hf.attention_forward(CAUSAL_MODULE, q, k, v, None,
                             position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2))
    assert kernels == []


@pytest.mark.parametrize("autocast", [False, True])
def test_attention_forward_refuses_meta_tensors(kernels, autocast):
    """Meta tensors hold no mask or lengths to read (nor a device for autocast to ask): the
    ValueError of a call that needs CUDA tensors, before any of it."""
    tensors = {name: t.to("meta") for name, t in hf_call().items()}
    if autocast:
        tensors.update(query=tensors["query"].float(), attention_mask=None)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with pytest.raises(ValueError, match="fmha: query is on meta; fmha needs CUDA tensors"):
            hf.attention_forward(CAUSAL_MODULE, **tensors)
    assert kernels == []


def test_a_padded_batch_of_no_queries(kernels):
    """The queries are the mask's last seqlen_q slots: none of them when seqlen_q is 0 (a slice
    [-0:] would be all of them). Right padding: group mode, not the decode path."""
    q, k, v = qkv(seqlen_q=0)
    out = _flash.flash_attention(q, k, v, causal=True,
                                 padding_mask=left_padded([7, 4, 6], 7).flip(-1))
    assert out.shape == (3, 0, 4, 16)
    assert kernels[0]["q"].shape[0] == 0


def causal(batch_idx, head_idx, q_idx, kv_idx):
    """transformers' causal_mask_function."""
    return kv_idx <= q_idx


def test_padding_mask_is_flash_attention_2s():
    mask = left_padded([6, 3], 6)
    # A sliding-window layer's cache holds the last 4 keys.
    assert torch.equal(hf.padding_mask(2, 4, mask, q_length=1, q_offset=5, mask_function=causal),
                       mask[:, -4:])
    assert hf.padding_mask(2, 6, torch.ones(2, 6, dtype=torch.bool)) is None
    assert hf.padding_mask(2, 6, None, q_length=1, q_offset=5, mask_function=causal) is None
    assert hf.padding_mask(2, 6, None) is None  # transformers 4.x: no q_length
    # A static cache's mask (generate keeps it with padding) is shorter than its slots.
    short = left_padded([3, 3], 3)
    assert torch.equal(hf.padding_mask(2, 8, short, q_length=1, q_offset=2), short)


@pytest.mark.parametrize("q_offset", [4, torch.tensor(4)], ids=["int", "tensor"])
def test_padding_mask_of_a_static_cache_without_one(q_offset):
    """8 slots, 4 written before this step's 2 queries: the 6 written ones, all tokens."""
    mask = hf.padding_mask(3, 8, None, q_length=2, q_offset=q_offset, mask_function=causal,
                           device="cpu")
    assert mask.dtype == torch.bool and mask.shape == (3, 6) and mask.all()


def test_padding_mask_of_cross_attention_leaves_the_keys_alone():
    """A decoder's 2 queries on an encoder's 8 keys: more keys than queries, no cache."""
    every_key = lambda batch_idx, head_idx, q_idx, kv_idx: True  # noqa: E731
    assert hf.padding_mask(3, 8, None, q_length=2, q_offset=0, mask_function=every_key) is None


def test_padding_mask_of_packed_sequences_takes_tensor_indices():
    """Padding-free training without a cache: transformers composes its causal mask with the
    packed sequences' (and_masks), whose function calls tensor methods on the indices."""
    def and_masks(batch_idx, head_idx, q_idx, kv_idx):
        return q_idx.new_ones((), dtype=torch.bool) & causal(batch_idx, head_idx, q_idx, kv_idx)

    assert hf.padding_mask(1, 8, None, q_length=8, q_offset=0, mask_function=and_masks) is None


def eager_rows(q, k, v, padding_mask, *, causal, sliding_window=None):
    """transformers' eager attention of every row, padding included, in float64: an additive
    mask of float32's minimum on the keys a row may not see, which swamps any score, so a row
    that sees no key attends to all keys alike. The queries are the last seqlen_q keys."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    i = torch.arange(seqlen_k - seqlen_q, seqlen_k).view(-1, 1)
    j = torch.arange(seqlen_k).view(1, -1)
    sees = padding_mask[:, None, None, :] & (j <= i if causal else torch.ones_like(j <= i))
    if sliding_window is not None:
        sees = sees & (i - j < sliding_window)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(group, 2))
    scores = scores * q.shape[-1] ** -0.5 + torch.where(sees, 0.0, torch.finfo(torch.float32).min)
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1),
                        v.double().repeat_interleave(group, 2))


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_attention_forward_gives_rows_that_see_no_key_eagers_value(kernels, sliding_window):
    """A left-padded prefill (or training step): every row as eager attention has it, the
    padding rows that see no key (the mean of V over all keys) included, where fmha.fwd gives
    them 0; those rows reach a training loss (the slot before a row's first token predicts
    it)."""
    q, k, v = qkv()
    mask = left_padded([7, 4, 1], 7)
    out, _ = hf.attention_forward(CAUSAL_MODULE, *as_module_layout(q, k, v), mask,
                                  sliding_window=sliding_window)
    expected = eager_rows(q, k, v, mask, causal=True, sliding_window=sliding_window)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)
    # The blind rows' values reach V in the backward, as eager's do.
    v.requires_grad_()
    out, _ = hf.attention_forward(CAUSAL_MODULE, *as_module_layout(q, k, v), mask)
    out[2, :6].sum().backward()  # row 2's padding only: each is the mean of row 2's V
    torch.testing.assert_close(v.grad[2], torch.full_like(v.grad[2], 6 * 2 / 7), rtol=0,
                               atol=ATOL)
    assert not v.grad[:2].any()


def test_register_names_the_transformers_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ImportError, match=r"transformers >= 4\.53"):
        hf.register()


# ---- whole transformers models --------------------------------------------------------------


@pytest.fixture
def transformers(kernels):
    """transformers with fmha registered, fmha.fwd the reference."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (CI does not install it)")
    hf.register()
    return transformers


def tiny(transformers, config_class, **options):
    """A randomly initialised float32 model and its eager twin with the same weights."""
    config = getattr(transformers, config_class)(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
        eos_token_id=None, bos_token_id=None, **options)
    torch.manual_seed(0)
    # A config each: from_config sets the attention implementation on the config it is given.
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation="fmha")
    eager = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    assert model.config._attn_implementation == "fmha"
    return model.eval(), eager.eval()


def prompts(lengths, seqlen, seed=5):
    """Left-padded random token ids and their (batch, seqlen) attention mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (len(lengths), seqlen), generator=generator)
    mask = left_padded(lengths, seqlen).long()
    return ids * mask, mask


def assert_same_logits(model, eager, ids, mask):
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = eager(input_ids=ids, attention_mask=mask).logits
    assert len(reference_fwd.calls) == model.config.num_hidden_layers
    kept = mask.bool()
    torch.testing.assert_close(got[kept], want[kept], rtol=0, atol=1e-4)


@pytest.mark.parametrize("lengths", [[12, 12], [12, 7]], ids=["unpadded", "left-padded"])
def test_llama_logits(transformers, lengths):
    model, eager = tiny(transformers, "LlamaConfig")
    assert_same_logits(model, eager, *prompts(lengths, 12))


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("lengths", [[9, 9], [9, 5]], ids=["unpadded", "left-padded"])
def test_llama_generate(transformers, cache, lengths):
    model, eager = tiny(transformers, "LlamaConfig")
    ids, mask = prompts(lengths, 9)
    options = dict(attention_mask=mask, max_new_tokens=8, do_sample=False,
                   return_dict_in_generate=True, output_scores=True, cache_implementation=cache)
    got = model.generate(ids, **options)
    want = eager.generate(ids, **options)
    assert len(reference_fwd.calls) == 8 * model.config.num_hidden_layers  # prefill, 7 decodes
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.scores, want.scores):
        torch.testing.assert_close(step_got, step_want, rtol=0, atol=1e-4)


def test_llama_generate_reads_a_steps_left_padding_back_once(transformers, monkeypatch):
    # The model hands every layer of a decode step the same mask: one read back to the host a
    # step, not one a layer.
    model, _ = tiny(transformers, "LlamaConfig")
    checks = []
    original_bool = bool
    monkeypatch.setattr(_flash, "bool", lambda x: checks.append(1) or original_bool(x),
                        raising=False)
    packs = []
    original_pack = _flash.pack_padding_mask
    monkeypatch.setattr(_flash, "pack_padding_mask",
                        lambda mask: packs.append(1) or original_pack(mask))
    ids, mask = prompts([9, 5], 9)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    decodes = [call for call in reference_fwd.calls if call.get("kvcache")]
    assert len(decodes) == 7 * model.config.num_hidden_layers and len(checks) == 7
    # The prefill (group mode) packs the mask once, not once a layer.
    assert len(packs) == 1


def test_llama_generate_of_one_prompt_reads_its_positions_back_once(transformers, monkeypatch):
    # A batch of one row without a mask: each layer asks whether the position ids pack several
    # sequences (a read back to the host); the prefill's first layer answers for the others.
    model, eager = tiny(transformers, "LlamaConfig")
    reads = []
    original = _flash._pack_positions
    monkeypatch.setattr(_flash, "_pack_positions", lambda ids: reads.append(1) or original(ids))
    ids, _ = prompts([9], 9)
    options = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, **options), eager.generate(ids, **options))
    assert len(reads) == 1


def test_mistral_sliding_window(transformers):
    model, eager = tiny(transformers, "MistralConfig", sliding_window=4)
    assert_same_logits(model, eager, *prompts([12, 9], 12))


def test_gemma2_softcap_and_sliding_window(transformers):
    model, eager = tiny(transformers, "Gemma2Config", sliding_window=4, attn_logit_softcapping=0.1,
                        query_pre_attn_scalar=24)
    assert_same_logits(model, eager, *prompts([12, 9], 12))


def test_training_passes_the_modules_dropout(transformers, monkeypatch):
    model, _ = tiny(transformers, "LlamaConfig", attention_dropout=0.25)
    seen = []
    monkeypatch.setattr(fmha, "fwd", lambda q, k, v, **options: seen.append(options["dropout_p"])
                        or torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype))
    ids, mask = prompts([6, 6], 6)
    model.train()(input_ids=ids, attention_mask=mask)
    model.eval()(input_ids=ids, attention_mask=mask)
    assert seen == [0.25, 0.25, 0.0, 0.0]


# ---- SDPA's flash operators -----------------------------------------------------------------


@pytest.fixture
def replaced():
    """Stand-ins for torch's kernels of SDPA's flash operators on the CPU (a CPU build of torch
    has none), to be replaced; the list of their calls."""
    calls = []

    def forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                scale=None):
        calls.append("forward")
        empty = torch.empty((0,), dtype=torch.uint64)
        return (torch.zeros_like(query), torch.zeros(query.shape[:3]), None, None,
                query.shape[2], key.shape[2], empty, empty, torch.empty((0,), dtype=query.dtype))

    def backward(grad_out, query, key, value, *args, scale=None):
        calls.append("backward")
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)

    standins = torch.library.Library("aten", "IMPL", "CPU")
    standins.impl("_scaled_dot_product_flash_attention", forward, "CPU")
    standins.impl("_scaled_dot_product_flash_attention_backward", backward, "CPU")
    yield calls
    standins._destroy()


@pytest.fixture
def sdpa_on_cpu(kernels, replaced):
    """fmha's kernels of SDPA's flash operators installed for the CPU, over the stand-ins."""
    installed = sdpa.install("CPU")
    yield replaced
    installed.remove()


def sdpa_qkv(seqlen_q=7, seqlen_k=7):
    """SDPA's (batch, heads, seqlen, head_dim) layout, GQA 2:1."""
    q, k, v = qkv(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    return tuple(t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))


@pytest.mark.parametrize("seqlen_q,is_causal", [(7, False), (7, True), (3, True), (9, True)])
def test_sdpa_operator_matches_sdpa_math(sdpa_on_cpu, seqlen_q, is_causal):
    q, k, v = sdpa_qkv(seqlen_q=seqlen_q)
    result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal,
                                                                 scale=0.3)
    assert len(result) == 9 and result[4:6] == (seqlen_q, 7)
    out, lse = result[:2]
    # SDPA's math backend, top-left causal as SDPA defines is_causal.
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q2, k2, v2, is_causal=is_causal, scale=0.3,
                                          enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=0, atol=ATOL)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32

    dout = randn(*out.shape, seed=6)
    out.backward(dout)
    want.backward(dout)
    for got, expected in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    assert sdpa_on_cpu == []


def test_sdpa_backward_of_an_expanded_gradient(sdpa_on_cpu):
    q, k, v = sdpa_qkv()
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    out.sum().backward()  # a gradient of stride 0 everywhere: copied for the kernel
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, enable_gqa=True).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, rtol=0, atol=1e-10)


def test_sdpa_runs_the_replaced_kernel_for_what_fmha_lacks(sdpa_on_cpu, monkeypatch):
    def missing(*args, **kwargs):
        raise fmha.MissingInstanceError("no instance")

    q, k, v = sdpa_qkv()
    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.1, True)[0].sum().backward()
    assert sdpa_on_cpu == ["forward", "backward"]  # dropout: both on the kernel that drew it
    monkeypatch.setattr(fmha, "fwd", missing)
    monkeypatch.setattr(fmha, "bwd", missing)
    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0].sum().backward()
    assert sdpa_on_cpu == ["forward", "backward"] * 2


def test_sdpa_remove_gives_the_operators_back(kernels, replaced):
    installed = sdpa.install("CPU")
    q, k, v = (t.detach() for t in sdpa_qkv())
    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    assert replaced == [] and len(kernels) == 1
    installed.remove()
    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    assert replaced == ["forward"] and len(kernels) == 1


def test_sdpa_register_on_a_torch_without_cuda_registers_nothing(monkeypatch):
    """SDPA there never reaches the CUDA flash operators, which register() would replace (and
    has no kernel of torch's to fall back to): it says so, and code that registers fmha runs on
    torch's CPU kernels unchanged."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.warns(UserWarning, match=r"fmha.integrations.sdpa.register\(\): torch .* is "
                                         r"built without CUDA.* nothing is registered"):
        sdpa.register()
    assert torch.nn.attention.current_flash_attention_impl() != sdpa.NAME
    sdpa.unregister()


def test_sdpa_register_names_the_torch_it_needs(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    with pytest.raises(RuntimeError, match=r"torch >= 2\.11.*this is torch 2\.10\.0\+cu128"):
        sdpa.register()
