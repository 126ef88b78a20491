"""The backward grid as a training loop meets it: the loop tables of `python -m bench --bwd`.

The kernel-only tables time calls back to back on one set of inputs, which then stay in L2, and
keep the host's cost per call out of the figure. A training step differs in three ways, and
each timed call here has them:

- the layers between two attention calls evict L2: an L2 flush (fmha.timing.l2_flush, twice
  the L2 written) runs before every call, outside its events;
- every layer brings its own q, k and v: the calls take 3 input sets in turn;
- the host's cost is on the step's path: a call runs as a model's does, forward with grad, then
  backward into the leaves' .grad (set to None first, as optimizer.zero_grad does), with the
  gradient of the output arriving in (batch, seq, heads, dim) storage, the input of the output
  projection. Between the events of a call lies the GPU time of its kernels plus whatever of
  its host time the flush's GPU time (tens of us) did not cover; each row also gets the median
  host microseconds of a call (<backend>_host_us).

The leaves are held in one of two layouts: bhsd (batch, heads, seq, dim), as most models and
SDPA hold them, given to fmha as transpose(1, 2) views, and bshd, fmha's own, given to SDPA as
views. SDPA's calls enter torch.nn.attention.sdpa_kernel to force their backend, a few us of
host time a call that a model using its default backend would not spend.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

import fmha
from fmha.timing import interleaved_medians, l2_flush, rotating

LAYOUTS = ("bhsd", "bshd")
INPUT_SETS = 3


def _leaves(b, s, h, d_qk, d_v, dtype, layout):
    """One input set: q, k, v leaves that need grad, in `layout`, and the gradient of the
    output in (b, s, h, d_v) storage."""
    def leaf(d):
        shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
        return torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    return leaf(d_qk), leaf(d_qk), leaf(d_v), torch.randn(b, s, h, d_v, device="cuda",
                                                          dtype=dtype)


def _fmha_forward(causal, layout):
    """forward(q, k, v) -> (out, its gradient's view of dout) for fmha on leaves in layout."""
    view = (lambda t: t.transpose(1, 2)) if layout == "bhsd" else (lambda t: t)

    def forward(q, k, v, dout):
        return fmha.fwd(view(q), view(k), view(v), causal=causal), dout
    return forward


def _sdpa_forward(backend, causal, layout):
    """forward(q, k, v) -> (out, its gradient's view of dout) for one SDPA backend."""
    view = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))

    def forward(q, k, v, dout):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(view(q), view(k), view(v), is_causal=causal)
        return out, dout.transpose(1, 2)
    return forward


def _steps(forward, sets):
    """(backward alone, forward + backward) of `forward` as calls that take the input sets in
    turn; the backward alone replays a graph kept from one forward per set."""
    def zero_grad(q, k, v):
        q.grad = k.grad = v.grad = None

    def both(q, k, v, dout):
        zero_grad(q, k, v)
        out, grad = forward(q, k, v, dout)
        out.backward(grad)

    def backward_of(q, k, v, dout):
        out, grad = forward(q, k, v, dout)

        def backward():
            zero_grad(q, k, v)
            out.backward(grad, retain_graph=True)
        return backward

    return (rotating([backward_of(*inputs) for inputs in sets]),
            rotating([lambda inputs=inputs: both(*inputs) for inputs in sets]))


def run_case(key, flops, shape, dtype, causal, backends, args) -> list:
    """The loop rows of one grid case, two per layout ("bwd" and "fwd_bwd" in `kind`): TFLOP/s
    at 2.5x and 3.5x the forward's `flops` and host us per call for fmha and each SDPA backend
    in `backends` ({name: SDPBackend}) that runs the problem; one that cannot gets None and its
    reason, as in the kernel-only rows."""
    b, s, h, d_qk, d_v = shape
    flush = l2_flush()
    rows = []
    for layout in LAYOUTS:
        sets = [_leaves(b, s, h, d_qk, d_v, dtype, layout) for _ in range(INPUT_SETS)]
        forwards = {"fmha": _fmha_forward(causal, layout)}
        forwards.update({name: _sdpa_forward(backend, causal, layout)
                         for name, backend in backends.items()})
        bwd = {**key, "layout": layout, "kind": "bwd"}
        both = {**key, "layout": layout, "kind": "fwd_bwd"}
        calls = {}
        for name, forward in forwards.items():
            try:
                calls[name] = _steps(forward, sets)
                for call in calls[name]:
                    call()  # raises here, not while timing
            except (ValueError, RuntimeError) as err:  # not in this build, or not this GPU's
                calls.pop(name, None)
                bwd[name] = both[name] = None
                bwd[f"{name}_error"] = both[f"{name}_error"] = str(err).splitlines()[0]
        for row, which, factor in ((bwd, 0, 2.5), (both, 1, 3.5)):
            host = {}
            medians = interleaved_medians({name: pair[which] for name, pair in calls.items()},
                                          args.warmup_ms, args.repeat_ms, args.rounds,
                                          before=flush, host_us=host)
            row.update({name: factor * flops / ms * 1e-9 for name, ms in medians.items()})
            row.update({f"{name}_host_us": us for name, us in host.items()})
        rows += [bwd, both]
        del calls, sets
    return rows
