"""scripts/release_build.py without compiling: its plan splits each target's TUs between the
shard jobs as their own generator runs do, and its link and verify checks refuse outputs that
do not hold the selection. .ci/run builds and checks a tiny release for real."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "release_build.py"

spec = importlib.util.spec_from_file_location("release_build", SCRIPT)
release_build = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = release_build  # its dataclasses look their module up there
spec.loader.exec_module(release_build)


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    """The stdout of the script's plan and of the generator run of one of its jobs, run at once
    (each builds the whole catalog: seconds of CPU)."""
    commands = {
        # The extended preset (hundreds of TUs), both targets, 3 jobs each.
        "plan": [SCRIPT, "plan", "--json", "--preset", "extended", "--filter", "",
                 "--targets", "80;90a", "--shards", "3"],
        # What the CMake configure of one of its jobs runs.
        "job": ["-m", "generator", "--preset", "extended", "--targets", "90a", "--shard", "2/3",
                "--list"],
    }
    running = {name: subprocess.Popen([sys.executable, *map(str, command)], cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, command in commands.items()}
    done = {name: process.communicate() for name, process in running.items()}
    for name, process in running.items():
        assert process.returncode == 0, done[name][1]
    return {name: stdout for name, (stdout, _) in done.items()}


def test_plan_splits_each_target_between_its_shard_jobs(outputs):
    plan = json.loads(outputs["plan"])
    target_of = {instance["name"]: instance["target"] for instance in plan["instances"]}
    jobs = plan["jobs"]
    assert [(job["target"], job["index"], job["count"]) for job in jobs] == [
        (target, index, 3) for target in ("sm80", "sm90a") for index in (1, 2, 3)]
    compiled = [name for job in jobs for name in job["instances"]]
    assert sorted(compiled) == sorted(target_of), "every instance compiled, none twice"
    for job in jobs:
        assert job["instances"], f"{job['name']} compiles nothing"
        assert {target_of[name] for name in job["instances"]} == {job["target"]}
    assert next(job for job in jobs if job["name"] == "shard-sm90a-2-of-3")["instances"] \
        == outputs["job"].split()


@pytest.mark.parametrize("argv, status, message", [
    (["plan", "--targets", "auto"], 1, "a release names its targets"),
    (["plan", "--targets", "75"], 2, "unknown target '75'"),
    (["shard", "--target", "80;90a", "--index", "1"], 1, "a shard job has one target"),
    (["shard", "--target", "80", "--index", "3", "--shards", "2"], 1, "past --shards 2"),
])
def test_bad_options_say_what_is_wrong(capsys, argv, status, message):
    assert release_build.main(argv) == status
    assert message in capsys.readouterr().err


# ---- on a made-up plan: sm80 with 2 TUs in 2 jobs, sm90a with 1 (its second job empty) -----

A, B, C = "fwd_a_sm80", "fwd_b_sm80", "fwd_c_sm90a"
PLAN = release_build.Plan(
    preset="p", filter="", targets=("sm80", "sm90a"),
    instances=(release_build.Instance(C, "fwd", "sm90a"),  # in a dispatch order
               release_build.Instance(A, "fwd", "sm80"), release_build.Instance(B, "fwd", "sm80")),
    jobs=(release_build.ShardJob("sm80", 1, 2, (A,)), release_build.ShardJob("sm80", 2, 2, (B,)),
          release_build.ShardJob("sm90a", 1, 2, (C,)), release_build.ShardJob("sm90a", 2, 2, ())))


def test_plan_as_a_github_matrix():
    assert release_build.github_matrix(PLAN) == {"include": [
        {"name": f"shard-sm{target}-{index}-of-2", "target": target, "index": index}
        for target in ("80", "90a") for index in (1, 2)]}


def write_shard_outputs(out: Path, tus: dict[str, list[str]]) -> None:
    """Each job's archive and the manifest its generator run would write, with these TUs."""
    for job in PLAN.jobs:
        names = [i.name for i in PLAN.instances if i.target == job.target]
        job.manifest(out).parent.mkdir(parents=True)
        job.archive(out).write_bytes(b"!<arch>\n")
        job.manifest(out).write_text(json.dumps({
            "targets": [job.target],
            "shard": {"index": job.index, "count": job.count,
                      "tus": [f"{name}.cu" for name in tus[job.name]]},
            "instances": [{"name": name, "tu": f"{name}.cu"} for name in names]}))


def test_link_takes_shard_outputs_that_split_the_selection(tmp_path):
    write_shard_outputs(tmp_path, {job.name: list(job.instances) for job in PLAN.jobs})
    release_build.check_shard_outputs(PLAN, tmp_path)


@pytest.mark.parametrize("tus, message", [
    ({"shard-sm80-1-of-2": [A], "shard-sm80-2-of-2": [A, B]},
     f"{A} is compiled by 2 jobs: shard-sm80-1-of-2, shard-sm80-2-of-2"),
    ({"shard-sm80-1-of-2": [A], "shard-sm80-2-of-2": []}, f"{B} is compiled by no job"),
])
def test_link_refuses_shard_outputs_that_do_not_split_the_selection(tmp_path, tus, message):
    write_shard_outputs(tmp_path, {"shard-sm90a-1-of-2": [C], "shard-sm90a-2-of-2": [], **tus})
    with pytest.raises(release_build.ReleaseError, match=message):
        release_build.check_shard_outputs(PLAN, tmp_path)


def test_link_names_the_shard_job_whose_output_is_missing(tmp_path):
    write_shard_outputs(tmp_path, {job.name: list(job.instances) for job in PLAN.jobs})
    PLAN.jobs[2].archive(tmp_path).unlink()
    with pytest.raises(release_build.ReleaseError,
                       match="run its shard job \\(shard --target 90a --index 1 --shards 2\\)"):
        release_build.check_shard_outputs(PLAN, tmp_path)


# verify's reading of cuobjdump --list-elf, through a stand-in cuobjdump

@pytest.mark.parametrize("cubins, message", [
    (["sm_80", "sm_80", "sm_80", "sm_90a", "sm_90a"], None),
    (["sm_80", "sm_90a", "sm_90a"], "sm_80: 1 cubins for 2 instance TUs"),
    (["sm_80", "sm_80", "sm_80", "sm_90a", "sm_90a", "sm_90"], "sm_90: 1 cubins of a target"),
])
def test_verify_counts_each_targets_cubins(tmp_path, cubins, message):
    # The runtime's own CUDA code adds a cubin per target to the TUs'.
    listing = "".join(f"ELF file {n:4}: libfmha.{n}.{arch}.cubin\n"
                      for n, arch in enumerate(cubins, start=1))
    cuobjdump = tmp_path / "cuobjdump"
    cuobjdump.write_text(f"#!/bin/sh\nprintf '%s' '{listing}'\n")
    cuobjdump.chmod(0o755)
    if message is None:
        release_build.check_cubins(PLAN, tmp_path / "libfmha.so", str(cuobjdump))
    else:
        with pytest.raises(release_build.ReleaseError, match=message):
            release_build.check_cubins(PLAN, tmp_path / "libfmha.so", str(cuobjdump))


# verify's check of the dispatch tables, through a stand-in _C
@pytest.mark.parametrize("fwd, targets, message", [
    ([C, A, B], ["sm80", "sm90a"], None),
    ([C, A], ["sm80", "sm90a"], f"fwd: {B} is missing from the table"),
    ([C, A, B, B], ["sm80", "sm90a"], f"fwd: {B} appears 2 times in the table"),
    ([A, B, C], ["sm80", "sm90a"], "fwd: the table's order is not the generator's"),
    ([C, A, B], ["sm80"], "compiled_targets\\(\\) is \\['sm80'\\]"),
])
def test_verify_compares_the_dispatch_tables_with_the_selection(tmp_path, fwd, targets, message):
    module = tmp_path / "_C.py"
    module.write_text(f"""
def instances(): return [{{"name": name}} for name in {fwd!r}]
def bwd_instances(): return []
def kvcache_instances(): return []
def compiled_targets(): return {targets!r}
""")
    if message is None:
        release_build.check_tables(PLAN, module, sys.executable)
    else:
        with pytest.raises(release_build.ReleaseError, match=message):
            release_build.check_tables(PLAN, module, sys.executable)
