"""python -m bench --generate: decode end to end, as transformers users run it. Greedy
generate() of a randomly initialised Llama-family model (no download), eager, host time
included, with attn_implementation="fmha" against "sdpa" on the same weights.

The model is Llama 3.2 1B's shape by default (--hidden 2048, --model-layers 16, 32 query heads
on --model-kv-heads 8 K/V heads of --model-head-dim 64, MLP 4 x hidden), with a smaller
vocabulary (--vocab 32000) so that the output layer weighs less against the layers. Per case
(batch x prompt length): the prefill is the time of generate() with one new token; a decode
step is (the time with --new-tokens tokens - the prefill's) / (--new-tokens - 1), each round's
own pair. Each is the median over --rounds rounds that take the two implementations in turn.
--left-pad pads a quarter of each batch's rows to half the prompt (a left-padded batch: the
prefill runs varlen, each decode step's keys start past the padding). transformers' own cache
(DynamicCache) holds the keys, so a step also pays for its growth, for both implementations.
"""

import gc
import statistics
import time

import torch

IMPLEMENTATIONS = ("fmha", "sdpa")


def build_model(args):
    """The model in bf16 on the GPU, fmha registered with transformers."""
    import transformers

    import fmha.integrations.transformers as fmha_transformers

    fmha_transformers.register()
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.model_layers, head_dim=args.model_head_dim,
        num_attention_heads=args.hidden // args.model_head_dim,
        num_key_value_heads=args.model_kv_heads, pad_token_id=0, bos_token_id=None,
        eos_token_id=None, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


def _prompts(batch, prompt, vocab, left_pad):
    """Random token ids and their attention mask; with left_pad a quarter of the rows (at least
    one) keep only the last half of the prompt."""
    ids = torch.randint(1, vocab, (batch, prompt), device="cuda")
    mask = torch.ones_like(ids)
    if left_pad:
        mask[: max(1, batch // 4), : prompt // 2] = 0
    return ids * mask, mask


def _seconds(model, ids, mask, new_tokens):
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        # No end-of-sequence token: every call generates new_tokens tokens.
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_generate_case(model, batch, prompt, args):
    """One row: each implementation's prefill and decode step in ms (medians over the rounds)
    and the step's spread (max / min - 1). A round times generate() with one token, then with
    --new-tokens, and takes the step from that pair, so that a slow round moves one estimate;
    the garbage collector is off while a round runs (an eager step is mostly host time)."""
    row = {"batch": batch, "prompt": prompt, "new_tokens": args.new_tokens,
           "left_pad": args.left_pad}
    ids, mask = _prompts(batch, prompt, args.vocab, args.left_pad)
    prefills = {name: [] for name in IMPLEMENTATIONS}
    steps = {name: [] for name in IMPLEMENTATIONS}
    for name in IMPLEMENTATIONS:  # warm-up: kernels loaded, allocator grown
        model.set_attn_implementation(name)
        _seconds(model, ids, mask, args.new_tokens)
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.rounds):
            for name in IMPLEMENTATIONS:
                model.set_attn_implementation(name)
                prefill = _seconds(model, ids, mask, 1)
                total = _seconds(model, ids, mask, args.new_tokens)
                prefills[name].append(prefill)
                steps[name].append((total - prefill) / (args.new_tokens - 1))
    finally:
        gc.enable()
    for name in IMPLEMENTATIONS:
        row[f"{name}_prefill_ms"] = statistics.median(prefills[name]) * 1e3
        row[f"{name}_step_ms"] = statistics.median(steps[name]) * 1e3
        row[f"{name}_step_spread"] = max(steps[name]) / min(steps[name]) - 1
    return row


def format_rows(rows) -> str:
    header = (f"{'batch x prompt':>16} {'prefill fmha':>13} {'prefill sdpa':>13} "
              f"{'step fmha':>10} {'spread':>7} {'step sdpa':>10} {'spread':>7} "
              f"{'sdpa/fmha step':>15}")
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['batch']:>7} x {r['prompt']:<6} {r['fmha_prefill_ms']:>13.2f} "
            f"{r['sdpa_prefill_ms']:>13.2f} {r['fmha_step_ms']:>10.2f} "
            f"{r['fmha_step_spread']:>6.0%} {r['sdpa_step_ms']:>10.2f} "
            f"{r['sdpa_step_spread']:>6.0%} {r['sdpa_step_ms'] / r['fmha_step_ms']:>14.2f}x")
    return "\n".join(lines)
