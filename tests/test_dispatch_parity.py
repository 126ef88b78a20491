"""The C++ dispatcher (runtime/src/dispatcher.cpp) and the generator's mirror of its rule
(generator/dispatch.py: serves, first_serving) must choose the same instance, or the
generator's shadow proof and --explain describe a dispatcher that does not exist.

Both see the same table: the compiled instances, in the order fmha.instances() and
fmha.bwd_instances() report (which must be the generator's dispatch order). For random problems
drawn around every compiled trait set (head dims at, below and off the instance's, with and
without the log-sum-exp, tile multiples and ragged lengths, per-sequence lengths), the choice of
fmha.select (fmha.select_bwd), or its miss, must be generator.dispatch.first_serving's, for
each GPU generation the targets serve (sm80, sm86, sm90). The calls name the GPU
(capability=...) and pass meta tensors: the choice depends on the traits, the sizes and the
target only, so this runs without a GPU, in CI, and launches nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")

from conftest import repository  # noqa: E402
from generator.config import DEFAULT_CONFIG  # noqa: E402
from generator.dispatch import Problem, dispatch_order, first_serving  # noqa: E402
from generator.model import BwdTraits  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
CASES = 400
# An A100, an RTX 30x0/A10 (sm86: sm80 code runs, sm90a's does not), an H100/H200.
CAPABILITIES = [(8, 0), (8, 6), (9, 0)]
DEVICE = "meta"


@functools.lru_cache(maxsize=1)
def catalog() -> dict:
    """The repository matrix's instances by name."""
    return {i.name: i for i in repository().catalog.instances}


def compiled_in_dispatch_order(listed: list[dict]) -> list:
    """The catalog's instances of `listed` (fmha.instances() or bwd_instances()), in its order."""
    catalog_ = catalog()
    names = [i["name"] for i in listed]
    missing = [n for n in names if n not in catalog_]
    if missing:
        pytest.skip(f"built from another instances.yaml ({missing[0]} is not in {DEFAULT_CONFIG})")
    if not names:
        pytest.skip("this build compiled no instance of the operation")
    return [catalog_[n] for n in names]


def select_call(traits, seqlen_q, seqlen_k, seqused):
    """The arguments of an fmha.select (select_bwd) call with these forward (backward) traits
    and lengths (1 sequence, 2 heads), as fwd (bwd) would take them."""
    dtype = DTYPES[traits.dtype.token]
    q = torch.empty(1, seqlen_q, 2, traits.hdim_q, dtype=dtype, device=DEVICE)
    k = torch.empty(1, seqlen_k, 2, traits.hdim_q, dtype=dtype, device=DEVICE)
    if getattr(traits, "vlayout", None) and traits.vlayout.token == "col":  # (b, s, h, d) with the sequence dim contiguous, its
        piece = 16 // traits.dtype.size  # the elements of 16 bytes
        padded = -(-seqlen_k // piece) * piece  # rows 16-byte aligned as fmha.h asks
        v = torch.empty(1, 2, traits.hdim_v, padded, dtype=q.dtype, device=DEVICE)
        v = v[..., :seqlen_k].permute(0, 3, 1, 2)
    else:
        v = torch.empty(1, seqlen_k, 2, traits.hdim_v, dtype=q.dtype, device=DEVICE)
    kwargs = {}
    if isinstance(traits, BwdTraits):
        if traits.dbias:
            kwargs["return_dbias"] = True
    else:
        kwargs["return_lse"] = traits.lse
    if traits.mask.token == "causal":
        kwargs["causal"] = True
    elif traits.mask.token == "window":
        kwargs["window_size"] = (8, 8)
    if traits.bias.token == "elementwise":
        kwargs["bias"] = torch.zeros(1, 1, seqlen_q, seqlen_k, dtype=q.dtype, device=DEVICE)
    elif traits.bias.token == "alibi":
        kwargs["alibi_slopes"] = torch.ones(2, device=DEVICE)
    if traits.dropout:
        kwargs.update(dropout_p=0.1, dropout_seed=1)
    if traits.softcap:
        kwargs["softcap"] = 5.0
    if traits.mode.token == "group":
        q, k, v = (t[0] for t in (q, k, v))
        kwargs.update(cu_seqlens_q=torch.tensor([0, seqlen_q], dtype=torch.int32, device=DEVICE),
                      cu_seqlens_k=torch.tensor([0, seqlen_k], dtype=torch.int32, device=DEVICE),
                      max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k)
    if seqused:
        kwargs.update(seqused_q=torch.tensor([seqlen_q], dtype=torch.int32, device=DEVICE),
                      seqused_k=torch.tensor([seqlen_k], dtype=torch.int32, device=DEVICE))
    return q, k, v, kwargs


def problems(ordered, cc, rng):
    """Problems around the compiled trait sets: head dims at, below (multiples of 8, for the
    padded instances) and off the instance's; the forward's lse either way; lengths that are
    tile multiples or not; seqused now and then."""
    for _ in range(CASES):
        inst = rng.choice(ordered)
        own = inst.point.traits
        step = 16 // own.dtype.size  # e4m3 head dims are multiples of 16, never padded
        hdim_q, hdim_v = rng.choice([(own.hdim_q, own.hdim_v),
                                     (max(step, own.hdim_q - step * rng.randint(1, 4)),) * 2,
                                     (own.hdim_q + step, own.hdim_v + step)])
        traits = dataclasses.replace(own, hdim_q=hdim_q, hdim_v=hdim_v)
        if not isinstance(traits, BwdTraits):
            traits = dataclasses.replace(traits, lse=rng.random() < 0.5)
        tile = inst.tile
        if rng.random() < 0.5:
            seqlen_q, seqlen_k = tile.block_m * rng.randint(1, 4), tile.block_n * rng.randint(1, 4)
        else:
            seqlen_q, seqlen_k = rng.randint(1, 300), rng.randint(1, 300)
        yield Problem(traits, seqlen_q, seqlen_k, seqused=rng.random() < 0.2, cc=cc)


OPERATIONS = {"fwd": (fmha.instances, fmha.select), "bwd": (fmha.bwd_instances, fmha.select_bwd)}


@pytest.mark.parametrize("op", OPERATIONS)
def test_compiled_table_is_in_the_generators_dispatch_order(op):
    listed, _ = OPERATIONS[op]
    ordered = compiled_in_dispatch_order(listed())
    assert [i.name for i in dispatch_order(ordered)] == [i.name for i in ordered]


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("op", OPERATIONS)
def test_runtime_chooses_what_the_generator_rule_chooses(op, capability):
    listed, select = OPERATIONS[op]
    ordered = compiled_in_dispatch_order(listed())
    cc = capability[0] * 10 + capability[1]
    checked = misses = 0
    for problem in problems(ordered, cc, random.Random(20261121 + cc)):
        expected = first_serving(ordered, problem)
        q, k, v, kwargs = select_call(problem.traits, problem.seqlen_q, problem.seqlen_k,
                                      problem.seqused)
        try:
            chosen = select(q, k, v, capability=capability, **kwargs)["name"]
        except fmha.MissingInstanceError as miss:
            chosen = None
            misses += 1
            assert "FMHA_FILTER='" in str(miss) or "No generator target" in str(miss), str(miss)
        assert chosen == (expected.name if expected else None), (problem, kwargs.keys())
        checked += 1
    assert checked == CASES
