"""fmha behind the attention APIs of other libraries; each module is imported on its own.

    import fmha.integrations.transformers
    fmha.integrations.transformers.register()   # attn_implementation="fmha" in transformers
    import fmha.integrations.sdpa
    fmha.integrations.sdpa.register()           # F.scaled_dot_product_attention's flash backend

transformers: AutoModelForCausalLM.from_config(cfg, attn_implementation="fmha"), or
model.set_attn_implementation("fmha"), then runs its attention layers (padding masks, GQA,
sliding windows, soft-capping, generate() with its KV cache) on fmha.fwd. sdpa: unmodified
F.scaled_dot_product_attention code on CUDA runs fmha's kernels where its flash backend is
chosen, and torch's own FlashAttention-2 for dropout and for what no compiled fmha instance
serves. fmha.integrations.transformers imports transformers in register() alone.
"""
