"""The runtime's matching rule (serves), the order of preference, and the proof that every
instance is the one the dispatcher runs for some problem."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from conftest import BWD_OPERATION, repository
from hypothesis import given, settings
from hypothesis import strategies as st

from generator.dispatch import (PREFERENCE, REQUIREMENTS, Problem, check_dispatchable,
                                deciding_criterion, dispatch_order, first_serving, requirements,
                                serves, unmet)
from generator.errors import ConfigError, GeneratorError
from generator.model import BwdTraits, FwdTraits, KvcacheTraits, Tile
from generator.schema import BIAS, DTYPE, KV_DTYPE, MASK, MODE, PIPELINE, VLAYOUT


def problem(dtype="fp16", hdim=(64, 64), mask="none", bias="none", vlayout="row", mode="batch",
            lse=False, dropout=False, softcap=False, seqlen=(1024, 1024), seqused=False,
            cc=80) -> Problem:
    traits = FwdTraits(DTYPE.get(dtype), *hdim, MASK.get(mask), BIAS.get(bias),
                       VLAYOUT.get(vlayout), MODE.get(mode), lse, dropout, softcap)
    return Problem(traits, *seqlen, seqused=seqused, cc=cc)


# -- serves ------------------------------------------------------------------------------------

@pytest.mark.parametrize("trait, value", [
    ("dtype", "bf16"), ("mask", "causal"), ("bias", "alibi"), ("vlayout", "col"),
    ("dropout", True), ("softcap", True),
])
def test_functional_traits_must_be_equal(make_instance, trait, value):
    instance = make_instance(pad_seqlen=True)
    assert serves(instance, problem())
    assert not serves(instance, problem(**{trait: value}))
    assert serves(make_instance(pad_seqlen=True, **{trait: value}), problem(**{trait: value}))


def test_an_lse_instance_also_serves_calls_without_lse(make_instance):
    assert serves(make_instance(lse=True), problem(lse=False))
    assert serves(make_instance(lse=True), problem(lse=True))
    assert not serves(make_instance(lse=False), problem(lse=True))


@pytest.mark.parametrize("hdim, served", [
    ((128, 128), True), ((120, 128), True), ((8, 8), True), ((64, 128), True),
    ((136, 128), False),  # larger than the instance's
    ((100, 128), False),  # not a multiple of 8
    ((0, 128), False),
])
def test_head_dim_padding(make_instance, hdim, served):
    assert serves(make_instance(hdim=(128, 128), pad_hdim=True), problem(hdim=hdim)) == served
    assert serves(make_instance(hdim=(128, 128)), problem(hdim=hdim)) == (hdim == (128, 128))


@pytest.mark.parametrize("arch, cc, served", [
    ("sm80", 80, True), ("sm80", 86, True), ("sm80", 90, True), ("sm80", 100, True),
    ("sm80", 75, False), ("sm90a", 90, True), ("sm90a", 80, False), ("sm90a", 100, False),
])
def test_arch_runs_on_the_device(make_instance, arch, cc, served):
    assert serves(make_instance(arch=arch), problem(cc=cc)) == served


@pytest.mark.parametrize("changes, served", [
    ({}, True),
    ({"seqlen": (128 * 3, 64 * 5)}, True),
    ({"seqlen": (1000, 1024)}, False),
    ({"seqlen": (1024, 1000)}, False),
    ({"seqused": True}, False),
    ({"mode": "group"}, False),
])
def test_unpadded_seqlens(make_instance, changes, served):
    # The tile is 128x64: seqlen_q % 128 == 0 and seqlen_k % 64 == 0.
    assert serves(make_instance(), problem(**changes)) == served
    group = {"mode": "group"} if "mode" in changes else {}
    assert serves(make_instance(pad_seqlen=True, **group), problem(**changes))


def test_requirements_are_named_once():
    assert len({r.name for r in REQUIREMENTS}) == len(REQUIREMENTS)


# -- the order of preference -------------------------------------------------------------------

def test_padded_head_dims_take_the_tightest_that_fits(make_instance):
    padded = [make_instance(hdim=hdim, pad_seqlen=True, pad_hdim=True)
              for hdim in ((256, 256), (64, 64), (128, 128), (192, 128))]
    ordered = dispatch_order(padded)
    assert first_serving(ordered, problem(hdim=(120, 120))).name == \
        "fwd_fp16_d128_fa2_sm80_m128n64_pad_hpad"
    assert first_serving(ordered, problem(hdim=(64, 64))).point.traits.hdim_q == 64
    assert first_serving(ordered, problem(hdim=(136, 128))).point.traits.hdim_q == 192
    assert first_serving(ordered, problem(hdim=(136, 136))).point.traits.hdim_q == 256
    assert first_serving(ordered, problem(hdim=(264, 8))) is None


def test_exact_head_dims_before_padded_ones(make_instance):
    exact = make_instance(hdim=(128, 128), pad_seqlen=True)
    padded = make_instance(hdim=(128, 128), pad_seqlen=True, pad_hdim=True)
    assert dispatch_order([padded, exact]) == (exact, padded)
    assert deciding_criterion(exact, padded).prefers == "exact head dims first"


def test_leanest_first_and_lse_serves_what_lean_does_not(make_instance):
    lean, with_lse = make_instance(), make_instance(lse=True)
    ordered = dispatch_order([with_lse, lean])
    assert ordered == (lean, with_lse)
    assert first_serving(ordered, problem(lse=False)) is lean
    assert first_serving(ordered, problem(lse=True)) is with_lse


def test_order_arch_then_exactness_then_padding_then_tile(make_instance):
    instances = [make_instance(arch=arch, pad_seqlen=pad, tile=tile)
                 for arch in ("sm80", "sm90a") for pad in (True, False)
                 for tile in (Tile(128, 64, 8, 2), Tile(64, 64, 4, 2))]
    keys = [(i.point.arch.cc, i.point.pad_seqlen, -i.tile.block_m)
            for i in dispatch_order(instances)]
    assert keys == sorted(keys, key=lambda k: (-k[0], k[1], k[2]))


def test_dispatch_order_of_a_config(build):
    _, catalog = build()
    keys = [(i.point.arch.cc, i.point.pad_seqlen, i.tile.block_m * i.tile.block_n)
            for i in catalog.instances]
    assert keys == sorted(keys, key=lambda k: (-k[0], k[1], -k[2]))
    assert catalog.instances[0].name == "fwd_bf16_d64_causal_fa2_sm90a_m128n64"
    assert catalog.instances[-1].name == "fwd_fp16_d128_fa2_sm80_m64n32_pad"


def test_dispatch_order_is_independent_of_input_order(make_instance):
    instances = [make_instance(arch=a, pad_seqlen=p, hdim=h) for a in ("sm80", "sm90a")
                 for p in (True, False) for h in ((64, 64), (128, 128))]
    assert dispatch_order(instances) == dispatch_order(reversed(instances))
    assert [i.name for i in dispatch_order(instances)][:2] == [
        "fwd_fp16_d128_fa2_sm90a_m128n64", "fwd_fp16_d64_fa2_sm90a_m128n64"]


def test_newer_pipeline_first_on_the_same_arch(make_instance):
    fa3 = PIPELINE.get("fa3")
    newer = make_instance(arch="sm90a", pipeline=fa3, pad_seqlen=True)
    older = make_instance(arch="sm90a")
    ordered = dispatch_order([older, newer, make_instance(arch="sm80", pipeline=fa3)])
    # The arch decides first; then the pipeline, before the unpadded fast path.
    assert [i.name for i in ordered] == ["fwd_fp16_d64_fa3_sm90a_m128n64_pad",
                                         "fwd_fp16_d64_fa2_sm90a_m128n64",
                                         "fwd_fp16_d64_fa3_sm80_m128n64"]
    criterion = deciding_criterion(newer, older)
    assert criterion is PREFERENCE[2] and criterion.prefers == "newer pipeline first"
    assert (criterion.shows(newer), criterion.shows(older)) == ("pipeline fa3", "pipeline fa2")
    # The older one still runs what the newer one does not: here V^T.
    assert first_serving(ordered, problem(cc=90)) is newer
    assert first_serving(ordered, problem(vlayout="col", cc=90)) is None


def test_every_criterion_says_what_it_prefers(make_instance):
    first, second = make_instance(arch="sm90a"), make_instance(arch="sm80")
    criterion = deciding_criterion(first, second)
    assert criterion is PREFERENCE[0]
    assert (criterion.shows(first), criterion.shows(second)) == ("sm90a (cc 90)", "sm80 (cc 80)")


DEFAULT_CATALOG = repository().catalog
# The dtypes every operation has; the e4m3 forward's calls have a property of their own
# (test_generator_e4m3.py).
SIXTEEN_BIT = tuple(dtype.token for dtype in DTYPE if dtype.size == 2)


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from(SIXTEEN_BIT), mask=st.sampled_from(MASK.tokens),
       bias=st.sampled_from(BIAS.tokens), vlayout=st.sampled_from(VLAYOUT.tokens),
       mode=st.sampled_from(MODE.tokens),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
       hdim=st.tuples(st.integers(1, 40), st.integers(1, 40)).map(lambda d: (d[0] * 8, d[1] * 8)),
       seqlen=st.tuples(st.integers(1, 4096), st.integers(1, 4096)), seqused=st.booleans(),
       cc=st.sampled_from([75, 80, 86, 89, 90, 100]))
def test_repository_matrix_serves_every_call_on_its_newest_arch(dtype, mask, bias, vlayout, mode,
                                                                 flags, hdim, seqlen, seqused,
                                                                 cc):
    call = problem(dtype, hdim, mask, bias, vlayout, mode, *flags, seqlen=seqlen,
                   seqused=seqused, cc=cc)
    chosen = first_serving(DEFAULT_CATALOG.instances, call)
    # Head dims up to 256 that are multiples of 8, on cc 8.0 and newer: always served, by the
    # exact sm90a code on cc 9.0 and by the portable sm80 code elsewhere.
    if cc < 80 or max(hdim) > 256:
        assert chosen is None
        return
    assert chosen is not None and chosen.point.arch.cc == (90 if cc == 90 else 80)
    position = DEFAULT_CATALOG.instances.index(chosen)
    assert not any(serves(i, call) for i in DEFAULT_CATALOG.instances[:position])
    # fa3 runs on H100/H200 exactly what it supports, and nothing anywhere else.
    fa3_traits = (hdim in FA3_HDIMS and bias == "none" and vlayout == "row"
                  and not flags[1] and not flags[2])
    assert (chosen.point.pipeline.token == "fa3") == (cc == 90 and fa3_traits)


FA3_HDIMS = {(64, 64), (128, 128), (192, 128), (256, 256)}


@pytest.mark.parametrize("traits, pipeline", [
    ({}, "fa3"),
    ({"mask": "window", "mode": "group", "lse": True, "dtype": "bf16"}, "fa3"),
    ({"hdim": (192, 128), "mask": "causal"}, "fa3"),
    ({"bias": "elementwise"}, "fa2"),
    ({"bias": "alibi"}, "fa2"),
    ({"vlayout": "col"}, "fa2"),
    ({"dropout": True}, "fa2"),
    ({"softcap": True}, "fa2"),
    ({"hdim": (96, 96)}, "fa2"),
    ({"hdim": (120, 120)}, "fa2"),
])
@pytest.mark.parametrize("seqlen", [(1024, 1024), (1000, 777)])
def test_repository_matrix_runs_fa3_on_sm90a_where_it_has_the_traits(traits, pipeline, seqlen):
    chosen = first_serving(DEFAULT_CATALOG.instances, problem(**traits, seqlen=seqlen, cc=90))
    assert (chosen.point.pipeline.token, chosen.point.arch.token) == (pipeline, "sm90a")
    # On A100-class GPUs, and on newer ones that run sm80's PTX, only fa2 exists.
    for cc in (80, 86, 100):
        chosen = first_serving(DEFAULT_CATALOG.instances, problem(**traits, seqlen=seqlen, cc=cc))
        assert (chosen.point.pipeline.token, chosen.point.arch.token) == ("fa2", "sm80")


# -- the no-shadowing proof --------------------------------------------------------------------

def test_shadowed_instance_is_an_error_naming_both(make_instance):
    # An older pipeline's instance with the same traits, arch and padding as a newer one's
    # could never be chosen.
    newer, older = make_instance(pipeline=PIPELINE.get("fa3")), make_instance()
    with pytest.raises(GeneratorError) as caught:
        check_dispatchable(dispatch_order([older, newer]))
    assert caught.value.message.startswith(
        "fwd_fp16_d64_fa2_sm80_m128n64 is shadowed by fwd_fp16_d64_fa3_sm80_m128n64: for every "
        "problem tried that it serves (e.g. dtype=fp16,hdim=64x64,")


def test_padded_instance_shadowed_by_a_padded_head_dim_sibling(make_instance):
    # Both pad everything and run on sm80; the one with the larger tile comes first and serves
    # every shape the other does.
    big = make_instance(pad_seqlen=True, pad_hdim=True)
    small = make_instance(pad_seqlen=True, pad_hdim=True, tile=Tile(64, 64, 4, 2))
    with pytest.raises(GeneratorError, match=f"{small.name} is shadowed by {big.name}"):
        check_dispatchable(dispatch_order([big, small]))


def test_instance_that_serves_nothing_is_an_error(build, make_config, line_of):
    # Unpadded group mode: pad_seqlen=false runs batch mode only. The fix is a rule: the error
    # is the config's, at its rules.
    with pytest.raises(ConfigError) as caught:
        build(("mode: [batch]", "mode: [batch, group]"))
    assert caught.value.line == line_of(make_config().read_text(), "rules:")
    assert caught.value.message == (
        "operations.fwd.rules: fwd_bf16_d64_causal_group_fa2_sm90a_m128n64 serves no problem, so "
        "the dispatcher can never run it (seqlen: needs batch mode, no seqused, and seqlen_q and "
        "seqlen_k multiples of block_m and block_n when pad_seqlen=false (kvcache's cache lengths "
        "live on the device: never); for a prefill kernel, seqlen_q >= block_m or 256 packed "
        "rows, pages of a multiple of 8 keys, and no cache_leftpad); prune it with a rule")


def test_padding_siblings_are_not_shadowed(make_instance):
    # Each has a witness: unpadded tile multiples, ragged seqlens, smaller head dims.
    check_dispatchable(dispatch_order([
        make_instance(arch=arch, pad_seqlen=pad_seqlen, pad_hdim=pad_hdim, lse=lse)
        for arch in ("sm80", "sm90a") for pad_seqlen in (False, True)
        for pad_hdim in (False, True) for lse in (False, True)]))


def test_every_combination_of_the_axes_is_dispatchable(build):
    _, catalog = build(("bias: [none]", "bias: [none, alibi]"),
                       ("mode: [batch]", "mode: [batch, group]"),
                       ("lse: [false]", "lse: [false, true]"),
                       ("pad_hdim: [false]", "pad_hdim: [false, true]"),
                       ("rules: []", "rules:\n  - when: {mode: group, pad_seqlen: false}\n"
                                     "    reason: ragged"))
    assert len(catalog.instances) == 32 * 2 * 2 * 2 * 2 * 3 // 4


def test_duplicate_names_are_an_error(make_instance):
    # Warps and stages are not in the name: two tiles differing only there would collide.
    first = make_instance(tile=Tile(128, 64, 8, 2))
    second = make_instance(tile=Tile(128, 64, 4, 2))
    with pytest.raises(GeneratorError, match="two different instances are named "
                                             "fwd_fp16_d64_fa2_sm80_m128n64"):
        check_dispatchable(dispatch_order([first, second]))


def test_repository_proof_is_fast():
    start = time.thread_time()
    check_dispatchable(DEFAULT_CATALOG.instances)
    assert time.thread_time() - start < 3  # ~0.3 s; this thread's CPU time (test_generator_catalog)


# -- the bwd operation -------------------------------------------------------------------------

def bwd_problem(dtype="fp16", hdim=(64, 64), mask="none", bias="none", mode="batch",
                dbias=False, dropout=False, softcap=False, seqlen=(1024, 1024), seqused=False,
                cc=80) -> Problem:
    traits = BwdTraits(DTYPE.get(dtype), *hdim, MASK.get(mask), BIAS.get(bias), MODE.get(mode),
                       dbias, dropout, softcap)
    return Problem(traits, *seqlen, seqused=seqused, cc=cc)


@pytest.mark.parametrize("trait, value", [
    ("dtype", "bf16"), ("mask", "window"), ("bias", "elementwise"), ("mode", "group"),
    ("dbias", True), ("dropout", True), ("softcap", True),
])
def test_bwd_traits_must_be_equal(make_bwd_instance, trait, value):
    instance = make_bwd_instance(pad_seqlen=True)
    assert serves(instance, bwd_problem())
    assert not serves(instance, bwd_problem(**{trait: value}))
    assert serves(make_bwd_instance(pad_seqlen=True, **{trait: value}),
                  bwd_problem(**{trait: value}))


def test_a_dbias_instance_does_not_serve_calls_without_it(make_bwd_instance):
    # Unlike the forward's lse, dbias is a trait a call asks for or not: no relaxation.
    with_dbias = make_bwd_instance(bias="elementwise", dbias=True)
    assert not serves(with_dbias, bwd_problem(bias="elementwise"))
    assert serves(with_dbias, bwd_problem(bias="elementwise", dbias=True))


def test_an_operation_never_serves_anothers_problem(make_instance, make_bwd_instance):
    fwd, bwd = make_instance(pad_seqlen=True), make_bwd_instance(pad_seqlen=True)
    assert serves(fwd, problem()) and serves(bwd, bwd_problem())
    assert not serves(fwd, bwd_problem()) and not serves(bwd, problem())
    assert [r.name for r in unmet(bwd, problem())] == ["op"]
    # The backward's requirements have no lse and no vlayout; dbias instead.
    names = [r.name for r in requirements(bwd)]
    assert "lse" not in names and "vlayout" not in names and "dbias" in names
    assert "dbias" not in [r.name for r in requirements(fwd)]


@pytest.mark.parametrize("changes, served", [
    ({}, True),
    ({"seqlen": (64 * 3, 128 * 5)}, True),
    ({"seqlen": (1000, 1024)}, False),
    ({"seqlen": (1024, 1000)}, False),
    ({"seqlen": (1024 + 64, 1024 + 64)}, False),  # seqlen_k % 128
    ({"seqused": True}, False),
])
def test_bwd_unpadded_seqlens(make_bwd_instance, changes, served):
    # The tile is 64x128: seqlen_q % 64 == 0 and seqlen_k % 128 == 0.
    assert serves(make_bwd_instance(), bwd_problem(**changes)) == served
    assert serves(make_bwd_instance(pad_seqlen=True), bwd_problem(**changes))


def test_bwd_head_dim_padding(make_bwd_instance):
    padded = make_bwd_instance(hdim=(128, 128), pad_seqlen=True, pad_hdim=True)
    assert serves(padded, bwd_problem(hdim=(120, 96)))
    assert not serves(padded, bwd_problem(hdim=(100, 128)))
    assert not serves(make_bwd_instance(hdim=(128, 128), pad_seqlen=True),
                      bwd_problem(hdim=(120, 120)))


def test_dispatch_order_keeps_each_operation_apart(make_instance, make_bwd_instance):
    instances = [make_bwd_instance(arch="sm90a"), make_instance(arch="sm80"),
                 make_bwd_instance(arch="sm80", pad_seqlen=True, pad_hdim=True),
                 make_instance(arch="sm90a")]
    assert [i.name for i in dispatch_order(instances)] == [
        "fwd_fp16_d64_fa2_sm90a_m128n64", "fwd_fp16_d64_fa2_sm80_m128n64",
        "bwd_fp16_d64_fa2_sm90a_m64n128", "bwd_fp16_d64_fa2_sm80_m64n128_pad_hpad"]
    check_dispatchable(dispatch_order(instances))


def test_bwd_shadowed_instance_is_an_error(make_bwd_instance):
    big = make_bwd_instance(pad_seqlen=True, pad_hdim=True)
    small = make_bwd_instance(pad_seqlen=True, pad_hdim=True, tile=Tile(64, 64, 8, 2))
    with pytest.raises(GeneratorError, match=f"{small.name} is shadowed by {big.name}: .*"
                                             f"e.g. op=bwd,dtype=fp16,hdim=64x64,"):
        check_dispatchable(dispatch_order([big, small]))


def test_bwd_instance_that_serves_nothing_is_an_error(build):
    with pytest.raises(ConfigError) as caught:
        build(BWD_OPERATION, ("mode: [batch]", "mode: [batch, group]"),
              ("rules: []", "rules:\n  - when: {mode: group, pad_seqlen: false}\n    reason: fwd"))
    assert caught.value.message.startswith(
        "operations.bwd.rules: bwd_bf16_d64_causal_group_fa2_sm90a_m64n128 serves no problem")


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from(SIXTEEN_BIT), mask=st.sampled_from(MASK.tokens),
       bias=st.sampled_from(BIAS.tokens), mode=st.sampled_from(MODE.tokens),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
       hdim=st.tuples(st.integers(1, 40), st.integers(1, 40)).map(lambda d: (d[0] * 8, d[1] * 8)),
       seqlen=st.tuples(st.integers(1, 4096), st.integers(1, 4096)), seqused=st.booleans(),
       cc=st.sampled_from([75, 80, 86, 89, 90, 100]))
def test_repository_bwd_matrix_serves_every_call_on_its_newest_arch(dtype, mask, bias, mode,
                                                                     flags, hdim, seqlen,
                                                                     seqused, cc):
    dbias = flags[0] and bias == "elementwise"  # a bias gradient exists for a bias tensor only
    call = bwd_problem(dtype, hdim, mask, bias, mode, dbias, *flags[1:], seqlen=seqlen,
                       seqused=seqused, cc=cc)
    chosen = first_serving(DEFAULT_CATALOG.instances, call)
    if cc < 80 or max(hdim) > 256:
        assert chosen is None
        return
    # Every backward call is served: natively built on H100/H200, through sm80's code elsewhere;
    # by fa3 on H100/H200 exactly where it has the traits (the forward's head dims, no bias,
    # dropout or soft-cap), by fa2 otherwise.
    assert chosen is not None and chosen.op.token == "bwd"
    assert chosen.point.arch.cc == (90 if cc == 90 else 80)
    fa3_traits = hdim in FA3_HDIMS and bias == "none" and not flags[1] and not flags[2]
    assert chosen.point.pipeline.token == ("fa3" if cc == 90 and fa3_traits else "fa2")
    position = DEFAULT_CATALOG.instances.index(chosen)
    assert not any(serves(i, call) for i in DEFAULT_CATALOG.instances[:position])


# -- the kvcache operation ---------------------------------------------------------------------

def kvcache_problem(dtype="fp16", hdim=(64, 64), mask="none", bias="none", paged=False,
                    softcap=False, seqlen=(1, 4096), cc=80, kv_dtype="same") -> Problem:
    traits = KvcacheTraits(DTYPE.get(dtype), KV_DTYPE.get(kv_dtype), *hdim, MASK.get(mask),
                           BIAS.get(bias), paged, softcap)
    return Problem(traits, *seqlen, seqused=False, cc=cc)


@pytest.mark.parametrize("trait, value", [
    ("dtype", "bf16"), ("kv_dtype", "e4m3"), ("mask", "causal"), ("bias", "alibi"),
    ("paged", True), ("softcap", True),
])
def test_kvcache_traits_must_be_equal(make_kvcache_instance, trait, value):
    instance = make_kvcache_instance()
    assert serves(instance, kvcache_problem())
    assert not serves(instance, kvcache_problem(**{trait: value}))
    assert serves(make_kvcache_instance(**{trait: value}), kvcache_problem(**{trait: value}))


def test_kvcache_runs_exact_head_dims_at_every_length(make_kvcache_instance):
    instance = make_kvcache_instance(hdim=(128, 128))
    for seqlen in ((1, 1), (1, 100000), (16, 64), (7, 1000)):
        assert serves(instance, kvcache_problem(hdim=(128, 128), seqlen=seqlen))
    assert not serves(instance, kvcache_problem(hdim=(120, 120)))


def test_an_unpadded_kvcache_instance_serves_nothing(make_kvcache_instance):
    # Its cache lengths live on the device: whole tiles are never known on the host.
    unpadded = make_kvcache_instance(pad_seqlen=False)
    assert not serves(unpadded, kvcache_problem(seqlen=(16, 64)))
    assert [r.name for r in unmet(unpadded, kvcache_problem(seqlen=(16, 64)))] == ["seqlen"]
    with pytest.raises(GeneratorError, match=f"{unpadded.name} serves no problem"):
        check_dispatchable(dispatch_order([unpadded]))


def test_a_prefill_instance_takes_chunks_of_a_tile_on_pages_of_multiples_of_8(
        make_kvcache_instance):
    # fa3's kvcache kernel is the chunked-prefill one: at least block_m query tokens, on a
    # contiguous cache or pages of a multiple of 8 keys; the decode kernel takes the rest, and
    # each is the one chosen for some problem.
    prefill = make_kvcache_instance(hdim=(128, 128), paged=True, arch="sm90a",
                                    pipeline=PIPELINE.get("fa3"), tile=Tile(128, 128, 12, 2))
    decode = make_kvcache_instance(hdim=(128, 128), paged=True, arch="sm90a")
    chunk = replace(kvcache_problem(hdim=(128, 128), paged=True, seqlen=(128, 4096), cc=90),
                    page_size=16)
    assert serves(prefill, chunk) and serves(decode, chunk)
    # Shorter chunks whose query heads per K/V head make 256 packed rows, too.
    assert serves(prefill, replace(chunk, seqlen_q=32, group=8))
    # Left-padded sequences (cache_leftpad) are the decode kernel's alone.
    for other in (replace(chunk, seqlen_q=127), replace(chunk, seqlen_q=31, group=8),
                  replace(chunk, page_size=12), replace(chunk, page_size=0, leftpad=True)):
        assert [r.name for r in unmet(prefill, other)] == ["seqlen"] and serves(decode, other)
    ordered = dispatch_order([decode, prefill])
    assert ordered == (prefill, decode)
    assert first_serving(ordered, chunk) is prefill
    assert first_serving(ordered, replace(chunk, seqlen_q=1)) is decode
    check_dispatchable(ordered)


def test_kvcache_and_the_other_operations_never_serve_each_others_problems(
        make_instance, make_kvcache_instance):
    fwd, kvcache = make_instance(pad_seqlen=True), make_kvcache_instance()
    assert not serves(fwd, kvcache_problem()) and not serves(kvcache, problem())
    assert [r.name for r in unmet(kvcache, problem())] == ["op"]
    names = [r.name for r in requirements(kvcache)]
    assert "paged" in names and not {"lse", "vlayout", "mode", "dbias", "dropout"} & set(names)
    assert "paged" not in [r.name for r in requirements(fwd)]


def test_dispatch_order_puts_kvcache_last(make_instance, make_bwd_instance,
                                          make_kvcache_instance):
    instances = [make_kvcache_instance(arch="sm90a"), make_bwd_instance(), make_instance(),
                 make_kvcache_instance(paged=True)]
    assert [i.name for i in dispatch_order(instances)] == [
        "fwd_fp16_d64_fa2_sm80_m128n64", "bwd_fp16_d64_fa2_sm80_m64n128",
        "kvcache_fp16_d64_fa2_sm90a_m16n64_pad", "kvcache_fp16_d64_paged_fa2_sm80_m16n64_pad"]
    check_dispatchable(dispatch_order(instances))


def test_kvcache_shadowed_instance_is_an_error(make_kvcache_instance):
    big = make_kvcache_instance(tile=Tile(16, 128, 4, 2))
    small = make_kvcache_instance()
    with pytest.raises(GeneratorError, match=f"{small.name} is shadowed by {big.name}: .*"
                                             f"e.g. op=kvcache,dtype=fp16,kv_dtype=same,"
                                             f"hdim=64x64,"):
        check_dispatchable(dispatch_order([big, small]))


KVCACHE_HDIMS = {(d, d) for d in (32, 64, 96, 128, 192, 256)}
E4M3_HDIMS = {(d, d) for d in (64, 128, 192, 256)}


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from(SIXTEEN_BIT), mask=st.sampled_from(MASK.tokens),
       bias=st.sampled_from(BIAS.tokens), flags=st.tuples(st.booleans(), st.booleans()),
       hdim=st.sampled_from(sorted(KVCACHE_HDIMS | {(192, 128), (80, 80), (120, 120), (36, 36),
                                                    (100, 100), (57, 57)})),
       seqlen=st.tuples(st.integers(1, 64), st.integers(1, 1 << 20)),
       cc=st.sampled_from([75, 80, 86, 89, 90, 100]))
def test_repository_kvcache_matrix_serves_every_call_on_its_newest_arch(dtype, mask, bias, flags,
                                                                         hdim, seqlen, cc):
    call = kvcache_problem(dtype, hdim, mask, bias, *flags, seqlen=seqlen, cc=cc)
    chosen = first_serving(DEFAULT_CATALOG.instances, call)
    # Every call of the traits the rules keep (no elementwise bias) runs, on cc 8.0 and newer,
    # whatever its lengths and head dims: fa2, natively built on H100/H200, exact where the
    # matrix has the head dims, else the padded instance of the nearest above them.
    if cc < 80 or bias == "elementwise":
        assert chosen is None
        return
    assert chosen is not None and chosen.op.token == "kvcache"
    assert (chosen.point.pipeline.token, chosen.point.arch.cc) == ("fa2", 90 if cc == 90 else 80)
    own = (chosen.point.traits.hdim_q, chosen.point.traits.hdim_v)
    assert chosen.point.pad_hdim == (hdim not in KVCACHE_HDIMS)
    assert own == min((d, d) for d, _ in KVCACHE_HDIMS if d >= max(hdim))


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(SIXTEEN_BIT), mask=st.sampled_from(MASK.tokens),
       bias=st.sampled_from(["none", "alibi"]), flags=st.tuples(st.booleans(), st.booleans()),
       hdim=st.sampled_from(sorted(KVCACHE_HDIMS | {(120, 120), (80, 80), (57, 57)})),
       seqlen_q=st.sampled_from([1, 16, 128, 512, 4096]), cc=st.sampled_from([80, 89, 90]))
def test_repository_kvcache_matrix_runs_e4m3_caches_at_exact_head_dims_prefill_at_d64_d128(
        dtype, mask, bias, flags, hdim, seqlen_q, cc):
    """An e4m3 cache: exact head dims only (its rows move in 16-byte pieces of 16 elements), of
    64, 128, 192 and 256 (its rows' whole swizzle atoms); a chunk runs chunked prefill (fa3, on
    the 16-bit cache's tile) where a 16-bit cache's chunk of the same traits does, at head dims
    64 and 128 (d256's e4m3 staging stages do not fit beside its tile), and the decode kernel
    (fa2) otherwise."""
    call = replace(kvcache_problem(dtype, hdim, mask, bias, *flags, seqlen=(seqlen_q, 4096),
                                   cc=cc, kv_dtype="e4m3"), page_size=16 if flags[0] else 0)
    chosen = first_serving(DEFAULT_CATALOG.instances, call)
    if hdim not in E4M3_HDIMS:
        assert chosen is None
        return
    assert chosen is not None and chosen.point.traits.kv_dtype.token == "e4m3"
    assert not chosen.point.pad_hdim
    assert chosen.point.arch.cc == (90 if cc == 90 else 80)
    same = first_serving(DEFAULT_CATALOG.instances, replace(
        call, traits=replace(call.traits, kv_dtype=KV_DTYPE.get("same"))))
    assert same is not None and same.point.traits.kv_dtype.token == "same"
    prefill = same.point.pipeline.token == "fa3" and hdim[0] in (64, 128)
    assert chosen.point.pipeline.token == ("fa3" if prefill else "fa2")
    if prefill:
        assert chosen.tile == same.tile
