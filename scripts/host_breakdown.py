"""Where one planned fmha.fwd call spends its host time (perf notes v7): each step of fmha.fwd's
plan path timed alone, on the small shape of python -m bench (b=1, s=128, h=16, d=128, bf16),
next to the whole call and torch SDPA's.

    PYTHONPATH=build/dev/python python scripts/host_breakdown.py
"""

import torch
import torch.nn.functional as F

import fmha
from fmha import _api, _plans
from fmha.timing import host_us


def main():
    q, k, v = (torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    fmha.fwd(q, k, v)
    opts = (False, None, (-1, -1), "top_left", None, None, None, 0.0, 0.0, None, 0, False,
            None, None, None, None, None, None, None)
    key = _plans.call_key(q, k, v, *opts)
    plan = _api._PLANS.get(key)
    out, lse = plan.outputs(q)
    # lse, bias, alibi_slopes, cu_seqlens_q/k, seqused_q/k, q/k/v_descale, dropout seed, offset
    call = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, *_plans._KEEP_SIZES, torch._C._cuda_getCurrentRawStream(0), None)
    full = _api._make_args(_api._prepare(q, k, v, False, None, **_api._OPTION_DEFAULTS,
                                         materialize=True), out, None)
    stream = call[-2]
    steps = {
        "fmha.fwd, whole call": lambda: fmha.fwd(q, k, v),
        "  call_key": lambda: _plans.call_key(q, k, v, *opts),
        "  PlanTable.get": lambda: _api._PLANS.get(key),
        "  Plan.outputs (new_empty)": lambda: plan.outputs(q),
        "  Plan.launch (pointers, stream, C++)": lambda: plan.launch(
            q, k, v, out, lse, None, None, None, None, None, None, None, None, None, 0, 0,
            None),
        "    FwdArgs.run, integers ready": lambda: plan.args.run(*call),
        "    _C.fwd(FwdArgs ready): C++ alone": lambda: fmha._C.fwd(full, stream, None),
        "torch SDPA, default backend": lambda: F.scaled_dot_product_attention(qt, kt, vt),
    }
    # The op's path: what a torch.compile'd model pays per call, next to SDPA's there.
    ops = _api._prepare(q, k, v, False, None, **_api._OPTION_DEFAULTS, materialize=True)
    steps["torch.ops.fmha.fwd (dispatch + impl)"] = lambda: _api._fwd_op(*ops, None)
    steps["  _fwd_impl alone"] = lambda: _api._fwd_impl(*ops, None)
    compiled_fmha = torch.compile(lambda q, k, v: fmha.fwd(q, k, v), fullgraph=True)
    compiled_sdpa = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                                  fullgraph=True)
    steps["torch.compile'd fmha.fwd (the op)"] = lambda: compiled_fmha(q, k, v)
    steps["torch.compile'd SDPA"] = lambda: compiled_sdpa(qt, kt, vt)
    for name, fn in steps.items():
        print(f"{name:36s} {host_us(fn, warmup=200, repeat=2000):7.2f} us")


if __name__ == "__main__":
    main()
