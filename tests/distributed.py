"""What the multi-GPU test modules share: they run only under torchrun, one process per GPU,

    torchrun --nproc-per-node=2 -m pytest -q -p no:cacheprovider tests/test_context_parallel_gpu.py tests/test_fsdp_gpu.py

(any number of GPUs from 2; NCCL_NVLS_ENABLE=0 stays set where a machine sets it), and skip,
saying so, anywhere else. Every rank runs every test in the same order, so a test's checks are
reduced over the ranks before any rank asserts: one rank failing alone would leave the others
waiting in a collective until NCCL's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import pytest

COMMAND = ("torchrun --nproc-per-node=2 -m pytest -q -p no:cacheprovider "
           "tests/test_context_parallel_gpu.py tests/test_fsdp_gpu.py")

# A collective that waits longer than this has lost a rank (a failed compile, an exception on
# one rank only): the run fails instead of hanging. The slowest legitimate wait is compile on
# demand of an fa3 backward instance on the rank that compiles it (about 2 minutes of one core).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def launched_world_size() -> int:
    """The number of processes torchrun started (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_group(torch):
    """Joins torchrun's NCCL process group (once per process) on this rank's GPU and returns a
    1D device mesh of all ranks; skips the calling module where there is no torchrun of 2+
    processes, or fewer GPUs than processes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = launched_world_size()
    if world < 2:
        pytest.skip(f"needs torchrun with 2 or more GPUs: {COMMAND}", allow_module_level=True)
    if not torch.cuda.is_available() or torch.cuda.device_count() < int(
            os.environ.get("LOCAL_WORLD_SIZE", world)):
        pytest.skip(f"torchrun started {world} processes, this machine has "
                    f"{torch.cuda.device_count()} GPUs", allow_module_level=True)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    return init_device_mesh("cuda", (world,))


def largest_over_ranks(torch, value: float) -> float:
    """The largest of every rank's `value`: what each rank asserts on, so that all ranks pass
    or fail together."""
    return _reduced_over_ranks(torch, value, "MAX")


def smallest_over_ranks(torch, value: float) -> float:
    """The smallest of every rank's `value`, likewise."""
    return _reduced_over_ranks(torch, value, "MIN")


def _reduced_over_ranks(torch, value: float, op: str) -> float:
    import torch.distributed as dist

    reduced = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(reduced, op=getattr(dist.ReduceOp, op))
    return reduced.item()


def on_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def compile_on_demand():
    """Compile on demand on, as users get it (the suite's conftest turns it off for the
    single-process tests): what the default build lacks, such as the non-causal backward of a
    ring's later steps, is compiled at its first call."""
    saved = os.environ.get("FMHA_JIT")
    os.environ["FMHA_JIT"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("FMHA_JIT")
        else:
            os.environ["FMHA_JIT"] = saved
