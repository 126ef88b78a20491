"""fmha.integrations on a GPU: a transformers model and torch SDPA running fmha's kernels.

A small randomly initialised Llama (4 layers, 8 query heads on 2 K/V heads, head dim 64) in
bf16 runs with attn_implementation="fmha" and "sdpa", with and without left padding, and
generates greedily (also at head dims 40 and 36, which run padded); SDPA's flash backend runs before and after fmha.integrations.sdpa.register().

Pass rule, as the kernel tests' (tests/test_fwd_gpu.py): against a float32 (float64 for SDPA's
operator) run of the same weights and inputs, fmha's error is at most twice that of torch's
own bf16 path (the model's sdpa attention; SDPA's FlashAttention-2), plus a small absolute term.
bf16 rounds every layer's activations, so the two bf16 runs differ from the reference and from
each other by about the same amount; a kernel that got the masking, the alignment or the
scale wrong is off by far more. Greedy decoding compares tokens: where the two bf16 runs pick
differently, the float32 model must rate the two picks within TIE of each other (bf16's noise
on logits of a few units), i.e. the step was a near-tie that rounding may decide either way.
"""

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import import_fmha  # noqa: E402

torch, fmha = import_fmha()
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import reference as R  # noqa: E402
from fmha import jit  # noqa: E402
from fmha.integrations import sdpa  # noqa: E402
from fmha.integrations import transformers as fmha_transformers  # noqa: E402

DEVICE = "cuda"
DTYPE = torch.bfloat16
HEAD_DIM = 64
# Two bf16 picks the float32 model rates this close are a near-tie (see the module docstring):
# 8 significant bits round a logit of 4 by up to 2^-6, and each layer's rounding adds to it.
TIE = 0.125


@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install transformers)")
    fmha_transformers.register()
    return transformers


def needs_instance(**options):
    """Skips where this build compiles no bf16 d64 instance for these fmha.fwd options."""
    q = torch.empty(1, 128, 8, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k = torch.empty(1, 128, 2, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    try:
        fmha.select(q, k, k, mask_align="bottom_right", **options)
    except fmha.MissingInstanceError as exc:
        pytest.skip(f"this build has no instance for {options}: {exc}")


def models(transformers, config_class="LlamaConfig", yardstick="sdpa", head_dim=HEAD_DIM,
           reference="eager", **options):
    """The same random weights as a bf16 model with fmha, a bf16 one with the yardstick's
    attention (torch's own path), and a float32 one with the reference's (eager)."""
    config = getattr(transformers, config_class)(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, pad_token_id=0,
        bos_token_id=None, eos_token_id=None, initializer_range=0.05, **options)
    torch.manual_seed(0)
    built = []
    for implementation in ("fmha", yardstick, reference):
        # A config each: from_config sets the attention implementation on the config it is given.
        built.append(transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=implementation))
        built[-1].load_state_dict(built[0].state_dict())
    model, yardstick_model, reference = built
    assert model.config._attn_implementation == "fmha"
    return (model.to(DEVICE, DTYPE).eval(), yardstick_model.to(DEVICE, DTYPE).eval(),
            reference.to(DEVICE).eval())


def prompts(lengths, seqlen, seed=1):
    """Left-padded random token ids and their (batch, seqlen) attention mask."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    ids = torch.randint(1, 1000, (len(lengths), seqlen), generator=generator, device=DEVICE)
    mask = torch.stack([torch.arange(seqlen, device=DEVICE) >= seqlen - n for n in lengths])
    return ids * mask, mask.long()


def assert_within_twice(got, yardstick, reference, what):
    """The pass rule: fmha's error at most twice the yardstick's (torch's own bf16 path), plus
    1% of the reference's largest magnitude."""
    error = (got.float() - reference).abs().max().item()
    yardstick_error = (yardstick.float() - reference).abs().max().item()
    bound = 2 * yardstick_error + 0.01 * reference.abs().max().item()
    assert error <= bound, (f"{what}: fmha is {error:.4g} off the reference, torch's own path "
                            f"{yardstick_error:.4g} (bound {bound:.4g})")


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("lengths", [[40, 40], [40, 23]], ids=["unpadded", "left-padded"])
def test_llama_logits_match_sdpa(transformers, lengths):
    model, sdpa_model, reference = models(transformers)
    ids, mask = prompts(lengths, 40)
    kept = mask.bool()
    assert_within_twice(logits(model, ids, mask)[kept], logits(sdpa_model, ids, mask)[kept],
                            logits(reference, ids, mask)[kept].float(), "logits")


@pytest.mark.parametrize("lengths", [[24, 24], [24, 11]], ids=["unpadded", "left-padded"])
def test_llama_generate_matches_sdpa(transformers, lengths):
    assert_same_greedy_tokens(*models(transformers), *prompts(lengths, 24))


@pytest.mark.parametrize("head_dim", [40, 36])
def test_generate_at_a_head_dim_no_instance_has(transformers, monkeypatch, head_dim):
    """A model whose head dim no instance has (40, and 36, which is no multiple of 8) decodes
    on fwd_kvcache's head-dim-padded instances, left-padded, as SDPA does."""
    padded = head_dim + -head_dim % 8  # what the integration hands fwd_kvcache
    q = torch.empty(2, 1, 8, padded, device=DEVICE, dtype=DTYPE)
    k = torch.empty(2, 64, 2, padded, device=DEVICE, dtype=DTYPE)
    try:
        fmha.select_kvcache(q, k, k, causal=True, cache_seqlens=torch.zeros(
            2, dtype=torch.int32, device=DEVICE))
    except fmha.MissingInstanceError as exc:
        pytest.skip(f"this build has no bf16 causal kvcache instance for head dim {head_dim}: "
                    f"{exc}")
    decode_calls = []
    fwd_kvcache = fmha.fwd_kvcache

    def counted(*args, **kwargs):
        decode_calls.append(args[0].shape)
        return fwd_kvcache(*args, **kwargs)

    monkeypatch.setattr(fmha, "fwd_kvcache", counted)
    assert_same_greedy_tokens(*models(transformers, head_dim=head_dim), *prompts([24, 11], 24))
    # Every layer of each of the 15 steps after the prompt's: one query token a row.
    assert len(decode_calls) == 15 * 4 and all(shape[1] == 1 for shape in decode_calls)


def assert_same_greedy_tokens(model, sdpa_model, reference, ids, mask):
    """16 new tokens by greedy decoding, fmha's as SDPA's but at near-ties (TIE)."""
    options = dict(attention_mask=mask, max_new_tokens=16, do_sample=False)
    got = model.generate(ids, **options)[:, ids.shape[1]:]
    want = sdpa_model.generate(ids, **options)[:, ids.shape[1]:]
    rows = ids.shape[0]
    assert got.shape == want.shape == (rows, 16)
    for row in range(rows):
        differ = (got[row] != want[row]).nonzero()
        if differ.numel() == 0:
            continue
        step = differ[0].item()  # the first pick that differs; the continuations then part
        prefix = torch.cat([ids[row:row + 1], got[row:row + 1, :step]], dim=1)
        prefix_mask = torch.cat([mask[row:row + 1], torch.ones_like(got[row:row + 1, :step])],
                                dim=1)
        rated = logits(reference, prefix, prefix_mask)[0, -1]
        gap = (rated[got[row, step]] - rated[want[row, step]]).abs().item()
        assert gap <= TIE, (f"row {row}, new token {step}: fmha picked {got[row, step].item()}, "
                            f"sdpa {want[row, step].item()}, {gap:.3f} apart in the float32 model")


def test_left_padded_decode_step_runs_fwd_kvcache(monkeypatch):
    """A decode step of a left-padded batch (generate()'s: one query a row, the mask padding
    then tokens) runs fmha.fwd_kvcache with each row's padding as cache_leftpad, not fmha.fwd's
    group mode, and each row matches attention over its own tokens; a mask with a hole is no
    left padding and takes the group-mode path."""
    from fmha.integrations._flash import flash_attention
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    lengths, keys = (57, 130, 1), 130

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=DEVICE, dtype=DTYPE)

    q, k, v = randn(3, 1, 8, HEAD_DIM), randn(3, keys, 2, HEAD_DIM), randn(3, keys, 2, HEAD_DIM)
    mask = torch.stack([torch.arange(keys, device=DEVICE) >= keys - n for n in lengths])
    try:
        fmha.select_kvcache(q, k, v, causal=True, cache_leftpad=(keys - mask.sum(-1)).int(),
                            cache_seqlens=torch.full((3,), keys, dtype=torch.int32,
                                                     device=DEVICE))
    except fmha.MissingInstanceError as exc:
        pytest.skip(f"this build has no bf16 d64 causal kvcache instance: {exc}")
    def refuse(*args, **kwargs):
        raise AssertionError("a left-padded decode step ran fmha.fwd's group mode")

    monkeypatch.setattr(fmha, "fwd", refuse)
    out = flash_attention(q, k, v, causal=True, padding_mask=mask)
    for row, n in enumerate(lengths):
        own = (q[row:row + 1], k[row:row + 1, keys - n:], v[row:row + 1, keys - n:])
        truth, _ = R.attention_reference(*own, causal=True, mask_align="bottom_right")
        lowp, _ = R.attention_reference(*own, causal=True, mask_align="bottom_right",
                                        compute_dtype=DTYPE)
        R.compare(out[row:row + 1], truth, lowp, dtype=DTYPE, what=f"row {row}")

    holed = mask.clone()
    holed[0, keys - 10] = False
    with pytest.raises(AssertionError, match="group mode"):
        flash_attention(q, k, v, causal=True, padding_mask=holed)


def test_mistral_sliding_window_matches_sdpa(transformers):
    needs_instance(causal=True, window_size=(15, 0))
    model, sdpa_model, reference = models(transformers, "MistralConfig", sliding_window=16)
    ids, mask = prompts([40, 23], 40)
    kept = mask.bool()
    assert_within_twice(logits(model, ids, mask)[kept], logits(sdpa_model, ids, mask)[kept],
                            logits(reference, ids, mask)[kept].float(), "logits")


def test_gemma2_softcap_matches_eager(transformers):
    """Gemma2 has no sdpa path (its soft-capping): the bf16 yardstick is eager attention."""
    needs_instance(causal=True, window_size=(15, 0), softcap=1.0)
    needs_instance(causal=True, softcap=1.0)
    model, eager, reference = models(transformers, "Gemma2Config", yardstick="eager",
                                     sliding_window=16, attn_logit_softcapping=1.0,
                                     query_pre_attn_scalar=64)
    ids, mask = prompts([40, 23], 40)
    kept = mask.bool()
    assert_within_twice(logits(model, ids, mask)[kept], logits(eager, ids, mask)[kept],
                        logits(reference, ids, mask)[kept].float(), "logits")


# ---- training: padded and packed batches ----------------------------------------------------

# The families the integration serves, each with the fmha.fwd options its attention needs (a
# sliding window shorter than the sequences, soft-capping) and its bf16 yardstick: SDPA, or eager
# where transformers has no SDPA path (Gemma2's soft-capping).
FAMILIES = {
    "llama-gqa": ("LlamaConfig", "sdpa", {}, [dict(causal=True)]),
    "mistral-window": ("MistralConfig", "sdpa", dict(sliding_window=16),
                       [dict(causal=True, window_size=(15, 0))]),
    "gemma2-softcap": ("Gemma2Config", "eager",
                       dict(sliding_window=16, attn_logit_softcapping=1.0,
                            query_pre_attn_scalar=64),
                       [dict(causal=True, window_size=(15, 0), softcap=1.0),
                        dict(causal=True, softcap=1.0)]),
}
TRAINING_LENGTHS = [48, 37, 11]  # a batch's sequences: left-padded to 48, or packed into one row
# fmha's gradients may be this much further from the float32 model's than the yardstick's.
GRADIENT_SLACK = 1.2


def training_batch(layout):
    """(inputs, labels) of one training step over TRAINING_LENGTHS' sequences: left-padded with
    an attention mask and labels -100 on padding, as a padded training batch has them; or
    packed into one row, position ids restarting at each sequence (padding-free training),
    labels -100 on each sequence's first token (the previous sequence's last one predicts it)."""
    ids, mask = prompts(TRAINING_LENGTHS, max(TRAINING_LENGTHS), seed=5)
    if layout == "left-padded":
        return dict(input_ids=ids, attention_mask=mask), ids.masked_fill(mask == 0, -100)
    rows = [row[row.ne(0)] for row in ids * mask]
    packed = torch.cat(rows)[None]
    positions = torch.cat([torch.arange(len(row), device=DEVICE) for row in rows])[None]
    labels = packed.clone()
    labels[0, positions[0] == 0] = -100
    return dict(input_ids=packed, position_ids=positions, use_cache=False), labels


def gradients(model, inputs, labels):
    """Every parameter's gradient of one training step's loss, flattened into one float32
    vector."""
    model.train().zero_grad(set_to_none=True)
    model(**inputs, labels=labels).loss.backward()
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


def exact_fwd(q, k, v, **options):
    """fmha.fwd's semantics in float64 math (tests/reference.py), the output in q's dtype:
    exact attention, differentiated exactly, behind the integration."""
    return R.attention_reference(q, k, v, **options)[0].to(q.dtype)


@pytest.mark.parametrize("layout", ["left-padded", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_match_the_yardstick(transformers, monkeypatch, family, layout):
    """One training step's gradients with fmha attention are at most GRADIENT_SLACK times as far
    (relative L2 over all parameters) from the float32 model's as the bf16 yardstick's. Where
    the build lacks the family's traits, the step fails with a MissingInstanceError naming the
    filter that builds them.

    Packed, the reference is the float32 eager model and the yardstick torch's bf16 path.
    Left-padded, the rows of padding before a row's first token see no key under the causal
    mask, and the slot before the first token predicts it, so they reach the loss. fmha gives
    them eager's value (the mean of V), whose gradient reaches V only; eager's autograd also
    sends them a gradient through the softmax into q and k, as though its mask had not swamped
    their scores (a derivative of no function eager computes), and SDPA gives them other values
    altogether. So there both the reference (float32) and the yardstick (bf16) are the model
    with exact attention behind the integration (exact_fwd), the derivative of what fmha
    computes. A left-padded Gemma2 step (H200, 2026-11-28): fmha 2.42e-2 from the float32
    eager model, bf16 eager 1.54e-2, which shares the eager model's extra gradient; from the
    exact model fmha 1.29e-2, exact attention in bf16 1.30e-2, bf16 eager 2.31e-2."""
    config_class, yardstick, options, calls = FAMILIES[family]
    if layout == "left-padded":
        yardstick = reference = "fmha"
    else:
        reference = "eager"
    model, yardstick_model, reference_model = models(transformers, config_class, yardstick,
                                                     reference=reference, **options)
    inputs, labels = training_batch(layout)
    try:
        for call in calls:
            needs_instance(**call)
    except pytest.skip.Exception:
        if not jit.enabled():
            with pytest.raises(fmha.MissingInstanceError, match="FMHA_FILTER="):
                gradients(model, inputs, labels)
            return
        # Compile on demand builds what the build lacks: the step runs, checked as any other.
    got = gradients(model, inputs, labels)
    with monkeypatch.context() as patch:
        if layout == "left-padded":
            patch.setattr(fmha, "fwd", exact_fwd)
        want = gradients(reference_model, inputs, labels)
        yardstick_got = gradients(yardstick_model, inputs, labels)
    distance = (got - want).norm() / want.norm()
    yardstick_distance = (yardstick_got - want).norm() / want.norm()
    assert distance <= GRADIENT_SLACK * yardstick_distance, (
        f"fmha's gradients are {distance:.3e} from the float32 model's, the yardstick's "
        f"{yardstick_distance:.3e}")


# ---- SDPA's flash backend -------------------------------------------------------------------


def sdpa_problem(heads_k, seqlen_q=300, seqlen_k=300, seed=2):
    """SDPA's (batch, heads, seqlen, head_dim) bf16 q, k, v that need grad, and a gradient."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)

    def tensor(heads, seqlen):
        return torch.randn(2, heads, seqlen, HEAD_DIM, generator=generator, device=DEVICE,
                           dtype=DTYPE).requires_grad_()

    return (tensor(8, seqlen_q), tensor(heads_k, seqlen_k), tensor(heads_k, seqlen_k),
            torch.randn(2, 8, seqlen_q, HEAD_DIM, generator=generator, device=DEVICE, dtype=DTYPE))


def flash_sdpa(q, k, v, dout, **options):
    """F.scaled_dot_product_attention on its flash backend: the output and q, k, v's grads."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, **options)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("heads_k,seqlen_q,is_causal", [
    (8, 300, True), (8, 300, False), (8, 77, False), (2, 300, True)],
    ids=["causal", "full", "q-shorter", "gqa-causal"])
def test_sdpa_flash_backend_runs_fmha(heads_k, seqlen_q, is_causal):
    q, k, v, dout = sdpa_problem(heads_k, seqlen_q=seqlen_q)
    options = dict(is_causal=is_causal, enable_gqa=heads_k != 8)
    try:
        torchs = flash_sdpa(q, k, v, dout, **options)
    except RuntimeError as exc:  # torch's flash backend refuses the problem
        pytest.skip(f"torch's flash backend does not run it: {exc}")
    sdpa.register()
    try:
        fmhas = flash_sdpa(q, k, v, dout, **options)
        assert torch.nn.attention.current_flash_attention_impl() == "fmha"
    finally:
        sdpa.unregister()
    assert torch.nn.attention.current_flash_attention_impl() is None

    # fmha's kernel ran: its output is fmha.fwd's, bit for bit.
    direct = fmha.fwd(*(t.detach().transpose(1, 2) for t in (q, k, v)), causal=is_causal,
                      return_lse=True)[0]
    assert torch.equal(fmhas[0], direct.transpose(1, 2))
    # torch's own kernel is back.
    assert torch.equal(flash_sdpa(q, k, v, dout, **options)[0], torchs[0])

    grads = R.attention_grads(*(t.detach().transpose(1, 2) for t in (q, k, v)),
                              dout.transpose(1, 2), causal=is_causal)
    for name, got, want, exact in zip(("out", "dq", "dk", "dv"), fmhas, torchs,
                                      (grads.out, grads.dq, grads.dk, grads.dv)):
        assert_within_twice(got, want, exact.transpose(1, 2).float(), name)
