"""Expansion, pruning rules, tile assignment (and its shared-memory check) and instance names.
The dispatch order and the no-shadowing proof are in test_generator_dispatch.py."""

from __future__ import annotations

import re
import time

import pytest

from generator.catalog import build_catalog
from generator.config import DEFAULT_CONFIG, load
from generator.model import Tile
from generator.schema import ARCH

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


def test_repository_matrix():
    # 2 dtypes x 7 head dims x 3 masks x 3 biases x 2 V layouts x 2 archs x 2 dropout x 2
    # softcap = 2016 trait combinations, each with 5 instances the rules keep: batch mode with
    # lse false/true x (unpadded, fully padded), and group mode padded with lse.
    start = time.perf_counter()
    catalog = build_catalog(load(DEFAULT_CONFIG))
    assert time.perf_counter() - start < 5  # about 0.6 s on an idle machine
    assert len(catalog.instances) == 10080 and catalog.pruned == 32256 - 10080
    assert len(set(names(catalog))) == 10080
    for instance in catalog.instances:
        point = instance.point
        assert point.pad_seqlen == point.pad_hdim
        assert point.traits.mode.token == "batch" or (point.pad_seqlen and point.traits.lse)


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
        "tiles[1]: the tile needs 196608 bytes of shared memory (2 * (block_m * max(hdim_q, "
        "hdim_v) + stages * block_n * (hdim_q + hdim_v))), more than the 166912 a CTA may use "
        "on sm80")


def test_shared_memory_is_checked_only_on_the_archs_a_tile_is_used_on(build):
    _, catalog = build(*BIG_TILE, ("arch: [sm80, sm90a]", "arch: [sm90a]"))
    assert {i.tile.block_m for i in catalog.instances if i.point.traits.hdim_q == 128} == {256}
    rule = "rules:\n  - when: {arch: sm80, hdim_q: 128}\n    reason: too big for A100"
    build(*BIG_TILE, ("rules: []", rule))


def test_repository_tiles_fit_their_archs():
    # The largest, d256 with 128x64 on sm90a, takes 192 KB of H100's 227; on sm80 its
    # 128x32 tile takes 128 KB of A100's 163.
    config = load(DEFAULT_CONFIG)
    for entry in config.tiles:
        needed = entry.pipeline.shared_memory.bytes(entry.tile, entry.hdim)
        archs = [entry.arch] if entry.arch is not None else list(ARCH)
        assert all(needed <= arch.smem_limit for arch in archs), (entry.hdim, needed, archs)
