"""heads-per-cta.txt's correctness check: fmha.fwd_kvcache against a float64 reference (8 K/V heads)."""
import torch, fmha
torch.manual_seed(0)
def ref(q, k, v, lens):
    out = []
    for b in range(q.shape[0]):
        L = int(lens[b])
        qq = q[b].double().transpose(0, 1)               # (h, s, d)
        kk = k[b, :L].double().transpose(0, 1).repeat_interleave(q.shape[2] // k.shape[2], 0)
        vv = v[b, :L].double().transpose(0, 1).repeat_interleave(q.shape[2] // k.shape[2], 0)
        p = torch.softmax(qq @ kk.transpose(1, 2) / q.shape[-1] ** 0.5, -1)
        out.append((p @ vv).transpose(0, 1))
    return torch.stack(out)
worst = 0
for batch, cap, gqa, page, splits in [(1, 8192, 8, 0, 0), (3, 2000, 8, 0, 0), (2, 4096, 4, 16, 0),
                                      (5, 1024, 8, 64, 0), (64, 512, 8, 16, 0), (2, 3000, 8, 0, 1),
                                      (1, 1024, 4, 256, 7), (7, 777, 8, 0, 3)]:
    q = torch.randn(batch, 1, 8 * gqa, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, cap, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.randint(1, cap + 1, (batch,), device="cuda", dtype=torch.int32)
    want = ref(q, k, v, lens)
    if page:
        cap_p = -(-cap // page) * page
        kp = torch.zeros(batch, cap_p, 8, 128, device="cuda", dtype=torch.bfloat16); kp[:, :cap] = k
        vp = torch.zeros_like(kp); vp[:, :cap] = v
        pages = batch * cap_p // page
        perm = torch.randperm(pages, device="cuda")
        kc = torch.empty(pages, page, 8, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.empty_like(kc)
        kc[perm] = kp.view(pages, page, 8, 128); vc[perm] = vp.view(pages, page, 8, 128)
        table = perm.view(batch, -1).to(torch.int32)
        got = fmha.fwd_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=splits)
    else:
        got = fmha.fwd_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits)
    err = (got.double() - want).abs().max().item()
    worst = max(worst, err)
    print(f"b{batch} cap{cap} gqa{gqa} page{page} splits{splits}: max err {err:.3e}")
print("worst", worst, "OK" if worst < 2e-2 else "FAIL")
