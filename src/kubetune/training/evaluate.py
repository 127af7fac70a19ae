"""`kubetune eval RUN_DIR|RECIPE`: loss and perplexity of a trained run (or of the base
model a recipe names) on the recipe's eval data, with the same code as training's; for a
preference objective, its loss and TRL's eval metrics on the held-out pairs, and the
perplexity of their chosen answers."""

from __future__ import annotations

from pathlib import Path

from kubetune.data import prepare_data
from kubetune.errors import RecipeError
from kubetune.models.attention import register as register_attention
from kubetune.models.finetune import ModelParts
from kubetune.models.kernels import autocast_context, compute_precision
from kubetune.models.load import model_config
from kubetune.models.runs import load_run
from kubetune.recipe import Recipe, load_recipe
from kubetune.recipe.layout import data_parallel_only
from kubetune.rundir import RunDir
from kubetune.training.dist import DistEnv, init_distributed
from kubetune.training.preference import AdapterOff, FrozenCopy, Objective, PreferenceTraining, Reference
from kubetune.training.report import fmt_number, setup_logging
from kubetune.training.runner import LocalRunner
from kubetune.training.setup import configure_threads, eval_batcher
from kubetune.training.step import EvalResult, evaluate


def eval_target(target: str, overrides: list[str]) -> EvalResult:
    env = init_distributed("auto")
    setup_logging(env)
    run = RunDir(Path(target))
    recipe = run.recipe(overrides) if run.is_run() else load_recipe(target, overrides).recipe
    if recipe.finetune.objective == "grpo":
        raise RecipeError(
            f"{target}: a grpo run's held-out reward and accuracy are in its summary.json (sampled at the end of "
            "training); for the perplexity of a dataset's answers, add finetune.objective=sft data.train=FILE"
        )
    configure_threads(recipe.train.num_threads, env)  # before the precision: threads change the answer
    precision = compute_precision(
        recipe.train.precision, model_config(recipe.model), env.device
    )  # what training chose here
    recipe = recipe.with_kernels(precision, "fp32")
    model, tokenizer = load_run(run if run.is_run() else recipe, recipe, attn=register_attention())
    parts = ModelParts.of(model.to(env.device))
    data = prepare_data(recipe, tokenizer)
    layout = data_parallel_only(env.world_size, env.rank)
    batcher = eval_batcher(recipe, data, tokenizer.pad_token_id, layout, env.device.type)
    runner = LocalRunner(parts.loss, parts.loss, env.device, autocast_context(precision, env.device))
    if recipe.finetune.on_pairs:
        reference = pair_reference(recipe, run if run.is_run() else None, parts, runner, env)
        result = PreferenceTraining(Objective.of(recipe), runner, reference, reference).evaluate(batcher, layout, env)
    else:
        result = evaluate(runner, batcher, layout, env)
    print(
        f"eval loss {fmt_number(result.loss)}  perplexity {fmt_number(result.perplexity)}  "
        f"({result.tokens} target tokens)"
        + "".join(f"  {name} {fmt_number(value)}" for name, value in result.objective_metrics.items())
    )
    return result


def pair_reference(
    recipe: Recipe, run: RunDir | None, parts: ModelParts, runner: LocalRunner, env: DistEnv
) -> Reference | None:
    """DPO's reference for held-out pairs: a LoRA run's base (its adapter switched off), a full
    run's base model loaded beside it, or (a recipe's base model itself) the model."""
    if not Objective.of(recipe).needs_reference:
        return None
    if hasattr(parts.model, "disable_adapter"):
        return AdapterOff(runner, parts.model)
    if run is None:
        return FrozenCopy(runner, parts.loss)
    base, _ = load_run(recipe, attn=register_attention())
    return FrozenCopy(runner, ModelParts.of(base.to(env.device)).loss)
