"""LoRA's input dropout from a quarter of the random draws: the same distribution, the
same expectation, gradients through the same mask, and torch's generator behind it."""

from __future__ import annotations

import pytest
import torch

from kubetune.models.dropout import FastDropout, keep_mask, use_fast_dropout


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_the_drop_rate_and_the_expectation_are_dropouts(p):
    torch.manual_seed(0)
    x = torch.ones(1000, 1001)  # an odd size: the last 64-bit draw is cut
    y = FastDropout(p).train()(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - p) < 4 * (p * (1 - p) / x.numel()) ** 0.5 + 1 / 65536
    assert y.mean().item() == pytest.approx(1.0, abs=5e-3)
    kept = y[y != 0]
    assert torch.allclose(kept, torch.full_like(kept, 65536 / (65536 - round(p * 65536))))


def test_the_four_lanes_of_a_draw_are_independent():
    torch.manual_seed(1)
    m = keep_mask(torch.Size([400_000]), round(0.5 * 65536), torch.device("cpu")).view(-1, 4).float()
    rates = m.mean(0)
    assert torch.allclose(rates, torch.full_like(rates, 0.5), atol=0.01)
    corr = torch.corrcoef(m.T)
    assert (corr - torch.eye(4)).abs().max() < 0.01


def test_gradients_flow_through_the_kept_elements_only():
    torch.manual_seed(2)
    x = torch.randn(64, 33, requires_grad=True)
    d = FastDropout(0.3).train()
    y = d(x)
    y.sum().backward()
    kept = y.detach() != 0
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], d.scale))
    assert (x.grad[~kept] == 0).all()


def test_seeded_draws_repeat_and_eval_is_the_identity():
    x = torch.randn(32, 32)
    d = FastDropout(0.2).train()
    torch.manual_seed(3)
    a = d(x)
    torch.manual_seed(3)
    assert torch.equal(a, d(x))
    assert d.eval()(x) is x and FastDropout(0.0).train()(x) is x
    assert d.train()(x.bfloat16()).dtype == torch.bfloat16


def test_lora_models_get_it_on_every_adapted_input(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    assert use_fast_dropout(model) == 2 * model.config.num_hidden_layers
    assert not any(type(m) is torch.nn.Dropout for n, m in model.named_modules() if "lora_dropout" in n)
