"""The instance model: a kernel instance is a matrix point (what it computes, for which GPU and
sequence-length handling) plus the tile it runs with. Its name is derived here, once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .schema import (BIAS, BUILD_AXES, MASK, MODE, TRAIT_BOOL_AXES, VLAYOUT, Arch, DataType,
                     EnumValue, Pipeline)


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
    lse: bool  # writes the log-sum-exp of every row
    dropout: bool
    softcap: bool

    def value(self, axis: str):
        """The value on one of schema.CONDITION_AXES that is not a BUILD_AXES one."""
        return (self.hdim_q, self.hdim_v) if axis == "hdim" else getattr(self, axis)


@dataclass(frozen=True)
class MatrixPoint:
    """One point of the expanded matrix: the traits and how the kernel for them is built.
    Rules prune points; each surviving point gets a tile and becomes an Instance."""

    traits: FwdTraits
    pipeline: Pipeline
    arch: Arch
    pad_seqlen: bool  # False: the kernel needs seqlens that are multiples of its tile
    pad_hdim: bool  # True: it also runs head dims below its own that are multiples of 8

    def value(self, axis: str):
        """The value on one of schema.CONDITION_AXES: the point's own fields, or its traits'."""
        return getattr(self, axis) if axis in BUILD_AXES else self.traits.value(axis)


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
        """The identity of the instance, in a fixed order: fwd, dtype, head dims, the enum
        traits that differ from their defaults, the boolean traits that are on, pipeline, arch,
        tile, then `pad` for sequence-length and `hpad` for head-dim padding. E.g.
        fwd_bf16_d128_causal_alibi_col_group_lse_dropout_softcap_fa2_sm90a_m128n64_pad_hpad."""
        traits, point, tile = self.point.traits, self.point, self.tile
        hdim = (f"d{traits.hdim_q}" if traits.hdim_q == traits.hdim_v
                else f"d{traits.hdim_q}x{traits.hdim_v}")
        non_default = [value.token for axis, value in
                       ((MASK, traits.mask), (BIAS, traits.bias), (VLAYOUT, traits.vlayout),
                        (MODE, traits.mode))
                       if value.token != axis.name_default]
        flags = [axis for axis in TRAIT_BOOL_AXES if getattr(traits, axis)]
        padding = [token for token, on in (("pad", point.pad_seqlen), ("hpad", point.pad_hdim))
                   if on]
        return "_".join(["fwd", traits.dtype.token, hdim, *non_default, *flags,
                         point.pipeline.token, point.arch.token, f"m{tile.block_m}n{tile.block_n}",
                         *padding])


@dataclass(frozen=True)
class Condition:
    """Holds for a point, instance or traits whose value on `axis` is one of `values` (none of
    them, when negated); the shared atom of pruning rules (`when:`) and filter tokens
    (`axis=value`)."""

    axis: str
    values: frozenset
    negated: bool = False

    def admits(self, value) -> bool:
        return (value in self.values) != self.negated

    def holds(self, item: MatrixPoint | Instance | FwdTraits) -> bool:
        return self.admits(item.value(self.axis))
