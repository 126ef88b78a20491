import time, statistics, torch
import fmha
from fmha import _bwd, _plans, _C
from fmha.timing import host_us

b, s, h, d = 1, 128, 16, 128
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
stamps = []
orig = _bwd._PlannedAttention.backward

def timed(ctx, dout, _dlse):
    t = [time.perf_counter()]
    (q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) = ctx.saved_tensors
    plan = ctx.plan
    max_seqlen_q, max_seqlen_k, dropout_seed, dropout_offset = ctx.call
    t.append(time.perf_counter())
    dout = _bwd._kernel_layout(dout)
    vl = plan.args.vlayout
    deterministic = torch.are_deterministic_algorithms_enabled()
    key = (_plans.layout(dout), deterministic)
    bwd_plan = plan.backward.get(key)
    t.append(time.perf_counter())
    dq, dk, dv, dbias = bwd_plan.outputs(q, k, v)
    t.append(time.perf_counter())
    failed = bwd_plan.launch(dout, q, k, v, out, lse, None, None, None, None, None, None, max_seqlen_q, max_seqlen_k, dropout_seed, dropout_offset, dq, dk, dv, None, None)
    t.append(time.perf_counter())
    stamps.append([b - a for a, b in zip(t, t[1:])])
    return dq, dk, dv, None, None

out = fmha.fwd(q, k, v, causal=True)
torch.autograd.grad(out, (q, k, v), dout)  # makes the backward plan
def step():
    torch.autograd.grad(fmha.fwd(q, k, v, causal=True), (q, k, v), dout)
print("step, original backward", round(min(host_us(step) for _ in range(3)), 1))
_bwd._PlannedAttention.backward = staticmethod(torch.autograd.function.once_differentiable(timed))
print("step, timed backward", round(min(host_us(step) for _ in range(3)), 1))
_bwd._PlannedAttention.backward = staticmethod(timed)
print("step, timed backward w/o once_differentiable", round(min(host_us(step) for _ in range(3)), 1))
stamps.clear()
host_us(step)
med = [statistics.median(x) * 1e6 for x in zip(*stamps)]
print("inside backward (us): unpack %.1f, layout+key %.1f, outputs %.1f, launch %.1f" % tuple(med))
t_fwd = min(host_us(lambda: fmha.fwd(q, k, v, causal=True)) for _ in range(3))
print("forward with grad", round(t_fwd, 1))
