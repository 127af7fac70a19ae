"""Attention for packed rows: each sample attends only to itself, at the cost of its own length.

A packed row of 512 tokens may hold five 100-token samples. Handing SDPA a block-diagonal
mask is correct but computes all 512x512 scores and leaves the fast causal kernel; on a
2-core CPU that made attention a quarter of a training step. Instead causal SDPA runs on
each sample's slice (the CPU analogue of flash-attention's varlen kernel): attention costs
sum(len_i^2) instead of 512^2, and a sample never sees another one.

Which kernel and dtype is fastest depends on the CPU; the measurements behind the choice
are in BENCHMARKS.md ("Attention kernel for packed rows", `bench/train/attention_kernels.py`).

Samples of up to GROUPED_MAX_TOKENS can take a second kernel (`grouped_up_to`, chosen by
measurement in kubetune.models.kernels): the scores as batched matmuls, the query heads that
share a key/value head stacked into the rows of one product (no repeated keys and values), in
blocks of query positions against the keys up to each block's end, the probabilities kept for
backward. It computes a little more than the causal half that flash computes and keeps the
probabilities, but its work is whole matmuls where flash's CPU kernel, above all its backward,
runs many small ones.

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


# the longest sample the grouped kernel takes: the probabilities it keeps grow with the square
# of the length (about H x L^2 / 2 per layer); up to here they stay a fraction of what the
# sample's other activations keep (tens of KiB per token per layer)
GROUPED_MAX_TOKENS = 512
# query positions per block of the grouped kernel: a tile, like flash's own, small enough that the
# masked triangle it computes is a small share of a sample's scores, large enough for whole
# matmuls rather than vector products
GROUPED_BLOCK = 64


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
    that share a key/value head are the rows of one product with it, position by position."""
    n, h, d = q.shape
    kv = k.shape[1]
    stacked = q.view(n, kv, h // kv, d).permute(1, 0, 2, 3).reshape(kv, n * (h // kv), d)
    out = _GroupedCausal.apply(stacked, k.transpose(0, 1), v.transpose(0, 1), scale)
    return out.view(kv, n, h // kv, d).permute(1, 0, 2, 3).reshape(n, h, d)


@functools.lru_cache(maxsize=2)
def _future(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool, True above the diagonal: the later keys a query must not see."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


def future_keys(n: int, device: torch.device) -> torch.Tensor:
    """[n, 1, n]: for each of n queries at the block's own n positions, the later keys; a
    slice of one cached square serves every block."""
    return _future(max(n, GROUPED_BLOCK), device)[:n, :n].unsqueeze(1)


class _GroupedCausal(torch.autograd.Function):
    """softmax(q kᵀ · scale, causal) v, q [KVH, L·G, D] (row l·G + j: position l, the j-th
    query head of the key/value head), k and v [KVH, L, D].

    The queries go in blocks of GROUPED_BLOCK positions, each against the keys up to its last
    position only: a block's scores are exactly its rows' softmax inputs (a query never sees
    a later key), and the masked part computed is a block's triangle, not half of the square.
    Each block's probabilities are kept for backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        kv, n, g = k.shape[0], k.shape[1], q.shape[1] // k.shape[1]
        outs, probs = [], []
        for start, end in blocks(n):
            rows = q[:, start * g : end * g]
            scores = torch.baddbmm(
                q.new_empty(kv, rows.shape[1], end), rows, k[:, :end].transpose(1, 2), beta=0, alpha=scale
            )
            # only the block's own positions (the last columns) hold later keys
            own = scores.view(kv, end - start, g, end)[..., start:]
            own.masked_fill_(future_keys(end - start, q.device), float("-inf"))
            probs.append(torch.softmax(scores, dim=-1))
            outs.append(torch.bmm(probs[-1], v[:, :end]))
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scale = scale
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *probs = ctx.saved_tensors
        n, g = k.shape[1], q.shape[1] // k.shape[1]
        grad_q = torch.empty_like(q)
        grad_k = grad_v = None
        # the last block (it sees every key) first: its products are the whole key/value
        # gradients, contiguous; the earlier blocks' are added to their leading rows
        for (start, end), p in reversed(list(zip(blocks(n), probs, strict=True))):
            rows, grad_rows = slice(start * g, end * g), grad[:, start * g : end * g]
            part_v = torch.bmm(p.transpose(1, 2), grad_rows)
            grad_scores = torch._softmax_backward_data(torch.bmm(grad_rows, v[:, :end].transpose(1, 2)), p, -1, p.dtype)
            grad_q[:, rows] = torch.bmm(grad_scores, k[:, :end]).mul_(ctx.scale)
            part_k = torch.bmm(grad_scores.transpose(1, 2), q[:, rows]).mul_(ctx.scale)
            if grad_k is None or grad_v is None:
                grad_k, grad_v = part_k, part_v
            else:
                grad_k[:, :end] += part_k
                grad_v[:, :end] += part_v
        return grad_q, grad_k, grad_v, None


def blocks(n: int) -> list[tuple[int, int]]:
    """Query positions 0..n-1 in blocks of GROUPED_BLOCK."""
    return [(s, min(n, s + GROUPED_BLOCK)) for s in range(0, n, GROUPED_BLOCK)]


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
