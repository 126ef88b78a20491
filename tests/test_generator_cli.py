"""`python -m generator` end to end, as CMake and users run it (a subprocess, repo root as cwd)."""

from __future__ import annotations

import json

import pytest

SUMMARY_FIELDS = ("name", "op", "dtype", "hdim_q", "hdim_v", "mask", "bias", "vlayout", "mode",
                  "lse", "dropout", "softcap", "pipeline", "arch", "pad_seqlen", "pad_hdim",
                  "block_m", "block_n", "warps", "stages", "tu")
BWD_SUMMARY_FIELDS = ("name", "op", "dtype", "hdim_q", "hdim_v", "mask", "bias", "mode", "dbias",
                      "dropout", "softcap", "pipeline", "arch", "pad_seqlen", "pad_hdim",
                      "block_m", "block_n", "warps", "stages", "tu")
KVCACHE_SUMMARY_FIELDS = ("name", "op", "dtype", "kv_dtype", "hdim_q", "hdim_v", "mask", "bias",
                          "paged", "softcap", "pipeline", "arch", "pad_seqlen", "pad_hdim",
                          "block_m", "block_n", "warps", "stages", "tu")
DEFAULT_SELECTED = ("29 of 15801 instances selected (fwd 10, bwd 5, kvcache 14; 129351 "
                    "pruned)")


def test_default_render(run_cli, tmp_path):
    out = tmp_path / "gen"
    result = run_cli("--out", out)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"generator: {DEFAULT_SELECTED}, 29 TUs (sm80 12, sm90a 17), "
                             f"32 files written, 0 unchanged, 0 removed -> {out.as_posix()}\n")
    assert len(list(out.glob("fwd_*.cu"))) == 10 and len(list(out.glob("bwd_*.cu"))) == 5
    # The e4m3 (FP8) forward at d128, no mask and causal, batch mode, row-major V, for
    # H100/H200 only.
    assert sorted(p.name for p in out.glob("fwd_e4m3_*.cu")) == [
        "fwd_e4m3_d128_causal_lse_fa3_sm90a_m128n128_pad.cu",
        "fwd_e4m3_d128_lse_fa3_sm90a_m128n128_pad.cu"]
    assert len(list(out.glob("kvcache_*.cu"))) == 14
    # Decode from an e4m3 cache, and chunked prefill from it on a paged cache, causal, as from
    # the 16-bit cache, for H100/H200 only.
    assert sorted(p.name for p in out.glob("kvcache_*_kve4m3_*.cu")) == sorted(
        [f"kvcache_bf16_kve4m3_d128_{traits}fa2_sm90a_m16n128_pad.cu"
         for traits in ("", "causal_", "causal_paged_", "paged_")]
        + ["kvcache_bf16_kve4m3_d128_causal_paged_fa3_sm90a_m128n128_pad.cu"])
    assert {"dispatch_table.cpp", "instances.cmake", "manifest.json"} <= {
        p.name for p in out.iterdir()}


def test_second_run_writes_nothing(run_cli, tmp_path):
    out = tmp_path / "gen"
    run_cli("--out", out)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    result = run_cli("--out", out)
    assert "0 files written, 32 unchanged, 0 removed" in result.stdout
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_narrowing_removes_stale_tus(run_cli, tmp_path):
    out = tmp_path / "gen"
    run_cli("--out", out, "--preset", "extended", "--filter", "fp16,hdim64")
    result = run_cli("--out", out, "--preset", "minimal", "--targets", "90a")
    assert result.returncode == 0, result.stderr
    # minimal's fwd instances leave out the log-sum-exp, extended's write it: none are shared;
    # its two sm90a bwd and three sm90a kvcache ones are extended's.
    assert "7 of 15801 instances selected (fwd 2, bwd 2, kvcache 3;" in result.stdout
    assert "5 unchanged, 85 removed" in result.stdout
    assert sorted(p.name for p in out.glob("*.cu")) == [
        "bwd_fp16_d64_fa2_sm90a_m128n128_pad_hpad.cu", "bwd_fp16_d64_fa3_sm90a_m128n128_pad.cu",
        "fwd_fp16_d64_fa2_sm90a_m128n64_pad_hpad.cu", "fwd_fp16_d64_fa3_sm90a_m192n128_pad.cu",
        "kvcache_fp16_d64_fa2_sm90a_m16n128_pad.cu",
        "kvcache_fp16_d64_paged_fa2_sm90a_m16n128_pad.cu",
        "kvcache_fp16_d64_paged_fa3_sm90a_m192n128_pad.cu"]


def test_list(run_cli):
    result = run_cli("--list", "--preset", "extended", "--filter", "bf16,hdim128,causal,mode=batch",
                     "--targets", "sm90a")
    assert result.returncode == 0, result.stderr
    # Each operation's instances in its dispatch order, fwd's first.
    assert result.stdout.split() == ["fwd_bf16_d128_causal_lse_fa3_sm90a_m128n128_pad",
                                     "fwd_bf16_d128_causal_lse_fa2_sm90a_m128n64_pad_hpad",
                                     "bwd_bf16_d128_causal_fa3_sm90a_m64n128_pad",
                                     "bwd_bf16_d128_causal_fa2_sm90a_m64n128_pad_hpad"]
    bwd = run_cli("--list", "--preset", "extended", "--filter", "bwd,bf16,hdim128,causal,mode=batch",
                  "--targets", "sm90a")
    assert bwd.stdout.split() == result.stdout.split()[2:]
    assert run_cli("--list", "--preset", "extended", "--filter",
                   "op=bwd,bf16,hdim128,causal,mode=batch", "--targets", "sm90a").stdout == bwd.stdout


def test_json(run_cli):
    result = run_cli("--json", "--preset", "minimal")
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert [r["op"] for r in records] == ["fwd"] * 4 + ["bwd"] * 4 + ["kvcache"] * 6
    fields = {"fwd": SUMMARY_FIELDS, "bwd": BWD_SUMMARY_FIELDS, "kvcache": KVCACHE_SUMMARY_FIELDS}
    for record in records:
        # A decode instance with a full-grid tile (d64 on sm90a, instances.yaml) records it
        # before its TU.
        full_grid = (record["op"], record.get("pipeline"), record.get("arch")) == (
            "kvcache", "fa2", "sm90a")
        assert ("full_grid" in record) == full_grid
        expected = fields[record["op"]]
        assert tuple(record) == (expected[:-1] + ("full_grid", "tu") if full_grid else expected)
        assert record["name"].startswith(f"{record['op']}_")
        assert record["tu"] == f"{record['name']}.cu"
        assert (record["dtype"], record["hdim_q"], record["mask"], record.get("lse", False),
                record.get("dbias", False)) == ("fp16", 64, "none", False, False)
        # fa2 has the unpadded fast path and the fully padded fallback; fa3 pads seqlens only;
        # kvcache's fa2 pads seqlens (its cache lengths live on the device), with exact or
        # padded head dims.
        if record["op"] == "kvcache":
            allowed = ((True, False), (True, True))
        else:
            allowed = ((False, False), (True, True)) if record["pipeline"] == "fa2" else (
                (True, False),)
        assert (record["pad_seqlen"], record["pad_hdim"]) in allowed
    assert sorted(r["pipeline"] for r in records[:4]) == ["fa2", "fa2", "fa2", "fa3"]
    assert {(r["arch"], r["pipeline"], r["block_m"], r["block_n"]) for r in records[4:8]} == {
        ("sm80", "fa2", 128, 128), ("sm90a", "fa2", 128, 128), ("sm90a", "fa3", 128, 128)}
    # kvcache decode at d64: 64-key tiles, 128-key ones on sm90a; and the fa3 prefill tile.
    assert {(r["arch"], r["paged"], r["block_m"], r["block_n"]) for r in records[8:]} == {
        ("sm80", False, 16, 64), ("sm80", True, 16, 64), ("sm90a", False, 16, 128),
        ("sm90a", True, 16, 128), ("sm90a", True, 192, 128)}


def test_json_and_summary_leave_out_pruned_instances(run_cli, make_config, tmp_path):
    path = make_config(("rules: []",
                        "rules:\n  - when: {dtype: bf16, mask: causal}\n    reason: x"))
    records = json.loads(run_cli("--config", path, "--json").stdout)
    assert len(records) == 24
    assert not any(r["dtype"] == "bf16" and r["mask"] == "causal" for r in records)
    result = run_cli("--config", path, "--out", tmp_path / "gen")
    assert result.stdout.startswith("generator: 24 of 24 instances selected (fwd 24; 8 pruned), "
                                    "24 TUs (sm80 12, sm90a 12), 27 files")


def test_quiet(run_cli, tmp_path):
    result = run_cli("-q", "--out", tmp_path / "gen")
    assert result.returncode == 0 and result.stdout == ""


@pytest.mark.parametrize("args", [
    ["--filter", "fp61"], ["--filter", "none"], ["--filter", "hdim512"], ["--preset", "nightly"],
    ["--targets", "sm75"], ["--list", "--json"], ["--shard", "0/2"], ["--shard", "3/2"],
    ["--shard", "two"], ["--presets", "--shard", "1/2"], ["--explain", "dtype=fp16,hdim=64",
                                                          "--json"],
    ["--explain", "hdim=64"], ["--list", "--presets"], ["--loadable", "--list"],
    ["--loadable", "--shard", "1/2"],
    # Numbers that int() rejects ('²' is a digit to str.isdigit()) or that are too long for it.
    ["--shard", "1/" + "9" * 5000], ["--explain", "dtype=fp16,hdim=64,seqlen_q=²"],
    ["--explain", "dtype=fp16,hdim=" + "6" * 5000], ["--filter", "hdim_q=²"],
])
def test_user_errors_exit_2_without_traceback_or_output(run_cli, tmp_path, args):
    out = tmp_path / "gen"
    result = run_cli("--out", out, *args)
    assert result.returncode == 2, args
    assert "Traceback" not in result.stderr and result.stdout == "", args
    assert not out.exists(), args


def test_the_output_directory_cannot_hold_the_working_directory(run_cli):
    for out in (".", ".."):
        result = run_cli("--out", out)
        assert result.returncode == 2
        assert result.stderr == (f"--out: {out} holds the working directory, and a run replaces "
                                 f"its output directory as a whole: give it one of its own\n")


def test_unknown_filter_token_lists_valid_tokens(run_cli):
    result = run_cli("--list", "--filter", "fp16,casual")
    lines = result.stderr.splitlines()
    assert lines[0] == "--filter: unknown token 'casual'"
    assert any(line.split()[:1] == ["mask"] and "causal" in line for line in lines[1:])


def test_help_documents_the_filter_grammar_and_the_options(run_cli):
    result = run_cli("--help")
    assert result.returncode == 0
    words = " ".join(result.stdout.split())
    for text in ("--filter", "--preset", "--targets", "--list", "--json", "--out", "--config",
                 "--presets", "--shard", "--explain", "axis=value", "hdim128", "mask=none",
                 "glob", "hpad", "lse", "seqlen_q", "dispatch_table.cpp and manifest.json still",
                 "fwd, bwd, kvcache (op=kvcache)", "dbias", "paged", "op=bwd,dtype=bf16",
                 "op=kvcache,dtype=bf16"):
        assert text in words, text


# -- --presets ---------------------------------------------------------------------------------

def test_presets_table(run_cli):
    result = run_cli("--presets")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["preset", "fwd", "bwd", "kvcache", "TUs", "sm80", "sm90a", "why"]
    rows = {line.split()[0]: [int(n) for n in line.split()[1:7]]
            for line in lines[1:] if not line.startswith(" ")}
    assert rows == {"default": [10, 5, 14, 29, 12, 17],
                    "extended": [321, 276, 444, 1041, 444, 597],
                    "minimal": [4, 4, 6, 14, 7, 7],
                    "flash_attn": [2040, 2040, 1188, 5268, 2592, 2676],
                    "pytorch": [448, 672, 0, 1120, 560, 560],
                    "coverage": [616, 392, 664, 1672, 778, 894],
                    "all": [10149, 4056, 1596, 15801, 7824, 7977]}
    assert "CI smoke build (14 TUs)" in result.stdout
    assert max(map(len, lines)) <= 100


def test_presets_json_with_targets_and_filter(run_cli):
    result = run_cli("--presets", "--json", "--targets", "90a", "--filter", "!window")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [row["preset"] for row in rows] == ["default", "extended", "minimal", "flash_attn",
                                               "pytorch", "coverage", "all"]
    default = rows[0]
    assert default == {
        "preset": "default",
        "filters": [
            "fwd,bf16,hdim128,causal,bias=none,vlayout=row,lse,!dropout,!softcap,!*_fa2_sm90a_*",
            "fwd,bf16,hdim128,mask=none,mode=batch,bias=none,vlayout=row,lse,!dropout,!softcap,"
            "!*_fa2_sm90a_*",
            "bwd,bf16,hdim128,causal,bias=none,!dropout,!softcap,!*_fa2_sm90a_*",
            "kvcache,fa2,bf16,kv_dtype=same,hdim128,mask=none|causal,bias=none,!softcap,nohpad",
            "kvcache,fa3,paged,bf16,kv_dtype=same,hdim128,causal",
            "kvcache,fa2,bf16,kv_dtype=e4m3,hdim128,mask=none|causal,bias=none,!softcap,nohpad,"
            "sm90a",
            "kvcache,fa3,paged,bf16,kv_dtype=e4m3,hdim128,causal",
            "fwd,fa3,e4m3,hdim128,mask=none|causal,vlayout=row,mode=batch,lse"],
        "instances": 17, "instances_per_op": {"fwd": 5, "bwd": 2, "kvcache": 10}, "tus": 17,
        "tus_per_target": {"sm80": 0, "sm90a": 17}, "why": default["why"]}
    assert default["why"].startswith("What `pip install .` builds")
    # extended's e4m3 forward on sm90a without windows: 30 of its 45; its chunked prefill from an
    # e4m3 cache without windows: 16 of its 24 (fp16 and bf16, d64 and d128, contiguous and
    # paged, no mask and causal).
    assert rows[1]["instances_per_op"] == {"fwd": 100 + 30, "bwd": 100, "kvcache": 152 + 16}
    assert rows[2]["instances_per_op"] == {"fwd": 2, "bwd": 2, "kvcache": 3}


def test_presets_count_an_emptied_preset_as_zero(run_cli):
    rows = json.loads(run_cli("--presets", "--json", "--filter", "dropout").stdout)
    # kvcache has no dropout: none of its instances has it.
    assert {row["preset"]: tuple(row["instances_per_op"].values()) for row in rows} == {
        "default": (0, 0, 0), "extended": (0, 0, 0), "minimal": (0, 0, 0),
        "flash_attn": (1008, 1008, 0), "pytorch": (224, 336, 0), "coverage": (60, 60, 0),
        "all": (5040, 2016, 0)}


# -- --shard -----------------------------------------------------------------------------------

def test_shards_split_the_selection(run_cli, tmp_path):
    whole = run_cli("--list", "--preset", "extended").stdout.split()
    parts = [run_cli("--list", "--preset", "extended", "--shard", f"{index}/4").stdout.split()
             for index in range(1, 5)]
    assert sorted(sum(parts, [])) == sorted(whole)
    assert all(part == [name for name in whole if name in part] for part in parts)
    assert [len(part) for part in parts] == [261, 260, 260, 260]
    assert parts[1] == run_cli("--list", "--preset", "extended",
                               "--shard", "2/4").stdout.split()  # deterministic


def test_shard_render(run_cli, tmp_path):
    out = tmp_path / "gen"
    result = run_cli("--out", out, "--preset", "extended", "--shard", "2/4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("generator: 1041 of 15801 instances selected (fwd 321, "
                                    "bwd 276, kvcache 444; 129351 pruned); shard 2/4: 260 TUs "
                                    "(sm80 ")
    assert "263 files written" in result.stdout
    tus = sorted(p.name for p in out.glob("*.cu"))
    listed = run_cli("--list", "--preset", "extended", "--shard", "2/4").stdout.split()
    assert tus == sorted(f"{name}.cu" for name in listed)
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["instances"]) == 1041
    assert (manifest["shard"]["index"], manifest["shard"]["count"]) == (2, 4)
    assert sorted(manifest["shard"]["tus"]) == tus
    table = (out / "dispatch_table.cpp").read_text()
    assert table.count("&instances::launch_") == 1041
    assert table.count("&instances::workspace_bwd_") == 276
    assert table.count("&instances::workspace_kvcache_") == 444


def test_bad_shard_message(run_cli):
    result = run_cli("--list", "--shard", "5/4")
    assert result.returncode == 2
    assert result.stderr == "--shard: expected K/N with 1 <= K <= N, e.g. 2/4; got '5/4'\n"


# -- --explain ---------------------------------------------------------------------------------

def test_explain_hit_names_the_rule_and_the_runner_up(run_cli):
    result = run_cli("--explain", "dtype=bf16,hdim=120,mask=causal,seqlen_q=1000,arch=8.6",
                     "--preset", "extended")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("problem: dtype=bf16,hdim=120x120,mask=causal,bias=none,vlayout=row,"
                        "mode=batch,lse=false,dropout=false,softcap=false,seqlen_q=1000,"
                        "seqlen_k=1024,seqused=false,arch=86")
    assert lines[1] == "chosen:  fwd_bf16_d128_causal_lse_fa2_sm80_m128n64_pad_hpad"
    assert lines[2] == (
        "why:     4 of the 321 selected fwd instances serve it; it goes ahead of the runner-up "
        "fwd_bf16_d192x128_causal_lse_fa2_sm80_m128n64_pad_hpad by rule 6 of the dispatch order, "
        "the tightest padded head dims first: head dims 128x128 against head dims 192x128")
    assert lines[3] == "serving, in dispatch order:"
    assert len(lines) == 8


def test_explain_prefers_the_newer_pipeline(run_cli):
    result = run_cli("--explain", "dtype=fp16,hdim=64,lse=true,arch=sm90a", "--preset", "extended")
    lines = result.stdout.splitlines()
    assert lines[1] == "chosen:  fwd_fp16_d64_lse_fa3_sm90a_m192n128_pad"
    assert lines[2].endswith(
        "it goes ahead of the runner-up fwd_fp16_d64_lse_fa2_sm90a_m128n64_pad_hpad by rule 3 of "
        "the dispatch order, newer pipeline first: pipeline fa3 against pipeline fa2")
    assert lines[3] == "serving, in dispatch order:"  # fa3 ran: no note


def test_explain_says_which_rule_keeps_fa3_from_a_trait(run_cli):
    result = run_cli("--explain", "dtype=fp16,hdim=64,bias=alibi,lse=true,arch=sm90a",
                     "--preset", "flash_attn")
    lines = result.stdout.splitlines()
    assert lines[1] == "chosen:  fwd_fp16_d64_alibi_lse_fa2_sm90a_m128n64"
    assert "by rule 4 of the dispatch order, unpadded seqlens first: pad_seqlen=false against " \
           "pad_seqlen=true" in lines[2]
    assert lines[3] == ("note:    fa3 (sm90a) has no instance for bias=alibi: the fa3 pipeline "
                        "has no bias yet; bias calls on H100/H200 run fa2; falling back to fa2")
    assert lines[4] == "serving, in dispatch order:"


def test_explain_quotes_every_rule_that_keeps_fa3_away(run_cli):
    result = run_cli("--explain", "dtype=bf16,hdim=96,vlayout=col,softcap=true,arch=90",
                     "--preset", "all")
    notes = [line for line in result.stdout.splitlines() if line.startswith("note:")]
    # fa3 reads V^T of e4m3 inputs only: the rule names the 16-bit dtypes too.
    assert [note.partition(" has no instance for ")[2].split(":")[0] for note in notes] == [
        "hdim=96x96", "dtype=bf16, vlayout=col", "softcap=true"]
    assert all(note.endswith("; falling back to fa2") for note in notes)
    # On an A100 fa3 does not exist: nothing to say.
    result = run_cli("--explain", "dtype=bf16,hdim=96,vlayout=col,softcap=true,arch=80",
                     "--preset", "all")
    assert "note:" not in result.stdout


def test_explain_only_one_serving(run_cli):
    result = run_cli("--explain", "dtype=fp16,hdim=64,arch=80", "--preset", "minimal",
                     "--filter", "nopad")
    assert result.stdout.splitlines()[1:] == [
        "chosen:  fwd_fp16_d64_fa2_sm80_m128n64",
        "why:     the only one of the 1 selected fwd instances that serves it"]


def test_explain_miss_lists_the_nearest_and_a_filter_that_fits(run_cli):
    result = run_cli("--explain", "dtype=bf16,hdim=128,bias=alibi,vlayout=col,arch=80",
                     "--preset", "extended")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == "none of the 321 selected fwd instances serves it; the nearest:"
    assert lines[2] == ("  fwd_bf16_d128_lse_fa2_sm80_m128n64: bias=none (the call: alibi); "
                        "vlayout=row (the call: col)")
    assert lines[5] == "the matrix has one that fits: fwd_bf16_d128_alibi_col_fa2_sm80_m128n64"
    assert lines[6] == ("build it with: python -m generator --preset all --filter 'bf16,hdim128,"
                        "mask=none,bias=alibi,vlayout=col,mode=batch,dropout=false,softcap=false,"
                        "sm80'")
    # The suggested filter builds it, and what it builds fits.
    suggested = lines[6].split("--filter ")[1].strip("'")
    explained = run_cli("--explain", "dtype=bf16,hdim=128,bias=alibi,vlayout=col,arch=80",
                        "--preset", "all", "--filter", suggested)
    assert explained.stdout.splitlines()[1].startswith("chosen:  fwd_bf16_d128_alibi_col_")


def test_explain_miss_keeps_this_runs_preset_and_adds_the_target(run_cli):
    result = run_cli("--explain", "dtype=fp16,hdim=64,arch=80", "--preset", "extended",
                     "--targets", "90a")
    assert result.stdout.splitlines()[-1] == (
        "build it with: python -m generator --preset extended --filter 'fp16,hdim64,mask=none,"
        "bias=none,vlayout=row,mode=batch,dropout=false,softcap=false,nopad' --targets "
        "sm90a,sm80")


def test_explain_miss_outside_the_matrix(run_cli):
    result = run_cli("--explain", "dtype=fp16,hdim=512,arch=90", "--preset", "extended")
    lines = result.stdout.splitlines()
    assert "no fwd instance of the whole matrix serves it either; the nearest there:" in lines
    assert lines[-1] == "extend the matrix (instances.yaml) to build one"
    assert all(line.endswith("(the call: 512x512)") for line in lines[2:-1] if line[:2] == "  ")


@pytest.mark.parametrize("problem, message", [
    ("hdim=64", "needs dtype= (fp16, bf16, e4m3)"),
    ("dtype=fp16", "needs hdim=N or QxV (or hdim_q= and hdim_v=)"),
    ("dtype=fp32,hdim=64", "unknown dtype 'fp32'; valid: fp16, bf16"),
    ("dtype=fp16,hdim=64,mask=casual", "unknown mask 'casual'; valid: none, causal, window"),
    ("dtype=fp16,hdim=64,lse=yes", "lse takes true or false, not 'yes'"),
    ("dtype=fp16,hdim=6x", "hdim takes N or QxV (positive), e.g. 128 or 192x128, not '6x'"),
    ("dtype=fp16,hdim=64,hdim_q=64", "give hdim= or hdim_q=/hdim_v=, not both"),
    ("dtype=fp16,hdim=64,seqlen_q=0", "seqlen_q takes a positive integer, not '0'"),
    ("dtype=fp16,hdim=64,arch=hopper", "arch 'hopper' is neither a target (sm80, sm90a) nor a "
                                       "compute capability (e.g. 90 or 8.6)"),
    ("dtype=fp16,hdim=64,head=2", "unknown key 'head'; valid: dtype, kv_dtype, hdim, hdim_q"),
    ("dtype=fp16,fp16", "expected key=value, got 'fp16'"),
    ("dtype=fp16,dtype=bf16,hdim=64", "dtype is given twice"),
])
def test_explain_problem_errors(run_cli, problem, message):
    result = run_cli("--explain", problem)
    assert result.returncode == 2
    assert result.stderr.startswith(f"--explain: {message}")


# -- the bwd operation -------------------------------------------------------------------------

def test_filter_names_an_operation(run_cli):
    def listed(*filter_tokens):
        return run_cli("--list", "--preset", "extended", *filter_tokens).stdout.split()
    bwd = listed("--filter", "bwd")
    assert len(bwd) == 276 and all(name.startswith("bwd_") for name in bwd)
    assert listed("--filter", "op=bwd") == bwd
    fwd = listed("--filter", "fwd")
    assert len(fwd) == 321 and all(name.startswith("fwd_") for name in fwd)
    kvcache = listed("--filter", "kvcache")
    assert len(kvcache) == 444 and all(name.startswith("kvcache_") for name in kvcache)
    assert listed() == fwd + bwd + kvcache
    # An axis of the other operation selects nothing of it: lse and vlayout are fwd's.
    result = run_cli("--list", "--preset", "extended", "--filter", "bwd,lse")
    assert result.returncode == 2
    assert result.stderr.startswith("--filter: 'lse' matches none of the 276 instances left by")
    # Its negation holds for them: extended's fwd instances all have lse.
    assert listed("--filter", "!lse,hdim64,causal,mode=batch,nopad,sm80") == [
        "bwd_bf16_d64_causal_fa2_sm80_m128n128", "bwd_fp16_d64_causal_fa2_sm80_m128n128"]


def test_unknown_token_lists_the_operations(run_cli):
    result = run_cli("--list", "--filter", "bwd,bwdd")
    lines = result.stderr.splitlines()
    assert lines[0] == "--filter: unknown token 'bwdd'"
    assert any(line.split() == ["op", "fwd,", "bwd,", "kvcache"] for line in lines)
    assert any(line.split() == ["dbias", "dbias,", "dbias=true|false"] for line in lines)
    assert any(line.split() == ["paged", "paged,", "paged=true|false"] for line in lines)
    # A bare e4m3 is the dtype's; the cache's is spelled as in names.
    assert any(line.split() == ["dtype", "fp16,", "bf16,", "e4m3"] for line in lines)
    assert any(line.split() == ["kv_dtype", "same,", "kve4m3"] for line in lines)
    assert lines[-1] == ("an operation's own axes (kv_dtype, paged: kvcache's; vlayout, lse: "
                         "fwd's; mode, dropout: fwd's and bwd's; dbias: bwd's) hold for no "
                         "instance of another operation")


def test_json_of_bwd_instances(run_cli):
    records = json.loads(run_cli("--json", "--preset", "all", "--filter",
                                 "bwd,bf16,hdim192x128,window,alibi,group,dropout").stdout)
    assert [r["name"] for r in records] == [
        "bwd_bf16_d192x128_window_alibi_group_dropout_fa2_sm90a_m64n64_pad_hpad",
        "bwd_bf16_d192x128_window_alibi_group_dropout_softcap_fa2_sm90a_m64n64_pad_hpad",
        "bwd_bf16_d192x128_window_alibi_group_dropout_fa2_sm80_m64n64_pad_hpad",
        "bwd_bf16_d192x128_window_alibi_group_dropout_softcap_fa2_sm80_m64n64_pad_hpad"]
    assert all(tuple(r) == BWD_SUMMARY_FIELDS and r["op"] == "bwd" for r in records)


def test_shards_split_both_operations(run_cli):
    parts = [run_cli("--list", "--preset", "minimal", "--shard", f"{index}/2").stdout.split()
             for index in (1, 2)]
    # Each shard gets its share of the backward's TUs, which cost more to compile.
    assert [sum(name.startswith("bwd_") for name in part) for part in parts] == [2, 2]


def test_explain_bwd_hit(run_cli):
    result = run_cli("--explain", "op=bwd,dtype=bf16,hdim=128,mask=causal,arch=90",
                     "--preset", "extended", "--filter", "hdim128")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "problem: op=bwd,dtype=bf16,hdim=128x128,mask=causal,bias=none,mode=batch,dbias=false,"
        "dropout=false,softcap=false,seqlen_q=1024,seqlen_k=1024,seqused=false,arch=90",
        "chosen:  bwd_bf16_d128_causal_fa3_sm90a_m64n128_pad",
        "why:     4 of the 42 selected bwd instances serve it; it goes ahead of the runner-up "
        "bwd_bf16_d128_causal_fa2_sm90a_m64n128_pad_hpad by rule 3 of the dispatch order, "
        "newer pipeline first: pipeline fa3 against pipeline fa2",
        "serving, in dispatch order:",
        "  bwd_bf16_d128_causal_fa3_sm90a_m64n128_pad",
        "  bwd_bf16_d128_causal_fa2_sm90a_m64n128_pad_hpad",
        "  bwd_bf16_d128_causal_fa2_sm80_m64n128",
        "  bwd_bf16_d128_causal_fa2_sm80_m64n128_pad_hpad"]
    # The same problem with a ragged seqlen_q: fa3, which pads, against fa2's padded instance
    # for sm90a.
    ragged = run_cli("--explain", "op=bwd,dtype=bf16,hdim=128,mask=causal,seqlen_q=1000,arch=90",
                     "--preset", "extended", "--filter", "bwd,hdim128")
    assert ragged.stdout.splitlines()[1:3] == [
        "chosen:  bwd_bf16_d128_causal_fa3_sm90a_m64n128_pad",
        "why:     3 of the 42 selected bwd instances serve it; it goes ahead of the runner-up "
        "bwd_bf16_d128_causal_fa2_sm90a_m64n128_pad_hpad by rule 3 of the dispatch order, newer "
        "pipeline first: pipeline fa3 against pipeline fa2"]


def test_explain_bwd_miss_suggests_a_filter_that_fits(run_cli):
    problem = "op=bwd,dtype=fp16,hdim=64,bias=elementwise,dbias=true,seqlen_q=1000,arch=80"
    lines = run_cli("--explain", problem, "--preset", "extended").stdout.splitlines()
    assert lines[1] == "none of the 276 selected bwd instances serves it; the nearest:"
    assert lines[2] == ("  bwd_fp16_d64_fa2_sm80_m128n128_pad_hpad: bias=none (the call: "
                        "elementwise); dbias=false (the call: true)")
    assert lines[5] == ("the matrix has one that fits: "
                        "bwd_fp16_d64_elementwise_dbias_fa2_sm80_m128n128_pad_hpad")
    # The preset that builds the fewest instances of those with one that fits.
    assert lines[6] == ("build it with: python -m generator --preset pytorch --filter 'fp16,"
                        "hdim64,mask=none,bias=elementwise,mode=batch,dbias=true,dropout=false,"
                        "softcap=false,sm80,hpad'")
    suggested = lines[6].split("--filter ")[1].strip("'")
    explained = run_cli("--explain", problem, "--preset", "pytorch", "--filter", suggested)
    assert explained.stdout.splitlines()[1] == (
        "chosen:  bwd_fp16_d64_elementwise_dbias_fa2_sm80_m128n128_pad_hpad")
    # A forward problem never gets a backward instance, nor the other way round.
    fwd = run_cli("--explain", "dtype=fp16,hdim=64,arch=80", "--filter", "bwd")
    assert fwd.stdout.splitlines()[1] == ("none of the 0 selected fwd instances serves it; the "
                                          "nearest:")


@pytest.mark.parametrize("problem, message", [
    ("op=bwd,dtype=fp16,hdim=64,vlayout=row",
     "vlayout is a key of op=fwd, not of op=bwd; valid: dtype, hdim, hdim_q, hdim_v, mask, bias, "
     "mode, dbias, dropout, softcap, seqlen_q, seqlen_k, seqused, arch, op"),
    ("op=bwd,dtype=fp16,hdim=64,lse=true", "lse is a key of op=fwd, not of op=bwd"),
    ("dtype=fp16,hdim=64,dbias=true", "dbias is a key of op=bwd, not of op=fwd"),
    ("op=decode,dtype=fp16,hdim=64", "unknown op 'decode'; valid: fwd, bwd, kvcache"),
    ("op=bwd,dtype=fp16,hdim=64,dbias=1", "dbias takes true or false, not '1'"),
    ("op=bwd,hdim=64", "needs dtype= (fp16, bf16, e4m3)"),
])
def test_explain_bwd_problem_errors(run_cli, problem, message):
    result = run_cli("--explain", problem)
    assert result.returncode == 2
    assert result.stderr.startswith(f"--explain: {message}")


# -- the kvcache operation ---------------------------------------------------------------------

def test_list_and_json_of_kvcache_instances(run_cli):
    result = run_cli("--list", "--preset", "extended", "--filter", "kvcache,bf16,hdim128,causal",
                     "--targets", "sm90a")
    # An e4m3 cache's instances come with their dtype's, at exact head dims only: chunked
    # prefill on the 16-bit cache's tile, and decode, whose 128-key tile puts them first among
    # the decode instances (larger tile first: the two caches' instances never serve the same
    # call).
    assert result.stdout.split() == ["kvcache_bf16_d128_causal_fa3_sm90a_m128n128_pad",
                                     "kvcache_bf16_d128_causal_paged_fa3_sm90a_m128n128_pad",
                                     "kvcache_bf16_kve4m3_d128_causal_fa3_sm90a_m128n128_pad",
                                     "kvcache_bf16_kve4m3_d128_causal_paged_fa3_sm90a_m128n128_pad",
                                     "kvcache_bf16_kve4m3_d128_causal_fa2_sm90a_m16n128_pad",
                                     "kvcache_bf16_kve4m3_d128_causal_paged_fa2_sm90a_m16n128_pad",
                                     "kvcache_bf16_d128_causal_fa2_sm90a_m16n64_pad",
                                     "kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad",
                                     "kvcache_bf16_d128_causal_fa2_sm90a_m16n64_pad_hpad",
                                     "kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad_hpad"]
    e4m3 = run_cli("--list", "--preset", "extended", "--filter",
                   "kvcache,bf16,hdim128,causal,kve4m3", "--targets", "sm90a").stdout.split()
    assert e4m3 == [name for name in result.stdout.split() if "_kve4m3_" in name]
    assert run_cli("--list", "--preset", "extended", "--filter",
                   "kvcache,bf16,hdim128,causal,kv_dtype=e4m3", "--targets", "sm90a"
                   ).stdout.split() == e4m3
    records = json.loads(run_cli("--json", "--preset", "all", "--filter",
                                 "kvcache,fp16,kv_dtype=same,hdim256,window,alibi,paged,softcap"
                                 ).stdout)
    assert [r["name"] for r in records] == [
        "kvcache_fp16_d256_window_alibi_paged_softcap_fa2_sm90a_m16n64_pad",
        "kvcache_fp16_d256_window_alibi_paged_softcap_fa2_sm90a_m16n64_pad_hpad",
        "kvcache_fp16_d256_window_alibi_paged_softcap_fa2_sm80_m16n64_pad",
        "kvcache_fp16_d256_window_alibi_paged_softcap_fa2_sm80_m16n64_pad_hpad"]
    assert all(tuple(r) == KVCACHE_SUMMARY_FIELDS and r["op"] == "kvcache" for r in records)
    assert {r["kv_dtype"] for r in records} == {"same"}
    records = json.loads(run_cli("--json", "--preset", "all", "--filter",
                                 "kvcache,fp16,hdim256,window,alibi,paged,softcap,kve4m3").stdout)
    assert [(r["name"], r["kv_dtype"]) for r in records] == [
        ("kvcache_fp16_kve4m3_d256_window_alibi_paged_softcap_fa2_sm90a_m16n64_pad", "e4m3"),
        ("kvcache_fp16_kve4m3_d256_window_alibi_paged_softcap_fa2_sm80_m16n64_pad", "e4m3")]


# The decode instances of the extended preset that serve a bf16 d128 causal paged call on an
# H100, in dispatch order: newest arch first, then exact head dims, then the tightest padded.
BF16_D128_CAUSAL_PAGED_DECODE = [
    "kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad",
    "kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad_hpad",
    "kvcache_bf16_d192_causal_paged_fa2_sm90a_m16n64_pad_hpad",
    "kvcache_bf16_d256_causal_paged_fa2_sm90a_m16n64_pad_hpad",
    "kvcache_bf16_d128_causal_paged_fa2_sm80_m16n64_pad",
    "kvcache_bf16_d128_causal_paged_fa2_sm80_m16n64_pad_hpad",
    "kvcache_bf16_d192_causal_paged_fa2_sm80_m16n64_pad_hpad",
    "kvcache_bf16_d256_causal_paged_fa2_sm80_m16n64_pad_hpad"]


def test_explain_kvcache_hit(run_cli):
    result = run_cli("--explain", "op=kvcache,dtype=bf16,hdim=128,mask=causal,paged=true,"
                                  "seqlen_q=1,seqlen_k=4000,arch=90", "--preset", "extended")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "problem: op=kvcache,dtype=bf16,kv_dtype=same,hdim=128x128,mask=causal,bias=none,"
        "paged=true,softcap=false,seqlen_q=1,seqlen_k=4000,seqused=false,arch=90",
        "chosen:  kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad",
        "why:     8 of the 444 selected kvcache instances serve it; it goes ahead of the runner-up "
        "kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad_hpad by rule 5 of the dispatch "
        "order, exact head dims first: pad_hdim=false against pad_hdim=true",
        "serving, in dispatch order:",
        *(f"  {name}" for name in BF16_D128_CAUSAL_PAGED_DECODE)]


def test_explain_kvcache_chunk_runs_the_prefill_instance(run_cli):
    # A chunk of a tile of query tokens (and more) on sm90a: the fa3 prefill instance, ahead of
    # the decode ones, which serve it too; a decode step (seqlen_q=1, above) it does not serve.
    result = run_cli("--explain", "op=kvcache,dtype=bf16,hdim=128,mask=causal,paged=true,"
                                  "seqlen_q=512,seqlen_k=4000,arch=90", "--preset", "extended")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        "chosen:  kvcache_bf16_d128_causal_paged_fa3_sm90a_m128n128_pad",
        "why:     9 of the 444 selected kvcache instances serve it; it goes ahead of the runner-up "
        "kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad by rule 3 of the dispatch order, "
        "newer pipeline first: pipeline fa3 against pipeline fa2",
        "serving, in dispatch order:",
        "  kvcache_bf16_d128_causal_paged_fa3_sm90a_m128n128_pad",
        "  kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad",
        "  kvcache_bf16_d128_causal_paged_fa2_sm90a_m16n64_pad_hpad",
        "  kvcache_bf16_d192_causal_paged_fa2_sm90a_m16n64_pad_hpad",
        "  kvcache_bf16_d256_causal_paged_fa2_sm90a_m16n64_pad_hpad",
        "  kvcache_bf16_d128_causal_paged_fa2_sm80_m16n64_pad",
        "  kvcache_bf16_d128_causal_paged_fa2_sm80_m16n64_pad_hpad",
        "  kvcache_bf16_d192_causal_paged_fa2_sm80_m16n64_pad_hpad",
        "  kvcache_bf16_d256_causal_paged_fa2_sm80_m16n64_pad_hpad"]


def test_explain_an_e4m3_chunk_runs_the_prefill_instance_but_at_d256(run_cli):
    # A chunk from an e4m3 cache at d128: the fa3 prefill instance (the cache widened to fp16 in
    # shared memory), ahead of the decode ones; a decode step takes those.
    def explain(hdim: int, seqlen_q: int) -> list[str]:
        result = run_cli("--explain", f"op=kvcache,dtype=bf16,kv_dtype=e4m3,hdim={hdim},"
                                      f"mask=causal,paged=true,seqlen_q={seqlen_q},seqlen_k=4000,"
                                      "arch=90", "--preset", "extended")
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()[1:]

    assert explain(128, 512) == [
        "chosen:  kvcache_bf16_kve4m3_d128_causal_paged_fa3_sm90a_m128n128_pad",
        "why:     3 of the 444 selected kvcache instances serve it; it goes ahead of the runner-up "
        "kvcache_bf16_kve4m3_d128_causal_paged_fa2_sm90a_m16n128_pad by rule 3 of the dispatch "
        "order, newer pipeline first: pipeline fa3 against pipeline fa2",
        "serving, in dispatch order:",
        "  kvcache_bf16_kve4m3_d128_causal_paged_fa3_sm90a_m128n128_pad",
        "  kvcache_bf16_kve4m3_d128_causal_paged_fa2_sm90a_m16n128_pad",
        "  kvcache_bf16_kve4m3_d128_causal_paged_fa2_sm80_m16n64_pad"]
    assert explain(128, 1)[0] == (
        "chosen:  kvcache_bf16_kve4m3_d128_causal_paged_fa2_sm90a_m16n128_pad")
    # d256: its staging stages do not fit beside the tile; the rule's reason, as a note.
    assert explain(256, 512)[:4] == [
        "chosen:  kvcache_bf16_kve4m3_d256_causal_paged_fa2_sm90a_m16n64_pad",
        "why:     2 of the 444 selected kvcache instances serve it; it goes ahead of the runner-up "
        "kvcache_bf16_kve4m3_d256_causal_paged_fa2_sm80_m16n64_pad by rule 1 of the dispatch "
        "order, higher compute capability first: sm90a (cc 90) against sm80 (cc 80)",
        "note:    fa3 (sm90a) has no instance for kv_dtype=e4m3, hdim=256x256: chunked prefill "
        "from an e4m3 cache holds each K and V stage twice, in e4m3 as TMA lands it and in fp16 "
        "as the consumers read it (3 bytes an element): the d256 tile (128x80, 2 stages) would "
        "take 64 KB of Q + 240 KB of stages + 1 KB, past H100's 227 KB (a 2-stage tile of 48 "
        "keys a step would fit, 209 KB, but is not built). d256 e4m3 calls run the decode kernel "
        "at every chunk size; falling back to fa2",
        "serving, in dispatch order:"]
    # Exact head dims only, of 64, 128, 192 and 256: no padded instance runs 120 from an e4m3
    # cache, and none has 96.
    for hdim in (120, 96):
        result = run_cli("--explain", f"op=kvcache,dtype=bf16,kv_dtype=e4m3,hdim={hdim},arch=90",
                         "--preset", "all")
        assert "no kvcache instance of the whole matrix serves it either" in result.stdout
    # The filter of a miss names the cache's dtype.
    result = run_cli("--explain", "op=kvcache,dtype=fp16,kv_dtype=e4m3,hdim=192,bias=alibi,"
                                  "arch=80", "--preset", "extended")
    assert result.stdout.splitlines()[-1] == (
        "build it with: python -m generator --preset all --filter 'fp16,hdim192,kv_dtype=e4m3,"
        "mask=none,bias=alibi,paged=false,softcap=false,sm80'")


def test_explain_kvcache_miss_suggests_a_filter_that_fits(run_cli):
    problem = "op=kvcache,dtype=fp16,hdim=96,bias=alibi,softcap=true,arch=80"
    lines = run_cli("--explain", problem, "--preset", "extended").stdout.splitlines()
    assert lines[1] == "none of the 444 selected kvcache instances serves it; the nearest:"
    # The preset that builds least and has an instance serving it: coverage's head-dim-padded
    # d128 (every trait at d128), where flash_attn has the exact d96 one.
    assert lines[5] == ("the matrix has one that fits: "
                        "kvcache_fp16_d128_alibi_softcap_fa2_sm80_m16n64_pad_hpad")
    assert lines[6] == ("build it with: python -m generator --preset coverage --filter 'fp16,"
                        "hdim128,kv_dtype=same,mask=none,bias=alibi,paged=false,softcap=true,sm80,"
                        "hpad'")
    suggested = lines[6].split("--filter ")[1].strip("'")
    explained = run_cli("--explain", problem, "--preset", "coverage", "--filter", suggested)
    assert explained.stdout.splitlines()[1] == (
        "chosen:  kvcache_fp16_d128_alibi_softcap_fa2_sm80_m16n64_pad_hpad")
    # What the rules prune is outside the matrix: an elementwise bias.
    result = run_cli("--explain", "op=kvcache,dtype=fp16,hdim=64,bias=elementwise,arch=80")
    assert "no kvcache instance of the whole matrix serves it either" in result.stdout
    # (192, 128) runs on d192's head-dim-padded instance.
    result = run_cli("--explain", "op=kvcache,dtype=fp16,hdim=192x128,arch=80", "--preset", "all")
    assert result.stdout.splitlines()[1] == "chosen:  kvcache_fp16_d192_fa2_sm80_m16n64_pad_hpad"


@pytest.mark.parametrize("problem, message", [
    ("op=kvcache,dtype=fp16,hdim=64,mode=batch",
     "mode is a key of op=fwd and op=bwd, not of op=kvcache; valid: dtype, kv_dtype, hdim, "
     "hdim_q, hdim_v, mask, bias, paged, softcap, seqlen_q, seqlen_k, seqused, arch, op"),
    ("dtype=fp16,hdim=64,kv_dtype=e4m3", "kv_dtype is a key of op=kvcache, not of op=fwd"),
    ("op=kvcache,dtype=fp16,hdim=64,kv_dtype=fp8", "unknown kv_dtype 'fp8'; valid: same, e4m3"),
    ("op=kvcache,dtype=fp16,hdim=64,dropout=true", "dropout is a key of op=fwd and op=bwd"),
    ("dtype=fp16,hdim=64,paged=true", "paged is a key of op=kvcache, not of op=fwd"),
    ("op=kvcache,dtype=fp16,hdim=64,paged=yes", "paged takes true or false, not 'yes'"),
])
def test_explain_kvcache_problem_errors(run_cli, problem, message):
    result = run_cli("--explain", problem)
    assert result.returncode == 2
    assert result.stderr.startswith(f"--explain: {message}")
