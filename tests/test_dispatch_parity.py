"""The C++ dispatcher (runtime/src/dispatcher.cpp) and the generator's mirror of its rule
(generator/dispatch.py: serves, first_serving) must choose the same instance, or the
generator's shadow proof and --explain describe a dispatcher that does not exist.

Both see the same table: the compiled instances, in the order fmha.instances() reports (which
must be the generator's dispatch order). For random problems drawn around every compiled trait
set (head dims at, below and off the instance's, with and without the log-sum-exp, tile
multiples and ragged lengths, per-sequence lengths), fmha.select's choice, or its miss, must be
generator.dispatch.first_serving's. select launches nothing, so this runs in seconds.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import device_cc, import_fmha  # noqa: E402

torch, fmha = import_fmha()

from generator.catalog import build_catalog  # noqa: E402
from generator.config import DEFAULT_CONFIG, load  # noqa: E402
from generator.dispatch import Problem, dispatch_order, first_serving  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CASES = 400


def compiled_in_dispatch_order():
    catalog = {i.name: i for i in build_catalog(load(DEFAULT_CONFIG)).instances}
    names = [i["name"] for i in fmha.instances()]
    missing = [n for n in names if n not in catalog]
    if missing:
        pytest.skip(f"built from another instances.yaml ({missing[0]} is not in {DEFAULT_CONFIG})")
    return [catalog[n] for n in names]


def select_call(traits, seqlen_q, seqlen_k, seqused):
    """The arguments of an fmha.select call with these traits and lengths (1 sequence, 2
    heads), as fwd would take them."""
    q = torch.empty(1, seqlen_q, 2, traits.hdim_q, dtype=DTYPES[traits.dtype.token], device="cuda")
    k = torch.empty(1, seqlen_k, 2, traits.hdim_q, dtype=q.dtype, device="cuda")
    if traits.vlayout.token == "col":  # (b, s, h, d) with the sequence dim contiguous, its
        padded = -(-seqlen_k // 8) * 8  # rows 16-byte aligned as fmha.h asks
        v = torch.empty(1, 2, traits.hdim_v, padded, dtype=q.dtype, device="cuda")
        v = v[..., :seqlen_k].permute(0, 3, 1, 2)
    else:
        v = torch.empty(1, seqlen_k, 2, traits.hdim_v, dtype=q.dtype, device="cuda")
    kwargs = dict(return_lse=traits.lse)
    if traits.mask.token == "causal":
        kwargs["causal"] = True
    elif traits.mask.token == "window":
        kwargs["window_size"] = (8, 8)
    if traits.bias.token == "elementwise":
        kwargs["bias"] = torch.zeros(1, 1, seqlen_q, seqlen_k, dtype=q.dtype, device="cuda")
    elif traits.bias.token == "alibi":
        kwargs["alibi_slopes"] = torch.ones(2, device="cuda")
    if traits.dropout:
        kwargs.update(dropout_p=0.1, dropout_seed=1)
    if traits.softcap:
        kwargs["softcap"] = 5.0
    if traits.mode.token == "group":
        q, k, v = (t[0] for t in (q, k, v))
        kwargs.update(cu_seqlens_q=torch.tensor([0, seqlen_q], dtype=torch.int32, device="cuda"),
                      cu_seqlens_k=torch.tensor([0, seqlen_k], dtype=torch.int32, device="cuda"),
                      max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k)
    if seqused:
        kwargs.update(seqused_q=torch.tensor([seqlen_q], dtype=torch.int32, device="cuda"),
                      seqused_k=torch.tensor([seqlen_k], dtype=torch.int32, device="cuda"))
    return q, k, v, kwargs


def problems(ordered, cc, rng):
    """Problems around the compiled trait sets: head dims at, below (multiples of 8, for the
    padded instances) and off the instance's; lse either way; lengths that are tile multiples
    or not; seqused now and then."""
    for _ in range(CASES):
        inst = rng.choice(ordered)
        own = inst.point.traits
        hdim_q, hdim_v = rng.choice([(own.hdim_q, own.hdim_v),
                                     (max(8, own.hdim_q - 8 * rng.randint(1, 4)),) * 2,
                                     (own.hdim_q + 8, own.hdim_v + 8)])
        traits = dataclasses.replace(own, hdim_q=hdim_q, hdim_v=hdim_v,
                                     lse=rng.random() < 0.5)
        tile = inst.tile
        if rng.random() < 0.5:
            seqlen_q, seqlen_k = tile.block_m * rng.randint(1, 4), tile.block_n * rng.randint(1, 4)
        else:
            seqlen_q, seqlen_k = rng.randint(1, 300), rng.randint(1, 300)
        yield Problem(traits, seqlen_q, seqlen_k, seqused=rng.random() < 0.2, cc=cc)


@pytest.mark.gpu
def test_compiled_table_is_in_the_generators_dispatch_order():
    ordered = compiled_in_dispatch_order()
    assert [i.name for i in dispatch_order(ordered)] == [i.name for i in ordered]


@pytest.mark.gpu
def test_runtime_chooses_what_the_generator_rule_chooses():
    ordered = compiled_in_dispatch_order()
    cc = device_cc(torch)
    checked = misses = 0
    for problem in problems(ordered, cc, random.Random(20261121)):
        expected = first_serving(ordered, problem)
        q, k, v, kwargs = select_call(problem.traits, problem.seqlen_q, problem.seqlen_k,
                                      problem.seqused)
        try:
            chosen = fmha.select(q, k, v, **kwargs)["name"]
        except fmha.MissingInstanceError:
            chosen = None
            misses += 1
        assert chosen == (expected.name if expected else None), (problem, kwargs.keys())
        checked += 1
    assert checked == CASES and misses < CASES  # some calls must hit
