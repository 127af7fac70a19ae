"""fp16 loss scaling: the recipe's `train.loss_scale.*` reach torch's GradScaler, and kubetune's
step holds the scale under `max_scale` (seed 000: 65536, growing every 100 clean steps)."""

from __future__ import annotations

import pytest
import torch

from kubetune.errors import RecipeError
from kubetune.recipe import load_recipe
from kubetune.recipe.schema import LossScaleSection
from kubetune.training.optim import Optimization, build_optimization
from kubetune.training.parallel import single_process


def _optimization(*overrides: str) -> tuple[torch.nn.Linear, Optimization]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    train = load_recipe(None, ["train.precision=fp16", "train.warmup_steps=0", *overrides]).recipe.train
    return model, build_optimization(model, train, single_process(), torch.device("cpu"), total_steps=10)


def _step(model: torch.nn.Linear, optim: Optimization, overflow: bool = False) -> float:
    loss = model(torch.ones(3, 4)).pow(2).sum() * (float("inf") if overflow else 1.0)
    assert optim.scaler is not None
    optim.scaler.scale(loss).backward()
    optim.step(single_process())
    return optim.scaler.get_scale()


def test_the_defaults_are_torchs():
    torch_default = torch.amp.GradScaler("cpu")
    ours = LossScaleSection()
    assert (ours.init_scale, ours.growth_factor, ours.backoff_factor, ours.growth_interval) == (
        torch_default.get_scale(),
        torch_default.get_growth_factor(),
        torch_default.get_backoff_factor(),
        torch_default.get_growth_interval(),
    )
    assert ours.max_scale is None


def test_the_recipe_settings_reach_the_scaler():
    _, optim = _optimization(
        "train.loss_scale.init_scale=1024",
        "train.loss_scale.growth_factor=4",
        "train.loss_scale.backoff_factor=0.25",
        "train.loss_scale.growth_interval=100",
    )
    s = optim.scaler
    assert s is not None
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        1024.0,
        4.0,
        0.25,
        100,
    )
    assert _optimization("train.precision=bf16")[1].scaler is None


def test_max_scale_caps_growth_and_backoff_still_works():
    grow_every_step = ("train.loss_scale.init_scale=1024", "train.loss_scale.growth_interval=1")
    model, free = _optimization(*grow_every_step)
    assert [_step(model, free) for _ in range(3)] == [2048.0, 4096.0, 8192.0]  # torch alone: no cap
    model, capped = _optimization(*grow_every_step, "train.loss_scale.max_scale=2048")
    assert [_step(model, capped) for _ in range(3)] == [2048.0, 2048.0, 2048.0]
    before = model.weight.detach().clone()
    assert _step(model, capped, overflow=True) == 1024.0  # inf gradients: skipped step, backed off
    assert torch.equal(model.weight, before)
    assert _step(model, capped) == 2048.0  # and it grows back to the cap, no further


def test_an_init_scale_above_the_cap_is_one_clear_error():
    with pytest.raises(RecipeError, match=r"init_scale=131072 is above max_scale=65536; lower init_scale"):
        load_recipe(None, ["train.loss_scale.init_scale=131072", "train.loss_scale.max_scale=65536"])
