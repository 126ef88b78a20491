"""Issue 37's padded-training gradients: where does fmha's extra error come from?"""
import copy
import sys
import types

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import fmha
import fmha.integrations._flash as flash
import fmha.integrations.transformers as fmha_transformers

fmha_transformers.register()
torch.manual_seed(0)
DEV = "cuda"
config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                     max_position_embeddings=4096, pad_token_id=0)
config._attn_implementation = "eager"
base = LlamaForCausalLM(config).to(DEV).float()
BATCH, SEQ = 3, 777
PADS = [0, 100, 500]


def varlen_sdpa(q, k, v, *, causal, softmax_scale, cu_seqlens_q=None, cu_seqlens_k=None,
                **options):
    """fmha.fwd's group mode on torch SDPA, one sequence at a time (equal q/k lengths)."""
    if cu_seqlens_q is None:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=causal,
                                           scale=softmax_scale, enable_gqa=True)
        return o.transpose(1, 2)
    outs = []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)[None]
        ks = k[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        vs = v[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=softmax_scale,
                                           enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def shim():
    def no_kvcache(*a, **k):
        raise fmha.MissingInstanceError("shim")
    return types.SimpleNamespace(fwd=varlen_sdpa, fwd_kvcache=no_kvcache,
                                 MissingInstanceError=fmha.MissingInstanceError)


def mean_v_rows(orig):
    """flash_attention, with padded query rows set to the mean of V over all the row's keys."""
    def wrapped(q, k, v, *, padding_mask=None, **kw):
        out = orig(q, k, v, padding_mask=padding_mask, **kw)
        if padding_mask is None:
            return out
        fill = v.float().mean(dim=1).repeat_interleave(q.shape[2] // v.shape[2], dim=1)
        pad = padding_mask[:, -q.shape[1]:] == 0
        return torch.where(pad[:, :, None, None], fill[:, None].to(out.dtype), out)
    return wrapped


def sdpa_fully_masked_rows():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(2, 4, 64, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    m = torch.ones(2, 1, 64, 64, dtype=torch.bool, device=DEV).tril()
    m[1, :, :, :10] = False  # row 1 left-padded by 10: its first 10 queries see nothing
    mean = v[1].float().mean(dim=1)  # (heads, d)
    for name, backends in (("default", None), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                           ("math", [SDPBackend.MATH]), ("cudnn", [SDPBackend.CUDNN_ATTENTION])):
        try:
            if backends is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            else:
                with sdpa_kernel(backends):
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        except RuntimeError as e:
            print(f"  sdpa {name}: {str(e)[:80]}")
            continue
        rows = o[1, :, :10].float()
        print(f"  sdpa {name}: |rows| {rows.abs().max().item():.3f}, |rows - mean V| "
              f"{(rows - mean[:, None]).abs().max().item():.3f}, nan {rows.isnan().any().item()}")


def grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    named = {n: (p.grad.float().flatten() if p.grad is not None else torch.zeros(p.numel(), device=DEV))
             for n, p in model.named_parameters()}
    return out.loss.item(), named


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def report(tag, ref, got):
    ref_all = torch.cat(list(ref.values()))
    got_all = torch.cat(list(got.values()))
    worst = sorted(((((got[n] - ref[n]).norm() ** 2).item(), n) for n in ref), reverse=True)[:4]
    total = ((got_all - ref_all).norm() ** 2).item()
    print(f"  {tag:18s} rel {rel(got_all, ref_all):.3e}  top: " +
          ", ".join(f"{n.replace('model.', '')} {e / total:.0%} (rel {rel(got[n], ref[n]):.1e})"
                    for e, n in worst))


def run_case(name, inputs):
    print(name)
    loss_ref, ref = grads(base, **inputs)
    for impl in ("eager", "sdpa", "fmha", "fmha+sdpa-kernel", "fmha+meanV"):
        m = copy.deepcopy(base).to(torch.bfloat16)
        m.set_attn_implementation("fmha" if impl.startswith("fmha") else impl)
        saved, saved_fa = flash.fmha, fmha_transformers.flash_attention
        if impl == "fmha+sdpa-kernel":
            flash.fmha = shim()
        if impl == "fmha+meanV":
            fmha_transformers.flash_attention = mean_v_rows(saved_fa)
        try:
            loss, g = grads(m, **inputs)
        finally:
            flash.fmha, fmha_transformers.flash_attention = saved, saved_fa
        report(f"{impl} ({loss - loss_ref:+.1e})", ref, g)
        del m


gen = torch.Generator().manual_seed(1)
ids = torch.randint(3, config.vocab_size, (BATCH, SEQ), generator=gen).to(DEV)
mask = torch.ones(BATCH, SEQ, dtype=torch.long, device=DEV)
for row, pad in enumerate(PADS):
    mask[row, :pad] = 0
ids = ids.masked_fill(mask == 0, 0)
labels = ids.masked_fill(mask == 0, -100)
print("SDPA on rows that see no key (bf16, this GPU):")
sdpa_fully_masked_rows()
run_case("no padding", dict(input_ids=ids[:, -277:].contiguous(), labels=ids[:, -277:].contiguous()))
run_case("left padded, labels -100 on padding", dict(input_ids=ids, attention_mask=mask, labels=labels))
first = labels.clone()
for row, pad in enumerate(PADS):
    first[row, pad] = -100
if False: run_case("left padded, no label predicted from a pad position",
         dict(input_ids=ids, attention_mask=mask, labels=first))
positions = (mask.cumsum(-1) - 1).clamp(min=0)
if False: run_case("left padded, position ids from the mask, labels -100 on padding",
         dict(input_ids=ids, attention_mask=mask, labels=labels, position_ids=positions))
# Packed: the three sequences back to back, positions restarting, first token of each unlabeled.
seqs = [ids[r, p:] for r, p in enumerate(PADS)]
packed_ids = torch.cat(seqs)[None]
packed_pos = torch.cat([torch.arange(len(s), device=DEV) for s in seqs])[None]
packed_labels = packed_ids.clone()
start = 0
for s in seqs:
    packed_labels[0, start] = -100
    start += len(s)
run_case("packed, position ids restarting, use_cache=False",
         dict(input_ids=packed_ids, position_ids=packed_pos, labels=packed_labels, use_cache=False))
print("transformers", transformers.__version__, "torch", torch.__version__,
      torch.cuda.get_device_name())
