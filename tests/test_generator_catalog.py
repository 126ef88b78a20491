"""Expansion, pruning rules, tile assignment, instance names, dispatch order and the
no-shadowing proof."""

from __future__ import annotations

import dataclasses
import re

import pytest

from generator.catalog import build_catalog
from generator.config import DEFAULT_CONFIG, load
from generator.dispatch import check_dispatchable, dispatch_order
from generator.errors import GeneratorError
from generator.model import FwdTraits, Instance, MatrixPoint, Tile
from generator.schema import ARCH, BIAS, DTYPE, MASK, MODE, PIPELINE, VLAYOUT


def make_instance(dtype="fp16", hdim=(64, 64), mask="none", arch="sm80", pad_seqlen=False,
                  tile=Tile(128, 64, 8, 2), pipeline=PIPELINE.get("fa2")) -> Instance:
    traits = FwdTraits(DTYPE.get(dtype), *hdim, MASK.get(mask), BIAS.get("none"),
                       VLAYOUT.get("row"), MODE.get("batch"))
    return Instance(MatrixPoint(traits, pipeline, ARCH.get(arch), pad_seqlen), tile)


def names(catalog) -> list[str]:
    return [instance.name for instance in catalog.instances]


def test_default_matrix_has_32_instances():
    # 2 dtypes x 2 hdims x 2 masks x 2 archs x 2 paddings
    catalog = build_catalog(load(DEFAULT_CONFIG))
    assert len(catalog.instances) == 32 and catalog.pruned == 0
    assert len(set(names(catalog))) == 32


def test_expansion_covers_every_combination(build):
    _, catalog = build()
    combos = {(i.point.traits.dtype.token, i.point.traits.hdim_q, i.point.traits.mask.token,
               i.point.arch.token, i.point.pad_seqlen) for i in catalog.instances}
    assert len(combos) == len(catalog.instances) == 32


@pytest.mark.parametrize("instance, name", [
    (make_instance(), "fwd_fp16_d64_fa2_sm80_m128n64"),
    (make_instance("bf16", (128, 128), "causal", "sm90a", True),
     "fwd_bf16_d128_causal_fa2_sm90a_m128n64_pad"),
    (make_instance(hdim=(192, 128), tile=Tile(64, 32, 4, 2)), "fwd_fp16_d192x128_fa2_sm80_m64n32"),
])
def test_name_grammar(instance, name):
    assert instance.name == name


def test_names_are_identifiers_and_carry_every_trait(build):
    _, catalog = build()
    for instance in catalog.instances:
        assert re.fullmatch(r"[a-z0-9_]+", instance.name)
        assert instance.name.endswith("_pad") == instance.point.pad_seqlen
        assert ("_causal_" in instance.name) == (instance.point.traits.mask.token == "causal")
        assert f"_{instance.point.arch.token}_" in instance.name


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
    ("hdim_v: 128\n", "hdim_v: 96\n", "hdim_q and hdim_v multiples of 64"),
])
def test_tile_violating_a_pipeline_constraint_is_an_error(config_error, line_of, old, new, reason):
    error, text = config_error((old, new))
    assert error.line == line_of(text, "  - pipeline: fa2")  # the d128 entry
    assert f"tiles[1]: pipeline fa2 needs {reason}" in error.message


def test_dispatch_order_prefers_newer_arch_then_unpadded_then_larger_tile(build):
    _, catalog = build()
    keys = [(i.point.arch.cc, i.point.pad_seqlen, i.tile.block_m * i.tile.block_n)
            for i in catalog.instances]
    assert keys == sorted(keys, key=lambda k: (-k[0], k[1], -k[2]))
    assert catalog.instances[0].name == "fwd_bf16_d64_causal_fa2_sm90a_m128n64"
    assert catalog.instances[-1].name == "fwd_fp16_d128_fa2_sm80_m64n32_pad"


def test_dispatch_order_is_independent_of_input_order():
    instances = [make_instance(arch=a, pad_seqlen=p, hdim=h) for a in ("sm80", "sm90a")
                 for p in (True, False) for h in ((64, 64), (128, 128))]
    assert dispatch_order(instances) == dispatch_order(reversed(instances))
    assert [i.name for i in dispatch_order(instances)][:2] == [
        "fwd_fp16_d128_fa2_sm90a_m128n64", "fwd_fp16_d64_fa2_sm90a_m128n64"]


def test_shadowed_instance_is_an_error():
    # A second pipeline serving the same traits, arch and padding could never be chosen.
    fa2 = PIPELINE.get("fa2")
    other = dataclasses.replace(fa2, token="fa2b")
    first, second = make_instance(pipeline=fa2), make_instance(pipeline=other)
    with pytest.raises(GeneratorError, match="fwd_fp16_d64_fa2b_sm80_m128n64 is shadowed by "
                                             "fwd_fp16_d64_fa2_sm80_m128n64"):
        check_dispatchable(dispatch_order([first, second]))


def test_padded_and_arch_siblings_are_not_shadowed():
    check_dispatchable(dispatch_order([make_instance(arch=a, pad_seqlen=p)
                                       for a in ("sm80", "sm90a") for p in (False, True)]))


def test_duplicate_names_are_an_error():
    # Warps and stages are not in the name: two tiles differing only there would collide.
    first = make_instance(tile=Tile(128, 64, 8, 2))
    second = make_instance(tile=Tile(128, 64, 4, 2))
    with pytest.raises(GeneratorError, match="two different instances are named "
                                             "fwd_fp16_d64_fa2_sm80_m128n64"):
        check_dispatchable(dispatch_order([first, second]))
