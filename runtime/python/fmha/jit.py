"""Compile on demand: the instances a call needs and the build lacks, compiled when it misses.

A call of fmha::fwd, bwd or fwd_kvcache (or a workspace query of the latter two) that no
compiled instance runs asks the dispatcher what would build one (fmha::instance_recipe: a
generator filter and the device's target) and, with compile on demand on (FMHA_JIT, default
on), runs this module as a program with that recipe (runtime/src/compile_on_demand.cpp): it
renders those instances with the generator and templates the build used (`python -m generator
--loadable`), keeping the newest pipeline's (the ones a full build would run), compiles them
with the build's compiler and options into one shared object in the cache and prints its path;
the library loads it (fmha::load_instances: each instance joins the dispatcher where a full
build would have put it, so it never shadows a better built-in one) and dispatches the call
again. So Python calls and C++ programs compile alike. FMHA_JIT=0 turns it off: a miss raises
MissingInstanceError, as without a compiler. A call whose stream captures a CUDA graph never
compiles; its miss says how to fill the cache first.

The cache (FMHA_CACHE_DIR, default $XDG_CACHE_HOME/fmha or ~/.cache/fmha) keeps one object per
set of rendered sources, keyed by everything that changes the binary: the rendered TUs, the
headers they include (the kernels' and CUTLASS's), the compiler's version and options. It also
keeps the generator's catalog of the build's matrix (generator/catalog_cache.py). A
compile holds lock files, so concurrent threads and processes compile a key once (those that
miss the same recipe wait for the first and take its object, without the generator); it writes
beside the final name and renames into place, so a half-written object is never loaded, and an
object whose bytes lost their digest is compiled again. `python -m fmha.jit --filter ...` fills
the cache ahead of time (compile_filter).

Run as a program it needs only the standard library, jinja2 and pyyaml (no torch, no fmha
import): the library runs it by its path.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

# Not resolved: in a development tree the module is a link into the checkout, the config beside it.
_PACKAGE_DIR = Path(os.path.abspath(__file__)).parent
_CONFIG_FILE = _PACKAGE_DIR / "_jit_config.json"
# One compile at a time per process (the lock file serializes processes).
_PROCESS_LOCK = threading.Lock()
# The program's exit status when there is nothing it can compile here (no CUDA compiler, a
# build without the sources, no instance in the matrix): the library keeps the plain miss.
# runtime/src/compile_on_demand.cpp reads it.
NOTHING_TO_COMPILE = 3


class CompileError(RuntimeError):
    """Compiling an instance on demand failed; the message holds the compiler's."""


@functools.cache
def build_config() -> Optional[dict]:
    """The build's compiler, options and sources (CMakeLists.txt writes them), paths resolved;
    None for a build without them."""
    try:
        config = json.loads(_CONFIG_FILE.read_text())
    except (OSError, ValueError):
        return None
    for key in ("generator_root", "config", "include", "cutlass_include"):
        if config[key]:
            config[key] = str((_PACKAGE_DIR / config[key]).resolve())
    return config


def _compiler() -> Optional[str]:
    config = build_config()
    if config is None:
        return None
    return shutil.which(config["nvcc"]) or shutil.which("nvcc")


def compiler_available() -> bool:
    """Whether the build's CUDA compiler (or an nvcc on PATH) is there to compile with."""
    return _compiler() is not None


def enabled() -> bool:
    """Whether a miss compiles: FMHA_JIT is not 0, and a compiler is available (the library
    asks this program, which answers NOTHING_TO_COMPILE without one)."""
    return os.environ.get("FMHA_JIT", "1") != "0" and compiler_available()


def cache_dir() -> Path:
    if os.environ.get("FMHA_CACHE_DIR"):
        return Path(os.environ["FMHA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fmha"


@functools.cache
def _generator():
    """The generator package the build used, imported as _fmha_generator (not `generator`,
    which may be another package on the user's path; a top-level name, as the program imports
    no fmha package to hang it from)."""
    root = Path(build_config()["generator_root"]) / "generator"
    spec = importlib.util.spec_from_file_location(
        "_fmha_generator", root / "__init__.py", submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["_fmha_generator"] = module
    spec.loader.exec_module(module)
    for name in ("catalog_cache", "config", "errors", "operations", "render", "selection", "schema"):
        importlib.import_module(f"_fmha_generator.{name}")
    return module


@functools.cache
def _catalog():
    """The build's matrix: its config, catalog and presets' checked filters (seconds to
    build: kept for the process, and in the cache for the processes after it)."""
    gen = _generator()
    config = gen.config.load(Path(build_config()["config"]))
    return (config, *gen.catalog_cache.checked_catalog(config, cache_dir()))


def _tree_digest(roots) -> str:
    digest = hashlib.sha256()
    for root in roots:
        root = Path(root)
        paths = sorted(root.rglob("*")) if root.is_dir() else [root]
        for path in paths:
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root) if root.is_dir() else path.name).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _headers_digest() -> str:
    """A digest of every header an instance TU may include: the kernels' and CUTLASS's."""
    config = build_config()
    return _tree_digest(filter(None, (config["include"], config["cutlass_include"])))


@functools.cache
def _build_digest() -> str:
    """A digest of everything but the recipe that decides what a recipe compiles to: the
    generator, its templates and instances.yaml, the headers, the compiler and its options."""
    config = build_config()
    root = Path(config["generator_root"])
    return hashlib.sha256(json.dumps([
        _tree_digest([root / "generator", root / "templates", config["config"]]),
        _headers_digest(), config["cuda_version"], config["options"], config["link_options"],
    ]).encode()).hexdigest()


def _selection(filter_text: str, target: str):
    """The instances compile on demand builds for a recipe: those the filter selects for the
    target from the whole matrix, of the newest pipeline among them (the ones a full build
    would run first; the older pipelines' would never run), and where that pipeline's kernel
    takes only calls of many query tokens (kvcache's chunked prefill), the decode kernel's
    too: a recipe does not say how many query tokens the call had, and a decode step that
    missed is served by the decode kernel only."""
    gen = _generator()
    config, catalog, presets = _catalog()
    selection = gen.selection.select(config, catalog, "all", filter_text,
                                     gen.selection.parse_targets(target), presets)
    first = selection.instances[0]
    best = first.point.pipeline
    prefill_only = gen.operations.operation_of(first).kernel(best).prefill
    kept = tuple(i for i in selection.instances if i.point.pipeline == best or (
        prefill_only and not gen.operations.operation_of(i).kernel(i.point.pipeline).prefill))
    return gen.selection.Selection(kept, selection.targets, selection.gaps, selection.head_dims)


def _key(files: dict, target: str) -> str:
    """What decides the binary: the rendered sources, the target and the build (_build_digest)."""
    digest = hashlib.sha256(json.dumps([_build_digest(), target]).encode())
    for name in sorted(files):
        digest.update(name.encode())
        digest.update(files[name].encode())
    return digest.hexdigest()


def compile_filter(filter_text: str, target: str, quiet: bool = False) -> Path:
    """The shared object of the instances `filter_text` selects for `target` (e.g. "sm90a"),
    compiled into the cache unless it is there already; its path."""
    if _compiler() is None:
        raise CompileError("fmha: compile on demand needs the CUDA compiler this build was made "
                           "with, or nvcc on PATH; neither is there")
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    # A recipe seen before names its object without the generator (whose whole-matrix
    # selection takes seconds): one small file per recipe and build.
    recipe = cache / (hashlib.sha256(json.dumps([filter_text, target, _build_digest()])
                                     .encode()).hexdigest()[:24] + ".recipe")
    library = _recorded(recipe)
    if library is not None:
        return library
    # Processes missing the same instance at once (the ranks of one job) wait here for the
    # first, then find its object through the recipe: one of them runs the generator.
    with _PROCESS_LOCK, open(recipe.with_suffix(".lock"), "w") as recipe_lock:
        fcntl.flock(recipe_lock, fcntl.LOCK_EX)
        library = _recorded(recipe)
        if library is not None:
            return library
        selection = _selection(filter_text, target)
        files = _generator().render.render_loadable(selection, source="instances.yaml")
        key = _key(files, target)
        library = cache / f"{selection.instances[0].name}-{key[:16]}.so"
        # Another recipe may select the same instances: their object has a lock of its own.
        with open(cache / f"{key[:16]}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _intact(library):
                library.unlink(missing_ok=True)
                _compile(files, selection, target, library, quiet)
        _write_atomically(recipe, library.name)
    return library


def _recorded(recipe: Path) -> Optional[Path]:
    """The intact object a recipe file names, or None."""
    try:
        library = recipe.parent / recipe.read_text().strip()
    except OSError:
        return None
    return library if _intact(library) else None


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _intact(library: Path) -> bool:
    """Whether `library` is there whole: its bytes have the digest written when it was
    compiled. dlopen of a truncated object can kill the process (SIGBUS), so nothing is loaded
    unchecked."""
    try:
        expected = _digest_file(library).read_text().strip()
        return hashlib.sha256(library.read_bytes()).hexdigest() == expected
    except OSError:
        return False


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                     prefix=".part-") as f:
        f.write(text)
    os.replace(f.name, path)


def _compile(files: dict, selection, target: str, library: Path, quiet: bool) -> None:
    config = build_config()
    arch = next(a for a in selection.targets if a.token == target)
    uses_cutlass = any(_generator().render._kernel(i).uses_cutlass for i in selection.instances)
    if uses_cutlass and not config["cutlass_include"]:
        raise CompileError(f"fmha: {selection.instances[0].name} needs the CUTLASS/CuTe headers, "
                           "and this build found none (build with an fa3 instance, or set "
                           "FMHA_CUTLASS_INCLUDE_DIR when building)")
    nvcc = _compiler()
    includes = [f"-I{config['include']}"]
    if config["cutlass_include"]:
        includes += ["-isystem", config["cutlass_include"]]
    host = [f"-ccbin={config['host_compiler']}"] if config["host_compiler"] else []
    names = [i.name for i in selection.instances]
    begin = time.monotonic()
    if not quiet:
        print(f"fmha: compiling {', '.join(names)} for {target} on first use (fa3 instances "
              f"take 30-60 s, fa2 ones 5-20 s) into {library.parent}", file=sys.stderr,
              flush=True)
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=".compile-") as work:
        work = Path(work)
        for name, text in files.items():
            (work / name).write_text(text)
        sources = sorted(work.glob("*.cu")) + [work / "loadable_table.cpp"]

        def compile_one(source: Path) -> Path:
            obj = source.with_suffix(".o")
            gencode = [arch.gencode] if source.suffix == ".cu" else []
            _run([nvcc, *host, *config["options"], *gencode, *includes, "-c", str(source),
                  "-o", str(obj)])
            return obj

        workers = max(1, min(len(sources), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            objects = list(pool.map(compile_one, sources))
        partial = work / "instances.so"
        _run([nvcc, *host, *config["link_options"], *map(str, objects), "-o", str(partial)])
        # The digest first, then the object, each renamed into place whole: a reader sees no
        # object, or one it can check.
        _write_atomically(_digest_file(library), hashlib.sha256(partial.read_bytes()).hexdigest())
        os.replace(partial, library)
    if not quiet:
        print(f"fmha: compiled {library.name} in {time.monotonic() - begin:.0f} s",
              file=sys.stderr, flush=True)


def _run(command: list) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"fmha: compiling on demand failed ({command[0]} exited "
                           f"{result.returncode}):\n{result.stderr.strip()}")


def load(library: Path) -> int:
    """Loads a compiled object into the dispatcher; the instances it added. An object that is
    damaged or fails to load (made by another build) is removed, so the next compile replaces
    it."""
    if not _intact(library):
        library.unlink(missing_ok=True)
        raise CompileError(f"fmha: {library} is damaged (its bytes do not have the digest "
                           "written when it was compiled); removed, it compiles again")
    from fmha import _C  # noqa: PLC0415 (the program, which only compiles, imports no fmha)
    code, message, added = _C.load_instances(str(library))
    if code != _C.STATUS_OK:
        library.unlink(missing_ok=True)
        raise CompileError(message)
    return added


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fmha.jit",
        description="Compile instances into fmha's cache ahead of their first call, as a miss "
                    "would: the generator's --filter (with the `all` preset), for a target. "
                    "Prints the shared object's path. Exit status 3: nothing to compile here "
                    "(no CUDA compiler, or no instance of the matrix fits); stdout says why.")
    parser.add_argument("--filter", required=True, help="e.g. 'fwd,bf16,hdim256,causal'")
    parser.add_argument("--target", required=True, help="sm80 or sm90a")
    args = parser.parse_args(argv)
    if build_config() is None or _compiler() is None:
        print("fmha: compile on demand needs the CUDA compiler this build was made with, or "
              "nvcc on PATH, and the build's sources (_jit_config.json); they are not there")
        return NOTHING_TO_COMPILE
    try:
        print(compile_filter(args.filter, args.target))
    except _generator().errors.GeneratorError as error:
        print(f"fmha: nothing in the matrix to compile for this call: {error}")
        return NOTHING_TO_COMPILE
    except CompileError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
