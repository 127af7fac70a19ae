"""fp16 loss scaling: the recipe's `train.loss_scale.*` reach torch's GradScaler, and kubetune's
step holds the scale under `max_scale` (seed 000: 65536, growing every 100 clean steps)."""

from __future__ import annotations

import pytest
import torch
import yaml

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


def test_loss_scale_keys_under_bf16_are_one_warning_naming_them():
    def warnings(*overrides: str) -> list[str]:
        return load_recipe(None, list(overrides)).recipe.train.loss_scale_warnings()

    seed = ("train.loss_scale.growth_interval=100", "train.loss_scale.max_scale=65536")  # seed 000's scaler
    for precision in ("bf16", "fp32", "auto"):
        (line,) = warnings(f"train.precision={precision}", *seed)
        assert line.startswith("train.loss_scale.growth_interval, train.loss_scale.max_scale apply only to ")
        assert f"nothing under train.precision={precision}" in line and "need no loss scale" in line
    assert warnings("train.precision=fp16", *seed) == []  # fp16 reads them
    assert warnings("train.precision=bf16") == []  # the defaults are nobody's setting


def test_the_warning_survives_the_pods_recipe_and_reaches_render():
    from kubetune.k8s.render import render
    from kubetune.recipe.loader import recipe_to_yaml
    from kubetune.recipe.schema import Recipe

    loaded = load_recipe("llama2-13b-gaudi-tp4-pp8", ["train.loss_scale.growth_interval=100"]).recipe
    assert loaded.train.precision == "bf16"
    warned = [w for w in render(loaded).warnings if "train.loss_scale" in w]
    assert warned == loaded.train.loss_scale_warnings() and len(warned) == 1
    # the ConfigMap holds every key; only the changed one is named, once
    in_pod = Recipe.model_validate(yaml.safe_load(recipe_to_yaml(loaded)))
    assert in_pod.train.loss_scale_warnings() == warned
    assert not [w for w in render(load_recipe("llama2-13b-gaudi-tp4-pp8", []).recipe).warnings if "loss_scale" in w]


def test_fp16_with_tp_or_pp_is_refused_naming_what_to_use():
    from kubetune.recipe.layout import check_recipe, layout_for

    for parallel in (["parallel.tp=2"], ["parallel.pp=2"]):
        recipe = load_recipe(None, ["train.precision=fp16", *parallel]).recipe
        with pytest.raises(RecipeError) as refused:
            check_recipe(layout_for(recipe.parallel, 4), recipe)
        message = str(refused.value)
        assert "\n" not in message
        assert "use train.precision=bf16" in message and "no loss scale needed" in message
        assert "keep fp16 with parallel.tp=1 and parallel.pp=1" in message
    fp16_dp = load_recipe(None, ["train.precision=fp16"]).recipe
    check_recipe(layout_for(fp16_dp.parallel, 4), fp16_dp)  # data parallel: fp16 runs
