"""Llama's RMSNorm as one autograd function: the same result in fewer passes over the activations.

transformers' LlamaRMSNorm (and every model whose RMSNorm forward is the same code) is five
tensor operations, and autograd differentiates each one: a step of a LoRA run on CPU spends a
few percent of its time in the norms' forward and backward passes over [tokens x hidden]
activations, most of it moving memory rather than computing. Here the forward takes three
passes (a fused sum of squares, the scaling, the weight) and the backward four
(`bench/experiments/norm_parts.py` times both forms), from the input and the per-token scale
alone:

    y = w * (x * r),  r = 1 / sqrt(mean(x^2) + eps)
    dx = r * (g - x * r^2 * mean(g * x)),  g = dy * w

The result, gradients included, equals transformers' to float rounding
(tests/models/test_fused_norm.py); a norm whose forward is not Llama's keeps its own.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn


class _RMSNorm(torch.autograd.Function):
    """y = w · x / sqrt(mean(x²) + eps) over the last dimension, computed in fp32 and cast to
    the input's dtype before the weight, as transformers' LlamaRMSNorm does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        n = x.shape[-1]
        rstd = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(n).add_(eps).rsqrt_()
        normed = (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        return normed.mul_(weight) if normed.dtype == out_dtype else normed * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        x32 = x.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            normed = (x32 * rstd).to(x.dtype)
            grad_weight = (grad * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        g = (grad * weight).float()
        dot = torch.linalg.vecdot(g, x32, dim=-1).unsqueeze(-1)
        coef = rstd.square().mul_(dot).div_(-x.shape[-1])
        grad_x = g.addcmul_(x32, coef).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None


class FusedRMSNorm(nn.Module):
    """Marker class: an RMSNorm whose forward is `_RMSNorm` (the class is swapped in place)."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if type(hidden_states) is not torch.Tensor or type(self.weight.data) is not torch.Tensor:
            return llama_rms_norm(self, hidden_states)  # DTensors (tensor parallelism): the reference code
        return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def llama_rms_norm(module: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward(module, hidden_states)


@functools.cache
def _forward_source(cls: Any) -> str | None:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether `module`'s forward is LlamaRMSNorm's code (Mistral's, Qwen2's and others are copies)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cls: Any = type(module)
    if cls is LlamaRMSNorm:
        return True
    source = _forward_source(cls)
    return source is not None and source == _forward_source(LlamaRMSNorm) and hasattr(module, "variance_epsilon")


def use_fused_norms(model: nn.Module) -> int:
    """Give every Llama-style RMSNorm of `model` the fused forward; returns how many."""
    norms = [m for m in model.modules() if is_llama_rms_norm(m) and not isinstance(m, FusedRMSNorm)]
    for norm in norms:
        cls: Any = type(norm)
        norm.__class__ = fused_class(cls)
    return len(norms)


@functools.cache
def fused_class(cls: Any) -> type:
    """`cls` with the fused forward: still an instance of `cls` for whoever checks."""
    return type(f"Fused{cls.__name__}", (FusedRMSNorm, cls), {})
