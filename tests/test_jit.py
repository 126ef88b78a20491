"""Compile on demand (fmha.jit) on the host: an instance the build lacks compiled into the cache
by the program libfmha runs on a miss (without torch), loaded at the dispatcher's place for
it, found again without compiling, compiled once by processes that race for it, compiled again
when the cached object is broken, and not at all with FMHA_JIT=0. No GPU: select() takes a named capability. The GPU's side (a call that misses
compiles, runs and matches the reference) is tests/test_misses_gpu.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

fmha = pytest.importorskip("fmha")
jit = pytest.importorskip("fmha.jit")

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from exported_symbols import nm_available, runtime_exports  # noqa: E402
pytestmark = pytest.mark.skipif(not jit.compiler_available(),
                                reason="compile on demand needs a CUDA compiler")

# A forward instance in no preset a CI or default build makes (soft-capping), fa2 for sm80: a
# few seconds to compile.
FILTER = ("fwd,dtype=fp16,hdim_q=64,hdim_v=64,mask=causal,bias=none,vlayout=row,mode=batch,"
          "softcap,!dropout,lse=false")
NAME = "fwd_fp16_d64_causal_softcap_fa2_sm80_m128n64"


def run_python(code: str, cache: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "FMHA_CACHE_DIR": str(cache), "FMHA_JIT": "1",
                               **env})


SELECT = """
    import torch, fmha
    q = torch.empty(2, 512, 4, 64, dtype=torch.float16, device="meta")
    def chosen():
        try:
            return fmha.select(q, q, q, causal=True, softcap=30.0, capability=(8, 0))["name"]
        except fmha.MissingInstanceError:
            return "missing"
"""


def run_program(args: list, cache: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """fmha/jit.py run by its path, as libfmha runs it on a miss, where importing torch fails:
    the program needs none of it (nor fmha's extension)."""
    refusing = tmp_path / "no-torch"
    (refusing / "torch").mkdir(parents=True, exist_ok=True)
    (refusing / "torch" / "__init__.py").write_text(
        "raise ImportError('the compile program must not import torch')\n")
    path = os.pathsep.join(filter(None, [str(refusing), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, jit.__file__, *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "FMHA_CACHE_DIR": str(cache), "PYTHONPATH": path})


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache holding FILTER's object, compiled by the program as a miss runs it."""
    cache = tmp_path_factory.mktemp("fmha-cache")
    result = run_program(["--filter", FILTER, "--target", "sm80"], cache,
                         tmp_path_factory.mktemp("path"))
    assert result.returncode == 0, result.stderr
    assert f"fmha: compiling {NAME}" in result.stderr
    assert Path(result.stdout.strip()).parent == cache
    return cache


def test_a_compiled_instance_joins_the_dispatcher(cache):
    result = run_python(SELECT + f"""
    from fmha import jit
    print(chosen())
    library = jit.compile_filter({FILTER!r}, "sm80")
    print(jit.load(library), chosen())
    origins = {{i["name"]: i["origin"] for i in fmha.instances()}}
    print(origins[{NAME!r}] == str(library), set(origins.values()) <= {{None, str(library)}})
    """, cache)
    assert result.returncode == 0, result.stderr
    # With its padded sibling; fmha.instances() names the object each came from.
    assert result.stdout.split() == ["missing", "2", NAME, "True", "True"]
    assert "compiling" not in result.stderr  # the cache's object, found by its recipe


@pytest.mark.skipif(not nm_available(), reason="needs nm")
def test_a_compiled_object_keeps_its_runtimes_to_itself(cache):
    """As libfmha and fmha._C do (tests/exported_symbols.py says why): the object exports its
    table's function and no C++ or CUDA runtime symbol."""
    [library] = cache.glob("*.so")
    assert runtime_exports(library) == []


def test_racing_processes_compile_once(tmp_path):
    code = f"""
        from fmha import jit
        print(jit.compile_filter({FILTER!r}, "sm80"))
    """
    processes = [subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "FMHA_CACHE_DIR": str(tmp_path), "FMHA_JIT": "1"})
        for _ in range(8)]
    outputs = [p.communicate(timeout=600) for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs
    assert len({out.strip() for out, _ in outputs}) == 1
    assert sum(err.count("fmha: compiling ") for _, err in outputs) == 1
    assert not list(tmp_path.glob(".compile-*")) and not list(tmp_path.glob(".part-*"))


def test_a_broken_object_is_compiled_again(cache, tmp_path):
    broken = tmp_path / "cache"
    broken.mkdir()
    for path in cache.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    [library] = broken.glob("*.so")
    library.write_bytes(library.read_bytes()[:4096])  # a truncated object
    result = run_python(f"""
        from pathlib import Path
        from fmha import jit
        try:
            jit.load(Path({str(library)!r}))
        except jit.CompileError as err:
            print("refused:", err)
        print(Path({str(library)!r}).exists())
        print(jit.load(jit.compile_filter({FILTER!r}, "sm80")))
    """, broken)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"refused: fmha: {library} is damaged")
    assert lines[1:] == ["False", "2"]
    assert "fmha: compiling" in result.stderr
    # compile_filter checks what the cache holds as load does: a damaged object compiles again.
    library.write_bytes(library.read_bytes()[:4096])
    result = run_python(f"""
        from fmha import jit
        print(jit.load(jit.compile_filter({FILTER!r}, "sm80")))
    """, broken)
    assert result.stdout.split() == ["2"] and "fmha: compiling" in result.stderr


def test_fmha_jit_0_turns_it_off(cache):
    result = run_python("from fmha import jit; print(jit.enabled())", cache, FMHA_JIT="0")
    assert result.stdout.strip() == "False"


def test_an_unknown_recipe_is_a_generator_error(tmp_path):
    result = run_python("""
        from fmha import jit
        try:
            jit.compile_filter("fwd,hdim4096", "sm80")
        except Exception as err:
            print(type(err).__name__, err)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Error" in result.stdout and "hdim4096" in result.stdout
    assert not list(tmp_path.glob("*.so"))


def test_the_program_says_when_there_is_nothing_to_compile(tmp_path):
    """A recipe no instance of the matrix fits: the exit status that keeps the library's plain
    miss, and why on stdout."""
    result = run_program(["--filter", "fwd,hdim4096", "--target", "sm80"], tmp_path / "cache",
                         tmp_path)
    assert result.returncode == jit.NOTHING_TO_COMPILE, result.stderr
    assert "nothing in the matrix" in result.stdout and "hdim4096" in result.stdout
    assert not list((tmp_path / "cache").glob("*.so"))


# sm90a's e4m3 d128 tile has 128 keys (instances.yaml), sm80's the 16-bit cache's 64.
@pytest.mark.parametrize("cc, target, tile", [(90, "sm90a", "m16n128"), (80, "sm80", "m16n64")])
def test_an_e4m3_cache_miss_compiles_its_own_instance(cc, target, tile):
    """The recipe of a miss on an FP8 (e4m3) cache names its kv_dtype, so compile on demand
    builds the e4m3 decode instance, not the queries' dtype's (nothing is compiled here)."""
    import torch
    from fmha import _C, _kvcache
    cache = torch.empty(2, 256, 2, 128, dtype=torch.float8_e4m3fn)
    q = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16)
    args = _kvcache._described(q, cache, cache, None, None, torch.zeros(2, dtype=torch.int32),
                               dict(k_scale=torch.ones(2), v_scale=torch.ones(2), causal=True,
                                    block_table=torch.zeros(2, 16, dtype=torch.int32)), cc=cc)
    filter_text, recipe_target = _C.instance_recipe(args, cc)
    assert recipe_target == target
    assert "kv_dtype=e4m3" in filter_text.split(",")
    # On sm90a the chunked-prefill instance comes along: the recipe does not say how many query
    # tokens the call had, and the decode instance serves every call.
    prefill = ([f"kvcache_bf16_kve4m3_d128_causal_paged_fa3_{target}_m128n128_pad"]
               if target == "sm90a" else [])
    assert [i.name for i in jit._selection(filter_text, target).instances] == prefill + [
        f"kvcache_bf16_kve4m3_d128_causal_paged_fa2_{target}_{tile}_pad"]
