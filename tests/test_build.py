"""CMake configure + nvcc build of a small filtered subset, for both sm80 and sm90a.

Needs nvcc and cmake, not a GPU: the kernels, the dispatcher and the example compile and link,
each instance TU gets exactly its arch's -gencode, and the library's dispatch table holds the
filtered instances.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# With the default preset (lse, no bias, no dropout, no softcap, row-major V): one batch-mode
# kernel per arch, unpadded and fully padded.
FILTER = "fp16,hdim64,mask=none,mode=batch"

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("cmake") is None or shutil.which("ninja") is None,
    reason="needs nvcc, cmake and ninja",
)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    build = tmp_path_factory.mktemp("cmake")
    configure = subprocess.run(
        ["cmake", "-S", REPO, "-B", build, "-G", "Ninja", f"-DFMHA_FILTER={FILTER}",
         "-DFMHA_ARCHS=80;90a", "-DFMHA_BUILD_PYTHON=OFF", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
         f"-DPython3_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    assert "generator: 4 of 10080 instances selected" in configure.stdout
    compile_ = subprocess.run(["cmake", "--build", build], capture_output=True, text=True)
    assert compile_.returncode == 0, compile_.stdout + compile_.stderr
    return build


def test_each_instance_tu_compiles_for_its_own_arch(build_dir):
    commands = json.loads((build_dir / "compile_commands.json").read_text())
    # The generated instance TUs (runtime/src has .cu files of its own).
    tus = {Path(c["file"]).name: c["command"] for c in commands
           if Path(c["file"]).parent == build_dir / "gen" and c["file"].endswith(".cu")}
    assert len(tus) == 4
    for name, command in tus.items():
        if "_sm90a_" in name:
            assert "-gencode=arch=compute_90a,code=sm_90a" in command
            assert "compute_80" not in command
        else:
            assert "-gencode=arch=compute_80,code=[sm_80,compute_80]" in command
            assert "compute_90a" not in command


def test_library_and_example_link(build_dir):
    assert (build_dir / "python" / "fmha" / "libfmha.so").is_file()
    assert (build_dir / "fmha_fwd").is_file()
    manifest = json.loads((build_dir / "gen" / "manifest.json").read_text())
    names = {i["name"] for i in manifest["instances"]}
    table = (build_dir / "gen" / "dispatch_table.cpp").read_text()
    assert names and all(f'"{n}"' in table for n in names)


def test_bad_filter_fails_configure_with_the_generator_message(tmp_path):
    result = subprocess.run(
        ["cmake", "-S", REPO, "-B", tmp_path, "-G", "Ninja", "-DFMHA_FILTER=fp16,hdim80",
         "-DFMHA_BUILD_PYTHON=OFF", f"-DPython3_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True)
    assert result.returncode != 0
    assert "hdim80" in result.stderr and "python -m generator failed" in result.stderr
