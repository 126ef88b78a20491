"""fmha's kernels inside torch's context parallelism (ring attention over SDPA), on 2+ GPUs.

torch.distributed.tensor.experimental.context_parallel shards q, k and v along the sequence and
replaces SDPA by a ring: each rank calls SDPA's flash operator on its queries against every
rank's keys in turn and merges the partial outputs by their log-sum-exps, then runs the ring
backward the same way. With fmha.integrations.sdpa.register() active, those operator calls are
fmha's kernels. Checked here for causal attention with torch's load balancing (each rank holds
a head and a tail chunk, so the ring's later steps run non-causal calls on half the queries or
keys) and for non-causal attention, with both of torch's ways to rotate K/V (allgather,
alltoall), at 32k and 128k tokens (batch 1, 16 heads, head dim 128, bf16; 512k too on 4 or
more GPUs), and with grouped K/V heads through SDPA's enable_gqa.

Pass rule: the ring's result differs from a one-GPU call of the same kernels on the whole
sequence by the ring's own rounding (every step's output and gradients come back in bf16
before the float32 merge). fmha's ring result, unsharded, must be within twice that of torch's
own flash kernels under the same ring (against torch's one-GPU call), plus 1e-4 and half a bf16
ulp of the largest element, for the output and each of dq, dk, dv; and every flash operator
call of the ring must have run on fmha (a missing instance would fall back to torch's kernel
silently, so fmha.fwd and fmha.bwd are counted). Problems outside the default build (the
non-causal backward) are compiled on demand at their first call.

Run with the command in tests/distributed.py (torchrun); skipped elsewhere.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import (  # noqa: E402
    compile_on_demand, largest_over_ranks, process_group, smallest_over_ranks)
from gpu_support import import_fmha  # noqa: E402

torch, fmha = import_fmha()
MESH = process_group(torch)

import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor.experimental import context_parallel  # noqa: E402
from torch.distributed.tensor.experimental._attention import (  # noqa: E402
    context_parallel_unshard)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import reference as R  # noqa: E402
from bench.distributed import ring_options  # noqa: E402
from fmha.integrations import sdpa  # noqa: E402

DTYPE = torch.bfloat16
HEADS = 16
HEAD_DIM = 128
# The sequence dimension of SDPA's (batch, heads, seqlen, head_dim) tensors, which
# context_parallel shards.
SEQ_DIM = 2
OPERANDS = ("out", "dq", "dk", "dv")


@pytest.fixture(scope="module", autouse=True)
def users_setup():
    """Compile on demand on, as users have it; SDPA's flash backend torch's again afterwards."""
    with compile_on_demand():
        yield
    sdpa.unregister()


class CallCounter:
    """Counts the fmha.fwd and fmha.bwd calls that returned, i.e. that fmha served."""

    def __init__(self, monkeypatch):
        self.served = {"fwd": 0, "bwd": 0}
        for name in self.served:
            monkeypatch.setattr(fmha, name, self._counting(name, getattr(fmha, name)))

    def _counting(self, name, call):
        def counted(*args, **kwargs):
            result = call(*args, **kwargs)
            self.served[name] += 1
            return result
        return counted


def inputs(seqlen: int, kv_heads: int, seed: int):
    """q, k, v and the output's gradient, (1, heads, seqlen, 128) bf16, the same on every rank
    (one seed): each rank holds the whole problem and context_parallel takes its shard."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(heads):
        return torch.randn(1, heads, seqlen, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    return randn(HEADS), randn(kv_heads), randn(kv_heads), randn(HEADS)


def attention_and_grads(q, k, v, dout, causal: bool):
    """SDPA's flash backend forward and backward: (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                             enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def ring_attention_and_grads(q, k, v, dout, causal: bool, rotate: str):
    """attention_and_grads under torch's context parallelism on MESH, the results unsharded
    back to the whole sequence in its order. Causal calls shard with torch's head-tail load
    balancing, which torch's ring accepts for causal attention only."""
    shards = [t.clone() for t in (q, k, v, dout)]
    with ring_options(causal, rotate):
        with context_parallel(MESH, buffers=shards, buffer_seq_dims=[SEQ_DIM] * 4,
                              no_restore_buffers=set(shards)):
            results = attention_and_grads(*shards, causal)
        return context_parallel_unshard(MESH, list(results), [SEQ_DIM] * 4)


def ring_separation(ring, whole) -> list[float]:
    """Max |ring - whole| of each of (out, dq, dk, dv)."""
    return [(r.double() - w.double()).abs().max().item() for r, w in zip(ring, whole)]


CASES = [
    pytest.param(seqlen, causal, rotate, HEADS,
                 id=f"{seqlen // 1024}k-{'causal' if causal else 'full'}-{rotate}")
    for seqlen in (32 * 1024, 128 * 1024)
    for causal in (True, False)
    for rotate in ("allgather", "alltoall")
] + [pytest.param(32 * 1024, True, "allgather", 4, id="32k-causal-allgather-gqa16:4")]
# 512k tokens where 4 or more GPUs share them (one GPU still holds the whole problem for the
# comparison: 2 GiB an operand, about 10 s a forward+backward).
if MESH.size() >= 4:
    CASES += [pytest.param(512 * 1024, causal, "allgather", HEADS,
                           id=f"512k-{'causal' if causal else 'full'}-allgather")
              for causal in (True, False)]


@pytest.mark.parametrize("seqlen, causal, rotate, kv_heads", CASES)
def test_ring_attention_matches_one_gpu(seqlen, causal, rotate, kv_heads, monkeypatch):
    q, k, v, dout = inputs(seqlen, kv_heads, seed=seqlen + causal + len(rotate) + kv_heads)

    sdpa.unregister()
    torch_whole = attention_and_grads(q, k, v, dout, causal)
    torch_ring = ring_attention_and_grads(q, k, v, dout, causal, rotate)
    torch_separation = ring_separation(torch_ring, torch_whole)
    del torch_whole, torch_ring

    sdpa.register()
    fmha_whole = attention_and_grads(q, k, v, dout, causal)
    counter = CallCounter(monkeypatch)
    fmha_ring = ring_attention_and_grads(q, k, v, dout, causal, rotate)
    fmha_separation = ring_separation(fmha_ring, fmha_whole)

    # Each rank's forward makes one operator call per step of the ring it does not skip, the
    # backward as many: with load balancing (causal) or without a mask, every step.
    steps = MESH.size()
    served = [int(smallest_over_ranks(torch, counter.served[op])) for op in ("fwd", "bwd")]
    assert served == [steps, steps], (
        f"on some rank fmha served only {served} (fwd, bwd) of the ring's {steps} operator "
        f"calls of each; torch's kernel ran the others")

    failures = []
    for name, whole, ours, theirs in zip(OPERANDS, fmha_whole, fmha_separation, torch_separation):
        largest = whole.abs().max().item()
        tolerance = 2 * theirs + 1e-4 + 0.5 * R.ulp(largest, DTYPE)
        if largest_over_ranks(torch, ours - tolerance) > 0:
            failures.append(f"{name}: fmha's ring is {ours:.3g} from its one-GPU call, torch's "
                            f"flash ring {theirs:.3g} from its own (max |{name}| {largest:.3g})")
    assert not failures, "; ".join(failures)
