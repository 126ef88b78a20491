#!/usr/bin/env python3
"""A release build as .github/workflows/release.yml runs it, here on one machine, the jobs one
after another.

A release compiles the instance matrix in parts, one job per target and shard, and links the
parts once, as CUTLASS's and FlashAttention's release builds split theirs:

  plan    the jobs: for each target and shard K of N, the instance TUs that job compiles
          (--json names them)
  shard   one compile job (--target, --index): cmake -DFMHA_ARCHS=<target> -DFMHA_SHARD=K/N
          into <out>/shard-<target>-K-of-N, whose libfmha_shard_K_of_N.a holds its TUs' objects
  link    checks that the shard jobs' manifests hold the selection, each TU once, then builds
          one wheel per Python interpreter into <out>/wheels, its libfmha linking every archive
          (FMHA_SHARD_ARCHIVES)
  verify  each wheel's libfmha holds machine code for every target (cuobjdump --list-elf) and
          its dispatch tables name exactly the selection's instances (fmha._C, loaded alone:
          no torch or GPU needed)
  all     plan, every shard job, link, verify

    python scripts/release_build.py all --preset minimal --filter fa2 --targets "80;90a" \\
        --shards 2 --python python3.11 --python python3.12 --out build/release

The generator's --shard splits the selection of its own run's targets, so the N jobs of one
target split that target's TUs between them, and the jobs of all targets together hold the
whole selection: plan checks this on the generator's split, link on what the jobs wrote.
CMAKE_BUILD_PARALLEL_LEVEL limits the compiles of a job (cmake --build's and pip's alike).
cuobjdump is --cuobjdump, else $CUOBJDUMP, else on PATH or beside nvcc, else that of the
nvidia-cuda-cuobjdump wheel installed for this interpreter.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's generator, as CMake runs it

from generator import config as config_file  # noqa: E402
from generator.catalog import build_catalog  # noqa: E402
from generator.errors import GeneratorError  # noqa: E402
from generator.selection import Shard, check_presets, parse_targets, select  # noqa: E402

# The _C function that lists each operation's dispatch table.
TABLE_LISTINGS = {"fwd": "instances", "bwd": "bwd_instances", "kvcache": "kvcache_instances"}

# Run with the wheel's own interpreter on its unpacked fmha/_C: the module links libfmha beside
# it and needs neither torch (which only the fmha package imports) nor a GPU.
TABLE_PROBE = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("_C", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
tables = {{op: [i["name"] for i in getattr(module, listing)()]
          for op, listing in {TABLE_LISTINGS!r}.items()}}
print(json.dumps({{"targets": module.compiled_targets(), "tables": tables}}))
"""


class ReleaseError(Exception):
    """A step failed, or what it built is not what the plan says."""


@dataclass(frozen=True)
class Instance:
    name: str
    op: str
    target: str  # the generator's token: sm80, sm90a


@dataclass(frozen=True)
class ShardJob:
    """Compiles the TUs of shard `index` of `count` of one target's selection."""

    target: str
    index: int
    count: int
    instances: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"shard-{self.target}-{self.index}-of-{self.count}"

    def build_dir(self, out: Path) -> Path:
        return out / self.name

    def archive(self, out: Path) -> Path:
        return self.build_dir(out) / f"libfmha_shard_{self.index}_of_{self.count}.a"

    def manifest(self, out: Path) -> Path:
        return self.build_dir(out) / "gen" / "manifest.json"


@dataclass(frozen=True)
class Plan:
    preset: str
    filter: str
    targets: tuple[str, ...]
    instances: tuple[Instance, ...]  # the whole selection, in dispatch order
    jobs: tuple[ShardJob, ...]

    @property
    def cmake_archs(self) -> str:
        return ";".join(cmake_arch(target) for target in self.targets)

    def tus_of(self, target: str) -> int:
        return sum(instance.target == target for instance in self.instances)


def cmake_arch(target: str) -> str:
    """FMHA_ARCHS's spelling of a generator target: sm90a -> 90a."""
    return target.removeprefix("sm")


def target_tokens(text: str) -> tuple[str, ...]:
    if text.strip().lower() == "auto":
        raise ReleaseError("--targets: a release names its targets, e.g. '80;90a' (auto would "
                           "build for the build machine's GPUs)")
    return tuple(arch.token for arch in parse_targets(text))


def make_plan(preset: str, filter_text: str, targets_text: str, shards: int) -> Plan:
    """The selection and its shard jobs, split as each job's generator run splits it."""
    targets = target_tokens(targets_text)
    config = config_file.load()
    catalog = build_catalog(config)
    preset_tokens = check_presets(config, catalog)

    def selected(of_targets: tuple[str, ...]):
        return select(config, catalog, preset, filter_text, parse_targets(",".join(of_targets)),
                      preset_tokens=preset_tokens).instances

    instances = tuple(Instance(i.name, i.op.token, i.point.arch.token)
                      for i in selected(targets))
    jobs = []
    for target in targets:
        of_target = selected((target,))
        jobs += [ShardJob(target, index, shards,
                          tuple(i.name for i in Shard(index, shards).take(of_target)))
                 for index in range(1, shards + 1)]
    plan = Plan(preset, filter_text, targets, instances, tuple(jobs))
    check_partition(plan, {job.name: job.instances for job in plan.jobs}, "the plan")
    return plan


def check_partition(plan: Plan, parts: dict[str, tuple[str, ...]], what: str) -> None:
    """The parts (job name -> instance names) hold the selection, each instance once."""
    owners = collections.defaultdict(list)
    for job, names in parts.items():
        for name in names:
            owners[name].append(job)
    problems = [f"{name} is compiled by {len(jobs)} jobs: {', '.join(jobs)}"
                for name, jobs in owners.items() if len(jobs) > 1]
    selection = {instance.name for instance in plan.instances}
    problems += [f"{name} is compiled by no job" for name in sorted(selection - owners.keys())]
    problems += [f"{name} ({', '.join(owners[name])}) is not in the selection"
                 for name in sorted(owners.keys() - selection)]
    if problems:
        raise ReleaseError(f"{what}: the shard jobs do not split the selection (preset "
                           f"{plan.preset}, filter {plan.filter!r}, targets "
                           f"{plan.cmake_archs}) into disjoint parts:\n  " + "\n  ".join(problems))


def run(command: list, what: str, shown: str | None = None,
        **kwargs) -> subprocess.CompletedProcess:
    """Runs a step's command, shown first (as `shown` where given); a failure names the step."""
    print("+ " + (shown or shlex.join(map(str, command))), flush=True)
    try:
        done = subprocess.run(list(map(str, command)), **kwargs)
    except FileNotFoundError:
        raise ReleaseError(f"{what}: {command[0]} not found") from None
    if done.returncode != 0:
        detail = f":\n{done.stderr.strip()}" if isinstance(done.stderr, str) else ""
        raise ReleaseError(f"{what} failed (exit status {done.returncode}){detail}")
    return done


# ---- the steps ------------------------------------------------------------------------------

def print_plan(plan: Plan, out: Path) -> None:
    per_op = collections.Counter(instance.op for instance in plan.instances)
    print(f"selection: preset {plan.preset}, filter {plan.filter!r}, targets {plan.cmake_archs}: "
          f"{len(plan.instances)} instances ("
          + ", ".join(f"{op} {count}" for op, count in per_op.items()) + ")")
    op_of = {instance.name: instance.op for instance in plan.instances}
    width = max(len(job.name) for job in plan.jobs)
    for job in plan.jobs:
        job_ops = collections.Counter(op_of[name] for name in job.instances)
        print(f"  {job.name:<{width}}  {len(job.instances):4} TUs  "
              + (", ".join(f"{op} {count}" for op, count in job_ops.items())
                 or "(an empty archive: more shards than TUs)"))
    print(f"  link: FMHA_ARCHS={plan.cmake_archs}, the {len(plan.jobs)} archives under {out}")


def plan_record(plan: Plan) -> dict:
    """plan --json."""
    return {"preset": plan.preset, "filter": plan.filter, "targets": plan.targets,
            "instances": [vars(instance) for instance in plan.instances],
            "jobs": [{"name": job.name, "target": job.target, "index": job.index,
                      "count": job.count, "instances": job.instances} for job in plan.jobs]}


def github_matrix(plan: Plan) -> dict:
    """plan --matrix: the shard jobs as the workflow's compile jobs take them."""
    return {"include": [{"name": job.name, "target": cmake_arch(job.target), "index": job.index}
                        for job in plan.jobs]}


def build_shard(job: ShardJob, preset: str, filter_text: str, out: Path) -> None:
    start = time.monotonic()
    build = job.build_dir(out)
    what = f"shard job {job.name}"
    run(["cmake", "-S", REPO, "-B", build, "-G", "Ninja",
         f"-DFMHA_ARCHS={cmake_arch(job.target)}", f"-DFMHA_SHARD={job.index}/{job.count}",
         f"-DFMHA_PRESET={preset}", f"-DFMHA_FILTER={filter_text}",
         "-DFMHA_BUILD_PYTHON=OFF", "-DFMHA_BUILD_EXAMPLES=OFF",
         f"-DPython3_EXECUTABLE={sys.executable}"], f"{what}: configure")
    run(["cmake", "--build", build], f"{what}: build")
    print(f"{what}: {job.archive(out)} ({time.monotonic() - start:.0f} s)", flush=True)


def check_shard_outputs(plan: Plan, out: Path) -> None:
    """What the shard jobs wrote (each job's generator manifest names its TUs) splits the
    selection: an archive missing, built from other options or for another split fails here
    rather than as undefined symbols in the link."""
    parts = {}
    for job in plan.jobs:
        missing = [str(path) for path in (job.archive(out), job.manifest(out))
                   if not path.is_file()]
        if missing:
            raise ReleaseError(f"{job.name}: no {' or '.join(missing)}: run its shard job "
                               f"(shard --target {cmake_arch(job.target)} --index {job.index} "
                               f"--shards {job.count}) or put its artifact there")
        manifest = json.loads(job.manifest(out).read_text())
        shard = manifest.get("shard") or {}
        if manifest.get("targets") != [job.target] or (shard.get("index"), shard.get("count")) \
                != (job.index, job.count):
            raise ReleaseError(f"{job.manifest(out)}: targets {manifest.get('targets')}, shard "
                               f"{shard.get('index')}/{shard.get('count')}; the plan's job "
                               f"{job.name} is target {job.target}, shard {job.index}/{job.count}")
        name_of_tu = {instance["tu"]: instance["name"] for instance in manifest["instances"]}
        parts[job.name] = tuple(name_of_tu[tu] for tu in shard["tus"])
    check_partition(plan, parts, f"the shard jobs' manifests under {out}")


def interpreter_tag(python: str) -> str:
    """cp311 for a CPython 3.11: the tag of the wheels it builds and installs."""
    done = run([python, "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"],
               f"asking {python} for its version", capture_output=True, text=True)
    return done.stdout.strip()


def build_wheel(plan: Plan, out: Path, python: str, build_isolation: bool) -> Path:
    """The link job: a wheel for `python` whose libfmha links every shard archive."""
    defines = {"FMHA_PRESET": plan.preset, "FMHA_FILTER": plan.filter,
               "FMHA_ARCHS": plan.cmake_archs,
               "FMHA_SHARD_ARCHIVES": ";".join(str(job.archive(out)) for job in plan.jobs)}
    start = time.monotonic()
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    # Built aside, so that the new wheel is the only one there whatever <out>/wheels holds.
    with tempfile.TemporaryDirectory(dir=out, prefix="wheel-") as staging:
        run([python, "-m", "pip", "wheel", REPO, "--no-deps", "--wheel-dir", staging,
             *([] if build_isolation else ["--no-build-isolation"]),
             # One build tree per interpreter, apart from pip install .'s build/pip-<tag>.
             f"--config-settings=build-dir={out / 'link'}/{{wheel_tag}}",
             *(f"--config-settings=cmake.define.{name}={value}"
               for name, value in defines.items())],
            f"link job for {python}")
        built = list(Path(staging).glob("*.whl"))
        if len(built) != 1:
            raise ReleaseError(f"link job for {python}: pip wheel wrote {len(built)} wheels")
        wheel = wheels / built[0].name
        shutil.move(built[0], wheel)
    print(f"link job for {python}: {wheel} ({time.monotonic() - start:.0f} s)", flush=True)
    return wheel


def find_wheel(out: Path, python: str) -> Path:
    tag = interpreter_tag(python)
    wheels = sorted((out / "wheels").glob(f"fmha-*-{tag}-*.whl"))
    if len(wheels) != 1:
        raise ReleaseError(f"expected one {tag} wheel for {python} in {out / 'wheels'}, found "
                           f"{len(wheels)}: run link --python {python}")
    return wheels[0]


def find_cuobjdump(given: str | None) -> str:
    candidates = [given, os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent / "cuobjdump"))
    spec = importlib.util.find_spec("nvidia")  # the nvidia-cuda-cuobjdump wheel: nvidia/cu*/bin
    for root in (spec.submodule_search_locations if spec else None) or []:
        candidates += sorted(map(str, Path(root).glob("cu*/bin/cuobjdump")), reverse=True)
    for candidate in filter(None, candidates):
        if os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return candidate
    if given:
        raise ReleaseError(f"--cuobjdump {given}: no such program")
    raise ReleaseError("verify needs cuobjdump: none on PATH, beside nvcc or from pip; install it "
                       f"with {sys.executable} -m pip install nvidia-cuda-cuobjdump, or give "
                       "--cuobjdump")


def check_cubins(plan: Plan, libfmha: Path, cuobjdump: str) -> None:
    """Each instance TU puts one cubin of its target into libfmha (the runtime's own CUDA code
    adds one per target): a target with fewer cubins than TUs lost an archive's objects."""
    listing = run([cuobjdump, "--list-elf", libfmha], f"cuobjdump --list-elf {libfmha}",
                  capture_output=True, text=True).stdout
    cubins = collections.Counter(re.findall(r"\.(sm_\w+)\.cubin$", listing, re.MULTILINE))
    expected = {f"sm_{cmake_arch(target)}": plan.tus_of(target) for target in plan.targets}
    problems = [f"{arch}: {cubins[arch]} cubins for {tus} instance TUs"
                for arch, tus in expected.items() if cubins[arch] < tus]
    problems += [f"{arch}: {count} cubins of a target not asked for"
                 for arch, count in cubins.items() if arch not in expected]
    if problems:
        raise ReleaseError(f"{libfmha} does not hold the selection's code:\n  "
                           + "\n  ".join(problems) + f"\ncuobjdump --list-elf:\n{listing}")
    print("  cubins: " + ", ".join(f"{arch} {cubins[arch]} (for {tus} TUs)"
                                    for arch, tus in expected.items()))


def check_tables(plan: Plan, module: Path, python: str) -> None:
    """The library's dispatch tables and targets are the selection's."""
    probed = json.loads(run([python, "-c", TABLE_PROBE, module], f"loading {module}",
                            shown=f"{python} -c <list the dispatch tables of> {module}",
                            capture_output=True, text=True).stdout)
    problems = []
    if sorted(probed["targets"]) != sorted(plan.targets):
        problems.append(f"compiled_targets() is {probed['targets']}, not {list(plan.targets)}")
    ops = {instance.op for instance in plan.instances} | probed["tables"].keys()
    for op in sorted(ops):
        if op not in TABLE_LISTINGS:
            problems.append(f"{op}: the selection has instances of an operation whose table "
                            "this script cannot list (TABLE_LISTINGS)")
            continue
        table = probed["tables"][op]
        selection = [instance.name for instance in plan.instances if instance.op == op]
        problems += [f"{op}: {name} appears {count} times in the table"
                     for name, count in collections.Counter(table).items() if count > 1]
        problems += [f"{op}: {name} is missing from the table"
                     for name in selection if name not in table]
        problems += [f"{op}: {name} is in the table but not in the selection"
                     for name in table if name not in selection]
        if sorted(table) == sorted(selection) and table != selection:
            problems.append(f"{op}: the table's order is not the generator's dispatch order")
    if problems:
        raise ReleaseError(f"{module}'s dispatch tables are not the selection's:\n  "
                           + "\n  ".join(problems))
    print("  dispatch tables: " + ", ".join(f"{op} {len(table)}"
                                            for op, table in probed["tables"].items())
          + f"; targets {', '.join(probed['targets'])}")


def verify_wheel(plan: Plan, wheel: Path, python: str, cuobjdump: str, out: Path) -> None:
    unpacked = out / "verify" / wheel.stem
    shutil.rmtree(unpacked, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    package = unpacked / "fmha"
    modules = list(package.glob("_C.*.so"))
    if not (package / "libfmha.so").is_file() or len(modules) != 1:
        raise ReleaseError(f"{wheel}: expected fmha/libfmha.so and one fmha/_C.*.so in it")
    print(f"verify {wheel.name} with {python}:")
    check_cubins(plan, package / "libfmha.so", cuobjdump)
    check_tables(plan, modules[0], python)


# ---- command line -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--preset", default=os.environ.get("FMHA_PRESET", "default"),
                        help="preset of instances.yaml (default: $FMHA_PRESET, else default)")
    common.add_argument("--filter", default=os.environ.get("FMHA_FILTER", ""),
                        help="generator --filter, ANDed with the preset (default: $FMHA_FILTER)")
    common.add_argument("--shards", type=positive, default=1, metavar="N",
                        help="compile jobs per target (default: 1)")
    common.add_argument("--out", type=Path, default=REPO / "build" / "release",
                        help="the jobs' build trees, wheels/ and verify/ (default: build/release)")
    with_targets = argparse.ArgumentParser(add_help=False)
    with_targets.add_argument("--targets", default=os.environ.get("FMHA_ARCHS", "80;90a"),
                              help="GPU targets, e.g. '80;90a' (default: $FMHA_ARCHS, else 80;90a)")
    with_pythons = argparse.ArgumentParser(add_help=False)
    with_pythons.add_argument("--python", action="append", metavar="INTERPRETER",
                              help="a wheel for this interpreter; repeat for several (default: "
                                   "the one running this script)")
    linking = argparse.ArgumentParser(add_help=False)
    linking.add_argument("--no-build-isolation", dest="build_isolation", action="store_false",
                         help="build the wheels with the interpreters' installed scikit-build-"
                              "core, pybind11, jinja2 and pyyaml instead of pip's isolated ones")
    verifying = argparse.ArgumentParser(add_help=False)
    verifying.add_argument("--cuobjdump", help="the cuobjdump to list libfmha's cubins with")

    parser = argparse.ArgumentParser(
        prog="scripts/release_build.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    plan = steps.add_parser("plan", parents=[common, with_targets],
                            help="print the shard jobs and their TUs")
    shown = plan.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="the plan as JSON")
    shown.add_argument("--matrix", action="store_true",
                       help="the shard jobs as a GitHub Actions matrix, on one line")
    shard = steps.add_parser("shard", parents=[common], help="run one shard job")
    shard.add_argument("--target", required=True, help="its target, e.g. 90a")
    shard.add_argument("--index", type=positive, required=True, metavar="K",
                       help="its shard, 1 to --shards")
    steps.add_parser("link", parents=[common, with_targets, with_pythons, linking],
                     help="check the shard jobs' outputs, build the wheels")
    steps.add_parser("verify", parents=[common, with_targets, with_pythons, verifying],
                     help="check the wheels' libfmha and dispatch tables")
    steps.add_parser("all", parents=[common, with_targets, with_pythons, linking, verifying],
                     help="plan, every shard job, link, verify")
    return parser


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out.resolve()
    pythons = getattr(args, "python", None) or [sys.executable]
    try:
        if args.step == "shard":
            if args.index > args.shards:
                raise ReleaseError(f"--index {args.index} is past --shards {args.shards}")
            targets = target_tokens(args.target)
            if len(targets) != 1:
                raise ReleaseError(f"--target {args.target}: a shard job has one target")
            # Its TUs are what its own configure's generator run picks: no plan needed.
            build_shard(ShardJob(targets[0], args.index, args.shards, ()), args.preset,
                        args.filter, out)
            return 0
        plan = make_plan(args.preset, args.filter, args.targets, args.shards)
        if args.step == "plan":
            if args.matrix:
                print(json.dumps(github_matrix(plan)))
            elif args.json:
                print(json.dumps(plan_record(plan), indent=2))
            else:
                print_plan(plan, out)
            return 0
        if args.step == "all":
            print_plan(plan, out)
            for job in plan.jobs:
                build_shard(job, plan.preset, plan.filter, out)
        if args.step in ("link", "all"):
            check_shard_outputs(plan, out)
            for python in pythons:
                build_wheel(plan, out, python, args.build_isolation)
        if args.step in ("verify", "all"):
            cuobjdump = find_cuobjdump(args.cuobjdump)
            for python in pythons:
                verify_wheel(plan, find_wheel(out, python), python, cuobjdump, out)
            print(f"verified: every wheel's libfmha holds code for {plan.cmake_archs} and "
                  f"the {len(plan.instances)} instances of the selection")
        return 0
    except GeneratorError as err:
        print(f"release_build: {err}", file=sys.stderr)
        return 2
    except ReleaseError as err:
        print(f"release_build: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
