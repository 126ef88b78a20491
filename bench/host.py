"""python -m bench --host: what a call costs the host, for fmha and torch SDPA, as an inference
or training loop pays it: the forward without grad, the forward of inputs that need grad, a
training call (that forward, then the backward into the leaves' .grad, which the step then
clears), and the same training call compiled (torch.compile of the attention; its backward is
the compiled graph's). Microseconds per call on a problem whose kernels take a few
microseconds (b1 s128 h16 d128 causal bf16), so that the host never waits for the GPU and each
call's cost shows whole (fmha.timing.host_us); the median of rounds that take the backends in
turn. q, k, v are leaves in (batch, seq, heads, dim) for "fmha" and in (batch, heads, seq, dim)
for the rest, as SDPA and most models hold them; "fmha_bhsd" passes fmha their transpose(1, 2)
views.
"""

import contextlib
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha
from fmha.timing import host_us

SHAPE = dict(batch=1, seqlen=128, nheads=16, headdim=128)
BACKENDS = ("fmha", "fmha_bhsd", "sdpa", "sdpa_flash", "cudnn")
# The SDPA backend each column forces; "sdpa" is SDPA's own choice.
FORCED = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _attention(backend: str):
    """The backend's attention as a function of its (q, k, v) leaves."""
    if backend == "fmha":
        return lambda q, k, v: fmha.fwd(q, k, v, causal=True)
    if backend == "fmha_bhsd":
        return lambda q, k, v: fmha.fwd(q.transpose(1, 2), k.transpose(1, 2),
                                        v.transpose(1, 2), causal=True)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _leaves(backend: str, requires_grad: bool):
    b, s, h, d = (SHAPE[key] for key in ("batch", "seqlen", "nheads", "headdim"))
    shape = (b, s, h, d) if backend == "fmha" else (b, h, s, d)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                        requires_grad=requires_grad) for _ in range(3)]


def _training_call(attention, leaves):
    """One training call: the forward, the backward into the leaves' .grad, the grads cleared
    (a step's zero_grad(set_to_none=True))."""
    q, k, v = leaves
    out = attention(q, k, v)
    dout = torch.randn_like(out)

    def call():
        attention(q, k, v).backward(dout)
        for leaf in leaves:
            leaf.grad = None
    return call


def _calls(backend: str, compiled: bool) -> dict:
    """{row: call} of one backend: the calls whose host time the table shows."""
    attention = _attention(backend)
    plain, trained = _leaves(backend, False), _leaves(backend, True)

    def inference():
        with torch.no_grad():
            attention(*plain)
    calls = {"forward, no grad": inference,
             "forward, inputs need grad": lambda: attention(*trained),
             "forward + backward": _training_call(attention, trained)}
    if compiled and backend not in FORCED:
        calls["compiled forward + backward"] = _training_call(
            torch.compile(attention, fullgraph=True), _leaves(backend, True))
    return calls


def measure(rounds: int = 5, compiled: bool = True) -> dict:
    """{row: {backend: host us per call}}: medians of `rounds` rounds, each taking every
    backend in turn. A backend that cannot run the problem (fmha's build, SDPA's backends on
    this GPU) is left out of the rows it cannot run."""
    calls = {}
    for backend in BACKENDS:
        forced = FORCED.get(backend)
        try:
            with sdpa_kernel(forced) if forced else contextlib.nullcontext():
                made = _calls(backend, compiled)
                for call in made.values():
                    call()
        except (RuntimeError, ValueError):  # not built, or this backend refuses the problem
            continue
        calls[backend] = made
    times = {}
    for _ in range(rounds):
        for backend, made in calls.items():
            forced = FORCED.get(backend)
            with sdpa_kernel(forced) if forced else contextlib.nullcontext():
                for row, call in made.items():
                    times.setdefault(row, {}).setdefault(backend, []).append(host_us(call))
    return {row: {backend: statistics.median(us) for backend, us in by_backend.items()}
            for row, by_backend in times.items()}


def format_rows(costs: dict) -> str:
    shape = "b{batch} s{seqlen} h{nheads} d{headdim}".format(**SHAPE)
    lines = [f"host us per call ({shape} causal bf16; medians):",
             f"{'':30s}" + "".join(f"{b:>12s}" for b in BACKENDS)]
    for row, by_backend in costs.items():
        cells = "".join(f"{by_backend[b]:12.1f}" if b in by_backend else f"{'-':>12s}"
                        for b in BACKENDS)
        lines.append(f"{row:30s}{cells}")
    return "\n".join(lines)
