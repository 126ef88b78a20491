"""torch.compile(fullgraph=True) of fmha.fwd on a GPU: the compiled call traces fmha::fwd and
returns what the eager call returns, bitwise (perf notes v7: the eager path bypasses the op, the
compiled one runs it).

    PYTHONPATH=build/dev/python python scripts/compile_check.py
"""

import torch

import fmha


def main():
    q, k, v = (torch.randn(2, 256, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def attention(q, k, v):
        out, lse = fmha.fwd(q, k, v, causal=True, return_lse=True)
        return out * 2, lse

    eager = attention(q, k, v)
    compiled = torch.compile(attention, fullgraph=True)(q, k, v)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b), "compiled fmha.fwd differs from the eager call"
    print("torch.compile(fullgraph=True): bitwise equal to eager")


if __name__ == "__main__":
    main()
