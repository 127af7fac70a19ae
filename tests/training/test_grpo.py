"""GRPO (finetune.objective = grpo): TRL's formulas against values worked out by hand, the
engine's log-probabilities against the training forward's, and whole runs on the tiny model:
TRL's metrics, a reward that raises, step-exact resume after SIGKILL, two processes as one,
and the refused recipes."""

import json
import math

import pytest
import torch

from kubetune.errors import UserError
from kubetune.recipe import load_recipe
from kubetune.training.grpo_loss import Reduction, group_advantages, nanstd, token_loss
from kubetune.training.run import train_from_recipe
from tests.kit.cli import run_cli_subprocess
from tests.kit.processes import base_env, finish, kill_after_checkpoint, start_kubetune

TRL_KEYS = {
    "loss",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
}

# ------------------------------------------------------------------ advantages


def test_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    adv, zero = group_advantages(rewards, group=4, scale="group")
    std = math.sqrt(((0.75**2) + 3 * (0.25**2)) / 3)  # Bessel's correction, as TRL's nanstd
    assert adv[:4].tolist() == pytest.approx([0.75 / (std + 1e-4), *[-0.25 / (std + 1e-4)] * 3])
    # a group whose rewards are all equal teaches nothing: advantage 0, counted in frac_reward_zero_std
    assert adv[4:].tolist() == [0.0] * 4
    assert zero.tolist() == [False] * 4 + [True] * 4


def test_unscorable_completions_get_no_advantage_and_leave_the_mean():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 5.0], dtype=torch.float64)
    adv, _ = group_advantages(rewards, group=4, scale="none")
    assert adv.tolist() == pytest.approx([-2.0, 0.0, 0.0, 2.0])  # the mean of 1, 3, 5 is 3


def test_batch_scaling_divides_by_the_whole_step_std():
    rewards = torch.tensor([0.0, 1.0, 2.0, 4.0], dtype=torch.float64)
    adv, _ = group_advantages(rewards, group=2, scale="batch")
    assert adv.tolist() == pytest.approx(
        [
            -0.5 / (float(nanstd(rewards)) + 1e-4),
            0.5 / (float(nanstd(rewards)) + 1e-4),
            -1 / (float(nanstd(rewards)) + 1e-4),
            1 / (float(nanstd(rewards)) + 1e-4),
        ]
    )


# ------------------------------------------------------------------ the token loss


def test_the_ratio_is_clipped_at_both_ends():
    old = torch.zeros(4)
    logps = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    terms = token_loss(logps, old, adv, eps_low=0.2, eps_high=0.28)
    # A > 0 above 1 + eps_high: the clipped 1.28; A < 0 below 1 - eps: the clipped 0.8
    assert terms.loss.tolist() == pytest.approx([-1.28, 1.5, -0.5, 0.8])
    assert terms.high_clipped.tolist() == [True, False, False, False]
    assert terms.low_clipped.tolist() == [False, False, False, True]
    terms.loss.sum().backward()
    # a clipped token passes no gradient; the others d(-ratio A)/dlogp = -ratio A
    assert logps.grad.tolist() == pytest.approx([0.0, 1.5, -0.5, 0.0])


def test_the_kl_term_is_k3_against_the_reference():
    logps, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    terms = token_loss(logps, logps, torch.zeros(2), 0.2, 0.2, beta=0.5, ref_logps=ref)
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]
    assert terms.kl.tolist() == pytest.approx(k3)
    assert terms.loss.tolist() == pytest.approx([0.5 * k for k in k3])  # A = 0: only the KL term


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        # two completions: tokens (1, 2) and (3, 4, 5, 6); grad_accum 2
        ("grpo", ((1 + 2) / 2 + (3 + 4 + 5 + 6) / 4) / 2 / 2),
        ("bnpo", (1 + 2 + 3 + 4 + 5 + 6) / 6 / 2),
        ("dr_grpo", (1 + 2 + 3 + 4 + 5 + 6) / (2 * 10) / 2),
        # dapo: the generation's tokens per process (12), x grad_accum 2 / steps_per_generation 4
        ("dapo", (1 + 2 + 3 + 4 + 5 + 6) / (12 * 2 / 4)),
    ],
)
def test_each_loss_type_sums_tokens_as_trl(loss_type, expected):
    losses = torch.arange(1.0, 7.0)
    seq = torch.tensor([0, 0, 1, 1, 1, 1])
    reduce = Reduction(loss_type, accum=2, max_completion_length=10, tokens_per_process=12, generation_steps=4)
    assert reduce(losses, torch.ones(6), seq, 2).item() == pytest.approx(expected)


def test_masked_tokens_add_nothing():
    losses, seq = torch.arange(1.0, 7.0), torch.tensor([0, 0, 1, 1, 1, 1])
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # the second completion was truncated
    reduce = Reduction("grpo", accum=1, max_completion_length=10, tokens_per_process=6, generation_steps=1)
    assert reduce(losses, mask, seq, 2).item() == pytest.approx((1 + 2) / 2 / 2)


# ------------------------------------------------------------------ the engine samples what training scores


def completion_logps(parts, batch):
    """The training forward's log-probability of every completion token of a packed batch."""
    fields = (batch.input_ids, batch.position_ids, batch.targets, batch.cu_seqlens, batch.target_sample)
    return parts.loss(*fields, batch.target_tokens, prefixes=batch.prefixes)


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("bf16", 0.1)])
def test_engine_logprobs_equal_the_training_forwards(tiny_model_dir, tokenizer, precision, tolerance):
    from kubetune.models.finetune import build_model
    from kubetune.models.kernels import autocast_context
    from kubetune.training.grpo import pack_completions
    from kubetune.training.rollout import LocalRollouts, RolloutSettings

    recipe = load_recipe(
        None,
        [f"model.name_or_path={tiny_model_dir}", f"train.precision={precision}", "lora.dropout=0.0"],
    ).recipe
    torch.manual_seed(0)
    parts = build_model(recipe, str(tiny_model_dir), torch.device("cpu"))
    with torch.no_grad():  # LoRA's B starts at zero: give the adapter a say in the log-probs
        for name, p in parts.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    autocast = autocast_context(precision, torch.device("cpu"))
    rollouts = LocalRollouts(parts.lm, tokenizer.eos_token_id, autocast, max_sequence=64, rows=6)
    prompts = [(0, tokenizer("What is 2 + 2?")["input_ids"]), (1, tokenizer("Name a colour.")["input_ids"])]
    completions = rollouts.sample(prompts, 3, RolloutSettings(max_tokens=12, temperature=1.0, seed=7), generation=0)
    assert len(completions) == 6 and all(c.tokens for c in completions)
    assert len({tuple(c.tokens) for c in completions}) > 1  # each its own random stream
    batch, _ = pack_completions(completions, 64, tokenizer.pad_token_id)
    parts.model.eval()
    with torch.no_grad(), autocast():
        trained = completion_logps(parts, batch)
    assert batch.prefixes is not None and max(batch.prefixes) >= 0  # the groups read their prompt once
    sampled = torch.tensor([lp for c in completions for lp in c.logprobs])
    torch.testing.assert_close(trained, sampled, rtol=0, atol=tolerance)
    assert parts.lm.config._attn_implementation != "kubetune_slots"  # switched back for training


@pytest.mark.parametrize("max_seq_len", [64, 24])  # 24: a group does not fit one row and is split
def test_a_shared_prompt_gives_the_log_probs_and_gradients_of_a_copy_per_completion(
    tiny_model_dir, tokenizer, max_seq_len
):
    from kubetune.models.finetune import build_model
    from kubetune.training.grpo import pack_completions
    from kubetune.training.rollout import Completion

    recipe = load_recipe(None, [f"model.name_or_path={tiny_model_dir}", "train.precision=fp32"]).recipe
    torch.manual_seed(0)
    parts = build_model(recipe, str(tiny_model_dir), torch.device("cpu"))
    with torch.no_grad():
        for name, p in parts.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    parts.model.eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (9, 1, 6)]
    completions = [
        Completion(p, prompts[p], torch.randint(5, 500, (n,), generator=g).tolist(), [], False)
        for p, n in [(0, 3), (0, 5), (0, 1), (1, 4), (1, 2), (2, 7), (2, 2), (0, 2)]
    ]
    results = []
    for share in (False, True):
        batch, _ = pack_completions(completions, max_seq_len, tokenizer.pad_token_id, share_prompts=share)
        parts.model.zero_grad()
        logps = completion_logps(parts, batch)
        (logps * torch.linspace(0.5, 1.5, len(logps))).sum().backward()
        grads = {n: p.grad.clone() for n, p in parts.model.named_parameters() if p.grad is not None}
        results.append((batch, logps.detach(), grads))
    (plain, plain_logps, plain_grads), (shared, shared_logps, shared_grads) = results
    assert shared.real_tokens < plain.real_tokens  # the prompts are read once per group, not per completion
    assert plain.prefixes is None and shared.prefixes is not None and max(shared.prefixes) >= 0
    torch.testing.assert_close(shared_logps, plain_logps, rtol=1e-5, atol=1e-5)
    assert shared_grads.keys() == plain_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_rollouts_are_a_function_of_where_they_sit_in_the_run(tiny_model_dir, tokenizer):
    from kubetune.models.finetune import build_model
    from kubetune.training.rollout import LocalRollouts, RolloutSettings

    recipe = load_recipe(None, [f"model.name_or_path={tiny_model_dir}", "train.precision=fp32"]).recipe
    parts = build_model(recipe, str(tiny_model_dir), torch.device("cpu"))
    rollouts = LocalRollouts(parts.lm, tokenizer.eos_token_id, lambda: torch.autocast("cpu", enabled=False), 64, 4)
    prompt = [(3, tokenizer("Say something.")["input_ids"])]
    settings = RolloutSettings(max_tokens=8, temperature=1.0, seed=1)
    first, again = (rollouts.sample(prompt, 2, settings, generation=5) for _ in range(2))
    other = rollouts.sample(prompt, 2, settings, generation=6)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    assert [c.tokens for c in first] != [c.tokens for c in other]


# ------------------------------------------------------------------ whole runs on the tiny model


def tiny_qa(where):
    from tests.conftest import write_qa_file

    return write_qa_file(where / "qa.jsonl")


def records(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def assert_a_killed_run_resumes_exactly(tmp_path, common, steps, kill_at):
    """Train `common` straight through, then again killed (SIGKILL) after checkpoint `kill_at` and
    rerun: the second run's metrics match the first's, step by step (weights, sampling RNG)."""
    straight = tmp_path / "straight"
    train_from_recipe(None, [*common, f"train.max_steps={steps}", f"output_dir={straight}"])
    out = tmp_path / "killed"
    argv = ["train", "--nproc-per-node", "1", *common, f"train.max_steps={steps}", f"output_dir={out}"]
    kill_after_checkpoint(start_kubetune(argv), out, kill_at)
    finish(start_kubetune(argv))
    a, b = records(straight), records(out)
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for x, y in zip(a, b):
        for key in ("loss", "reward", "completions/mean_length", "entropy"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), (key, x["step"])


@pytest.mark.process
def test_a_grpo_run_reports_trls_metrics_and_the_held_out_reward(tmp_path, grpo_overrides):
    out = tmp_path / "run"
    summary = train_from_recipe(None, [*grpo_overrides, "train.max_steps=8", "train.save_every=0", f"output_dir={out}"])
    rows = records(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:
        assert set(r) >= TRL_KEYS | {"rewards/even_tokens/mean", "rewards/accuracy/mean"}, sorted(r)
        assert math.isfinite(r["loss"]) and 0 <= r["completions/clipped_ratio"] <= 1
    # a step learns exactly when its groups disagree: advantages are zero in groups of equal rewards
    assert any(r["grad_norm"] > 0 for r in rows if r["frac_reward_zero_std"] < 1)
    assert all(r["grad_norm"] == 0 for r in rows if r["frac_reward_zero_std"] == 1)
    assert summary.reward_before is not None and summary.reward_after is not None
    saved = json.loads((out / "summary.json").read_text())
    assert saved["objective"] == "grpo" and "eval_accuracy" in saved["eval_after"]
    logged = [json.loads(ln) for ln in (out / "completions.jsonl").read_text().splitlines()]
    assert logged and {"step", "prompt", "completion", "rewards", "advantage"} <= set(logged[0])
    assert (out / "adapter" / "adapter_config.json").is_file()
    from kubetune.training.evaluate import eval_target

    with pytest.raises(UserError, match=r"summary\.json"):  # `kubetune eval` says where the reward is
        eval_target(str(out), [])
    sft = eval_target(str(out), ["finetune.objective=sft", f"data.train={tiny_qa(tmp_path)}"])
    assert sft.perplexity is not None and sft.perplexity > 1  # the adapter's perplexity on other answers


@pytest.mark.process
def test_a_reward_that_raises_stops_with_one_line_and_keeps_the_checkpoints(tmp_path, grpo_overrides):
    out = tmp_path / "run"
    args = [o for o in grpo_overrides if not o.startswith("finetune.rl.reward_funcs")]
    args += ["finetune.rl.reward_funcs=[tests.training.rl_rewards:raises_later]", "train.save_every=1"]
    env = {**base_env(), "KUBETUNE_TEST_RAISE_AT": "4"}  # eval before, steps 1 and 2, then it raises
    done = run_cli_subprocess(["train", "--nproc-per-node", "1", *args, f"output_dir={out}"], env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1 and "raises_later" in lines[0] and "row" in lines[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert (out / "checkpoints" / "step-2").is_dir()


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
@pytest.mark.multiproc
def test_a_reward_that_raises_on_one_of_two_processes_stops_both_with_one_line(tmp_path, grpo_overrides):
    """The default multi-process launch: process 1's grader raises while process 0 waits for it in
    the step's reductions. The launcher stops both and says the one line; the checkpoints stay."""
    out = tmp_path / "run"
    args = [o for o in grpo_overrides if not o.startswith(("finetune.rl.reward_funcs", "train.grad_accum"))]
    args += ["finetune.rl.reward_funcs=[tests.training.rl_rewards:raises_later]", "train.save_every=1"]
    args += ["train.grad_accum=1"]
    env = {**base_env(), "KUBETUNE_TEST_RAISE_AT": "4", "KUBETUNE_TEST_RAISE_RANK": "1"}
    done = run_cli_subprocess(["train", "--nproc-per-node", "2", *args, f"output_dir={out}"], env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1 and "raises_later" in lines[0] and "row" in lines[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert (out / "checkpoints" / "step-2").is_dir()


@pytest.mark.process
def test_sigkill_then_rerun_matches_the_uninterrupted_run(tmp_path, grpo_overrides):
    assert_a_killed_run_resumes_exactly(tmp_path, [*grpo_overrides, "train.save_every=2"], steps=6, kill_at=4)


@pytest.mark.multiproc
def test_two_processes_train_grpo_as_one(tmp_path, grpo_overrides):
    common = [o for o in grpo_overrides if not o.startswith(("train.grad_accum", "train.num_threads"))]
    common += ["train.max_steps=3", "train.save_every=0"]
    one, two = tmp_path / "one", tmp_path / "two"
    train_from_recipe(None, [*common, "train.grad_accum=2", f"output_dir={one}"])
    out = finish(start_kubetune(["train", "--nproc-per-node", "2", *common, "train.grad_accum=1", f"output_dir={two}"]))
    assert "2 process(es)" in out
    for x, y in zip(records(one), records(two), strict=True):
        for key in ("loss", "reward", "reward_std", "completions/mean_length", "entropy", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (key, x["step"])


# ------------------------------------------------------------------ refused recipes


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["finetune.rl.num_generations=1"], "num_generations"),
        (["finetune.rl.reward_weights=[1.0,2.0]"], "one weight per"),
        (["finetune.rl.rollout=server", "finetune.rl.server_url=localhost:8000"], "http://"),
    ],
)
def test_bad_rl_settings_are_one_line(overrides, says):
    with pytest.raises(UserError) as e:
        load_recipe(None, ["finetune.objective=grpo", *overrides])
    assert says in str(e.value) and "\n" not in str(e.value).strip()


@pytest.mark.parametrize(
    "overrides, processes, says",
    [
        (["parallel.tp=2"], 2, "parallel.tp=1"),
        (["parallel.fsdp=2"], 2, "parallel.fsdp=1"),
        (["train.micro_batch_size=6", "finetune.rl.num_generations=4"], 1, "must divide"),
        (["finetune.rl.steps_per_generation=3", "train.grad_accum=2"], 1, "multiple of train.grad_accum"),
        (["finetune.rl.rollout=server"], 1, "finetune.rl.server_url"),
        (["finetune.rl.rollout=server", "finetune.rl.server_url=http://h:8000", "finetune.method=full"], 1, "lora"),
    ],
)
def test_layouts_grpo_cannot_run_are_refused_in_one_line(overrides, processes, says):
    from kubetune.recipe.layout import check_recipe, layout_for

    base = ["finetune.objective=grpo", "train.global_batch_size=null", "train.grad_accum=1", "train.micro_batch_size=8"]
    recipe = load_recipe(None, [*base, *overrides]).recipe
    with pytest.raises(UserError) as e:
        check_recipe(layout_for(recipe.parallel, processes), recipe)
    assert says in str(e.value) and "\n" not in str(e.value).strip()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["train.micro_batch_size=3"], "must divide"),  # before any model loads
        (["finetune.rl.reward_funcs=[acuracy]"], "accuracy"),  # the nearest built-in named
    ],
)
def test_refused_grpo_runs_exit_2_with_one_line(tmp_path, grpo_overrides, overrides, says):
    args = ["train", "--nproc-per-node", "1", *grpo_overrides, *overrides, f"output_dir={tmp_path}/r"]
    done = run_cli_subprocess(args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
