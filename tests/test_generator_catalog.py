"""Expansion, pruning rules, tile assignment (and its shared-memory check) and instance names.
The dispatch order and the no-shadowing proof are in test_generator_dispatch.py."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest

from generator.catalog import build_catalog
from generator.config import DEFAULT_CONFIG, load
from generator.gaps import fallback_notes
from generator.model import Tile
from conftest import BWD_OPERATION, KVCACHE_OPERATION, make_traits, repository
from generator.operations import operation_of
from generator.schema import ARCH, OPERATION, PIPELINE

EVERY_AXIS = (("bias: [none]", "bias: [none, elementwise, alibi]"),
              ("vlayout: [row]", "vlayout: [row, col]"), ("mode: [batch]", "mode: [batch, group]"),
              ("lse: [false]", "lse: [false, true]"),
              ("dropout: [false]", "dropout: [false, true]"),
              ("softcap: [false]", "softcap: [false, true]"),
              ("pad_hdim: [false]", "pad_hdim: [false, true]"))
GROUP_NEEDS_PADDING = ("rules: []", "rules:\n  - when: {mode: group, pad_seqlen: false}\n"
                                    "    reason: ragged")


def names(catalog) -> list[str]:
    return [instance.name for instance in catalog.instances]


FA3_HDIMS = {(64, 64), (128, 128), (192, 128), (256, 256)}


def test_repository_matrix():
    # fa2: 2 dtypes x 7 head dims x 3 masks x 3 biases x 2 V layouts x 2 archs x 2 dropout x 2
    # softcap = 2016 trait combinations, each with 5 instances the rules keep: batch mode with
    # lse false/true x (unpadded, fully padded), and group mode padded with lse; less the 48
    # unpadded batch-mode ones on sm90a that fa3 serves (2 dtypes x 4 head dims x 3 masks x
    # lse false/true). fa3: those 24 trait combinations on sm90a, each with 3 instances, all
    # padding sequence lengths only: batch mode with lse false/true, and group mode with lse.
    # e4m3 (the forward's third dtype, 3 x 32256 points): fa3 on sm90a, head dims 64, 128 and
    # 256 x 3 masks, each with row-major V in batch mode with lse false/true and in group mode
    # with lse, and with V^T in batch mode with lse false/true (no group mode: its rule): 45.
    # This thread's CPU time: neither other jobs nor the CPU that torch's worker threads spend
    # after earlier tests count (process_time did). Every operation's matrix (15348 instances)
    # took 2.9-4.4 s on the 2-core CI-like machine (2026-11-28), 5.4 s beside a compile; the
    # bound catches a blow-up (a rule checked per pair of points), not a few percent.
    start = time.thread_time()
    catalog = build_catalog(load(DEFAULT_CONFIG))
    assert time.thread_time() - start < 15
    fwd = catalog.of(OPERATION.get("fwd"))
    assert len(fwd) == 10080 - 48 + 72 + 45 and catalog.instances[:len(fwd)] == fwd
    # Every operation's points less what its rules keep (BWD_POINTS, KVCACHE_POINTS: below).
    assert catalog.pruned == 3 * 32256 - 10149 + BWD_POINTS - 4056 + KVCACHE_POINTS - 1596
    assert len(set(names(catalog))) == 10149 + 4056 + 1596
    for instance in fwd:
        point, traits = instance.point, instance.point.traits
        assert traits.mode.token == "batch" or (point.pad_seqlen and traits.lse)
        if point.pipeline.token == "fa2":
            assert point.pad_seqlen == point.pad_hdim
            continue
        assert point.arch.token == "sm90a" and point.pad_seqlen and not point.pad_hdim
        assert (traits.hdim_q, traits.hdim_v) in FA3_HDIMS
        # fa3 reads V^T of e4m3 inputs only, in batch mode.
        vlayouts = ({"row", "col"} if traits.dtype.token == "e4m3" and traits.mode.token == "batch"
                    else {"row"})
        assert traits.vlayout.token in vlayouts
        assert (traits.bias.token, traits.dropout, traits.softcap) == ("none", False, False)


def test_fa2_keeps_on_sm90a_what_fa3_does_not_serve():
    catalog = repository().catalog
    fa2_sm90a = [i.point for i in catalog.of(OPERATION.get("fwd"))
                 if i.point.pipeline.token == "fa2" and i.point.arch.token == "sm90a"]
    unpadded = [p for p in fa2_sm90a if not p.pad_hdim]
    # Every trait fa3 lacks keeps its fa2 fast path; fa3's own traits keep only fa2's
    # head-dim-padded fallback, for the head dims below them.
    assert unpadded and all(
        (p.traits.hdim_q, p.traits.hdim_v) not in FA3_HDIMS or p.traits.bias.token != "none"
        or p.traits.vlayout.token != "row" or p.traits.dropout or p.traits.softcap
        for p in unpadded)
    assert {(p.traits.hdim_q, p.traits.hdim_v) for p in fa2_sm90a if p.pad_hdim} >= FA3_HDIMS


def test_expansion_covers_every_combination(build):
    _, catalog = build(*EVERY_AXIS, GROUP_NEEDS_PADDING)
    # 32 base points x 3 x 2 x 2 x 2 x 2 x 2 x 2, less the unpadded group-mode ones.
    assert len(catalog.instances) == 32 * 3 * 64 - 32 * 3 * 64 // 4
    assert len(set(names(catalog))) == len(catalog.instances)


@pytest.mark.parametrize("fields, name", [
    ({}, "fwd_fp16_d64_fa2_sm80_m128n64"),
    ({"dtype": "bf16", "hdim": (128, 128), "mask": "causal", "arch": "sm90a", "pad_seqlen": True},
     "fwd_bf16_d128_causal_fa2_sm90a_m128n64_pad"),
    ({"hdim": (192, 128), "tile": Tile(64, 32, 4, 2)}, "fwd_fp16_d192x128_fa2_sm80_m64n32"),
    ({"dtype": "bf16", "hdim": (128, 128), "mask": "causal", "bias": "alibi", "vlayout": "col",
      "mode": "group", "lse": True, "dropout": True, "softcap": True, "arch": "sm90a",
      "pad_seqlen": True, "pad_hdim": True},
     "fwd_bf16_d128_causal_alibi_col_group_lse_dropout_softcap_fa2_sm90a_m128n64_pad_hpad"),
    ({"mask": "window", "bias": "elementwise", "softcap": True, "pad_hdim": True},
     "fwd_fp16_d64_window_elementwise_softcap_fa2_sm80_m128n64_hpad"),
    ({"lse": True}, "fwd_fp16_d64_lse_fa2_sm80_m128n64"),
])
def test_name_grammar(make_instance, fields, name):
    assert make_instance(**fields).name == name


def test_names_are_identifiers_and_carry_every_trait(build):
    _, catalog = build(*EVERY_AXIS, GROUP_NEEDS_PADDING)
    for instance in catalog.instances:
        point, traits = instance.point, instance.point.traits
        name = instance.name
        assert re.fullmatch(r"[a-z0-9_]+", name)
        assert name.endswith("_hpad") == point.pad_hdim
        assert name.removesuffix("_hpad").endswith("_pad") == point.pad_seqlen
        for token, on in (("causal", traits.mask.token == "causal"),
                          ("alibi", traits.bias.token == "alibi"),
                          ("col", traits.vlayout.token == "col"),
                          ("group", traits.mode.token == "group"), ("lse", traits.lse),
                          ("dropout", traits.dropout), ("softcap", traits.softcap)):
            assert (f"_{token}_" in name) == on, (name, token)
        assert f"_{point.arch.token}_" in name


def test_tile_comes_from_the_yaml(build):
    _, catalog = build()
    tiles = {i.point.traits.hdim_q: i.tile for i in catalog.instances}
    assert tiles == {64: Tile(128, 64, 8, 2), 128: Tile(64, 32, 4, 2)}


def test_rule_prunes_matching_points(build):
    rule = "rules:\n  - when: {dtype: bf16, hdim_q: [128, 256], mask: causal}\n    reason: test"
    _, catalog = build(("rules: []", rule))
    assert len(catalog.instances) == 28 and catalog.pruned == 4
    assert not any(n.startswith("fwd_bf16_d128_causal") for n in names(catalog))


def test_rules_on_arch_and_padding(build):
    rules = ("rules:\n"
             "  - when: {arch: sm80, pad_seqlen: true}\n    reason: one\n"
             "  - when: {dtype: fp16, arch: sm90a}\n    reason: two")
    _, catalog = build(("rules: []", rules))
    assert catalog.pruned == 16 and len(catalog.instances) == 16
    for instance in catalog.instances:
        point = instance.point
        assert not (point.arch.token == "sm80" and point.pad_seqlen)
        assert not (point.arch.token == "sm90a" and point.traits.dtype.token == "fp16")


def test_rules_on_the_boolean_axes(build):
    rules = ("rules:\n"
             "  - when: {pad_seqlen: false, pad_hdim: true}\n    reason: one\n"
             "  - when: {lse: false, dropout: true}\n    reason: two")
    _, catalog = build(("lse: [false]", "lse: [false, true]"),
                       ("dropout: [false]", "dropout: [false, true]"),
                       ("pad_hdim: [false]", "pad_hdim: [false, true]"), ("rules: []", rules))
    # 32 x 2 x 2 x 2 points; (nopad, hpad) drops a quarter, (no lse, dropout) a quarter of the rest
    assert len(catalog.instances) == 256 * 3 // 4 * 3 // 4
    for instance in catalog.instances:
        point = instance.point
        assert point.pad_seqlen or not point.pad_hdim
        assert point.traits.lse or not point.traits.dropout


def test_rule_that_matches_nothing_is_an_error(config_error, line_of):
    error, text = config_error(("rules: []", "rules:\n  - when: {hdim_v: 256}\n    reason: dead"))
    assert "this rule matches no point of the matrix" in error.message
    assert error.line == line_of(text, "hdim_v: 256")


def test_rules_that_prune_everything_are_an_error(config_error, line_of):
    error, text = config_error(("rules: []", "rules:\n  - when: {mask: [none, causal]}\n"
                                             "    reason: all"))
    assert "prune every point" in error.message
    assert error.line == line_of(text, "rules:")


def test_point_without_tile_is_an_error(config_error, line_of):
    error, text = config_error(("    - [128, 128]", "    - [128, 128]\n    - [192, 128]"))
    assert "no entry matches pipeline=fa2, arch=sm80, hdim_q=192, hdim_v=128" in error.message
    assert error.line == line_of(text, "tiles:")


def test_point_with_two_tiles_is_an_error(config_error, line_of):
    extra = ("  - {pipeline: fa2, arch: sm90a, hdim_q: 64, hdim_v: 64, block_m: 64, block_n: 64, "
             "warps: 4, stages: 2, why: x}\n")
    error, text = config_error(("  - pipeline: fa2\n", extra + "  - pipeline: fa2\n"))
    first, second = line_of(text, "why: d64"), line_of(text, "why: x")
    assert error.line == second
    assert (f"this entry and the one at line {first} both match pipeline=fa2, arch=sm90a, "
            f"hdim_q=64, hdim_v=64") in error.message


def test_tiles_per_arch(build):
    sm80 = ("  - {pipeline: fa2, arch: sm80, hdim_q: 64, hdim_v: 64, block_m: 64, block_n: 64, "
            "warps: 4, stages: 2, why: x}\n")
    _, catalog = build(("hdim_q: 64, hdim_v: 64,", "arch: sm90a, hdim_q: 64, hdim_v: 64,"),
                       ("  - pipeline: fa2\n", sm80 + "  - pipeline: fa2\n"))
    tiles = {(i.point.arch.token, i.point.traits.hdim_q): i.tile.block_m for i in catalog.instances}
    assert tiles == {("sm80", 64): 64, ("sm90a", 64): 128, ("sm80", 128): 64, ("sm90a", 128): 64}


def test_tile_that_matches_nothing_is_an_error(config_error, line_of):
    dead = ("  - {pipeline: fa2, hdim_q: 256, hdim_v: 256, block_m: 128, block_n: 64, warps: 8, "
            "stages: 2, why: x}\n")
    error, text = config_error(("rules: []", dead + "rules: []"))
    assert "this entry matches no instance" in error.message
    assert error.line == line_of(text, "hdim_q: 256")


@pytest.mark.parametrize("old, new, reason", [
    ("warps: 4", "warps: 3", "block_m == 16 * warps or 32 * warps"),
    ("block_n: 32", "block_n: 40", "block_n % 16 == 0"),
    ("stages: 2\n    why", "stages: 3\n    why", "stages == 2"),
    ("hdim_v: 128\n", "hdim_v: 80\n", "hdim_q and hdim_v multiples of 32"),
])
def test_tile_violating_a_pipeline_constraint_is_an_error(config_error, line_of, old, new, reason):
    error, text = config_error((old, new))
    assert error.line == line_of(text, "  - pipeline: fa2")  # the d128 entry
    assert f"tiles[1]: pipeline fa2 needs {reason}" in error.message


def test_head_dims_that_are_multiples_of_32_are_valid(build):
    tile = ("  - {pipeline: fa2, hdim_q: 96, hdim_v: 32, block_m: 128, block_n: 64, warps: 4, "
            "stages: 2, why: x}\n")
    _, catalog = build(("    - [128, 128]", "    - [128, 128]\n    - [96, 32]"),
                       ("rules: []", tile + "rules: []"))
    assert any(name.startswith("fwd_fp16_d96x32_") for name in names(catalog))


# d128 with a 256x128 tile of 8 warps: 2 * (256 * 128 + 2 * 128 * 256) = 196608 bytes, past
# sm80's 166912 and within sm90a's 232448.
BIG_TILE = (("block_m: 64\n    block_n: 32\n    warps: 4",
             "block_m: 256\n    block_n: 128\n    warps: 8"),)


def test_tile_past_an_archs_shared_memory_is_an_error(config_error, line_of):
    error, text = config_error(*BIG_TILE)
    assert error.line == line_of(text, "  - pipeline: fa2")
    assert error.message == (
        "operations.fwd.tiles[1]: the tile needs 196608 bytes of shared memory (2 * (block_m * "
        "max(hdim_q, hdim_v) + stages * block_n * (hdim_q + hdim_v))), more than the 166912 a "
        "CTA may use on sm80")


def test_shared_memory_is_checked_only_on_the_archs_a_tile_is_used_on(build):
    _, catalog = build(*BIG_TILE, ("arch: [sm80, sm90a]", "arch: [sm90a]"))
    assert {i.tile.block_m for i in catalog.instances if i.point.traits.hdim_q == 128} == {256}
    rule = "rules:\n  - when: {arch: sm80, hdim_q: 128}\n    reason: too big for A100"
    build(*BIG_TILE, ("rules: []", rule))


def test_repository_tiles_fit_the_archs_they_are_used_on():
    # The largest: fa3's d256 128x80 takes 225 KB of H100's 227 (the rules keep fa3 off sm80);
    # fa2's d256 128x64 on sm90a 192 KB, and its 128x32 on sm80 128 KB of A100's 163. The
    # backward's: d256 64x64 on sm90a 209 KB, (192, 192) 64x64 161 KB on both.
    used = {(operation_of(i).kernel(i.point.pipeline), i.point.arch, i.point.traits, i.tile)
            for i in repository().catalog.instances}
    assert {(kernel.header, arch.token) for kernel, arch, *_ in used} == {
        ("fmha/kernels/fwd_fa2_sm80.cuh", "sm80"), ("fmha/kernels/fwd_fa2_sm80.cuh", "sm90a"),
        ("fmha/kernels/fwd_fa3_sm90.cuh", "sm90a"), ("fmha/kernels/bwd_fa2_sm80.cuh", "sm80"),
        ("fmha/kernels/bwd_fa2_sm80.cuh", "sm90a"), ("fmha/kernels/bwd_fa3_sm90.cuh", "sm90a"),
        ("fmha/kernels/kvcache_decode_split_kv.cuh", "sm80"),
        ("fmha/kernels/kvcache_decode_split_kv.cuh", "sm90a"),
        ("fmha/kernels/kvcache_chunked_prefill_sm90.cuh", "sm90a")}
    for kernel, arch, traits, tile in used:
        needed = kernel.shared_memory.needed(tile, traits, arch.smem_limit)
        assert needed <= arch.smem_limit, (kernel.header, arch.token, traits, needed)


# -- rules on head-dim pairs, negated conditions, anchors ------------------------------------

def test_rule_on_head_dim_pairs(build):
    rule = "rules:\n  - when: {hdim: [[128, 128], [256, 256]], mask: causal}\n    reason: test"
    _, catalog = build(("rules: []", rule))
    assert len(catalog.instances) == 24 and catalog.pruned == 8
    assert not any(n.startswith(("fwd_fp16_d128_causal", "fwd_bf16_d128_causal"))
                   for n in names(catalog))


def test_negated_condition_matches_every_other_value(build):
    rule = ("rules:\n  - when: {hdim: {not: [[64, 64]]}, mask: {not: none}, dtype: {not: fp16}}\n"
            "    reason: test")
    _, catalog = build(("rules: []", rule))
    assert catalog.pruned == 4
    assert not any(n.startswith("fwd_bf16_d128_causal") for n in names(catalog))


def test_a_yaml_anchor_names_a_list_for_several_rules(build):
    rules = ("rules:\n"
             "  - when: {hdim: {not: &kept [[64, 64]]}, arch: sm80}\n    reason: one\n"
             "  - when: {hdim: *kept, arch: sm90a, mask: causal}\n    reason: two")
    _, catalog = build(("rules: []", rules))
    assert {(i.point.arch.token, i.point.traits.hdim_q, i.point.traits.mask.token)
            for i in catalog.instances} == {("sm80", 64, "none"), ("sm80", 64, "causal"),
                                            ("sm90a", 64, "none"), ("sm90a", 128, "none"),
                                            ("sm90a", 128, "causal")}


# -- the fa3 pipeline ------------------------------------------------------------------------

FA3_TILES = ("  - {pipeline: fa3, hdim_q: 64, hdim_v: 64, block_m: 192, block_n: 128, warps: 16, "
             "stages: 2, why: fa3 d64}\n"
             "  - {pipeline: fa3, hdim_q: 128, hdim_v: 128, block_m: 128, block_n: 128, "
             "warps: 12, stages: 2, why: fa3 d128}\n")
# fa3 on sm90a only, where it serves what fa2 would.
FA3 = (("pipeline: [fa2]", "pipeline: [fa2, fa3]"),
       ("rules: []", FA3_TILES + "rules:\n  - when: {pipeline: fa3, arch: sm80}\n    reason: one\n"
                     "  - when: {pipeline: fa2, arch: sm90a}\n    reason: two"))


def test_fa3_instances_and_their_tiles(build):
    _, catalog = build(*FA3)
    assert len(catalog.instances) == 32
    # sm90a's fa3 first, and there the larger tile first among the unpadded instances.
    assert names(catalog)[0] == "fwd_bf16_d64_causal_fa3_sm90a_m192n128"
    assert {(i.point.pipeline.token, i.point.arch.token)
            for i in catalog.instances[:16]} == {("fa3", "sm90a")}
    tiles = {(i.point.pipeline.token, i.point.traits.hdim_q): i.tile for i in catalog.instances}
    assert tiles[("fa3", 64)] == Tile(192, 128, 16, 2)
    assert tiles[("fa3", 128)] == Tile(128, 128, 12, 2)


@pytest.mark.parametrize("old, new, reason", [
    ("block_m: 192, block_n: 128, warps: 16", "block_m: 160, block_n: 128, warps: 16",
     "block_m 128 or 192"),
    ("block_m: 192, block_n: 128, warps: 16", "block_m: 256, block_n: 128, warps: 20",
     "block_m 128 or 192"),
    ("block_m: 192, block_n: 128, warps: 16", "block_m: 192, block_n: 128, warps: 12",
     "warps == 4 * (block_m // 64 + 1)"),
    ("block_n: 128, warps: 16", "block_n: 120, warps: 16", "block_n % 16 == 0 and 16 <= block_n"),
    ("block_n: 128, warps: 16", "block_n: 272, warps: 16", "block_n % 16 == 0 and 16 <= block_n"),
    ("warps: 16, stages: 2", "warps: 16, stages: 1", "stages >= 2"),
    ("hdim_q: 64, hdim_v: 64, block_m: 192", "hdim_q: 96, hdim_v: 64, block_m: 192",
     "hdim_q and hdim_v multiples of 64"),
])
def test_fa3_tile_violating_a_constraint_is_an_error(config_error, line_of, old, new, reason):
    error, text = config_error(*FA3, (old, new))
    assert error.line == line_of(text, "why: fa3 d64")
    assert f"tiles[2]: pipeline fa3 needs {reason}" in error.message


def test_head_dim_padding_kept_for_an_exact_kernel_is_an_error(config_error, line_of):
    # fa3's kernels take exact head dims only (operations.Kernel.padded_hdim_step None).
    error, text = config_error(*FA3, ("pad_hdim: [false]", "pad_hdim: [false, true]"))
    assert error.line == line_of(text, "rules:")
    assert ("they keep pad_hdim=true points of pipeline fa3, whose kernel takes exact head dims "
            "only; add a rule with when: {pipeline: fa3, pad_hdim: true}") in error.message


def test_fa3_shared_memory_counts_its_barriers(config_error, line_of):
    # 2 * (128 * 128 + 2 * 256 * 256) + 1024 = 295936 bytes, past sm90a's 232448.
    error, text = config_error(*FA3, ("block_m: 128, block_n: 128, warps: 12",
                                      "block_m: 128, block_n: 256, warps: 12"))
    assert error.line == line_of(text, "why: fa3 d128")
    assert error.message == (
        "operations.fwd.tiles[3]: the tile needs 295936 bytes of shared memory (2 * (block_m * "
        "max(hdim_q, hdim_v) + stages * block_n * (hdim_q + hdim_v)) + 1024 (barriers and "
        "alignment)), more than the 232448 a CTA may use on sm90a")


def test_gaps_are_the_rules_on_a_pipelines_traits(build):
    rules = FA3[1][1] + (
        "\n  - when: {pipeline: fa3, mask: causal, hdim: [[128, 128]]}\n    reason: no causal d128"
        "\n  - when: {pipeline: fa3, dtype: bf16, pad_seqlen: true}\n    reason: a variant"
        "\n  - when: {dtype: fp16, mask: causal, hdim: [[64, 64]]}\n    reason: every pipeline")
    _, catalog = build(FA3[0], (FA3[1][0], rules))
    # The padding rule drops a variant, which another serves; a rule without a pipeline drops
    # the traits everywhere; fa3 has instances on sm90a only.
    (gap,) = catalog.gaps
    assert (gap.pipeline.token, gap.arch.token, gap.reason) == ("fa3", "sm90a", "no causal d128")
    assert [c.axis for c in gap.conditions] == ["mask", "hdim"]
    chosen = next(i for i in catalog.instances if i.name == "fwd_fp16_d128_causal_fa2_sm80_m64n32")
    traits = chosen.point.traits
    assert gap.matches(traits) and gap.describe(traits) == "mask=causal, hdim=128x128"
    assert not gap.matches(replace(traits, hdim_q=64, hdim_v=64))
    # A note only for an older pipeline on the gap's arch.
    assert fallback_notes(chosen, traits, catalog.gaps) == []
    on_sm90a = replace(chosen, point=replace(chosen.point, arch=ARCH.get("sm90a")))
    assert fallback_notes(on_sm90a, traits, catalog.gaps) == [
        "fa3 (sm90a) has no instance for mask=causal, hdim=128x128: no causal d128; falling "
        "back to fa2"]


# -- the bwd operation -----------------------------------------------------------------------

# 2 dtypes x 7 head dims x 3 masks x 3 biases x 2 modes x 2 dbias x 2 dropout x 2 softcap x
# 2 archs x 4 padding variants, with fa2 only.
# dtype x hdim x mask x bias x mode x dbias x dropout x softcap x pipeline x arch x padding
BWD_POINTS = 2 * 7 * 3 * 3 * 2 * 2 * 2 * 2 * 2 * 2 * 4
BWD_TILES = {  # (hdim_q, hdim_v, arch) -> fa2's tile
    **{(d, d, arch): Tile(64, 128, 8, 2) for d in (32, 96, 128) for arch in ("sm80", "sm90a")},
    **{(64, 64, arch): Tile(128, 128, 8, 2) for arch in ("sm80", "sm90a")},
    **{(192, d, arch): Tile(64, 64, 8, 2) for d in (128, 192) for arch in ("sm80", "sm90a")},
    (256, 256, "sm80"): Tile(32, 64, 8, 2), (256, 256, "sm90a"): Tile(64, 64, 8, 2)}


FA3_BWD_HDIMS = {(64, 64), (128, 128), (192, 128), (256, 256)}


def test_repository_bwd_matrix():
    # fa2: 2 dtypes x 7 head dims x 3 masks x 4 bias variants (none, elementwise with and
    # without dbias, ALiBi) x 2 dropout x 2 softcap = 672 trait combinations, each with 3
    # instances on each arch: batch mode unpadded and fully padded, group mode fully padded;
    # less the 24 unpadded ones on sm90a that fa3 serves (2 dtypes x 4 head dims x 3 masks,
    # batch mode, no bias, dropout or soft-cap). fa3: those 24 and their 24 in group mode,
    # padding sequence lengths only.
    catalog = repository().catalog
    bwd = catalog.of(OPERATION.get("bwd"))
    start = catalog.instances.index(bwd[0])
    assert len(bwd) == 672 * 3 * 2 - 24 + 48 and catalog.instances[start:start + len(bwd)] == bwd
    assert all(i.name.startswith("bwd_") for i in bwd)
    fa3 = [i for i in bwd if i.point.pipeline.token == "fa3"]
    assert {(i.point.traits.hdim_q, i.point.traits.mask.token, i.point.traits.dtype.token,
             i.point.traits.mode.token) for i in fa3} == {
        (d, m, t, mode) for d in (64, 128, 192, 256) for m in ("none", "causal", "window")
        for t in ("fp16", "bf16") for mode in ("batch", "group")} and len(fa3) == 48
    for instance in fa3:
        point, traits = instance.point, instance.point.traits
        assert point.arch.token == "sm90a" and point.pad_seqlen and not point.pad_hdim
        assert (traits.bias.token, traits.dropout, traits.softcap) == ("none", False, False)
        # d64: 128 query rows per step; (192, 128) and d256: both consumers on 64 keys (the
        # head-dim split).
        assert instance.tile == {64: Tile(128, 128, 12, 2), 128: Tile(64, 128, 12, 2),
                                 192: Tile(64, 64, 12, 2), 256: Tile(64, 64, 12, 2)}[
                                     traits.hdim_q]
    fa2 = [i for i in bwd if i.point.pipeline.token == "fa2"]
    combinations = {(i.point.traits.hdim_q, i.point.traits.hdim_v, i.point.arch.token,
                     i.point.pad_seqlen) for i in fa2}
    assert len(combinations) == 7 * 2 * 2  # every head dim, padded or not, on either arch
    for instance in fa2:
        point, traits = instance.point, instance.point.traits
        assert point.pad_seqlen == point.pad_hdim
        # fa2's fast path on sm90a is only for what fa3 does not serve.
        assert (point.arch.token == "sm80" or point.pad_hdim
                or (traits.hdim_q, traits.hdim_v) not in FA3_BWD_HDIMS
                or traits.mode.token == "group"  # fa2 pads seqlens in group mode only
                or traits.bias.token != "none" or traits.dropout or traits.softcap)
        assert traits.mode.token == "batch" or point.pad_seqlen
        assert not traits.dbias or traits.bias.token == "elementwise"
        assert instance.tile == BWD_TILES[(traits.hdim_q, traits.hdim_v, point.arch.token)]
    # fa3 has no backward for these traits (instances.yaml's rules); explain quotes the reasons.
    assert {(gap.pipeline.token, gap.arch.token, tuple(c.axis for c in gap.conditions))
            for gap in catalog.gaps if gap.op.token == "bwd"} == {
        ("fa3", "sm90a", (axis,)) for axis in ("hdim", "bias", "dropout", "softcap")}


@pytest.mark.parametrize("fields, name", [
    ({}, "bwd_fp16_d64_fa2_sm80_m64n128"),
    ({"mask": "window", "pad_seqlen": True, "pad_hdim": True},
     "bwd_fp16_d64_window_fa2_sm80_m64n128_pad_hpad"),
    ({"dtype": "bf16", "hdim": (192, 128), "mask": "causal", "bias": "elementwise",
      "mode": "group", "dbias": True, "dropout": True, "softcap": True, "arch": "sm90a",
      "pad_seqlen": True, "pad_hdim": True, "tile": Tile(64, 64, 8, 2)},
     "bwd_bf16_d192x128_causal_elementwise_group_dbias_dropout_softcap_fa2_sm90a_m64n64_pad_hpad"),
    ({"bias": "alibi", "softcap": True}, "bwd_fp16_d64_alibi_softcap_fa2_sm80_m64n128"),
])
def test_bwd_name_grammar(make_bwd_instance, fields, name):
    assert make_bwd_instance(**fields).name == name


def test_bwd_operation_of_the_base_config(build):
    _, catalog = build(BWD_OPERATION)
    fwd, bwd = catalog.of(OPERATION.get("fwd")), catalog.of(OPERATION.get("bwd"))
    assert len(fwd) == len(bwd) == 32 and catalog.instances == fwd + bwd
    assert {(i.point.traits.hdim_q, i.tile) for i in bwd} == {
        (64, Tile(64, 128, 8, 2)), (128, Tile(64, 64, 4, 2))}
    # The larger tile first: 64 x 128 at d64 before 64 x 64 at d128.
    assert names(catalog)[32] == "bwd_bf16_d64_causal_fa2_sm90a_m64n128"


def test_bwd_rules(build):
    rules = ("    rules:\n      - when: {dbias: true, bias: {not: elementwise}}\n"
             "        reason: no bias gradient")
    bwd_with_rules = (BWD_OPERATION[0], BWD_OPERATION[1].replace("    rules: []", rules))
    _, catalog = build(bwd_with_rules, ("bias: [none]", "bias: [none, elementwise, alibi]"),
                       ("dbias: [false]", "dbias: [false, true]"))
    bwd = catalog.of(OPERATION.get("bwd"))
    # fwd: 3 biases; bwd: none, elementwise with and without dbias, alibi.
    assert len(catalog.of(OPERATION.get("fwd"))) == 32 * 3 and len(bwd) == 32 * 4
    assert {(i.point.traits.bias.token, i.point.traits.dbias) for i in bwd} == {
        ("none", False), ("elementwise", False), ("elementwise", True), ("alibi", False)}
    assert catalog.pruned == 32 * 2


SHARED_GROUP_RULE = ("operations:\n", "rules:\n  - when: {mode: group, pad_seqlen: false}\n"
                                      "    reason: ragged\noperations:\n")


def test_a_shared_rule_prunes_every_operation(build):
    _, catalog = build(BWD_OPERATION, ("mode: [batch]", "mode: [batch, group]"),
                       SHARED_GROUP_RULE)
    for op in ("fwd", "bwd"):
        instances = catalog.of(OPERATION.get(op))
        assert len(instances) == 48
        assert all(i.point.pad_seqlen for i in instances if i.point.traits.mode.token == "group")


def test_a_shared_rule_may_match_one_operation_only(build):
    # fa3 is fwd's only: the shared rule on it prunes fwd points alone, and is not dead.
    shared = ("operations:\n", "rules:\n  - when: {pipeline: fa3, arch: sm80}\n"
                               "    reason: one\noperations:\n")
    fwd_rules = ("rules: []", FA3_TILES + "rules:\n  - when: {pipeline: fa2, arch: sm90a}\n"
                                          "    reason: two")
    _, catalog = build(BWD_OPERATION, FA3[0], fwd_rules, shared)
    assert len(catalog.of(OPERATION.get("fwd"))) == len(catalog.of(OPERATION.get("bwd"))) == 32
    assert catalog.pruned == 32


def test_a_shared_rule_that_matches_nothing_is_an_error(config_error, line_of):
    error, text = config_error(BWD_OPERATION, ("operations:\n", "rules:\n  - when: {hdim_v: 256}\n"
                                                                "    reason: dead\noperations:\n"))
    assert error.message == ("rules[0]: this rule matches no point of the matrix of any "
                             "operation; fix or remove it")
    assert error.line == line_of(text, "hdim_v: 256")


# The bwd d64 tile of BWD_OPERATION: 64 x 128 on 8 warps, 32 keys per warp (d64: hdim_q + hdim_v
# <= 256) shared by two warps.
KEYS = "block_n % warp_keys == 0, warps % (block_n / warp_keys) == 0 and split_d = warps / "
DQ = "warps % (block_m / r) == 0 and (hdim_q / (warps / (block_m / r))) % 16 == 0 for r = 32"


@pytest.mark.parametrize("old, new, reason", [
    ("block_n: 128, warps: 8", "block_n: 112, warps: 8", KEYS),  # 112 % 32
    ("block_n: 128, warps: 8", "block_n: 32, warps: 8", KEYS),  # 8 warps on 32 keys
    ("block_n: 128, warps: 8", "block_n: 128, warps: 6", KEYS),  # 6 warps on 4 key slices
    ("block_n: 128, warps: 8", "block_n: 256, warps: 8", "split_d == 2 where warp_keys == 32"),
    ("block_m: 64, block_n: 128", "block_m: 48, block_n: 128", "block_m % (16 * split_d) == 0"),
    ("block_m: 64, block_n: 128", "block_m: 96, block_n: 128", DQ),  # 3 or 6 row groups, 8 warps
    ("block_m: 64, block_n: 128, warps: 8", "block_m: 32, block_n: 256, warps: 16",
     DQ),  # dQ: 64 columns over 8 column groups
    ("hdim_v: 64, block_m: 64", "hdim_v: 80, block_m: 64",
     "(hdim_q / split_d) % 16 == 0 and (hdim_v / split_d) % 16 == 0"),
    ("hdim_q: 64, hdim_v: 64, block_m: 64", "hdim_q: 224, hdim_v: 48, block_m: 64",
     "hdim_q, hdim_v and block_m multiples of 32"),  # 16 keys a warp past 256, split_d 1
    ("warps: 8, stages: 2, why: bwd d64", "warps: 8, stages: 3, why: bwd d64", "stages == 2"),
])
def test_bwd_tile_violating_a_constraint_is_an_error(config_error, line_of, old, new, reason):
    error, text = config_error(BWD_OPERATION, (old, new))
    assert error.line == line_of(text, "why: bwd d64")
    assert error.message.startswith(f"operations.bwd.tiles[0]: pipeline fa2 needs {reason}")


def test_bwd_shared_memory_is_checked_per_arch(config_error, line_of, build):
    # d128 with 32 x 256 on 16 warps: 2 * 256 * 256 + 2 * (2 * 32 * 256 + 8 * 32)
    # + 2 * 256 * 32 * 2 = 197120 bytes, past sm80's 166912 and within sm90a's 232448.
    big = ("block_m: 64, block_n: 64, warps: 4", "block_m: 32, block_n: 256, warps: 16")
    error, text = config_error(BWD_OPERATION, big)
    assert error.line == line_of(text, "why: bwd d128")
    assert error.message == (
        "operations.bwd.tiles[1]: the tile needs 197120 bytes of shared memory (2 * block_n * "
        "(hdim_q + hdim_v) + stages * (2 * block_m * (hdim_q + hdim_v) + 8 * block_m) + 2 * "
        "block_n * block_m * (2 if split_d > 1 else 1)), more than the 166912 a CTA may use on "
        "sm80")
    _, catalog = build(BWD_OPERATION, big, ("arch: [sm80, sm90a]", "arch: [sm90a]"))
    assert {i.tile.block_n for i in catalog.of(OPERATION.get("bwd"))
            if i.point.traits.hdim_q == 128} == {256}


def test_bwd_shared_memory_matches_the_kernels_formula():
    # BwdConfig::kSmemBytes of bwd_fa2_sm80.cuh, for the repository's tiles: K and V, two
    # stages of Q, dO and 8 bytes per row, dS^T (and P^T when two warps share a warp's keys:
    # 32 keys per warp at d128 make 8 warps on 128 keys share them, 16 at d192 on 64).
    kernel = operation_of(repository().catalog.of(OPERATION.get("bwd"))[0]).kernel(
        PIPELINE.get("fa2"))
    def needed(tile, hdim):
        return kernel.shared_memory.bytes(tile, make_traits("bwd", hdim))
    assert needed(Tile(64, 128, 8, 2), (128, 128)) == 164864
    # One warp on its 16 keys (split_d 1): dS^T alone.
    assert needed(Tile(64, 128, 8, 2), (192, 128)) == 181248
    assert needed(Tile(64, 64, 8, 2), (192, 192)) == 164864
    assert needed(Tile(32, 64, 8, 2), (256, 256)) == 139776
    assert needed(Tile(64, 64, 8, 2), (256, 256)) == 214016


# -- the kvcache operation -------------------------------------------------------------------

# dtype x kv_dtype x hdim x mask x bias x paged x softcap x pipeline x arch x padding
KVCACHE_POINTS = 2 * 2 * 7 * 3 * 3 * 2 * 2 * 2 * 2 * 4


def test_repository_kvcache_matrix():
    # fa2 (decode), on a cache of the queries' dtype: 2 dtypes x 6 head dims (hdim_q ==
    # hdim_v) x 3 masks x 2 biases (none, ALiBi) x 2 (contiguous, paged) x 2 softcap on 2 archs
    # x exact and padded head dims: 1152; on an e4m3 cache the same at exact head dims only,
    # of 64, 128, 192 and 256: 384. fa3 (chunked prefill): 2 dtypes x head dims 64, 128 and
    # 256 x 3 masks x 2 (contiguous, paged) on sm90a, without ALiBi or soft-cap, exact head
    # dims, on a cache of the queries' dtype: 36; on an e4m3 cache the same at head dims 64 and
    # 128: 24. Each pads sequence lengths; kvcache's is the last table of the catalog.
    catalog = repository().catalog
    kvcache = catalog.of(OPERATION.get("kvcache"))
    assert catalog.instances[-len(kvcache):] == kvcache
    assert all(i.name.startswith("kvcache_") and i.point.pad_seqlen for i in kvcache)
    decode = [i for i in kvcache if i.point.pipeline.token == "fa2"]
    prefill = [i for i in kvcache if i.point.pipeline.token == "fa3"]
    e4m3 = [i for i in decode if i.point.traits.kv_dtype.token == "e4m3"]
    assert (len(decode), len(e4m3), len(prefill)) == (1152 + 384, 384, 36 + 24)
    assert {i.point.traits.hdim_q for i in e4m3} == {64, 128, 192, 256}
    assert sum(i.point.pad_hdim for i in decode) == 576
    assert not any(i.point.pad_hdim for i in (*prefill, *e4m3))
    assert all(i.name.startswith(f"kvcache_{i.point.traits.dtype.token}_kve4m3_d") for i in e4m3)
    assert {(i.point.traits.kv_dtype.token, i.point.traits.hdim_q) for i in prefill} == {
        ("same", 64), ("same", 128), ("same", 256), ("e4m3", 64), ("e4m3", 128)}
    assert {(i.point.traits.hdim_q, i.point.traits.hdim_v) for i in decode} == {
        (d, d) for d in (32, 64, 96, 128, 192, 256)}
    assert {i.point.traits.bias.token for i in decode} == {"none", "alibi"}
    for instance in decode:
        point = instance.point
        # Three stages but where they would pass A100's shared memory (d256: 200 KB); on sm90a
        # d64 (both caches) in 8 warps on 128-key tiles, with the 4-warp tile for calls that
        # fill every SM; an e4m3 cache at d128 on sm90a in 4 warps on 128-key tiles (its rows
        # are half as long). Every other e4m3 instance takes its 16-bit tile.
        a100_d256 = point.arch.token == "sm80" and point.traits.hdim_q == 256
        eight_warps = point.arch.token == "sm90a" and point.traits.hdim_q == 64
        e4m3_d128 = (point.arch.token == "sm90a" and point.traits.hdim_q == 128
                     and point.traits.kv_dtype.token == "e4m3")
        expected = (Tile(16, 128, 8, 3, full_grid=Tile(16, 64, 4, 3)) if eight_warps
                    else Tile(16, 128, 4, 3) if e4m3_d128
                    else Tile(16, 64, 4, 2 if a100_d256 else 3))
        assert instance.tile == expected
    forward_tiles = {i.point.traits.hdim_q: i.tile for i in catalog.of(OPERATION.get("fwd"))
                     if i.point.pipeline.token == "fa3" and i.point.traits.dtype.size == 2}
    for instance in prefill:
        point, traits = instance.point, instance.point.traits
        assert point.arch.token == "sm90a" and traits.hdim_q in (64, 128, 256)
        assert traits.bias.token == "none" and not traits.softcap
        assert instance.tile == forward_tiles[traits.hdim_q]
    # The calls fa3 leaves to the decode kernel on sm90a: other head dims, ALiBi, soft-cap, an
    # e4m3 cache at d256.
    gaps = {gap.reason.split(";")[0].split(":")[0]: gap for gap in catalog.gaps
            if gap.op.token == "kvcache"}
    assert sorted(gaps) == [
        "chunked prefill from an e4m3 cache holds each K and V stage twice, in e4m3 as TMA lands "
        "it and in fp16 as the consumers read it (3 bytes an element)",
        "chunked prefill runs on the fa3 forward's tiles, which it has for head dims 64, 128 "
        "and 256 here", "the fa3 forward has no ALiBi yet", "the fa3 forward has no "
        "soft-capping yet"]
    e4m3_gap = gaps[min(gaps)]
    assert [c.axis for c in e4m3_gap.conditions] == ["kv_dtype", "hdim"]
    assert e4m3_gap.reason.endswith("d256 e4m3 calls run the decode kernel at every chunk size")


@pytest.mark.parametrize("fields, name", [
    ({}, "kvcache_fp16_d64_fa2_sm80_m16n64_pad"),
    ({"dtype": "bf16", "hdim": (128, 128), "mask": "causal", "paged": True, "arch": "sm90a"},
     "kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad"),
    ({"mask": "window", "bias": "alibi", "paged": True, "softcap": True},
     "kvcache_fp16_d64_window_alibi_paged_softcap_fa2_sm80_m16n64_pad"),
    # An e4m3 cache says so after the dtype, the queries'; a cache of their dtype says nothing.
    ({"dtype": "bf16", "kv_dtype": "e4m3", "hdim": (128, 128), "mask": "causal", "paged": True,
      "arch": "sm90a", "tile": Tile(16, 128, 4, 3)},
     "kvcache_bf16_kve4m3_d128_causal_paged_fa2_sm90a_m16n128_pad"),
    ({"kv_dtype": "e4m3", "hdim": (192, 128)}, "kvcache_fp16_kve4m3_d192x128_fa2_sm80_m16n64_pad"),
])
def test_kvcache_name_grammar(make_kvcache_instance, fields, name):
    assert make_kvcache_instance(**fields).name == name


def test_kvcache_operation_of_the_base_config(build):
    _, catalog = build(BWD_OPERATION, KVCACHE_OPERATION)
    fwd, bwd, kvcache = (catalog.of(OPERATION.get(op)) for op in ("fwd", "bwd", "kvcache"))
    assert len(fwd) == len(bwd) == len(kvcache) == 32
    assert catalog.instances == fwd + bwd + kvcache
    # The top matrix's mode and dropout are not kvcache's; its rule keeps the padded ones.
    assert all(i.point.pad_seqlen and not hasattr(i.point.traits, "mode") for i in kvcache)
    assert {i.point.traits.paged for i in kvcache} == {False, True}
    assert names(catalog)[64] == "kvcache_bf16_d128_causal_fa2_sm90a_m16n128_pad"


D128_TILE = ("  - {pipeline: fa2, hdim_q: 128, hdim_v: 128, block_m: 16, block_n: 128, warps: 4, "
             "stages: 2, why: kvcache d128}")


def test_kvcache_tiles_may_differ_for_paged_caches(build):
    # `paged` selects a kvcache tile entry's points: here d128's paged instances take 8 warps.
    paged_tile = ("  - {pipeline: fa2, paged: true, hdim_q: 128, hdim_v: 128, block_m: 16, "
                  "block_n: 128, warps: 8, stages: 2, why: kvcache d128 paged}\n"
                  "  - {pipeline: fa2, paged: false, hdim_q: 128, hdim_v: 128, block_m: 16, "
                  "block_n: 128, warps: 4, stages: 2, why: kvcache d128}")
    _, catalog = build(BWD_OPERATION, KVCACHE_OPERATION, (D128_TILE, paged_tile))
    d128 = [i for i in catalog.of(OPERATION.get("kvcache")) if i.point.traits.hdim_q == 128]
    assert {(i.point.traits.paged, i.tile.warps) for i in d128} == {(True, 8), (False, 4)}


def test_a_tile_entry_both_with_and_without_paged_is_an_error(config_error, line_of):
    paged_tile = ("  - {pipeline: fa2, paged: true, hdim_q: 128, hdim_v: 128, block_m: 16, "
                  "block_n: 128, warps: 8, stages: 2, why: kvcache d128 paged}")
    error, text = config_error(BWD_OPERATION, KVCACHE_OPERATION,
                               (D128_TILE, D128_TILE + "\n" + paged_tile))
    assert error.line == line_of(text, "why: kvcache d128 paged")
    assert error.message.endswith("both match pipeline=fa2, arch=sm80, hdim_q=128, hdim_v=128, "
                                  "kv_dtype=same, paged=true; each instance needs exactly one")


def test_paged_selects_no_tile_of_an_operation_without_it(config_error, line_of):
    error, _ = config_error(("pipeline: fa2, hdim_q: 64", "pipeline: fa2, paged: true, hdim_q: 64"))
    assert "paged" in error.message


# `kv_dtype` selects a kvcache tile entry's points as `paged` does: here d128's e4m3 instances
# take 3 stages. KVCACHE_E4M3 gives the base config's kvcache operation both caches.
KVCACHE_E4M3 = ("kv_dtype: [same]", "kv_dtype: [same, e4m3]")
D128_E4M3_TILE = ("  - {pipeline: fa2, kv_dtype: e4m3, hdim_q: 128, hdim_v: 128, block_m: 16, "
                  "block_n: 128, warps: 4, stages: 3, why: kvcache d128 e4m3}")


def test_kvcache_tiles_may_differ_for_e4m3_caches(build):
    same_tile = D128_TILE.replace("{pipeline: fa2,", "{pipeline: fa2, kv_dtype: same,")
    _, catalog = build(BWD_OPERATION, KVCACHE_OPERATION, KVCACHE_E4M3,
                       (D128_TILE, same_tile + "\n" + D128_E4M3_TILE))
    kvcache = catalog.of(OPERATION.get("kvcache"))
    d128 = [i for i in kvcache if i.point.traits.hdim_q == 128]
    assert {(i.point.traits.kv_dtype.token, i.tile.stages) for i in d128} == {("same", 2),
                                                                              ("e4m3", 3)}
    # The d64 entry names no kv_dtype: it serves both caches.
    assert {(i.point.traits.kv_dtype.token, i.tile) for i in kvcache
            if i.point.traits.hdim_q == 64} == {("same", Tile(16, 64, 4, 2)),
                                                ("e4m3", Tile(16, 64, 4, 2))}
    assert "kvcache_bf16_kve4m3_d128_causal_paged_fa2_sm90a_m16n128_pad" in names(catalog)


def test_kv_dtype_combines_with_arch_and_paged(build):
    # The repository's layout: e4m3 on sm90a has its own tile, sm80 one for both caches.
    tiles = ("  - {pipeline: fa2, arch: sm80, hdim_q: 128, hdim_v: 128, block_m: 16, "
             "block_n: 64, warps: 4, stages: 2, why: kvcache d128 sm80}\n"
             "  - {pipeline: fa2, kv_dtype: same, arch: sm90a, hdim_q: 128, hdim_v: 128, "
             "block_m: 16, block_n: 128, warps: 4, stages: 2, why: kvcache d128}\n"
             "  - {pipeline: fa2, kv_dtype: e4m3, arch: sm90a, paged: true, hdim_q: 128, "
             "hdim_v: 128, block_m: 16, block_n: 128, warps: 8, stages: 3, why: e4m3 paged}\n"
             "  - {pipeline: fa2, kv_dtype: e4m3, arch: sm90a, paged: false, hdim_q: 128, "
             "hdim_v: 128, block_m: 16, block_n: 128, warps: 4, stages: 3, why: e4m3}")
    _, catalog = build(BWD_OPERATION, KVCACHE_OPERATION, KVCACHE_E4M3, (D128_TILE, tiles))
    d128 = {(i.point.arch.token, i.point.traits.kv_dtype.token, i.point.traits.paged, i.tile)
            for i in catalog.of(OPERATION.get("kvcache")) if i.point.traits.hdim_q == 128}
    assert d128 == {("sm80", kv, paged, Tile(16, 64, 4, 2))
                    for kv in ("same", "e4m3") for paged in (False, True)} | {
        ("sm90a", "same", False, Tile(16, 128, 4, 2)), ("sm90a", "same", True, Tile(16, 128, 4, 2)),
        ("sm90a", "e4m3", False, Tile(16, 128, 4, 3)), ("sm90a", "e4m3", True, Tile(16, 128, 8, 3))}


def test_a_tile_entry_both_with_and_without_kv_dtype_is_an_error(config_error, line_of):
    error, text = config_error(BWD_OPERATION, KVCACHE_OPERATION, KVCACHE_E4M3,
                               (D128_TILE, D128_TILE + "\n" + D128_E4M3_TILE))
    assert error.line == line_of(text, "why: kvcache d128 e4m3")
    assert error.message == (
        f"operations.kvcache.tiles: this entry and the one at line "
        f"{line_of(text, 'why: kvcache d128}')} both match pipeline=fa2, arch=sm80, hdim_q=128, "
        f"hdim_v=128, kv_dtype=e4m3, paged=false; each instance needs exactly one")


def test_an_e4m3_point_without_a_tile_is_an_error(config_error, line_of):
    same_tile = D128_TILE.replace("{pipeline: fa2,", "{pipeline: fa2, kv_dtype: same,")
    error, text = config_error(BWD_OPERATION, KVCACHE_OPERATION, KVCACHE_E4M3,
                               (D128_TILE, same_tile))
    assert error.line == text.count("\n", 0, text.rindex("    tiles:")) + 1  # kvcache's
    assert error.message == ("operations.kvcache.tiles: no entry matches pipeline=fa2, arch=sm80, "
                             "hdim_q=128, hdim_v=128, kv_dtype=e4m3, paged=false; add one")


def test_a_kv_dtype_entry_that_matches_nothing_is_an_error(config_error, line_of):
    # The matrix has no e4m3 cache, so the entry serves no instance.
    error, text = config_error(BWD_OPERATION, KVCACHE_OPERATION,
                               (D128_TILE, D128_TILE + "\n" + D128_E4M3_TILE))
    assert error.line == line_of(text, "why: kvcache d128 e4m3")
    assert error.message == ("operations.kvcache.tiles[2]: this entry matches no instance; fix "
                             "or remove it")


@pytest.mark.parametrize("old, new, fragment, message", [
    ("kv_dtype: e4m3, hdim_q", "kv_dtype: fp8, hdim_q", "kv_dtype: fp8",
     "operations.kvcache.tiles[2].kv_dtype: unknown value 'fp8'; valid: same, e4m3"),
    ("kv_dtype: e4m3, hdim_q", "kv_dtype: [e4m3], hdim_q", "kv_dtype: [e4m3]",
     "operations.kvcache.tiles[2].kv_dtype: got a list; valid: same, e4m3"),
])
def test_a_wrong_kv_dtype_of_a_tile_is_reported_at_its_line(config_error, line_of, old, new,
                                                            fragment, message):
    error, text = config_error(BWD_OPERATION, KVCACHE_OPERATION, KVCACHE_E4M3,
                               (D128_TILE, D128_TILE + "\n" + D128_E4M3_TILE.replace(old, new)))
    assert error.line == line_of(text, fragment)
    assert error.message == message


def test_kv_dtype_selects_no_tile_of_an_operation_without_it(config_error, line_of):
    error, text = config_error(("pipeline: fa2, hdim_q: 64",
                                "pipeline: fa2, kv_dtype: e4m3, hdim_q: 64"))
    assert error.line == line_of(text, "kv_dtype: e4m3")
    assert error.message == ("operations.fwd.tiles[0]: unknown key 'kv_dtype'; valid: pipeline, "
                             "hdim_q, hdim_v, block_m, block_n, warps, stages, why, arch, "
                             "dtype, vlayout, full_grid")


FULL_GRID_D128 = D128_TILE.replace("stages: 2,", "stages: 2, full_grid: {block_n: 64, warps: 4, "
                                                "stages: 3},")


def test_kvcache_full_grid_tile_rides_with_the_tile(build):
    # A kvcache fa2 tile may name the tile of calls that fill every SM: the instances keep the
    # entry's tile (and name) and carry the second one, with the entry's block_m.
    _, catalog = build(BWD_OPERATION, KVCACHE_OPERATION, (D128_TILE, FULL_GRID_D128))
    tiles = {(i.point.traits.hdim_q, i.tile) for i in catalog.of(OPERATION.get("kvcache"))}
    assert tiles == {(64, Tile(16, 64, 4, 2)),
                     (128, Tile(16, 128, 4, 2, full_grid=Tile(16, 64, 4, 3)))}


@pytest.mark.parametrize("old, new, fragment, message", [
    # Only a launcher that takes a second config may have one.
    ("warps: 8, stages: 2, why: d64}",
     "warps: 8, stages: 2, full_grid: {block_n: 64, warps: 4, stages: 2}, why: d64}", "why: d64}",
     "operations.fwd.tiles[0].full_grid: pipeline fa2 of fwd runs one tile for every call; a "
     "full-grid tile is for kvcache's fa2"),
    # It shares the entry's block_m (the packed rows of a CTA) and names the rest.
    (D128_TILE, FULL_GRID_D128.replace("{block_n: 64", "{block_m: 16, block_n: 64"),
     "why: kvcache d128", "operations.kvcache.tiles[1].full_grid: unknown key 'block_m'; valid: "
     "block_n, warps, stages"),
    (D128_TILE, FULL_GRID_D128.replace(" warps: 4, stages: 3}", " stages: 3}"),
     "why: kvcache d128", "operations.kvcache.tiles[1].full_grid: missing field 'warps'"),
    # The kernel's constraints hold for it too.
    (D128_TILE, FULL_GRID_D128.replace("{block_n: 64", "{block_n: 48"), "why: kvcache d128",
     "operations.kvcache.tiles[1].full_grid: pipeline fa2 needs block_n % (16 * warps) == 0"),
    # So does the arch's shared memory: 2 * (16 * 128 + 3 * 256 * 256) + 4 * 4 * 256 bytes.
    (D128_TILE, FULL_GRID_D128.replace("{block_n: 64", "{block_n: 256"), "why: kvcache d128",
     "operations.kvcache.tiles[1]: its full-grid tile needs 401408 bytes of shared memory"),
])
def test_a_wrong_full_grid_tile_is_an_error(config_error, line_of, old, new, fragment, message):
    error, text = config_error(BWD_OPERATION, KVCACHE_OPERATION, (old, new))
    assert error.line == line_of(text, fragment)
    assert error.message.startswith(message)


@pytest.mark.parametrize("old, new, reason", [
    ("block_m: 16, block_n: 64", "block_m: 32, block_n: 64", "block_m == 16"),
    ("block_n: 64, warps: 4", "block_n: 48, warps: 4", "block_n % (16 * warps) == 0"),
    ("block_n: 64, warps: 4", "block_n: 64, warps: 8", "block_n % (16 * warps) == 0"),
    ("warps: 4, stages: 2, why: kvcache d64", "warps: 4, stages: 1, why: kvcache d64",
     "stages >= 2"),
    ("hdim_q: 64, hdim_v: 64, block_m: 16", "hdim_q: 64, hdim_v: 80, block_m: 16",
     "hdim_q and hdim_v multiples of 32"),
])
def test_kvcache_tile_violating_a_constraint_is_an_error(config_error, line_of, old, new, reason):
    error, text = config_error(KVCACHE_OPERATION, (old, new))
    assert error.line == line_of(text, "why: kvcache d64")
    assert error.message.startswith(f"operations.kvcache.tiles[0]: pipeline fa2 needs {reason}")


def test_kvcache_shared_memory_matches_the_kernels_formula(config_error, line_of):
    # decode::Config::kSmemBytes of a paged instance: Q, K and V per stage, and the table
    # entries of stages + 1 key tiles. The repository's d256 sm80 tile: 139264 + 768 bytes,
    # within A100's 163 KB.
    kernel = operation_of(repository().catalog.of(OPERATION.get("kvcache"))[0]
                          ).kernel(PIPELINE.get("fa2"))
    assert kernel.shared_memory.bytes(Tile(16, 64, 4, 2), make_traits("kvcache", (256, 256))) == (
        139264 + 768)
    # An e4m3 cache's K and V tiles take a byte an element (SmemTile<kBlockN, kHeadDimQK /
    # kCacheElementsPer16Bit>), Q two: the repository's e4m3 d128 sm90a tile, 128 keys in three
    # stages, 16 * 128 * 2 + 3 * 128 * 256 + 4 * 4 * 128 bytes (32 KB a stage).
    e4m3_cache = make_traits("kvcache", (128, 128), kv_dtype="e4m3")
    assert kernel.shared_memory.bytes(Tile(16, 128, 4, 3), e4m3_cache) == 4096 + 98304 + 2048
    # d128 with 256-key steps in three stages: 2 * 16 * 128 + 2 * 3 * 256 * 256 + 4 * 4 * 256 =
    # 401408 bytes.
    error, text = config_error(KVCACHE_OPERATION, ("block_n: 128, warps: 4, stages: 2",
                                                   "block_n: 256, warps: 4, stages: 3"))
    assert error.line == line_of(text, "why: kvcache d128")
    assert error.message == (
        "operations.kvcache.tiles[1]: the tile needs 401408 bytes of shared memory (2 * block_m * "
        "hdim_q + kv_size * stages * block_n * (hdim_q + hdim_v) + 4 * (stages + 1) * block_n, "
        "kv_size 2, or 1 of an e4m3 cache), more than the 166912 a CTA may use on sm80")


# d128 with 128-key steps in four stages: 268800 bytes of a 16-bit cache, past both archs'
# limits, and 4096 + 131072 + 2560 = 137728 of an e4m3 one, within A100's 163 KB.
BIG_D128_TILE = ("  - {pipeline: fa2, hdim_q: 128, hdim_v: 128, block_m: 16, block_n: 128, "
                 "warps: 4, stages: 4, why: big d128}")


def test_kvcache_shared_memory_is_checked_per_cache_dtype(config_error, line_of, build):
    # The tile fits an e4m3 cache's instances...
    e4m3_only = BIG_D128_TILE.replace("{pipeline: fa2,", "{pipeline: fa2, kv_dtype: e4m3,")
    same_tile = D128_TILE.replace("{pipeline: fa2,", "{pipeline: fa2, kv_dtype: same,")
    _, catalog = build(KVCACHE_OPERATION, KVCACHE_E4M3,
                       (D128_TILE, same_tile + "\n" + e4m3_only))
    assert {i.tile.stages for i in catalog.of(OPERATION.get("kvcache"))
            if i.point.traits.kv_dtype.token == "e4m3" and i.point.traits.hdim_q == 128} == {4}
    # ...and not a 16-bit cache's, which an entry without kv_dtype serves too.
    error, text = config_error(KVCACHE_OPERATION, KVCACHE_E4M3, (D128_TILE, BIG_D128_TILE))
    assert error.line == line_of(text, "why: big d128")
    assert error.message.startswith("operations.kvcache.tiles[1]: the tile needs 268800 bytes "
                                    "of shared memory")


SM90A_SMEM = ARCH.get("sm90a").smem_limit  # 232448: 227 KB


def chunked_prefill_smem():
    return operation_of(repository().catalog.of(OPERATION.get("kvcache"))[0]).kernel(
        PIPELINE.get("fa3")).shared_memory


def test_chunked_prefill_from_an_e4m3_cache_takes_shared_memory_of_its_own():
    # chunked_prefill::Config of an e4m3 cache: Q and the K/V stages in fp16, the cache's
    # staging stages a byte an element (3 bytes a K or V element a stage), O in its own region
    # where it fits under the limit (kSeparateO), 1 KB of barriers and alignment.
    smem = chunked_prefill_smem()
    e4m3 = {d: make_traits("kvcache", (d, d), kv_dtype="e4m3") for d in (64, 128, 256)}
    # d64, 192x128 in 2 stages: 24 + 96 + 24 (O) + 1 KB.
    assert smem.needed(Tile(192, 128, 16, 2), e4m3[64], SM90A_SMEM) == (
        2 * 192 * 64 + 3 * 2 * 128 * 128 + 2 * 192 * 64 + 1024) == 148480
    # d128, 128x128 in 2 stages: 32 + 192 + 1 KB = 225 KB; O's 32 KB more would pass 227 KB,
    # so O is staged over Q. Under a larger limit it would take its own region.
    assert smem.needed(Tile(128, 128, 12, 2), e4m3[128], SM90A_SMEM) == (
        2 * 128 * 128 + 3 * 2 * 128 * 256 + 1024) == 230400
    assert smem.needed(Tile(128, 128, 12, 2), e4m3[128], 1 << 20) == 230400 + 32768
    # d256's 128x80 tile: 64 + 240 KB, past the limit with or without O (instances.yaml prunes it).
    assert smem.needed(Tile(128, 80, 12, 2), e4m3[256], SM90A_SMEM) == 65536 + 245760 + 1024
    # A 16-bit cache takes the forward's count (O over Q), whatever the limit.
    fwd_fa3 = operation_of(repository().catalog.of(OPERATION.get("fwd"))[0]).kernel(
        PIPELINE.get("fa3")).shared_memory
    for d, tile in ((64, Tile(192, 128, 16, 2)), (128, Tile(128, 128, 12, 2)),
                    (256, Tile(128, 80, 12, 2))):
        same = make_traits("kvcache", (d, d))
        assert smem.needed(tile, same, SM90A_SMEM) == smem.needed(tile, same, 1 << 20) == (
            fwd_fa3.bytes(tile, make_traits("fwd", (d, d)))) == (
            2 * (tile.block_m * d + 2 * tile.block_n * 2 * d) + 1024)
        assert smem.formula(same) == fwd_fa3.formula(make_traits("fwd", (d, d)))
    assert smem.formula(e4m3[128]) == (
        "2 * block_m * hdim_q + 3 * stages * block_n * (hdim_q + hdim_v) (Q and the K/V stages "
        "in fp16, the e4m3 cache's staging stages a byte an element) + 2 * block_m * hdim_v (O "
        "in its own region where it fits under the arch's limit, else over Q: 0) + 1024 "
        "(barriers and alignment), of an e4m3 cache widened to fp16")


def test_chunked_prefill_from_an_e4m3_cache_at_d256_would_pass_sm90as_shared_memory(
        make_config, line_of):
    # Without the rule that prunes it, d256's e4m3 chunked prefill fails the shared-memory check
    # at the fa3 d256 tile's line: 2 * 128 * 256 + 3 * 2 * 80 * 512 + 1024 bytes.
    from generator.errors import ConfigError
    text = DEFAULT_CONFIG.read_text()
    rule = re.search(r"      - when: \{pipeline: fa3, kv_dtype: e4m3, hdim: \[\[256, 256\]\]\}\n"
                     r"        reason: >-\n(          .*\n)+?(?=      - when)", text)
    assert rule and "the decode kernel at every chunk size" in rule.group(0)
    path = make_config(text=text.replace(rule.group(0), ""))
    with pytest.raises(ConfigError) as caught:
        build_catalog(load(path))
    assert caught.value.line == line_of(path.read_text(), "{pipeline: fa3, hdim_q: 256")
    assert caught.value.message.endswith(
        "the tile needs 312320 bytes of shared memory (2 * block_m * hdim_q + 3 * stages * "
        "block_n * (hdim_q + hdim_v) (Q and the K/V stages in fp16, the e4m3 cache's staging "
        "stages a byte an element) + 2 * block_m * hdim_v (O in its own region where it fits "
        "under the arch's limit, else over Q: 0) + 1024 (barriers and alignment), of an e4m3 "
        "cache widened to fp16), more than the 232448 a CTA may use on sm90a")
