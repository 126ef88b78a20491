"""The e4m3 parts of the benchmark on the CPU: bench/fp8.py's table and ratios (python -m bench
--dtypes e4m3), bench/fp8_accuracy.py's arguments, table and one row of reference columns
(--device cpu), its --p-study (P's scale and the key tiles' order), and bench/plot.py's
e4m3_rows."""

import json

import pytest

torch = pytest.importorskip("torch")

from bench import fp8, fp8_accuracy, plot  # noqa: E402


def e4m3_row(hdim, causal, seqlen, vcol, row, bf16, mm=1500.0, **more):
    return {"dtype": "e4m3", "hdim": hdim, "causal": causal, "batch": 16384 // seqlen,
            "nheads": 2048 // hdim, "seqlen": seqlen, "fmha_vcol": vcol, "fmha": row,
            "fmha_bf16": bf16, "scaled_mm": mm, "scaled_mm_exact": 1200.0, "sdpa_flash": 400.0,
            "cudnn": 600.0, **more}


def test_ratios_and_the_issues_bar():
    row = e4m3_row(128, False, 4096, 1050.0, 1200.0, 700.0)
    assert fp8.ratio(row, "row/mm") == pytest.approx(0.8)
    assert fp8.ratio(row, "vcol/bf16") == pytest.approx(1.5)
    assert fp8.bar_cell(row) == "0.75 met"  # the row-major rate, what a model sees
    assert fp8.bar_cell(e4m3_row(128, False, 4096, 1200.0, 1050.0, 700.0)) == "0.75 below"
    assert fp8.bar_cell(e4m3_row(256, True, 4096, 1200.0, 1000.0, 700.0)) == "0.85 below"
    assert fp8.bar_cell(e4m3_row(64, True, 4096, 1200.0, 1000.0, 700.0)) == "-"
    missing = e4m3_row(128, False, 4096, None, None, 700.0)
    assert fp8.ratio(missing, "vcol/mm") is None and fp8.bar_cell(missing) == "-"


def test_table_names_each_case_and_the_errors():
    rows = [e4m3_row(128, False, 1024, 1100.0, 900.0, 650.0),
            e4m3_row(256, True, 8192, None, None, 700.0, fmha_vcol_error="no instance",
                     fmha_error="no instance")]
    text = fp8.format_rows(rows)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["case", "fmha_vcol", "fmha", "fmha_bf16"]
    assert "e4m3 128 False 1024" in lines[1] and "0.73x" in lines[1] and "0.75 below" in lines[1]
    assert "e4m3 256 True 8192" in lines[2] and lines[2].split()[4] == "-"
    assert "  fmha_error: no instance" in text and "  fmha_vcol_error: no instance" in text


def test_v_transposed_is_a_view_with_the_keys_contiguous():
    v = torch.randn(2, 20, 3, 16)
    vt = fp8.v_transposed(v)
    assert vt.shape == v.shape and torch.equal(vt, v)
    assert vt.stride(1) == 1 and vt.stride(3) == 32  # rows of keys 16-element aligned


def test_plot_draws_e4m3_rows():
    rows = [e4m3_row(d, c, s, 900.0 + s / 100, 800.0, 600.0) for d in (128, 256)
            for c in (False, True) for s in (1024, 4096)]
    table = plot.TABLES["e4m3_rows"]
    by_panel = plot.panels(rows, table)
    assert len(by_panel) == 4
    assert set(by_panel[(128, "e4m3", True)]) == {"fmha_vcol", "fmha", "fmha_bf16", "scaled_mm",
                                                  "sdpa_flash", "cudnn"}
    assert plot.panel_title(table, (128, "e4m3", True)) == "e4m3, d128, causal"
    assert plot.table_of({"rows": [], "e4m3_rows": rows}, None) == "e4m3_rows"


def test_bench_takes_e4m3_on_the_forward_grid_only():
    bench_main = pytest.importorskip("bench.__main__")  # needs fmha
    args = bench_main.parse_args(["--dtypes", "bf16,e4m3", "--hdims", "128,256"])
    assert args.dtypes == ["bf16", "e4m3"]
    for other in (["--bwd"], ["--decode"], ["--prefill"], ["--host"]):
        with pytest.raises(SystemExit):
            bench_main.parse_args(["--dtypes", "e4m3", *other])
    with pytest.raises(SystemExit):
        bench_main.parse_args(["--dtypes", "e5m2"])


def test_accuracy_study_arguments():
    args = fp8_accuracy.parse_args([])
    assert (args.hdims, args.seqlens) == ([128, 256], [4096, 1024])
    assert args.kinds == ["normal", "fa3_outliers", "outlier_channels", "sinks"]
    assert fp8_accuracy.parse_args(["--json"]).json == "-"
    assert fp8_accuracy.parse_args(["--json", "out.jsonl"]).json == "out.jsonl"
    with pytest.raises(SystemExit):
        fp8_accuracy.parse_args(["--kinds", "uniform"])


def test_accuracy_study_reference_columns_on_the_cpu(tmp_path, capsys):
    """A small study on the CPU: the reference columns (fmha's are '-'), FlashAttention-3's
    figures beside its input kind, JSON lines with the info first."""
    out = tmp_path / "study.jsonl"
    rows = fp8_accuracy.main(["--device", "cpu", "--hdims", "32", "--seqlens", "200",
                              "--heads", "2", "--kinds", "normal,fa3_outliers",
                              "--json", str(out)])
    assert [r["kind"] for r in rows] == ["normal", "fa3_outliers"]
    for r in rows:
        assert r["e4m3"] is None and r["e4m3_head_orig"] is None
        # The quantizing reference errs about 2^-4 / sqrt(12) of the probabilities, relative.
        assert 1e-4 * r["|O|"] < r["qref"] < 0.1 * r["|O|"]
        assert r["qref_orig"] >= r["qref"] * 0.5  # the inputs' quantization adds to it
    assert rows[1]["fa3"] == "2.4e-2/9.1e-3" and rows[0]["fa3"] is None
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert "info" in lines[0] and lines[0]["info"]["fa3"]["rmse"]["baseline FP16"] == 3.2e-4
    assert [line["kind"] for line in lines[1:]] == ["normal", "fa3_outliers"]
    printed = capsys.readouterr().out
    assert "2.4e-2/9.1e-3" in printed and "baseline FP8" in printed


def test_p_study_arguments_and_variants():
    args = fp8_accuracy.parse_args(["--p-study", "--threads", "1"])
    assert args.p_study and args.threads == 1
    assert not fp8_accuracy.parse_args([]).p_study
    names = [fp8_accuracy.p_variant_name(v) for v in fp8_accuracy.P_VARIANTS]
    assert names == ["1/lf", "1/fl", "16/lf", "16/fl", "256/lf", "256/fl", "448/lf", "448/fl"]
    assert fp8_accuracy.p_variant_name(fp8_accuracy.P_KERNEL) == "256/lf"


@pytest.mark.parametrize("causal", [False, True])
def test_p_study_outputs_are_the_quantizing_reference_with_the_running_max(causal):
    """Each (scale, order) of --p-study is fwd_reference_e4m3(p_max="running", p_scale=,
    order=) on the per-tensor codes, and its truth the reference's."""
    R = fp8_accuracy.R
    gen = torch.Generator().manual_seed(3)
    q, k, v = R.study_inputs("sinks", 1, 300, 2, 2, 32, gen=gen)
    (q8, qd), (k8, kd), (v8, vd) = (R.to_e4m3(x, "tensor") for x in (q, k, v))
    truth, outs = fp8_accuracy.p_study_outputs(q8, k8, v8, (qd, kd, vd), causal, rows=100)
    assert set(outs) == set(fp8_accuracy.P_VARIANTS)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, p_max="running")
    for (scale, order), out in outs.items():
        ref = R.fwd_reference_e4m3(q8, k8, v8, **kw, p_scale=scale, order=order)
        torch.testing.assert_close(out, ref.quantized, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(truth, ref.truth, rtol=1e-12, atol=1e-15)


def test_p_study_table_on_the_cpu(tmp_path, capsys):
    """--p-study's rows: every kind x head dim x mask x length, the RMSE of each (scale,
    order), the winner the smallest and the kernel's over it; the table names them."""
    out = tmp_path / "p.jsonl"
    rows = fp8_accuracy.main(["--p-study", "--device", "cpu", "--hdims", "32", "--seqlens",
                              "160", "--heads", "1", "--kinds", "normal,sinks",
                              "--json", str(out)])
    assert [(r["kind"], r["causal"]) for r in rows] == [
        ("normal", False), ("normal", True), ("sinks", False), ("sinks", True)]
    for r in rows:
        rmse = r["rmse"]
        assert len(rmse) == 8 and all(0 < e < r["|O|"] for e in rmse.values())
        assert rmse[r["winner"]] == min(rmse.values())
        assert r["kernel/winner"] == pytest.approx(rmse["256/lf"] / min(rmse.values()))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["info"]["p_study"] and len(lines) == 1 + len(rows)
    printed = capsys.readouterr().out
    assert "not the kernel" in printed
    header = printed.splitlines()[1].split()
    assert header[:5] == ["kind", "hdim", "S", "mask", "|O|"] and header[-2] == "winner"
    assert len(printed.splitlines()) == 2 + len(rows)
