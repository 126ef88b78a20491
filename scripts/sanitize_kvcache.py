"""The KV-cache cases of scripts/sanitize.py: a few tiny fmha.fwd_kvcache problems per compiled
instance (fmha.kvcache_instances()), chosen to reach every path of its launcher, each forced by
name, synchronized, and checked against tests/reference.py's kvcache_reference computed on the
CPU, the caches the call leaves included.

Decode instances (the split-KV decode kernel: the append, the attention per key split on one of
its tiles, the combine of the splits) run one to twelve query tokens with several splits (forced,
one, more than a sequence has key tiles, and the heuristic's), MQA/GQA/MHA, empty caches, a
sequence without keys, and k/v appended with rotary (GPT-NeoX and GPT-J, on part of or the whole
head dim), an append that overflows the cache; paged caches on pages of every size class the
launcher tells apart (1 key: a table entry per key; 7: a thread's run of rows crosses pages, so
each row looks its page up; 16 and 48: runs in a page, tiles starting on and inside a page; 256:
a page spans tiles), contiguous ones with cache_batch_idx (shuffled rows among spare ones) and
cache_leftpad (a sequence whose padding covers every key); head dims below a head-dim-padded
instance's (a partial last 16-byte piece, and a narrower V); and, where the instance has a
full-grid tile, a step whose sequences and K/V heads alone fill every SM.

Prefill instances (the fa3 forward reading the cache by TMA) run chunks of many query tokens (at
least 256 packed rows, so every prefill tile takes them): a first chunk beside a later one,
chunks that fill and that overflow the cache, a sequence without keys; pages of 8, 16, 48 and 256
keys (box heights 8 and 16 and a whole tile, a shift or a division per page lookup) or a
contiguous cache (of a multiple of 8 keys and not), in the three memory orders its tensor maps
fold differently (packed: heads in the boxes' columns; head-major: heads in the pages; rows
pitched past the head dim: 8-row boxes).

Each case varies the instance's mask (windows of both sides and sizes), ALiBi (per head, per
sequence and head) and soft-cap. Every operand is a view into a poisoned buffer: q, k and v with
NaN rows after each sequence and NaN columns past the head dim; the caches with NaN pages or
rows around them, in every row no sequence has cached (past each length, before each left
padding, spare pages and rows) and, pitched, past the head dim; block_table, cache_seqlens,
cache_batch_idx and cache_leftpad inside buffers of out-of-range indices (block_table's entries
past the pages a sequence reaches too), the rotary tables followed by NaN rows. Outputs,
log-sum-exps and the split partials start as NaN (freed NaN blocks of their sizes). After the
call: the output and log-sum-exp against the float64 reference (the forward's pass rule); the
caches' appended rows within two ulps of the reference's, and every other element of their
buffers, poison included, bitwise untouched; the other operands' buffers untouched.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Optional

DEVICE = "cuda"

# The traits that tell KV-cache instances apart, besides the architecture and the tile; the
# pipeline is fa3 (chunked prefill) or fa2 (decode), and a full-grid tile is a second tile.
KEY_TRAITS = ("dtype", "hdim_q", "hdim_v", "mask", "bias", "paged", "softcap", "pad_hdim",
              "pipeline", "full_grid_block_n")

# (left, right, causal) of the window instances' cases, taken in turn: bounded on one side or
# both, a diagonal of one key, causal with a left bound.
WINDOWS = ((37, 0, False), (-1, 5, False), (16, 16, False), (0, 0, False), (64, -1, True),
           (100, 3, False))
ALIBI_KINDS = ("head", "batch_head")
SOFTCAPS = (5.0, 1.0, 30.0)
# An index no table, length or row map holds (block_table, cache_seqlens, cache_batch_idx, and
# cache_leftpad's buffers around their data): a kernel that reads past its indices addresses
# far past the cache, which memcheck reports.
POISON_INDEX = 1 << 30
SPARE_PAGES = 3  # a paged cache's pages that no sequence owns (NaN)
SPARE_ROWS = 2   # a contiguous cache's rows that cache_batch_idx maps no sequence to (NaN)


@dataclass(frozen=True)
class Case:
    """One fmha.fwd_kvcache problem.

    capacity: the keys a sequence's cache holds (paged: whole pages); lengths: cache_seqlens
    before the append; seqlen_new: k/v appended, rotated when rotary is "neox" or "gptj"
    (interleaved) on rotary_fraction of the head dim; num_splits: 0 for the heuristic's;
    page_size: 0 for a contiguous cache; batch_idx: contiguous caches, sequences in shuffled rows
    among spare ones; leftpad: cache_leftpad (contiguous); layout: the caches' memory order
    (_cache_buffer); dtype and head_dims: the instance's dtype and the call's (q/k, v) head
    dims; causal, window, alibi, softcap: the instance's traits as the case varies them; lse:
    return_lse.
    """

    batch: int
    seqlen_q: int
    nhead_q: int
    nhead_k: int
    capacity: int
    lengths: tuple
    seqlen_new: int = 0
    rotary: Optional[str] = None
    rotary_fraction: float = 1.0
    num_splits: int = 0
    page_size: int = 0
    batch_idx: bool = False
    leftpad: tuple = ()
    layout: str = "nhd"
    dtype: str = "fp16"
    head_dims: tuple = ()
    causal: bool = False
    window: tuple = (-1, -1)
    alibi: Optional[str] = None
    softcap: float = 0.0
    lse: bool = True

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dims[0] * self.rotary_fraction) // 2 * 2 if self.rotary else 0

    def describe(self) -> str:
        lengths = str(list(self.lengths))
        if len(self.lengths) > 6:  # the full-grid step's
            lengths = f"[{min(self.lengths)}..{max(self.lengths)} x{len(self.lengths)}]"
        parts = [self.dtype, f"d{self.head_dims[0]}/{self.head_dims[1]}",
                 f"h{self.nhead_q}/{self.nhead_k}", f"b{self.batch} q{self.seqlen_q}",
                 f"cap{self.capacity} len{lengths}"]
        if self.seqlen_new:
            parts.append(f"new{self.seqlen_new}")
        if self.rotary:
            parts.append(f"rotary={self.rotary}/{self.rotary_dim}")
        parts.append(f"splits={self.num_splits or 'auto'}")
        parts.append(f"page={self.page_size}" if self.page_size else "contiguous")
        if self.batch_idx:
            parts.append("batch_idx")
        if self.leftpad:
            parts.append(f"leftpad{list(self.leftpad)}")
        parts.append(self.layout)
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"window{self.window}")
        if self.alibi:
            parts.append(f"alibi={self.alibi}")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.lse:
            parts.append("lse")
        return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# Which problems (plain Python: no CUDA needed)
# ---------------------------------------------------------------------------------------------

# Decode on a paged cache, most telling first (racecheck's --cases 1 runs the first).
DECODE_PAGED = (
    # GQA 8:1, the new token appended and rotated (GPT-NeoX, half the head dim), 3 splits over an
    # empty cache, one key and 300; pages of 16: a thread's run of rows in one page, several
    # pages a key tile.
    ("splits3_pages16", Case(3, 1, 8, 1, 512, (0, 1, 300), seqlen_new=1, rotary="neox",
                             rotary_fraction=0.5, num_splits=3, page_size=16)),
    # Three tokens appended and rotated (GPT-J), MHA; 5 splits of at most 3 key tiles (idle
    # splits); pages of one key (a table entry per key); head-major caches.
    ("tokens3_pages1", Case(2, 3, 4, 4, 160, (2, 97), seqlen_new=3, rotary="gptj", num_splits=5,
                            page_size=1, layout="hnd")),
    # No append: a sequence without keys (output 0, log-sum-exp -inf); the heuristic's splits;
    # pages of 7 (runs cross pages: per-row lookups); rows pitched past the head dim.
    ("no_keys_pages7", Case(3, 2, 4, 2, 301, (0, 150, 299), page_size=7, layout="pitched")),
    # 12 tokens x GQA 4:1, three row blocks; the append overflows the first cache by 8 keys
    # (dropped: nothing is written past its last page); one split (no combine); pages of 48
    # (runs in a page, key tiles that start inside one).
    ("overflow_pages48", Case(2, 12, 8, 2, 480, (476, 40), seqlen_new=12, num_splits=1,
                              page_size=48)),
    # 16 query heads on 2, rotary on the whole head dim; the heuristic's many splits on few
    # units; pages of 256 (a page spans key tiles); no log-sum-exp.
    ("heuristic_pages256", Case(2, 1, 16, 2, 768, (700, 300), seqlen_new=1, rotary="neox",
                                page_size=256, lse=False)),
)

# Decode on a contiguous cache: the paged cases' shapes, with shuffled rows and left padding.
DECODE_CONTIGUOUS = (
    ("splits3_batch_idx", Case(3, 1, 8, 1, 512, (0, 1, 300), seqlen_new=1, rotary="neox",
                               rotary_fraction=0.5, num_splits=3, batch_idx=True)),
    # Left padding, one sequence's covering every key it has (output 0, log-sum-exp -inf); four
    # tokens appended and rotated (GPT-J: positions stay the cache's rows); head-major caches in
    # shuffled rows.
    ("leftpad_tokens4", Case(3, 4, 8, 2, 400, (350, 37, 20), seqlen_new=4, rotary="gptj",
                             num_splits=4, batch_idx=True, leftpad=(100, 0, 24), layout="hnd")),
    # 301 keys a row (no multiple of a tile or of 8), a sequence without keys.
    ("no_keys_pitched", Case(3, 2, 4, 2, 301, (0, 150, 299), layout="pitched")),
    # The append overflows the first row by 8 keys: nothing may land in the next row.
    ("overflow_rows", Case(2, 12, 8, 2, 333, (329, 40), seqlen_new=12, num_splits=1,
                           batch_idx=True)),
    ("heuristic_long", Case(2, 1, 16, 2, 2000, (1900, 700), seqlen_new=1, rotary="neox",
                            lse=False)),
)

# Chunked prefill on a paged cache: at least 256 packed rows (query tokens x query heads per
# K/V head) and pages of a multiple of 8 keys, what every prefill instance takes.
PREFILL_PAGED = (
    # A first chunk (an empty cache) beside a later one, GQA 4:1, appended and rotated (NeoX,
    # half the head dim); pages of 16 (16-key boxes, a shift per page); packed caches (heads
    # fold into the boxes' columns).
    ("chunk_pages16", Case(2, 200, 8, 2, 512, (0, 300), seqlen_new=200, rotary="neox",
                           rotary_fraction=0.5, page_size=16)),
    # 40 tokens x GQA 8:1 (fewer tokens than a tile), no append, a sequence without keys; pages
    # of 48 (a division per page, 16-key boxes); head-major caches of 2 K/V heads (heads fold
    # into pages; one head would fold into the columns).
    ("packed_pages48", Case(3, 40, 16, 2, 384, (100, 0, 333), page_size=48, layout="hnd")),
    # The chunk fills the cache to its last key (GPT-J); pages of 256 (a page spans tiles); rows
    # pitched past the head dim (8-row boxes, as for any strides where there are 2 K/V heads).
    ("fill_pages256", Case(1, 256, 4, 2, 512, (256,), seqlen_new=256, rotary="gptj",
                           page_size=256, layout="pitched")),
    # The append overflows the first cache by 94 keys; pages of 8 (the smallest box).
    ("overflow_pages8", Case(2, 130, 4, 2, 736, (700, 7), seqlen_new=130, page_size=8,
                             lse=False)),
)

PREFILL_CONTIGUOUS = (
    ("chunk_batch_idx", Case(2, 200, 8, 2, 512, (0, 300), seqlen_new=200, rotary="neox",
                             rotary_fraction=0.5, batch_idx=True)),
    ("packed_hnd", Case(3, 40, 16, 2, 384, (100, 0, 333), layout="hnd")),
    # 1001 keys a row, no multiple of 8: 8-row boxes; the chunk fills the row.
    ("fill_1001", Case(1, 256, 4, 2, 1001, (745,), seqlen_new=256, rotary="gptj")),
    ("overflow_pitched", Case(2, 130, 4, 2, 736, (700, 7), seqlen_new=130, layout="pitched",
                              lse=False)),
)


def _head_dim_shapes(inst: dict) -> tuple:
    """Head dims below a padded decode instance's (any, in place in pitched rows): one that ends
    inside a 16-byte piece, and whole pieces with a narrower V."""
    d, dv = inst["hdim_q"], inst["hdim_v"]
    paged = inst["paged"]
    partial = (d // 2 + 3, dv // 2 + 3)
    narrow = (d - 8, dv // 2)
    return (
        (f"hdim{partial[0]}_{partial[1]}",
         Case(2, 2, 4, 1, 200, (150, 0), seqlen_new=2, rotary="neox", rotary_fraction=0.5,
              num_splits=3, page_size=12 if paged else 0, leftpad=() if paged else (30, 0),
              layout="pitched", head_dims=partial)),
        (f"hdim{narrow[0]}_{narrow[1]}",
         Case(2, 1, 8, 2, 256, (254, 31), seqlen_new=1, rotary="gptj", num_splits=2,
              page_size=16 if paged else 0, layout="pitched", head_dims=narrow)),
    )


def _full_grid_shape(inst: dict) -> tuple:
    """More (sequence, K/V head) units than any GPU has SMs (11 x 16): the instance's full-grid
    tile, with 2 splits so that its combine runs too."""
    return ("full_grid", Case(11, 1, 32, 16, 128, tuple(i * 53 % 128 for i in range(11)),
                              seqlen_new=1, rotary="neox", num_splits=2,
                              page_size=16 if inst["paged"] else 0))


def _with_traits(case: Case, inst: dict, idx: int) -> tuple[Case, str]:
    """The case with the instance's mask, ALiBi and soft-cap, varied by the case index; and a
    label of the variant."""
    label = []
    if inst["mask"] == "causal":
        case = replace(case, causal=True)
        label.append("causal")
    elif inst["mask"] == "window":
        left, right, causal = WINDOWS[idx % len(WINDOWS)]
        case = replace(case, window=(left, right), causal=causal)
        label.append(f"win{left}_{right}{'_causal' if causal else ''}")
    if inst["bias"] == "alibi":
        case = replace(case, alibi=ALIBI_KINDS[idx % len(ALIBI_KINDS)])
        label.append(f"alibi_{case.alibi}")
    if inst["softcap"]:
        case = replace(case, softcap=SOFTCAPS[idx % len(SOFTCAPS)])
        label.append(f"softcap{case.softcap:g}")
    return case, "-".join(label)


def instance_cases(inst: dict) -> list[tuple[str, Case]]:
    """The cases of one KV-cache instance, most telling first: (label, case)."""
    if inst["prefill"]:
        shapes = PREFILL_PAGED if inst["paged"] else PREFILL_CONTIGUOUS
    else:
        shapes = DECODE_PAGED if inst["paged"] else DECODE_CONTIGUOUS
        if inst["pad_hdim"]:
            shapes += _head_dim_shapes(inst)
        if inst.get("full_grid_block_n", 0):
            shapes += (_full_grid_shape(inst),)
    cases = []
    for idx, (name, case) in enumerate(shapes):
        case = replace(case, dtype=inst["dtype"],
                       head_dims=case.head_dims or (inst["hdim_q"], inst["hdim_v"]))
        if case.page_size:  # whole pages
            case = replace(case, capacity=-(-case.capacity // case.page_size) * case.page_size)
        case, variant = _with_traits(case, inst, idx)
        cases.append((f"{name}-{variant}" if variant else name, case))
    return cases


# ---------------------------------------------------------------------------------------------
# Running (torch, fmha and tests/reference.py passed in)
# ---------------------------------------------------------------------------------------------


@dataclass
class Poisoned:
    """An operand as a view into a buffer poisoned around it: `view_of` maps the buffer to the
    operand; `host` is the buffer as built (on the CPU), `device` its copy on the GPU."""

    host: object
    view_of: Callable
    device: object = None

    @property
    def operand(self):
        return self.view_of(self.device)

    @property
    def reference(self):
        return self.view_of(self.host)


def _round8(x: int) -> int:
    return -(-x // 8) * 8


def _pitch(d: int) -> int:
    """A row of d elements padded with NaN to a multiple of 8 and 8 more: in place for the
    kernels (rows start 16 bytes apart), poison past the head dim."""
    return _round8(d) + 8


def _operand_buffer(torch, values) -> Poisoned:
    """q, k or v (batch, seqlen, heads, d): 3 NaN rows after each sequence, NaN past the head
    dim."""
    b, s, h, d = values.shape
    host = torch.full((b, s + 3, h, _pitch(d)), float("nan"), dtype=values.dtype)
    view_of = lambda t: t[:, :s, :, :d]  # noqa: E731
    view_of(host).copy_(values)
    return Poisoned(host, view_of)


def _cache_buffer(torch, layout: str, units: int, rows: int, heads: int, d: int,
                  dtype) -> Poisoned:
    """A NaN (units, rows, heads, d) cache (units: pages or cache rows, rows: keys each) with a
    NaN unit before and after it, in memory order `layout`: "nhd" packed; "hnd" a unit's heads
    one after another (a (units, heads, rows, d) tensor, transposed); "pitched" rows of
    _pitch(d) columns (no two dimensions merge)."""
    nan = float("nan")
    if layout == "hnd":
        host = torch.full((units + 2, heads, rows, d), nan, dtype=dtype)
        view_of = lambda t: t[1:-1].transpose(1, 2)  # noqa: E731
    elif layout == "pitched":
        host = torch.full((units + 2, rows, heads, _pitch(d)), nan, dtype=dtype)
        view_of = lambda t: t[1:-1, :, :, :d]  # noqa: E731
    else:
        host = torch.full((units + 2, rows, heads, d), nan, dtype=dtype)
        view_of = lambda t: t[1:-1]  # noqa: E731
    return Poisoned(host, view_of)


def _index_buffer(torch, values) -> Poisoned:
    """int32 indices inside POISON_INDEX: 4 entries before and after a vector, 4 columns after
    each row of a table (block_table's batch stride then is no row length)."""
    values = torch.as_tensor(values, dtype=torch.int32)
    if values.dim() == 1:
        n = values.shape[0]
        host = torch.full((n + 8,), POISON_INDEX, dtype=torch.int32)
        view_of = lambda t: t[4:4 + n]  # noqa: E731
    else:
        cols = values.shape[1]
        host = torch.full((values.shape[0], cols + 4), POISON_INDEX, dtype=torch.int32)
        view_of = lambda t: t[:, :cols]  # noqa: E731
    view_of(host).copy_(values)
    return Poisoned(host, view_of)


def _table_buffer(torch, values) -> Poisoned:
    """A rotary table (seqlen_rotary, rotary_dim / 2), contiguous, with NaN rows after it."""
    rows = values.shape[0]
    host = torch.full((rows + 4, values.shape[1]), float("nan"), dtype=values.dtype)
    host[:rows] = values
    return Poisoned(host, lambda t: t[:rows])


@dataclass
class Built:
    """A case's operands: the call's keyword arguments as poisoned buffers (None where absent)
    and ALiBi's slopes (plain: fmha.fwd_kvcache reads a (batch, nheads) table at a row stride
    of nheads)."""

    q: Poisoned
    k_cache: Poisoned
    v_cache: Poisoned
    k: Optional[Poisoned]
    v: Optional[Poisoned]
    indices: dict      # cache_seqlens, block_table, cache_batch_idx, cache_leftpad
    rotary: dict       # rotary_cos, rotary_sin
    alibi_slopes: object
    reference_table: object  # block_table with every entry a page: the reference gathers all

    def buffers(self) -> dict:
        named = {"q": self.q, "k_cache": self.k_cache, "v_cache": self.v_cache, "k": self.k,
                 "v": self.v, **self.indices, **self.rotary}
        return {name: p for name, p in named.items() if p is not None}

    def kwargs(self, reference: bool) -> dict:
        """fwd_kvcache's keyword arguments past q, the caches, k and v: the GPU's operands, or
        (reference) the host's for kvcache_reference."""
        pick = (lambda p: p.reference) if reference else (lambda p: p.operand)
        out = {name: pick(p) for name, p in {**self.indices, **self.rotary}.items()}
        if reference and self.reference_table is not None:
            out["block_table"] = self.reference_table
        if self.alibi_slopes is not None:
            out["alibi_slopes"] = self.alibi_slopes if reference else self.alibi_slopes.to(
                DEVICE)
        return out


def _build(torch, R, inst: dict, case: Case, seed: int) -> Built:
    """The case's operands, drawn from a CPU generator seeded by seed, in poisoned host buffers
    (nothing on the GPU yet)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = R.DTYPES[inst["dtype"]]
    d, dv = case.head_dims
    b, hk = case.batch, case.nhead_k

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(dtype)

    indices = {"cache_seqlens": _index_buffer(torch, list(case.lengths))}
    table = None
    if case.page_size:
        pages_per_seq = case.capacity // case.page_size
        units, rows = b * pages_per_seq + SPARE_PAGES, case.page_size
        table = torch.randperm(units, generator=gen)[:b * pages_per_seq].view(b, pages_per_seq)
        # The entries past the pages a sequence's keys reach (the append's included) hold
        # POISON_INDEX, as a serving loop's unused entries hold anything: a kernel may read
        # them, never follow them.
        used = table.clone()
        for seq, length in enumerate(case.lengths):
            reached = min(length + case.seqlen_new, case.capacity)
            used[seq, -(-reached // case.page_size):] = POISON_INDEX
        indices["block_table"] = _index_buffer(torch, used)
    else:
        units, rows = (b + SPARE_ROWS if case.batch_idx else b), case.capacity
        cache_rows = (torch.randperm(units, generator=gen)[:b] if case.batch_idx
                      else torch.arange(b))
        if case.batch_idx:
            indices["cache_batch_idx"] = _index_buffer(torch, cache_rows)
        if case.leftpad:
            indices["cache_leftpad"] = _index_buffer(torch, list(case.leftpad))

    def place(view, seq: int, first: int, values) -> None:
        """Keys first.. of sequence seq: through its pages, or in its cache row."""
        if not case.page_size:
            view[int(cache_rows[seq]), first:first + len(values)] = values
            return
        key, end = first, first + len(values)
        while key < end:
            page, row = divmod(key, case.page_size)
            take = min(case.page_size - row, end - key)
            view[int(table[seq, page]), row:row + take] = values[key - first:key - first + take]
            key += take

    caches = []
    for dim in (d, dv):
        cache = _cache_buffer(torch, case.layout, units, rows, hk, dim, dtype)
        view = cache.reference
        # Each sequence's cached keys [left padding, length); every other row stays NaN.
        for seq, length in enumerate(case.lengths):
            start = min(case.leftpad[seq], length) if case.leftpad else 0
            place(view, seq, start, randn(length - start, hk, dim))
        caches.append(cache)

    q = _operand_buffer(torch, randn(b, case.seqlen_q, case.nhead_q, d))
    k = v = None
    if case.seqlen_new:
        k = _operand_buffer(torch, randn(b, case.seqlen_new, hk, d))
        v = _operand_buffer(torch, randn(b, case.seqlen_new, hk, dv))
    rotary = {}
    if case.rotary:
        angles = torch.rand(case.capacity, case.rotary_dim // 2, generator=gen) * 2 * math.pi
        rotary = {"rotary_cos": _table_buffer(torch, angles.cos().to(dtype)),
                  "rotary_sin": _table_buffer(torch, angles.sin().to(dtype))}
    slopes = None
    if case.alibi:
        shape = (case.nhead_q,) if case.alibi == "head" else (b, case.nhead_q)
        slopes = torch.rand(shape, generator=gen) * 0.3 + 0.02
    return Built(q, caches[0], caches[1], k, v, indices, rotary, slopes, table)


def _options(case: Case) -> dict:
    options = dict(causal=case.causal, window_size=tuple(case.window), softcap=case.softcap)
    if case.rotary:
        options["rotary_interleaved"] = case.rotary == "gptj"
    return options


def _workspace_bytes(inst: dict, case: Case) -> int:
    """The most workspace the call can take (the decode kernel's fp32 split partials and the
    rotated q), so that a freed NaN block of that size serves it: at most one split per key tile
    of the instance's smaller tile, and 128 (the launcher's bound)."""
    def rounded(n):
        return -(-n // 256) * 256

    rows = case.batch * case.nhead_q * case.seqlen_q
    total = rounded(rows * inst["hdim_q"] * 2) if case.rotary else 0
    if not inst["prefill"]:
        block_n = min(inst["block_n"], inst.get("full_grid_block_n", 0) or inst["block_n"])
        splits = min(case.num_splits or 128, -(-case.capacity // block_n))
        if splits > 1:
            total += rounded(splits * rows * inst["hdim_v"] * 4) + rounded(splits * rows * 4)
    return total


def _bits(torch, t):
    """t's elements as integers of their width, so that NaN compares equal to itself."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _check_cache(torch, R, name: str, cache: Poisoned, want, dtype, what: str) -> None:
    """The cache's whole buffer after the call: the elements the reference's append changed
    within two ulps of its (the kernel rotates in fp32, the reference in float64, each rounding
    once), every other one, the poison included, bitwise as before."""
    got = cache.device.cpu()
    expect = cache.host.clone()
    cache.view_of(expect).copy_(want)
    appended = _bits(torch, expect) != _bits(torch, cache.host)
    moved = (_bits(torch, got) != _bits(torch, expect)) & ~appended
    assert not moved.any(), (
        f"{what}: {int(moved.sum())} elements of {name}'s buffer outside the appended rows "
        "changed (a write past a sequence's rows, its pages, or its head dim)")
    if appended.any():
        new, ref = got[appended].double(), expect[appended].double()
        assert not new.isnan().any(), f"{what}: appended rows of {name} left unwritten (NaN)"
        diff = (new - ref).abs().max().item()
        assert diff <= 2 * R.ulp(ref.abs().max().item(), dtype), (
            f"{what}: {name}'s appended rows off by {diff}")


def run_case(torch, fmha, R, inst: dict, case: Case, seed: int, check: bool) -> str:
    """Runs one KV-cache case; returns a short result, raises on a failure."""
    dtype = R.DTYPES[inst["dtype"]]
    built = _build(torch, R, inst, case, seed)
    for buffer in built.buffers().values():
        buffer.device = buffer.host.to(DEVICE, copy=True)  # the host's stays as built
    k, v = (None if p is None else p.operand for p in (built.k, built.v))
    call_kwargs = built.kwargs(reference=False)
    b, sq, hq = case.batch, case.seqlen_q, case.nhead_q
    dv = case.head_dims[1]
    # Last before the call, which allocates out (its rows 16 bytes apart), the log-sum-exp and
    # the workspace, in that order.
    R.poison_allocator([((b, sq, hq, _round8(dv)), dtype), ((b, hq, sq), torch.float32),
                        ((_workspace_bytes(inst, case) // 4 or 1,), torch.float32)], DEVICE)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        result = fmha.fwd_kvcache(built.q.operand, built.k_cache.operand, built.v_cache.operand,
                                  k, v, **call_kwargs, **_options(case),
                                  num_splits=case.num_splits, return_lse=case.lse,
                                  instance=inst["name"])
    torch.cuda.synchronize()
    copied = [str(w.message) for w in warned if "copies" in str(w.message)]
    assert not copied, f"the call ran on copies, not in place: {copied[0][:200]}"
    out, lse = result if case.lse else (result, None)
    if not check:
        return "ran"
    what = "fwd_kvcache"  # the failure's line names the instance and the case
    expect = (b, sq, hq, dv)
    assert tuple(out.shape) == expect, f"{what}: output shape {tuple(out.shape)}, want {expect}"
    new = [None if p is None else p.reference for p in (built.k, built.v)]
    args = (built.q.reference, built.k_cache.reference, built.v_cache.reference, *new)
    kwargs = dict(built.kwargs(reference=True), **_options(case))
    truth, truth_lse, want_k, want_v = R.kvcache_reference(*args, **kwargs)
    # compare() skips the reference's NaN elements, and here it has none unless this script
    # put a sequence's keys where the poison is.
    assert not truth.isnan().any(), f"{what}: the reference read the poison (a case bug)"
    lowp, _, _, _ = R.kvcache_reference(*args, **kwargs, compute_dtype=dtype)
    cmp = R.compare(out.cpu(), truth, lowp, dtype=dtype,
                    lse=None if lse is None else lse.cpu(),
                    ref_lse=truth_lse if case.lse else None, what=what)
    _check_cache(torch, R, "k_cache", built.k_cache, want_k, dtype, what)
    _check_cache(torch, R, "v_cache", built.v_cache, want_v, dtype, what)
    for name, buffer in built.buffers().items():
        if name not in ("k_cache", "v_cache"):
            assert torch.equal(_bits(torch, buffer.device.cpu()), _bits(torch, buffer.host)), (
                f"{what}: the call wrote into {name}'s buffer")
    return f"err {cmp.err:.2e} <= {cmp.tol:.2e}"
