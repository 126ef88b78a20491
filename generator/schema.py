"""The generator's vocabulary: every axis of the instance matrix, its valid values, and how each
value is spelled in C++.

This is the one place that knows both the YAML tokens and the C++ contract
(runtime/include/fmha/fmha.h and registry.h), in the spirit of CUTLASS's `DataTypeTag` and CK's
`cpp_symbol_map.py`. Everything downstream (validation, instance names, the filter, the
templates, the token arrays of the dispatch table) reads from here, so a new value of an axis
is a line here, its enumerator in fmha.h, and its use in instances.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union


@dataclass(frozen=True)
class EnumValue:
    """A value of an axis that is a C++ enum in fmha.h."""

    token: str  # spelling in instances.yaml, filters and instance names
    cpp: str  # the enumerator
    value: int  # the enumerator's integer value: its index in registry.h's token arrays


@dataclass(frozen=True)
class DataType(EnumValue):
    element: str  # the CUDA element type the kernel is instantiated with


@dataclass(frozen=True)
class Arch:
    token: str
    cc: int  # compute capability as major*10+minor, as registry.h's arch_cc
    exact: bool  # an 'a' target carries features that exist only on exactly this cc
    gencode: str  # the nvcc flag that compiles an instance TU for this target
    smem_limit: int  # bytes of shared memory one CTA may opt into on the target's GPU


@dataclass(frozen=True)
class TileConstraint:
    """A condition a pipeline's kernel places on its tile; `reason` is shown when it fails."""

    reason: str
    holds: Callable[[Any, tuple[int, int]], bool]  # (model.Tile, (hdim_q, hdim_v)) -> ok


@dataclass(frozen=True)
class SharedMemory:
    """How much shared memory a pipeline's CTA takes for a tile, checked against each arch's
    limit so that an oversized tile is reported at its line instead of failing at launch."""

    formula: str  # the same in words, for the error message
    bytes: Callable[[Any, tuple[int, int]], int]  # (model.Tile, (hdim_q, hdim_v)) -> bytes


@dataclass(frozen=True)
class Pipeline:
    token: str
    header: str  # the kernel header an instance TU includes
    config_template: str  # class template taking the instance's compile-time parameters
    launcher: str  # function template launching the kernel for one config
    tile_constraints: tuple[TileConstraint, ...]
    shared_memory: SharedMemory
    # The header includes CuTe/CUTLASS (<cute/...>, <cutlass/...>): the build adds their include
    # directory to this pipeline's TUs only, and needs it only when it compiles one.
    uses_cutlass: bool


AxisValue = Union[EnumValue, Arch, Pipeline]


@dataclass(frozen=True)
class EnumAxis:
    """An axis whose values are a closed set of tokens."""

    name: str
    values: tuple[AxisValue, ...]
    # The value instance names leave out; None: the axis is always spelled.
    name_default: str | None = None

    def __iter__(self) -> Iterator[AxisValue]:
        return iter(self.values)

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(v.token for v in self.values)

    def get(self, token: str) -> AxisValue | None:
        return next((v for v in self.values if v.token == token), None)


DTYPE = EnumAxis("dtype", (
    DataType("fp16", "fmha::DataType::kFP16", 0, element="__half"),
    DataType("bf16", "fmha::DataType::kBF16", 1, element="__nv_bfloat16"),
))

# causal and window are aligned top-left or bottom-right at run time (FwdArgs::mask_align), so
# the alignment is not an axis.
MASK = EnumAxis("mask", (
    EnumValue("none", "fmha::MaskType::kNone", 0),
    EnumValue("causal", "fmha::MaskType::kCausal", 1),
    EnumValue("window", "fmha::MaskType::kWindow", 2),
), name_default="none")

BIAS = EnumAxis("bias", (
    EnumValue("none", "fmha::BiasType::kNone", 0),
    EnumValue("elementwise", "fmha::BiasType::kElementwise", 1),
    EnumValue("alibi", "fmha::BiasType::kAlibi", 2),
), name_default="none")

# col: V stored transposed, (hdim_v, seqlen_k) with the sequence contiguous.
VLAYOUT = EnumAxis("vlayout", (
    EnumValue("row", "fmha::VLayout::kRowMajor", 0),
    EnumValue("col", "fmha::VLayout::kColMajor", 1),
), name_default="row")

# group: FlashAttention's varlen, sequences packed along one token dimension.
MODE = EnumAxis("mode", (
    EnumValue("batch", "fmha::Mode::kBatch", 0),
    EnumValue("group", "fmha::Mode::kGroup", 1),
), name_default="batch")

# What fmha/kernels/fwd_fa2_sm80.cuh static_asserts, checked here too so that a bad tile is
# reported at its line in instances.yaml instead of deep inside an nvcc run.
_FA2_CONSTRAINTS = (
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


def _q_and_kv_ring_bytes(tile, hdim: tuple[int, int]) -> int:
    """The Q region (it also stages O in the epilogue, so it fits the wider head dim) and one K
    and one V tile per stage, of 2-byte elements."""
    return 2 * (tile.block_m * max(hdim) + tile.stages * tile.block_n * (hdim[0] + hdim[1]))


# FwdConfig::kSmemBytes of fwd_fa2_sm80.cuh.
_FA2_SHARED_MEMORY = SharedMemory(_Q_AND_KV_RING, _q_and_kv_ring_bytes)

# What fmha/kernels/fwd_fa3_sm90.cuh static_asserts: one producer warpgroup (4 warps) feeds
# block_m / 64 consumer warpgroups through TMA, and each consumer issues wgmma on its 64 rows.
_FA3_CONSTRAINTS = (
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
# the 1024-byte alignment that 128-byte-swizzled TMA tiles need.
_FA3_BARRIERS_AND_ALIGNMENT = 1024
_FA3_SHARED_MEMORY = SharedMemory(
    f"{_Q_AND_KV_RING} + {_FA3_BARRIERS_AND_ALIGNMENT} (barriers and alignment)",
    lambda tile, hdim: _q_and_kv_ring_bytes(tile, hdim) + _FA3_BARRIERS_AND_ALIGNMENT)

# Newest first: where instances of two pipelines both serve a problem on the same arch, the
# dispatcher runs the newer pipeline's (dispatch.PREFERENCE).
PIPELINE = EnumAxis("pipeline", (
    Pipeline("fa3", header="fmha/kernels/fwd_fa3_sm90.cuh", config_template="fmha::fa3::FwdConfig",
             launcher="fmha::fa3::launch_fwd", tile_constraints=_FA3_CONSTRAINTS,
             shared_memory=_FA3_SHARED_MEMORY, uses_cutlass=True),
    Pipeline("fa2", header="fmha/kernels/fwd_fa2_sm80.cuh", config_template="fmha::fa2::FwdConfig",
             launcher="fmha::fa2::launch_fwd", tile_constraints=_FA2_CONSTRAINTS,
             shared_memory=_FA2_SHARED_MEMORY, uses_cutlass=False),
))

# sm80 also embeds compute_80 PTX, so newer GPUs without their own target can still JIT it.
# The shared-memory limits are the opt-in maxima per CTA of A100 (163 KB) and H100/H200 (227 KB).
ARCH = EnumAxis("arch", (
    Arch("sm80", cc=80, exact=False, gencode="-gencode=arch=compute_80,code=[sm_80,compute_80]",
         smem_limit=166912),
    Arch("sm90a", cc=90, exact=True, gencode="-gencode=arch=compute_90a,code=sm_90a",
         smem_limit=232448),
))

ENUM_AXES: dict[str, EnumAxis] = {
    axis.name: axis for axis in (DTYPE, MASK, BIAS, VLAYOUT, MODE, PIPELINE, ARCH)}

# The enum axes of fmha::FwdTraits, whose tokens registry.h holds indexed by enumerator value.
REGISTRY_TOKEN_ARRAYS: dict[str, EnumAxis] = {
    "kDataTypeTokens": DTYPE,
    "kMaskTokens": MASK,
    "kBiasTokens": BIAS,
    "kVLayoutTokens": VLAYOUT,
    "kModeTokens": MODE,
}

INT_AXES = ("hdim_q", "hdim_v")
# How filters and --explain problems spell an integer: ASCII digits (str.isdigit() also takes
# '²', which int() rejects, and \d takes every script's digits), at most 9 of them, so that it
# fits a C++ int and int() never meets Python's limit on the length of a number.
INTEGER = "[0-9]{1,9}"
# lse, dropout and softcap are functional traits (fmha::FwdTraits): a problem asks for them.
# pad_seqlen and pad_hdim are capabilities of an instance: which shapes it also runs.
TRAIT_BOOL_AXES = ("lse", "dropout", "softcap")
BOOL_AXES = (*TRAIT_BOOL_AXES, "pad_seqlen", "pad_hdim")

# The axes a rule's `when:` and a filter's `axis=value` can name, in instance-name order; `hdim`
# is the (hdim_q, hdim_v) pair.
CONDITION_AXES = ("dtype", "hdim", "hdim_q", "hdim_v", "mask", "bias", "vlayout", "mode", "lse",
                  "dropout", "softcap", "pipeline", "arch", "pad_seqlen", "pad_hdim")
# The condition axes that say how and for which GPU an instance is built; the others are the
# functional traits a problem asks for.
BUILD_AXES = ("pipeline", "arch", "pad_seqlen", "pad_hdim")

# The axes of `matrix:` in instances.yaml, in its order; `hdim` lists (hdim_q, hdim_v) pairs.
MATRIX_AXES = ("dtype", "hdim", "mask", "bias", "vlayout", "mode", "lse", "dropout", "softcap",
               "pipeline", "arch", "pad_seqlen", "pad_hdim")
