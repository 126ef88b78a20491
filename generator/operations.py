"""The operations: what each one computes and how its instances are built, after CUTLASS's
generator (one description class per OperationKind over the shared vocabulary of schema.py),
rather than CK-Tile's copy of the codegen per operation.

An Operation says everything that differs between operations, in one place:
  traits      its traits class (model.py), mirroring fmha.h's: the fields are its functional
              axes, so they give its matrix axes, instance names, dispatch rows and manifest
              records
  kernels     which pipelines implement it and how: the kernel header an instance TU includes,
              the config class template and the launcher it instantiates, the workspace
              function if the operation has one, the tile constraints the kernel
              static_asserts and the shared memory a tile takes
  template    its instance TU's template in templates/
  args        the C++ argument struct its launchers take
  registry    the prefix of its names in registry.h (k{R}Instances, {R}InstanceEntry, ...)
  exports     the functions each of its TUs defines, which its dispatch rows point to
  row_lines   its dispatch rows' traits, line by line (the rendered table's layout)
Its matrix, tiles and rules are in instances.yaml under `operations: <token>:`.

What a pipeline token means for each operation (the tokens name kernel designs, schema.PIPELINE,
and stay as instances.yaml, instance names and filters spell them; the kernels are named by
what they do):
  fwd      fa3  the FlashAttention-3 forward: TMA, wgmma and warp specialization (sm90a only),
                fmha/kernels/fwd_fa3_sm90.cuh
           fa2  the FlashAttention-2 forward: mma.sync (sm80 and built natively for sm90a),
                fmha/kernels/fwd_fa2_sm80.cuh
  bwd      fa3  the FlashAttention-3 backward: TMA, wgmma and warp specialization (sm90a only),
                fmha/kernels/bwd_fa3_sm90.cuh
           fa2  the FlashAttention-2 backward: mma.sync (sm80 and built natively for sm90a),
                fmha/kernels/bwd_fa2_sm80.cuh
  kvcache  fa3  chunked prefill: the fa3 forward's kernel reading K and V from the cache by TMA
                (an e4m3 cache's tiles widened to fp16 in shared memory,
                fmha/kernels/fwd_fa3_kv_widen_sm90.cuh), for calls of many query tokens (sm90a
                only), fmha/kernels/kvcache_chunked_prefill_sm90.cuh
           fa2  split-KV decode (Flash-Decoding): a CTA per key split on mma.sync, its splits
                combined by their log-sum-exp, for calls of few query tokens (sm80 and built
                natively for sm90a), fmha/kernels/kvcache_decode_split_kv.cuh
Both kvcache pipelines first append k_new/v_new to the cache with one kernel,
fmha/kernels/kvcache_append.cuh.

Adding an operation (as kvcache was added):
  1. its traits struct in fmha.h and its table in registry.h (k<R>Instances, <R>InstanceEntry,
     <R>PipelineGap, ..., with the entry's function pointers);
  2. its traits class in model.py (the fields in instance-name order) and its OperationKind in
     schema.OPERATION;
  3. an Operation here, with its kernels, and its TU template in templates/;
  4. an axis of its own that no operation has yet: its name in schema.MATRIX_AXES (and
     TRAIT_BOOL_AXES or ENUM_AXES), and in dispatch.EQUAL_TRAITS when a call must match it;
  5. its entry under `operations:` in instances.yaml, and its part of the presets; a shared
     rule that must not hold for it names the operations it is for (`op: [fwd, bwd]`);
  6. the runtime: its table in the dispatcher (runtime/src/dispatcher.cpp), its entry points
     in api.cpp and the bindings.
Everything else (the filter grammar, presets, dispatch order and shadow proof, --explain, the
manifest, the CMake list) works for it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from .model import BwdTraits, FwdTraits, KvcacheTraits, Traits
from .schema import (BUILD_AXES, OPERATION, PIPELINE, EnumAxis, OperationKind, Pipeline,
                     head_dims_joined, with_head_dims)


@dataclass(frozen=True)
class TileConstraint:
    """A condition a kernel places on its tile; `reason` is shown when it fails. Constraints
    are checked in order, so one may assume those before it hold."""

    reason: str
    holds: Callable[[Any, tuple[int, int]], bool]  # (model.Tile, (hdim_q, hdim_v)) -> ok


@dataclass(frozen=True)
class SharedMemory:
    """How much shared memory a kernel's CTA takes for a tile, checked against each arch's
    limit so that an oversized tile is reported at its line instead of failing at launch."""

    # (model.Traits) -> the formula of `bytes` for an instance of these traits, in words, for
    # the error message
    formula: Callable[[Traits], str]
    # (model.Tile, model.Traits) -> bytes, from what the instance's traits say of its tiles:
    # their head dims; the bytes of a K or V element (Traits.kv_element_size): 2, or 1 of an
    # e4m3 KV cache, which the decode kernel reads and the chunked-prefill kernel stages before
    # widening it to fp16, and of the fa3 forward's e4m3 inputs (Q, K and V share the dtype
    # there; O stays bf16); and the rings of V tiles (Traits.v_rings: 2 where the fa3 forward
    # transposes an e4m3 V in shared memory). The other kernels' K and V are the inputs'
    # 16-bit dtype, so their formulas count 2-byte elements and one V ring.
    bytes: Callable[[Any, Traits], int]
    # (model.Tile, model.Traits) -> the bytes of a region the kernel gives space of its own
    # only where `bytes` and it fit under the arch's limit together, and stages over another
    # region otherwise (chunked prefill from an e4m3 cache: O, over Q; its config's
    # kSeparateO); None: the formula has no such region.
    region_if_it_fits: Callable[[Any, Traits], int] | None = None

    def needed(self, tile, traits: Traits, smem_limit: int) -> int:
        """The bytes a CTA of this tile takes on an arch that lets it use smem_limit (the
        config's kSmemLimit, schema.Arch.smem_limit): `bytes`, plus region_if_it_fits's where
        both fit."""
        needed = self.bytes(tile, traits)
        region = self.region_if_it_fits(tile, traits) if self.region_if_it_fits else 0
        return needed + region if needed + region <= smem_limit else needed


def _hdims(traits: Traits) -> tuple[int, int]:
    return traits.hdim_q, traits.hdim_v


@dataclass(frozen=True)
class Kernel:
    """How one pipeline implements one operation."""

    pipeline: Pipeline
    header: str  # the kernel header an instance TU includes
    config_template: str  # class template taking the instance's compile-time parameters
    launcher: str  # function template launching the instance's kernels for one config
    tile_constraints: tuple[TileConstraint, ...]
    shared_memory: SharedMemory
    # The header includes CuTe/CUTLASS (<cute/...>, <cutlass/...>): the build adds their include
    # directory to these TUs only, and needs it only when it compiles one.
    uses_cutlass: bool
    # Function template sizing the scratch the instance's kernels share; None: they need none.
    workspace: str | None = None
    # Its tiles are for many query tokens (kvcache's chunked prefill on the fa3 forward): it
    # serves calls of at least block_m query tokens, or of at least PREFILL_MIN_PACKED_ROWS
    # packed rows, on caches whose pages are multiples of PREFILL_PAGE_MULTIPLE keys; the
    # operation's other pipeline serves the rest (decode).
    prefill: bool = False
    # The head dims its pad_hdim instances run below their own come in steps of this: 8 where
    # rows move in whole 16-byte pieces (fa2's forward and backward; the API pads other head
    # dims with copies), 1 where a row's last piece may be partial (the KV-cache decode kernel,
    # whose cache is written in place and cannot be copied per call). None: exact head dims
    # only (instances.yaml must prune its pad_hdim instances; catalog.prune checks).
    padded_hdim_step: int | None = 8
    # Its launcher and workspace function take a second config, the tile's `full_grid` (a
    # tile entry may give one), which runs the calls whose units alone fill every SM.
    full_grid_tile: bool = False
    # The N extents its wgmma GEMMs may take for a tile and (hdim_q, hdim_v), or None for a
    # kernel without wgmma: a TU whose N falls outside WGMMA_BASE_N defines CuTe's extended
    # shapes (Kernel.extended_wgmma_shapes).
    wgmma_n: Callable[[Any, tuple[int, int]], tuple[int, ...]] | None = None

    def extended_wgmma_shapes(self, tile, hdims: tuple[int, int]) -> bool:
        """Whether an instance TU of this tile and head dims must define
        CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (fmha/kernels/sm90_primitives.cuh says why it is
        not always on: a minute of compile time per TU)."""
        return self.wgmma_n is not None and not set(self.wgmma_n(tile, hdims)) <= WGMMA_BASE_N


# The wgmma N extents CuTe's op selectors take without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
# (cute/arch/mma_sm90_gmma.hpp); wgmma itself takes every multiple of 8 up to 256.
WGMMA_BASE_N = frozenset({8, 16, 32, 64, 96, 128, 192, 256})


# Keys a prefill kernel's pages hold a multiple of: its TMA boxes are one page's rows and start
# on a 1024-byte swizzle period of 8 rows (fmha/kernels/cached_kv_sm90.cuh).
PREFILL_PAGE_MULTIPLE = 8
# Packed rows (query tokens x query heads per K/V head: the decode kernel's rows) from which a
# prefill kernel also takes chunks shorter than its tile: on an H100 (bf16 d128) it read
# 64-148 TFLOP/s against the decode kernel's 47-56 at 256, and 16-37 against 22-52 at 128
# (docs/perf-notes.md v15). Both numbers go into the dispatch table as well (registry.h's
# kPrefillMinPackedRows and kPrefillPageMultiple), for the C++ dispatcher's rule.
PREFILL_MIN_PACKED_ROWS = 256


@dataclass(frozen=True)
class Export:
    """A function every instance TU of an operation defines, `<prefix>_<instance name>`, which
    the dispatch table declares and its row points to."""

    prefix: str
    returns: str
    params: str  # the parameter types, as the table declares them

    def declaration(self, name: str) -> str:
        return f"{self.returns} {self.prefix}_{name}({self.params});"

    def pointer(self, name: str) -> str:
        return f"&instances::{self.prefix}_{name}"


@dataclass(frozen=True)
class Operation:
    kind: OperationKind
    traits: type[Traits]
    kernels: tuple[Kernel, ...]
    template: str
    args: str
    registry: str
    exports: tuple[Export, ...]
    row_lines: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        # The rows initialize fmha.h's traits struct by position: its fields in their order.
        assert sum(self.row_lines, ()) == self.traits.axes(), self.kind
        assert all(k.pipeline in PIPELINE.values for k in self.kernels), self.kind

    @property
    def token(self) -> str:
        return self.kind.token

    @cached_property
    def matrix_axes(self) -> tuple[str, ...]:
        """The axes of its matrix, in instance-name order: its traits' fields (hdim for the
        two head dims), then how and for which GPU an instance is built."""
        return (*head_dims_joined(self.traits.axes()), *BUILD_AXES)

    @cached_property
    def condition_axes(self) -> tuple[str, ...]:
        """The axes its rules can name: the matrix axes, and each head dim alone."""
        return with_head_dims(self.matrix_axes)

    @cached_property
    def pipelines(self) -> EnumAxis:
        """Its pipelines, newest first as in schema.PIPELINE."""
        return EnumAxis("pipeline", tuple(p for p in PIPELINE
                                          if any(k.pipeline == p for k in self.kernels)))

    def kernel(self, pipeline: Pipeline) -> Kernel:
        return next(k for k in self.kernels if k.pipeline == pipeline)

    @cached_property
    def padded_hdim_step(self) -> int:
        """The step of the head dims its pad_hdim instances run (Kernel.padded_hdim_step,
        which its padding kernels share); 0 where none pads. The runtime reads it from the
        dispatch table (registry.h's k<R>PaddedHeadDimStep)."""
        steps = {k.padded_hdim_step for k in self.kernels if k.padded_hdim_step is not None}
        assert len(steps) <= 1, (self.kind, steps)
        return steps.pop() if steps else 0

    # registry.h's names of its table, e.g. kBwdInstances, kNumBwdInstances, BwdInstanceEntry.
    @property
    def traits_cpp(self) -> str:
        return self.traits.__name__  # FwdTraits, as fmha.h names it

    @property
    def table(self) -> str:
        return f"k{self.registry}Instances"

    @property
    def count(self) -> str:
        return f"kNum{self.registry}Instances"

    @property
    def entry(self) -> str:
        return f"{self.registry}InstanceEntry"

    @property
    def padded_hdim_step_name(self) -> str:
        return f"k{self.registry}PaddedHeadDimStep"

    @property
    def gap_type(self) -> str:
        return f"{self.registry}PipelineGap"

    @property
    def gaps(self) -> str:
        return f"k{self.registry}PipelineGaps"

    @property
    def gap_count(self) -> str:
        return f"kNum{self.registry}PipelineGaps"

    @property
    def matrix_head_dims(self) -> str:
        return f"k{self.registry}MatrixHeadDims"

    @property
    def matrix_head_dim_count(self) -> str:
        return f"kNum{self.registry}MatrixHeadDims"


# ---- fwd -------------------------------------------------------------------------------------

# What fmha/kernels/fwd_fa2_sm80.cuh static_asserts, checked here too so that a bad tile is
# reported at its line in instances.yaml instead of deep inside an nvcc run.
_FWD_FA2_CONSTRAINTS = (
    TileConstraint("block_m == 16 * warps or 32 * warps (each warp owns 16 or 32 query rows)",
                   lambda tile, hdim: tile.block_m in (16 * tile.warps, 32 * tile.warps)),
    TileConstraint("block_n % 16 == 0 (keys are consumed in 16-wide MMA k-steps)",
                   lambda tile, hdim: tile.block_n % 16 == 0),
    TileConstraint("stages == 2 (K and V are double-buffered)",
                   lambda tile, hdim: tile.stages == 2),
    # 32 rather than the MMA's 16: shared-memory rows are XOR-swizzled in atoms of 32 or 64
    # columns (4 or 8 chunks of 16 bytes).
    TileConstraint("hdim_q and hdim_v multiples of 32 (the shared-memory swizzle's atoms)",
                   lambda tile, hdim: all(d % 32 == 0 for d in hdim)),
)

_Q_AND_KV_RING = "2 * (block_m * max(hdim_q, hdim_v) + stages * block_n * (hdim_q + hdim_v))"


def _q_and_kv_ring_bytes(tile, traits: Traits) -> int:
    """The Q region (it also stages O in the epilogue, so it fits the wider head dim) and one K
    and one V tile per stage, of 2-byte elements (the forward's 16-bit inputs)."""
    hdim = _hdims(traits)
    return 2 * (tile.block_m * max(hdim) + tile.stages * tile.block_n * (hdim[0] + hdim[1]))


# What fmha/kernels/fwd_fa3_sm90.cuh static_asserts: one producer warpgroup (4 warps) feeds
# block_m / 64 consumer warpgroups through TMA, and each consumer issues wgmma on its 64 rows.
_FWD_FA3_CONSTRAINTS = (
    TileConstraint("block_m 128 or 192 (two or three consumer warpgroups of 64 query rows: the "
                   "register split between producer and consumers is set for those)",
                   lambda tile, hdim: tile.block_m in (128, 192)),
    TileConstraint("warps == 4 * (block_m // 64 + 1) (one producer warpgroup plus one consumer "
                   "warpgroup per 64 query rows)",
                   lambda tile, hdim: tile.warps == 4 * (tile.block_m // 64 + 1)),
    TileConstraint("block_n % 16 == 0 and 16 <= block_n <= 256 (wgmma's N for S = QK^T, and "
                   "16-key k-steps for O += PV)",
                   lambda tile, hdim: tile.block_n % 16 == 0 and 16 <= tile.block_n <= 256),
    TileConstraint("stages >= 2 (the K/V ring loads one tile while the consumers read another)",
                   lambda tile, hdim: tile.stages >= 2),
    # 64 two-byte elements are one 128-byte swizzle atom of TMA and wgmma's shared-memory layout.
    TileConstraint("hdim_q and hdim_v multiples of 64 (128-byte swizzle atoms)",
                   lambda tile, hdim: all(d % 64 == 0 for d in hdim)),
    TileConstraint("hdim_v <= hdim_q (O is staged over Q where it has no region of its own)",
                   lambda tile, hdim: hdim[1] <= hdim[0]),
)

# FwdConfig::kSmemBytes of fwd_fa3_sm90.cuh: fa2's regions, plus the K/V ring's mbarriers and
# the 1024-byte alignment that 128-byte-swizzled TMA tiles need. kvcache's chunked prefill runs
# the same kernel, so on a cache of the queries' 16-bit dtype it takes the same (an e4m3 cache
# takes its own: _CHUNKED_PREFILL_SHARED_MEMORY below). e4m3 inputs (Traits.kv_element_size 1:
# Q, K and V alike) take a byte an element, and O, bf16, a region of its own: it does not fit
# over Q; a row-major e4m3 V takes a second ring (Traits.v_rings 2): TMA lands its row-major
# tiles in `stages` stages of their own, and the producer transposes each into the V^T stages
# the consumers read.
_FA3_BARRIERS_AND_ALIGNMENT = 1024
_FA3_BARRIERS = f"{_FA3_BARRIERS_AND_ALIGNMENT} (barriers and alignment)"


def _fwd_fa3_smem_bytes(tile, traits: Traits) -> int:
    if traits.kv_element_size == 2:
        return _q_and_kv_ring_bytes(tile, traits) + _FA3_BARRIERS_AND_ALIGNMENT
    hdim_q, hdim_v = _hdims(traits)
    return (tile.block_m * hdim_q + tile.stages * tile.block_n * (hdim_q + traits.v_rings * hdim_v)
            + 2 * tile.block_m * hdim_v + _FA3_BARRIERS_AND_ALIGNMENT)


def _fwd_fa3_smem_formula(traits: Traits) -> str:
    if traits.kv_element_size == 2:
        return f"{_Q_AND_KV_RING} + {_FA3_BARRIERS}"
    v_tiles, v_layout = (("2 * hdim_v", "row-major V (its tiles and their transposes in rings of "
                          "their own)") if traits.v_rings == 2 else ("hdim_v", "V^T"))
    return (f"block_m * hdim_q + stages * block_n * (hdim_q + {v_tiles}) + 2 * block_m * hdim_v "
            f"(O, bf16, in its own region) + {_FA3_BARRIERS}, of e4m3 inputs with {v_layout}")


_FWD_FA3_SHARED_MEMORY = SharedMemory(_fwd_fa3_smem_formula, _fwd_fa3_smem_bytes)


def _fwd_fa3_wgmma_n(tile, hdim: tuple[int, int]) -> tuple[int, ...]:
    """S = QK^T is (64, block_n) per consumer warpgroup, O += PV (64, hdim_v)."""
    return (tile.block_n, hdim[1])


FWD = Operation(
    kind=OPERATION.get("fwd"),
    traits=FwdTraits,
    kernels=(
        Kernel(PIPELINE.get("fa3"), header="fmha/kernels/fwd_fa3_sm90.cuh",
               config_template="fmha::fa3::FwdConfig", launcher="fmha::fa3::launch_fwd",
               tile_constraints=_FWD_FA3_CONSTRAINTS, shared_memory=_FWD_FA3_SHARED_MEMORY,
               uses_cutlass=True, padded_hdim_step=None, wgmma_n=_fwd_fa3_wgmma_n),
        # FwdConfig::kSmemBytes of fwd_fa2_sm80.cuh.
        Kernel(PIPELINE.get("fa2"), header="fmha/kernels/fwd_fa2_sm80.cuh",
               config_template="fmha::fa2::FwdConfig", launcher="fmha::fa2::launch_fwd",
               tile_constraints=_FWD_FA2_CONSTRAINTS,
               shared_memory=SharedMemory(lambda traits: _Q_AND_KV_RING,
                                          _q_and_kv_ring_bytes),
               uses_cutlass=False),
    ),
    template="fwd_instance.cu.j2",
    args="FwdArgs",
    registry="Fwd",
    exports=(Export("launch", "cudaError_t", "const FwdArgs&, cudaStream_t"),),
    row_lines=(("dtype", "hdim_q", "hdim_v"), ("mask", "bias"), ("vlayout", "mode"),
               ("lse", "dropout", "softcap")),
)


# ---- bwd -------------------------------------------------------------------------------------

def _warp_keys(hdim: tuple[int, int]) -> int:
    """Keys per warp (BwdConfig::kWarpKeys): 32 where dK and dV of 32 keys over half the head
    dims fit the registers (hdim_q + hdim_v <= 256, two warps sharing the keys), else 16."""
    return 32 if hdim[0] + hdim[1] <= 256 else 16


def _split_d(tile, hdim: tuple[int, int]) -> int:
    """Warps sharing a warp's keys (kSplitD): warps / (block_n / warp_keys), 1 or 2; each of
    two takes half the queries for S^T and half the head dims for dK and dV."""
    return tile.warps // (tile.block_n // _warp_keys(hdim))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _dq_rows_fit(tile, hdim_q: int, rows: int) -> bool:
    """BwdConfig's bwd_dq_rows_fit: dQ's tile (block_m x hdim_q) splits over the warps into
    row groups of `rows` and column groups of a multiple of 16 head-dim columns (the kernel
    takes 32 rows where they fit, else 16)."""
    if tile.block_m % rows or tile.warps % (tile.block_m // rows):
        return False
    col_groups = tile.warps // (tile.block_m // rows)
    return hdim_q % col_groups == 0 and hdim_q // col_groups % 16 == 0


# What fmha/kernels/bwd_fa2_sm80.cuh static_asserts (BwdConfig, and SmemTile for its shared-memory
# tiles), in its order: a warp owns warp_keys keys (block_n / warp_keys key slices), alone or
# with a second warp (split_d = 2).
_WARP_KEYS = "warp_keys = 32 if hdim_q + hdim_v <= 256 else 16"
_BWD_FA2_CONSTRAINTS = (
    TileConstraint(f"block_n % warp_keys == 0, warps % (block_n / warp_keys) == 0 and split_d = "
                   f"warps / (block_n / warp_keys) in {{1, 2}}, where {_WARP_KEYS} (16 or 32 "
                   f"keys per warp, shared by one or two warps)",
                   lambda tile, hdim: (tile.block_n % _warp_keys(hdim) == 0
                                       and tile.warps % (tile.block_n // _warp_keys(hdim)) == 0
                                       and _split_d(tile, hdim) in (1, 2))),
    TileConstraint(f"split_d == 2 where warp_keys == 32, {_WARP_KEYS} (32 keys per warp need "
                   f"two warps to share them: registers)",
                   lambda tile, hdim: _warp_keys(hdim) == 16 or _split_d(tile, hdim) == 2),
    TileConstraint("block_m % (16 * split_d) == 0 (a warp's queries come in m16 tiles)",
                   lambda tile, hdim: tile.block_m % (16 * _split_d(tile, hdim)) == 0),
    TileConstraint("warps % (block_m / r) == 0 and (hdim_q / (warps / (block_m / r))) % 16 == 0 "
                   "for r = 32 or r = 16 (dQ's tile is split over the warps as block_m / r row "
                   "groups times the rest along hdim_q, in warp tiles of 16-column multiples)",
                   lambda tile, hdim: any(_dq_rows_fit(tile, hdim[0], rows) for rows in (32, 16))),
    TileConstraint("block_m / split_d / 8 a power of two (a warp's n8 tiles of queries, which "
                   "stmatrix stores in pairs at XOR-stepped addresses)",
                   lambda tile, hdim: _is_power_of_two(tile.block_m // _split_d(tile, hdim) // 8)),
    TileConstraint("(hdim_q / split_d) % 16 == 0 and (hdim_v / split_d) % 16 == 0 (a warp's "
                   "share of dK and dV comes in pairs of n8 tiles)",
                   lambda tile, hdim: all(d % _split_d(tile, hdim) == 0
                                          and d // _split_d(tile, hdim) % 16 == 0 for d in hdim)),
    TileConstraint("hdim_q, hdim_v and block_m multiples of 32 (shared-memory tiles are made of "
                   "swizzle atoms of 32 or 64 columns: rows of K, V, Q, dO, and of dS^T, which "
                   "has block_m columns)",
                   lambda tile, hdim: all(d % 32 == 0 for d in (*hdim, tile.block_m))),
    TileConstraint("stages == 2 (Q and dO are double-buffered)",
                   lambda tile, hdim: tile.stages == 2),
)


def _bwd_fa2_smem_bytes(tile, traits: Traits) -> int:
    """BwdConfig::kSmemBytes: K and V of the CTA; per stage Q, dO and the LSE and D of each
    row; dS^T and, when split_d > 1, P^T."""
    hdim = _hdims(traits)
    both = hdim[0] + hdim[1]
    return (2 * tile.block_n * both
            + tile.stages * (2 * tile.block_m * both + 8 * tile.block_m)
            + 2 * tile.block_n * tile.block_m * (2 if _split_d(tile, hdim) > 1 else 1))


# What fmha/kernels/bwd_fa3_config_sm90.cuh static_asserts: one producer warpgroup feeds two
# consumer warpgroups through TMA. block_n 128 splits the keys between them (64 each: wgmma's
# M), block_n 64 splits the head dim (both take the same 64 keys, each half of dK's and dV's
# columns; with unequal head dims, the products instead): the config's work_split, WorkSplit::kKeys,
# kHeadDim or kProducts.
def _bwd_fa3_splits_head_dim(tile) -> bool:
    return tile.block_n == 64


def _bwd_fa3_wgmma_n(tile, hdim: tuple[int, int]) -> tuple[int, ...]:
    """A superset of BwdConfig's wgmma N extents (a spurious extended set costs only compile
    time; the config's static_assert catches a missing one): S^T's and dP^T's queries
    (block_m) and dK's, dV's and dQ's columns (the head dims), each whole or halved between
    the two consumer warpgroups, and with the products split 128 and hdim_q - 128."""
    whole = (tile.block_m, *hdim)
    return (*whole, *(n // 2 for n in whole), *((128, hdim[0] - 128) if hdim[0] > 128 else ()))


_BWD_FA3_CONSTRAINTS = (
    TileConstraint("block_n 128 (two consumer warpgroups of 64 keys: wgmma's M) or 64 (both on "
                   "the same 64 keys, each with half the head dim)",
                   lambda tile, hdim: tile.block_n in (64, 128)),
    TileConstraint("block_n 128: block_m 64 or 128 and block_m * (hdim_q + hdim_v) <= 16384 "
                   "(whole 128-byte swizzle atoms across dS^T's rows; S^T and dP^T of 64 x "
                   "block_m per warpgroup beside dK and dV in registers); block_n 64: block_m 64",
                   lambda tile, hdim: tile.block_m == 64 if _bwd_fa3_splits_head_dim(tile)
                   else tile.block_m in (64, 128) and tile.block_m * (hdim[0] + hdim[1]) <= 16384),
    TileConstraint("warps == 12 (one producer and two consumer warpgroups)",
                   lambda tile, hdim: tile.warps == 12),
    TileConstraint("stages == 2 (Q and dO are double-buffered)",
                   lambda tile, hdim: tile.stages == 2),
    TileConstraint("block_n 128: hdim_q and hdim_v multiples of 64, at most 128 (128-byte "
                   "swizzle atoms; dK and dV of 64 keys fit a consumer's registers); block_n 64: "
                   "hdim_q == hdim_v, 128 or 256 (each warpgroup's half is whole swizzle atoms), "
                   "or (192, 128) (warpgroup 0 computes dV and 128 columns of dK, warpgroup 1 "
                   "the other 64 and dQ)",
                   lambda tile, hdim: (hdim[0] == hdim[1] and hdim[0] in (128, 256))
                   or tuple(hdim) == (192, 128)
                   if _bwd_fa3_splits_head_dim(tile)
                   else all(d % 64 == 0 and d <= 128 for d in hdim)),
)


def _bwd_fa3_smem_bytes(tile, traits: Traits) -> int:
    """BwdConfig::kSmemBytes of bwd_fa3_config_sm90.cuh: K and V; per stage Q, dO and the LSE and D
    of each row; two dS^T buffers, and with the head-dim split two P^T buffers; one step's fp32
    dQ tile for the writer warp in two slices (of 128 columns each with the products split,
    none with the even head-dim split, whose consumers add dQ with atomics); the barriers and
    the 1024-byte alignment of TMA's tiles."""
    hdim = _hdims(traits)
    both = hdim[0] + hdim[1]
    split_head_dim = _bwd_fa3_splits_head_dim(tile)
    split_products = split_head_dim and hdim[0] != hdim[1]
    dq_slice_cols = 128 if split_products else 0 if split_head_dim else hdim[0] // 2
    return (2 * tile.block_n * both
            + tile.stages * (2 * tile.block_m * both + 8 * tile.block_m)
            + (4 if split_head_dim else 2) * 2 * tile.block_n * tile.block_m
            + 4 * tile.block_m * 2 * dq_slice_cols
            + _FA3_BARRIERS_AND_ALIGNMENT)


BWD = Operation(
    kind=OPERATION.get("bwd"),
    traits=BwdTraits,
    kernels=(
        # Three kernels per instance, launched in order by launch_bwd: the row sums
        # D = rowsum(dO * O), the dQ/dK/dV kernel, the fp32 dQ conversion. fa3: TMA, wgmma and
        # warp specialization, sm90a only.
        Kernel(PIPELINE.get("fa3"), header="fmha/kernels/bwd_fa3_sm90.cuh",
               config_template="fmha::fa3::BwdConfig", launcher="fmha::fa3::launch_bwd",
               tile_constraints=_BWD_FA3_CONSTRAINTS,
               shared_memory=SharedMemory(
                   lambda traits:
                   "2 * block_n * (hdim_q + hdim_v) + stages * (2 * block_m * (hdim_q + hdim_v) "
                   "+ 8 * block_m) + 4 * block_n * block_m + (block_n 128: 4 * block_m * hdim_q; "
                   "block_n 64: 4 * block_n * block_m, and with hdim_q != hdim_v 1024 * block_m) "
                   f"+ {_FA3_BARRIERS}",
                   _bwd_fa3_smem_bytes),
               uses_cutlass=True, workspace="fmha::fa3::bwd_workspace_bytes",
               padded_hdim_step=None, wgmma_n=_bwd_fa3_wgmma_n),
        # mma.sync, for sm80 and newer.
        Kernel(PIPELINE.get("fa2"), header="fmha/kernels/bwd_fa2_sm80.cuh",
               config_template="fmha::fa2::BwdConfig", launcher="fmha::fa2::launch_bwd",
               tile_constraints=_BWD_FA2_CONSTRAINTS,
               shared_memory=SharedMemory(
                   lambda traits:
                   "2 * block_n * (hdim_q + hdim_v) + stages * (2 * block_m * (hdim_q + hdim_v) "
                   "+ 8 * block_m) + 2 * block_n * block_m * (2 if split_d > 1 else 1)",
                   _bwd_fa2_smem_bytes),
               uses_cutlass=False, workspace="fmha::fa2::bwd_workspace_bytes"),
    ),
    template="bwd_instance.cu.j2",
    args="BwdArgs",
    registry="Bwd",
    exports=(Export("launch", "cudaError_t", "const BwdArgs&, cudaStream_t"),
             Export("workspace", "size_t", "const BwdArgs&")),
    row_lines=(("dtype", "hdim_q", "hdim_v"), ("mask", "bias", "mode"),
               ("dbias", "dropout", "softcap")),
)


# ---- kvcache ---------------------------------------------------------------------------------

# What fmha/kernels/kvcache_decode_split_kv.cuh needs of a tile. A CTA serves one K/V head of one
# sequence (and one split of its keys): its query rows are the new query tokens times the query
# heads sharing that K/V head, packed into one m16 fragment.
_DECODE_CONSTRAINTS = (
    TileConstraint("block_m == 16 (the packed query rows of one K/V head: one m16 fragment "
                   "that every warp shares)",
                   lambda tile, hdim: tile.block_m == 16),
    TileConstraint("block_n % (16 * warps) == 0 (the warps split each key tile in multiples of "
                   "16 keys, one MMA k-step)",
                   lambda tile, hdim: tile.block_n % (16 * tile.warps) == 0),
    TileConstraint("stages >= 2 (K and V stream through a cp.async ring)",
                   lambda tile, hdim: tile.stages >= 2),
    TileConstraint("hdim_q and hdim_v multiples of 32 (the shared-memory swizzle's atoms)",
                   lambda tile, hdim: all(d % 32 == 0 for d in hdim)),
)


# chunked_prefill::Config's SharedStorage (kvcache_chunked_prefill_sm90.cuh). A cache of the
# queries' 16-bit dtype: the fa3 forward's (_FWD_FA3_SHARED_MEMORY). An e4m3 cache
# (Traits.kv_element_size 1): the kernel computes in fp16, so Q (bf16 queries converted in the
# kernel) and the K and V stages the consumers read take 2 bytes an element; TMA lands the
# cache's tiles in staging stages of their own, a byte an element, which two producer warps
# widen into those (fmha/kernels/fwd_fa3_kv_widen_sm90.cuh): 3 bytes a K or V element a stage.
# O (the queries' dtype) takes a region of its own where it fits beside them under the arch's
# limit (the config's kSeparateO: SharedMemory.region_if_it_fits) and is staged over Q
# otherwise: d64 (192x128, 2 stages) 24 + 96 + 24 (O) + 1 KB; d128 (128x128, 2 stages) 32 +
# 192 + 1 KB, O over Q; d256's 128x80 tile, 64 + 240 KB, does not fit (instances.yaml prunes
# it).
def _chunked_prefill_smem_bytes(tile, traits: Traits) -> int:
    if traits.kv_element_size == 2:
        return _fwd_fa3_smem_bytes(tile, traits)
    hdim_q, hdim_v = _hdims(traits)
    return (2 * tile.block_m * hdim_q + 3 * tile.stages * tile.block_n * (hdim_q + hdim_v)
            + _FA3_BARRIERS_AND_ALIGNMENT)


def _chunked_prefill_o_region(tile, traits: Traits) -> int:
    """O's own region (16-bit elements) of an e4m3 cache's instances; none of a 16-bit cache's,
    whose formula is the forward's."""
    return 0 if traits.kv_element_size == 2 else 2 * tile.block_m * traits.hdim_v


def _chunked_prefill_smem_formula(traits: Traits) -> str:
    if traits.kv_element_size == 2:
        return _fwd_fa3_smem_formula(traits)
    return ("2 * block_m * hdim_q + 3 * stages * block_n * (hdim_q + hdim_v) (Q and the K/V "
            "stages in fp16, the e4m3 cache's staging stages a byte an element) + 2 * block_m * "
            "hdim_v (O in its own region where it fits under the arch's limit, else over Q: 0) "
            f"+ {_FA3_BARRIERS}, of an e4m3 cache widened to fp16")


_CHUNKED_PREFILL_SHARED_MEMORY = SharedMemory(_chunked_prefill_smem_formula,
                                              _chunked_prefill_smem_bytes,
                                              region_if_it_fits=_chunked_prefill_o_region)


_DECODE_SHARED_MEMORY = ("2 * block_m * hdim_q + kv_size * stages * block_n * (hdim_q + hdim_v) "
                         "+ 4 * (stages + 1) * block_n, kv_size 2, or 1 of an e4m3 cache")


def _decode_smem_bytes(tile, traits: Traits) -> int:
    """decode::Config::kSmemBytes of a paged instance: the Q tile (2-byte elements: the
    queries'), one K and one V tile per stage of the cache's kv_size-byte elements (its
    KTile and VTile are SmemTiles of hdim / kCacheElementsPer16Bit 16-bit columns: hdim *
    kv_size bytes a row), and the block-table entries of stages + 1 key tiles (int32; a
    contiguous instance has none)."""
    hdim, kv_size = _hdims(traits), traits.kv_element_size
    return (2 * tile.block_m * hdim[0]
            + kv_size * tile.stages * tile.block_n * (hdim[0] + hdim[1])
            + 4 * (tile.stages + 1) * tile.block_n)


KVCACHE = Operation(
    kind=OPERATION.get("kvcache"),
    traits=KvcacheTraits,
    kernels=(
        # The fa3 forward's kernel with K and V read from the cache by TMA (an e4m3 cache's
        # tiles widened to fp16 in shared memory), after the append kernel the decode pipeline
        # runs too; the forward's tiles and limits, and shared memory of its own for e4m3 caches.
        Kernel(PIPELINE.get("fa3"), header="fmha/kernels/kvcache_chunked_prefill_sm90.cuh",
               config_template="fmha::kvcache::chunked_prefill::Config",
               launcher="fmha::kvcache::chunked_prefill::launch",
               tile_constraints=_FWD_FA3_CONSTRAINTS,
               shared_memory=_CHUNKED_PREFILL_SHARED_MEMORY,
               uses_cutlass=True, workspace="fmha::kvcache::chunked_prefill::workspace_bytes",
               prefill=True, padded_hdim_step=None, wgmma_n=_fwd_fa3_wgmma_n),
        # An instance appends k_new/v_new to the cache (rotated, when asked), attends with a
        # CTA per key split, and combines the splits by their log-sum-exp; its workspace holds
        # the splits' partial results.
        Kernel(PIPELINE.get("fa2"), header="fmha/kernels/kvcache_decode_split_kv.cuh",
               config_template="fmha::kvcache::decode::Config",
               launcher="fmha::kvcache::decode::launch",
               tile_constraints=_DECODE_CONSTRAINTS,
               shared_memory=SharedMemory(lambda traits: _DECODE_SHARED_MEMORY,
                                          _decode_smem_bytes),
               uses_cutlass=False, workspace="fmha::kvcache::decode::workspace_bytes",
               padded_hdim_step=1, full_grid_tile=True),
    ),
    template="kvcache_instance.cu.j2",
    args="KvcacheArgs",
    registry="Kvcache",
    exports=(Export("launch", "cudaError_t", "const KvcacheArgs&, cudaStream_t"),
             Export("workspace", "size_t", "const KvcacheArgs&")),
    row_lines=(("dtype", "kv_dtype", "hdim_q", "hdim_v"), ("mask", "bias"), ("paged", "softcap")),
)


# Every operation, in schema.OPERATION's order: the order of the catalog, of --list and of the
# dispatch table's arrays.
OPERATIONS: dict[str, Operation] = {op.token: op for op in (FWD, BWD, KVCACHE)}
assert tuple(OPERATIONS) == OPERATION.tokens


def operation_of(item) -> Operation:
    """The operation of an instance, point or problem (their `op`), or of traits."""
    return OPERATIONS[(item.kind if isinstance(item, Traits) else item.op).token]
