"""The GRPO speed benchmark's plan, kubetune recipe, figures and report (bench/train/grpo_vs_trl.py),
and the process-tree peak RSS it measures with (bench/common/processes.py): a recipe key renamed,
a metrics row read wrong or a ratio turned upside down fails here, not after an hour of benchmark.
The long runs themselves are not run here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
from bench.common.processes import TreePeakRss

from kubetune.data.prompts import PromptSet
from kubetune.data.tokenize import TokenizedData
from kubetune.recipe import load_recipe
from kubetune.recipe.layout import check_recipe, data_parallel_only, grad_accum_for
from tests.conftest import load_bench

grpo = load_bench("train/grpo_vs_trl")


def bench_args(**changes) -> argparse.Namespace:
    args = {"steps": 20, "prompts_per_step": 4, "num_generations": 8, "max_completion_length": 64}
    args |= {"max_prompt_tokens": 128, "temperature": 1.0, "lr": 1e-5, "repeats": 1, "no_warmup": False}
    args |= {"precision": "auto", "threads": 2, "arms": "trl-cb,kubetune,trl-generate"}
    return argparse.Namespace(**(args | changes))


def test_kubetune_runs_first_and_the_plan_counts_completions():
    plan = grpo.plan_from_args(bench_args())
    assert plan.arms == ("kubetune", "trl-generate", "trl-cb")  # its precision choice is TRL's precision
    assert plan.completions_per_step == 32 and plan.warmup


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"arms": "kubetune,vllm"}, "--arms: unknown vllm"),
        ({"arms": "trl-generate"}, "--precision auto is kubetune's choice"),
        ({"num_generations": 1}, "--num-generations must be >= 2"),
        ({"steps": 0}, "--steps must be >= 1"),
        ({"temperature": 0.0}, "--temperature must be > 0"),
    ],
)
def test_plans_that_cannot_run_are_refused_in_one_line(changes, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        grpo.plan_from_args(bench_args(**changes))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_kubetune_side_is_the_same_grpo_run_for_any_number_of_processes(tmp_path, processes):
    plan = grpo.plan_from_args(bench_args())
    recipe = load_recipe(None, grpo.kubetune_overrides(plan, tmp_path / "data.jsonl", str(tmp_path), "auto", 20)).recipe
    rl = recipe.finetune.rl
    assert (recipe.finetune.objective, rl.num_generations, rl.max_completion_length) == ("grpo", 8, 64)
    assert (rl.beta, rl.loss_type, rl.scale_rewards, rl.top_k, rl.reward_funcs) == (
        0.0,
        "dapo",
        "group",
        0,
        ["accuracy"],
    )
    assert (recipe.lora.r, recipe.lora.dropout, recipe.lora.target_modules) == (8, 0.0, ["q_proj", "v_proj"])
    assert (recipe.train.max_steps, recipe.train.lr_schedule, recipe.train.resume) == (20, "constant", "never")
    assert recipe.data.max_seq_len == 128 + 64
    # 4 prompts x G 8 per optimizer step whatever the processes: TRL's 8 completions x 4 micro-batches
    check_recipe(data_parallel_only(processes, 0), recipe)
    assert grad_accum_for(recipe.train, processes) * processes * recipe.train.micro_batch_size == 32


def test_the_generated_task_is_the_same_every_time_and_answers_right():
    rows = grpo.arithmetic_rows(5)
    assert rows == grpo.arithmetic_rows(5) and rows != grpo.arithmetic_rows(5, seed=1)
    a, b = (int(x) for x in rows[0]["prompt"].removeprefix("What is ").split("?")[0].split(" + "))
    assert rows[0]["answer"] == str(a + b)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (None, "no such file"),
        ([], "has no rows"),
        ([{"prompt": "1 + 1?", "answer": "2"}, {"prompt": "2 + 2?"}], "row 1 lacks `prompt` or `answer`"),
    ],
)
def test_data_without_prompt_and_answer_is_refused(tmp_path, lines, message, capsys):
    path = tmp_path / "task.jsonl"
    if lines is not None:
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(SystemExit) as exit_:
        grpo.checked_data(path)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def metrics_row(step: int, mean_length: float, rollout: float, sampling: float) -> dict:
    """A GRPO row of kubetune's metrics.jsonl, with the keys the bench reads."""
    return {
        "step": step,
        "step_s": {"rollout": rollout, "compute": 1.0, "optimizer": 0.01, "communication": 0.01},
        "completions/mean_length": mean_length,
        "rollout/seconds": sampling,
    }


def test_kubetune_figures_add_up_every_steps_row():
    plan = grpo.plan_from_args(bench_args(prompts_per_step=2, num_generations=4))  # 8 completions a step
    rows = [metrics_row(1, 10.0, 3.0, 2.5), metrics_row(2, 12.0, 2.0, 1.5)]
    summary = {"steps": 2, "train_time_s": 8.0, "precision": "fp32", "peak_rss_mb_per_rank": [700.0, 650.0]}
    figures = grpo.kubetune_figures(rows, summary, plan)
    assert figures["completion_tokens"] == pytest.approx((10 + 12) * 8)
    assert (figures["rollout_s"], figures["sampling_s"], figures["loop_s"]) == (5.0, 4.0, 8.0)
    assert figures["workers_peak_rss_mb"] == 1350.0
    d = grpo.derived(figures | {"peak_rss_mb": 1500.0}, plan)
    assert d["completion_tokens_per_s"] == pytest.approx(176 / 5.0) and d["sampled_tokens_per_s"] == 44.0
    assert (d["steps_per_s"], d["training_s"], d["mean_length"]) == (0.25, 3.0, 11.0)
    with pytest.raises(SystemExit, match="1 step rows with rollout figures for 2 steps"):
        grpo.kubetune_figures(rows[:1], summary, plan)


def run(tokens: float, rollout: float, loop: float, rss: float, **extra) -> dict:
    figures = {"steps": 4, "completion_tokens": tokens, "rollout_s": rollout, "sampling_s": rollout * 0.9}
    return figures | {"loop_s": loop, "peak_rss_mb": rss, "precision": "fp32"} | extra


def test_report_compares_kubetune_with_trls_faster_setting(capsys):
    plan = grpo.Plan(4, 2, 4, 16, 128, 1.0, 1e-5, 3, False, "auto", 2, ("kubetune", "trl-generate", "trl-cb"))
    kubetune = {"workers_peak_rss_mb": 900.0, "processes": "2 x 1 thread each"}
    # each figure's median over the repeats: the slow third repeat moves none of them
    repeats = [(4.0, 8.0), (5.0, 10.0), (50.0, 100.0)]
    results = {
        "kubetune": [run(400, rollout, loop, 1000.0, **kubetune) for rollout, loop in repeats],
        "trl-generate": [run(400, 40.0, 80.0, 2000.0)] * 3,  # 0.05 steps/s
        "trl-cb": [run(400, 20.0, 40.0, 2500.0)] * 3,  # 0.1 steps/s: the faster
    }
    grpo.report(plan, results, "fp32", "test prompts")
    out = capsys.readouterr().out
    assert "TRL's faster CPU setting here: trl-cb (use_transformers_continuous_batching=True)" in out
    # tokens/s 400/5 = 80 vs 400/20 = 20: x4; steps/s 4/10 = 0.4 vs 0.1: x4; RSS 1000 vs 2500: x0.4
    assert "completion tokens/s x4.00 (target >= 3.0: PASS), optimizer steps/s x4.00 (target >= 3.0: PASS)" in out
    assert "peak RSS x0.40 (target <= 1.0: PASS)" in out
    assert "kubetune's workers' own peak RSS (summary.json, summed): 900 MB" in out
    assert "kubetune / TRL (trl-generate): completion tokens/s x8.00, optimizer steps/s x8.00, peak RSS x0.50" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["trl_arm"] == "trl-cb" and summary["ratios"]["steps_per_s"] == pytest.approx(4.0)
    assert summary["figures"]["kubetune"]["rollout_s"] == 5.0


def test_trl_config_is_the_same_step_and_sizes_the_continuous_batching_cache(tmp_path):
    plan = grpo.plan_from_args(bench_args())
    config = grpo.trl_config(plan, str(tmp_path), "fp32", True, 20)
    # 4 micro-batches of G 8 completions, all sampled in one generation per optimizer step
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (8, 4)
    assert (config.generation_batch_size, config.steps_per_generation, config.num_generations) == (32, 4, 8)
    assert (config.beta, config.loss_type, config.scale_rewards, config.top_k) == (0.0, "dapo", "group", 0)
    assert (
        not config.activation_checkpointing
        and not config.gradient_checkpointing
        and not config.bf16
        and config.use_transformers_continuous_batching
    )
    # one 256-token page per completion (128 + 64 tokens), every prompt in one forward
    sizes = config.transformers_continuous_batching_config
    assert (sizes["num_blocks"], sizes["max_batch_tokens"]) == (32, 32 * 128)
    assert grpo.trl_config(plan, str(tmp_path), "bf16", False, 20).transformers_continuous_batching_config is None


def test_trl_is_handed_kubetunes_prompt_text_and_its_tokens_must_match(tmp_path, tokenizer):
    plan = grpo.plan_from_args(bench_args())
    data = tmp_path / "task.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in grpo.arithmetic_rows(3)))
    prompts = grpo.kubetune_prompts(plan, data, str(tmp_path), tokenizer)
    dataset = grpo.trl_dataset(prompts, tokenizer)
    assert dataset.column_names == ["prompt", "answer"] and dataset[0]["answer"] == grpo.arithmetic_rows(3)[0]["answer"]
    assert "<|im_start|>assistant" in dataset[0]["prompt"]  # rendered with the chat template
    t = prompts.tokens
    shifted = TokenizedData(np.where(np.arange(len(t.ids)) == t.offsets[1], t.ids + 1, t.ids), t.trainable, t.offsets)
    with pytest.raises(SystemExit, match="TRL tokenizes prompt 1 as"):
        grpo.trl_dataset(PromptSet(shifted, prompts.texts, prompts.columns), tokenizer)


def test_peak_rss_counts_the_whole_process_tree():
    child = "import time; block = bytearray(200 * 2**20); time.sleep(1.5)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent])
    rss = TreePeakRss(proc.pid, interval=0.05)
    proc.wait()
    rss.stop()
    assert rss.peak > 200 * 2**20  # the child's block, and the parent beside it
