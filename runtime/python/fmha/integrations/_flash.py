"""FlashAttention-2's calling conventions on top of fmha.fwd, for the integrations.

Libraries written for FlashAttention hand attention a padded batch, (batch, seqlen, heads,
head_dim), with a 2D padding mask, or sequences packed into one row; their causal mask is
aligned bottom-right (the last query sees every key, as in a decode step against a KV cache)
and their sliding window counts the query's own token. flash_attention() turns that into one
fmha.fwd call: the tokens the mask keeps packed into fmha.fwd's group (varlen) mode with
cu_seqlens, head dims padded to what the kernels take, and the output laid back out as the
caller's batch. Plain torch: no other library is imported here.
"""

import functools
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

import fmha
from fmha._checks import INT_LIMIT
from fmha._head_dims import pad as pad_head_dim

# Query tokens per sequence up to which an unpadded call against more keys (a decode step, or a
# few speculative tokens) runs fmha.fwd_kvcache: its split-KV kernel packs the query heads of
# one K/V head into a 16-row tile and spreads the keys over the SMs, where fmha.fwd's 128- or
# 192-row query tiles would run one mostly empty CTA per head.
DECODE_MAX_QUERIES = 16


class Packed(NamedTuple):
    """The tokens of a padded (batch, seqlen) batch that fmha.fwd's group mode runs."""

    indices: torch.Tensor  # int64 (tokens,): their positions in the flattened batch * seqlen
    cu_seqlens: torch.Tensor  # int32 (batch + 1,): where each sequence's tokens start, then the end
    max_seqlen: int


def pack_padding_mask(padding_mask: torch.Tensor) -> Packed:
    """The tokens that a (batch, seqlen) padding mask keeps (nonzero: a token, 0: padding), in
    order. Reads the longest length back to the host (0 of an empty batch): fmha.fwd takes it
    as an int."""
    lengths = padding_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(padding_mask.flatten()).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    return Packed(indices, cu_seqlens, int(lengths.max()) if lengths.numel() else 0)


def pack_positions(position_ids: torch.Tensor) -> Optional[tuple[torch.Tensor, int]]:
    """(cu_seqlens, max_seqlen) of the sequences packed into one row (padding-free batches),
    told apart by their position ids, each sequence's counting up from the row's smallest;
    None where the row holds one sequence. Reads from the device twice: where the sequences
    start, and the longest one; every layer of a forward gets the same position ids, so its
    first layer reads them and the others reuse the answer (_LastAnswer)."""
    return _last_positions.answer(position_ids, None, lambda: _pack_positions(position_ids))


def _pack_positions(position_ids: torch.Tensor) -> Optional[tuple[torch.Tensor, int]]:
    positions = position_ids.flatten()
    starts = torch.nonzero(positions == positions.min()).flatten()
    if starts.numel() <= 1:
        return None
    cu_seqlens = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, ...) -> (tokens, ...): the tokens at `indices` of the flattened batch."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, indices)


def scatter_tokens(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """gather_tokens undone: (tokens, ...) -> (batch, seqlen, ...), zeros where no token is."""
    out = x.new_zeros(batch * seqlen, *x.shape[1:]).index_copy(0, indices, x)
    return out.view(batch, seqlen, *x.shape[1:])


def window_size(sliding_window: Optional[int], causal: bool, seqlen_k: int) -> tuple[int, int]:
    """fmha.fwd's window_size for a sliding window of `sliding_window` keys, the query's own
    included (transformers' and FlashAttention's count): a query sees the sliding_window - 1
    keys before it (and as many after it when not causal). None, or a window no shorter than
    the keys, bounds nothing: (-1, -1), which runs on the instances without a window."""
    if sliding_window is None or seqlen_k <= sliding_window:
        return -1, -1
    return sliding_window - 1, 0 if causal else sliding_window - 1


def _decodes(q, k, v, cu_seqlens_q, dropout_p) -> bool:
    """Whether flash_attention may run this call on fmha.fwd_kvcache (DECODE_MAX_QUERIES): no
    packing, no dropout, one head dim, nothing that needs a backward, and not under
    torch.compile (fwd_kvcache is no torch.library op yet; fmha.fwd is). A padding mask must
    also be left padding (_left_padding)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    return (not torch.compiler.is_compiling()
            and cu_seqlens_q is None and dropout_p == 0.0
            and seqlen_q <= DECODE_MAX_QUERIES and seqlen_q < seqlen_k
            and q.shape[-1] == v.shape[-1]
            and not (torch.is_grad_enabled()
                     and (q.requires_grad or k.requires_grad or v.requires_grad)))


def _left_padding(padding_mask: torch.Tensor, seqlen_q: int) -> Optional[torch.Tensor]:
    """Each row's count of padding slots (int32, fwd_kvcache's cache_leftpad) where every row is
    padding, then tokens to its end, at least seqlen_q of them (the queries are tokens); else
    None. generate() pads on the left, so its decode steps qualify. The answer reads one bool
    back to the host (as the group-mode path's pack_padding_mask reads a length), which stalls
    the host until the GPU catches up; every layer of a step gets the same mask tensor, so the
    step's first layer reads it and the others reuse it (_LastAnswer)."""
    def ask():
        keys = padding_mask.shape[1]
        tokens = padding_mask.sum(dim=-1, dtype=torch.int32)
        first = padding_mask.int().argmax(dim=-1)  # the first token's slot (0 in a row of none)
        pads = keys - tokens
        return pads if bool(((first == pads) & (tokens >= seqlen_q)).all()) else None

    return _last_left_padding.answer(padding_mask, seqlen_q, ask)


def _pack_batch(padding_mask: torch.Tensor, seqlen_q: int) -> tuple[Packed, Packed]:
    """The keys and the queries (the last seqlen_q slots of each row) a padding mask keeps, for
    group mode. Each packing reads a length back to the host; every layer of a forward gets the
    same mask, so its first layer packs it and the others reuse the answer (_LastAnswer)."""
    def ask():
        batch, seqlen_k = padding_mask.shape
        keys = pack_padding_mask(padding_mask)
        if seqlen_q == seqlen_k:
            return keys, keys
        if seqlen_q == 1:  # a decode step: each row's one query, no search for it
            device = padding_mask.device
            return keys, Packed(torch.arange(batch, device=device),
                                torch.arange(batch + 1, dtype=torch.int32, device=device), 1)
        return keys, pack_padding_mask(padding_mask[:, seqlen_k - seqlen_q:])

    return _last_batch.answer(padding_mask, seqlen_q, ask)


class _LastAnswer:
    """The last answer to a question about a tensor that reads it back to the host (a mask's
    left padding, its packing, the position ids' sequences): every layer of a forward gets the
    same tensor, so the first layer asks and the others reuse the answer, one stall of the host
    a forward, not one a layer. Held weakly (a freed tensor whose id is reused never matches),
    as long as the tensor is not written in place (its version counter) and for the same `key`
    (the question's other arguments). One tuple, replaced whole, so threads never see a key with
    another call's answer."""

    def __init__(self):
        self._entry = None  # (weakref to the tensor, its version, key, answer)

    def answer(self, tensor: torch.Tensor, key, ask: Callable[[], Any]):
        """The last answer where it was for this tensor, unwritten since, and this key; else
        ask()'s, kept."""
        entry = self._entry
        if entry is not None:
            ref, version, known_key, known = entry
            if ref() is tensor and tensor._version == version and known_key == key:
                return known
        answer = ask()
        self._entry = (weakref.ref(tensor), tensor._version, key, answer)
        return answer


_last_left_padding = _LastAnswer()
_last_batch = _LastAnswer()
_last_positions = _LastAnswer()


@functools.lru_cache(maxsize=1)
def _cache_lengths(batch: int, keys: int, device: torch.device) -> torch.Tensor:
    """The last decode call's cache lengths: every layer of a step has the same batch and keys,
    so a step fills one (a fill kernel) and its other layers reuse it."""
    return torch.full((batch,), keys, dtype=torch.int32, device=device)


def _check_shapes(q, k, v, padding_mask: Optional[torch.Tensor]) -> None:
    """What flash_attention's packing, padding and indexing need of its arguments, checked
    before any of it: shapes that agree, sizes fmha.fwd takes (a copy of an expanded tensor
    past them would fail to allocate), positive head dims (the default scale divides by one)
    and a padding mask of the keys that covers the queries; without them torch's indexing would
    fail in its own terms. fmha.fwd checks the rest of q, k and v (dtypes, devices)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fmha: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"fmha: {name} must be 4-D (batch, seqlen, heads, head_dim), got "
                             f"shape {tuple(t.shape)}")
        if max(t.shape) >= INT_LIMIT:
            raise ValueError(f"fmha: {name} has shape {tuple(t.shape)}; every size must be below "
                             "2**31 (fmha.fwd takes sizes as int)")
    (batch, seqlen_q, heads, head_dim), (batch_k, seqlen_k, heads_k, head_dim_k) = q.shape, k.shape
    batch_v, seqlen_v, heads_v, head_dim_v = v.shape
    if not batch_k == batch_v == batch:
        raise ValueError(f"fmha: q, k and v must have one batch size, got {batch}, {batch_k} and "
                         f"{batch_v}")
    if (seqlen_v, heads_v) != (seqlen_k, heads_k):
        raise ValueError(f"fmha: k and v must have one seqlen and one head count, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if heads_k == 0 or heads % heads_k:
        raise ValueError(f"fmha: q's {heads} heads must be a multiple of k's and v's {heads_k} "
                         "(MQA/GQA)")
    if head_dim_k != head_dim:
        raise ValueError(f"fmha: q has head dim {head_dim} but k has {head_dim_k}")
    if head_dim == 0 or head_dim_v == 0:
        raise ValueError(f"fmha: head dims must be positive, got {head_dim} for q and k and "
                         f"{head_dim_v} for v")
    if padding_mask is None:
        return
    if not isinstance(padding_mask, torch.Tensor):
        raise TypeError(f"fmha: padding_mask must be a torch.Tensor or None, got "
                        f"{type(padding_mask).__name__}")
    if padding_mask.dtype.is_floating_point or padding_mask.dtype.is_complex:
        raise TypeError(f"fmha: padding_mask must be bool or of an integer dtype (nonzero: a "
                        f"token), got {padding_mask.dtype}")
    if (padding_mask.dim() != 2 or padding_mask.shape[0] != batch
            or not seqlen_q <= padding_mask.shape[1] <= seqlen_k):
        raise ValueError(f"fmha: padding_mask must be (batch, seqlen) with batch {batch} and "
                         f"seqlen_q {seqlen_q} <= seqlen <= seqlen_k {seqlen_k} (a slot per key, "
                         f"the queries in the last ones), got shape {tuple(padding_mask.shape)}")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    softmax_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                    softcap: float = 0.0, dropout_p: float = 0.0,
                    padding_mask: Optional[torch.Tensor] = None,
                    cu_seqlens_q: Optional[torch.Tensor] = None,
                    cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0,
                    max_seqlen_k: int = 0) -> torch.Tensor:
    """Attention of a padded batch in FlashAttention-2's conventions, on fmha.fwd.

    q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, heads_k, head_dim[_v]), any
    head dims (padded here to multiples of 8); returns (batch, seqlen_q, heads, head_dim_v).
    causal: bottom-right aligned, per sequence. softmax_scale defaults to 1/sqrt(head_dim).

    padding_mask: (batch, seqlen) of the keys, nonzero for a token; the queries are the last
    seqlen_q positions of each row (left padding, or a decode step). A mask shorter than the
    keys leaves out the key slots past it (a static KV cache's unwritten ones). The rows of
    padding queries are zeros. cu_seqlens_q/cu_seqlens_k (int32, sequences + 1) and
    max_seqlen_q/max_seqlen_k instead: sequences packed back to back along the rows, every
    token a sequence's (padding-free batches).
    """
    _check_shapes(q, k, v, padding_mask)
    batch, seqlen_q = q.shape[:2]
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if padding_mask is not None and k.shape[1] > padding_mask.shape[1]:
        k, v = k[:, :padding_mask.shape[1]], v[:, :padding_mask.shape[1]]
    options = dict(
        causal=causal, mask_align="bottom_right", softcap=softcap, dropout_p=dropout_p,
        softmax_scale=head_dim ** -0.5 if softmax_scale is None else softmax_scale,
        window_size=window_size(sliding_window, causal, k.shape[1]))
    # fmha.fwd and fwd_kvcache would pad head dims that are no multiple of 8 themselves (the
    # rows of transformers' caches are packed, so the caches are copied either way); here once
    # for both paths, and without fwd_kvcache's warning about copying the caches.
    q, k, v = pad_head_dim(q), pad_head_dim(k), pad_head_dim(v)

    if _decodes(q, k, v, cu_seqlens_q, dropout_p):
        # k and v are the whole cache (the step's tokens appended by the caller): attend to all
        # of it from each row's first token on, the queries aligned with its last keys.
        leftpad = None if padding_mask is None else _left_padding(padding_mask, seqlen_q)
        if padding_mask is None or leftpad is not None:
            try:
                out = fmha.fwd_kvcache(
                    q, k, v, cache_seqlens=_cache_lengths(batch, k.shape[1], q.device),
                    cache_leftpad=leftpad, causal=causal, window_size=options["window_size"],
                    softcap=softcap, softmax_scale=options["softmax_scale"])
                return out[..., :head_dim_v] if out.shape[-1] != head_dim_v else out
            except fmha.MissingInstanceError:  # a build without this kvcache instance
                pass
    if padding_mask is not None:
        keys, queries = _pack_batch(padding_mask, seqlen_q)
        out = fmha.fwd(gather_tokens(q, queries.indices), gather_tokens(k, keys.indices),
                       gather_tokens(v, keys.indices), cu_seqlens_q=queries.cu_seqlens,
                       cu_seqlens_k=keys.cu_seqlens, max_seqlen_q=queries.max_seqlen,
                       max_seqlen_k=keys.max_seqlen, **options)
        out = scatter_tokens(out, queries.indices, batch, seqlen_q)
    elif cu_seqlens_q is not None:
        out = fmha.fwd(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **options)
        out = out.view(batch, seqlen_q, *out.shape[1:])
    else:
        out = fmha.fwd(q, k, v, **options)
    return out[..., :head_dim_v] if out.shape[-1] != head_dim_v else out
