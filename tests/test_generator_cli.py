"""`python -m generator` end to end, as CMake and users run it (a subprocess, repo root as cwd)."""

from __future__ import annotations

import json
import time

SUMMARY_FIELDS = ("name", "dtype", "hdim_q", "hdim_v", "mask", "bias", "vlayout", "mode",
                  "pipeline", "arch", "pad_seqlen", "block_m", "block_n", "warps", "stages", "tu")


def test_default_render(run_cli, tmp_path):
    out = tmp_path / "gen"
    start = time.perf_counter()
    result = run_cli("--out", out)
    assert time.perf_counter() - start < 5
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"generator: 32 of 32 instances selected (0 pruned), 35 files "
                             f"written, 0 unchanged, 0 removed -> {out.as_posix()}\n")
    assert len(list(out.glob("*.cu"))) == 32
    assert {"dispatch_table.cpp", "instances.cmake", "manifest.json"} <= {p.name for p in out.iterdir()}


def test_second_run_writes_nothing(run_cli, tmp_path):
    out = tmp_path / "gen"
    run_cli("--out", out)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    result = run_cli("--out", out)
    assert "0 files written, 35 unchanged, 0 removed" in result.stdout
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_narrowing_removes_stale_tus(run_cli, tmp_path):
    out = tmp_path / "gen"
    run_cli("--out", out)
    result = run_cli("--out", out, "--preset", "minimal", "--targets", "90a")
    assert result.returncode == 0, result.stderr
    assert "2 of 32 instances selected" in result.stdout and "30 removed" in result.stdout
    assert sorted(p.name for p in out.glob("*.cu")) == [
        "fwd_fp16_d64_fa2_sm90a_m128n64.cu", "fwd_fp16_d64_fa2_sm90a_m128n64_pad.cu"]


def test_list(run_cli):
    result = run_cli("--list", "--filter", "bf16,hdim128,causal", "--targets", "sm90a")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["fwd_bf16_d128_causal_fa2_sm90a_m128n64",
                                     "fwd_bf16_d128_causal_fa2_sm90a_m128n64_pad"]


def test_json(run_cli):
    result = run_cli("--json", "--preset", "minimal")
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert len(records) == 4
    for record in records:
        assert tuple(record) == SUMMARY_FIELDS
        assert record["tu"] == f"{record['name']}.cu"
        assert (record["dtype"], record["hdim_q"], record["mask"]) == ("fp16", 64, "none")


def test_json_and_summary_leave_out_pruned_instances(run_cli, make_config, tmp_path):
    path = make_config(("rules: []", "rules:\n  - when: {dtype: bf16, mask: causal}\n    reason: x"))
    records = json.loads(run_cli("--config", path, "--json").stdout)
    assert len(records) == 24
    assert not any(r["dtype"] == "bf16" and r["mask"] == "causal" for r in records)
    result = run_cli("--config", path, "--out", tmp_path / "gen")
    assert result.stdout.startswith("generator: 24 of 24 instances selected (8 pruned), 27 files")


def test_quiet(run_cli, tmp_path):
    result = run_cli("-q", "--out", tmp_path / "gen")
    assert result.returncode == 0 and result.stdout == ""


def test_user_errors_exit_2_without_traceback_or_output(run_cli, tmp_path):
    out = tmp_path / "gen"
    for args in (["--filter", "fp61"], ["--filter", "none"], ["--filter", "hdim256"],
                 ["--preset", "nightly"], ["--targets", "sm75"], ["--list", "--json"]):
        result = run_cli("--out", out, *args)
        assert result.returncode == 2, args
        assert "Traceback" not in result.stderr and result.stdout == "", args
        assert not out.exists(), args


def test_unknown_filter_token_lists_valid_tokens(run_cli):
    result = run_cli("--list", "--filter", "fp16,casual")
    lines = result.stderr.splitlines()
    assert lines[0] == "--filter: unknown token 'casual'"
    assert any(line.split()[:1] == ["mask"] and "causal" in line for line in lines[1:])


def test_help_documents_the_filter_grammar(run_cli):
    result = run_cli("--help")
    assert result.returncode == 0
    for text in ("--filter", "--preset", "--targets", "--list", "--json", "--out", "--config",
                 "axis=value", "hdim128", "mask=none", "glob"):
        assert text in result.stdout
