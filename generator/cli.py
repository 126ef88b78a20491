"""python -m generator: load and check the config, build the catalog, select, then list, count
the presets, explain a dispatch, or render. Everything is checked before anything is written."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from . import config as config_file
from .catalog import Catalog
from .catalog_cache import checked_catalog
from .config import Config
from .errors import GeneratorError
from .explain import PROBLEM_HELP, explain, parse_problem
from .model import Instance
from .output import sync
from .render import instance_record, json_text, manifest_sources, render, render_loadable
from .schema import ARCH, Arch
from .selection import (GRAMMAR, Selection, parse_shard, parse_targets, select,
                        select_each_preset)

DEFAULT_OUT = Path("build/gen")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m generator",
        description="Expand the kernel-instance matrix of instances.yaml, prune it, select from\n"
                    "it, and render one CUDA TU per instance plus dispatch_table.cpp,\n"
                    "instances.cmake and manifest.json. The output directory is replaced as a\n"
                    "whole (a run that stops midway leaves the old one); files whose bytes do\n"
                    "not change keep their mtime, and TUs of instances no longer selected are\n"
                    "removed.",
        epilog=f"{GRAMMAR}\n\n{PROBLEM_HELP}\n\nExit status: 0 done, 1 the output could not be "
               f"written (the old output is\nleft as it was), 2 a mistake in the config or the "
               f"options (nothing is\nwritten then).",
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
    parser.add_argument("--shard", metavar="K/N",
                        help="build part K of N (1 <= K <= N) of the selected TUs: the N parts are "
                             "disjoint, together the whole selection, and balanced by head dims, "
                             "padding and arch. "
                             "Only this part's TUs are written and listed in instances.cmake; "
                             "dispatch_table.cpp and manifest.json still describe the whole "
                             "selection (the manifest's `shard` names the part), so the objects "
                             "of N shard jobs link against one table. --list and --json show "
                             "the part")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--list", action="store_true",
                        help="print the selected instance names in dispatch order; write nothing")
    action.add_argument("--presets", action="store_true",
                        help="print each preset's instance counts per operation and TU counts "
                             "(per target too) with its reason, with --filter and --targets "
                             "applied; JSON with --json; write nothing")
    action.add_argument("--explain", metavar="PROBLEM",
                        help="print the selected instance the runtime would run for PROBLEM "
                             "and why, or on a miss the nearest ones and a --filter that "
                             "would build one that fits (syntax below); write nothing")
    parser.add_argument("--json", action="store_true",
                        help="print the selected instances as a JSON array in dispatch order "
                             "(`tu` is relative to --out), or with --presets the counts; write "
                             "nothing")
    parser.add_argument("--loadable", action="store_true",
                        help="render the selection as a shared object that a built libfmha "
                             "loads at run time (fmha::load_instances): its TUs, "
                             "loadable_table.cpp and manifest.json, no dispatch table or "
                             "instances.cmake (compile on demand does this for one instance)")
    parser.add_argument("-q", "--quiet", action="store_true", help="omit the summary line")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.json and (args.list or args.explain is not None):
        parser.error("--json goes alone or with --presets")
    if args.shard is not None and (args.presets or args.explain is not None):
        parser.error("--shard applies to rendering, --list and --json")
    if args.loadable and (args.shard is not None or args.presets or args.list or args.json
                          or args.explain is not None):
        parser.error("--loadable renders: it goes without --shard, --list, --json, --presets "
                     "and --explain")
    try:
        _run(args)
    except GeneratorError as err:
        print(err, file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader stopped early (`| head`): not an error of ours. Point stdout at devnull so
        # that flushing it at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as err:
        print(f"generator: {err.filename}: {err.strerror}", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace) -> None:
    targets = parse_targets(args.targets) if args.targets is not None else None
    shard = parse_shard(args.shard) if args.shard is not None else None
    problem = parse_problem(args.explain) if args.explain is not None else None
    config = config_file.load(args.config)
    catalog, preset_tokens = checked_catalog(config)

    if args.presets:
        _print_presets(select_each_preset(config, catalog, args.filter, targets, preset_tokens),
                       config, catalog, as_json=args.json)
        return

    selection = select(config, catalog, args.preset, args.filter, targets, preset_tokens)
    if problem is not None:
        sys.stdout.write(explain(problem, selection, config, catalog, args.preset, targets,
                                 preset_tokens))
        return

    built = shard.take(selection.instances) if shard else selection.instances
    if args.list:
        print("\n".join(instance.name for instance in built))
        return
    if args.json:
        sys.stdout.write(json_text([instance_record(i) for i in built]))
        return

    # The output directory is replaced as a whole: not one that holds the working directory.
    if Path.cwd().resolve().is_relative_to(args.out.resolve()):
        raise GeneratorError(f"{args.out.as_posix()} holds the working directory, and a run "
                             f"replaces its output directory as a whole: give it one of its own",
                             "--out")
    files = (render_loadable(selection, source=args.config.name) if args.loadable else
             render(selection, source=args.config.name, shard=shard))
    report = sync(args.out, files, owned=manifest_sources)
    if not args.quiet:
        part = f"; shard {shard}:" if shard else ","
        per_op = ", ".join(f"{op} {count}"
                           for op, count in _per_op(selection.instances, config).items())
        print(f"generator: {len(selection.instances)} of {len(catalog.instances)} instances "
              f"selected ({per_op}; {catalog.pruned} pruned){part} "
              f"{_tu_counts(built, selection.targets)}, {report.written} files written, "
              f"{report.unchanged} unchanged, {report.removed} removed -> {args.out.as_posix()}")


def _per_target(instances: Sequence[Instance], targets: Sequence[Arch]) -> dict[str, int]:
    return {arch.token: sum(i.point.arch == arch for i in instances) for arch in targets}


def _per_op(instances: Sequence[Instance], config: Config) -> dict[str, int]:
    """Instances per operation of the config."""
    return {op: sum(i.op.token == op for i in instances) for op in config.operations}


def _tu_counts(instances: Sequence[Instance], targets: Sequence[Arch]) -> str:
    """`N TUs (sm80 n, sm90a m)`: one TU per instance, and how many nvcc builds per target."""
    per_target = ", ".join(f"{token} {count}"
                           for token, count in _per_target(instances, targets).items())
    return f"{len(instances)} TU{'' if len(instances) == 1 else 's'} ({per_target})"


def _print_presets(selections: dict[str, Selection], config: Config, catalog: Catalog,
                   as_json: bool) -> None:
    """One row per preset: instances per operation, TUs (one per instance) in all and per
    target, and why."""
    archs = [arch for arch in ARCH if any(i.point.arch == arch for i in catalog.instances)]
    rows = [{"preset": name, "filters": list(config.presets[name].filters),
             "instances": len(selection.instances),
             "instances_per_op": _per_op(selection.instances, config),
             "tus": len(selection.instances),
             "tus_per_target": _per_target(selection.instances, archs),
             "why": " ".join(config.presets[name].why.split())}
            for name, selection in selections.items()]
    if as_json:
        sys.stdout.write(json_text(rows))
        return
    table = [["preset", *config.operations, "TUs", *(arch.token for arch in archs)],
             *([row["preset"], *row["instances_per_op"].values(), row["tus"],
                *row["tus_per_target"].values()] for row in rows)]
    widths = [max(len(str(line[column])) for line in table) for column in range(len(table[0]))]

    def cells(line: list) -> str:
        return "  ".join([f"{line[0]:<{widths[0]}}",
                          *(f"{cell:>{width}}" for cell, width in zip(line[1:], widths[1:]))])

    prefix_width = sum(widths) + 2 * len(widths)
    print(f"{cells(table[0])}  why")
    for line, row in zip(table[1:], rows):
        prefix = f"{cells(line)}  "
        why = textwrap.wrap(row["why"], width=max(40, 100 - prefix_width),
                            break_on_hyphens=False)
        print(prefix + why[0])
        for line in why[1:]:
            print(" " * prefix_width + line)
