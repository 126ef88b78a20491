"""The generator's vocabulary, shared by every operation: each axis of the instance matrices, its
valid values, and how each value is spelled in C++.

This is the one place that knows both the YAML tokens and the C++ spellings of the traits
(runtime/include/fmha/fmha.h and registry.h), in the spirit of CUTLASS's `DataTypeTag` and CK's
`cpp_symbol_map.py`. Everything downstream (validation, instance names, the filter, the
templates, the token arrays of the dispatch table) reads from here, so a new value of an axis
is a line here, its enumerator in fmha.h, and its use in instances.yaml. What differs per
operation (its traits, kernels, templates, C++ table) is in operations.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union


@dataclass(frozen=True)
class EnumValue:
    """A value of an axis that is a C++ enum in fmha.h."""

    token: str  # spelling in instances.yaml, filters and instance names
    cpp: str  # the enumerator
    value: int  # the enumerator's integer value: its index in registry.h's token arrays


@dataclass(frozen=True)
class DataType(EnumValue):
    element: str  # the CUDA element type the kernel is instantiated with
    size: int  # sizeof(element)


@dataclass(frozen=True)
class CacheType(EnumValue):
    """What a KV cache holds (kvcache's kv_dtype axis)."""

    element: str | None  # the CUDA element type of the cache; None: the queries' (the dtype's)
    size: int | None  # sizeof(element); None: the queries' dtype's

    def element_for(self, dtype: DataType) -> str:
        """The cache's element type for queries of `dtype`."""
        return self.element or dtype.element

    def size_for(self, dtype: DataType) -> int:
        """The bytes of a cache element for queries of `dtype`: sizeof(element_for(dtype))."""
        return self.size or dtype.size


@dataclass(frozen=True)
class Arch:
    token: str
    cc: int  # compute capability as major*10+minor, as registry.h's arch_cc
    exact: bool  # an 'a' target carries features that exist only on exactly this cc
    gencode: str  # the nvcc flag that compiles an instance TU for this target
    smem_limit: int  # bytes of shared memory one CTA may opt into on the target's GPU


@dataclass(frozen=True)
class Pipeline:
    """A kernel design (fa2: mma.sync; fa3: TMA, wgmma and warp specialization). The token is
    shared by the operations it implements; what it means for each (for kvcache, fa2 is the
    split-KV decode kernel and fa3 chunked prefill) is stated once, in operations.py's module
    docstring, and how it implements each one (its header, config template, launcher, tile
    constraints) is that operation's (operations.Kernel)."""

    token: str


@dataclass(frozen=True)
class OperationKind:
    """What an instance computes (CUTLASS's OperationKind): the first word of its name, the
    `op` of filters and of the manifest. What an operation is made of is operations.py's."""

    token: str
    title: str


AxisValue = Union[EnumValue, Arch, Pipeline, OperationKind]


@dataclass(frozen=True)
class EnumAxis:
    """An axis whose values are a closed set of tokens."""

    name: str
    values: tuple[AxisValue, ...]
    # The value instance names leave out; None: the axis is always spelled.
    name_default: str | None = None
    # What instance names put before a value's token, where the token alone would not say
    # which axis it is of (kv_dtype's e4m3 is `kve4m3`: the cache's, not the queries'). Filters
    # take the prefixed token too, and where another axis has the bare one (dtype's e4m3), only
    # the prefixed one names this axis's value (selection._bare_values).
    name_prefix: str = ""

    def __iter__(self) -> Iterator[AxisValue]:
        return iter(self.values)

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(v.token for v in self.values)

    def get(self, token: str) -> AxisValue | None:
        return next((v for v in self.values if v.token == token), None)


# e4m3: float8 e4m3 inputs (torch.float8_e4m3fn) of the forward only, with descale factors
# (FwdArgs::q_descale, ...), and O in bf16; instances.yaml gives it to the fwd operation alone.
DTYPE = EnumAxis("dtype", (
    DataType("fp16", "fmha::DataType::kFP16", 0, element="__half", size=2),
    DataType("bf16", "fmha::DataType::kBF16", 1, element="__nv_bfloat16", size=2),
    DataType("e4m3", "fmha::DataType::kE4M3", 2, element="__nv_fp8_e4m3", size=1),
))

# What a KV cache holds: same, the queries' dtype; e4m3, float8 e4m3 with a dequantization
# scale per tensor, K/V head or sequence and K/V head (KvcacheArgs::k_scale/v_scale).
KV_DTYPE = EnumAxis("kv_dtype", (
    CacheType("same", "fmha::KvCacheDtype::kSame", 0, element=None, size=None),
    CacheType("e4m3", "fmha::KvCacheDtype::kE4M3", 1, element="__nv_fp8_e4m3", size=1),
), name_default="same", name_prefix="kv")

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

# Newest first: where instances of two pipelines both serve a problem on the same arch, the
# dispatcher runs the newer pipeline's (dispatch.PREFERENCE). Which operations a pipeline
# implements, and how, is in operations.py.
PIPELINE = EnumAxis("pipeline", (Pipeline("fa3"), Pipeline("fa2")))

# sm80 also embeds compute_80 PTX, so newer GPUs without their own target can still JIT it.
# The shared-memory limits are the opt-in maxima per CTA of A100 (163 KB) and H100/H200 (227 KB).
ARCH = EnumAxis("arch", (
    Arch("sm80", cc=80, exact=False, gencode="-gencode=arch=compute_80,code=[sm_80,compute_80]",
         smem_limit=166912),
    Arch("sm90a", cc=90, exact=True, gencode="-gencode=arch=compute_90a,code=sm_90a",
         smem_limit=232448),
))

# The operations (operations.OPERATIONS describes each); `op` in filters, --explain and the
# rules that several operations share.
OPERATION = EnumAxis("op", (
    OperationKind("fwd", "the forward pass"),
    OperationKind("bwd", "the backward pass: dQ, dK, dV (and dbias) of a forward call"),
    OperationKind("kvcache", "KV-cache attention (decode): new query tokens against the keys a "
                             "cache holds, appending new keys first"),
))

ENUM_AXES: dict[str, EnumAxis] = {
    axis.name: axis for axis in (OPERATION, DTYPE, KV_DTYPE, MASK, BIAS, VLAYOUT, MODE, PIPELINE,
                                 ARCH)}

# The enum axes of the traits of fmha.h (FwdTraits, BwdTraits, KvcacheTraits), whose tokens
# registry.h holds indexed by enumerator value.
REGISTRY_TOKEN_ARRAYS: dict[str, EnumAxis] = {
    "kDataTypeTokens": DTYPE,
    "kKvCacheDtypeTokens": KV_DTYPE,
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
# Functional traits a problem asks for (fmha::FwdTraits, BwdTraits, KvcacheTraits): lse is the
# forward's (it writes the log-sum-exp), dbias the backward's (it writes the bias gradient),
# paged kvcache's (the cache is in pages reached through a block table), dropout the forward's
# and the backward's, softcap every operation's. pad_seqlen and pad_hdim are capabilities of an
# instance: which shapes it also runs.
TRAIT_BOOL_AXES = ("lse", "dbias", "paged", "dropout", "softcap")
BOOL_AXES = (*TRAIT_BOOL_AXES, "pad_seqlen", "pad_hdim")

# Every axis of some operation's matrix, in instance-name order; `hdim` lists (hdim_q, hdim_v)
# pairs. An operation has a subsequence of them (operations.Operation.matrix_axes): the fields
# of its traits class (hdim for hdim_q and hdim_v), then BUILD_AXES.
MATRIX_AXES = ("dtype", "kv_dtype", "hdim", "mask", "bias", "vlayout", "mode", "lse", "dbias",
               "paged", "dropout", "softcap", "pipeline", "arch", "pad_seqlen", "pad_hdim")


def with_head_dims(axes: tuple[str, ...]) -> tuple[str, ...]:
    """Axes as conditions may name them: `hdim`, then each of its head dims alone."""
    at = axes.index("hdim") + 1
    return (*axes[:at], "hdim_q", "hdim_v", *axes[at:])


def head_dims_joined(fields: tuple[str, ...]) -> tuple[str, ...]:
    """A traits class's fields with hdim_q and hdim_v as one `hdim`, where hdim_q was."""
    return tuple("hdim" if field == "hdim_q" else field for field in fields if field != "hdim_v")


# The axes a rule's `when:` and a filter's `axis=value` can name: the matrix axes, with `hdim`
# also as its two head dims.
CONDITION_AXES = with_head_dims(MATRIX_AXES)
# The condition axes that say how and for which GPU an instance is built, which every operation
# has; the others are the functional traits a problem asks for.
BUILD_AXES = ("pipeline", "arch", "pad_seqlen", "pad_hdim")
# What a filter's `axis=value` can name: the operation too.
FILTER_AXES = ("op", *CONDITION_AXES)
