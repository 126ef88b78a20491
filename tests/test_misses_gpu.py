"""Calls that once killed the process on a build without their instances: each runs
in a process of its own, so that a crash fails its case (with the signal) instead of ending the
test run, and must end with a result or a MissingInstanceError that names the filter to build.

The probes are those of the report (bf16, head dim 256 or 128 with a trait the default preset
leaves out: soft-capping, a sliding window, ALiBi, dropout), through select, explain, fwd (with
and without tensors that need grad, the backward included), and fwd_kvcache. On a build that
has the instance the call runs and returns; on the default build (`pip install .`) it misses.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import import_fmha  # noqa: E402

torch, fmha = import_fmha()

SETUP = """
import torch, fmha
def t(*shape, grad=False):
    return torch.randn(*shape, dtype=torch.bfloat16, device="cuda").requires_grad_(grad)
q256 = t(2, 500, 4, 256)
q128 = t(2, 500, 4, 128)
"""
PROBES = {
    "select d256": "fmha.select(q256, q256, q256)",
    "explain d256": "print(fmha.explain(q256, q256, q256))",
    "fwd d256": "fmha.fwd(q256, q256, q256)",
    "fwd+bwd d256": "q = t(2, 500, 4, 256, grad=True); fmha.fwd(q, q, q).sum().backward()",
    "fwd d128 softcap": "fmha.fwd(q128, q128, q128, softcap=30.0)",
    "fwd d128 window": "fmha.fwd(q128, q128, q128, window_size=(64, 0))",
    "fwd d128 alibi": "fmha.fwd(q128, q128, q128, alibi_slopes=torch.ones(4, device='cuda'))",
    "fwd d128 dropout": "fmha.fwd(q128, q128, q128, dropout_p=0.1)",
    "fwd+bwd d128 softcap": ("q = t(2, 500, 4, 128, grad=True); "
                             "fmha.fwd(q, q, q, causal=True, softcap=30.0).sum().backward()"),
    "fwd_kvcache d256": ("fmha.fwd_kvcache(t(2, 1, 8, 256), t(2, 512, 2, 256), t(2, 512, 2, 256), "
                         "cache_seqlens=torch.full((2,), 300, dtype=torch.int32, device='cuda'))"),
    "fwd_kvcache d128 softcap": (
        "fmha.fwd_kvcache(t(2, 1, 8, 128), t(2, 512, 2, 128), t(2, 512, 2, 128), softcap=30.0, "
        "cache_seqlens=torch.full((2,), 300, dtype=torch.int32, device='cuda'))"),
}
EPILOGUE = """
try:
    {call}
    torch.cuda.synchronize()
    print("OUTCOME result")
except fmha.MissingInstanceError as miss:
    print("OUTCOME miss", miss)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("probe", PROBES)
def test_a_call_outside_the_build_raises_or_runs(probe):
    script = SETUP + EPILOGUE.format(call=PROBES[probe])
    # The miss itself, not compile on demand (test_a_miss_compiles_on_demand below).
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "FMHA_JIT": "0"})
    assert done.returncode == 0, (
        f"{probe}: the process ended with {done.returncode} "
        f"({'signal ' + str(-done.returncode) if done.returncode < 0 else 'an exception'}):\n"
        f"{done.stderr[-2000:]}")
    outcome = done.stdout[done.stdout.index("OUTCOME"):]
    if outcome.startswith("OUTCOME miss"):
        assert "FMHA_FILTER='" in outcome and "Nearest compiled:" in outcome, outcome
    else:
        assert outcome.startswith("OUTCOME result"), outcome


JIT_SCRIPT = """
import sys, torch, fmha
sys.path.insert(0, {tests!r})
from reference import attention_reference
torch.manual_seed(0)
q, k, v = (torch.randn(2, 500, 4, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
           for _ in range(3))
dout = torch.randn(2, 500, 4, 128, dtype=torch.bfloat16, device="cuda")
out = fmha.fwd(q, k, v, causal=True, softcap=30.0)
out.backward(dout)
leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
ref, _ = attention_reference(*leaves, causal=True, softcap=30.0)
ref.backward(dout.double())
errors = [((a.double() - b).abs().max() / b.abs().max()).item()
          for a, b in ((out, ref), *((t.grad, l.grad) for t, l in zip((q, k, v), leaves)))]
print("ERRORS", *errors)
print("INSTANCES", fmha.select(q, k, v, causal=True, softcap=30.0)["name"],
      fmha.select_bwd(q, k, v, causal=True, softcap=30.0)["name"])
"""


@pytest.mark.gpu
def test_a_miss_compiles_on_demand(tmp_path):
    """A causal soft-capped d128 call (in no default build): its first call compiles the
    forward and the backward instances into an empty cache, runs them, and matches the float64
    reference; a second process finds them in the cache and compiles nothing."""
    from fmha import jit
    if not jit.compiler_available():
        pytest.skip("compile on demand needs a CUDA compiler")
    script = JIT_SCRIPT.format(tests=str(Path(__file__).resolve().parent))
    env = {**os.environ, "FMHA_CACHE_DIR": str(tmp_path), "FMHA_JIT": "1"}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=900, env=env) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    first, again = runs
    # The forward with the log-sum-exp (a training call keeps it), then the backward.
    assert "fmha: compiling fwd_bf16_d128_causal_lse_softcap" in first.stderr
    assert "fmha: compiling bwd_bf16_d128_causal_softcap" in first.stderr
    assert "fmha: compiling" not in again.stderr
    for done in runs:
        errors = [float(x) for x in done.stdout.split("ERRORS")[1].split()[:4]]
        assert max(errors) < 2e-2, errors
        names = done.stdout.split("INSTANCES")[1].split()
        assert all("softcap" in name for name in names), names



@pytest.mark.gpu
def test_a_miss_inside_a_graph_capture_raises_before_compiling(tmp_path):
    """Compiling and loading kernels have no place in a CUDA-graph capture: the miss says how
    to have the instance before capturing, and nothing was compiled."""
    from fmha import jit
    if not jit.compiler_available():
        pytest.skip("compile on demand needs a CUDA compiler")
    q = torch.empty(2, 500, 4, 128, dtype=torch.bfloat16, device="cuda")
    try:
        fmha.select(q, q, q, softcap=30.0)
        pytest.skip("this build holds a soft-capped d128 instance: nothing misses")
    except fmha.MissingInstanceError:
        pass
    script = SETUP + """
graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph):
        fmha.fwd(q128, q128, q128, softcap=30.0)
    print("OUTCOME captured")
except fmha.MissingInstanceError as miss:
    print("OUTCOME miss", miss)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "FMHA_CACHE_DIR": str(tmp_path),
                                            "FMHA_JIT": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = done.stdout[done.stdout.index("OUTCOME"):]
    assert outcome.startswith("OUTCOME miss") and "CUDA-graph capture" in outcome, outcome
    assert "python -m fmha.jit --filter" in outcome
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.gpu
def test_a_cpp_programs_miss_compiles_on_demand(tmp_path):
    """The C++ API compiles on demand as Python calls do (the same code, libfmha's): a program
    linked against the package's libfmha calls fmha::fwd with soft-capping (in no default
    build); the call compiles its instance with the Python the build was configured with (no
    FMHA_PYTHON), runs it and matches float64; run again, it finds the instance in the cache."""
    from fmha import jit
    if not jit.compiler_available():
        pytest.skip("compile on demand needs a CUDA compiler")
    q = torch.empty(1, 200, 2, 128, dtype=torch.bfloat16, device="cuda")
    try:
        fmha.select(q, q, q, causal=True, softcap=30.0)
        pytest.skip("this build holds a soft-capped d128 instance: nothing misses")
    except fmha.MissingInstanceError:
        pass
    package = Path(fmha.__file__).parent
    config = jit.build_config()
    program = tmp_path / "compile_on_demand"
    built = subprocess.run(
        [shutil.which(config["nvcc"]) or "nvcc", "-std=c++17", "-O2",
         str(Path(__file__).resolve().parent / "cpp" / "compile_on_demand.cpp"),
         f"-I{config['include']}", f"-L{package}", "-lfmha", f"-Xlinker=-rpath,{package}",
         "-o", str(program)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    env = {name: value for name, value in os.environ.items() if name != "FMHA_PYTHON"}
    env.update(FMHA_CACHE_DIR=str(tmp_path / "cache"), FMHA_JIT="1")
    runs = [subprocess.run([str(program), "30"], capture_output=True, text=True, timeout=900,
                           env=env) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
        instance = done.stdout.split("INSTANCE")[1].split()[0]
        error = float(done.stdout.split("ERROR")[1].split()[0])
        assert "softcap" in instance and error < 2e-2, done.stdout
    assert "fmha: compiling fwd_bf16_d128_causal_softcap" in runs[0].stderr
    assert "fmha: compiling" not in runs[1].stderr
