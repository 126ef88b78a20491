"""python -m bench.plot: a bench run's JSON drawn as FlashAttention's README draws its numbers.

    python -m bench.plot RESULTS.json --out PLOT.png [--table bwd_rows] [--dtype bf16]
                         [--date YYYY-MM-DD] [--command "python -m bench ..."]

One panel per configuration (dtype, head dim, causal; for decode the heads and batch), TFLOP/s
(GB/s for decode) against the sequence length (the cached keys for decode, the chunk for
chunked prefill), a line for fmha and for each peer the run measured. The title names the
GPU, the date and the command: runs since bench recorded them carry the last two in their
JSON; for older ones give --date and --command. `python -m bench ... --plot PLOT.png` draws
the same from the run it has just made. Needs only the JSON and matplotlib (`pip install
.[plot]`), no GPU, no torch.
"""

import argparse
import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Table:
    """How to draw one kind of bench row: the x axis, the fields that make a panel (the first
    one varies across a figure's columns), the columns to draw with their legend labels, and
    the unit and what the rows measure."""
    x: str
    x_label: str
    panel_keys: tuple
    series: dict
    unit: str
    what: str


GRID_SERIES = {"fmha": "fmha", "fmha_det": "fmha, deterministic",
               "sdpa_flash": "FlashAttention-2 (SDPA flash)", "cudnn": "cuDNN (SDPA)",
               "sdpa_efficient": "SDPA memory-efficient"}
GRID_PANEL = ("hdim", "dtype", "causal")

TABLES = {
    "rows": Table("seqlen", "sequence length", GRID_PANEL, GRID_SERIES, "TFLOP/s", "forward"),
    "bwd_rows": Table("seqlen", "sequence length", GRID_PANEL, GRID_SERIES, "TFLOP/s",
                      "backward"),
    "fwd_bwd_rows": Table("seqlen", "sequence length", GRID_PANEL, GRID_SERIES, "TFLOP/s",
                          "forward + backward"),
    "e4m3_rows": Table(
        "seqlen", "sequence length", GRID_PANEL,
        {"fmha_vcol": "fmha e4m3, V^T given", "fmha": "fmha e4m3, v row-major (with its copy)",
         "fmha_bf16": "fmha bf16", "scaled_mm": "torch._scaled_mm e4m3 8192^3",
         "sdpa_flash": "FlashAttention-2 bf16 (SDPA flash)", "cudnn": "cuDNN bf16 (SDPA)"},
        "TFLOP/s", "e4m3 forward"),
    "decode_rows": Table(
        "cache_len", "cached keys per sequence", ("batch", "dtype", "hdim", "heads"),
        {"fmha": "fmha, contiguous cache", "fmha_paged16": "fmha, pages of 16",
         "fmha_paged64": "fmha, pages of 64", "fmha_paged256": "fmha, pages of 256",
         "sdpa_flash": "FlashAttention-2 (SDPA flash)", "sdpa_cudnn": "cuDNN (SDPA)"},
        "GB/s", "decode step"),
    "prefill_rows": Table(
        "chunk", "query tokens per chunk", ("context", "dtype", "hdim", "heads", "batch"),
        {"fwd": "fmha.fwd, contiguous", "kvcache": "fwd_kvcache, contiguous cache",
         "paged16": "fwd_kvcache, pages of 16", "paged64": "fwd_kvcache, pages of 64",
         "paged256": "fwd_kvcache, pages of 256", "append16": "fwd_kvcache appending, pages of 16",
         "e4m3_kvcache": "fwd_kvcache, e4m3 contiguous cache",
         "e4m3_paged16": "fwd_kvcache, e4m3, pages of 16",
         "e4m3_paged64": "fwd_kvcache, e4m3, pages of 64"},
        "TFLOP/s", "chunked prefill"),
}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "e4m3": "e4m3"}
SHORT_DTYPES = {long: short for short, long in DTYPE_NAMES.items()}


def table_of(results: dict, name: str | None) -> str:
    """The row table to draw: `name`, else the results' first drawable one."""
    drawable = [key for key in TABLES if results.get(key)]
    if name is None and drawable:
        return drawable[0]
    if name in drawable:
        return name
    sys.exit(f"bench.plot: no {name or 'drawable'} rows here; this run has "
             f"{', '.join(drawable) or 'none'} (tables: {', '.join(TABLES)})")


def sort_key(value):
    """Numbers in numeric order, before any text (a head dim of 192x128)."""
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def panel_title(table: Table, key: tuple) -> str:
    fields = dict(zip(table.panel_keys, key))
    dtype = fields.pop("dtype")
    words = [SHORT_DTYPES.get(dtype, dtype)]
    if "hdim" in fields:
        words.append(f"d{fields.pop('hdim')}")
    if "causal" in fields:
        words.append("causal" if fields.pop("causal") else "non-causal")
    words += [f"{name} {value}" for name, value in fields.items()]
    return ", ".join(words)


def panels(rows: list, table: Table) -> dict:
    """{panel key: {column: [(x, value), ...]}}, points in order of x; a column a backend could
    not run (None) leaves its point out."""
    out = {}
    for row in rows:
        key = tuple(row.get(k) for k in table.panel_keys)
        for column in table.series:
            if isinstance(row.get(column), (int, float)):
                out.setdefault(key, {}).setdefault(column, []).append((row[table.x], row[column]))
    for series in out.values():
        for points in series.values():
            points.sort()
    return out


def layout(keys) -> dict:
    """{panel key: (row, column)}: a figure column per value of the key's first field (the head
    dim, the batch), a figure row per combination of the others."""
    columns = sorted({key[0] for key in keys}, key=sort_key)
    rows = sorted({key[1:] for key in keys}, key=lambda rest: [sort_key(v) for v in rest])
    return {key: (rows.index(key[1:]), columns.index(key[0])) for key in keys}


def caption(info: dict, table: Table, date: str | None, command: str | None) -> str:
    """The figure's title: what, GPU, date and command; an unknown date or command is an
    error, since a figure without them cannot be checked or redrawn."""
    date, command = date or info.get("date"), command or info.get("command")
    if not (date and command):
        sys.exit("bench.plot: this JSON records no date or command (bench wrote neither before "
                 "they were added); give --date and --command")
    return f"{table.what}, {table.unit}: {info.get('gpu', 'unknown GPU')}, {date}\n{command}"


def require_matplotlib():
    """matplotlib's pyplot, or an exit that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench: --plot and bench.plot need matplotlib: pip install matplotlib "
                 "(or pip install '.[plot]')")
    matplotlib.use("Agg")  # files only; no display on the GPU machines
    import matplotlib.pyplot as plt
    return plt


def draw(results: dict, out: str, table_name: str | None = None, dtype: str | None = None,
         date: str | None = None, command: str | None = None):
    """Draws a bench run's rows (the dict `python -m bench --json` writes) into `out`."""
    plt = require_matplotlib()
    name = table_of(results, table_name)
    table = TABLES[name]
    title = caption(results["info"], table, date, command)
    rows = [r for r in results[name]
            if dtype is None or r["dtype"] in (dtype, DTYPE_NAMES.get(dtype))]
    by_panel = panels(rows, table)
    if not by_panel:
        sys.exit(f"bench.plot: no {name} with numbers{f' for {dtype}' if dtype else ''}")
    places = layout(by_panel)
    nrows, ncols = (max(place[i] for place in places.values()) + 1 for i in (0, 1))
    height = 3.2 * nrows + 1.2  # inches: the panels, the two-line title and the legend
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, height), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")  # turned back on where a panel lands
    copy_gbs = results["info"].get("copy_gbs") if name == "decode_rows" else None
    for key, series in by_panel.items():
        ax = axes[places[key]]
        ax.axis("on")
        for column, points in series.items():
            ax.plot(*zip(*points), marker="o", label=table.series[column],
                    linewidth=2.5 if column == "fmha" else 1.5)
        if copy_gbs:
            ax.axhline(copy_gbs, color="grey", linestyle="--", label="device-to-device copy")
        xs = sorted({x for points in series.values() for x, _ in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 else str(x) for x in xs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title(panel_title(table, key), fontsize=10)
        ax.set_xlabel(table.x_label)
        ax.set_ylabel(table.unit)
    legend = {}
    for ax in axes.flat:  # every label once, from whichever panel drew it
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.suptitle(title, fontsize=10)
    fig.legend(legend.values(), legend.keys(), loc="lower center", frameon=False,
               ncol=min(len(legend), 4))
    legend_inches = 0.25 * -(-len(legend) // 4) + 0.1
    fig.tight_layout(rect=(0, legend_inches / height, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__.splitlines()[0])
    p.add_argument("results", help="a JSON file written by python -m bench --json")
    p.add_argument("--out", required=True, help="the image to write (PNG, SVG, PDF)")
    p.add_argument("--table", choices=list(TABLES),
                   help="which rows to draw (default: the file's first drawable table)")
    p.add_argument("--dtype", help="draw only this dtype's rows (bf16, fp16, e4m3)")
    p.add_argument("--date", help="the run's date, where its JSON records none")
    p.add_argument("--command", help="the run's command, where its JSON records none")
    args = p.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    draw(results, args.out, args.table, args.dtype, args.date, args.command)


if __name__ == "__main__":
    main()
