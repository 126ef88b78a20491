"""CMake configure + nvcc build of a small filtered subset, for both sm80 and sm90a.

Needs nvcc and cmake, not a GPU: the kernels, the dispatcher and the example compile and link,
each instance TU gets exactly its arch's -gencode, and the library's dispatch table holds the
filtered instances. A sharded build of the same subset (FMHA_SHARD=1/2 and 2/2, then a final
libfmha from FMHA_SHARD_ARCHIVES) compiles the same TUs alike, once each, and links them.
"""

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# With the default preset (bf16, head dim 128, lse, no bias, no dropout, no softcap, row-major V,
# KV-cache attention), batch mode: the forward without a mask (fa2 unpadded and fully padded for
# sm80, fa3 for sm90a), the backward, causal (the same three), and KV-cache attention (which
# has no mode) without a mask: decode on a contiguous and a paged cache for sm80 and sm90a, and
# from an e4m3 cache (contiguous and paged) for sm90a. Not the default's e4m3 (FP8) forward
# (!e4m3: the dtype's, not the cache's kve4m3): a fourth fa3 TU, another minute of one core,
# for what the three fa3 TUs here already check of the build.
PRESET = "default"
FILTER = "mode=batch|kvcache,mask=none|bwd_*,!e4m3"
TUS = 12

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("cmake") is None or shutil.which("ninja") is None,
    reason="needs nvcc, cmake and ninja",
)


def configure(build, *options):
    """cmake configure of the test subset, with `options` (-D...) on top."""
    return subprocess.run(
        ["cmake", "-S", REPO, "-B", build, "-G", "Ninja", f"-DFMHA_PRESET={PRESET}",
         f"-DFMHA_FILTER={FILTER}",
         "-DFMHA_ARCHS=80;90a", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
         f"-DPython3_EXECUTABLE={sys.executable}", *options],
        capture_output=True, text=True)


def configure_and_build(build, *options):
    """Configure and build; the configure output."""
    configured = configure(build, *options)
    assert configured.returncode == 0, configured.stdout + configured.stderr
    compiled = subprocess.run(["cmake", "--build", build], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return configured.stdout


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    build = tmp_path_factory.mktemp("cmake")
    output = configure_and_build(build, "-DFMHA_BUILD_PYTHON=OFF")
    # The matrix's total moves with instances.yaml; the selection's counts are this test's.
    assert re.search(rf"generator: {TUS} of \d+ instances selected \(fwd 3, bwd 3, kvcache 6;",
                     output), output
    assert "CUTLASS 4.2" in output and "headers for the fa3 TUs" in output
    return build


def test_each_instance_tu_compiles_for_its_own_arch(build_dir):
    commands = json.loads((build_dir / "compile_commands.json").read_text())
    # The generated instance TUs (runtime/src has .cu files of its own).
    tus = {Path(c["file"]).name: c["command"] for c in commands
           if Path(c["file"]).parent == build_dir / "gen" and c["file"].endswith(".cu")}
    assert len(tus) == TUS
    for name, command in tus.items():
        if "_sm90a_" in name:
            assert "-gencode=arch=compute_90a,code=sm_90a" in command
            assert "compute_80" not in command
        else:
            assert "-gencode=arch=compute_80,code=[sm_80,compute_80]" in command
            assert "compute_90a" not in command
        # Only the fa3 TU sees the CUTLASS headers.
        assert ("/source/include " in command) == ("_fa3_" in name), (name, command)


def test_library_and_example_link(build_dir):
    assert (build_dir / "python" / "fmha" / "libfmha.so").is_file()
    assert (build_dir / "fmha_fwd").is_file()
    manifest = json.loads((build_dir / "gen" / "manifest.json").read_text())
    names = {i["name"] for i in manifest["instances"]}
    table = (build_dir / "gen" / "dispatch_table.cpp").read_text()
    assert names and all(f'"{n}"' in table for n in names)


def test_a_selection_without_fa3_needs_no_cutlass(tmp_path):
    # A CUTLASS directory that does not exist would fail the configure, were it looked at.
    result = configure(tmp_path, "-DFMHA_BUILD_PYTHON=OFF", f"-DFMHA_FILTER={FILTER},fa2",
                       "-DFMHA_CUTLASS_INCLUDE_DIR=/nonexistent")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CUTLASS" not in result.stdout


def test_a_missing_cutlass_fails_configure_saying_how_to_get_it(tmp_path):
    result = configure(tmp_path, "-DFMHA_BUILD_PYTHON=OFF",
                       "-DFMHA_CUTLASS_INCLUDE_DIR=/nonexistent")
    assert result.returncode != 0
    message = " ".join(result.stderr.split())
    assert "'/nonexistent' (from FMHA_CUTLASS_INCLUDE_DIR) has no cute/tensor.hpp" in message
    assert "pip install --no-deps nvidia-cutlass==4.2.0.0" in message


def _gpu_targets() -> list:
    """What FMHA_ARCHS=auto should pick here: the targets of nvidia-smi's GPUs, or none."""
    try:
        caps = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if caps.returncode != 0:
        return []
    targets = []
    for cap in re.findall(r"\d+\.\d+", caps.stdout):
        major, minor = map(int, cap.split("."))
        target = "90a" if (major, minor) == (9, 0) else "80" if major >= 8 else None
        if target and target not in targets:
            targets.append(target)
    return targets


def test_auto_targets_are_the_gpus_or_both(tmp_path):
    """FMHA_ARCHS=auto, pip install's default: the build machine's GPUs, else sm80 and sm90a."""
    result = subprocess.run(
        ["cmake", "-S", REPO, "-B", tmp_path, "-G", "Ninja", f"-DFMHA_PRESET={PRESET}",
         f"-DFMHA_FILTER={FILTER},fa2", "-DFMHA_ARCHS=auto", "-DFMHA_COMPILER_LAUNCHER=none",
         "-DFMHA_BUILD_PYTHON=OFF",
         f"-DPython3_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    expected = _gpu_targets()
    if expected:
        assert f"FMHA_ARCHS=auto: {';'.join(expected)}, for this machine's GPUs" in result.stdout
    else:
        assert "FMHA_ARCHS=auto: no GPU of compute capability 8.0 or newer here" in result.stdout
        assert "(sm80 6, sm90a 4)" in result.stdout  # fa2 for both targets
    assert "Compiler cache" not in result.stdout


def test_bad_filter_fails_configure_with_the_generator_message(tmp_path):
    result = subprocess.run(
        ["cmake", "-S", REPO, "-B", tmp_path, "-G", "Ninja", "-DFMHA_FILTER=bf16,hdim80",
         "-DFMHA_BUILD_PYTHON=OFF", f"-DPython3_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True)
    assert result.returncode != 0
    assert "hdim80" in result.stderr and "python -m generator failed" in result.stderr


# ---- sharded build --------------------------------------------------------------------------

def instance_tus(build):
    """The instance TUs that build's instances.cmake lists (what CMake compiles there)."""
    text = (build / "gen" / "instances.cmake").read_text()
    return re.findall(r'"\$\{CMAKE_CURRENT_LIST_DIR\}/([^"/]+\.cu)"', text)


def instance_compile_commands(build):
    """The compile command of each instance TU, by TU name, with the build's own paths and the
    target's object directory written alike."""
    commands = json.loads((build / "compile_commands.json").read_text())
    return {Path(c["file"]).name: c["command"].replace(str(build), "<build>")
            .replace("/fmha_shard.dir/", "/fmha.dir/")
            for c in commands
            if Path(c["file"]).parent == build / "gen" and c["file"].endswith(".cu")}


@pytest.fixture(scope="module")
def shard_dirs(tmp_path_factory):
    """Shards 1/2 and 2/2 of the test subset, built side by side. FMHA_BUILD_PYTHON is left on:
    a shard job builds no _C and so needs no pybind11."""
    def shard(index):
        build = tmp_path_factory.mktemp(f"shard{index}")
        output = configure_and_build(build, f"-DFMHA_SHARD={index}/2")
        assert f"FMHA_SHARD={index}/2: building only" in output
        assert f"shard {index}/2: {TUS // 2} TUs" in output
        return build
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(shard, (1, 2)))


@pytest.fixture(scope="module")
def final_dir(tmp_path_factory, shard_dirs):
    """libfmha from the two shard archives; first from shard 1's alone, which must not link.
    Returns the build and the output of that failed build."""
    archives = [build / f"libfmha_shard_{index}_of_2.a"
                for index, build in enumerate(shard_dirs, start=1)]
    build = tmp_path_factory.mktemp("final")
    options = ["-DFMHA_BUILD_PYTHON=OFF", "-DFMHA_BUILD_EXAMPLES=OFF"]
    configured = configure(build, *options, f"-DFMHA_SHARD_ARCHIVES={archives[0]}")
    assert configured.returncode == 0, configured.stdout + configured.stderr
    missing = subprocess.run(["cmake", "--build", build], capture_output=True, text=True)
    assert missing.returncode != 0, "libfmha linked without shard 2/2"
    output = configure_and_build(build, *options,
                                 "-DFMHA_SHARD_ARCHIVES=" + ";".join(map(str, archives)))
    assert "links the instances of 2 shard archives" in output
    return build, missing.stdout + missing.stderr


def test_shards_split_the_selection_and_build_only_their_archive(shard_dirs, final_dir):
    final, _ = final_dir
    selection = {i["tu"] for i in json.loads((final / "gen" / "manifest.json").read_text())
                 ["instances"]}
    assert len(selection) == TUS
    parts = []
    for index, build in enumerate(shard_dirs, start=1):
        tus = set(instance_tus(build))
        assert tus == {p.name for p in (build / "gen").glob("*.cu")}
        # The shard's dispatch table and manifest still describe the whole selection.
        manifest = json.loads((build / "gen" / "manifest.json").read_text())
        assert {i["tu"] for i in manifest["instances"]} == selection
        assert set(manifest["shard"]["tus"]) == tus
        assert (build / f"libfmha_shard_{index}_of_2.a").is_file()
        assert not (build / "python" / "fmha" / "libfmha.so").exists()
        assert not list(build.glob("python/fmha/_C*")) and not (build / "fmha_fwd").exists()
        parts.append(tus)
    assert parts[0] and parts[1] and not parts[0] & parts[1]
    assert parts[0] | parts[1] == selection


def test_shard_tus_compile_exactly_like_the_normal_build(build_dir, shard_dirs):
    normal = instance_compile_commands(build_dir)
    sharded = {}
    for build in shard_dirs:
        sharded.update(instance_compile_commands(build))
    assert len(normal) == TUS and sharded == normal


def test_final_library_links_every_instance_from_the_archives(final_dir):
    final, _ = final_dir
    # No instance TU compiled here: they come from the archives.
    commands = json.loads((final / "compile_commands.json").read_text())
    assert not [c for c in commands if Path(c["file"]).parent == final / "gen"
                and c["file"].endswith(".cu")]
    library = final / "python" / "fmha" / "libfmha.so"
    assert library.is_file() and not (final / "fmha_fwd").exists()
    table = (final / "gen" / "dispatch_table.cpp").read_text()
    launches = set(re.findall(r"&instances::(launch_\w+)", table))
    assert len(launches) == TUS
    symbols = subprocess.run(["nm", "-C", library], capture_output=True, text=True, check=True)
    defined = set(re.findall(r"^[0-9a-f]+ t fmha::detail::instances::(launch_\w+)\(",
                             symbols.stdout, re.M))
    assert defined == launches  # hidden in libfmha: local text symbols
    undefined = subprocess.run(["nm", "-u", library], capture_output=True, text=True, check=True)
    assert "launch_" not in undefined.stdout


def test_final_library_without_a_shard_fails_to_link(final_dir):
    _, missing = final_dir
    assert "undefined reference" in missing and "launch_fwd_bf16_d128" in missing


@pytest.mark.parametrize(("options", "message"), [
    (["-DFMHA_SHARD=0/2"], "FMHA_SHARD: expected K/N with 1 <= K <= N"),
    (["-DFMHA_SHARD=3/2"], "FMHA_SHARD: expected K/N with 1 <= K <= N"),
    (["-DFMHA_SHARD=1of2"], "FMHA_SHARD: expected K/N with 1 <= K <= N"),
    (["-DFMHA_SHARD=1/2", "-DFMHA_SHARD_ARCHIVES=/a.a"], "exclude each other"),
    (["-DFMHA_SHARD_ARCHIVES=libfmha_shard_1_of_2.a"], "is not an absolute path"),
    (["-DFMHA_SHARD_ARCHIVES=/nonexistent/libfmha_shard_1_of_2.a"], "no such file"),
])
def test_bad_shard_options_fail_configure(tmp_path, options, message):
    result = configure(tmp_path, "-DFMHA_BUILD_PYTHON=OFF", *options)
    assert result.returncode != 0
    assert message in " ".join(result.stderr.split())
