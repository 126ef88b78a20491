import torch, torch.nn.functional as F
import fmha
from fmha import _api, _bwd, _plans
from fmha.timing import host_us

b, s, h, d = 1, 128, 16, 128
def leaves(shape, g=True):
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=g) for _ in range(3)]
q, k, v = leaves((b, s, h, d))
qt, kt, vt = leaves((b, h, s, d))
dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
doutt = dout.transpose(1, 2).contiguous()

out = fmha.fwd(q, k, v, causal=True)
torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
souts = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
grads = [torch.empty_like(t) for t in (q, k, v)]

class Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.detach().clone() if False else torch.empty_like(q)
    @staticmethod
    def backward(ctx, g):
        return grads[0], grads[1], grads[2]
tout = Trivial.apply(q, k, v)

ctx_plan = out.grad_fn
plan = None
for key, p in list(_api._PLANS._plans.items()):
    if p.backward is not None: plan = p
bplan = next(iter(plan.backward._plans.values()))
sq = out.grad_fn.saved_tensors if hasattr(out.grad_fn, "saved_tensors") else None
q2, k2, v2, o2, lse2 = out.grad_fn.saved_tensors[:5]

cases = {
  "fmha autograd.grad(out)": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
  "sdpa autograd.grad(out)": lambda: torch.autograd.grad(souts, (qt, kt, vt), doutt, retain_graph=True),
  "trivial Function autograd.grad": lambda: torch.autograd.grad(tout, (q, k, v), dout, retain_graph=True),
  "bwd plan.run direct": lambda: bplan.run(dout, q2, k2, v2, o2, lse2, None, None, None, None, None, None, 0, 0, 0, 0, None),
  "bwd outputs only": lambda: bplan.outputs(q2, k2, v2),
  "torch.empty ws": lambda: torch.empty(bplan.workspace_bytes or 1, dtype=torch.uint8, device="cuda"),
  "fmha.bwd public": lambda: fmha.bwd(dout, q2, k2, v2, o2, lse2, causal=True),
  "fwd grad": lambda: fmha.fwd(q, k, v, causal=True),
  "sdpa fwd grad": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
  "trivial fwd apply": lambda: Trivial.apply(q, k, v),
}
for rnd in range(2):
    for name, fn in cases.items():
        fn()
        print(f"{rnd} {name:34s} {min(host_us(fn) for _ in range(3)):8.1f} us", flush=True)
print("workspace bytes", bplan.workspace_bytes)
