"""A LoRA-adapted linear layer's forward and backward as one autograd function.

PEFT computes `base(x) + lora_B(lora_A(dropout(x))) * scaling` module by module, and autograd
keeps every piece: a dropped-out copy of x, the [tokens, out] adapter product, its scaled copy
and the sum; in backward, the scaling's and the dropout's passes and a second [tokens, in]
input gradient added to the base's. For a rank-8 update that is a few percent of the layer's
FLOPs, those full-size passes cost as much as the update itself. Here:

- the rank-r products keep the rank as the rows of their result (`A @ xᵀ`, `Bᵀ @ gᵀ`, an
  [r, tokens] matrix): MKL served the transposed form, an output only r columns wide, up to
  several times slower (bench/experiments/lora_layouts.py);
- the adapter's product is accumulated into the base output, and its input gradient into the
  base's (`addmm_`, `addcmul_`), instead of being materialised and added;
- LoRA's scaling and the dropout's 1 / keep-probability are one scalar applied to the
  [r, tokens] intermediate, not to full-size activations;
- the dropout mask is kubetune.models.dropout's (the same draws and keep probability), kept as
  bools and applied as a 0/1 multiplier, which costs a fraction of `torch.where` on a bool mask.

The gradients are PEFT's up to float rounding (tests/models/test_fused_lora.py). Where PEFT's
forward would do more than vanilla LoRA (adapters disabled or merged, several active adapters,
DoRA and other variants, mixed-adapter batches, DTensors under tensor parallelism, a trainable
base weight), PEFT's own forward runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from kubetune.models.dropout import FastDropout, keep_mask


class _LoraLinear(torch.autograd.Function):
    """y = x Wᵀ + b + c · (x ⊙ keep) Aᵀ Bᵀ on 2-D x; c folds LoRA's scaling and the dropout's."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        keep: torch.Tensor | None,
        c: float,
    ) -> torch.Tensor:
        dropped = x if keep is None else x * keep.view(torch.uint8).to(x.dtype)
        h_t = (lora_a @ dropped.t()).mul_(c)  # [r, N], scaled
        y = F.linear(x, weight, bias).addmm_(h_t.t(), lora_b.t())
        ctx.save_for_backward(dropped, weight, lora_a, lora_b, keep, h_t)
        ctx.c = c
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dropped, weight, lora_a, lora_b, keep, h_t = ctx.saved_tensors
        need_x, _, _, need_a, need_b = ctx.needs_input_grad[:5]
        grad_h_t = (lora_b.t() @ grad.t()).mul_(ctx.c)  # [r, N]: d(loss)/d(dropped Aᵀ), transposed
        grad_a = grad_h_t @ dropped if need_a else None
        grad_b = (h_t @ grad).t() if need_b else None
        grad_x = None
        if need_x:
            grad_x = grad @ weight
            if keep is None:
                grad_x.addmm_(grad_h_t.t(), lora_a)
            else:
                grad_x.addcmul_(grad_h_t.t() @ lora_a, keep.view(torch.uint8).to(grad_x.dtype))
        return grad_x, None, None, grad_a, grad_b, None, None


def _plain(*tensors: torch.Tensor) -> bool:
    return all(type(t) in (torch.Tensor, nn.Parameter) for t in tensors)


def vanilla_adapter(layer: Any, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The one active adapter of a PEFT lora.Linear whose forward is plain LoRA, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1 or active[0] in layer.lora_variant:
        return None
    name = active[0]
    base, lora_a, lora_b = layer.get_base_layer(), layer.lora_A[name], layer.lora_B[name]
    trained_base = base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)
    if not isinstance(base, nn.Linear) or trained_base or lora_a.bias is not None:
        return None
    if lora_b.bias is not None or not isinstance(layer.lora_dropout[name], FastDropout | nn.Identity):
        return None
    if not _plain(x, base.weight, lora_a.weight, lora_b.weight):
        return None
    dtypes = {x.dtype, base.weight.dtype, lora_a.weight.dtype, lora_b.weight.dtype}
    # mixed dtypes without autocast: PEFT casts between its two paths; leave that to it
    return name if len(dtypes) == 1 or torch.is_autocast_enabled(x.device.type) else None


def fused_forward(layer: Any, x: torch.Tensor, name: str) -> torch.Tensor:
    """PEFT lora.Linear's forward for adapter `name` (vanilla_adapter said it is plain LoRA)."""
    base, dropout = layer.get_base_layer(), layer.lora_dropout[name]
    weight, bias, a, b = base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight
    device = x.device.type
    if torch.is_autocast_enabled(device):  # what autocast would run the products in
        dtype = torch.get_autocast_dtype(device)
        x, weight, a, b = (t.to(dtype) for t in (x, weight, a, b))
        bias = None if bias is None else bias.to(dtype)
    flat = x.reshape(-1, x.shape[-1])
    keep, c = None, float(layer.scaling[name])
    if isinstance(dropout, FastDropout) and dropout.training and dropout.threshold:
        keep, c = keep_mask(flat.shape, dropout.threshold, x.device), c * dropout.scale
    with torch.autocast(device, enabled=False):
        y = _LoraLinear.apply(flat, weight, bias, a, b, keep, c)
    return y.view(*x.shape[:-1], y.shape[-1])


class FusedLoraLinear(LoraLinear):
    """PEFT's lora.Linear, with plain LoRA's forward and backward fused (see the module docstring)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = vanilla_adapter(self, x, args, kwargs)
        return super().forward(x, *args, **kwargs) if name is None else fused_forward(self, x, name)


def use_fused_lora(model: nn.Module) -> int:
    """Give every PEFT lora.Linear of `model` the fused forward; returns how many."""
    layers = [m for m in model.modules() if type(m) is LoraLinear]
    for layer in layers:
        layer.__class__ = FusedLoraLinear
    return len(layers)
