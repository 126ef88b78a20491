"""Host cost of the torch calls a Python fmha.fwd path can make, each timed alone (issue 13),
next to torch SDPA's whole call: what a per-call path can afford.

    python scripts/host_costs_torch.py
"""

import time

import torch
import torch.nn.functional as F


def us_per_call(fn, calls=20000):
    """Mean host microseconds per call; `calls` stays below the launch queue's depth (~1k)
    where a call queues GPU work longer than its host work."""
    for _ in range(min(calls // 10, 100)):
        fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    q = torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16)
    qt = q.transpose(1, 2).contiguous()
    big = [torch.randn(4, 16, 2048, 64, device="cuda", dtype=torch.float16) for _ in range(3)]
    dev = q.device
    cache = {}
    key = (q.shape, q.stride(), q.dtype, q.get_device())
    cache[key] = 1
    rows = {
        "torch.add (launch floor)": lambda: torch.add(q, q),
        "SDPA b1 s128 h16 d128 bf16": lambda: F.scaled_dot_product_attention(qt, qt, qt),
        "SDPA b4 s2048 h16 d64 fp16 causal (200 calls)": None,
        "torch.empty(shape, dtype, device)": lambda: torch.empty((1, 128, 16, 128),
                                                                 dtype=q.dtype, device=dev),
        "q.new_empty(shape)": lambda: q.new_empty((1, 128, 16, 128)),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "torch.cuda.current_stream(dev).cuda_stream": lambda: torch.cuda.current_stream(dev).cuda_stream,
        "torch._C._cuda_getCurrentRawStream(idx)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "with torch.cuda.device(dev)": lambda: torch.cuda.device(dev).__enter__(),
        "q.shape, q.stride(), q.dtype, q.get_device()": lambda: (q.shape, q.stride(), q.dtype, q.get_device()),
        "q.device": lambda: q.device,
        "q.data_ptr()": lambda: q.data_ptr(),
        "signature key of 3 tensors + dict get": lambda: cache.get(((q.shape, q.stride(), q.dtype, q.get_device()), (q.shape, q.stride(), q.dtype, q.get_device()), (q.shape, q.stride(), q.dtype, q.get_device()))),
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "torch._C._is_torch_function_mode_enabled()": torch._C._is_torch_function_mode_enabled,
        "torch._C._len_torch_dispatch_stack()": torch._C._len_torch_dispatch_stack,
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
    }
    for name, fn in rows.items():
        if fn is None:
            fn = lambda: F.scaled_dot_product_attention(*big, is_causal=True)  # noqa: E731
        calls = 200 if name.startswith("SDPA") else 20000
        print(f"{name:52s} {us_per_call(fn, calls):8.2f} us")


if __name__ == "__main__":
    main()
