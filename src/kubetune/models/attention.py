"""Attention for packed rows: each sample attends only to itself, at the cost of its own length.

A packed row of 512 tokens may hold four 128-token samples. Handing SDPA a block-diagonal
mask is correct but computes all 512x512 scores and leaves the fast causal kernel; on a
2-core CPU that made attention 25% of a training step. Instead we run causal SDPA on each
sample's slice (the CPU analogue of flash-attention's varlen kernel), so attention costs
sum(len_i^2) instead of 512^2 and never crosses a sample boundary.

The segment boundaries travel from the collator to this function as the keyword
`kubetune_cu_seqlens` (cumulative lengths over the flattened batch, like flash-attention's
`cu_seq_lens`): transformers forwards unknown keyword arguments from the model's forward
down to the attention function. Without that keyword (generation, unpacked batches) the
stock SDPA path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "kubetune_packed"
SEGMENTS_KWARG = "kubetune_cu_seqlens"


def packed_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, T, D], key/value [B, KVH, T, D] -> ([B, T, H, D], None)."""
    cu = kwargs.get(SEGMENTS_KWARG)
    if cu is None or query.shape[2] == 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    b, h, t, d = query.shape
    if key.shape[1] != h:  # grouped-query attention: CPU flash backward is slow with enable_gqa
        key = key.repeat_interleave(h // key.shape[1], dim=1)
        value = value.repeat_interleave(h // value.shape[1], dim=1)
    lengths = [end - start for start, end in zip(cu[:-1], cu[1:])]
    # [B, H, T, D] -> [B*T, H, D], then split (not index) so autograd's backward is one cat.
    # fp32 inside: PyTorch's CPU flash kernel is several times faster in fp32 than in bf16
    # for short sequences, and these tensors are small.
    dtype = query.dtype
    qs = query.transpose(1, 2).reshape(b * t, h, d).float().split(lengths)
    ks = key.transpose(1, 2).reshape(b * t, h, d).float().split(lengths)
    vs = value.transpose(1, 2).reshape(b * t, h, d).float().split(lengths)
    p = dropout if module.training else 0.0
    outs = [
        F.scaled_dot_product_attention(
            qi.transpose(0, 1).unsqueeze(0), ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scaling, dropout_p=p,
        ).squeeze(0).transpose(0, 1)
        for qi, ki, vi in zip(qs, ks, vs)
    ]
    out = torch.cat(outs, dim=0).reshape(b, t, h, d).to(dtype)
    return out, None


def register() -> str:
    """Make the implementation known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    return ATTN_IMPLEMENTATION


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> list[int]:
    """Cumulative segment boundaries over the flattened batch; a segment starts where position_id == 0."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0, as_tuple=False).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return starts + [flat.numel()]
