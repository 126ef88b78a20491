"""The instance model: a kernel instance is a matrix point (what it computes, for which GPU and
sequence-length handling) plus the tile it runs with. Its name is derived here, once.

Each operation has its own traits class (FwdTraits, BwdTraits, KvcacheTraits): the functional
traits a problem asks for, mirroring fmha.h's struct of the same name. Everything else (points,
instances, names, conditions) is the same for every operation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache, cached_property
from typing import ClassVar

from .schema import BUILD_AXES, ENUM_AXES, OPERATION, VLAYOUT, Arch, CacheType, DataType, \
    EnumValue, OperationKind, Pipeline


class _Absent:
    """The value of an axis that an operation does not have (lse of a bwd instance): no
    condition on that axis holds for it."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


@cache
def _axes(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in fields(cls))


class Traits:
    """What a problem must match for an instance to run it. Subclasses are frozen dataclasses
    whose fields, in order, are the operation's functional axes (dtype first, hdim_q and hdim_v,
    its enum and boolean traits), in the order of fmha.h's struct of the same name: they give
    the operation's matrix axes, instance names, dispatch rows (aggregate initializers of that
    struct) and manifest records their order."""

    kind: ClassVar[OperationKind]

    @classmethod
    def axes(cls) -> tuple[str, ...]:
        """The field names, in order."""
        return _axes(cls)

    def value(self, axis: str):
        """The value on one of schema.FILTER_AXES that is not a BUILD_AXES one; ABSENT for an
        axis this operation does not have."""
        if axis == "hdim":
            return self.hdim_q, self.hdim_v
        if axis == "op":
            return self.kind
        # Axis names are schema.FILTER_AXES: none of them names a method or a class variable.
        return getattr(self, axis, ABSENT)

    def flag(self, axis: str) -> bool:
        """A boolean trait, false for an operation without it (only the forward has lse)."""
        return getattr(self, axis, False)

    @property
    def kv_element_size(self) -> int:
        """The bytes of a K or V element as the kernels hold it in shared memory: the dtype's
        (a KV cache's may be narrower: KvcacheTraits); operations.SharedMemory reads it."""
        return self.dtype.size

    @property
    def v_rings(self) -> int:
        """The rings of V tiles the kernels keep in shared memory: one, V as the kernel reads
        it, but for the forward's e4m3 inputs with row-major V (FwdTraits);
        operations.SharedMemory reads it."""
        return 1


@dataclass(frozen=True)
class FwdTraits(Traits):
    """The forward's traits; mirrors fmha::FwdTraits."""

    kind: ClassVar[OperationKind] = OPERATION.get("fwd")

    dtype: DataType
    hdim_q: int
    hdim_v: int
    mask: EnumValue
    bias: EnumValue
    vlayout: EnumValue
    mode: EnumValue
    lse: bool  # writes the log-sum-exp of every row
    dropout: bool
    softcap: bool

    @property
    def v_rings(self) -> int:
        """2 of 1-byte (e4m3) inputs with row-major V: the 8-bit wgmma reads V only K-major
        (V^T, keys contiguous), so TMA lands row-major V tiles in a ring of their own and the
        producer warpgroup transposes each into a V^T ring, the consumers'. 1 otherwise: 16-bit
        V is read as it lies, and an e4m3 V^T is loaded as the consumers read it."""
        return 2 if self.dtype.size == 1 and self.vlayout == VLAYOUT.get("row") else 1


@dataclass(frozen=True)
class BwdTraits(Traits):
    """The backward's traits; mirrors fmha::BwdTraits. No V layout (it takes row-major V) and
    no lse (it always reads the forward's log-sum-exp)."""

    kind: ClassVar[OperationKind] = OPERATION.get("bwd")

    dtype: DataType
    hdim_q: int
    hdim_v: int
    mask: EnumValue
    bias: EnumValue
    mode: EnumValue
    dbias: bool  # writes the gradient of an elementwise bias
    dropout: bool
    softcap: bool


@dataclass(frozen=True)
class KvcacheTraits(Traits):
    """KV-cache attention's traits; mirrors fmha::KvcacheTraits. No mode (every sequence has its
    own cache length, on the device), no V layout, lse or dropout."""

    kind: ClassVar[OperationKind] = OPERATION.get("kvcache")

    dtype: DataType  # q's, k_new's, v_new's and the output's
    kv_dtype: CacheType  # the cache's: the same, or e4m3 with scales
    hdim_q: int
    hdim_v: int
    mask: EnumValue  # aligned bottom-right: the new query tokens are the sequence's last
    bias: EnumValue
    paged: bool  # the cache is in pages reached through a block table
    softcap: bool

    @property
    def kv_element_size(self) -> int:
        """The cache's: 1 of an e4m3 cache, whose tiles the decode kernel keeps in e4m3
        (decode::Config's kCacheElementsPer16Bit = 2 / sizeof(KvElement)) and the
        chunked-prefill kernel stages in e4m3 before widening them to fp16."""
        return self.kv_dtype.size_for(self.dtype)


@dataclass(frozen=True)
class MatrixPoint:
    """One point of an operation's expanded matrix: the traits and how the kernel for them is
    built. Rules prune points; each surviving point gets a tile and becomes an Instance."""

    traits: Traits
    pipeline: Pipeline
    arch: Arch
    pad_seqlen: bool  # False: the kernel needs seqlens that are multiples of its tile
    pad_hdim: bool  # True: it also runs head dims below its own (Operation.padded_hdim_step)

    @property
    def op(self) -> OperationKind:
        return self.traits.kind

    def value(self, axis: str):
        """The value on one of schema.FILTER_AXES: the point's own fields, or its traits'."""
        return getattr(self, axis) if axis in BUILD_AXES else self.traits.value(axis)


@dataclass(frozen=True)
class Tile:
    # fwd: query rows per CTA; bwd: query rows per step of the loop over queries; kvcache: query
    # rows per CTA, packed (the query tokens times the query heads of one K/V head)
    block_m: int
    # fwd and kvcache: key rows per main-loop step; bwd: keys per CTA (their K, V, dK and dV
    # stay on chip)
    block_n: int
    warps: int
    stages: int  # fwd and kvcache: K/V tiles in flight in shared memory; bwd: Q/dO tiles
    # kvcache (a kernel with Kernel.full_grid_tile): the tile of calls whose units (sequence,
    # K/V head, row block) alone fill every SM, with this tile's block_m; None: this one
    full_grid: Tile | None = None


@dataclass(frozen=True)
class Instance:
    point: MatrixPoint
    tile: Tile

    @property
    def op(self) -> OperationKind:
        return self.point.traits.kind

    def value(self, axis: str):
        return self.point.value(axis)

    @cached_property
    def name(self) -> str:
        """The identity of the instance, in a fixed order: the operation, then its traits in the
        order of its traits class (the dtype, the head dims, the enum traits that differ from
        their defaults, with their axis's name prefix, and the boolean traits that are on),
        pipeline, arch, tile, then `pad` for sequence-length and `hpad` for head-dim padding.
        E.g. fwd_bf16_d128_causal_alibi_col_group_lse_dropout_softcap_fa2_sm90a_m128n64_pad_hpad,
        bwd_fp16_d64_elementwise_dbias_fa2_sm80_m64n128,
        kvcache_bf16_kve4m3_d128_causal_paged_fa2_sm90a_m16n128_pad."""
        traits, point, tile = self.point.traits, self.point, self.tile
        spelled = []
        for axis in traits.axes():
            if axis == "hdim_q":
                spelled.append(f"d{traits.hdim_q}" if traits.hdim_q == traits.hdim_v
                               else f"d{traits.hdim_q}x{traits.hdim_v}")
                continue
            if axis == "hdim_v":
                continue
            value = getattr(traits, axis)
            if isinstance(value, bool):
                spelled += [axis] if value else []
            elif value.token != ENUM_AXES[axis].name_default:
                spelled.append(ENUM_AXES[axis].name_prefix + value.token)
        padding = [token for token, on in (("pad", point.pad_seqlen), ("hpad", point.pad_hdim))
                   if on]
        return "_".join([traits.kind.token, *spelled, point.pipeline.token, point.arch.token,
                         f"m{tile.block_m}n{tile.block_n}", *padding])


@dataclass(frozen=True)
class Condition:
    """Holds for a point, instance or traits whose value on `axis` is one of `values` (none of
    them, when negated); the shared atom of pruning rules (`when:`) and filter tokens
    (`axis=value`). It never holds for an item whose operation does not have the axis."""

    axis: str
    values: frozenset
    negated: bool = False

    def admits(self, value) -> bool:
        return (value in self.values) != self.negated

    def holds(self, item: MatrixPoint | Instance | Traits) -> bool:
        value = item.value(self.axis)
        return value is not ABSENT and self.admits(value)
