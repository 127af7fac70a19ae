"""The fused RMSNorm computes what transformers' LlamaRMSNorm computes, gradients included, and
replaces only norms whose forward is Llama's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kubetune.models.fused_norm import FusedRMSNorm, is_llama_rms_norm, use_fused_norms
from tests.kit.models import assert_same_step, loss_and_grads, tiny_model


def norm_pair(dtype: torch.dtype, weight_dtype: torch.dtype, trainable: bool) -> tuple[nn.Module, nn.Module]:
    g = torch.Generator().manual_seed(0)
    ref = LlamaRMSNorm(48, eps=1e-5).to(weight_dtype)
    ref.weight.data.copy_(torch.rand(48, generator=g) + 0.5)
    ref.weight.requires_grad_(trainable)
    fused = LlamaRMSNorm(48, eps=1e-5).to(weight_dtype)
    fused.weight.data.copy_(ref.weight.data)
    fused.weight.requires_grad_(trainable)
    assert use_fused_norms(fused) == 1
    return ref, fused


@pytest.mark.parametrize(
    ("dtype", "weight_dtype", "trainable", "tol"),
    [
        (torch.float32, torch.float32, False, 1e-5),
        (torch.float32, torch.float32, True, 1e-5),
        (torch.bfloat16, torch.bfloat16, True, 2e-2),
        (torch.bfloat16, torch.float32, False, 2e-2),  # autocast-style: fp32 weight, bf16 activations
    ],
)
def test_fused_norm_equals_transformers(dtype, weight_dtype, trainable, tol):
    ref, fused = norm_pair(dtype, weight_dtype, trainable)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 17, 48, generator=g) * 4).to(dtype)
    grad = torch.randn(3, 17, 48, generator=g)
    results = []
    for module in (ref, fused):
        xi = x.clone().requires_grad_()
        out = module(xi)
        out.backward(grad.to(out.dtype))
        results.append((out.detach(), xi.grad, module.weight.grad))
    (out_r, dx_r, dw_r), (out_f, dx_f, dw_f) = results
    assert out_f.dtype == out_r.dtype and dx_f.dtype == dx_r.dtype
    torch.testing.assert_close(out_f.float(), out_r.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(dx_f.float(), dx_r.float(), atol=tol, rtol=tol)
    if trainable:
        torch.testing.assert_close(dw_f.float(), dw_r.float(), atol=tol * 10, rtol=tol)
    else:
        assert dw_f is None and dw_r is None


def test_only_llama_style_norms_are_replaced():
    class OnePlusWeightNorm(LlamaRMSNorm):  # Gemma's kind: another formula
        def forward(self, hidden_states):
            return (1 + self.weight) * hidden_states

    assert is_llama_rms_norm(LlamaRMSNorm(8)) and not is_llama_rms_norm(OnePlusWeightNorm(8))
    model = nn.Sequential(LlamaRMSNorm(8), OnePlusWeightNorm(8), nn.LayerNorm(8))
    assert use_fused_norms(model) == 1
    assert isinstance(model[0], FusedRMSNorm) and isinstance(model[0], LlamaRMSNorm)
    assert not isinstance(model[1], FusedRMSNorm)
    assert use_fused_norms(model) == 0  # idempotent


def test_a_tiny_llama_gives_the_same_loss_and_gradients(tokenizer):
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(2))
    results = []
    for fused in (False, True):
        model = tiny_model(tokenizer, seed=5)
        if fused:
            assert use_fused_norms(model) == 2 * model.config.num_hidden_layers + 1
        results.append(loss_and_grads(model, input_ids=ids, labels=ids))
    assert_same_step(*results)
