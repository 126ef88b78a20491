"""How long a call that the build lacks takes with compile on demand (fmha.jit), on a GPU.

    python scripts/jit_times.py            (FMHA_CACHE_DIR: a new temporary directory unless set)

Each case runs twice, each time in a process of its own on the same cache: the first call of
the first process misses, compiles its instances and loads them; the second process finds the
object in the cache. The time is the first call's, to the end of its kernels (the process's
`import fmha` apart, printed once); the error is against a float64 reference. Cases: a training
step the default build holds (what any first training call costs), a forward it lacks on fa2
(soft-capping) and on fa3 (fp16), and a training step whose forward and backward it lacks
(fp16 d64, fa3 on H100/H200). Prints a line per run, then a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

CASES = {
    # The first training call's own cost, on the default build's instances: no compile.
    "fwd+bwd built in (bf16)": "dtype=torch.bfloat16, kwargs=dict(causal=True), train=True",
    "fwd fa2 (softcap)": "dtype=torch.bfloat16, kwargs=dict(causal=True, softcap=30.0), train=False",
    "fwd fa3 (fp16)": "dtype=torch.float16, kwargs=dict(causal=True), train=False",
    "fwd+bwd fa3 (fp16, d64)": "dtype=torch.float16, kwargs=dict(causal=True), train=True, d=64",
}

CHILD = """
import time
t0 = time.perf_counter()
import torch
import fmha
import_s = time.perf_counter() - t0

def run(dtype, kwargs, train, d=128):
    q, k, v = (torch.randn(2, 1024, 8, d, device="cuda", dtype=dtype, requires_grad=train)
               for _ in range(3))
    start = time.perf_counter()
    out = fmha.fwd(q, k, v, **kwargs)
    if train:
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref = [t.detach().double().transpose(1, 2).requires_grad_(train) for t in (q, k, v)]
    scores = ref[0] @ ref[1].transpose(-1, -2) / d ** 0.5
    if kwargs.get("softcap"):
        scores = kwargs["softcap"] * torch.tanh(scores / kwargs["softcap"])
    keep = torch.ones(1024, 1024, device="cuda", dtype=torch.bool).tril()
    expected = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ ref[2]
    error = (out.double().transpose(1, 2) - expected).abs().max().item()
    if train:
        ref_grads = torch.autograd.grad(expected, ref, torch.ones_like(expected))
        error = max([error] + [(g.double().transpose(1, 2) - r).abs().max().item()
                               for g, r in zip(grads, ref_grads)])
    origin = fmha.select(q, k, v, **kwargs)["origin"]
    return {"seconds": seconds, "import_s": import_s, "max_error": error,
            "origin": None if origin is None else os.path.basename(origin)}

import json, os
print(json.dumps(run(%s)))
"""


def main() -> int:
    cache = os.environ.get("FMHA_CACHE_DIR") or tempfile.mkdtemp(prefix="fmha-jit-times-")
    env = {**os.environ, "FMHA_CACHE_DIR": cache, "FMHA_JIT": "1"}
    rows = []
    for name, arguments in CASES.items():
        for run in ("first process", "second process"):
            result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD % arguments)],
                                    capture_output=True, text=True, env=env, timeout=900)
            if result.returncode != 0:
                print(f"{name}, {run}: failed\n{result.stderr[-3000:]}", file=sys.stderr)
                return 1
            record = json.loads(result.stdout.strip().splitlines()[-1])
            compiled = [line for line in result.stderr.splitlines() if "compiling" in line]
            print(f"{name}, {run}: {record} {compiled}")
            rows.append((name, run, record))
    print(f"\ncache {cache}; import fmha took {rows[0][2]['import_s']:.1f} s")
    print(f"{'case':26} {'process':15} {'first call s':>12} {'max error':>10}  origin")
    for name, run, record in rows:
        print(f"{name:26} {run:15} {record['seconds']:12.2f} {record['max_error']:10.2e}  "
              f"{record['origin']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
