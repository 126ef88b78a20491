"""Context parallelism's scaling: forward+backward of one long sequence on 1 GPU and on N.

    torchrun --nproc-per-node=2 -m bench.distributed [--seqlens 131072] [--masks causal,full]

Times SDPA's flash backend, forward and backward, on one sequence (batch 1, 16 heads, head dim
128, bf16; q, k, v and the output's gradient held (batch, heads, seqlen, dim) as models hold
them) for two kernels behind it: fmha (fmha.integrations.sdpa.register()) and torch's own
FlashAttention-2. First the whole sequence on rank 0's GPU alone (the other ranks wait), then
under torch's context_parallel on all N ranks: causal with torch's head-tail load balancing,
non-causal without, K/V rotated by allgather (torch's default). A step is timed on the host
from a barrier to the last rank's finish (CUDA synchronized), so the ring's communication and
the slowest rank count; at these sizes one step is 0.1-1 s, far above L2 and launch effects.
Medians of --steps steps after --warmup steps (whose first calls compile what the build lacks).

Columns: ms a step; TFLOP/s per GPU (FlashAttention's 3.5 x 4 b h s^2 d FLOPs, halved for
causal, over the step's time and N); speedup, the one-GPU step time over the N-GPU one (N at
linear scaling). Rank 0 prints the table and, with --json, writes the rows.
"""

import argparse
import datetime
import json
import os
import shlex
import contextlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
from torch.nn.attention import SDPBackend, sdpa_kernel

from fmha.integrations import sdpa

HEADS = 16
HEAD_DIM = 128
DTYPE = torch.bfloat16
SEQ_DIM = 2
BACKENDS = ("fmha", "sdpa_flash")


def step_fn(q, k, v, dout, causal: bool):
    """One forward+backward of SDPA's flash backend on leaves q, k, v."""
    def step():
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(dout)
    return step


def median_seconds(step, steps: int, warmup: int, group_wide: bool) -> float:
    """Median host seconds of `step()` from a barrier until every rank's GPU is done
    (group_wide) or this GPU is (rank 0 alone)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        if group_wide:
            dist.barrier()
        begin = time.perf_counter()
        step()
        torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - begin], device="cuda")
        if group_wide:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def leaves(seqlen: int):
    gen = torch.Generator(device="cuda").manual_seed(seqlen)

    def randn():
        return torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    return randn(), randn(), randn(), randn()


def one_gpu_seconds(seqlen: int, causal: bool, args) -> float:
    """Rank 0's step time on the whole sequence (the others wait); broadcast to all ranks."""
    seconds = torch.zeros(1, device="cuda", dtype=torch.float64)
    if dist.get_rank() == 0:
        q, k, v, dout = leaves(seqlen)
        step = step_fn(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout, causal)
        seconds[0] = median_seconds(step, args.steps, args.warmup, group_wide=False)
        del q, k, v, dout
    dist.broadcast(seconds, src=0)
    return seconds.item()


@contextlib.contextmanager
def ring_options(causal: bool, rotate: str):
    """torch's ring as fmha's context-parallel runs take it (this benchmark and
    tests/test_context_parallel_gpu.py): head-tail load balancing for causal attention, the
    only kind torch's ring balances, and K/V passed around by `rotate` ("allgather" or
    "alltoall"); the balancing option is restored after. context_parallel shards, and
    context_parallel_unshard gathers, by the option in force: both belong inside."""
    balanced = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = causal
    set_rotate_method(rotate)
    try:
        yield
    finally:
        _cp_options.enable_load_balance = balanced


def ring_seconds(mesh, seqlen: int, causal: bool, args) -> float:
    """The step time under context_parallel on all ranks."""
    shards = list(leaves(seqlen))
    with ring_options(causal, args.rotate), context_parallel(
            mesh, buffers=shards, buffer_seq_dims=[SEQ_DIM] * 4, no_restore_buffers=set(shards)):
        q, k, v, dout = shards
        step = step_fn(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout, causal)
        return median_seconds(step, args.steps, args.warmup, group_wide=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", default="131072",
                        help="comma-separated total sequence lengths (default 131072)")
    parser.add_argument("--masks", default="causal,full", help="causal, full, or both")
    parser.add_argument("--rotate", default="allgather", choices=("allgather", "alltoall"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the rows to this file (rank 0)")
    args = parser.parse_args(argv)
    masks = args.masks.split(",")
    if any(mask not in ("causal", "full") for mask in masks):
        parser.error(f"--masks takes causal and full, not {args.masks!r}")

    if "WORLD_SIZE" not in os.environ:
        parser.error("run under torchrun: torchrun --nproc-per-node=N -m bench.distributed")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10),
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))

    rows = []
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        for mask in masks:
            causal = mask == "causal"
            flops = 3.5 * 4 * HEADS * seqlen * seqlen * HEAD_DIM * (0.5 if causal else 1.0)
            for backend in BACKENDS:
                if backend == "fmha":
                    sdpa.register()
                else:
                    sdpa.unregister()
                one = one_gpu_seconds(seqlen, causal, args)
                ring = ring_seconds(mesh, seqlen, causal, args)
                for gpus, seconds in ((1, one), (world, ring)):
                    rows.append({"backend": backend, "gpus": gpus, "seqlen": seqlen,
                                 "mask": mask, "ms": seconds * 1e3,
                                 "tflops_per_gpu": flops / seconds / gpus / 1e12,
                                 "speedup": one / seconds})
    sdpa.unregister()

    if dist.get_rank() == 0:
        print(f"context parallel, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"b1 h{HEADS} d{HEAD_DIM} bf16, forward+backward, rotate {args.rotate}")
        print(f"{'backend':<11} {'GPUs':>4} {'seqlen':>7} {'mask':<6} {'ms':>8} "
              f"{'TFLOP/s/GPU':>11} {'speedup':>7}")
        for row in rows:
            print(f"{row['backend']:<11} {row['gpus']:>4} {row['seqlen']:>7} {row['mask']:<6} "
                  f"{row['ms']:>8.1f} {row['tflops_per_gpu']:>11.1f} {row['speedup']:>7.2f}")
        if args.json:
            with open(args.json, "w") as f:
                command = (f"torchrun --nproc-per-node={world} -m bench.distributed "
                       + shlex.join(sys.argv[1:] if argv is None else argv))
            json.dump({"command": command, "world_size": world,
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
