"""The instance model: a kernel instance is a matrix point (what it computes, for which GPU and
sequence-length handling) plus the tile it runs with. Its name is derived here, once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .schema import BIAS, MASK, MODE, VLAYOUT, Arch, DataType, EnumValue, Pipeline


@dataclass(frozen=True)
class FwdTraits:
    """What a problem must match for an instance to run it; mirrors fmha::FwdTraits."""

    dtype: DataType
    hdim_q: int
    hdim_v: int
    mask: EnumValue
    bias: EnumValue
    vlayout: EnumValue
    mode: EnumValue


@dataclass(frozen=True)
class MatrixPoint:
    """One point of the expanded matrix: the traits and how the kernel for them is built.
    Rules prune points; each surviving point gets a tile and becomes an Instance."""

    traits: FwdTraits
    pipeline: Pipeline
    arch: Arch
    pad_seqlen: bool  # False: the kernel needs seqlens that are multiples of its tile

    def value(self, axis: str):
        """The value on one of schema.CONDITION_AXES: the point's own fields, or its traits'."""
        return getattr(self if axis in ("pipeline", "arch", "pad_seqlen") else self.traits, axis)


@dataclass(frozen=True)
class Tile:
    block_m: int  # query rows per CTA
    block_n: int  # key rows per main-loop step
    warps: int
    stages: int  # K/V tiles in flight in shared memory


@dataclass(frozen=True)
class Instance:
    point: MatrixPoint
    tile: Tile

    def value(self, axis: str):
        return self.point.value(axis)

    @cached_property
    def name(self) -> str:
        """The identity of the instance, in a fixed order: fwd, dtype, head dims, the traits
        that differ from their defaults, pipeline, arch, tile, and `pad` for padded kernels.
        E.g. fwd_bf16_d128_causal_fa2_sm90a_m128n64_pad."""
        traits, point, tile = self.point.traits, self.point, self.tile
        hdim = (f"d{traits.hdim_q}" if traits.hdim_q == traits.hdim_v
                else f"d{traits.hdim_q}x{traits.hdim_v}")
        non_default = [value.token for axis, value in
                       ((MASK, traits.mask), (BIAS, traits.bias), (VLAYOUT, traits.vlayout),
                        (MODE, traits.mode))
                       if value.token != axis.name_default]
        parts = ["fwd", traits.dtype.token, hdim, *non_default, point.pipeline.token,
                 point.arch.token, f"m{tile.block_m}n{tile.block_n}"]
        if point.pad_seqlen:
            parts.append("pad")
        return "_".join(parts)


@dataclass(frozen=True)
class Condition:
    """Holds for a point or instance whose value on `axis` is one of `values`; the shared atom of
    pruning rules (`when:`) and filter tokens (`axis=value`)."""

    axis: str
    values: frozenset

    def holds(self, item: MatrixPoint | Instance) -> bool:
        return item.value(self.axis) in self.values
