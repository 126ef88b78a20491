import sys, torch, fmha
dt = torch.bfloat16
def t(*s): return torch.randn(*s, dtype=dt, device="cuda")
q = t(2, 500, 4, 256)
q128 = t(2, 500, 4, 128)
probes = {
    "select_d256": lambda: fmha.select(q, q, q),
    "explain_d256": lambda: fmha.explain(q, q, q),
    "fwd_d256": lambda: fmha.fwd(q, q, q),
    "fwd_softcap": lambda: fmha.fwd(q128, q128, q128, softcap=30.0),
    "fwd_window": lambda: fmha.fwd(q128, q128, q128, window_size=(64, 0)),
}
name = sys.argv[1]
try:
    r = probes[name]()
    print(name, "returned", str(r)[:200])
except Exception as e:
    print(name, "raised", type(e).__name__, str(e)[:300].replace("\n", " "))
