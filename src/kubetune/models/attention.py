"""Attention for packed rows: each sample attends only to itself, at the cost of its own length.

A packed row of 512 tokens may hold five 100-token samples. Handing SDPA a block-diagonal
mask is correct but computes all 512x512 scores and leaves the fast causal kernel; on a
2-core CPU that made attention a quarter of a training step. Instead causal SDPA runs on
each sample's slice (the CPU analogue of flash-attention's varlen kernel): attention costs
sum(len_i^2) instead of 512^2, and a sample never sees another one.

Which kernel and dtype is fastest depends on the CPU; the measurements behind the choice
are in BENCHMARKS.md ("Attention kernel for packed rows", `bench/attention_kernels.py`).

The segment lengths reach this function through the keyword `kubetune_seqlens`: transformers
forwards unknown keyword arguments from the model's forward down to the attention function.
Without it (generation, plain batches) the stock SDPA path runs.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "kubetune_packed"
SEQLENS_KWARG = "kubetune_seqlens"


def seqlens_from_cu(cu: list[int]) -> list[int]:
    """Segment lengths from cumulative boundaries over the flattened batch."""
    return [e - s for s, e in itertools.pairwise(cu) if e > s]


def per_sample_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[int],
    scaling: float | None,
    dropout: float,
    upcast: bool,
) -> torch.Tensor:
    """Causal attention of each packed sample with itself: [B, H, T, D] x3 -> [B, T, H, D].

    `upcast` runs the kernel in fp32 (the inputs' dtype otherwise); which is faster depends
    on the CPU, so kubetune.models.kernels measures it.
    """
    b, h, t, d = query.shape
    if key.shape[1] != h:  # grouped-query attention: CPU flash backward is slow with enable_gqa
        key = key.repeat_interleave(h // key.shape[1], dim=1)
        value = value.repeat_interleave(h // value.shape[1], dim=1)
    dtype = query.dtype

    def segments(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # [B, H, T, D] -> per sample [1, H, len, D]; split, so that backward is one cat
        flat = x.transpose(1, 2).reshape(b * t, h, d)
        return tuple(s.transpose(0, 1).unsqueeze(0) for s in (flat.float() if upcast else flat).split(lengths))

    outs = [
        F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scaling, dropout_p=dropout)
        .squeeze(0)
        .transpose(0, 1)
        for qi, ki, vi in zip(segments(query), segments(key), segments(value))
    ]
    return torch.cat(outs).reshape(b, t, h, d).to(dtype)


def _packed_forward(upcast: bool) -> Any:
    def forward(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """query [B, H, T, D], key/value [B, KVH, T, D] -> ([B, T, H, D], None)."""
        lengths = kwargs.get(SEQLENS_KWARG)
        if lengths is None or query.shape[2] == 1:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        p = dropout if module.training else 0.0
        return per_sample_attention(query, key, value, lengths, scaling, p, upcast), None

    return forward


packed_attention_forward = _packed_forward(upcast=True)  # the fp32 kernel, as benchmarks call it

# attention kind (kubetune.models.kernels) -> the name transformers knows the implementation by
IMPLEMENTATIONS = {"fp32": ATTN_IMPLEMENTATION, "native": ATTN_IMPLEMENTATION + "_native"}


def register(kind: str = "fp32") -> str:
    """Make the implementation of `kind` known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    name = IMPLEMENTATIONS[kind]
    AttentionInterface.register(name, _packed_forward(upcast=kind == "fp32"))
    return name
