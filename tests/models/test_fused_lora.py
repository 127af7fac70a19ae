"""The fused LoRA linear layer against PEFT's own forward: the same outputs and gradients
(the same dropout draws), and PEFT's path wherever the layer is more than plain LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from kubetune.models.dropout import use_fast_dropout
from kubetune.models.fused_lora import FusedLoraLinear, use_fused_lora


class Block(nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(48, 40, bias=bias)
        self.v_proj = nn.Linear(48, 24, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x).sum(-1) + self.v_proj(x).sum(-1)


def peft_pair(dropout: float = 0.0, bias: bool = False, **config) -> tuple[nn.Module, nn.Module]:
    """(PEFT's model, the same model with the fused layers), with lora_B not zero."""
    torch.manual_seed(0)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **config}
    model = get_peft_model(Block(bias), LoraConfig(lora_dropout=dropout, **config))
    use_fast_dropout(model)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)
    fused = copy.deepcopy(model)
    assert use_fused_lora(fused) == 2
    return model, fused


def outputs_and_grads(model: nn.Module, x: torch.Tensor, seed: int = 1) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad()
    torch.manual_seed(seed)  # the dropout's draws
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    return [y.detach(), x.grad, *grads]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("bias", [False, True])
def test_outputs_and_gradients_are_pefts(dropout, bias):
    model, fused = peft_pair(dropout, bias)
    x = torch.randn(3, 7, 48)
    want, got = outputs_and_grads(model.train(), x), outputs_and_grads(fused.train(), x)
    assert len(want) == len(got) == 6  # y, x.grad, A and B of both layers
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_the_dropout_is_drawn_in_training_only():
    _, fused = peft_pair(dropout=0.5)
    x = torch.randn(2, 5, 48)
    torch.manual_seed(1)
    a = fused.train()(x)
    torch.manual_seed(2)
    assert not torch.equal(a, fused(x))  # other draws, another output
    assert torch.equal(fused.eval()(x), fused(x))


def test_a_frozen_input_gets_no_gradient_and_empty_batches_pass():
    _, fused = peft_pair()
    y = fused(torch.randn(2, 5, 48))  # x without requires_grad: only the adapters' gradients
    y.sum().backward()
    assert all(p.grad is not None for n, p in fused.named_parameters() if "lora_" in n)
    assert fused(torch.randn(0, 5, 48)).shape == (0, 5)


def test_autocast_runs_the_products_in_its_dtype_and_the_adapters_stay_fp32():
    model, fused = peft_pair()
    x = torch.randn(2, 6, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model.q_proj(x)
        got = fused.q_proj(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    a = fused.q_proj.lora_A["default"].weight
    assert a.dtype == torch.float32 and a.grad is not None and a.grad.dtype == torch.float32


def test_disabled_and_merged_adapters_take_pefts_path():
    model, fused = peft_pair()
    x = torch.randn(2, 5, 48)
    with fused.disable_adapter():
        base = fused(x)
    torch.testing.assert_close(base, fused.get_base_model().q_proj.base_layer(x).sum(-1) + _v_base(fused, x))
    assert not torch.allclose(base, fused(x))  # the adapters count again
    fused.merge_adapter()
    torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


def _v_base(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.get_base_model().v_proj.base_layer(x).sum(-1)


def test_dora_and_a_mixed_adapter_batch_take_pefts_path():
    model, fused = peft_pair(use_dora=True)
    x = torch.randn(2, 5, 48)
    torch.testing.assert_close(fused(x), model(x))  # DoRA's magnitude applies: not plain LoRA
    model, fused = peft_pair()
    names = ["default", "__base__"]  # PEFT passes them to each layer, in eval mode only
    mixed = fused.eval()(x, adapter_names=names)
    torch.testing.assert_close(mixed, model.eval()(x, adapter_names=names))
    torch.testing.assert_close(mixed[1], fused.get_base_model().q_proj.base_layer(x[1]).sum(-1) + _v_base(fused, x[1]))


def test_a_lora_model_fuses_every_adapted_layer(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    use_fast_dropout(model)
    assert use_fused_lora(model) == 2 * model.config.num_hidden_layers
    assert sum(type(m) is FusedLoraLinear for m in model.modules()) == 2 * model.config.num_hidden_layers


def test_a_trained_base_bias_takes_pefts_path_and_gets_its_gradient():
    _, fused = peft_pair(bias=True)
    bias = fused.get_base_model().q_proj.base_layer.bias
    bias.requires_grad_(True)
    fused(torch.randn(2, 5, 48)).sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


def test_recomputed_layers_draw_the_same_dropout(tiny_model_dir):
    """Gradient checkpointing reruns each layer's forward in backward: the fused layers must
    draw the same masks again (checkpoint restores the RNG state), or the gradients differ."""
    from transformers import AutoModelForCausalLM

    def grads(checkpointing: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir),
            LoraConfig(r=4, lora_dropout=0.3, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        )
        use_fast_dropout(model)
        use_fused_lora(model)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero, which would leave A without a gradient
                nn.init.normal_(p, std=0.5)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for n, p in model.named_parameters() if "lora_" in n]

    for plain, recomputed in zip(grads(False), grads(True), strict=True):
        assert plain.abs().sum() > 0
        torch.testing.assert_close(recomputed, plain)
