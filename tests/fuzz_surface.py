"""The problems of tests/test_fuzz_surface.py (no input crashes the process), and the
worker that runs them; the test starts this file in subprocesses and judges what they report.

A problem is one call of fmha's public surface, drawn from random.Random(seed) alone, with a
one-line description:

- fmha.fwd in batch and group (varlen) mode, fmha.bwd, and autograd through fmha.fwd (inputs
  that require grad, then .backward());
- fmha.select/explain, select_bwd/explain_bwd and select_kvcache/explain_kvcache (with a
  `capability=` keyword, where one of them takes it);
- fmha.fwd_kvcache on contiguous and paged caches, of q's dtype or FP8 (e4m3, with k_scale and
  v_scale), with appended k/v, rotary embeddings, cache_batch_idx and cache_leftpad;
- fmha.dropout_mask;
- fmha.integrations.transformers: attention_forward (with a stand-in attention module that has
  is_causal) and padding_mask; fmha.integrations.sdpa: register(), then
  F.scaled_dot_product_attention (and its backward), then unregister();
- the example programs fmha_fwd and fmha_bwd of the build directory FMHA_EXAMPLES_DIR, with a
  random argv, garbage included (skipped without FMHA_EXAMPLES_DIR).

A draw starts from a valid call. About a third of the problems stay valid; the others get one
to three corruptions, a few get many: a wrong dtype (float32, float64, int32, int64, bool,
float8), rank, size or layout (transposed, step-sliced, expanded with stride 0, one element off
a 16-byte boundary, the last dim not contiguous), a device other than the rest's, an empty or a
huge size (meta tensors or expand(): more than 2**31 elements, or a size of 2**31 and more),
NaN and Inf, a non-tensor where a tensor goes and a tensor where a number goes, an option out
of range, and inconsistent cu_seqlens, max_seqlen, seqused, block_table, cache_seqlens and the
like. The tensors allocated are a few MB at most; the huge ones are meta tensors or expanded.

With a GPU most problems use CUDA tensors, and valid ones run: drawn from the traits of a
compiled instance this GPU runs (fmha.instances(), bwd_instances(), kvcache_instances()) or
from traits outside the build, which miss. Without one, problems use CPU and meta tensors,
which reach every check but the device's, and, for fmha.fwd and fmha.bwd, fake CUDA tensors
(FakeTensorMode, as torch.compile traces them), which pass it.

    python tests/fuzz_surface.py --first S --count N [--jsonl PATH]

runs problems S .. S + N - 1 in one process and writes two JSON lines per problem (to PATH,
else to stdout), each flushed at once: {"seed", "surface", "start": description} before the
call, so that a process killed by a signal leaves the problem it was running identifiable, and
{"seed", "outcome", "message", ...} after it. The outcome is "result", the class name of the
exception raised, "exit N" (an example program's exit status), "ExampleCrash" (an example
program killed by a signal or past its timeout), "HarnessError" (this file could not make the
problem: its own bug) or "skipped". After a CUDA error (an illegal memory access, a misaligned
address: the CUDA context is dead) the worker stops with exit status 3. A seed names the same
problem on machines alike: the number of GPUs torch sees changes the devices drawn.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import inspect
import json
import math
import os
import random
import re
import resource
import signal
import subprocess
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fmha
from fmha.integrations import sdpa as fmha_sdpa
from fmha.integrations import transformers as fmha_transformers
from gpu_support import device_cc, runs_here

MESSAGE_CHARS = 300
# The worker's data segment (malloc, torch's CPU allocator) is capped, so that a call that
# copies a huge expanded tensor fails to allocate instead of taking the machine's memory; the
# example programs inherit the cap. (RLIMIT_AS would also count the address space that CUDA
# reserves, and break it.)
MEMORY_LIMIT_BYTES = 8 << 30
# Elements of the storage behind a tensor the generator allocates: a few MB at most. Meta and
# fake tensors allocate nothing, and huge sizes are views of small storages (expand()).
MAX_STORAGE = 1 << 22
EXAMPLE_TIMEOUT_S = 60
# GPU memory a worker keeps cached between problems; past it, the cache is given back.
CACHED_GPU_BYTES = 4 << 30
# A CUDA error after which the context is dead (or a launch that should not have happened). Out
# of memory is not one.
DEVICE_FAULT = re.compile(r"CUDA error|illegal memory access|misaligned address|illegal "
                          r"instruction|unspecified launch failure|device-side assert",
                          re.IGNORECASE)
DEVICE_FAULT_EXIT = 3
# A message the C++ runtime stopped formatting halfway: a key without its value, or one that
# ends in "got" or "of". A libstdc++ mismatch, where it does not crash: the first integer formatted into a
# std::ostringstream bound to another libstdc++ than the one that made it fails the stream;
# so does a null C string.
GARBLED = re.compile(r"\w=(?=\s|$)|\b(?:got|of)\s*$")

HALF = (torch.float16, torch.bfloat16)
WRONG_DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bool]
WRONG_DTYPES += [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2")
                 if hasattr(torch, name)]
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
               torch.float64: "f64", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
               torch.bool: "bool", torch.uint8: "u8"}
INSTANCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MULTIPLES_OF_8 = (8, 16, 32, 40, 64, 72, 96, 128, 160, 192, 256)
# What goes where a tensor should.
NON_TENSORS = (None, 3, 2.5, "q", [1, 2], (4, 4), True, float("nan"))
# Sizes no fmha size may have: fmha::FwdArgs and KvcacheArgs hold them as int.
HUGE_SIZES = (2**31, 2**31 + 8, 2**32, 2**40)
NAN, INF = float("nan"), float("inf")


class HarnessError(Exception):
    """This file could not make a problem it drew: its own bug, not fmha's."""


class ExampleCrash(Exception):
    """An example program died by a signal or ran past EXAMPLE_TIMEOUT_S."""


@dataclass(frozen=True)
class Machine:
    """What the draws depend on besides the seed: the GPUs, the compiled instances they run,
    and the example programs' build directory."""

    gpus: int
    fwd_instances: tuple = ()
    bwd_instances: tuple = ()
    kvcache_instances: tuple = ()
    instance_names: tuple = ()
    examples: Optional[Path] = None

    @property
    def cuda(self) -> bool:
        return self.gpus > 0

    @classmethod
    def detect(cls) -> "Machine":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        fwd, bwd, kvcache = fmha.instances(), fmha.bwd_instances(), fmha.kvcache_instances()
        # The calls drawn are 16-bit (INSTANCE_DTYPES): not the e4m3 forward's instances.
        fwd = [i for i in fwd if i["dtype"] in INSTANCE_DTYPES]

        def here(instances) -> tuple:
            return tuple(i for i in instances if runs_here(i, device_cc(torch))) if gpus else ()

        examples = os.environ.get("FMHA_EXAMPLES_DIR")
        return cls(gpus, here(fwd), here(bwd), here(kvcache),
                   tuple(sorted(i["name"] for i in (*fwd, *bwd, *kvcache))),
                   Path(examples) if examples else None)


# ---- tensors to make -------------------------------------------------------------------------


@dataclass
class Spec:
    """A tensor to make when the problem runs: its shape, dtype and device, the layout of its
    storage (_layout; `arg` is the layout's parameter), and its values: random ones (with a few
    NaN or Inf where `special` says so) or the given nested list."""

    shape: tuple
    dtype: torch.dtype
    device: str = "cpu"
    layout: str = "contiguous"
    arg: int = 0
    values: Optional[list] = None
    special: str = ""
    grad: bool = False
    seed: int = 0

    def __str__(self) -> str:
        text = f"{DTYPE_NAMES.get(self.dtype, str(self.dtype).replace('torch.', ''))}"
        text += f"{list(self.shape)}".replace(" ", "")
        if self.device != "cpu":
            text += f"@{self.device}"
        if self.layout != "contiguous":
            text += f":{self.layout}" + (str(self.arg) if self.arg else "")
        if self.values is not None:
            text += "=" + _short(str(self.values).replace(" ", ""), 40)
        if self.special:
            text += f"!{self.special}"
        return text + ("+grad" if self.grad else "")

    def reshape(self, shape: tuple) -> None:
        """A new shape: the given values no longer fit, random ones take their place."""
        self.shape, self.values = tuple(shape), None

    def storage(self) -> int:
        return math.prod(self._layout()[0])

    def _layout(self) -> tuple[tuple, Callable[[torch.Tensor], torch.Tensor]]:
        """(the storage's shape, the view of it that is this tensor)."""
        shape, rank, arg, kind = tuple(self.shape), len(self.shape), self.arg, self.layout
        if kind == "transposed" and rank >= 2:  # e.g. a (b, h, s, d) tensor's transpose(1, 2)
            i, j = (rank - 3, rank - 2) if rank >= 3 else (0, 1)
            base = list(shape)
            base[i], base[j] = base[j], base[i]
            return tuple(base), lambda t: t.transpose(i, j)
        if kind in ("stepped", "lastnc") and rank >= 1:  # every other element of one dim
            dim = rank - 1 if kind == "lastnc" else arg % rank
            base = list(shape)
            base[dim] *= 2
            index = (slice(None),) * dim + (slice(None, None, 2),)
            return tuple(base), lambda t: t[index]
        if kind == "expanded" and rank >= 1:  # stride 0 along the dims of the bitmask arg
            dims = {i for i in range(rank) if arg >> i & 1} or {0}
            # (A dim of size 0 stays 0: no values fill a storage row of it.)
            return (tuple(min(n, 1) if i in dims else n for i, n in enumerate(shape)),
                    lambda t: t.expand(shape))
        if kind == "offset":  # `arg` elements past the storage's (aligned) start
            return (math.prod(shape) + arg,), lambda t: t[arg:].view(shape)
        if kind == "rows" and rank >= 1:  # the first columns of rows `arg` elements wide
            return (*shape[:-1], max(arg, shape[-1])), lambda t: t[..., :shape[-1]]
        if kind == "vt" and rank in (3, 4):  # V^T stored: the sequence dim contiguous
            seq = shape[-3]
            rows = max(arg, seq)
            if rank == 4:
                b, _, h, dim = shape
                return (b, h, dim, rows), lambda t: t[..., :seq].permute(0, 3, 1, 2)
            _, h, dim = shape
            return (h, dim, rows), lambda t: t[..., :seq].permute(2, 0, 1)
        return shape, lambda t: t

    def build(self, fake: bool) -> torch.Tensor:
        base_shape, view = self._layout()
        if self.device == "meta":  # nothing to fill: no memory behind it
            t = view(torch.empty(base_shape, dtype=self.dtype, device="meta"))
        elif fake:
            # Fake CUDA tensors on a torch without CUDA take no indexing: the view's strides
            # are taken from a meta tensor's.
            like = view(torch.empty(base_shape, dtype=self.dtype, device="meta"))
            t = torch.empty(base_shape, dtype=self.dtype, device=self.device).as_strided(
                like.shape, like.stride(), like.storage_offset())
        else:
            if math.prod(base_shape) > MAX_STORAGE:
                raise HarnessError(f"{self} needs a storage of {base_shape}")
            t = view(self._filled(base_shape, view).to(self.device))
        if self.grad and t.dtype.is_floating_point:
            t = t.detach().requires_grad_()
        return t

    def _filled(self, base_shape: tuple, view) -> torch.Tensor:
        if self.values is not None:
            full = torch.tensor(self.values, dtype=torch.float64 if self.dtype.is_floating_point
                                else torch.int64).to(self.dtype)
            base = torch.full(base_shape, -7).to(self.dtype)  # -7 between the entries
            if self.layout == "expanded":
                base.copy_(full[tuple(slice(0, n) for n in base_shape)])
            else:
                view(base).copy_(full)
            return base
        generator = torch.Generator().manual_seed(self.seed)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, base_shape, generator=generator).bool()
        if not self.dtype.is_floating_point:
            return torch.randint(-8, 300, base_shape, generator=generator).to(self.dtype)
        x = torch.randn(base_shape, generator=generator)
        if self.special and x.numel():
            spots = torch.randint(x.numel(), (max(1, x.numel() // 64),), generator=generator)
            x.view(-1)[spots] = NAN if self.special == "nan" else INF
            x.view(-1)[spots[::2]] *= -1
        return x.to(self.dtype)

    def fit(self) -> None:
        """Makes a tensor of this shape possible, and a real one cheap: a view (expand()) of a
        storage of at most MAX_STORAGE elements."""
        # torch counts elements in an int64, and refuses sizes whose product passes it even
        # where another size is 0
        while math.prod(max(n, 1) for n in self.shape) >= 2**62:
            largest = max(range(len(self.shape)), key=lambda i: self.shape[i])
            self.reshape(self.shape[:largest] + (1,) + self.shape[largest + 1:])
        if self.device == "meta" or self.storage() <= MAX_STORAGE:
            return
        self.values = None
        self.layout = "expanded"
        self.arg = sum(1 << i for i, n in enumerate(self.shape) if n > 8)
        if self.storage() > MAX_STORAGE:
            self.arg = (1 << len(self.shape)) - 1


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe(value) -> str:
    """A value as a description shows it: one line, short."""
    if isinstance(value, Spec):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value).replace("'", "")
    if isinstance(value, (str, bytes)) and len(value) > 24:
        return f"{value[:12]!r}*{len(value)}"
    return _short(repr(value).replace("\n", " "), 60)


# ---- a call being drawn ----------------------------------------------------------------------


@dataclass
class Call:
    """A call being drawn: its arguments by name (Specs for tensors), `positional` the names
    passed by position; `dims` the sizes of the valid call it started as, for the corruptions;
    `notes` the corruptions applied."""

    api: str
    positional: tuple
    args: dict
    dims: SimpleNamespace = field(default_factory=SimpleNamespace)
    fake: bool = False
    notes: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return not self.notes

    def specs(self, names=None) -> list[str]:
        return [n for n, v in self.args.items()
                if isinstance(v, Spec) and (names is None or n in names)]

    def describe(self) -> str:
        parts = [describe(self.args[n]) for n in self.positional]
        parts += [f"{n}={describe(v)}" for n, v in self.args.items() if n not in self.positional]
        extra = "".join(f" {k}={describe(v)}" for k, v in self.extra.items())
        how = "valid" if self.valid else "corrupted: " + ", ".join(self.notes)
        return f"{'fake ' if self.fake else ''}{self.api}({', '.join(parts)}){extra} [{how}]"

    def materialized(self) -> tuple[list, dict]:
        """The positional and keyword arguments, with tensors made."""
        made = {}
        for name, value in self.args.items():
            try:
                made[name] = value.build(self.fake) if isinstance(value, Spec) else value
            except HarnessError:
                raise
            except Exception as exc:
                raise HarnessError(f"making {name}={value}: {exc!r}") from exc
        return [made.pop(n) for n in self.positional], made

    def mode(self):
        return FakeTensorMode() if self.fake else contextlib.nullcontext()


@dataclass
class Problem:
    """A drawn problem: what it calls, how, and what its outcome must be. expect: "result" for
    a valid call that runs (it returns, or raises MissingInstanceError for traits the build
    lacks), "device" for a valid call on a CPU or meta device (it stops at the device check),
    None for anything clear. token: what an exception's message must name. torch_may_reject:
    torch's own checks run first (SDPA), and what they raise is torch's."""

    surface: str
    description: str
    run: Callable[[], Any]
    expect: Optional[str] = None
    token: str = "fmha."
    torch_may_reject: bool = False


class Draw:
    """One problem's random choices: random.Random(seed), the machine, and the problem's home
    device (every tensor of a valid call is on it; `fake`: under FakeTensorMode)."""

    def __init__(self, seed: int, machine: Machine):
        self.rng = random.Random(seed)
        self.machine = machine
        self.device = "cpu"
        self.fake = False

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def pick(self, options):
        options = list(options)
        return options[self.rng.randrange(len(options))]

    def weighted(self, options: dict):
        return self.rng.choices(list(options), weights=list(options.values()))[0]

    def size(self, top: int = 300) -> int:
        """A sequence length in [0, top], short ones likelier."""
        kind = self.weighted({"zero": 3, "short": 40, "medium": 40, "long": 17})
        return {"zero": 0, "short": self.rng.randint(1, min(16, top)),
                "medium": self.rng.randint(1, min(128, top)),
                "long": self.rng.randint(1, top)}[kind]

    def spec(self, shape, dtype, **kwargs) -> Spec:
        kwargs.setdefault("device", self.device)
        return Spec(tuple(shape), dtype, seed=self.rng.getrandbits(31), **kwargs)

    def values(self, values, dtype=torch.int32, **kwargs) -> Spec:
        shape = []
        level = values
        while isinstance(level, list):
            shape.append(len(level))
            level = level[0] if level else None
        return self.spec(shape, dtype, values=values, **kwargs)

    def home(self, fake_ok: bool) -> None:
        """Draws the problem's device: mostly the GPU where there is one; else CPU, meta and
        (where the API is a torch.library op) fake CUDA tensors."""
        if self.machine.cuda:
            options = {"cuda": 70, "cpu": 10, "meta": 8, "fake": 12 if fake_ok else 0}
        else:
            options = {"cpu": 45, "meta": 25, "fake": 30 if fake_ok else 0}
        device = self.weighted(options)
        self.fake = device == "fake"
        self.device = "cuda" if self.fake else device

    def other_device(self, current: str) -> str:
        # A fake cuda:1 needs either no GPU or two (FakeTensorMode initializes the devices).
        cuda = self.machine.cuda or self.fake
        second = self.machine.gpus >= 2 or (self.fake and not self.machine.cuda)
        options = ["cpu", "meta", *(["cuda"] if cuda else []), *(["cuda:1"] if second else [])]
        return self.pick([o for o in options if o != current] or options)

    def expect(self, call: Call) -> Optional[str]:
        if not call.valid:
            return None
        return "result" if self.device.startswith("cuda") else "device"


def _instance(d: Draw, instances: tuple, **traits) -> Optional[dict]:
    """A compiled instance this GPU runs with these traits, most of the time for a call on the
    GPU, so that valid calls launch; else None: traits drawn freely, which the build may lack."""
    if not (d.device.startswith("cuda") and not d.fake and d.chance(0.6)):
        return None
    fitting = [i for i in instances if all(i.get(k) == v for k, v in traits.items())]
    return d.pick(fitting) if fitting else None


def _head_dims(d: Draw, inst: Optional[dict]) -> tuple[int, int]:
    if inst is not None:
        dq, dv = inst["hdim_q"], inst["hdim_v"]
        if inst.get("pad_hdim") and d.chance(0.5):  # a smaller head dim, served padded
            small = d.rng.randint(1, dq)
            return small, small if dq == dv else d.rng.randint(1, dv)
        return dq, dv
    dq = d.pick(MULTIPLES_OF_8) if d.chance(0.7) else d.rng.randint(1, 256)
    if d.chance(0.8):
        return dq, dq
    return dq, d.pick(MULTIPLES_OF_8) if d.chance(0.5) else d.rng.randint(1, 256)


def _row_layout(d: Draw, width: int) -> dict:
    """A layout the kernels take for a (..., seq, heads, width) tensor."""
    kind = d.weighted({"contiguous": 6, "transposed": 3, "rows": 1})
    return dict(layout=kind, arg=-(-width // 8) * 8 + d.pick((0, 8)) if kind == "rows" else 0)


def _maybe_special(d: Draw, call: Call) -> None:
    """NaN and Inf are valid values: put some into one float tensor of a valid call."""
    floats = [n for n in call.specs() if call.args[n].dtype.is_floating_point]
    if floats and d.chance(0.1):
        call.args[d.pick(floats)].special = d.pick(("nan", "inf"))


def _prefix_sums(lengths) -> list:
    sums = [0]
    for n in lengths:
        sums.append(sums[-1] + n)
    return sums


# ---- fmha.fwd, fmha.bwd, select/explain ------------------------------------------------------


def draw_attention(d: Draw, api: str, group: bool) -> Call:
    """A valid call: api is "fwd", "bwd" (with dout, out and lse), or a select/explain of either
    (fwd's or bwd's arguments without dout, out, lse and instance)."""
    backward = api in ("bwd", "select_bwd", "explain_bwd")
    describes = api not in ("fwd", "bwd")
    pool = d.machine.bwd_instances if backward else d.machine.fwd_instances
    inst = _instance(d, pool, mode="group" if group else "batch")
    # A backward instance has no V layout: that trait is drawn for it.
    trait = lambda key, draw: inst[key] if inst and key in inst else draw()  # noqa: E731

    dtype = INSTANCE_DTYPES[inst["dtype"]] if inst else d.pick(HALF)
    dq, dv = _head_dims(d, inst)
    mask = trait("mask", lambda: d.weighted({"none": 5, "causal": 3, "window": 2}))
    bias = trait("bias", lambda: d.weighted({"none": 7, "elementwise": 2, "alibi": 1}))
    vlayout = trait("vlayout", lambda: d.pick(("row",) * 6 + ("col",)))
    col_major = not backward and vlayout == "col"
    dropout = trait("dropout", lambda: d.chance(0.1))
    softcap = trait("softcap", lambda: d.chance(0.1))

    b = d.weighted({0: 1, 1: 8, 2: 6, 3: 4})
    hk = d.rng.randint(1, 3)
    hq = hk * d.rng.randint(1, 3)
    dims = SimpleNamespace(group=group, b=b, hq=hq, hk=hk, dq=dq, dv=dv)
    if group:
        dims.lens_q = [d.size(128) for _ in range(b)]
        dims.lens_k = [d.size(128) for _ in range(b)]
        # Tokens past the last sequence are allowed (a packed buffer with room to spare).
        dims.sq = sum(dims.lens_q) + (d.rng.randint(1, 8) if d.chance(0.15) else 0)
        dims.sk = sum(dims.lens_k) + (d.rng.randint(1, 8) if d.chance(0.15) else 0)
        dims.max_q, dims.max_k = max(dims.lens_q, default=0), max(dims.lens_k, default=0)
        lead_q, lead_k = (dims.sq,), (dims.sk,)
    else:
        dims.sq, dims.sk = d.size(), d.size()
        dims.max_q, dims.max_k = dims.sq, dims.sk
        lead_q, lead_k = (b, dims.sq), (b, dims.sk)

    args = {"q": d.spec((*lead_q, hq, dq), dtype, **_row_layout(d, dq)),
            "k": d.spec((*lead_k, hk, dq), dtype, **_row_layout(d, dq))}
    if col_major:
        args["v"] = d.spec((*lead_k, hk, dv), dtype, layout="vt",
                           arg=-(-dims.sk // 8) * 8 + d.pick((0, 8)))
    else:
        args["v"] = d.spec((*lead_k, hk, dv), dtype, **_row_layout(d, dv))
    positional = ("q", "k", "v")
    if api == "bwd":
        out_shape = (*lead_q, hq, dv)
        lse_shape = (hq, dims.sq) if group else (b, hq, dims.sq)
        args = {"dout": d.spec(out_shape, dtype, **_row_layout(d, dv)), **args,
                "out": d.spec(out_shape, dtype), "lse": d.spec(lse_shape, torch.float32)}
        positional = ("dout", "q", "k", "v", "out", "lse")

    if mask == "causal":
        args["causal"] = True
    elif mask == "window":
        causal = d.chance(0.3)
        left = d.pick((-1, d.rng.randint(0, dims.max_k + 20)))
        right = d.pick((-1, 0)) if causal else d.pick((-1, d.rng.randint(0, dims.max_k + 20)))
        if left == right == -1:
            left = d.rng.randint(0, 64)
        if causal:
            args["causal"] = True
        args["window_size"] = (left, right)
    if d.chance(0.5):
        args["mask_align"] = d.pick(("top_left", "bottom_right"))
    target = (b, hq, dims.max_q, dims.max_k)
    if bias == "elementwise":
        rank = d.rng.randint(2, 4)
        shape = [1 if d.chance(0.3) else n for n in target[4 - rank:]]
        name = d.pick(("bias", "attn_mask"))
        bias_dtype = dtype if name == "bias" or d.chance(0.5) else torch.bool
        args[name] = d.spec(shape, bias_dtype)
    elif bias == "alibi":
        args["alibi_slopes"] = d.spec(d.pick(((hq,), (b, hq))), torch.float32)
    if not backward and trait("lse", lambda: d.chance(0.4)):
        args["return_lse"] = True
    if dropout:
        args["dropout_p"] = d.pick((0.1, 0.5, 0.9, round(d.rng.random() * 0.99, 3)))
        if backward or d.chance(0.5):  # the backward needs the forward's seed
            args["dropout_seed"] = d.rng.randrange(2**64)
        if d.chance(0.5):
            args["dropout_offset"] = d.rng.randrange(2**32)
    if softcap:
        args["softcap"] = d.pick((1.0, 30.0, 50.0, round(d.rng.uniform(0.01, 100), 3)))
    if d.chance(0.3):
        args["softmax_scale"] = round(d.rng.uniform(0.01, 2.0), 4)
    for name, lens in (("seqused_q", "lens_q"), ("seqused_k", "lens_k")):
        if d.chance(0.1):
            limits = getattr(dims, lens) if group else [getattr(dims, "s" + name[-1])] * b
            args[name] = d.values([d.rng.randint(0, n) for n in limits])
    if group:
        args.update(cu_seqlens_q=d.values(_prefix_sums(dims.lens_q)),
                    cu_seqlens_k=d.values(_prefix_sums(dims.lens_k)),
                    max_seqlen_q=dims.max_q, max_seqlen_k=dims.max_k)
    if api == "bwd":
        if d.chance(0.3):
            args["deterministic"] = True
        additive = args.get("bias") or (args.get("attn_mask") if bias == "elementwise" and
                                        args["attn_mask"].dtype != torch.bool else None)
        if additive is not None and d.chance(0.5):
            args["return_dbias"] = True
    elif describes and backward and d.chance(0.2):
        args["deterministic"] = True
    if inst and inst.get("pad_seqlen") and not describes and d.chance(0.15):
        args["instance"] = inst["name"]  # padded lengths: it runs any length
    call = Call(f"fmha.{api}", positional, args, dims, fake=d.fake)
    _maybe_special(d, call)
    return call


# ---- fmha.fwd_kvcache, select_kvcache, explain_kvcache ---------------------------------------


def draw_kvcache(d: Draw, api: str) -> Call:
    """A valid call of fwd_kvcache (api "fwd_kvcache") or of select/explain_kvcache."""
    inst = _instance(d, d.machine.kvcache_instances)
    # A backward instance has no V layout: that trait is drawn for it.
    trait = lambda key, draw: inst[key] if inst and key in inst else draw()  # noqa: E731
    dtype = INSTANCE_DTYPES[inst["dtype"]] if inst else d.pick(HALF)
    # An FP8 cache (torch.float8_e4m3fn, with k_scale and v_scale): head dims of whole 16-byte
    # pieces of 16 elements, rows a multiple of 16 apart.
    e4m3 = trait("kv_dtype", lambda: d.pick(("same",) * 4 + ("e4m3",))) == "e4m3"
    if e4m3 and inst is None:
        dq = dv = d.pick((16, 32, 64, 96, 128, 192, 256))
    else:
        dq, dv = _head_dims(d, inst)
    cache_dtype, piece = (torch.float8_e4m3fn, 16) if e4m3 else (dtype, 8)
    mask = trait("mask", lambda: d.weighted({"none": 5, "causal": 4, "window": 2}))
    alibi = trait("bias", lambda: d.pick(("none",) * 8 + ("alibi",))) == "alibi"
    paged = trait("paged", lambda: d.chance(0.45))
    softcap = trait("softcap", lambda: d.chance(0.1))

    b = d.rng.randint(1, 3)
    hk = d.rng.randint(1, 3)
    hq = hk * d.rng.randint(1, 3)
    sq = d.rng.randint(1, 8) if d.chance(0.7) else max(1, d.size())
    capacity = d.rng.randint(1, 300)
    dims = SimpleNamespace(b=b, hq=hq, hk=hk, dq=dq, dv=dv, sq=sq, paged=paged)
    args = {"q": d.spec((b, sq, hq, dq), dtype, **_row_layout(d, dq))}
    if paged:
        page = d.pick((1, 3, 8, 16, 64, 256))
        pages = -(-capacity // page)
        capacity = pages * page
        pool = b * pages + d.rng.randint(0, 4)
        table = d.rng.sample(range(pool), b * pages)
        dims.pages, dims.page, dims.pool = pages, page, pool
        cache_shape = (pool, page, hk)
    else:
        dims.b_cache = b + (d.rng.randint(0, 2) if d.chance(0.3) else 0)
        cache_shape = (dims.b_cache, capacity, hk)
    dims.capacity = capacity
    cache_layout = d.pick(("contiguous",) * 3 + ("rows",))
    args["k_cache"] = d.spec((*cache_shape, dq), cache_dtype, layout=cache_layout,
                             arg=-(-dq // piece) * piece + piece)
    args["v_cache"] = d.spec((*cache_shape, dv), cache_dtype, layout=cache_layout,
                             arg=-(-dv // piece) * piece + piece)
    if e4m3:
        for name in ("k_scale", "v_scale"):
            args[name] = d.spec(d.pick(((), (1,), (hk,), (b, hk))), torch.float32)
    new = 0 if d.chance(0.5) else d.rng.randint(1, min(16, capacity))
    dims.new = new
    if new:
        args["k"] = d.spec((b, new, hk, dq), dtype, **_row_layout(d, dq))
        args["v"] = d.spec((b, new, hk, dv), dtype, **_row_layout(d, dv))
    seqlens = [d.rng.randint(0, capacity - new) for _ in range(b)]
    args["cache_seqlens"] = d.values(seqlens)
    if paged:
        args["block_table"] = d.values([table[i * pages:(i + 1) * pages] for i in range(b)])
    else:
        if d.chance(0.2) or dims.b_cache > b:
            args["cache_batch_idx"] = d.values(d.rng.sample(range(dims.b_cache), b))
        if d.chance(0.15):
            args["cache_leftpad"] = d.values([d.rng.randint(0, n) for n in seqlens])
    if new and dq >= 2 and d.chance(0.25):
        half = d.rng.randint(1, dq // 2)
        args["rotary_cos"] = d.spec((capacity, half), dtype)
        args["rotary_sin"] = d.spec((capacity, half), dtype)
        if d.chance(0.5):
            args["rotary_interleaved"] = True
    if mask == "causal":
        args["causal"] = True
    elif mask == "window":
        args["causal"] = d.chance(0.5)
        right = d.pick((-1, 0)) if args["causal"] else d.pick((-1, d.rng.randint(0, 64)))
        args["window_size"] = (d.rng.randint(0, capacity + 8), right)
    if softcap:
        args["softcap"] = d.pick((1.0, 30.0, round(d.rng.uniform(0.01, 100), 3)))
    if alibi:
        args["alibi_slopes"] = d.spec(d.pick(((hq,), (b, hq))), torch.float32)
    if d.chance(0.3):
        args["softmax_scale"] = round(d.rng.uniform(0.01, 2.0), 4)
    if d.chance(0.3):
        args["num_splits"] = d.rng.randint(0, 8)
    if d.chance(0.4):
        args["return_lse"] = True
    if inst and inst.get("pad_seqlen") and api == "fwd_kvcache" and d.chance(0.15):
        args["instance"] = inst["name"]
    call = Call(f"fmha.{api}", ("q", "k_cache", "v_cache", *(("k", "v") if new else ())), args,
                dims, fake=False)
    _maybe_special(d, call)
    return call


# ---- corruptions -----------------------------------------------------------------------------

CORRUPTIONS: dict[str, list] = {}


def corruption(*families: str):
    """Registers a corruption, fn(d, call) -> bool (False: it did not apply), for calls of these
    families."""
    def register(fn):
        for family in families:
            CORRUPTIONS.setdefault(family, []).append(fn)
        return fn
    return register


def corrupt(d: Draw, call: Call, *families: str) -> Call:
    """Applies none (a valid call), one to three, or many corruptions of these families, then
    fits every tensor into a small storage."""
    count = d.weighted({0: 32, 1: 30, 2: 16, 3: 10, 5: 7, 8: 5})
    pool = [fn for family in families for fn in CORRUPTIONS[family]]
    for _ in range(count * 3):  # tries, as some corruptions do not apply to every call
        if len(call.notes) >= count:
            break
        fn = d.pick(pool)
        if fn(d, call) is not False:
            call.notes.append(fn.__name__)
    for name in call.specs():
        call.args[name].fit()
    return call


def _some_spec(d: Draw, call: Call, names=None) -> Optional[Spec]:
    names = call.specs(names)
    return call.args[d.pick(names)] if names else None


@corruption("attention", "kvcache", "hf", "sdpa")
def wrong_dtype(d, call):
    spec = _some_spec(d, call)
    if spec is None:
        return False
    spec.dtype = d.pick([t for t in (*WRONG_DTYPES, *HALF) if t != spec.dtype])


@corruption("attention", "kvcache", "hf", "sdpa")
def wrong_rank(d, call):
    spec = _some_spec(d, call)
    if spec is None:
        return False
    shape = list(spec.shape)
    if shape and d.chance(0.5):
        del shape[d.rng.randrange(len(shape))]
    else:
        shape.insert(d.rng.randrange(len(shape) + 1), d.rng.randint(1, 3))
    spec.reshape(shape)


@corruption("attention", "kvcache", "hf", "sdpa")
def wrong_size(d, call):
    spec = _some_spec(d, call)
    if spec is None or not spec.shape:
        return False
    shape = list(spec.shape)
    dim = d.rng.randrange(len(shape))
    n = shape[dim]
    shape[dim] = d.pick([s for s in (0, 1, n + 1, max(n - 1, 0), 2 * n, d.rng.randint(0, 300))
                         if s != n] or [n + 1])
    spec.reshape(shape)


@corruption("attention", "kvcache", "hf", "sdpa")
def empty(d, call):
    spec = _some_spec(d, call)
    if spec is None or not spec.shape:
        return False
    shape = list(spec.shape)
    shape[d.rng.randrange(len(shape))] = 0
    spec.reshape(shape)


@corruption("attention", "kvcache", "sdpa")  # transformers always passes tensors
def not_a_tensor(d, call):
    names = call.specs()
    if not names:
        return False
    call.args[d.pick(names)] = d.pick(NON_TENSORS)


@corruption("attention", "kvcache", "hf", "sdpa")
def layout(d, call):
    spec = _some_spec(d, call)
    if spec is None or not spec.shape:
        return False
    rank = len(spec.shape)
    spec.layout = d.pick(("transposed", "stepped", "expanded", "offset", "lastnc", "rows", "vt"))
    spec.arg = {"stepped": d.rng.randrange(rank), "expanded": d.rng.randrange(1, 1 << rank),
                "offset": d.pick((1, 2, 3, 8)), "rows": spec.shape[-1] + d.pick((1, 3, 4, 8)),
                "vt": spec.shape[-3] + d.pick((0, 1, 8)) if rank >= 3 else 0,
                }.get(spec.layout, 0)


@corruption("attention", "kvcache", "hf", "sdpa")
def mixed_devices(d, call):
    spec = _some_spec(d, call)
    if spec is None:
        return False
    spec.device = d.other_device(spec.device)


@corruption("attention", "kvcache", "hf", "sdpa")
def nan_inf(d, call):
    floats = [n for n in call.specs() if call.args[n].dtype.is_floating_point]
    if not floats:
        return False
    call.args[d.pick(floats)].special = d.pick(("nan", "inf"))


@corruption("attention", "kvcache", "hf", "sdpa")
def huge(d, call):
    """A size of 2**31 or more (meta or expanded), or more than 2**31 elements with every size
    below it (expanded along the sequence: the offsets of the output pass 2**31)."""
    spec = _some_spec(d, call)
    if spec is None or not spec.shape:
        return False
    shape = list(spec.shape)
    if d.chance(0.5) or len(shape) < 3:
        dim = d.rng.randrange(len(shape))
        shape[dim] = d.pick(HUGE_SIZES)
    else:
        dim = len(shape) - 3
        rest = math.prod(shape) // max(shape[dim], 1)
        if rest == 0:
            return False
        shape[dim] = 2**31 // rest + 1
    spec.reshape(shape)
    if d.chance(0.4) and not call.fake:
        spec.device = "meta"
    else:
        spec.layout, spec.arg = "expanded", 1 << dim


def _set_heads(call: Call, names, heads: int) -> None:
    for name in names:
        spec = call.args.get(name)
        if isinstance(spec, Spec) and len(spec.shape) >= 2:
            shape = list(spec.shape)
            shape[-2] = heads
            spec.reshape(shape)


@corruption("attention", "kvcache", "hf")
def heads(d, call):
    dims = call.dims
    if not hasattr(dims, "hq"):
        return False
    if d.chance(0.25):
        _set_heads(call, ("q", "query"), 0)
        return
    if "key" in call.args:
        names = ("key", "value")
    elif "k_cache" in call.args:
        names = ("k_cache", "v_cache", "k", "v")
    else:
        names = ("k", "v")
    _set_heads(call, names, d.pick((0, dims.hq + 1, 5 if dims.hq % 5 else 7, 2**16)))


@corruption("attention", "kvcache", "hf")
def head_dim(d, call):
    names = [n for n in ("q", "k", "v", "k_cache", "v_cache", "query", "key", "value")
             if isinstance(call.args.get(n), Spec)]
    if not names:
        return False
    size = d.pick((0, 7, 13, 257, 260, 264, 300, 512, 1024, 65544))
    chosen = d.pick((names, [n for n in names if n in ("q", "k", "k_cache", "query", "key")],
                     [d.pick(names)]))
    for name in chosen:
        spec = call.args[name]
        spec.reshape((*spec.shape[:-1], size))


# Bad values of the options, by name; a callable draws one (a tensor where a number goes).
OPTION_VALUES = {
    "causal": (1, 0, None, "True", 1.0, lambda d: d.values(True, torch.bool)),
    "softmax_scale": (0, 0.0, -1.0, NAN, INF, -INF, "0.1", True, 5e-324, 1e308, [1.0], 2**70,
                      lambda d: d.values(0.5, torch.float32)),
    "window_size": ((-2, 0), (0, -5), (2**31, 0), (0, 2**31), (2**31 - 1, 2**31 - 1), (1.5, 2),
                    (1, 2, 3), 4, None, "(-1,-1)", [-1, -1], [3, 3], (True, False), (-1, 2**63),
                    (NAN, 0), (), (-1,), "causal+right"),
    "mask_align": (0, "bottom-right", "", None, "TOP_LEFT", ["top_left"]),
    "softcap": (-1.0, NAN, INF, -INF, "30", None, True, 1e308, 5e-324, 2**70),
    "dropout_p": (-0.1, 1.0, 1.5, NAN, INF, None, "0.1", True, 0.999999,
                  lambda d: d.values(0.1, torch.float32)),
    "dropout_seed": (-1, 2**64, 2**64 - 1, 2**100, 1.5, "1", True, -2**63,
                     lambda d: d.values(7, torch.int64)),
    "dropout_offset": (-1, 2**32, 2**32 - 1, 2**70, None, 1.5, True),
    "return_lse": (1, None, "yes", 0),
    "deterministic": (1, None, "no"),
    "return_dbias": (1, "yes", None, True),
    "instance": ("", "nope", "x" * 5000, "fwd\x00", 3, b"name", "other"),
    "num_splits": (-1, 2**31, 1.5, True, None, 10**6, 2**63),
    "rotary_interleaved": (1, None, "no"),
}
OPTIONS_OF = {
    "fwd": ("causal", "softmax_scale", "window_size", "mask_align", "softcap", "dropout_p",
            "dropout_seed", "dropout_offset", "return_lse", "instance"),
    "bwd": ("causal", "softmax_scale", "window_size", "mask_align", "softcap", "dropout_p",
            "dropout_seed", "dropout_offset", "deterministic", "return_dbias", "instance"),
    "kvcache": ("causal", "softmax_scale", "window_size", "softcap", "num_splits",
                "return_lse", "rotary_interleaved", "instance"),
}


def _options_of(call: Call) -> tuple:
    api = call.api.split(".")[-1]
    if "kvcache" in api:
        names = OPTIONS_OF["kvcache"]
    else:
        names = OPTIONS_OF["bwd" if "bwd" in api else "fwd"]
    if api not in ("fwd", "bwd", "fwd_kvcache"):  # select and explain take no instance
        names = tuple(n for n in names if n != "instance")
    return names


@corruption("attention", "kvcache")
def bad_option(d, call):
    name = d.pick(_options_of(call))
    value = d.pick(OPTION_VALUES[name])
    if callable(value):
        value = value(d)
    if value == "causal+right":  # causal with a window reaching right of the diagonal
        call.args["causal"] = True
        value = (d.pick((-1, 4)), d.rng.randint(1, 64))
    elif value == "other":  # a compiled instance of another operation, or the same one
        if not d.machine.instance_names:
            return False
        value = d.pick(d.machine.instance_names)
    call.args[name] = value


@corruption("attention")
def bad_bias(d, call):
    dims = call.dims
    target = (dims.b, dims.hq, dims.max_q, dims.max_k)
    dtype = call.args["q"].dtype if isinstance(call.args.get("q"), Spec) else torch.float16
    kind = d.pick(("dtype", "shape", "rank5", "scalar", "both", "alibi+bias", "alibi shape",
                   "alibi dtype", "mask int", "not a tensor", "device", "huge", "lastnc",
                   "all masked"))
    good = d.spec([1 if d.chance(0.3) else n for n in target], dtype)
    for name in ("bias", "attn_mask", "alibi_slopes"):
        call.args.pop(name, None)
    if kind == "dtype":
        call.args["bias"] = d.spec(good.shape, d.pick((torch.float32, torch.bool, *HALF)))
    elif kind == "shape":
        shape = list(good.shape)
        shape[d.rng.randrange(4)] += d.pick((1, 2, 5))
        call.args[d.pick(("bias", "attn_mask"))] = d.spec(shape, dtype)
    elif kind == "rank5":
        call.args["bias"] = d.spec((1, *good.shape), dtype)
    elif kind == "scalar":
        call.args["bias"] = d.spec((), dtype)
    elif kind == "both":
        call.args.update(bias=good, attn_mask=d.spec(good.shape, torch.bool))
    elif kind == "alibi+bias":
        call.args.update(bias=good, alibi_slopes=d.spec((dims.hq,), torch.float32))
    elif kind == "alibi shape":
        call.args["alibi_slopes"] = d.spec(d.pick(((dims.hq + 1,), (dims.b + 1, dims.hq),
                                                   (dims.hq, 1), ())), torch.float32)
    elif kind == "alibi dtype":
        call.args["alibi_slopes"] = d.spec((dims.hq,), d.pick((torch.float64, *HALF)))
    elif kind == "mask int":
        call.args["attn_mask"] = d.spec(good.shape, torch.int32)
    elif kind == "not a tensor":
        call.args[d.pick(("bias", "attn_mask", "alibi_slopes"))] = d.pick(((0.5,), 1.0, "x"))
    elif kind == "device":
        call.args["bias"] = d.spec(good.shape, dtype, device=d.other_device(d.device))
    elif kind == "huge":  # the full shape, at stride 0: valid
        call.args["bias"] = d.spec(target, dtype, layout="expanded", arg=15)
    elif kind == "lastnc":
        call.args["attn_mask"] = d.spec(good.shape, dtype, layout="lastnc")
    else:  # every key masked: rows that see no key
        call.args["attn_mask"] = d.values(False, torch.bool)


@corruption("attention")
def bad_seqused(d, call):
    dims = call.dims
    name = d.pick(("seqused_q", "seqused_k"))
    top = dims.max_q if name == "seqused_q" else dims.max_k
    kind = d.pick(("dtype", "shape", "2-d", "stepped", "device", "list", "negative", "beyond"))
    entries = [d.rng.randint(0, top) for _ in range(dims.b)]
    spec = d.values(entries)
    if kind == "dtype":
        spec.dtype = d.pick((torch.int64, torch.float32, torch.int16))
    elif kind == "shape":
        spec = d.values(entries + [0])
    elif kind == "2-d":
        spec = d.values([[n] for n in entries]) if entries else d.values([[0]])
    elif kind == "stepped":
        spec.layout = "stepped"
    elif kind == "device":
        spec.device = d.other_device(d.device)
    elif kind == "list":
        spec = entries
    elif kind == "negative":
        spec = d.values([-1 - n for n in entries])
    else:  # the caller's contract: entries past the sequence's length
        spec = d.values([n + d.pick((1, 64, 2**31 - 1 - n)) for n in entries])
    call.args[name] = spec


@corruption("group")
def bad_cu_seqlens(d, call):
    dims = call.dims
    name, lens, total = d.pick((("cu_seqlens_q", dims.lens_q, dims.sq),
                                ("cu_seqlens_k", dims.lens_k, dims.sk)))
    entries = _prefix_sums(lens)
    kind = d.pick(("dtype", "device", "length", "empty", "2-d", "decreasing", "negative",
                   "beyond", "stepped", "list", "missing"))
    spec = d.values(entries)
    if kind == "dtype":
        spec.dtype = d.pick((torch.int64, torch.float32, torch.bool, torch.uint8))
    elif kind == "device":
        spec.device = d.other_device(d.device)
    elif kind == "length":
        spec = d.values(entries + [entries[-1]] * d.rng.randint(1, 3) if d.chance(0.5)
                        else entries[:-1] or [0, 0])
    elif kind == "empty":
        spec = d.spec((0,), torch.int32)
    elif kind == "2-d":
        spec = d.values([[n] for n in entries])
    elif kind == "decreasing":
        spec = d.values(entries[::-1] if len(entries) > 1 else [5, 0])
    elif kind == "negative":
        spec = d.values([-n - 1 for n in entries])
    elif kind == "beyond":  # the caller's contract: offsets past the packed tokens
        spec = d.values(entries[:-1] + [total + d.pick((1, 100, 2**31 - 1 - total))])
    elif kind == "stepped":
        spec.layout = "stepped"
    elif kind == "list":
        spec = entries
    else:
        spec = None
    call.args[name] = spec


@corruption("group")
def bad_max_seqlen(d, call):
    dims = call.dims
    name, longest = d.pick((("max_seqlen_q", dims.max_q), ("max_seqlen_k", dims.max_k)))
    value = d.pick((0, -1, max(longest - 1, 0), 2**31, 2**40, 1.5, True, None, "5",
                    d.values(longest, torch.int64)))
    call.args[name] = value


@corruption("attention")
def mode_mix(d, call):
    """Group-mode arguments in a batch-mode call and the reverse."""
    if call.dims.group:
        spec = call.args.get("q")
        if not isinstance(spec, Spec):
            return False
        spec.reshape((1, *spec.shape))
    elif d.chance(0.5):
        call.args[d.pick(("max_seqlen_q", "max_seqlen_k"))] = d.pick((16, 0))
    else:
        call.args[d.pick(("cu_seqlens_q", "cu_seqlens_k"))] = d.values([0, call.dims.sq])


@corruption("bwd")
def bad_operand(d, call):
    """out, dout and lse as the forward did not return them."""
    name = d.pick(("out", "dout", "lse"))
    spec = call.args.get(name)
    if not isinstance(spec, Spec):
        return False
    kind = d.pick(("dtype", "shape", "lse mode", "layout", "misaligned", "expanded",
                   "no seed", "dbias without bias"))
    if kind == "dtype":
        spec.dtype = d.pick((torch.float32, torch.float64, *HALF))
    elif kind == "shape":
        shape = list(spec.shape)
        if shape:
            shape[d.rng.randrange(len(shape))] += d.pick((1, -1 if min(shape) else 1, 8))
        spec.reshape(shape)
    elif kind == "lse mode":  # the other mode's log-sum-exp shape
        dims = call.dims
        call.args["lse"] = d.spec((dims.b, dims.hq, dims.max_q) if dims.group
                                  else (dims.hq, dims.b * dims.sq), torch.float32)
    elif kind == "layout":
        spec.layout = d.pick(("lastnc", "stepped", "transposed"))
        spec.arg = d.rng.randrange(max(len(spec.shape), 1))
    elif kind == "misaligned":
        spec.layout, spec.arg = "offset", d.pick((1, 2, 3))
    elif kind == "expanded":
        spec.layout, spec.arg = "expanded", d.rng.randrange(1, 1 << max(len(spec.shape), 1))
    elif kind == "no seed":
        call.args["dropout_p"] = 0.25
        call.args.pop("dropout_seed", None)
    else:
        for bias in ("bias", "attn_mask", "alibi_slopes"):
            call.args.pop(bias, None)
        call.args["return_dbias"] = True


@corruption("select")
def unknown_keyword(d, call):
    call.args[d.pick(("instance", "casual", "return_dbias" if "bwd" not in call.api
                      else "return_lse"))] = True


@corruption("kvcache")
def bad_cache_seqlens(d, call):
    dims = call.dims
    kind = d.pick(("negative", "beyond", "dtype", "shape", "2-d", "0-d", "device", "int",
                   "list", "stepped"))
    entries = [d.rng.randint(0, dims.capacity) for _ in range(dims.b)]
    spec = d.values(entries)
    if kind == "negative":
        spec = d.values([-1 - n if d.chance(0.7) else -2**31 for n in entries])
    elif kind == "beyond":  # the caller's contract: more keys than the cache holds
        spec = d.values([dims.capacity - dims.new + d.pick((1, 17, 2**31 - 1 - dims.capacity))
                         for _ in entries])
    elif kind == "dtype":
        spec.dtype = d.pick((torch.int64, torch.float32, torch.int16))
    elif kind == "shape":
        spec = d.values(entries + [0])
    elif kind == "2-d":
        spec = d.values([[n] for n in entries])
    elif kind == "0-d":
        spec = d.values(entries[0])
    elif kind == "device":
        spec.device = d.other_device(d.device)
    elif kind == "int":
        spec = entries[0]
    elif kind == "list":
        spec = entries
    else:
        spec.layout = "stepped"
    call.args["cache_seqlens"] = spec


@corruption("kvcache")
def bad_block_table(d, call):
    dims = call.dims
    if not dims.paged:  # a contiguous cache given a block table: its rows become pages
        call.args["block_table"] = d.values([[0] for _ in range(dims.b)])
        return
    table = call.args.get("block_table")
    entries = table.values if isinstance(table, Spec) and table.values is not None else \
        [[0] * dims.pages for _ in range(dims.b)]
    kind = d.pick(("out of range", "negative", "dtype", "shape", "1-d", "no pages", "3-d",
                   "stepped", "device", "list", "with batch_idx", "with leftpad", "huge"))
    spec = d.values(entries)
    if kind == "out of range":  # the caller's contract: pages past the pool
        row = d.rng.randrange(dims.b)
        entries[row][-1] = d.pick((dims.pool, dims.pool + 100, 2**31 - 1))
        spec = d.values(entries)
    elif kind == "negative":
        entries[d.rng.randrange(dims.b)][0] = d.pick((-1, -2**31))
        spec = d.values(entries)
    elif kind == "dtype":
        spec.dtype = d.pick((torch.int64, torch.float32))
    elif kind == "shape":
        spec = d.values(entries + [entries[0]])
    elif kind == "1-d":
        spec = d.values([row[0] for row in entries])
    elif kind == "no pages":
        spec = d.spec((dims.b, 0), torch.int32)
    elif kind == "3-d":
        spec = d.values([[[n] for n in row] for row in entries])
    elif kind == "stepped":
        spec.layout, spec.arg = "lastnc", 1
    elif kind == "device":
        spec.device = d.other_device(d.device)
    elif kind == "list":
        spec = entries
    elif kind == "with batch_idx":
        call.args["cache_batch_idx"] = d.values(list(range(dims.b)))
    elif kind == "with leftpad":
        call.args["cache_leftpad"] = d.values([0] * dims.b)
    else:  # more pages per sequence than the sizes hold
        spec = d.spec((dims.b, 2**31 // max(dims.page, 1) + 1), torch.int32, layout="expanded",
                      arg=3)
    call.args["block_table"] = spec


@corruption("kvcache")
def bad_cache_index(d, call):
    """cache_batch_idx and cache_leftpad of the wrong type, shape or range."""
    dims = call.dims
    name = d.pick(("cache_batch_idx", "cache_leftpad"))
    top = getattr(dims, "b_cache", dims.b)
    kind = d.pick(("range", "negative", "dtype", "shape", "device", "list"))
    entries = [d.rng.randrange(top) for _ in range(dims.b)]
    spec = d.values(entries)
    if kind == "range":  # the caller's contract: past the cache's rows or keys
        spec = d.values([top + d.pick((0, 5, 2**31 - 1 - top)) if name == "cache_batch_idx"
                         else dims.capacity + d.pick((1, 100)) for _ in entries])
    elif kind == "negative":
        spec = d.values([-1] * dims.b)
    elif kind == "dtype":
        spec.dtype = d.pick((torch.int64, torch.float32))
    elif kind == "shape":
        spec = d.values(entries + [0])
    elif kind == "device":
        spec.device = d.other_device(d.device)
    else:
        spec = entries
    call.args[name] = spec


@corruption("kvcache")
def bad_append(d, call):
    """k and v to append: one without the other, or shapes that disagree."""
    dims = call.dims
    dtype = call.args["q"].dtype if isinstance(call.args.get("q"), Spec) else torch.float16
    new = dims.new or 1
    call.positional = ("q", "k_cache", "v_cache", "k", "v")
    k = d.spec((dims.b, new, dims.hk, dims.dq), dtype)
    v = d.spec((dims.b, new, dims.hk, dims.dv), dtype)
    kind = d.pick(("k only", "v only", "seq", "batch", "more than fits"))
    if kind == "k only":
        v = None
    elif kind == "v only":
        k = None
    elif kind == "seq":
        v.reshape((dims.b, new + 1, dims.hk, dims.dv))
    elif kind == "batch":
        k.reshape((dims.b + 1, new, dims.hk, dims.dq))
    else:  # more new keys than the cache has room for
        more = dims.capacity + d.pick((1, 50))
        k.reshape((dims.b, more, dims.hk, dims.dq))
        v.reshape((dims.b, more, dims.hk, dims.dv))
    call.args.update(k=k, v=v)


@corruption("kvcache")
def bad_rotary(d, call):
    dims = call.dims
    dtype = call.args["q"].dtype if isinstance(call.args.get("q"), Spec) else torch.float16
    half = max(1, dims.dq // 4)
    cos, sin = d.spec((dims.capacity, half), dtype), d.spec((dims.capacity, half), dtype)
    kind = d.pick(("without k", "cos only", "too wide", "no columns", "shapes differ",
                   "stepped", "dtype", "short", "1-d"))
    if kind == "without k":
        call.args.pop("k", None)
        call.args.pop("v", None)
        call.positional = ("q", "k_cache", "v_cache")
    elif kind == "cos only":
        sin = None
    elif kind == "too wide":
        cos.reshape((dims.capacity, dims.dq // 2 + 1))
        sin.reshape(cos.shape)
    elif kind == "no columns":
        cos.reshape((dims.capacity, 0))
        sin.reshape(cos.shape)
    elif kind == "shapes differ":
        sin.reshape((dims.capacity + 1, half))
    elif kind == "stepped":
        cos.layout = "lastnc"
    elif kind == "dtype":
        cos.dtype = sin.dtype = torch.float32
    elif kind == "short":  # the caller's contract: fewer positions than the keys reach
        cos.reshape((1, half))
        sin.reshape((1, half))
    else:
        cos.reshape((half,))
        sin.reshape((half,))
    call.args.update(rotary_cos=cos, rotary_sin=sin)


@corruption("kvcache")
def unknown_option(d, call):
    if call.api == "fmha.fwd_kvcache":
        return False
    call.args[d.pick(("instance", "casual", "dropout_p"))] = True


@corruption("kvcache")
def small_cache_batch(d, call):
    """A contiguous cache with fewer rows than q has sequences, and no cache_batch_idx."""
    dims = call.dims
    if dims.paged:
        return False
    call.args.pop("cache_batch_idx", None)
    for name in ("k_cache", "v_cache"):
        spec = call.args.get(name)
        if isinstance(spec, Spec) and spec.shape:
            spec.reshape((max(dims.b - 1, 0), *spec.shape[1:]))


def _past_limit(d: Draw) -> str:
    return d.pick(("batch", "heads", "head dim", "seqlen", "causal grid"))


def _stride_zero_rows(shape: tuple) -> dict:
    """Expanded along every dim but the last: any size, one row of storage."""
    return dict(layout="expanded", arg=(1 << (len(shape) - 1)) - 1)


def past_kernel_limits(d, call):
    """Sizes the Python checks let through and only the C++ checks bound (batch and heads up to
    65535, head dims up to 65536, seqlen_q + seqlen_k below 2**30, the causal grid's CTAs), at
    stride 0. Only for select and explain, which allocate nothing."""
    dims = call.dims
    if dims.group:
        return False
    dtype = call.args["q"].dtype if isinstance(call.args.get("q"), Spec) else torch.float16
    b, sq, sk, hq, hk, dq, dv = 1, d.rng.randint(1, 16), d.rng.randint(1, 16), 1, 1, 64, 64
    kind = _past_limit(d)
    if kind == "batch":
        b = d.pick((65535, 65536, 70000))
    elif kind == "heads":
        hq = d.pick((65535, 65536, 70000))
    elif kind == "head dim":
        dq = dv = d.pick((264, 520, 65536, 65544, 65552))
    elif kind == "seqlen":
        sk = d.pick((2**30 - 16, 2**30, 2**30 + 8, 2**31 - 8))
    else:  # more CTAs than a 1-D grid holds
        b, hq, sq = 65535, d.pick((32768, 65535)), d.pick((1, 300))
        call.args["causal"] = True
        call.args.pop("window_size", None)
    for name in ("bias", "attn_mask", "alibi_slopes", "seqused_q", "seqused_k"):
        call.args.pop(name, None)
    for name, shape in (("q", (b, sq, hq, dq)), ("k", (b, sk, hk, dq)), ("v", (b, sk, hk, dv))):
        call.args[name] = d.spec(shape, dtype, **_stride_zero_rows(shape))


def past_kvcache_limits(d, call):
    """As past_kernel_limits, for select_kvcache and explain_kvcache: sizes past the C++
    checks' bounds, or the cache's keys past 2**30."""
    dims = call.dims
    dtype = call.args["q"].dtype if isinstance(call.args.get("q"), Spec) else torch.float16
    b, sq, hq, hk, dq, rows = 1, d.rng.randint(1, 16), 1, 1, 64, d.rng.randint(1, 300)
    kind = _past_limit(d)
    if kind == "batch":
        b = d.pick((65535, 65536, 70000))
    elif kind == "heads":
        hq = d.pick((65535, 65536, 70000))
    elif kind == "head dim":
        dq = d.pick((264, 520, 65536, 65544, 65552))
    elif kind == "seqlen":
        sq = d.pick((2**29, 2**30, 2**31 - 8))
    else:  # the cache's keys
        rows = d.pick((2**30 - 8, 2**30, 2**31 - 8))
    for name in ("k", "v", "block_table", "cache_batch_idx", "cache_leftpad", "rotary_cos",
                 "rotary_sin", "alibi_slopes"):
        call.args.pop(name, None)
    call.positional = ("q", "k_cache", "v_cache")
    cache = (b, rows, hk, dq)
    call.args.update(q=d.spec((b, sq, hq, dq), dtype, **_stride_zero_rows((b, sq, hq, dq))),
                     k_cache=d.spec(cache, dtype, **_stride_zero_rows(cache)),
                     v_cache=d.spec(cache, dtype, **_stride_zero_rows(cache)),
                     cache_seqlens=d.spec((b,), torch.int32))
    if dims.paged:  # one page per sequence: the page is the whole cache row
        call.args["block_table"] = d.spec((b, 1), torch.int32, layout="expanded", arg=1)
        call.args["k_cache"].reshape((1, rows, hk, dq))
        call.args["v_cache"].reshape((1, rows, hk, dq))


# ---- select, explain and the capability keyword ----------------------------------------------


def _takes(fn: Callable, keyword: str) -> bool:
    return keyword in inspect.signature(fn).parameters


# A GPU's compute capability as torch.cuda.get_device_capability() gives it, and what is none.
CAPABILITIES = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (7, 5))
BAD_CAPABILITIES = (80, 90, "sm90a", [9, 0], (9,), (9, 0, 0), (0, 0), (9, 10), (-1, 0),
                    (2**40, 0), (True, False), (9.0, 0), "x", 8.0)


def _capability_variant(d: Draw, call: Call, fn: Callable) -> None:
    """The `capability=` keyword, where this API takes it (skipped where it does not yet): an
    answer for that GPU, which needs none, so that tensors on any device reach the dispatcher's
    checks; now and then a value that is no capability."""
    # Without a GPU, a capability is the only way to reach the dispatcher.
    if not (_takes(fn, "capability") and d.chance(0.5 if d.machine.cuda else 0.8)):
        return
    if d.chance(0.8):
        call.args["capability"] = d.pick(CAPABILITIES)
    else:
        call.args["capability"] = d.pick(BAD_CAPABILITIES)
        call.notes.append("bad_capability")


# ---- problems --------------------------------------------------------------------------------


# What a torch without CUDA raises where an operation (indexing, a copy) meets a fake CUDA
# tensor: a limit of the machine, which a torch with CUDA does not have.
FAKE_CUDA_LIMIT = "PyTorch is not linked with support for cuda devices"


def _api_run(call: Call, fn: Callable) -> Callable[[], Any]:
    def run():
        with call.mode():
            positional, keywords = call.materialized()
            try:
                return fn(*positional, **keywords)
            except RuntimeError as exc:
                if call.fake and not torch.cuda.is_available() and FAKE_CUDA_LIMIT in str(exc):
                    return Finished("skipped", f"fake CUDA tensors need a torch with CUDA here: "
                                               f"{exc}")
                raise
    return run


def _families(call: Call, *more: str) -> tuple:
    """The corruptions that apply to an attention call: group mode's too in group mode."""
    return ("attention", *(("group",) if call.dims.group else ()), *more)


def attention_problem(d: Draw, surface: str) -> Problem:
    group = surface.endswith("varlen")
    api = surface.removesuffix("-varlen")
    d.home(fake_ok=True)
    call = draw_attention(d, api, group)
    corrupt(d, call, *_families(call, *(("bwd",) if api == "bwd" else ())))
    fn = fmha.fwd if api == "fwd" else fmha.bwd
    return Problem(surface, call.describe(), _api_run(call, fn), d.expect(call))


def autograd_problem(d: Draw, surface: str) -> Problem:
    """fmha.fwd on inputs that need grad, then a backward through it: of out.sum() (a gradient
    of stride 0 everywhere) or of a random gradient."""
    d.home(fake_ok=False)  # a fake CUDA tensor's autograd aborts on a torch without CUDA
    call = draw_attention(d, "fwd", group=d.chance(0.3))
    call.api = "autograd fmha.fwd"
    for name in ("q", "k", "v"):
        call.args[name].grad = d.chance(0.7)
    if not any(call.args[n].grad for n in ("q", "k", "v")):
        call.args["q"].grad = True
    if isinstance(call.args.get("bias"), Spec) and d.chance(0.5):
        call.args["bias"].grad = True
    call.extra["backward"] = d.pick(("sum", "random"))
    corrupt(d, call, *_families(call))

    def run():
        positional, keywords = call.materialized()
        out = fmha.fwd(*positional, **keywords)
        out = out[0] if isinstance(out, tuple) else out
        if isinstance(out, torch.Tensor) and out.requires_grad:
            if call.extra["backward"] == "sum":
                out.sum().backward()
            else:
                out.backward(torch.randn_like(out))
        return out

    return Problem(surface, call.describe(), run, d.expect(call))


def select_problem(d: Draw, surface: str) -> Problem:
    backward = surface == "select_bwd"
    name = d.pick(("select_bwd", "explain_bwd") if backward else ("select", "explain"))
    d.home(fake_ok=False)
    call = draw_attention(d, name, group=d.chance(0.35))
    corrupt(d, call, *_families(call, "select"))
    if d.chance(0.25) and past_kernel_limits(d, call) is not False:
        call.notes.append("past_kernel_limits")
    fn = getattr(fmha, name)
    _capability_variant(d, call, fn)
    return Problem(surface, call.describe(), _api_run(call, fn), _described_expect(d, call))


def _described_expect(d: Draw, call: Call) -> Optional[str]:
    """A valid select or explain for a named GPU answers wherever its tensors are."""
    if call.valid and "capability" in call.args:
        return "result"
    return d.expect(call)


def kvcache_problem(d: Draw, surface: str) -> Problem:
    name = "fwd_kvcache" if surface == "fwd_kvcache" else d.pick(("select_kvcache",
                                                                   "explain_kvcache"))
    d.home(fake_ok=False)
    call = draw_kvcache(d, name)
    corrupt(d, call, "kvcache")
    if name != "fwd_kvcache" and d.chance(0.25):
        past_kvcache_limits(d, call)
        call.notes.append("past_kvcache_limits")
    fn = getattr(fmha, name)
    if name != "fwd_kvcache":
        _capability_variant(d, call, fn)
    return Problem(surface, call.describe(), _api_run(call, fn), _described_expect(d, call))


def dropout_mask_problem(d: Draw, surface: str) -> Problem:
    cuda = d.machine.cuda
    args = dict(seed=d.rng.randrange(2**64), offset=d.rng.randrange(2**32),
                dropout_p=round(d.rng.random() * 0.99, 3), batch=d.rng.randint(0, 3),
                nhead=d.rng.randint(0, 9), seqlen_q=d.size(), seqlen_k=d.size())
    if cuda:
        args["device"] = d.pick((None, "cuda", "cuda:0", torch.device("cuda", 0)))
    else:
        args["device"] = d.pick(("cpu", "meta", torch.device("cpu")))
    call = Call("fmha.dropout_mask", tuple(args)[:-1], args)
    bad = {
        "seed": (-1, 2**64, 1.5, "1", None, True, d.values(3, torch.int64)),
        "offset": (-1, 2**32, 2**40, 1.5, None, True),
        "dropout_p": (1.0, -0.1, NAN, INF, 1.5, "0.1", True, None),
        "batch": (-1, 65535, 65536, 70000, 2**31, 2**40, 2.0, None, True),
        "nhead": (-1, 65536, 2**31, 2**40, 3.0, "2"),
        "seqlen_q": (-1, 2**31, 2**40, 1.5),
        "seqlen_k": (-1, 2**31, 2**40, "4"),
        "device": ("xyz", 3, -1, "cuda:7", "cpu", "meta", torch.device("meta"), 1.5, "cuda:-1"),
    }
    for _ in range(d.weighted({0: 35, 1: 45, 2: 15, 4: 5})):
        name = d.pick(bad)
        call.args[name] = d.pick(bad[name])
        if name in ("batch", "nhead", "seqlen_q", "seqlen_k") and isinstance(
                call.args[name], int) and call.args[name] > 65535:
            # One huge size; the others small, so the mask is what is huge, not the product.
            for other in ("batch", "nhead", "seqlen_q", "seqlen_k"):
                if other != name and isinstance(call.args[other], int):
                    call.args[other] = min(call.args[other], 1)
        call.notes.append(name)
    expect = None
    if call.valid:
        expect = "result" if cuda else "device"
    return Problem(surface, call.describe(), _api_run(call, fmha.dropout_mask), expect)


class MaskFunction:
    """A transformers mask function (batch, head, q, kv) -> bool, named in descriptions."""

    def __init__(self, causal: bool):
        self.causal = causal

    def __call__(self, batch, head, q, kv) -> bool:
        return kv <= q if self.causal else True

    def __repr__(self) -> str:
        return "causal_mask" if self.causal else "bidirectional_mask"


def _padding_rows(d: Draw, batch: int, keys: int, queries: int) -> list:
    """A 2D padding mask's rows: left padding (each row holding at least the queries), right
    padding or holes."""
    kind = d.pick(("left", "right", "holes"))
    rows = []
    for _ in range(batch):
        if kind == "holes":
            rows.append([int(d.chance(0.8)) for _ in range(keys)])
            continue
        tokens = d.rng.randint(min(queries, keys), keys)
        pad = [0] * (keys - tokens)
        rows.append(pad + [1] * tokens if kind == "left" else [1] * tokens + pad)
    return rows


def hf_attention_problem(d: Draw, surface: str) -> Problem:
    """transformers' attention call: query, key and value (batch, heads, seqlen, head_dim) as
    the attention module has them (views of the projections' (batch, seqlen, heads, head_dim)),
    the 2D padding mask padding_mask makes, the module's options, and flash_attention_2's
    packed-sequence keywords."""
    d.home(fake_ok=False)
    dtype = d.pick(HALF)
    hk = d.rng.randint(1, 3)
    hq = hk * d.rng.randint(1, 3)
    head_dim = d.pick(MULTIPLES_OF_8) if d.chance(0.6) else d.rng.randint(1, 256)
    packing = d.weighted({"none": 8, "mask": 6, "positions": 1, "cu_seqlens": 1})
    b = 1 if packing in ("positions", "cu_seqlens") else d.rng.randint(1, 3)
    sk = d.rng.randint(1, 128)
    sq = sk if packing in ("positions", "cu_seqlens") or d.chance(0.5) else \
        d.rng.randint(1, min(sk, 16))
    layout = d.pick(("transposed",) * 4 + ("contiguous",))
    module = SimpleNamespace(is_causal=d.chance(0.8))
    args = {"module": module,
            "query": d.spec((b, hq, sq, head_dim), dtype, layout=layout),
            "key": d.spec((b, hk, sk, head_dim), dtype, layout=layout),
            "value": d.spec((b, hk, sk, head_dim), dtype, layout=layout),
            "attention_mask": None}
    if packing == "mask":
        keys = sk if d.chance(0.85) else d.rng.randint(sq, sk)  # shorter: a static cache's
        args["attention_mask"] = d.values(_padding_rows(d, b, keys, sq),
                                          d.pick((torch.bool, torch.int64)))
    elif packing in ("positions", "cu_seqlens"):
        lengths, left = [], sk
        while left:
            lengths.append(d.rng.randint(1, left))
            left -= lengths[-1]
        if packing == "positions":
            args["position_ids"] = d.values([[p for n in lengths for p in range(n)]],
                                            torch.int64)
        else:
            cu = d.values(_prefix_sums(lengths))
            args.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                        max_length_k=max(lengths))
    if d.chance(0.1):
        args["dropout"] = d.pick((0.1, 0.5))
    if d.chance(0.3):
        args["scaling"] = round(d.rng.uniform(0.01, 2.0), 4)
    if d.chance(0.3):
        args["sliding_window"] = d.rng.randint(1, sk + 5)
    if d.chance(0.2):
        args["softcap"] = d.pick((0.0, 30.0, 50.0))
    if d.chance(0.3):
        args["is_causal"] = d.chance(0.5)
    call = Call("transformers.attention_forward",
                ("module", "query", "key", "value", "attention_mask"), args,
                SimpleNamespace(b=b, hq=hq, hk=hk, sq=sq, sk=sk), fake=False)
    _maybe_special(d, call)
    corrupt(d, call, "hf")
    for name in call.specs():
        call.args[name].fit()
    return Problem(surface, call.describe(),
                   _api_run(call, fmha_transformers.attention_forward), d.expect(call),
                   token="fmha")


@corruption("hf")
def bad_hf_mask(d, call):
    dims = call.dims
    kind = d.pick(("1-d", "3-d", "4-d", "batch", "longer", "float", "int values",
                   "all padding", "device"))
    rows = _padding_rows(d, dims.b, dims.sk, dims.sq)
    spec = d.values(rows, torch.bool)
    if kind == "1-d":
        spec = d.values(rows[0], torch.bool)
    elif kind == "3-d":
        spec = d.values([rows], torch.bool)
    elif kind == "4-d":  # a 4D mask built outside the model's mask functions
        spec = d.spec((dims.b, 1, dims.sq, dims.sk), torch.bool)
    elif kind == "batch":
        spec = d.values(rows + rows[:1], torch.bool)
    elif kind == "longer":
        spec = d.values([row + [1, 1, 1] for row in rows], torch.bool)
    elif kind == "float":
        spec = d.values([[0.5 * n for n in row] for row in rows], torch.float32)
    elif kind == "int values":
        spec = d.values([[2 * n for n in row] for row in rows], torch.int64)
    elif kind == "all padding":
        spec = d.values([[0] * dims.sk for _ in rows], torch.bool)
    else:
        spec.device = d.other_device(d.device)
    call.args["attention_mask"] = spec


@corruption("hf")
def bad_hf_option(d, call):
    name = d.pick(("dropout", "scaling", "sliding_window", "softcap", "is_causal", "module",
                   "s_aux", "position_ids", "cu_seq_lens", "max_length"))
    dims = call.dims
    if name == "dropout":
        call.args[name] = d.pick((1.0, -0.1, NAN, 1.5))
    elif name == "scaling":
        call.args[name] = d.pick((0.0, -1.0, NAN, INF))
    elif name == "sliding_window":
        call.args[name] = d.pick((0, -1, -5, 2**40, 1.5))
    elif name == "softcap":
        call.args[name] = d.pick((-1.0, NAN, INF))
    elif name == "is_causal":
        call.args[name] = d.pick((1, "yes"))
    elif name == "module":
        call.args["is_causal"] = None
        call.args["module"] = SimpleNamespace(is_causal=d.pick((None, 1, "no")))
    elif name == "s_aux":  # attention sinks
        call.args[name] = d.spec((dims.hq,), torch.float32)
    elif name == "position_ids":
        call.args["attention_mask"] = None
        call.args[name] = d.pick((d.spec((1, dims.sk), torch.float32),
                                  d.values([list(range(dims.sk))[::-1]], torch.int64),
                                  d.values([[0] * dims.sk], torch.int64),
                                  d.spec((2, dims.sk), torch.int64),
                                  d.values([[0, 1]], torch.int64)))
    elif name == "cu_seq_lens":
        cu = d.pick((d.values([0, dims.sk, 0]), d.values([0, dims.sk * dims.b + 5]),
                     d.values([0, dims.sk], torch.float32), d.values([[0, dims.sk]])))
        call.args.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=dims.sk,
                         max_length_k=dims.sk)
    else:
        cu = d.values([0, dims.sq * dims.b])
        call.args.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                         max_length_q=d.pick((0, -1, 2**40, d.values(dims.sk, torch.int64))),
                         max_length_k=dims.sk)


def padding_mask_problem(d: Draw, surface: str) -> Problem:
    """padding_mask as transformers' mask interface calls it: a batch size, the layer's key
    count, the model's 2D mask (or None), the query length and offset, the mask function."""
    device = d.pick(("cpu", "cuda")) if d.machine.cuda else "cpu"
    b = d.rng.randint(1, 3)
    keys = d.rng.randint(1, 64)
    queries = d.rng.randint(1, keys)
    args = dict(batch_size=b, kv_length=keys, attention_mask=None,
                q_length=d.pick((None, queries)), q_offset=d.rng.randint(0, keys),
                mask_function=d.pick((None, MaskFunction(True), MaskFunction(False))),
                device=torch.device(device))
    if d.chance(0.6):
        width = keys + d.pick((0, 0, 3, -min(3, keys - 1)))
        args["attention_mask"] = d.values(_padding_rows(d, b, width, min(queries, width)),
                                          d.pick((torch.bool, torch.int64)), device=device)
    if d.chance(0.2):
        args["q_offset"] = d.values(args["q_offset"], torch.int64, device=device)
    call = Call("transformers.padding_mask", (), args)
    if d.chance(0.2):  # edges a model could reach
        name = d.pick(("kv_length", "q_offset", "q_length"))
        call.args[name] = {"kv_length": 0, "q_offset": keys + 7, "q_length": 0}[name]
        call.notes.append(name)
    return Problem(surface, call.describe(),
                   _api_run(call, fmha_transformers.padding_mask),
                   "result" if call.valid else None, token="fmha")


def sdpa_problem(d: Draw, surface: str) -> Problem:
    """F.scaled_dot_product_attention as unmodified SDPA code calls it, with fmha registered
    as its flash backend (register() before, unregister() after), forced to the flash backend
    or not, and its backward."""
    d.home(fake_ok=False)
    dtype = d.pick(HALF)
    b = d.rng.randint(1, 3)
    hk = d.rng.randint(1, 3)
    hq = hk * d.rng.randint(1, 3)
    head_dim = d.pick(MULTIPLES_OF_8) if d.chance(0.8) else d.rng.randint(1, 256)
    sq, sk = max(1, d.size()), max(1, d.size())
    grad = d.chance(0.5)
    args = {"query": d.spec((b, hq, sq, head_dim), dtype, grad=grad),
            "key": d.spec((b, hk, sk, head_dim), dtype, grad=grad),
            "value": d.spec((b, hk, sk, head_dim), dtype, grad=grad)}
    if d.chance(0.1):
        args["dropout_p"] = 0.1
    if d.chance(0.5):
        args["is_causal"] = True
    if d.chance(0.3):
        args["scale"] = round(d.rng.uniform(0.01, 2.0), 4)
    if hq != hk or d.chance(0.2):
        args["enable_gqa"] = True
    call = Call("F.scaled_dot_product_attention", ("query", "key", "value"), args,
                SimpleNamespace(b=b, hq=hq, hk=hk, sq=sq, sk=sk))
    call.extra["flash_only"] = d.chance(0.7)
    call.extra["backward"] = grad
    _maybe_special(d, call)
    corrupt(d, call, "sdpa")

    def run():
        fmha_sdpa.register()
        try:
            positional, keywords = call.materialized()
            flash = torch.nn.attention.SDPBackend.FLASH_ATTENTION
            backends = torch.nn.attention.sdpa_kernel(flash) if call.extra["flash_only"] \
                else contextlib.nullcontext()
            with backends:
                out = F.scaled_dot_product_attention(*positional, **keywords)
                if out.requires_grad:
                    out.sum().backward()
            return out
        finally:
            fmha_sdpa.unregister()

    # A valid call on the GPU returns: some backend serves it unless only flash may.
    expect = None
    if call.valid and not call.extra["flash_only"] and d.device == "cuda":
        expect = "result"
    return Problem(surface, call.describe(), run, expect, token="fmha", torch_may_reject=True)


@corruption("sdpa")
def bad_sdpa_option(d, call):
    name = d.pick(("dropout_p", "scale", "is_causal", "enable_gqa", "attn_mask"))
    dims = call.dims
    call.args[name] = {
        "dropout_p": d.pick((1.0, -0.1, NAN)),
        "scale": d.pick((0.0, -1.0, NAN, INF)),
        "is_causal": d.pick((1, "yes")),
        "enable_gqa": False,
        "attn_mask": d.spec((dims.sq, dims.sk), torch.bool),
    }[name]


# ---- the example programs --------------------------------------------------------------------

# Values of a flag that are no value of it.
GARBAGE = ("", "x", "1.5", "-1", "-2", "0", "99999999999999999999", "0x10", "nan", "inf", "-inf",
           "1e3", " 1", "1 ", "1,2", ",", "-", "+1", "2147483647", "2147483648", "4294967296",
           "18446744073709551616", "-2147483649", "1,,2", "\t", "\u00e9", "%s%n%s", "1" * 400)
# Arguments that are not -name=value.
MALFORMED = ("-b", "b=2", "--b=2", "-=3", "-", "=", "", "-b==2", "-b=2=3", "--", "-?x")
MASKS = ("0", "1", "2", "n", "t", "b", "t:16,0", "b:-1,32", "xt:32", "xb:0", "t:", "t:1",
         "b:x,y", "xt:", "xb:-5", "g:1,2", "t:-5,-5", "t:2147483647,2147483647",
         "b:-2147483648,0", "t:1,2,3", "xt:2147483647", "n:1", "3")
BIASES = ("n", "e", "e:1", "e:2", "a", "a:1", "0", "1", "2", "e:3", "a:2", "x", "", "e:1:2")
# Flags whose large valid values make a long run, not a bad input.
RUN_LENGTH_FLAGS = ("warmup", "repeat")


def example_problem(d: Draw, surface: str) -> Problem:
    """fmha_fwd or fmha_bwd with a small valid problem's flags, then garbage: values that are
    none, malformed arguments, unknown and repeated flags, odd masks, biases and lengths, huge
    sizes. -v (the float64 reference), -warmup and -repeat stay small unless garbled."""
    program = surface
    batch = d.rng.randint(1, 3)
    hk = d.rng.randint(1, 3)
    heads = hk * d.rng.randint(1, 3)
    group = d.chance(0.3)
    seq, seq_k = d.rng.randint(1, 300), d.rng.randint(1, 300)
    dim = d.pick(MULTIPLES_OF_8) if d.chance(0.8) else d.rng.randint(1, 256)
    flags = {"prec": d.pick(("fp16", "bf16")), "mode": int(group), "b": batch, "h": heads,
             "h_k": hk, "s": seq, "s_k": seq_k, "d": dim, "mask": d.pick(MASKS[:10]),
             "bias": d.pick(BIASES[:6]), "warmup": d.rng.randint(0, 1),
             "repeat": d.rng.randint(1, 2), "seed": d.rng.randrange(2**32)}
    # The float64 reference only for problems it checks in a few seconds.
    flags["v"] = int(batch * heads * seq * seq_k * dim < 2e7 and d.chance(0.5))
    if group and d.chance(0.5):
        flags["s"] = ",".join(str(d.rng.randint(0, seq)) for _ in range(batch))
    if d.chance(0.2):
        flags["d_v"] = d.pick(MULTIPLES_OF_8)
    if d.chance(0.2):
        flags["p_drop"] = d.pick((0.1, 0.5))
    if d.chance(0.2):
        flags["softcap"] = d.pick((10, 50))
    if d.chance(0.2):
        flags["scale_s"] = d.pick((0.1, 1))
    if program == "fmha_fwd":
        flags["vlayout"] = d.pick(("r", "c"))
        flags["lse"] = d.rng.randint(0, 1)
    else:
        flags["deterministic"] = d.rng.randint(0, 1)
        if flags["bias"] in ("e", "e:1", "e:2") and d.chance(0.5):
            flags["dbias"] = 1
    if d.chance(0.3):
        flags["json"] = 1
    if d.chance(0.2):
        flags["kname"] = 1
    notes, extra = [], []
    for _ in range(d.weighted({0: 30, 1: 40, 2: 20, 4: 10})):
        kind = d.pick(("garbage", "garbage", "malformed", "unknown", "repeated", "mask", "bias",
                       "lengths", "huge", "huge", "help"))
        notes.append(kind)
        if kind == "garbage":
            flags[d.pick(list(flags))] = d.pick(GARBAGE)
        elif kind == "malformed":
            extra.append(d.pick(MALFORMED))
        elif kind == "unknown":
            extra.append(d.pick(("-zz=1", "-B=2", "-vlayout=r" if program == "fmha_bwd"
                                 else "-dbias=1")))
        elif kind == "repeated":
            name = d.pick(list(flags))
            extra.append(f"-{name}={d.pick(GARBAGE)}")
        elif kind == "mask":
            flags["mask"] = d.pick(MASKS)
        elif kind == "bias":
            flags["bias"] = d.pick(BIASES)
        elif kind == "lengths":
            flags["mode"] = 1
            flags[d.pick(("s", "s_k"))] = d.pick(("1,2", "0,0,0", ",", "5,-1", "2147483647," * 2,
                                                   "0"))
            if d.chance(0.5):
                flags[d.pick(("s_qpad", "s_kpad"))] = d.pick(("1", "-2", "1,2,3,4", "0"))
            else:
                flags[d.pick(("q_eff_lens", "kv_eff_lens"))] = d.pick(("1", "0,0,0", "-1"))
        elif kind == "huge":
            flags["v"] = 0  # the float64 reference of a huge problem takes hours
            name = d.pick(("b", "h", "s", "s_k", "d", "d_v", "h_k"))
            flags[name] = d.pick(("2147483647", "65536", "1000000", "100000"))
            if d.chance(0.3):
                flags[d.pick(("h", "d"))] = "65536"
        else:
            extra.append(d.pick(("-?", "--help")))
    for name in RUN_LENGTH_FLAGS:
        if str(flags[name]).isdigit() and 2 < int(flags[name]) < 2**31:
            flags[name] = 2
    argv = [f"-{name}={value}" for name, value in flags.items()] + extra
    d.rng.shuffle(argv)
    shown = [a if a.isprintable() and " " not in a and 0 < len(a) <= 40 else describe(a)
             for a in argv]
    how = f"corrupted: {', '.join(notes)}" if notes else "valid"
    description = f"{program} {' '.join(shown)} [{how}]"
    return Problem(surface, description, lambda: run_example(d.machine, program, argv))


@dataclass
class Finished:
    """An outcome that is no return value and no exception: an example program's exit status,
    or a problem skipped."""

    outcome: str
    message: str = ""


def run_example(machine: Machine, program: str, argv: list) -> Finished:
    if machine.examples is None:
        return Finished("skipped", "FMHA_EXAMPLES_DIR is not set")
    path = machine.examples / program
    if not path.is_file():
        return Finished("skipped", f"{path} does not exist")
    try:
        done = subprocess.run([str(path), *argv], capture_output=True, timeout=EXAMPLE_TIMEOUT_S,
                              text=True, errors="replace")
    except subprocess.TimeoutExpired:
        raise ExampleCrash(f"{program} ran past {EXAMPLE_TIMEOUT_S} s") from None
    said = (done.stderr.strip() or done.stdout.strip()).splitlines()
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise ExampleCrash(f"{program} died by {name}: {' | '.join(said[-3:])}")
    return Finished(f"exit {done.returncode}", said[0] if said else "")


SURFACES = {  # surface: (weight, problem maker)
    "fwd": (13, attention_problem),
    "fwd-varlen": (8, attention_problem),
    "bwd": (6, attention_problem),
    "bwd-varlen": (3, attention_problem),
    "autograd": (8, autograd_problem),
    "select": (9, select_problem),
    "select_bwd": (5, select_problem),
    "fwd_kvcache": (13, kvcache_problem),
    "select_kvcache": (7, kvcache_problem),
    "dropout_mask": (4, dropout_mask_problem),
    "transformers.attention_forward": (8, hf_attention_problem),
    "transformers.padding_mask": (3, padding_mask_problem),
    "sdpa": (4, sdpa_problem),
    "fmha_fwd": (3, example_problem),
    "fmha_bwd": (3, example_problem),
}


def draw(seed: int, machine: Machine) -> Problem:
    d = Draw(seed, machine)
    surface = d.weighted({name: weight for name, (weight, _) in SURFACES.items()})
    return SURFACES[surface][1](d, surface)


# ---- the worker ------------------------------------------------------------------------------


def _clear_kind(exc: BaseException) -> Optional[str]:
    for kind in (TypeError, ValueError, NotImplementedError):
        if isinstance(exc, kind):
            return kind.__name__
    return None


def _fmha_files() -> set:
    return {os.path.realpath(m.__file__) for name, m in list(sys.modules.items())
            if (name == "fmha" or name.startswith("fmha.")) and getattr(m, "__file__", None)}


def _raised_in_fmha(exc: BaseException) -> bool:
    """Whether the exception came through fmha's Python code (else: torch's own checks)."""
    files = _fmha_files()
    return any(os.path.realpath(frame.filename) in files
               for frame in traceback.extract_tb(exc.__traceback__))


def run_problem(problem: Problem, machine: Machine) -> dict:
    """The outcome record of one problem."""
    record = dict(expect=problem.expect, token=problem.token,
                  torch_may_reject=problem.torch_may_reject)
    error: Optional[BaseException] = None
    try:
        result = problem.run()
        if machine.cuda:  # an asynchronous CUDA error belongs to the problem that caused it
            torch.cuda.synchronize()
    except ExampleCrash as exc:
        record.update(outcome="ExampleCrash", message=str(exc)[:MESSAGE_CHARS], crash=True)
        return record
    except HarnessError:
        raise
    except Exception as exc:
        error = exc
    else:
        if isinstance(result, Finished):
            record.update(outcome=result.outcome, message=result.message[:MESSAGE_CHARS])
        else:
            record.update(outcome="result", message="")
        return record
    message = str(error)
    record.update(outcome=type(error).__name__, message=message[:MESSAGE_CHARS],
                  kind=_clear_kind(error), in_fmha=_raised_in_fmha(error),
                  garbled=bool(GARBLED.search(message)))
    if machine.cuda:
        fault = DEVICE_FAULT.search(message) and "out of memory" not in message
        if not fault:
            try:
                torch.cuda.synchronize()
            except Exception as late:  # a launch of this problem faulted after it raised
                message = str(late)
                fault = DEVICE_FAULT.search(message) and "out of memory" not in message
                if fault:
                    record.update(outcome=type(late).__name__, message=message[:MESSAGE_CHARS])
        record["device_fault"] = bool(fault)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, required=True, help="the first problem's seed")
    parser.add_argument("--count", type=int, required=True, help="how many problems to run")
    parser.add_argument("--jsonl", type=Path, help="where the JSON lines go (default: stdout)")
    options = parser.parse_args(argv)

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    faulthandler.enable()  # a crash prints the Python stack of the problem that caused it
    # The problems are small; the test runs a worker per core, which one thread each keeps
    # from oversubscribing them.
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # deprecations and fmha's copy warnings are no outcome
    machine = Machine.detect()
    out = options.jsonl.open("a") if options.jsonl else sys.stdout

    def emit(line: dict) -> None:
        out.write(json.dumps(line) + "\n")
        out.flush()

    for seed in range(options.first, options.first + options.count):
        problem = draw(seed, machine)
        problem.description = problem.description.replace("\n", " ")
        emit({"seed": seed, "surface": problem.surface, "start": problem.description})
        torch.manual_seed(seed)  # what a call draws from torch's generator (dropout seeds)
        try:
            record = run_problem(problem, machine)
        except HarnessError as exc:
            record = dict(outcome="HarnessError", message=str(exc)[:MESSAGE_CHARS])
        emit({"seed": seed, **record})
        if record.get("device_fault"):
            return DEVICE_FAULT_EXIT
        if machine.cuda and torch.cuda.memory_reserved() > CACHED_GPU_BYTES:
            torch.cuda.empty_cache()  # the test runs two workers on one GPU
    return 0


if __name__ == "__main__":
    sys.exit(main())
