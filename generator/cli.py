"""python -m generator: load and check the config, build the catalog, select, then list or
render. Everything is checked before anything is written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import config as config_file
from .catalog import build_catalog
from .errors import GeneratorError
from .output import sync
from .render import instance_record, json_text, manifest_sources, render
from .selection import GRAMMAR, parse_targets, select

DEFAULT_OUT = Path("build/gen")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m generator",
        description="Expand the kernel-instance matrix of instances.yaml, prune it, select from\n"
                    "it, and render one CUDA TU per instance plus dispatch_table.cpp,\n"
                    "instances.cmake and manifest.json. Files whose bytes would not change are\n"
                    "not rewritten, and TUs of instances no longer selected are removed.",
        epilog=f"{GRAMMAR}\n\nExit status: 0 done, 1 the output could not be written, 2 a mistake "
               f"in the\nconfig or the options (nothing is written then).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=config_file.DEFAULT_CONFIG, metavar="PATH",
                        help="the instance matrix (default: instances.yaml at the repository root)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help="where to render (default: %(default)s, relative to the working "
                             "directory)")
    parser.add_argument("--preset", default=config_file.DEFAULT_PRESET, metavar="NAME",
                        help="a named filter from the config's presets (default: %(default)s)")
    parser.add_argument("--filter", default="", metavar="TOKENS",
                        help="tokens that must all hold, besides the preset's, e.g. "
                             "'fp16,hdim128,!causal' (grammar below)")
    parser.add_argument("--targets", metavar="ARCHS",
                        help="keep only instances for these archs: sm80,sm90a or CMake-style "
                             "'80;90a' (default: every arch of the matrix)")
    listing = parser.add_mutually_exclusive_group()
    listing.add_argument("--list", action="store_true",
                         help="print the selected instance names in dispatch order; write nothing")
    listing.add_argument("--json", action="store_true",
                         help="print the selected instances as a JSON array in dispatch order "
                              "(`tu` is relative to --out); write nothing")
    parser.add_argument("-q", "--quiet", action="store_true", help="omit the summary line")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except GeneratorError as err:
        print(err, file=sys.stderr)
        return 2
    except OSError as err:
        print(f"generator: {err.filename}: {err.strerror}", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace) -> None:
    targets = parse_targets(args.targets) if args.targets is not None else None
    config = config_file.load(args.config)
    catalog = build_catalog(config)
    selection = select(config, catalog, args.preset, args.filter, targets)

    if args.list:
        print("\n".join(instance.name for instance in selection.instances))
        return
    if args.json:
        sys.stdout.write(json_text([instance_record(i) for i in selection.instances]))
        return

    files = render(selection, source=args.config.name)
    report = sync(args.out, files, owned=manifest_sources(args.out))
    if not args.quiet:
        print(f"generator: {len(selection.instances)} of {len(catalog.instances)} instances "
              f"selected ({catalog.pruned} pruned), {report.written} files written, "
              f"{report.unchanged} unchanged, {report.removed} removed -> {args.out.as_posix()}")
