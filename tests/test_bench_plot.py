"""bench/plot.py on the CPU: panels from a small bench JSON, and the PNG drawn from it when
matplotlib is installed (it is an optional dependency; CI does not install it)."""

import json

import pytest

from bench import plot


def grid_row(hdim, causal, seqlen, fmha, cudnn, flash=None):
    return {"dtype": "bfloat16", "hdim": hdim, "causal": causal, "batch": 16384 // seqlen,
            "nheads": 2048 // hdim, "seqlen": seqlen, "fmha": fmha, "cudnn": cudnn,
            "sdpa_flash": flash}


RESULTS = {
    "info": {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-27",
             "command": "python -m bench --bwd --dtypes bf16 --hdims 64,128"},
    "bwd_rows": [grid_row(d, causal, s, 300.0 + s / 100, 290.0, 200.0 if s < 4096 else None)
                 for d in (64, 128) for causal in (False, True) for s in (4096, 1024, 2048)],
    "fwd_bwd_rows": [grid_row(128, False, 1024, 350.0, 330.0)],
}


def test_panels_group_by_configuration_and_sort_by_seqlen():
    by_panel = plot.panels(RESULTS["bwd_rows"], plot.TABLES["bwd_rows"])
    assert len(by_panel) == 4
    series = by_panel[(128, "bfloat16", True)]
    assert [x for x, _ in series["fmha"]] == [1024, 2048, 4096]
    # a backend that could not run a point (None) leaves it out
    assert [x for x, _ in series["sdpa_flash"]] == [1024, 2048]


def test_layout_puts_head_dims_in_columns():
    places = plot.layout(plot.panels(RESULTS["bwd_rows"], plot.TABLES["bwd_rows"]))
    assert places[(64, "bfloat16", False)] == (0, 0)
    assert places[(128, "bfloat16", True)] == (1, 1)


def test_panel_titles_and_caption_name_what_was_measured():
    table = plot.TABLES["bwd_rows"]
    assert plot.panel_title(table, (128, "bfloat16", True)) == "bf16, d128, causal"
    title = plot.caption(RESULTS["info"], table, None, None)
    assert "NVIDIA H100 80GB HBM3" in title and "2026-11-27" in title
    assert "python -m bench --bwd" in title


def test_caption_without_date_or_command_is_an_error():
    with pytest.raises(SystemExit, match="--date and --command"):
        plot.caption({"gpu": "NVIDIA H200"}, plot.TABLES["rows"], None, None)


def test_unknown_table_names_the_drawable_ones():
    with pytest.raises(SystemExit, match="bwd_rows, fwd_bwd_rows"):
        plot.table_of(RESULTS, "decode_rows")


@pytest.mark.parametrize("table", [None, "fwd_bwd_rows"])
def test_draws_a_png_from_a_json_file(tmp_path, table):
    pytest.importorskip("matplotlib")
    results = tmp_path / "bwd.json"
    results.write_text(json.dumps(RESULTS))
    out = tmp_path / "bwd.png"
    plot.main([str(results), "--out", str(out), *(["--table", table] if table else [])])
    assert out.read_bytes().startswith(b"\x89PNG")


def test_date_and_command_given_for_an_older_json(tmp_path):
    pytest.importorskip("matplotlib")
    older = {**RESULTS, "info": {"gpu": "NVIDIA H200"}}
    results = tmp_path / "old.json"
    results.write_text(json.dumps(older))
    out = tmp_path / "old.png"
    plot.main([str(results), "--out", str(out), "--date", "2026-11-21", "--command",
               "python -m bench --bwd"])
    assert out.read_bytes().startswith(b"\x89PNG")


def test_bench_run_records_date_and_command_and_draws(tmp_path):
    pytest.importorskip("matplotlib")
    bench_main = pytest.importorskip("bench.__main__")  # needs torch and fmha
    out, saved = tmp_path / "run.png", tmp_path / "run.json"
    args = bench_main.parse_args(["--bwd", "--json", str(saved), "--plot", str(out)])
    bench_main.save(args, {"info": {"gpu": "NVIDIA H100 80GB HBM3"},
                           "bwd_rows": RESULTS["bwd_rows"]})
    info = json.loads(saved.read_text())["info"]
    assert info["command"] == f"python -m bench --bwd --json {saved} --plot {out}"
    assert len(info["date"]) == len("2026-11-27")
    assert out.read_bytes().startswith(b"\x89PNG")
