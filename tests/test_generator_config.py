"""instances.yaml validation: every mistake is one `file:line: message` with the valid choices,
exit status 2, no traceback, nothing written."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from conftest import BASE_CONFIG, BWD_OPERATION, KVCACHE_OPERATION

from generator.config import DEFAULT_CONFIG, load
from generator.errors import ConfigError
from generator.operations import KVCACHE, OPERATIONS
from generator.schema import ENUM_AXES, MATRIX_AXES, PIPELINE, REGISTRY_TOKEN_ARRAYS


# (old, new): a mistake to put into the base config; marker: a fragment of the line the error
# must name; message: what the error must say.
MISTAKES = {
    "unknown top-level key": (("presets:\n", "rulez: []\npresets:\n"), "rulez:",
                              "unknown key 'rulez'; valid: matrix, rules, operations, presets"),
    "unknown operation key": (("rules: []", "rules: []\nrulez: []"), "rulez:",
                              "operations.fwd: unknown key 'rulez'; valid: matrix, tiles, rules"),
    "unknown operation": (("presets:\n", "  dcode: {tiles: []}\npresets:\n"), "dcode:",
                          "operations: unknown key 'dcode'; valid: fwd, bwd"),
    "axis of an operation in the top matrix too": (
        ("  mode: [batch]", "  mode: [batch]\n  lse: [false]"), "      lse: [false]",
        "operations.fwd.matrix: lse is given in the top matrix too"),
    "axis given twice": (("vlayout: [row]", "vlayout: [row]\n  dtype: [fp16]"), "  dtype: [fp16]",
                         "operations.fwd.matrix: dtype is given in the top matrix too (line 2); "
                         "give each axis once"),
    "unknown pipeline": (("pipeline: [fa2]", "pipeline: [fa2, fa4]"), "fa4",
                         "operations.fwd.matrix.pipeline: unknown value 'fa4'; valid: fa3, fa2"),
    "unknown matrix axis": (("  mode: [batch]", "  mode: [batch]\n  layout: [row]"), "  layout:",
                            "matrix: unknown key 'layout'; valid: dtype, hdim, mask"),
    "unknown enum value": (("mask: [none, causal]", "mask: [none, casual]"), "casual",
                           "matrix.mask: unknown value 'casual'; valid: none, causal, window"),
    "unknown bias": (("bias: [none]", "bias: [none, alibbi]"), "alibbi",
                     "matrix.bias: unknown value 'alibbi'; valid: none, elementwise, alibi"),
    "unknown arch": (("arch: [sm80, sm90a]", "arch: [sm80, sm90]"), "sm90]",
                     "matrix.arch: unknown value 'sm90'; valid: sm80, sm90a"),
    "value on a later line": (("    - [128, 128]", "    - [128, 0]"), "[128, 0]",
                              "matrix.hdim: expected a positive integer, got an integer 0"),
    "listed twice": (("dtype: [fp16, bf16]", "dtype: [fp16, fp16]"), "dtype:",
                     "matrix.dtype: 'fp16' is listed twice"),
    "axis not a list": (("dtype: [fp16, bf16]", "dtype: fp16"), "dtype:",
                        "matrix.dtype: expected a list, got a string 'fp16'"),
    "empty axis": (("dtype: [fp16, bf16]", "dtype: []"), "dtype:",
                   "matrix.dtype: needs at least one entry"),
    "hdim not a pair": (("    - [64, 64]", "    - 64"), "    - 64",
                        "matrix.hdim: expected a [hdim_q, hdim_v] pair, got an integer 64"),
    "pad_seqlen not a boolean": (("pad_seqlen: [false, true]", "pad_seqlen: [false, 1]"),
                                 "pad_seqlen:", "matrix.pad_seqlen: expected true or false, got an integer 1"),
    "lse not a boolean": (("lse: [false]", "lse: [false, 'true']"), "lse:",
                          "matrix.lse: expected true or false, got a string 'true'"),
    "pad_hdim listed twice": (("pad_hdim: [false]", "pad_hdim: [false, false]"), "pad_hdim:",
                              "matrix.pad_hdim: false is listed twice"),
    "missing new axis": (("  softcap: [false]\n", ""), "    matrix:",
                         "operations.fwd.matrix: missing field 'softcap' (an axis of fwd that "
                         "the top matrix does not give)"),
    "missing matrix axis": (("  vlayout: [row]\n", ""), "    matrix:",
                            "operations.fwd.matrix: missing field 'vlayout'"),
    "missing tile field": (("    warps: 4\n", ""), "  - pipeline: fa2", "tiles[1]: missing field 'warps'"),
    "tile size as string": (("    block_m: 64", "    block_m: '64'"), "block_m: '64'",
                            "tiles[1].block_m: expected a positive integer, got a string '64'"),
    "tile size as boolean": (("    stages: 2\n    why", "    stages: yes\n    why"), "stages: yes",
                             "tiles[1].stages: expected a positive integer, got a boolean true"),
    "unknown tile key": (("    why: d128", "    why: d128\n    block_k: 32"), "block_k",
                         "tiles[1]: unknown key 'block_k'"),
    "empty why": (("    why: d128", "    why: ''"), "why: ''",
                  "tiles[1].why: expected a non-empty string"),
    "rule on unknown axis": (("rules: []", "rules:\n  - when: {dtypes: bf16}\n    reason: r"),
                             "dtypes", "rules[0].when: unknown key 'dtypes'; valid: dtype, hdim, "
                                       "hdim_q"),
    "rule on hdim without pairs": (("rules: []", "rules:\n  - when: {hdim: [64, 64]}\n    "
                                                 "reason: r"),
                                   "hdim: [64", "rules[0].when.hdim: expected a [hdim_q, hdim_v] "
                                                "pair, got an integer 64"),
    "rule on hdim with one pair unlisted": (("rules: []", "rules:\n  - when: {hdim: 64}\n    "
                                                          "reason: r"),
                                            "hdim: 64", "rules[0].when.hdim: expected a list, "
                                                        "got an integer 64"),
    "rule negation with another key": (("rules: []", "rules:\n  - when: {mask: {nor: causal}}\n"
                                                     "    reason: r"),
                                       "nor:", "rules[0].when.mask: unknown key 'nor'; valid: not"),
    "rule negation of nothing": (("rules: []", "rules:\n  - when: {mask: {not: []}}\n"
                                               "    reason: r"),
                                 "not: []", "rules[0].when.mask.not: needs at least one entry"),
    "rule negation of a bad value": (("rules: []", "rules:\n  - when:\n      mask:\n"
                                                   "        not: [none, casual]\n    reason: r"),
                                     "not: [none", "rules[0].when.mask.not: unknown value "
                                                   "'casual'; valid: none, causal, window"),
    "rule with bad value": (("rules: []", "rules:\n  - when: {dtype: [bf16, fp8]}\n    reason: r"),
                            "fp8", "rules[0].when.dtype: unknown value 'fp8'; valid: fp16, bf16"),
    "rule with bad boolean": (("rules: []", "rules:\n  - when: {dropout: 1}\n    reason: r"),
                              "dropout: 1", "rules[0].when.dropout: expected true or false, got an integer 1"),
    "rule without conditions": (("rules: []", "rules:\n  - when: {}\n    reason: r"), "when: {}",
                                "rules[0].when: needs at least one condition"),
    "rule without reason": (("rules: []", "rules:\n  - when: {dtype: bf16}"), "when:",
                            "rules[0]: missing field 'reason'"),
    "rules not a list": (("rules: []", "rules: {}"), "rules:", "rules: expected a list, got a mapping"),
    "preset without default": (("  default: {", "  everything: {"), "presets:",
                               "presets: missing field 'default'"),
    "preset filter not a string": (('filter: "fp16,hdim64,mask=none"', "filter: 5"), "minimal",
                                   "presets.minimal.filter: expected a string in the --filter "
                                   "grammar or a list of them (their union), got an integer 5"),
    "preset with an empty union": (('filter: "fp16,hdim64,mask=none"', "filter: []"), "minimal",
                                   "presets.minimal.filter: a list of filters needs non-empty "
                                   "strings in the --filter grammar, got an empty list"),
    "preset with unknown token": (('filter: "fp16,hdim64,mask=none"', 'filter: "fp16,fp61"'),
                                  "minimal", "presets.minimal.filter: unknown token 'fp61'"),
    "preset selecting nothing": (('filter: "fp16,hdim64,mask=none"', 'filter: "fp16,hdim46"'),
                                 "minimal", "presets.minimal.filter: 'hdim46' matches none of the 32"),
    "preset with ambiguous token": (('filter: "fp16,hdim64,mask=none"', 'filter: "fp16,none"'),
                                    "minimal", "'none' is a value of more than one axis (mask, bias)"),
    "duplicate key": (("  bias: [none]", "  bias: [none]\n  bias:  [none]"), "bias:  [none]",
                      "duplicate key 'bias'"),
    "malformed YAML": (("  bias: [none]", "  bias: none: x"), "bias: none: x", "invalid YAML"),
    # PyYAML types these scalars, and its constructors fail on them with Python errors.
    "date that does not exist": (("    why: d128", "    why: 2001-13-45"), "2001-13-45",
                                 "invalid YAML: cannot read '2001-13-45' as a YAML timestamp: "
                                 "month must be in 1..12"),
    "timestamp tag on a non-date": (("    why: d128", "    why: !!timestamp x"), "!!timestamp",
                                    "invalid YAML: cannot read 'x' as a YAML timestamp"),
    "int tag on a word": (("    why: d128", "    why: !!int x"), "!!int x",
                          "cannot read 'x' as a YAML int: invalid literal for int()"),
    "number too long to read": (("    block_m: 64", "    block_m: " + "9" * 5000), "block_m: 99",
                                "cannot read '" + "9" * 40 + "...' as a YAML int"),
    "nested too deeply": (("rules: []", "rules: " + "[" * 5000 + "]" * 5000), "rules: [[",
                          "invalid YAML: nested too deeply"),
    "control character": (("  bias: [none]", "  bias: [no\x1fne]"), "bias: [no",
                          "invalid YAML: unacceptable character #x001f: special characters "
                          "are not allowed"),
    "preset filter with digits int() rejects": (('filter: "fp16,hdim64,mask=none"',
                                                 'filter: "hdim_q=²"'), "minimal",
                                                "'hdim_q=²': hdim_q takes a number, not '²'"),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_mistake_is_reported_at_its_line(name, config_error, line_of):
    replacement, marker, message = MISTAKES[name]
    error, text = config_error(replacement)
    assert error.line == line_of(text, marker), str(error)
    assert message in error.message
    assert str(error).startswith(f"{error.file}:{error.line}: ")


def test_cli_reports_one_line_exit_2_and_writes_nothing(make_config, run_cli, tmp_path, line_of):
    path = make_config(("mask: [none, causal]", "mask: [none, casual]"))
    out = tmp_path / "out"
    result = run_cli("--config", path, "--out", out)
    assert result.returncode == 2
    line = line_of(path.read_text(), "casual")
    assert result.stderr == (f"{path.as_posix()}:{line}: matrix.mask: unknown value 'casual'; "
                             f"valid: none, causal, window\n")
    assert result.stdout == ""
    assert not out.exists()


@pytest.mark.parametrize("text", ["", "- just\n- a list\n"])
def test_file_must_be_a_mapping(text, make_config):
    with pytest.raises(ConfigError, match="expected a mapping") as caught:
        load(make_config(text=text))
    assert caught.value.line == 1


def test_not_utf8_is_reported_at_its_line(make_config, line_of):
    path = make_config()
    text = path.read_text()
    path.write_bytes(path.read_bytes().replace(b"smoke build", b"smoke \xff build"))
    with pytest.raises(ConfigError) as caught:
        load(path)
    line = line_of(text, "smoke build")
    column = text.splitlines()[line - 1].index("smoke build") + len("smoke ") + 1
    assert (caught.value.line, caught.value.message) == (
        line, f"not UTF-8: byte 0xff at column {column}")


def test_missing_file_is_a_user_error(run_cli, tmp_path):
    result = run_cli("--config", tmp_path / "absent.yaml", "--list")
    assert result.returncode == 2
    assert "cannot read config" in result.stderr and "Traceback" not in result.stderr


def test_repository_config_loads():
    config = load(DEFAULT_CONFIG)
    assert {"default", "minimal"} <= set(config.presets)
    assert all(preset.why for preset in config.presets.values())
    assert list(config.operations) == ["fwd", "bwd", "kvcache"]
    assert all(entry.why for op in config.operations.values() for entry in op.tiles)
    # The shared rules come first in the rules of each operation they apply to: all three
    # are fwd's and bwd's; kvcache has no mode, and the fa2 rule names fwd and bwd. fwd's own:
    # 10 on 16-bit inputs, 3 that keep e4m3 to fa3, head dims 64, 128 and 256, and V^T to
    # batch mode.
    fwd, bwd, kvcache = config.operations.values()
    assert [len(op.rules) for op in (fwd, bwd, kvcache)] == [3 + 10 + 3, 3 + 1 + 8, 1 + 11]
    assert fwd.rules[:3] == bwd.rules[:3] == config.shared_rules
    assert kvcache.rules[:1] == config.shared_rules[1:2]
    assert [c.axis for c in kvcache.rules[0].when] == ["pad_seqlen", "pad_hdim"]


def test_registry_token_arrays_are_indexed_by_enum_value():
    # registry.h's arrays are indexed by the enumerator's integer value, so the values of each
    # axis must be exactly 0..n-1.
    for axis in REGISTRY_TOKEN_ARRAYS.values():
        assert sorted(value.value for value in axis) == list(range(len(axis.values)))


def test_schema_tokens_are_identifier_parts():
    # Tokens become parts of instance names, hence of C++ function names and file names.
    for axis in ENUM_AXES.values():
        for token in axis.tokens:
            assert token.isidentifier() or token.isalnum(), token
        assert axis.name_default in (None, *axis.tokens)


def test_matrix_axes_are_in_the_order_of_instances_yaml():
    # The schema's order is the one of the repository's matrices (and of the instance names):
    # each operation's axes are a subsequence of it, and so are the keys of the top matrix and
    # of each operation's own, as instances.yaml lists them.
    config = load(DEFAULT_CONFIG)
    for op in config.operations.values():
        assert list(op.matrix.axes) == list(op.op.matrix_axes)
        assert list(op.op.matrix_axes) == [a for a in MATRIX_AXES if a in op.op.matrix_axes]
    text = DEFAULT_CONFIG.read_text()

    def block(start: str, end: str) -> str:
        begin = text.index(start)
        return text[begin:text.index(end, begin)]

    blocks = [("  ", block("\nmatrix:", "\nrules:")),
              *(("      ", block(f"\n  {op}:\n    matrix:", "\n    tiles:"))
                for op in config.operations)]
    for indent, lines in blocks:
        keys = [line.split(":")[0].strip() for line in lines.splitlines()
                if re.match(rf"{indent}[a-z]", line)]
        assert keys and keys == [axis for axis in MATRIX_AXES if axis in keys], keys


def bwd(old: str = "", new: str = "") -> tuple[str, str]:
    """The replacement that adds the bwd operation, with `old` replaced by `new` in its text
    (which is written with its own indentation)."""
    assert old in BWD_OPERATION[1], old
    return BWD_OPERATION[0], BWD_OPERATION[1].replace(old, new, 1)


# Mistakes of a config with both operations: (replacements, marker, message).
BWD_MISTAKES = {
    "fwd axis in the top matrix": (
        (bwd(), ("  mode: [batch]", "  mode: [batch]\n  vlayout: [row, col]")),
        "vlayout: [row, col]",
        "matrix: vlayout is an axis of fwd only; give it under operations.fwd.matrix"),
    "bwd axis in a fwd matrix": (
        (bwd(), ("vlayout: [row]", "vlayout: [row]\n  dbias: [true]")), "dbias: [true]",
        "operations.fwd.matrix: unknown key 'dbias'; valid: dtype, hdim, mask, bias, vlayout, "
        "mode, lse, dropout, softcap, pipeline, arch, pad_seqlen, pad_hdim"),
    "rule on an axis the operation lacks": (
        (bwd("    rules: []", "    rules:\n      - {when: {lse: true}, reason: r}"),),
        "when: {lse",
        "operations.bwd.rules[0].when: unknown key 'lse'; valid: dtype, hdim, hdim_q, hdim_v, "
        "mask, bias, mode, dbias, dropout, softcap, pipeline, arch, pad_seqlen, pad_hdim"),
    "shared rule on an axis of one operation": (
        (bwd(), ("operations:\n", "rules:\n  - {when: {vlayout: col}, reason: r}\noperations:\n")),
        "vlayout: col", "rules[0].when: vlayout is an axis of fwd only; give this rule under "
                        "operations.fwd.rules"),
    "missing bwd axis": (
        (bwd("    matrix:\n      dbias: [false]\n      pipeline: [fa2]\n", ""),), "  bwd:",
        "operations.bwd.matrix: missing field 'dbias' (an axis of bwd that the top matrix does "
        "not give)"),
    "bwd without tiles": (
        (bwd("    tiles:", "    tilez:"),), "tilez:",
        "operations.bwd: unknown key 'tilez'; valid: matrix, tiles, rules"),
}


@pytest.mark.parametrize("name", BWD_MISTAKES)
def test_mistake_with_two_operations_is_reported_at_its_line(name, config_error, line_of):
    replacements, marker, message = BWD_MISTAKES[name]
    error, text = config_error(*replacements)
    assert error.line == line_of(text, marker), str(error)
    assert message in error.message, str(error)


def kvcache(old: str, new: str) -> tuple[str, str]:
    """The replacement that adds the kvcache operation, with `old` replaced by `new` in its
    text."""
    assert old in KVCACHE_OPERATION[1], old
    return KVCACHE_OPERATION[0], KVCACHE_OPERATION[1].replace(old, new, 1)


# Mistakes that name a pipeline an operation lacks: the test takes fa3's kvcache kernel away,
# so that kvcache is implemented by fa2 alone.
PIPELINE_MISTAKES = {
    "pipeline the operation lacks": (
        (kvcache("pipeline: [fa2]", "pipeline: [fa2, fa3]"),), "pipeline: [fa2, fa3]",
        "operations.kvcache.matrix.pipeline: kvcache has no pipeline 'fa3'; its pipelines: fa2"),
    "tile of a pipeline the operation lacks": (
        (kvcache("{pipeline: fa2, hdim_q: 64", "{pipeline: fa3, hdim_q: 64"),), "why: kvcache d64",
        "operations.kvcache.tiles[0].pipeline: kvcache has no pipeline 'fa3'; its pipelines: fa2"),
}


@pytest.mark.parametrize("name", PIPELINE_MISTAKES)
def test_pipeline_an_operation_lacks_is_reported_at_its_line(name, config_error, line_of,
                                                             monkeypatch):
    fa2_only = replace(KVCACHE, kernels=(KVCACHE.kernel(PIPELINE.get("fa2")),))
    monkeypatch.setitem(OPERATIONS, "kvcache", fa2_only)
    replacements, marker, message = PIPELINE_MISTAKES[name]
    error, text = config_error(*replacements)
    assert error.line == line_of(text, marker), str(error)
    assert message in error.message, str(error)


def test_operations_need_at_least_one(make_config, line_of):
    text = BASE_CONFIG[:BASE_CONFIG.index("operations:")] + "operations: {}\n" + \
        BASE_CONFIG[BASE_CONFIG.index("presets:"):]
    with pytest.raises(ConfigError) as caught:
        load(make_config(text=text))
    assert caught.value.message == ("operations: needs at least one operation; valid: fwd, bwd, "
                                    "kvcache")
    assert caught.value.line == line_of(text, "operations:")


# -- shared axes and rules with kvcache, which has no mode or dropout ------------------------------

def test_an_operation_takes_the_shared_axes_it_has(build):
    config, catalog = build(BWD_OPERATION, KVCACHE_OPERATION)
    kvcache = config.operations["kvcache"]
    assert tuple(kvcache.matrix.axes) == ("dtype", "kv_dtype", "hdim", "mask", "bias", "paged",
                                          "softcap", "pipeline", "arch", "pad_seqlen", "pad_hdim")
    # The top matrix's mode and dropout are fwd's and bwd's, also without bwd in the config.
    config, _ = build(KVCACHE_OPERATION)
    assert list(config.operations) == ["fwd", "kvcache"]
    assert "mode" in config.operations["fwd"].matrix.axes


def test_a_shared_rule_holds_for_the_operations_with_its_axes(build):
    rules = ("rules:\n  - {when: {mode: batch, pad_seqlen: true}, reason: fwd and bwd}\n"
             "  - {when: {arch: sm80, dtype: bf16}, reason: all three}\noperations:\n")
    config, catalog = build(BWD_OPERATION, KVCACHE_OPERATION, ("operations:\n", rules))
    first, second = config.shared_rules
    assert [len(op.rules) for op in config.operations.values()] == [2, 2, 2]
    assert config.operations["kvcache"].rules[0] is second
    assert {(i.op.token, i.point.pad_seqlen) for i in catalog.instances} == {
        ("fwd", False), ("bwd", False), ("kvcache", True)}
    assert not any(i.point.arch.token == "sm80" and i.point.traits.dtype.token == "bf16"
                   for i in catalog.instances)


def test_a_shared_rule_names_its_operations_with_op(build):
    rule = ("rules:\n  - {when: {op: [fwd, kvcache], mask: causal}, reason: no causal}\n"
            "operations:\n")
    config, catalog = build(BWD_OPERATION, KVCACHE_OPERATION, ("operations:\n", rule))
    assert [len(op.rules) for op in config.operations.values()] == [1, 0, 2]
    assert {(i.op.token, i.point.traits.mask.token) for i in catalog.instances} == {
        ("fwd", "none"), ("bwd", "none"), ("bwd", "causal"), ("kvcache", "none")}


KVCACHE_MISTAKES = {
    "kvcache axis in the top matrix": (
        (("  mode: [batch]", "  mode: [batch]\n  paged: [false]"),), "  paged: [false]",
        "matrix: paged is an axis of kvcache only; give it under operations.kvcache.matrix"),
    "shared rule on a kvcache axis": (
        (("operations:\n", "rules:\n  - {when: {paged: true}, reason: r}\noperations:\n"),),
        "paged: true", "rules[0].when: paged is an axis of kvcache only; give this rule under "
                       "operations.kvcache.rules"),
    "unknown operation in a shared rule": (
        (("operations:\n", "rules:\n  - {when: {op: decode}, reason: r}\noperations:\n"),),
        "op: decode", "rules[0].when.op: unknown value 'decode'; valid: fwd, bwd, kvcache"),
    "op in an operation's own rule": (
        (("{when: {pad_seqlen: false}", "{when: {op: kvcache}"),),
        "op: kvcache", "operations.kvcache.rules[0].when: unknown key 'op'; valid: dtype, "
                       "kv_dtype, hdim"),
    "a rule on an axis kvcache lacks": (
        (("{when: {pad_seqlen: false}", "{when: {mode: group}"),),
        "mode: group", "operations.kvcache.rules[0].when: unknown key 'mode'; valid: dtype, "
                       "kv_dtype, hdim, hdim_q, hdim_v, mask, bias, paged, softcap, pipeline, "
                       "arch, pad_seqlen, pad_hdim"),
    "kv_dtype in the top matrix": (
        (("  mode: [batch]", "  mode: [batch]\n  kv_dtype: [e4m3]"),), "kv_dtype: [e4m3]",
        "matrix: kv_dtype is an axis of kvcache only; give it under operations.kvcache.matrix"),
    "an unknown cache dtype": (
        (("  kv_dtype: [same]", "  kv_dtype: [same, fp8]"),), "kv_dtype: [same, fp8]",
        "operations.kvcache.matrix.kv_dtype: unknown value 'fp8'; valid: same, e4m3"),
    "a shared rule for an operation the config lacks": (
        (("operations:\n", "rules:\n  - {when: {op: bwd, mask: causal}, reason: r}\n"
                           "operations:\n"),),
        "op: bwd", "rules[0]: this rule matches no point of the matrix of any operation"),
}


@pytest.mark.parametrize("name", KVCACHE_MISTAKES)
def test_kvcache_mistake_is_reported_at_its_line(name, config_error, line_of):
    replacements, marker, message = KVCACHE_MISTAKES[name]
    error, text = config_error(KVCACHE_OPERATION, *replacements)
    assert error.line == line_of(text, marker), str(error)
    assert message in error.message, str(error)


def test_a_kvcache_instance_that_serves_nothing_is_an_error(config_error):
    # Unpadded kvcache instances would need lengths known on the host: the rule prunes them.
    error, text = config_error(KVCACHE_OPERATION, (
        "rules:\n  - {when: {pad_seqlen: false}, reason: the cache lengths live on the device}",
        "rules: []"))
    assert error.line == text[:text.rindex("    rules: []")].count("\n") + 1  # kvcache's
    assert error.message.startswith(
        "operations.kvcache.rules: kvcache_bf16_d128_causal_fa2_sm90a_m16n128 serves no problem, "
        "so the dispatcher can never run it (seqlen: needs batch mode, no seqused,")
