"""Attention for packed rows: each sample attends only to itself, at the cost of its own length.

A packed row of 512 tokens may hold five 100-token samples. Handing SDPA a block-diagonal
mask is correct but computes all 512x512 scores and leaves the fast causal kernel; on a
2-core CPU that made attention a quarter of a training step. Instead causal SDPA runs on
each sample's slice (the CPU analogue of flash-attention's varlen kernel): attention costs
sum(len_i^2) instead of 512^2, and a sample never sees another one.

Which kernel and dtype is fastest depends on the CPU; the measurements behind the choice
are in BENCHMARKS.md ("Attention kernel for packed rows", `bench/train/attention_kernels.py`).

Short samples can take a second kernel (`grouped_up_to`, chosen by measurement in
kubetune.models.kernels): the whole score square of a sample as batched matmuls, each key/value
head's group of query heads stacked into the rows of one product (no repeated keys and values),
the probabilities kept for backward. It computes twice the causal half that flash computes and
keeps H x L^2 probabilities, so it can only win where flash's blocked loops cost more than that
(short samples); `GROUPED_MAX_TOKENS` bounds the memory it may keep.

The segment lengths reach this function through the keyword `kubetune_seqlens`: transformers
forwards unknown keyword arguments from the model's forward down to the attention function.
Without it (generation, plain batches) the stock SDPA path runs.

On an accelerator the per-sample loop is the wrong shape of work: each slice is a small
kernel launch (dozens per layer), and on Gaudi every batch would also be a new graph (lazy
and graph mode compile one per shape). There the whole row goes through one SDPA call with a
block-diagonal causal mask that keeps samples apart: Habana's fused SDPA on Gaudi, torch's
(its memory-efficient kernel takes the mask) on CUDA. The mask costs T^2 scores per row, a
small share of a step at these row lengths next to the projections; flash-attention's
varlen kernel would skip the masked blocks (`bench/train/attention_gpu.py` compares them).
Rows so long that the micro-batch's mask would pass 1 GiB keep the per-sample loop on CUDA.
The Batcher pads rows to a few static lengths on HPU (`kubetune.data.packing.shape_buckets`)
so that the same graphs run every step.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "kubetune_packed"
SEQLENS_KWARG = "kubetune_seqlens"
PREFIXES_KWARG = "kubetune_prefixes"  # Batch.prefixes: segments that continue a shared prompt

log = logging.getLogger("kubetune")


def seqlens_from_cu(cu: list[int]) -> list[int]:
    """Segment lengths from cumulative boundaries over the flattened batch."""
    return [e - s for s, e in itertools.pairwise(cu) if e > s]


# the longest sample the grouped kernel takes: its kept probabilities (H x L^2 per layer) stay
# a fraction of what the sample's other activations keep (tens of KiB per token per layer)
GROUPED_MAX_TOKENS = 256


def per_sample_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[int],
    scaling: float | None,
    dropout: float,
    upcast: bool,
    prefixes: list[int] | None = None,
    grouped_up_to: int = 0,
) -> torch.Tensor:
    """Causal attention of each packed sample with itself: [B, H, T, D], key/value [B, KVH, T, D]
    -> [B, T, H, D]. A segment with a prefix (`prefixes[i]` >= 0, Batch.prefixes) attends to
    all of that earlier segment too, as if its tokens came right after it.

    `upcast` runs the kernel in fp32 (the inputs' dtype otherwise); samples of at most
    `grouped_up_to` tokens take the grouped kernel (module docstring), the others flash. Which
    is faster depends on the CPU, so kubetune.models.kernels measures both.
    """
    b, h, t, d = query.shape
    dtype = query.dtype
    scale = scaling if scaling is not None else d**-0.5

    def segments(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # [B, heads, T, D] -> per sample [len, heads, D]; split, so that backward is one cat
        flat = x.transpose(1, 2).reshape(b * t, x.shape[1], d)
        return (flat.float() if upcast else flat).split(lengths)

    qs, ks, vs = segments(query), segments(key), segments(value)
    outs = []
    for i, qi in enumerate(qs):
        p = prefixes[i] if prefixes else -1
        if p < 0 and not dropout and lengths[i] <= grouped_up_to:
            outs.append(grouped_causal_attention(qi, ks[i], vs[i], scale))
            continue
        ki, vi = flash_heads(ks[i], h), flash_heads(vs[i], h)
        if p < 0:
            out = F.scaled_dot_product_attention(
                flash_heads(qi, h), ki, vi, is_causal=True, scale=scaling, dropout_p=dropout
            )
        else:
            ki, vi = torch.cat((flash_heads(ks[p], h), ki), dim=2), torch.cat((flash_heads(vs[p], h), vi), dim=2)
            mask = after_prefix_mask(lengths[i], lengths[p], qi.device)
            out = F.scaled_dot_product_attention(
                flash_heads(qi, h), ki, vi, attn_mask=mask, scale=scaling, dropout_p=dropout
            )
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs).reshape(b, t, h, d).to(dtype)


def flash_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """One sample [len, kv, D] as SDPA's [1, heads, len, D], key/value heads repeated to
    `heads`: CPU flash backward is slow with enable_gqa."""
    x = x.transpose(0, 1)
    if x.shape[0] != heads:
        x = x.repeat_interleave(heads // x.shape[0], dim=0)
    return x.unsqueeze(0)


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sample's causal attention, q [L, H, D], k/v [L, KVH, D] -> [L, H, D]: the query heads
    that share a key/value head are the rows of one product with it."""
    n, h, d = q.shape
    kv = k.shape[1]
    g = h // kv
    stacked = q.view(n, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * n, d)
    out = _GroupedCausal.apply(stacked, k.transpose(0, 1), v.transpose(0, 1), scale)
    return out.view(kv, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d)


@functools.lru_cache(maxsize=8)
def _future(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool, True above the diagonal: the later keys a query must not see. Slices of
    one cached square serve every shorter sample."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


def future_mask(n: int, device: torch.device) -> torch.Tensor:
    return _future(GROUPED_MAX_TOKENS, device)[:n, :n] if n <= GROUPED_MAX_TOKENS else _future(n, device)


class _GroupedCausal(torch.autograd.Function):
    """softmax(q kᵀ · scale, causal) v on [KVH, G·L, D] queries (G query heads per key/value
    head, stacked) and [KVH, L, D] keys and values; the probabilities are kept for backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        kv, rows, _ = q.shape
        n = k.shape[1]
        scores = torch.baddbmm(q.new_empty(kv, rows, n), q, k.transpose(1, 2), beta=0, alpha=scale)
        scores.view(kv, rows // n, n, n).masked_fill_(future_mask(n, q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale = scale
        return torch.bmm(probs, v)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, probs = ctx.saved_tensors
        grad_v = torch.bmm(probs.transpose(1, 2), grad)
        grad_probs = torch.bmm(grad, v.transpose(1, 2))
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        grad_q = torch.baddbmm(torch.empty_like(q), grad_scores, k, beta=0, alpha=ctx.scale)
        grad_k = torch.baddbmm(torch.empty_like(k), grad_scores.transpose(1, 2), q, beta=0, alpha=ctx.scale)
        return grad_q, grad_k, grad_v, None


@functools.lru_cache(maxsize=256)  # a group's completions have a few lengths; every layer asks again
def after_prefix_mask(length: int, prefix: int, device: torch.device) -> torch.Tensor:
    """[length, prefix + length] bool: each token of a segment sees the whole prefix and its
    own segment up to itself (causal, aligned to the bottom right)."""
    return torch.ones(length, prefix + length, dtype=torch.bool, device=device).tril(diagonal=prefix)


def expand_kv_heads(key: torch.Tensor, value: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query key/value heads repeated to `heads`: CPU flash backward is slow with
    enable_gqa, and Habana's fused SDPA has needed equal head counts."""
    if key.shape[1] == heads:
        return key, value
    return key.repeat_interleave(heads // key.shape[1], dim=1), value.repeat_interleave(heads // value.shape[1], dim=1)


# the largest block-diagonal mask (bytes, all rows of a micro-batch) CUDA builds; longer rows
# keep the per-sample loop, whose cost follows the samples rather than the row's T^2
CUDA_MASK_BYTES = 2**30


def whole_rows_on_cuda(query: torch.Tensor) -> bool:
    """Whether a CUDA batch [B, H, T, D] takes one masked call over whole rows."""
    b, _, t, _ = query.shape
    return query.device.type == "cuda" and b * t * t * query.element_size() <= CUDA_MASK_BYTES


def on_hpu(x: torch.Tensor) -> bool:
    return x.device.type == "hpu"


@functools.cache
def fused_sdpa() -> Any | None:
    """Habana's FusedSDPA kernel, or None where this SynapseAI has none (warned once)."""
    try:
        from habana_frameworks.torch.hpex.kernels import FusedSDPA
    except ImportError:
        log.warning(
            "attention: habana_frameworks.torch.hpex.kernels.FusedSDPA is missing (older SynapseAI); "
            "packed rows use torch SDPA with a block-diagonal mask"
        )
        return None
    return FusedSDPA


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the model computes in: autocast's where it is on, else the tensor's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


@functools.lru_cache(maxsize=1)  # every layer of one forward asks for the same mask
def block_causal_mask(
    lengths: tuple[int, ...],
    rows: int,
    t: int,
    dtype: torch.dtype,
    device: torch.device,
    prefixes: tuple[int, ...] = (),
) -> torch.Tensor:
    """Additive [B, 1, T, T] mask over packed rows: 0 where a token may attend (an earlier or
    the same position of its own segment, or any of the prefix segment it continues), the
    dtype's minimum everywhere else."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).view(rows, t).to(device)
    pos = torch.arange(t, device=device)
    allowed = (segment[:, :, None] == segment[:, None, :]) & (pos[:, None] >= pos[None, :])
    if prefixes:  # a prefix sits earlier in the same row (GRPO's packing keeps a group in one row)
        prefix_of = torch.tensor(prefixes, device=device)[segment]
        allowed |= prefix_of[:, :, None] == segment[:, None, :]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


def fused_packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[int],
    scaling: float | None,
    dropout: float,
    upcast: bool = False,
    prefixes: list[int] | None = None,
    kernel: Any | None = None,
) -> torch.Tensor:
    """Causal attention of packed samples, each with itself (and its prefix segment, if any), in
    one call over whole rows (accelerators): [B, H, T, D] x3 -> [B, T, H, D], in the compute
    dtype (fp32 with `upcast`, the recipe's model.packed_attention=fp32). `kernel` is Habana's
    FusedSDPA (`fused_sdpa()`); without it torch's SDPA runs."""
    b, h, t, _ = query.shape
    dtype = torch.float32 if upcast else compute_dtype(query)
    key, value = expand_kv_heads(key, value, h)
    query, key, value = (x.to(dtype) for x in (query, key, value))
    mask = block_causal_mask(tuple(lengths), b, t, dtype, query.device, tuple(prefixes or ()))
    with torch.autocast(query.device.type, enabled=False):  # the dtype chosen above, not autocast's list
        if kernel is None:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
        else:
            # is_causal=False: the mask carries causality and the sample boundaries (no row of
            # it is all masked: a token always sees itself). softmax_mode "None" is the exact
            # softmax ("fast" is for inference); recompute_mode=True recomputes the
            # probabilities in backward instead of keeping [T, T] per head, flash-style;
            # valid_sequence_lengths=None: padding is a segment of its own in the mask.
            out = kernel.apply(query, key, value, mask, dropout, False, scaling, "None", True, None, "right")
    return out.transpose(1, 2).contiguous()


def _packed_forward(upcast: bool, grouped_up_to: int = 0) -> Any:
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
        prefixes = kwargs.get(PREFIXES_KWARG)
        if on_hpu(query) or whole_rows_on_cuda(query):  # one call over whole rows (module docstring)
            kernel = fused_sdpa() if on_hpu(query) else None
            return fused_packed_attention(query, key, value, lengths, scaling, p, upcast, prefixes, kernel), None
        return per_sample_attention(query, key, value, lengths, scaling, p, upcast, prefixes, grouped_up_to), None

    return forward


packed_attention_forward = _packed_forward(upcast=True)  # the fp32 kernel, as benchmarks call it

# attention kind (kubetune.models.kernels) -> the name transformers knows the implementation by
IMPLEMENTATIONS = {"fp32": ATTN_IMPLEMENTATION, "native": ATTN_IMPLEMENTATION + "_native"}


def register(kind: str = "fp32", grouped_up_to: int = 0) -> str:
    """Make the implementation of `kind` known to transformers (idempotent), with samples of
    at most `grouped_up_to` tokens on the grouped kernel; returns its name."""
    from transformers import AttentionInterface

    name = IMPLEMENTATIONS[kind] + (f"_grouped{grouped_up_to}" if grouped_up_to else "")
    AttentionInterface.register(name, _packed_forward(upcast=kind == "fp32", grouped_up_to=grouped_up_to))
    return name
