"""FlashAttention-2's flash_attn.bert_padding: a padded batch packed into varlen tokens and back.

Plain torch on any device, differentiable: unpad_input gathers the tokens a mask keeps,
pad_input scatters them back with zeros in the padding.
"""

import torch

from fmha.integrations._flash import gather_tokens, pack_padding_mask, scatter_tokens


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The tokens of a padded batch, packed for the varlen functions.

    hidden_states: (batch, seqlen, ...). attention_mask: (batch, seqlen), nonzero where a token
    is. unused_mask (optional): (batch, seqlen), nonzero where a slot is allocated to a sequence
    but unused; such slots are packed with the tokens and counted in cu_seqlens, not in seqused.

    Returns (hidden_states (total, ...), indices (total,) int64 of the tokens in the flattened
    batch, cu_seqlens (batch + 1,) int32, max_seqlen_in_batch (int, read back to the host),
    seqused (batch,) int32: each sequence's tokens without its unused slots)."""
    kept = attention_mask if unused_mask is None else torch.logical_or(attention_mask,
                                                                       unused_mask)
    packed = pack_padding_mask(kept)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    return (gather_tokens(hidden_states, packed.indices), packed.indices, packed.cu_seqlens,
            packed.max_seqlen, seqused)


def pad_input(hidden_states, indices, batch, seqlen):
    """unpad_input undone: (total, ...) tokens at `indices` of the flattened batch ->
    (batch, seqlen, ...), zeros where no token is."""
    return scatter_tokens(hidden_states, indices, batch, seqlen)


def index_first_axis(input, indices):
    """input's rows at `indices` along its first axis: (n, ...) -> (len(indices), ...)."""
    return input.index_select(0, indices)


def index_put_first_axis(values, indices, first_axis_dim):
    """index_first_axis undone: (len(indices), ...) -> (first_axis_dim, ...), zeros elsewhere."""
    return values.new_zeros((first_axis_dim, *values.shape[1:])).index_copy(0, indices, values)
