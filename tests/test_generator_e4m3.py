"""The e4m3 (FP8) forward in the generator: the dtype value, the rules that keep it to the fa3
pipeline on sm90a at head dims 64, 128 and 256, with row-major V in batch and group mode and V^T
in batch mode, its names and tiles (dtype- and vlayout-selected tile entries, shared memory of
1-byte inputs, a bf16 O of its own and a second V ring for a row-major V), the filter words
(e4m3 is the dtype's, kve4m3 the KV cache's), the presets, --explain, and what reaches the TU,
the dispatch table and the manifest. No GPU, no nvcc."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_traits, repository
from test_generator_dispatch import problem

from generator.dispatch import first_serving, serves
from generator.errors import GeneratorError
from generator.model import Tile
from generator.operations import OPERATIONS
from generator.render import MANIFEST, render
from generator.schema import BIAS, DTYPE, KV_DTYPE, MASK, MODE, VLAYOUT
from generator.selection import select

# (hdim, vlayout) -> the tile's name part and tile: d256 with a row-major V takes 64-key steps,
# as its second V ring does not fit beside 128-key ones.
E4M3_TILES = {(64, "row"): ("m192n128", Tile(192, 128, 16, 3)),
              (64, "col"): ("m192n128", Tile(192, 128, 16, 3)),
              (128, "row"): ("m128n128", Tile(128, 128, 12, 3)),
              (128, "col"): ("m128n128", Tile(128, 128, 12, 3)),
              (256, "row"): ("m128n64", Tile(128, 64, 12, 2)),
              (256, "col"): ("m128n128", Tile(128, 128, 12, 2))}


def e4m3_names(vlayout: str | None = None) -> list[str]:
    """Every e4m3 instance of instances.yaml (of one V layout, when given): fa3 on sm90a, head
    dims 64, 128 and 256, every mask; row-major V in batch mode with and without the
    log-sum-exp and in group mode with it, V^T in batch mode only (its rule: V^T tiles of
    packed sequences start at keys TMA cannot copy from)."""
    names = []
    for (hdim, layout), (tile, _) in E4M3_TILES.items():
        if vlayout not in (None, layout):
            continue
        spelled = "col_" if layout == "col" else ""
        modes = ("", "lse_") if layout == "col" else ("", "lse_", "group_lse_")
        for mask in ("", "causal_", "window_"):
            for mode_lse in modes:
                names.append(f"fwd_e4m3_d{hdim}_{mask}{spelled}{mode_lse}fa3_sm90a_{tile}_pad")
    return names


def fwd_e4m3(preset: str, filter_text: str = "") -> list:
    return [i for i in repository().select(preset, filter_text).instances
            if i.op.token == "fwd" and i.point.traits.dtype.token == "e4m3"]


# ---- the axis value and the matrix ---------------------------------------------------------

def test_e4m3_is_a_one_byte_dtype_of_the_forward_only():
    e4m3 = DTYPE.get("e4m3")
    assert (e4m3.cpp, e4m3.value, e4m3.element, e4m3.size) == (
        "fmha::DataType::kE4M3", 2, "__nv_fp8_e4m3", 1)
    matrices = {token: op.matrix["dtype"] for token, op in repository().config.operations.items()}
    assert {token: [d.token for d in dtypes] for token, dtypes in matrices.items()} == {
        "fwd": ["fp16", "bf16", "e4m3"], "bwd": ["fp16", "bf16"], "kvcache": ["fp16", "bf16"]}
    assert not any(i.point.traits.dtype.token == "e4m3" for i in repository().catalog.instances
                   if i.op.token != "fwd")
    assert OPERATIONS["fwd"].kernel(OPERATIONS["fwd"].pipelines.get("fa3"))


def test_the_e4m3_instances_are_fa3_sm90a_at_head_dims_64_128_256_v_transposed_in_batch_mode():
    instances = fwd_e4m3("all")
    assert sorted(i.name for i in instances) == sorted(e4m3_names())
    assert len(instances) == 45 and len(e4m3_names("row")) == 27
    for i in instances:
        traits, point = i.point.traits, i.point
        assert (point.pipeline.token, point.arch.token, traits.bias.token) == (
            "fa3", "sm90a", "none")
        assert traits.vlayout.token == "row" or traits.mode.token == "batch"
        assert traits.mode.token == "batch" or traits.lse
        assert point.pad_seqlen and not point.pad_hdim
        assert not (traits.dropout or traits.softcap)
        assert traits.hdim_q == traits.hdim_v
        assert i.tile == E4M3_TILES[traits.hdim_q, traits.vlayout.token][1]


def test_the_16_bit_forward_keeps_v_transposed_on_fa2():
    # {pipeline: fa3, dtype: [fp16, bf16], vlayout: col}: V^T of 16-bit inputs runs fa2 still.
    catalog = repository().catalog
    col = [i for i in catalog.instances if i.op.token == "fwd"
           and i.point.traits.vlayout.token == "col" and i.point.traits.dtype.size == 2]
    assert col and all(i.point.pipeline.token == "fa2" for i in col)
    assert any(i.point.arch.token == "sm90a" for i in col)


@pytest.mark.parametrize("fragment, reason", [
    ("{dtype: e4m3, pipeline: fa2}", "the e4m3 forward runs on fa3 only"),
    ("{dtype: e4m3, vlayout: col, mode: group}", "the e4m3 forward reads V^T (vlayout col) in "
                                                 "batch mode only"),
    ("{dtype: e4m3, hdim: [[192, 128]]}", "the e4m3 forward has tiles for head dims 64, 128 and "
                                         "256"),
])
def test_each_e4m3_rule_says_why(fragment, reason):
    rules = repository().config.operations["fwd"].rules
    text = {rule.label: rule.reason for rule in rules}
    assert any(" ".join(r.split()).startswith(reason) for r in text.values()), reason


@settings(max_examples=100, deadline=None)
@given(mask=st.sampled_from(MASK.tokens), bias=st.sampled_from(BIAS.tokens),
       vlayout=st.sampled_from(VLAYOUT.tokens), mode=st.sampled_from(MODE.tokens),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
       hdim=st.sampled_from([(64, 64), (128, 128), (256, 256), (192, 128), (96, 96), (16, 16),
                             (112, 128), (64, 128)]),
       seqlen=st.tuples(st.integers(1, 4096), st.integers(1, 4096)), seqused=st.booleans(),
       cc=st.sampled_from([80, 86, 89, 90, 100]))
def test_the_matrix_serves_e4m3_calls_where_its_rules_say(mask, bias, vlayout, mode, flags, hdim,
                                                          seqlen, seqused, cc):
    """An e4m3 call runs on an H100/H200 (cc 9.0) with row-major V in either mode or V^T in batch
    mode, no bias, dropout or soft-capping, at head dims 64, 128 or 256 exactly, on fa3,
    whatever its mask, lengths and lse; nothing else runs it (no fa2 instance, no padded head
    dims)."""
    lse, dropout, softcap = flags
    call = problem("e4m3", hdim, mask, bias, vlayout, mode, lse, dropout, softcap, seqlen=seqlen,
                   seqused=seqused, cc=cc)
    instances = repository().catalog.instances
    chosen = first_serving(instances, call)
    runs = (cc == 90 and (vlayout == "row" or mode == "batch") and bias == "none" and not dropout
            and not softcap and hdim in ((64, 64), (128, 128), (256, 256)))
    assert (chosen is not None) == runs
    if runs:
        assert (chosen.point.pipeline.token, chosen.point.arch.token) == ("fa3", "sm90a")
        assert chosen.point.traits.dtype.token == "e4m3" and chosen.point.traits.lse >= lse
        assert chosen.point.traits.vlayout.token == vlayout
        position = instances.index(chosen)
        assert not any(serves(i, call) for i in instances[:position])


# ---- filters: e4m3 is the dtype's word, kve4m3 the cache's -----------------------------------

@pytest.mark.parametrize("filter_text, vlayout", [
    ("e4m3", None), ("dtype=e4m3", None), ("fwd,e4m3", None), ("*_e4m3_*", None),
    ("fa3,sm90a,col,e4m3", "col"), ("e4m3,vlayout=row", "row")])
def test_e4m3_selects_the_e4m3_forward(filter_text, vlayout):
    selection = repository().select("all", filter_text).instances
    assert sorted(i.name for i in selection) == sorted(e4m3_names(vlayout))


@pytest.mark.parametrize("filter_text", ["kve4m3", "kv_dtype=e4m3", "kvcache,kve4m3",
                                         "*_kve4m3_*"])
def test_kve4m3_selects_the_e4m3_kv_cache(filter_text):
    selection = repository().select("all", filter_text).instances
    assert selection and all(i.op.token == "kvcache" and i.point.traits.kv_dtype.token == "e4m3"
                             for i in selection)
    assert len(selection) == sum(1 for i in repository().catalog.instances
                                 if i.op.token == "kvcache"
                                 and i.point.traits.kv_dtype == KV_DTYPE.get("e4m3"))


def test_e4m3_names_no_bwd_or_kvcache_instance():
    with pytest.raises(GeneratorError, match="'e4m3' matches none of the 4056 instances left"):
        repository().select("all", "bwd,e4m3")
    assert not any(i.op.token != "fwd" for i in repository().select("all", "e4m3|bf16,!bf16")
                   .instances)


# ---- presets -------------------------------------------------------------------------------

def test_presets_take_the_e4m3_forward():
    """default: d128, no mask and causal, batch mode, row-major V (the layout models hold), with
    the log-sum-exp (which also serves calls without it, as default's bf16 forward); extended
    and all: every e4m3 instance; coverage: every row-major one with the log-sum-exp, its V^T
    filter's (d64 and d128, no mask and causal, batch mode) and its lean d64 ones (no mask and
    causal, batch mode, without the log-sum-exp); the presets of 16-bit APIs none."""
    assert sorted(i.name for i in fwd_e4m3("default")) == [
        "fwd_e4m3_d128_causal_lse_fa3_sm90a_m128n128_pad",
        "fwd_e4m3_d128_lse_fa3_sm90a_m128n128_pad"]
    assert sorted(i.name for i in fwd_e4m3("extended")) == sorted(e4m3_names())
    lean_d64 = ["fwd_e4m3_d64_causal_fa3_sm90a_m192n128_pad", "fwd_e4m3_d64_fa3_sm90a_m192n128_pad"]
    assert sorted(i.name for i in fwd_e4m3("coverage")) == sorted(
        [name for name in e4m3_names("row") if "_lse_" in name] + lean_d64
        + [name for name in e4m3_names("col") if "window" not in name and "_d256_" not in name
           and "_lse_" in name])
    for preset in ("minimal", "flash_attn", "pytorch"):
        assert fwd_e4m3(preset) == []


# ---- tiles: dtype and vlayout selectors, and the shared memory of 1-byte inputs -------------

E4M3_MATRIX = ("dtype: [fp16, bf16]", "dtype: [fp16, e4m3]")
E4M3_TILE = ("  - {pipeline: fa2, dtype: e4m3, hdim_q: 64, hdim_v: 64, block_m: 128, block_n: 64, "
             "warps: 8, stages: 2, why: e4m3 d64}\n"
             "  - {pipeline: fa2, dtype: e4m3, hdim_q: 128, hdim_v: 128, block_m: 64, block_n: 32, "
             "warps: 4, stages: 2, why: e4m3 d128}\n")


def test_an_e4m3_point_takes_a_tile_entry_that_names_its_dtype(config_error, line_of):
    # An entry without `dtype` serves the 16-bit dtypes only.
    error, text = config_error(E4M3_MATRIX)
    assert error.line == line_of(text, "tiles:")
    assert error.message == ("operations.fwd.tiles: no entry matches pipeline=fa2, arch=sm80, "
                             "hdim_q=64, hdim_v=64, dtype=e4m3, vlayout=row; add one")


def test_dtype_selects_a_tile_entry(build):
    config, catalog = build(E4M3_MATRIX, ("rules: []", E4M3_TILE + "rules: []"))
    tiles = {(i.point.traits.dtype.token, i.point.traits.hdim_q): i.tile
             for i in catalog.instances}
    assert tiles == {("fp16", 64): Tile(128, 64, 8, 2), ("fp16", 128): Tile(64, 32, 4, 2),
                     ("e4m3", 64): Tile(128, 64, 8, 2), ("e4m3", 128): Tile(64, 32, 4, 2)}
    assert any(i.name.startswith("fwd_e4m3_d64_") for i in catalog.instances)


def test_a_dtype_entry_without_points_is_an_error(config_error, line_of):
    error, text = config_error(("rules: []", E4M3_TILE + "rules: []"))
    assert error.line == line_of(text, "why: e4m3 d64}")
    assert error.message == ("operations.fwd.tiles[2]: this entry matches no instance; fix or "
                             "remove it")


# The fa3 tiles of BASE_CONFIG's fwd operation, one for e4m3 inputs of each V layout.
FA3_E4M3 = (("pipeline: [fa2]", "pipeline: [fa3]"),
            ("arch: [sm80, sm90a]", "arch: [sm90a]"),
            ("pad_seqlen: [false, true]", "pad_seqlen: [true]"),
            ("dtype: [fp16, bf16]", "dtype: [e4m3]"),
            ("hdim:\n    - [64, 64]\n    - [128, 128]", "hdim:\n    - [128, 128]"),
            ("vlayout: [row]", "vlayout: [row, col]"))
FA3_E4M3_TILES = (
    "  - {pipeline: fa3, dtype: e4m3, vlayout: row, hdim_q: 128, hdim_v: 128, block_m: 128, "
    "block_n: 64, warps: 12, stages: 2, why: e4m3 row}\n"
    "  - {pipeline: fa3, dtype: e4m3, vlayout: col, hdim_q: 128, hdim_v: 128, block_m: 128, "
    "block_n: 128, warps: 12, stages: 2, why: e4m3 col}\n")
FA2_TILES = ("  - {pipeline: fa2, hdim_q: 64, hdim_v: 64, block_m: 128, block_n: 64, warps: 8, "
             "stages: 2, why: d64}\n  - pipeline: fa2\n    hdim_q: 128\n    hdim_v: 128\n"
             "    block_m: 64\n    block_n: 32\n    warps: 4\n    stages: 2\n    why: d128\n")


def test_vlayout_selects_a_tile_entry(build):
    _, catalog = build(*FA3_E4M3, (FA2_TILES, FA3_E4M3_TILES))
    tiles = {i.point.traits.vlayout.token: i.tile for i in catalog.instances}
    assert tiles == {"row": Tile(128, 64, 12, 2), "col": Tile(128, 128, 12, 2)}
    assert sorted(i.name for i in catalog.instances) == [
        "fwd_e4m3_d128_causal_col_fa3_sm90a_m128n128_pad",
        "fwd_e4m3_d128_causal_fa3_sm90a_m128n64_pad",
        "fwd_e4m3_d128_col_fa3_sm90a_m128n128_pad", "fwd_e4m3_d128_fa3_sm90a_m128n64_pad"]


def test_an_entry_without_vlayout_serves_both(build):
    both = FA3_E4M3_TILES.split("\n")[0].replace("vlayout: row, ", "").replace("row}", "both}")
    both += "\n"
    _, catalog = build(*FA3_E4M3, (FA2_TILES, both))
    assert {i.point.traits.vlayout.token for i in catalog.instances} == {"row", "col"}
    assert {i.tile for i in catalog.instances} == {Tile(128, 64, 12, 2)}


def test_a_vlayout_entry_beside_one_without_is_two_matches(config_error, line_of):
    both = FA3_E4M3_TILES.split("\n")[0].replace("vlayout: row, ", "").replace("row}", "both}")
    both += "\n"
    error, text = config_error(*FA3_E4M3, (FA2_TILES, both + FA3_E4M3_TILES))
    assert error.line == line_of(text, "why: e4m3 row}")
    assert error.message.endswith("both match pipeline=fa3, arch=sm90a, hdim_q=128, hdim_v=128, "
                                  "dtype=e4m3, vlayout=row; each instance needs exactly one")


def test_a_vlayout_without_its_entry_is_named(config_error, line_of):
    error, text = config_error(*FA3_E4M3, (FA2_TILES, FA3_E4M3_TILES.split("\n")[0] + "\n"))
    assert error.line == line_of(text, "tiles:")
    assert error.message == ("operations.fwd.tiles: no entry matches pipeline=fa3, arch=sm90a, "
                             "hdim_q=128, hdim_v=128, dtype=e4m3, vlayout=col; add one")


def test_a_bad_vlayout_names_the_valid_ones(config_error, line_of):
    error, text = config_error(("pipeline: fa2, hdim_q: 64",
                                "pipeline: fa2, vlayout: T, hdim_q: 64"))
    assert error.line == line_of(text, "vlayout: T")
    assert error.message == "operations.fwd.tiles[0].vlayout: unknown value 'T'; valid: row, col"


def test_vlayout_is_a_selector_of_the_forwards_tiles_only(config_error, line_of):
    from conftest import BWD_OPERATION
    error, text = config_error(BWD_OPERATION, (
        "  - {pipeline: fa2, hdim_q: 64, hdim_v: 64, block_m: 64, block_n: 128",
        "  - {pipeline: fa2, vlayout: row, hdim_q: 64, hdim_v: 64, block_m: 64, block_n: 128"))
    assert error.line == line_of(text, "vlayout: row, hdim_q: 64")
    assert error.message.startswith("operations.bwd.tiles[0]: unknown key 'vlayout'; valid: ")
    assert error.message.endswith(", why, arch, dtype, full_grid")


def fa3_smem(tile: Tile, hdim: int, dtype: str = "e4m3", vlayout: str = "row") -> int:
    kernel = OPERATIONS["fwd"].kernel(OPERATIONS["fwd"].pipelines.get("fa3"))
    return kernel.shared_memory.bytes(tile, make_traits("fwd", (hdim, hdim), dtype=dtype,
                                                        vlayout=vlayout))


def test_fa3_e4m3_shared_memory_counts_bytes_of_one_os_own_region_and_a_row_major_vs_ring():
    # V^T: d256, Q 128 * 256, two stages of 128 keys x (256 + 256), O 128 * 256 * 2, 1 KB.
    assert fa3_smem(Tile(128, 128, 12, 2), 256, vlayout="col") == (
        128 * 256 + 2 * 128 * 512 + 128 * 256 * 2 + 1024) == 230400
    assert fa3_smem(Tile(128, 128, 12, 3), 128, vlayout="col") == 148480
    assert fa3_smem(Tile(192, 128, 16, 3), 64, vlayout="col") == 87040
    # Row-major V: a stage holds K, V and V^T. d256 on 64 keys: Q 32 KB, two stages of
    # 64 x (256 + 512), O 64 KB, 1 KB (193 KB); d128 and d64 on the V^T tiles (193 and 109 KB).
    assert fa3_smem(Tile(128, 64, 12, 2), 256) == (
        128 * 256 + 2 * 64 * (256 + 2 * 256) + 2 * 128 * 256 + 1024) == 197632
    assert fa3_smem(Tile(128, 128, 12, 3), 128) == 16384 + 3 * 128 * 384 + 32768 + 1024 == 197632
    assert fa3_smem(Tile(192, 128, 16, 3), 64) == 12288 + 3 * 128 * 192 + 24576 + 1024 == 111616
    # 16-bit inputs as before, either layout (fa3 reads a 16-bit V row-major; O over Q).
    for dtype in ("bf16", "fp16"):
        assert fa3_smem(Tile(128, 80, 12, 2), 256, dtype) == 2 * (128 * 256 + 2 * 80 * 512) + 1024


def test_fa3_shared_memory_formula_in_words_per_dtype_and_vlayout():
    smem = OPERATIONS["fwd"].kernel(OPERATIONS["fwd"].pipelines.get("fa3")).shared_memory
    col, row, bf16 = (smem.formula(make_traits("fwd", (128, 128), dtype=dtype, vlayout=vlayout))
                      for dtype, vlayout in (("e4m3", "col"), ("e4m3", "row"), ("bf16", "row")))
    assert col.startswith("block_m * hdim_q + stages * block_n * (hdim_q + hdim_v) + 2 * block_m")
    assert col.endswith("of e4m3 inputs with V^T")
    assert row.startswith("block_m * hdim_q + stages * block_n * (hdim_q + 2 * hdim_v) + 2 * "
                          "block_m * hdim_v")
    assert row.endswith("of e4m3 inputs with row-major V (its tiles and their transposes in rings "
                        "of their own)")
    assert bf16 == smem.formula(make_traits("fwd", (128, 128), vlayout="col")) == (
        "2 * (block_m * max(hdim_q, hdim_v) + stages * block_n * (hdim_q + hdim_v)) + 1024 "
        "(barriers and alignment)")


def _build_with(old: str, new: str):
    """instances.yaml's catalog with `old` (once in the file) replaced by `new`."""
    import tempfile
    from pathlib import Path

    from generator.catalog import build_catalog
    from generator.config import DEFAULT_CONFIG, load
    text = DEFAULT_CONFIG.read_text()
    assert text.count(old) == 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "instances.yaml"
        path.write_text(text.replace(old, new))
        return build_catalog(load(path))


E4M3_D256 = "        hdim_q: 256\n        hdim_v: 256\n        block_m: 128\n        block_n: {}\n"


@pytest.mark.parametrize("vlayout, block_n, stages, needed, formula", [
    # Three stages of the V^T tile: 32768 + 196608 + 65536 + 1024 bytes.
    ("col", 128, 3, 295936, "block_m * hdim_q + stages * block_n * (hdim_q + hdim_v) + 2 * "
     "block_m * hdim_v (O, bf16, in its own region) + 1024 (barriers and alignment), of e4m3 "
     "inputs with V^T"),
    # The V^T tile's 128 keys with a row-major V: 32768 + 2 * 128 * 768 + 65536 + 1024 bytes.
    ("row", 128, 2, 295936, "block_m * hdim_q + stages * block_n * (hdim_q + 2 * hdim_v) + 2 * "
     "block_m * hdim_v (O, bf16, in its own region) + 1024 (barriers and alignment), of e4m3 "
     "inputs with row-major V (its tiles and their transposes in rings of their own)"),
])
def test_an_e4m3_tile_past_sm90as_shared_memory_is_an_error(vlayout, block_n, stages, needed,
                                                            formula):
    from generator.errors import ConfigError
    old = (f"        vlayout: {vlayout}\n" + E4M3_D256.format(128 if vlayout == "col" else 64)
           + "        warps: 12\n        stages: 2\n")
    new = (f"        vlayout: {vlayout}\n" + E4M3_D256.format(block_n)
           + f"        warps: 12\n        stages: {stages}\n")
    with pytest.raises(ConfigError) as caught:
        _build_with(old, new)
    assert caught.value.message.endswith(
        f"the tile needs {needed} bytes of shared memory ({formula}), more than the 232448 a CTA "
        f"may use on sm90a")


# ---- --list and --explain ------------------------------------------------------------------

def test_cli_lists_the_e4m3_instances(run_cli):
    result = run_cli("--preset", "all", "--filter", "e4m3", "--list")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == sorted(e4m3_names())


def test_explain_an_e4m3_call(run_cli):
    result = run_cli("--explain", "dtype=e4m3,hdim=128,mask=causal,arch=sm90a")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        "chosen:  fwd_e4m3_d128_causal_lse_fa3_sm90a_m128n128_pad",
        "why:     the only one of the 10 selected fwd instances that serves it"]
    result = run_cli("--explain", "dtype=e4m3,hdim=256,mode=group,mask=causal,arch=sm90a",
                     "--preset", "all")
    assert "chosen:  fwd_e4m3_d256_causal_group_lse_fa3_sm90a_m128n64_pad" in result.stdout
    # On an A100 no instance runs it: the fa3 kernel is sm90a's.
    result = run_cli("--explain", "dtype=e4m3,hdim=128,vlayout=col,arch=80", "--preset", "all")
    assert "no fwd instance of the whole matrix serves it either" in result.stdout
    assert "fwd_e4m3_d128_col_fa3_sm90a_m128n128_pad: sm90a runs only on cc 90" in result.stdout


def test_explain_an_e4m3_call_the_rules_leave_out(run_cli):
    """V^T in group mode and (192, 128) have no e4m3 instance: the miss quotes the rule."""
    result = run_cli("--explain", "dtype=e4m3,hdim=128,vlayout=col,mode=group,lse=true,arch=sm90a",
                     "--preset", "all")
    lines = result.stdout.splitlines()
    assert lines[-1] == "extend the matrix (instances.yaml) to build one"
    assert lines[-3] == "instances.yaml's rules drop these traits:"
    assert lines[-2].startswith("  operations.fwd.rules[")
    assert lines[-2].split(": ", 1)[1].startswith(
        "the e4m3 forward reads V^T (vlayout col) in batch mode only")
    result = run_cli("--explain", "dtype=e4m3,hdim=192x128,vlayout=col,arch=sm90a")
    assert "the e4m3 forward has tiles for head dims 64, 128 and 256" in result.stdout


# ---- what the TU, the dispatch table and the manifest say ---------------------------------

def test_an_e4m3_instance_reaches_the_tu_and_the_table():
    name = "fwd_e4m3_d128_causal_col_lse_fa3_sm90a_m128n128_pad"
    matrix = repository()
    selection = select(matrix.config, matrix.catalog, "all", "e4m3,hdim128,causal,batch,lse,col",
                       preset_tokens=matrix.preset_tokens)
    files = render(selection, source="instances.yaml")
    tu = files[f"{name}.cu"]
    assert '#include "fmha/kernels/fwd_fa3_sm90.cuh"' in tu
    assert ("using Config = fmha::fa3::FwdConfig<\n"
            "      /*Element=*/__nv_fp8_e4m3, /*kHeadDimQK=*/128, /*kHeadDimV=*/128,\n"
            "      /*kBlockM=*/128, /*kBlockN=*/128, /*kNumWarps=*/12, /*kStages=*/3,\n"
            "      /*kMask=*/fmha::MaskType::kCausal, /*kBias=*/fmha::BiasType::kNone,\n"
            "      /*kVLayout=*/fmha::VLayout::kColMajor, /*kMode=*/fmha::Mode::kBatch,\n"
            "      /*kLse=*/true, /*kDropout=*/false, /*kSoftcap=*/false,\n"
            "      /*kPadSeqlen=*/true, /*kPadHdim=*/false,\n"
            "      /*kSmemLimit=*/232448>;") in tu
    table = files["dispatch_table.cpp"]
    assert 'const char* const kDataTypeTokens[] = {"fp16", "bf16", "e4m3"};' in table
    assert "{/*dtype=*/fmha::DataType::kE4M3, /*hdim_q=*/128, /*hdim_v=*/128," in table
    (record,) = json.loads(files[MANIFEST])["instances"]
    assert (record["name"], record["dtype"], record["vlayout"], record["stages"]) == (
        name, "e4m3", "col", 3)


def test_a_row_major_e4m3_group_instance_reaches_the_tu():
    name = "fwd_e4m3_d256_causal_group_lse_fa3_sm90a_m128n64_pad"
    matrix = repository()
    selection = select(matrix.config, matrix.catalog, "all", "e4m3,hdim256,causal,group",
                       preset_tokens=matrix.preset_tokens)
    assert [i.name for i in selection.instances] == [name]
    tu = render(selection, source="instances.yaml")[f"{name}.cu"]
    assert ("      /*kBlockM=*/128, /*kBlockN=*/64, /*kNumWarps=*/12, /*kStages=*/2,\n"
            "      /*kMask=*/fmha::MaskType::kCausal, /*kBias=*/fmha::BiasType::kNone,\n"
            "      /*kVLayout=*/fmha::VLayout::kRowMajor, /*kMode=*/fmha::Mode::kGroup,\n") in tu
