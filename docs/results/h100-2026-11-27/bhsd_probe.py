import torch, fmha, time
from torch.profiler import profile, ProfilerActivity
b,s,h,d=1,128,16,128
def leaves(shape): return [torch.randn(shape,device="cuda",dtype=torch.bfloat16,requires_grad=True) for _ in range(3)]
bshd=leaves((b,s,h,d)); bhsd=leaves((b,h,s,d))
dout=torch.randn(b,s,h,d,device="cuda",dtype=torch.bfloat16)
def step_bshd():
    fmha.fwd(*bshd,causal=True).backward(dout)
    for t in bshd: t.grad=None
def step_bhsd():
    fmha.fwd(*(t.transpose(1,2) for t in bhsd),causal=True).backward(dout)
    for t in bhsd: t.grad=None
def step_bhsd_keepgrad():
    fmha.fwd(*(t.transpose(1,2) for t in bhsd),causal=True).backward(dout)
def host(fn,n=300):
    for _ in range(30): fn()
    torch.cuda.synchronize(); t=time.perf_counter()
    for _ in range(n): fn()
    e=time.perf_counter()-t; torch.cuda.synchronize(); return e/n*1e6
for r in range(3):
    print("bshd %.1f bhsd %.1f bhsd(no zero_grad) %.1f"%(host(step_bshd),host(step_bhsd),host(step_bhsd_keepgrad)))
for name,fn in (("bshd",step_bshd),("bhsd",step_bhsd)):
    for t in bhsd+bshd: t.grad=None
    for _ in range(20): fn()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(50): fn()
    print(name)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
