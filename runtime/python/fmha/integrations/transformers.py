"""fmha as a transformers attention implementation: attn_implementation="fmha".

    import fmha.integrations.transformers
    fmha.integrations.transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fmha",
                                             dtype=torch.bfloat16).cuda()
    model.set_attn_implementation("fmha")          # or switch a model already loaded

register() adds attention_forward to transformers' AttentionInterface and padding_mask to its
AttentionMaskInterface, the pair transformers' flash_attention_2 has: the model's mask
functions build only the 2D padding mask of the keys (None when nothing is padded), and
attention_forward packs the tokens it keeps into fmha.fwd's group (varlen) mode, with the
causal mask aligned bottom-right per sequence, so a left-padded batch's prefill runs one
fmha.fwd call per layer; the decode steps of generate() (up to 16 query tokens against the KV
cache) run fmha.fwd_kvcache on the cache as transformers holds it, a left-padded row's keys
counted from its first token (cache_leftpad). What the attention module asks for is passed
on: its scaling, sliding window, soft-capping, MQA/GQA (K/V with fewer heads) and, in
training, dropout (fmha.fwd's, whose backward autograd runs). Head dims that are not
multiples of 8 are zero-padded here. Sequences packed into one row (padding-free training)
are told apart as flash_attention_2 does: by the cu_seq_lens_q/cu_seq_lens_k and
max_length_q/max_length_k arguments, or by position ids that restart. A problem no compiled
instance serves (a sliding window, soft-capping or dropout in a build without them) raises
fmha.MissingInstanceError naming the filter that builds one.

Written against transformers 5.24 and run on 5.17; needs 4.53 or newer, which added
AttentionMaskInterface (register() raises ImportError saying so on an older one).
transformers is imported by register() alone: the functions here are plain torch. Where
versions differ: 5.x passes the mask functions q_length and q_offset, from which padding_mask
marks a static cache's written slots; 4.x passes cache_position instead, which it does not
read, and its generate() (4.53's, as read) keeps the 2D attention mask, which marks them.
"""

from importlib import metadata
from typing import Optional

import torch
import torch.nn.functional as F

from fmha.integrations._flash import flash_attention, pack_positions, window_size

# The name models take as attn_implementation once register() ran.
NAME = "fmha"

# transformers 4.53 added AttentionMaskInterface, through which the model's masks reach us as a
# 2D padding mask (AttentionInterface itself is older).
MIN_TRANSFORMERS = "4.53"


def register() -> None:
    """Registers fmha with transformers as attn_implementation="fmha": attention_forward with
    its AttentionInterface, padding_mask with its AttentionMaskInterface. Raises ImportError
    where transformers is missing or older than MIN_TRANSFORMERS."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:
        try:
            found = f"transformers {metadata.version('transformers')} is installed"
        except metadata.PackageNotFoundError:
            found = "transformers is not installed"
        raise ImportError(
            f"fmha.integrations.transformers needs transformers >= {MIN_TRANSFORMERS} (its "
            f"AttentionInterface and AttentionMaskInterface); {found}: pip install "
            f"'transformers>={MIN_TRANSFORMERS}'") from exc
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)


def padding_mask(batch_size: int, kv_length: int, attention_mask: Optional[torch.Tensor] = None,
                 q_length: Optional[int] = None, q_offset=0, mask_function=None, device=None,
                 **kwargs) -> Optional[torch.Tensor]:
    """The mask attention_forward gets from the model's mask functions: a bool (batch, keys)
    padding mask of the layer's keys, or None where every key is a token.

    flash_attention_2's (transformers.masking_utils.flash_attention_mask): the last kv_length
    columns of the model's 2D mask (a sliding-window layer's cache holds the last keys only),
    None where that is all ones. A mask shorter than kv_length stays as it is: a static
    cache's slots past it are unwritten, and attention_forward leaves them out.

    generate() keeps that mask for a static cache only for implementations named flash*, and
    drops it where nothing is padded. Then a causal mask (mask_function hides key 1 from query
    0: self-attention, not an encoder's or cross-attention's) over more keys than the tokens
    written once this step is, q_offset + q_length (transformers 5.x passes both), is a static
    cache's: the mask becomes all ones over the written slots. That reads a static layer's
    offset, a tensor, back to the host: once per forward, not per layer. kwargs: the rest of
    what transformers passes.
    """
    if attention_mask is None:
        if q_length is None or mask_function is None or _sees(mask_function, 0, 1):
            return None
        written = int(q_offset) + q_length
        if written >= kv_length:
            return None
        return torch.ones(batch_size, written, dtype=torch.bool, device=device)
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and attention_mask.all():
        return None
    return attention_mask


def _sees(mask_function, q_idx: int, kv_idx: int) -> bool:
    """Whether the model's mask function lets query q_idx see key kv_idx (of sequence 0, head
    0). The indices go in as 0-d tensors, as transformers passes them: the functions it
    composes (and_masks, for a causal mask over packed sequences) call tensor methods on them."""
    index = (torch.tensor(i) for i in (0, 0, q_idx, kv_idx))
    return bool(mask_function(*index))


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention call on fmha.fwd: query (batch, heads, seqlen_q, head_dim), key
    and value (batch, heads_k, seqlen_k, head_dim) as the attention module has them (the KV
    cache's keys included), attention_mask what padding_mask made. Returns (output (batch,
    seqlen_q, heads, head_dim_v), None): no attention weights, as flash_attention_2.

    is_causal defaults to the module's. Under torch.autocast, float32 queries and keys (a
    float32 model's rotary embedding makes them) run in the autocast dtype."""
    if s_aux is not None:
        raise NotImplementedError(
            "fmha: attention sinks (s_aux) have no fmha kernel; run this model with "
            "attn_implementation='sdpa' or 'eager'")
    _check_tensors(query, key, value, attention_mask, kwargs)
    causal = module.is_causal if is_causal is None else is_causal
    # The kernels take (batch, seqlen, heads, head_dim): views of the modules' layout.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    device_type = q.device.type
    if q.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    packed = {}
    cu_seq_lens_q, cu_seq_lens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        packed = dict(cu_seqlens_q=cu_seq_lens_q.to(torch.int32),
                      cu_seqlens_k=cu_seq_lens_k.to(torch.int32),
                      max_seqlen_q=int(kwargs["max_length_q"]),
                      max_seqlen_k=int(kwargs["max_length_k"]))
    elif (attention_mask is None and q.shape[0] == 1 and q.shape[1] > 1
          and q.shape[1] == k.shape[1] and kwargs.get("position_ids") is not None):
        position_ids = kwargs["position_ids"]
        if position_ids.numel() != q.shape[1]:  # each token's position, in the row's order
            raise ValueError(
                f"fmha: position_ids must hold one position per token, (1, seqlen) = (1, "
                f"{q.shape[1]}), got shape {tuple(position_ids.shape)}")
        sequences = pack_positions(position_ids)
        if sequences is not None:
            cu_seqlens, max_seqlen = sequences
            packed = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                          max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)

    out = flash_attention(q, k, v, causal=causal, softmax_scale=scaling,
                          sliding_window=sliding_window, softcap=softcap or 0.0,
                          dropout_p=dropout, padding_mask=attention_mask, **packed)
    if attention_mask is not None and q.shape[1] == attention_mask.shape[1]:
        # A prefill or a training step: the queries are the mask's slots, padding included (a
        # decode step's are its rows' newest tokens).
        out = _as_eager_on_blind_rows(out, v[:, :attention_mask.shape[1]], attention_mask,
                                      causal, sliding_window)
    return out, None


# The keyword arguments of transformers' attention call that attention_forward reads, besides
# the mask: the packed sequences' positions or their lengths (flash_attention_2's).
_PACKING_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                   "max_length_k")


def _check_tensors(query, key, value, attention_mask, kwargs: dict) -> None:
    """What attention_forward needs of its tensors before it uses them, checked first: query,
    key and value 4-D (it takes their transposes), a 2D attention_mask on their device (it
    indexes the keys by it), and no meta tensor (it reads the mask and the packed sequences'
    positions or lengths back to the host, and under autocast asks for the device's dtype).
    The shapes are flash_attention's to check."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fmha: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"fmha: {name} must be 4-D (batch, heads, seqlen, head_dim), got "
                             f"shape {tuple(t.shape)}")
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"fmha: attention_mask must be a torch.Tensor or None, got "
                        f"{type(attention_mask).__name__}")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"fmha: attention_mask must be the 2D padding mask that fmha's mask function makes, "
            f"got {attention_mask.dim()} dimensions; a mask built outside the model's mask "
            "functions (e.g. a 4D mask passed in) needs attn_implementation='sdpa' or 'eager'")
    for name, t in (("key", key), ("value", value), ("attention_mask", attention_mask)):
        if t is not None and t.device != query.device:
            raise ValueError(f"fmha: {name} is on {t.device} but query is on {query.device}; "
                             "query, key, value and attention_mask must be on one device")
    for name, t in {"query": query, **{n: kwargs.get(n) for n in _PACKING_KWARGS}}.items():
        if isinstance(t, torch.Tensor) and t.is_meta:
            raise ValueError(f"fmha: {name} is on meta; fmha needs CUDA tensors (attention_forward "
                             "reads the padding mask and the packed sequences' positions and "
                             "lengths, which meta tensors do not hold)")


def _as_eager_on_blind_rows(out: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor,
                            causal: bool, sliding_window: Optional[int]) -> torch.Tensor:
    """out with the rows of queries that see no token (a left-padded row's padding, under a
    causal mask) as transformers' eager attention has them: the mean of V over all the row's
    keys, where fmha.fwd (as FlashAttention) gives 0. Eager's additive mask puts the dtype's
    minimum on every key of such a row, which swamps the scores, so its softmax is uniform.
    These rows reach the loss: the padding slot before a row's first token predicts that
    token, and labels that are -100 on padding only keep it. With 0 there, a random Llama's
    gradients (bf16, 3 x 777 tokens, rows left-padded by 100 and 500) were 1.47x as far from
    the float32 model's as eager's and SDPA's; with eager's rows, 1.00x (H200, 2026-11-27).
    Their gradient is this value's: it reaches V only. Eager's autograd also sends them one
    through the softmax into q and k, as though the mask had not swamped their scores (the
    derivative of no function eager computes); fmha does not copy that, so a left-padded step's
    gradients differ from eager's by it (tests/test_integrations_gpu.py's training test).

    v (batch, seqlen_k, heads_k, head_dim_v) are the keys' values; out (batch, seqlen_q,
    heads, head_dim_v) the queries', aligned with the last seqlen_q keys."""
    batch, seqlen_q, heads = out.shape[:3]
    seqlen_k = padding_mask.shape[1]
    left, right = window_size(sliding_window, causal, seqlen_k)
    # Each query's visible keys [first, last]: it is aligned with key `aligned`.
    aligned = torch.arange(seqlen_k - seqlen_q, seqlen_k, device=out.device)
    first = (aligned - left).clamp(min=0) if left >= 0 else torch.zeros_like(aligned)
    if causal:
        last = aligned
    else:
        last = (aligned + right).clamp(max=seqlen_k - 1) if right >= 0 else \
            torch.full_like(aligned, seqlen_k - 1)
    tokens_before = F.pad(padding_mask.to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))
    seen = tokens_before[:, last + 1] - tokens_before[:, first]  # (batch, seqlen_q)
    accumulate = torch.promote_types(v.dtype, torch.float32)
    mean_v = v.mean(dim=1, dtype=accumulate).repeat_interleave(heads // v.shape[2], dim=1)
    return torch.where((seen == 0)[:, :, None, None], mean_v[:, None].to(out.dtype), out)
