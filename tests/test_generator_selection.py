"""The --filter grammar, presets and --targets: every form, and every way of getting it wrong."""

from __future__ import annotations

import re

import pytest
from conftest import BWD_OPERATION, KVCACHE_OPERATION, repository
from hypothesis import given, settings
from hypothesis import strategies as st

from generator.errors import ConfigError, GeneratorError
from generator.selection import (Shard, compile_cost_class, parse_filter, parse_shard,
                                parse_targets, select)


@pytest.fixture
def selected(build):
    """selected(filter=..., preset=..., targets=...) -> names of the selected instances."""
    config, catalog = build()

    def selected_(filter_text="", preset="default", targets=None):
        parsed_targets = parse_targets(targets) if targets is not None else None
        selection = select(config, catalog, preset, filter_text, parsed_targets)
        return [instance.name for instance in selection.instances]

    return selected_


@pytest.mark.parametrize("filter_text, count, every_name_has", [
    ("", 32, "fwd_"),
    ("fp16", 16, "_fp16_"),
    ("bf16,hdim128", 8, "bf16_d128"),
    ("causal", 16, "_causal_"),
    ("sm90a", 16, "_sm90a_"),
    ("fa2", 32, "_fa2_"),
    ("row,batch", 32, "fwd_"),
    ("pad", 16, "_pad"),
    ("hdim64", 16, "_d64_"),
    ("hdim64x64", 16, "_d64_"),
    ("hdim=128", 16, "_d128_"),
    ("hdim_q=128", 16, "_d128_"),
    ("hdim_v=64", 16, "_d64_"),
    ("dtype=bf16", 16, "_bf16_"),
    ("arch=sm80", 16, "_sm80_"),
    ("pad_seqlen=true", 16, "_pad"),
    ("fp16|bf16", 32, "fwd_"),
    ("mask=none|causal", 32, "fwd_"),
    ("causal|*_pad", 24, "fwd_"),
    ("fp16|mask=causal", 24, "fwd_"),
    ("mask=causal|fp16", 24, "fwd_"),
    ("hdim_q=64|128", 32, "fwd_"),
    ("hdim=64|hdim128", 32, "fwd_"),
    ("*_sm90a_*", 16, "_sm90a_"),
    ("fwd_bf16_d??_*", 8, "_d64_"),
    ("*_m[6]4n32*", 16, "_m64n32"),
    (" fp16 , causal ", 8, "_fp16_d"),
])
def test_filter_forms(selected, filter_text, count, every_name_has):
    names = selected(filter_text)
    assert len(names) == count
    assert all(every_name_has in name for name in names)


@pytest.mark.parametrize("filter_text, excluded", [
    ("!causal", "_causal_"),
    ("!*_pad", "_pad"),
    ("!sm80", "_sm80_"),
    ("mask=none", "_causal_"),
    ("nopad", "_pad"),
    ("pad_seqlen=false", "_pad"),
])
def test_negations_and_complements(selected, filter_text, excluded):
    names = selected(filter_text)
    assert len(names) == 16
    assert not any(excluded in name for name in names)


def test_negated_alternatives_mean_neither(selected):
    names = selected("!fp16|causal")
    assert len(names) == 8
    assert all("_bf16_" in name and "_causal_" not in name for name in names)
    with pytest.raises(GeneratorError, match=re.escape("'!fp16|bf16' matches none of the 32")):
        selected("!fp16|bf16")


def test_tokens_combine_by_and(selected):
    assert selected("bf16,hdim128,causal,sm90a,nopad") == ["fwd_bf16_d128_causal_fa2_sm90a_m64n32"]


@pytest.mark.parametrize("filter_text, count, every_name_has", [
    ("hdim128x64", 16, "_d128x64_"),
    ("hdim=128x64", 16, "_d128x64_"),
    ("hdim128", 16, "_d128_"),  # hdim_q and hdim_v both 128
    ("hdim_q=128", 32, "_d128"),
    ("hdim_v=64", 32, "_d"),
    ("hdim_q=128,hdim_v=64", 16, "_d128x64_"),
])
def test_unequal_head_dims(build, filter_text, count, every_name_has):
    tile = ("  - {pipeline: fa2, hdim_q: 128, hdim_v: 64, block_m: 64, block_n: 32, warps: 4, "
            "stages: 2, why: x}\n")
    config, catalog = build(("    - [128, 128]", "    - [128, 128]\n    - [128, 64]"),
                            ("rules: []", tile + "rules: []"))
    names = [i.name for i in select(config, catalog, "default", filter_text).instances]
    assert len(names) == count
    assert all(every_name_has in name for name in names)


def test_unknown_token_lists_the_valid_ones_by_axis(selected):
    with pytest.raises(GeneratorError) as caught:
        selected("fp16,fp61")
    error = caught.value
    assert str(error).startswith("--filter: unknown token 'fp61'\n")
    lines = error.details.splitlines()
    assert any(line.split() == ["dtype", "fp16,", "bf16,", "e4m3"] for line in lines)
    assert any(line.split()[:3] == ["hdim", "hdim64,", "hdim128,"] for line in lines)
    assert any(line.split() == ["mask", "mask=none,", "causal,", "window"] for line in lines)
    assert any(line.split() == ["bias", "bias=none,", "elementwise,", "alibi"] for line in lines)
    assert any(line.split() == ["arch", "sm80,", "sm90a"] for line in lines)
    assert any(line.split() == ["lse", "lse,", "lse=true|false"] for line in lines)
    assert any(line.split()[:3] == ["pad_seqlen", "pad,", "nopad,"] for line in lines)
    assert any(line.split() == ["pad_hdim", "hpad,", "nohpad,", "pad_hdim=true|false"]
               for line in lines)
    assert any(line.split()[0] == "name" for line in lines)


def test_bare_value_of_two_axes_is_ambiguous(selected):
    with pytest.raises(GeneratorError, match=r"'none' is a value of more than one axis "
                                             r"\(mask, bias\); write mask=none or bias=none"):
        selected("none")


@pytest.mark.parametrize("filter_text, message", [
    ("fp16,,causal", "empty token in 'fp16,,causal'"),
    ("fp16,", "empty token"),
    ("fp16|", "empty alternative in 'fp16|'"),
    ("dtpye=fp16", "unknown axis 'dtpye' in 'dtpye=fp16'"),
    ("mask=casual", "'mask=casual': unknown mask 'casual'; valid: none, causal, window"),
    ("lse=1", "'lse=1': lse takes true or false, not '1'"),
    ("nolse", "unknown token 'nolse'"),
    ("mask=none|casual", "unknown token 'casual' in 'mask=none|casual'"),
    ("hdim_q=big", "'hdim_q=big': hdim_q takes a number, not 'big'"),
    # Digits that int() rejects, or takes too long to read: str.isdigit() holds for '²'.
    ("hdim_q=²", "'hdim_q=²': hdim_q takes a number, not '²'"),
    ("hdim_q=" + "9" * 5000, "hdim_q takes a number"),
    ("hdim" + "9" * 5000, "unknown token 'hdim999"),
    ("pad_seqlen=yes", "'pad_seqlen=yes': pad_seqlen takes true or false, not 'yes'"),
    ("hdim=64y", "'hdim=64y': hdim= takes N or QxV"),
    ("!fp16|fp61", "unknown token 'fp61' in '!fp16|fp61'"),
])
def test_malformed_filters(selected, filter_text, message):
    with pytest.raises(GeneratorError) as caught:
        selected(filter_text)
    assert message in caught.value.message


def test_token_that_matches_nothing_is_named(selected):
    with pytest.raises(GeneratorError) as caught:
        selected("fp16,hdim256")
    assert str(caught.value) == ("--filter: 'hdim256' matches none of the 32 instances, "
                                 "so nothing would be built")


def test_token_that_empties_the_selection_names_what_came_before(selected):
    with pytest.raises(GeneratorError) as caught:
        selected("fp16,hdim64,causal,*_sm80_m128n64_pad,nopad")
    assert caught.value.message == (
        "'nopad' matches none of the 1 instances left by --filter "
        "'fp16,hdim64,causal,*_sm80_m128n64_pad', so nothing would be built")


def test_glob_that_matches_nothing_is_an_error(selected):
    with pytest.raises(GeneratorError, match=r"'\*_sm100_\*' matches none of the 32"):
        selected("*_sm100_*")


BOOLEAN_AXES = (("lse: [false]", "lse: [false, true]"),
                 ("dropout: [false]", "dropout: [false, true]"),
                 ("softcap: [false]", "softcap: [false, true]"),
                 ("pad_hdim: [false]", "pad_hdim: [false, true]"))


@pytest.mark.parametrize("filter_text, holds", [
    ("lse", lambda i: i.point.traits.lse),
    ("!lse", lambda i: not i.point.traits.lse),
    ("lse=true", lambda i: i.point.traits.lse),
    ("lse=false", lambda i: not i.point.traits.lse),
    ("dropout", lambda i: i.point.traits.dropout),
    ("dropout=false", lambda i: not i.point.traits.dropout),
    ("softcap", lambda i: i.point.traits.softcap),
    ("hpad", lambda i: i.point.pad_hdim),
    ("nohpad", lambda i: not i.point.pad_hdim),
    ("pad_hdim=true", lambda i: i.point.pad_hdim),
    ("pad,nohpad", lambda i: i.point.pad_seqlen and not i.point.pad_hdim),
    ("lse|dropout", lambda i: i.point.traits.lse or i.point.traits.dropout),
    ("lse=true|false", lambda i: True),
    ("!lse|softcap", lambda i: not i.point.traits.lse and not i.point.traits.softcap),
])
def test_boolean_axes(build, filter_text, holds):
    config, catalog = build(*BOOLEAN_AXES)
    selection = select(config, catalog, "default", filter_text).instances
    assert selection == tuple(i for i in catalog.instances if holds(i))
    assert 0 < len(selection)


def test_bool_words_are_not_values_of_an_enum_axis():
    from generator.selection import _BARE_VALUES, _BOOL_WORDS
    assert not _BOOL_WORDS.keys() & _BARE_VALUES.keys()


def test_repository_presets_parse_and_select():
    matrix = repository()
    counts = {name: tuple(sum(i.op.token == op for i in matrix.select(name).instances)
                          for op in ("fwd", "bwd", "kvcache"))
              for name in matrix.config.presets}
    # The e4m3 forward: 2 instances in default, all 45 in extended and all, 24 in coverage
    # (test_generator_e4m3.py says which). Chunked prefill from an e4m3 cache: 1 in default,
    # all 24 in extended, coverage and all (test_presets_choose_the_cache_dtypes_their_users_call).
    assert counts == {"default": (10, 5, 14), "extended": (321, 276, 444),
                      "minimal": (4, 4, 6), "flash_attn": (2040, 2040, 1188),
                      "pytorch": (448, 672, 0), "coverage": (616, 392, 664),
                      "all": (10149, 4056, 1596)}


def test_presets_choose_the_cache_dtypes_their_users_call():
    """default decodes from an e4m3 cache (bf16 d128, no mask and causal, contiguous and paged)
    on H100/H200 beside its caches of the queries' dtype, and runs chunked prefill from it where
    it does from those (fa3, paged, causal); minimal and flash_attn (whose API has no FP8 cache)
    keep those only; extended and coverage take both."""
    matrix = repository()

    def kvcache(preset: str, kv_dtype: str) -> list:
        return [i for i in matrix.select(preset).instances
                if i.op.token == "kvcache" and i.point.traits.kv_dtype.token == kv_dtype]

    assert sorted(i.name for i in kvcache("default", "e4m3")) == sorted(
        [f"kvcache_bf16_kve4m3_d128_{traits}fa2_sm90a_m16n128_pad"
         for traits in ("", "causal_", "paged_", "causal_paged_")]
        + ["kvcache_bf16_kve4m3_d128_causal_paged_fa3_sm90a_m128n128_pad"])
    assert len(kvcache("default", "same")) == 9
    # Chunked prefill from either cache on the same traits.
    prefill = {kv_dtype: {i.name.replace("_kve4m3_", "_") for i in kvcache("default", kv_dtype)
                          if i.point.pipeline.token == "fa3"} for kv_dtype in ("same", "e4m3")}
    assert prefill["same"] == prefill["e4m3"] == {
        "kvcache_bf16_d128_causal_paged_fa3_sm90a_m128n128_pad"}
    for preset in ("minimal", "flash_attn"):
        assert kvcache(preset, "e4m3") == [] and kvcache(preset, "same")
    for preset in ("extended", "coverage"):
        same, e4m3 = kvcache(preset, "same"), kvcache(preset, "e4m3")
        # Every decode instance of the queries' dtype at exact head dims an e4m3 cache takes
        # (64, 128, 192, 256) has its e4m3 twin, on its tile but at d128 on sm90a, where an
        # e4m3 cache has 128-key tiles (its rows are half as long).
        # Every chunked-prefill (fa3) instance of the queries' dtype at d64 and d128 has its
        # e4m3 twin on the same tile; d256's do not fit beside the e4m3 staging stages.
        twins = {i.name.replace("kvcache_fp16_", "kvcache_fp16_kve4m3_").replace(
                     "kvcache_bf16_", "kvcache_bf16_kve4m3_")
                 for i in same if not i.point.pad_hdim
                 and i.point.traits.hdim_q in ((64, 128, 192, 256)
                                               if i.point.pipeline.token == "fa2"
                                               else (64, 128))}
        twins = {name.replace("_fa2_sm90a_m16n64_", "_fa2_sm90a_m16n128_")
                 if "_kve4m3_d128_" in name else name for name in twins}
        assert {i.name for i in e4m3} == twins


@pytest.mark.parametrize("filter_text", ["kve4m3", "kv_dtype=e4m3", "!same",
                                         "kv_dtype=same|e4m3,!same", "kv_dtype=same|kve4m3,!same",
                                         "*_kve4m3_*"])
def test_filters_name_the_cache_dtype(filter_text):
    catalog = repository().catalog
    selection = repository().select("all", f"kvcache,{filter_text}").instances
    assert selection == tuple(i for i in catalog.instances
                              if i.op.token == "kvcache"
                              and i.point.traits.kv_dtype.token == "e4m3")


def test_the_cache_dtype_is_kvcaches_own_axis():
    # No fwd or bwd instance has it, and its negation holds for all of them. (A bare e4m3 is
    # the dtype's: the e4m3 forward's, test_generator_e4m3.py.)
    with pytest.raises(GeneratorError, match="'kve4m3' matches none of the 10149 instances left"):
        repository().select("all", "fwd,kve4m3")
    assert len(repository().select("all", "fwd,!kve4m3").instances) == 10149
    with pytest.raises(GeneratorError, match="'e4m3' matches none of the 1596 instances left"):
        repository().select("all", "kvcache,e4m3")


def test_minimal_preset_builds_each_pipeline_and_padding_path():
    # CI's smoke build compiles one TU of each, for the forward and the backward pass: fa2
    # unpadded and padded for sm80, and for sm90a fa3 (padded, its only variant) and fa2's
    # head-dim-padded fallback; for kvcache (padded sequence lengths), fa3's chunked prefill
    # on a paged cache for sm90a, fa2's decode with a contiguous and a paged cache for each
    # arch, and its head-dim-padded variant on a paged cache for sm80.
    instances = repository().select("minimal").instances
    assert [(i.op.token, i.point.pipeline.token, i.point.arch.token, i.point.pad_seqlen,
             i.point.pad_hdim, i.point.traits.flag("paged")) for i in instances] == [
        ("fwd", "fa3", "sm90a", True, False, False), ("fwd", "fa2", "sm90a", True, True, False),
        ("fwd", "fa2", "sm80", False, False, False), ("fwd", "fa2", "sm80", True, True, False),
        ("bwd", "fa3", "sm90a", True, False, False), ("bwd", "fa2", "sm90a", True, True, False),
        ("bwd", "fa2", "sm80", False, False, False), ("bwd", "fa2", "sm80", True, True, False),
        ("kvcache", "fa3", "sm90a", True, False, True),
        ("kvcache", "fa2", "sm90a", True, False, False),
        ("kvcache", "fa2", "sm90a", True, False, True),
        ("kvcache", "fa2", "sm80", True, False, False),
        ("kvcache", "fa2", "sm80", True, False, True),
        ("kvcache", "fa2", "sm80", True, True, True)]


def test_coverage_preset_has_every_value_of_every_axis_of_each_operation():
    matrix = repository()
    instances = matrix.select("coverage").instances
    for token, op_config in matrix.config.operations.items():
        mine = [i for i in instances if i.op.token == token]
        built = DEFAULT_CATALOG.of(op_config.op.kind)  # the values the rules keep
        for axis in op_config.op.matrix_axes:
            assert {i.value(axis) for i in mine} == {i.value(axis) for i in built}, (token, axis)
        # The backward's traits together: bias gradients in group mode, dropout with windows.
        if token == "bwd":
            assert {(i.point.traits.dbias, i.point.traits.mode.token) for i in mine} == {
                (False, "batch"), (True, "batch"), (False, "group"), (True, "group")}


def test_union_preset_selects_what_any_of_its_filters_selects(build):
    union = 'filter: ["fp16,hdim64,mask=none", "bf16,causal,sm90a,pad"]'
    config, catalog = build(('filter: "fp16,hdim64,mask=none"', union))
    names = {i.name for i in select(config, catalog, "minimal").instances}
    first = {i.name for i in select(config, catalog, "default", "fp16,hdim64,mask=none").instances}
    second = {i.name for i in select(config, catalog, "default", "bf16,causal,sm90a,pad").instances}
    assert names == first | second and first and second and not first & second
    # --filter narrows the union like any preset.
    assert {i.name for i in select(config, catalog, "minimal", "bf16").instances} == second


def test_each_filter_of_a_union_must_select_something(build):
    union = 'filter: ["fp16,hdim64", "bf16,hdim96"]'
    config, catalog = build(('filter: "fp16,hdim64,mask=none"', union))
    with pytest.raises(ConfigError, match=r"presets.minimal.filter\[1\]: 'hdim96' matches none"):
        select(config, catalog, "default")


def test_presets(selected):
    assert len(selected(preset="minimal")) == 4
    assert selected(preset="minimal", filter_text="sm90a,nopad") == ["fwd_fp16_d64_fa2_sm90a_m128n64"]


def test_unknown_preset_lists_the_valid_ones(selected):
    with pytest.raises(GeneratorError) as caught:
        selected(preset="nightly")
    assert str(caught.value) == "--preset: unknown preset 'nightly'; valid: default, minimal"


def test_preset_and_filter_that_exclude_each_other(selected):
    with pytest.raises(GeneratorError) as caught:
        selected(preset="minimal", filter_text="causal")
    assert caught.value.message == (
        "'causal' matches none of the 4 instances left by preset 'minimal' "
        "'fp16,hdim64,mask=none', so nothing would be built")


def test_a_broken_preset_fails_every_run(build):
    config, catalog = build(('filter: "fp16,hdim64,mask=none"', 'filter: "fp16,hdim96"'))
    with pytest.raises(ConfigError, match="presets.minimal.filter: 'hdim96' matches none"):
        select(config, catalog, "default")


@pytest.mark.parametrize("text, tokens", [
    ("sm80,sm90a", ["sm80", "sm90a"]),
    ("80;90a", ["sm80", "sm90a"]),
    ("80,90a", ["sm80", "sm90a"]),
    (" 90a ; ", ["sm90a"]),
    ("sm90a;80;90a", ["sm90a", "sm80"]),
])
def test_target_forms(text, tokens):
    assert [arch.token for arch in parse_targets(text)] == tokens


@pytest.mark.parametrize("text, message", [
    ("90", "unknown target '90'; valid: sm80 (80), sm90a (90a)"),
    ("sm_80", "unknown target 'sm_80'"),
    ("", "no target given"),
])
def test_bad_targets(text, message):
    with pytest.raises(GeneratorError) as caught:
        parse_targets(text)
    assert caught.value.where == "--targets"
    assert message in caught.value.message


def test_targets_keep_only_their_arch(build):
    config, catalog = build()
    selection = select(config, catalog, "default", "", parse_targets("90a"))
    assert len(selection.instances) == 16
    assert [arch.token for arch in selection.targets] == ["sm90a"]


def test_selection_targets_are_the_archs_with_instances(build):
    config, catalog = build()
    selection = select(config, catalog, "default", "sm80", parse_targets("80;90a"))
    assert [arch.token for arch in selection.targets] == ["sm80"]


def test_target_outside_the_matrix_selects_nothing(build):
    config, catalog = build(("arch: [sm80, sm90a]", "arch: [sm80]"))
    with pytest.raises(GeneratorError, match="--targets: 'sm90a' matches none of the 16"):
        select(config, catalog, "default", "", parse_targets("sm90a"))


DEFAULT_CATALOG = repository().catalog
VALID_TERMS = ["fp16", "bf16", "causal", "window", "mask=none", "bias=none", "alibi", "col",
               "group", "lse", "dropout", "softcap", "lse=false", "sm80", "sm90a", "pad", "nopad",
               "hpad", "nohpad", "pad_hdim=true", "hdim64", "hdim128", "hdim_q=64", "hdim_v=128",
               "fa2", "fa3", "*_pad", "*_sm90a_*", "fwd_bf16*", "dtype=bf16", "arch=sm80"]


@settings(max_examples=60, deadline=None)
@given(terms=st.lists(st.sampled_from(VALID_TERMS), min_size=1, max_size=3))
def test_negation_is_the_complement_of_the_alternatives(terms):
    catalog = DEFAULT_CATALOG
    alternatives = "|".join(terms)
    (token,) = parse_filter(alternatives, "--filter", catalog)
    (negated,) = parse_filter(f"!{alternatives}", "--filter", catalog)
    singles = [parse_filter(term, "--filter", catalog)[0] for term in terms]
    for instance in catalog.instances[::17]:  # a spread sample keeps 60 examples quick
        assert token.holds(instance) == any(single.holds(instance) for single in singles)
        assert negated.holds(instance) == (not token.holds(instance))


@pytest.mark.parametrize("text, index, count", [("1/1", 1, 1), ("2/4", 2, 4), (" 4 / 4 ", 4, 4)])
def test_shard_forms(text, index, count):
    assert parse_shard(text) == Shard(index, count)
    assert str(parse_shard(text)) == f"{index}/{count}"


@pytest.mark.parametrize("text", ["0/4", "5/4", "1/0", "2", "a/b", "-1/2", "1/2/3", "",
                                  "1/" + "9" * 5000, "²/4"])
def test_bad_shards(text):
    with pytest.raises(GeneratorError) as caught:
        parse_shard(text)
    assert caught.value.where == "--shard"
    assert caught.value.message == f"expected K/N with 1 <= K <= N, e.g. 2/4; got {text!r}"


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 8])
def test_shards_are_a_balanced_partition_in_dispatch_order(count):
    instances = repository().select("extended").instances
    shards = [Shard(index, count).take(instances) for index in range(1, count + 1)]
    names = [[i.name for i in shard] for shard in shards]
    assert sorted(sum(names, [])) == sorted(i.name for i in instances)  # disjoint, whole
    for shard in shards:  # each in dispatch order
        assert list(shard) == [i for i in instances if i in shard]
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    # Each shard gets its share of every cost class (head dims, pipeline, padding, ...), and
    # so of the head dims as a whole.
    for cost_class in {compile_cost_class(i) for i in instances}:
        counts = [sum(compile_cost_class(i) == cost_class for i in shard) for shard in shards]
        assert max(counts) - min(counts) <= 1, cost_class
    totals = [sum(i.point.traits.hdim_q + i.point.traits.hdim_v for i in shard)
              for shard in shards]
    assert max(totals) - min(totals) <= 512
    assert names == [[i.name for i in Shard(index, count).take(instances)]
                     for index in range(1, count + 1)]


def test_more_shards_than_instances_leaves_some_empty():
    instances = repository().select("minimal").instances
    assert [len(Shard(index, 15).take(instances)) for index in range(1, 16)] == [1] * 14 + [0]


# -- the kvcache operation ----------------------------------------------------------------------

@pytest.mark.parametrize("filter_text, count", [
    ("kvcache", 32),
    ("op=kvcache", 32),
    ("kvcache,paged", 16),
    ("paged", 16),  # an axis of kvcache only
    ("paged=false", 16),
    ("!paged", 64 + 16),  # fwd and bwd instances have no paged trait: its negation holds
    ("kvcache,!paged,hdim128,causal", 4),
    ("mode=batch", 64),  # kvcache has no mode
    ("!dropout,kvcache", 32),
    ("fwd|kvcache,sm80", 32),
])
def test_filters_on_kvcache(build, filter_text, count):
    config, catalog = build(BWD_OPERATION, KVCACHE_OPERATION)
    selection = select(config, catalog, "default", filter_text).instances
    assert len(selection) == count, [i.name for i in selection]


def test_kvcache_instances_take_a_share_of_each_shard(build):
    _, catalog = build(BWD_OPERATION, KVCACHE_OPERATION)
    kvcache = {i.name for i in catalog.instances if i.op.token == "kvcache"}
    parts = [{i.name for i in Shard(index, 4).take(catalog.instances)} for index in range(1, 5)]
    assert [len(part & kvcache) for part in parts] == [8, 8, 8, 8]
