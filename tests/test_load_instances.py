"""Instances loaded at run time (fmha::load_instances, compile on demand's last step): a shared
object rendered with `python -m generator --loadable` joins the dispatcher at the place the
generator's order of preference gives each of its instances, and anything else is refused with
a message. No GPU needed: loading and ordering are host work, and select() takes a named
capability. Each case runs in a process of its own, as a load lasts for the process's life.

The ordering cases compile the loadable table of hundreds of instances against stub launch
functions (host code, seconds); one case compiles a real fa2 instance with nvcc."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc to compile a shared object")
fmha = pytest.importorskip("fmha")

from conftest import repository  # noqa: E402
from generator.dispatch import dispatch_order  # noqa: E402


def render_loadable(out: Path, filter_: str, targets: str) -> list[dict]:
    subprocess.run([sys.executable, "-m", "generator", "--loadable", "--preset", "all",
                    "--filter", filter_, "--targets", targets, "--out", str(out), "-q"],
                   cwd=REPO_ROOT, check=True)
    return json.loads((out / "manifest.json").read_text())["instances"]


def compile_shared(out: Path, sources: list[Path], *flags: str) -> Path:
    library = out / "instances.so"
    subprocess.run([NVCC, "-std=c++17", "-shared", "-Xcompiler=-fPIC",
                    f"-I{REPO_ROOT / 'runtime' / 'include'}", *flags, "-o", str(library),
                    *map(str, sources)], check=True, capture_output=True)
    return library


def stub_launchers(out: Path) -> Path:
    """A TU that defines every function loadable_table.cpp declares, each failing if called."""
    table = (out / "loadable_table.cpp").read_text()
    start = table.index("namespace fmha::detail::instances {")
    declarations = table[start:table.index("}  // namespace fmha::detail::instances")]
    bodies = []
    for line in declarations.splitlines()[1:]:
        line = line.strip()
        if not line:
            continue
        returns = "cudaErrorNotSupported" if line.startswith("cudaError_t") else "0"
        bodies.append(line.rstrip(";") + " { return " + returns + "; }")
    stub = out / "stubs.cpp"
    stub.write_text('#include "fmha/registry.h"\nnamespace fmha::detail::instances {\n'
                    + "\n".join(bodies) + "\n}\n")
    return stub


def in_process(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_loaded_instances_take_the_generators_order(tmp_path):
    """Hundreds of instances of every operation, loaded into a build that holds a few: the
    merged tables list them in the order the generator gives the union."""
    loaded = render_loadable(tmp_path, "hdim64|hdim128,!dropout", "80;90a")
    assert len(loaded) > 300
    library = compile_shared(tmp_path, [tmp_path / "loadable_table.cpp",
                                        stub_launchers(tmp_path)])
    names = json.loads(in_process(f"""
        import json, fmha
        from fmha import _C
        built = {{"fwd": fmha.instances(), "bwd": fmha.bwd_instances(),
                  "kvcache": fmha.kvcache_instances()}}
        code, message, added = _C.load_instances({str(library)!r})
        assert code == 0, message
        again = _C.load_instances({str(library)!r})
        merged = {{"fwd": fmha.instances(), "bwd": fmha.bwd_instances(),
                   "kvcache": fmha.kvcache_instances()}}
        print(json.dumps({{"added": added, "again": again[2],
                          "built": {{op: [i["name"] for i in rows] for op, rows in built.items()}},
                          "merged": {{op: [i["name"] for i in rows]
                                     for op, rows in merged.items()}}}}))
    """))
    built = {name for rows in names["built"].values() for name in rows}
    assert names["added"] == len({i["name"] for i in loaded} - built)
    assert names["again"] == 0  # a second load adds nothing
    by_name = {instance.name: instance for instance in repository().catalog.instances}
    for op, merged in names["merged"].items():
        expected = [i.name for i in dispatch_order(by_name[name] for name in set(merged))]
        assert merged == expected, op
        assert set(merged) == set(names["built"][op]) | {
            i["name"] for i in loaded if i["name"].startswith(op + "_")}


def test_a_loaded_instance_serves_the_calls_it_fits(tmp_path):
    """A real kernel compiled on its own: select() runs it for the problem it fits, and the
    built-in instances keep the problems they served."""
    loaded = render_loadable(  # soft-capping: in no preset a CI or default build makes
        tmp_path, "fwd,fp16,hdim64,causal,mode=batch,!lse,bias=none,vlayout=row,!dropout,"
                  "softcap,!hpad,!pad", "80")
    [instance] = loaded
    library = compile_shared(tmp_path, sorted(tmp_path.glob("*.cu")) + [
        tmp_path / "loadable_table.cpp"], "--expt-relaxed-constexpr",
        "-gencode=arch=compute_80,code=sm_80")
    out = in_process(f"""
        import torch, fmha
        from fmha import _C
        q = torch.empty(2, 512, 4, 64, dtype=torch.float16, device="meta")
        def chosen(**options):
            try:
                return fmha.select(q, q, q, causal=True, capability=(8, 0), **options)["name"]
            except fmha.MissingInstanceError:
                return "missing"
        print(chosen(softcap=30.0), chosen())
        print(_C.load_instances({str(library)!r}))
        print(chosen(softcap=30.0), chosen())
    """).splitlines()
    before, plain = out[0].split()
    assert before == "missing"
    assert out[1] == "(0, '', 1)"
    assert out[2].split() == [instance["name"], plain]


@pytest.mark.parametrize("kind", ["missing", "not_elf", "no_table", "other_abi"])
def test_load_refuses_what_is_no_loadable_table(tmp_path, kind):
    if kind == "missing":
        path = tmp_path / "absent.so"
    elif kind == "not_elf":
        path = tmp_path / "text.so"
        path.write_text("not a shared object\n" * 20)
    else:
        source = tmp_path / "other.cpp"
        abi = "fmha::detail::kRegistryAbi + 1" if kind == "other_abi" else None
        source.write_text('#include "fmha/registry.h"\n' + (
            "static const fmha::detail::LoadableInstances table = {" + abi +
            ", nullptr, 0, nullptr, 0, nullptr, 0};\n"
            'extern "C" __attribute__((visibility("default")))\n'
            "const fmha::detail::LoadableInstances* fmha_loadable_instances() "
            "{ return &table; }\n" if abi else "int unrelated() { return 1; }\n"))
        path = compile_shared(tmp_path, [source])
    out = in_process(f"""
        import fmha
        from fmha import _C
        before = [i["name"] for i in fmha.instances()]
        print(_C.load_instances({str(path)!r}))
        assert [i["name"] for i in fmha.instances()] == before
    """)
    code, message, added = eval(out)
    assert (code, added) == (fmha._C.STATUS_INVALID_ARGUMENT, 0)
    assert message.startswith(f"fmha::load_instances({path}): ")
    expected = {"missing": "No such file", "not_elf": "invalid ELF header",
                "no_table": "not a shared object of fmha instances",
                "other_abi": "compile it again"}[kind]
    assert expected in message
