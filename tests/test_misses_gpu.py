"""Calls that once killed the process on a build without their instances: each runs
in a process of its own, so that a crash fails its case (with the signal) instead of ending the
test run, and must end with a result or a MissingInstanceError that names the filter to build.

The probes are those of the report (bf16, head dim 256 or 128 with a trait the default preset
leaves out: soft-capping, a sliding window, ALiBi, dropout), through select, explain, fwd (with
and without tensors that need grad, the backward included), and fwd_kvcache. On a build that
has the instance the call runs and returns; on the default build (`pip install .`) it misses.
"""

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
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (
        f"{probe}: the process ended with {done.returncode} "
        f"({'signal ' + str(-done.returncode) if done.returncode < 0 else 'an exception'}):\n"
        f"{done.stderr[-2000:]}")
    outcome = done.stdout[done.stdout.index("OUTCOME"):]
    if outcome.startswith("OUTCOME miss"):
        assert "FMHA_FILTER='" in outcome and "Nearest compiled:" in outcome, outcome
    else:
        assert outcome.startswith("OUTCOME result"), outcome
