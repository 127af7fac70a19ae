"""Preference training (finetune.objective = dpo | orpo | simpo): the losses against values
worked out by hand, the per-sample log-probs of the chunked head against the plain head, and
whole runs on the tiny model: TRL's metrics, the reference from the same weights (on the fly
and precomputed agree), step-exact resume after SIGKILL, and the refused combinations."""

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kubetune.errors import UserError
from kubetune.models.finetune import head_logps
from kubetune.models.lm_loss import sample_logprobs
from kubetune.recipe import load_recipe
from kubetune.training.preference import (
    PAIR_METRICS,
    Objective,
    PairIndex,
    dpo_loss,
    orpo_loss,
    precomputes,
    simpo_loss,
)
from kubetune.training.run import train_from_recipe
from tests.kit.processes import finish, kill_after_checkpoint, start_kubetune

TRL_KEYS = {"loss", *PAIR_METRICS}


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)"""
    return math.log1p(math.exp(x))


# ------------------------------------------------------------------ the losses, by hand


def test_dpo_loss_is_the_sigmoid_of_the_reward_margin():
    t = torch.tensor
    # log-ratios: chosen -1 - (-1.5) = 0.5, rejected -2 - (-1.5) = -0.5: margin 1, beta 0.1
    losses, rc, rr = dpo_loss(t([-1.0]), t([-2.0]), t([-1.5]), t([-1.5]), beta=0.1)
    assert losses.item() == pytest.approx(softplus(-0.1), rel=1e-6)  # -log sigmoid(0.1)
    assert (rc.item(), rr.item()) == pytest.approx((0.05, -0.05))
    # conservative DPO: 10% of the labels assumed flipped
    smoothed, _, _ = dpo_loss(t([-1.0]), t([-2.0]), t([-1.5]), t([-1.5]), beta=0.1, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * softplus(-0.1) + 0.1 * softplus(0.1), rel=1e-6)


def test_orpo_odds_ratio_term():
    c, r = -0.5, -1.0  # mean log-probs per token
    log_odds = (c - r) - (math.log(1 - math.exp(c)) - math.log(1 - math.exp(r)))
    term, rc, rr = orpo_loss(torch.tensor([c]), torch.tensor([r]), beta=0.1)
    assert term.item() == pytest.approx(0.1 * softplus(-log_odds), rel=1e-6)  # -beta log sigmoid(log_odds)
    assert (rc.item(), rr.item()) == pytest.approx((-0.05, -0.1))


def test_simpo_loss_has_its_target_margin():
    # z = beta ((c - r) - gamma / beta) = 2 (0.5 - 0.25) = 0.5
    losses, rc, rr = simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]), beta=2.0, gamma=0.5)
    assert losses.item() == pytest.approx(softplus(-0.5), rel=1e-6)
    assert (rc.item(), rr.item()) == pytest.approx((-1.0, -2.0))
    smoothed, _, _ = simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]), 2.0, 0.5, label_smoothing=0.2)
    assert smoothed.item() == pytest.approx(0.8 * softplus(-0.5) + 0.2 * softplus(0.5), rel=1e-6)


# ------------------------------------------------------------------ per-sample log-probs of the chunked head


def plain_logprobs(hidden, weight, targets, samples, n):
    picked = -F.cross_entropy((hidden @ weight.t()).float(), targets.clamp(min=0), reduction="none")
    keep = samples >= 0
    return torch.zeros(n).index_add_(0, samples[keep], picked[keep])


@pytest.mark.parametrize("chunk", [1, 8, 1000])
@pytest.mark.parametrize("train_weight", [False, True])
@pytest.mark.parametrize("vocab_slice", [16, 4096])
def test_sample_logprobs_and_gradients_equal_the_plain_head(chunk, train_weight, vocab_slice):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(37, 24, generator=g), torch.randn(101, 24, generator=g) * 0.3
    targets = torch.randint(0, 101, (37,), generator=g)
    samples = torch.randint(-1, 5, (37,), generator=g)  # -1: a row of no sample
    upstream = torch.randn(5, generator=g)  # what a preference loss sends back per sample
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    ours = sample_logprobs(h1, w1, targets, samples, 5, chunk_rows=chunk, vocab_slice=vocab_slice)
    ref = plain_logprobs(h2, w2, targets, samples, 5)
    (ours * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    if train_weight:
        torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-5)
    else:
        assert w1.grad is None


@pytest.mark.parametrize("vocab_slice", [16, 4096])
def test_sample_entropy_equals_the_plain_softmax_entropy(vocab_slice):
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(37, 24, generator=g), torch.randn(101, 24, generator=g)
    targets, samples = torch.randint(0, 101, (37,), generator=g), torch.randint(-1, 5, (37,), generator=g)
    entropy = torch.zeros(5)
    sample_logprobs(hidden, weight, targets, samples, 5, chunk_rows=8, entropy=entropy, vocab_slice=vocab_slice)
    logp = (hidden @ weight.t()).log_softmax(-1)
    per_row = -(logp.exp() * logp).sum(-1)
    keep = samples >= 0
    expected = torch.zeros(5).index_add_(0, samples[keep], per_row[keep])
    torch.testing.assert_close(entropy, expected, rtol=1e-5, atol=1e-4)


def test_sample_logprobs_under_bf16_autocast_match_the_plain_head_under_autocast():
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(64, 32, generator=g), (torch.randn(257, 32, generator=g) * 0.3).to(torch.bfloat16)
    targets, samples = torch.randint(0, 257, (64,), generator=g), torch.randint(0, 4, (64,), generator=g)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = sample_logprobs(h1, weight, targets, samples, 4, chunk_rows=16, vocab_slice=64)
        ref = plain_logprobs(h2, weight, targets, samples, 4)
    ours.sum().backward()
    ref.sum().backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=5e-2)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=2e-2, atol=2e-3)


def test_static_shapes_and_a_wrapped_head_give_the_same_logprobs():
    g = torch.Generator().manual_seed(1)
    head = nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 9, 16, generator=g)
    targets = torch.randint(0, 50, (2, 9), generator=g)
    owner = torch.randint(-1, 3, (2, 9), generator=g)
    targets[owner < 0] = -100
    selected = head_logps(head, hidden, targets, owner, 3, static_shapes=False)
    padded = head_logps(head, hidden, targets, owner, 3, static_shapes=True)
    through_module = head_logps(nn.Sequential(head), hidden, targets, owner, 3)  # not a plain Linear
    torch.testing.assert_close(selected, padded)
    torch.testing.assert_close(selected, through_module)


# ------------------------------------------------------------------ recipes


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["finetune.objective=dpo", "finetune.method=full", "finetune.preference.reference=adapter_off"], "copy"),
        (["finetune.objective=orpo", "finetune.preference.label_smoothing=0.1"], "ORPO has none"),
    ],
)
def test_bad_combinations_are_one_line(overrides, says):
    with pytest.raises(UserError) as e:
        load_recipe(None, overrides)
    assert says in str(e.value) and "\n" not in str(e.value).strip()


def test_auto_precomputes_from_one_epoch_on():
    auto = load_recipe(None, ["finetune.objective=dpo"]).recipe
    assert precomputes(auto, total_steps=10, steps_per_epoch=10)
    assert not precomputes(auto, total_steps=9, steps_per_epoch=10)
    asked = load_recipe(None, ["finetune.objective=dpo", "finetune.preference.reference_logps=on_the_fly"]).recipe
    assert not precomputes(asked, total_steps=100, steps_per_epoch=10)


# ------------------------------------------------------------------ whole runs on the tiny model


@pytest.fixture
def pairs_file(tmp_path):
    rows = [
        {
            "instruction": "Answer this question truthfully",
            "input": f"What is fact number {i}?",
            "chosen": f"Fact number {i} is that {i} plus {i} equals {2 * i}.",
            "rejected": f"I do not know fact {i}.",
        }
        for i in range(40)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def pref_overrides(tiny_overrides, pairs_file):
    return [o for o in tiny_overrides if not o.startswith(("data.train=", "eval.generate"))] + [
        f"data.train={pairs_file}",
        "eval.generate=0",
        "finetune.objective=dpo",
        "train.log_every=1",
    ]


def records(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.process
def test_dpo_on_the_fly_and_precomputed_reference_train_the_same(tmp_path, pref_overrides):
    fly = tmp_path / "fly"
    pre = tmp_path / "pre"
    steps = ["train.max_steps=4", "train.save_every=0"]
    a = train_from_recipe(
        None, pref_overrides + steps + [f"output_dir={fly}", "finetune.preference.reference_logps=on_the_fly"]
    )
    b = train_from_recipe(
        None, pref_overrides + steps + [f"output_dir={pre}", "finetune.preference.reference_logps=precompute"]
    )
    ra, rb = records(fly), records(pre)
    assert all(set(r) >= TRL_KEYS for r in ra + rb)
    # the reference is the starting model: at step 1 every reward is 0 and DPO's loss is log 2
    assert ra[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert ra[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    for x, y in zip(ra, rb):
        for key in TRL_KEYS:
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), key
    assert ra[-1]["rewards/margins"] > 0 and ra[-1]["loss"] < ra[0]["loss"]
    assert (pre / "reference_logps.pt").is_file() and not (fly / "reference_logps.pt").exists()
    # held-out pairs: the accuracy of their rewards, the perplexity of their chosen answers
    assert a.reward_accuracy_before == 0.0 and a.reward_accuracy_after == pytest.approx(b.reward_accuracy_after)
    assert a.reward_accuracy_after > 0.5
    assert a.eval_loss_after < a.eval_loss_before == pytest.approx(math.log(2), abs=1e-6)
    summary = json.loads((fly / "summary.json").read_text())
    assert summary["objective"] == "dpo" and summary["eval_after"]["eval_rewards/accuracies"] == a.reward_accuracy_after
    assert summary["perplexity_after"] > 1
    # `kubetune eval RUN` scores the same pairs with the same code (the adapter switched off for the reference)
    from kubetune.training.evaluate import eval_target

    again = eval_target(str(fly), [])
    assert again.objective_metrics == pytest.approx(summary["eval_after"], rel=1e-4, abs=1e-5)
    assert again.perplexity == pytest.approx(summary["perplexity_after"], rel=1e-4)


@pytest.mark.process
def test_full_dpo_reference_copy_equals_the_precomputed_start(tmp_path, pref_overrides):
    full = pref_overrides + ["finetune.method=full", "train.lr=1e-3", "train.max_steps=3", "train.save_every=0"]
    copy = records_of(tmp_path / "copy", full + ["finetune.preference.reference_logps=on_the_fly"])
    pre = records_of(tmp_path / "pre", full + ["finetune.preference.reference_logps=precompute"])
    assert copy[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for x, y in zip(copy, pre):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
        assert x["rewards/margins"] == pytest.approx(y["rewards/margins"], rel=1e-3, abs=1e-5)


def records_of(out, overrides):
    train_from_recipe(None, overrides + [f"output_dir={out}"])
    return records(out)


@pytest.mark.process
def test_a_copy_over_the_memory_budget_is_refused_with_its_cost(tmp_path, pref_overrides, monkeypatch):
    monkeypatch.setenv("KUBETUNE_MEMORY_BUDGET", str(1024**2))  # 1 MiB
    args = pref_overrides + ["finetune.method=full", "finetune.preference.reference_logps=on_the_fly"]
    with pytest.raises(UserError, match=r"frozen copy of the weights costs .* GiB per process"):
        train_from_recipe(None, args + [f"output_dir={tmp_path / 'run'}"])


@pytest.mark.process
@pytest.mark.parametrize("objective", ["orpo", pytest.param("simpo", marks=pytest.mark.slow)])
def test_reference_free_objectives_learn_the_preference(tmp_path, pref_overrides, objective):
    out = tmp_path / objective
    summary = train_from_recipe(
        None, pref_overrides + [f"finetune.objective={objective}", "train.max_steps=6", f"output_dir={out}"]
    )
    rs = records(out)
    assert all(set(r) >= TRL_KEYS for r in rs)
    assert rs[-1]["rewards/margins"] > rs[0]["rewards/margins"]
    assert summary.reward_accuracy_after >= summary.reward_accuracy_before
    assert not (out / "reference_logps.pt").exists()  # no reference at all


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
@pytest.mark.process
def test_dpo_sigkill_then_rerun_matches_the_uninterrupted_run(tmp_path, pref_overrides):
    common = pref_overrides + [
        "train.max_steps=8",
        "train.save_every=3",
        "finetune.preference.reference_logps=precompute",
    ]
    straight = tmp_path / "straight"
    train_from_recipe(None, common + [f"output_dir={straight}"])
    out = tmp_path / "killed"
    kill_after_checkpoint(start_kubetune(["train", *common, f"output_dir={out}"]), out, step=6)
    table = (out / "reference_logps.pt").stat().st_mtime_ns
    resumed = start_kubetune(["train", *common, f"output_dir={out}"])
    log, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, log
    assert "resumed from" in log and "reference log-probs read from" in log
    assert (out / "reference_logps.pt").stat().st_mtime_ns == table  # read back, not recomputed
    a, b = records(straight), records(out)
    assert [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b):
        for key in TRL_KEYS:
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (key, x["step"])


# ------------------------------------------------------------------ several processes


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "parallel, reference_logps",
    [
        pytest.param(
            [], "on_the_fly", marks=pytest.mark.slow
        ),  # DDP, the adapter off in every step (CI: GRPO's and SFT's DDP)
        # FSDP2, each rank's share of the table summed (slow: CI runs FSDP2 in test_distributed.py)
        pytest.param(["parallel.fsdp=2"], "precompute", marks=pytest.mark.slow),
    ],
)
def test_two_processes_train_dpo_as_one(tmp_path, pref_overrides, parallel, reference_logps):

    common = [o for o in pref_overrides if not o.startswith(("train.grad_accum", "train.num_threads"))] + [
        "train.max_steps=3",
        "train.save_every=0",
        f"finetune.preference.reference_logps={reference_logps}",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    train_from_recipe(None, [*common, "train.grad_accum=2", f"output_dir={one}"])
    out = finish(
        start_kubetune(
            ["train", "--nproc-per-node", "2", *common, *parallel, "train.grad_accum=1", f"output_dir={two}"]
        )
    )
    assert "2 process(es)" in out
    for x, y in zip(records(one), records(two), strict=True):
        for key in TRL_KEYS:
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (key, x["step"])
    sa, sb = (json.loads((run / "summary.json").read_text()) for run in (one, two))
    assert sa["eval_after"] == pytest.approx(sb["eval_after"], rel=1e-4, abs=1e-5)


def test_the_exporter_serves_trl_metrics_by_name():
    from prometheus_client import generate_latest

    from kubetune.training.telemetry import Identity, Telemetry, TrainMetrics

    metrics = TrainMetrics(Identity(job="run", rank=0, node="n"), multiprocess=False)
    telemetry = Telemetry(metrics, None, total_steps=10, world_size=1, flops_per_token=0.0, peak_flops=0.0)
    telemetry.objective({"loss": 0.6, "rewards/accuracies": 0.75, "eval_rewards/margins": 0.5})
    text = generate_latest(metrics.registry).decode()
    assert 'kubetune_train_preference{job="run",metric="rewards/accuracies",node="n",rank="0"} 0.75' in text
    assert 'metric="eval_rewards/margins"' in text and 'metric="loss"' not in text


def test_the_loss_plot_shows_the_reward_accuracy(tmp_path):
    from kubetune.training.runlog import plot_loss_curve

    def png(with_accuracy: bool) -> bytes:
        rows = [{"step": s, "loss": 0.7 - 0.05 * s, "tokens_per_s": 100.0} for s in (1, 2, 3, 4)]
        for r in rows if with_accuracy else []:
            r["rewards/accuracies"] = r["step"] / 4
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss_curve.png", [[4, 0.5]])
        return (tmp_path / "loss_curve.png").read_bytes()

    assert png(with_accuracy=True) != png(with_accuracy=False)


def test_tensor_and_pipeline_parallel_are_refused_in_one_line():
    from kubetune.errors import RecipeError
    from kubetune.recipe.layout import check_recipe, layout_for

    recipe = load_recipe(None, ["finetune.objective=simpo", "parallel.pp=2"]).recipe
    with pytest.raises(RecipeError, match=r"finetune.objective=simpo runs data parallel .* set parallel.tp=1"):
        check_recipe(layout_for(recipe.parallel, 2), recipe)
    sft = load_recipe(None, ["parallel.pp=2"]).recipe
    check_recipe(layout_for(sft.parallel, 2), sft)  # SFT keeps its pipelines


def test_packed_sequence_logprobs_equal_each_sequence_scored_alone(tiny_model_dir, pairs_file, tokenizer, tmp_path):
    """The whole chain: pairs packed several to a row, each target attributed to its sample,
    through the chunked head, equal each answer scored alone by the plain model."""
    from kubetune.data import Batcher, prepare_data
    from kubetune.models.finetune import build_model
    from kubetune.models.kernels import autocast_context
    from kubetune.training.runner import LocalRunner

    overrides = [f"model.name_or_path={tiny_model_dir}", f"data.train={pairs_file}", "finetune.objective=dpo"]
    recipe = load_recipe(None, [*overrides, f"data.cache_dir={tmp_path}", "train.precision=fp32"]).recipe
    recipe = recipe.with_kernels("fp32", "fp32")
    data = prepare_data(recipe, tokenizer)
    batcher = Batcher(data.train, max_seq_len=128, micro_batch_size=2, packing=True, seed=0, pad_id=0)
    b, _ = batcher.micro_batch(0, 0)
    assert len(b.chosen) > 2  # several pairs share the rows
    model = build_model(recipe, str(tiny_model_dir), torch.device("cpu"))
    runner = LocalRunner(model.loss, model.loss, torch.device("cpu"), autocast_context("fp32", torch.device("cpu")))
    with torch.no_grad():
        packed = runner.sample_logps(model.loss, b)
        samples = data.train.unit_samples(PairIndex.of(b).pair_ids.tolist())
        for s, i in enumerate(samples):
            ids_np, trained_np = data.train.sample(i)
            ids, trained = torch.from_numpy(ids_np.astype("int64")), torch.from_numpy(trained_np)
            logits = model.lm(input_ids=ids[None]).logits[0, :-1].float()
            picked = logits.log_softmax(-1).gather(1, ids[1:, None]).squeeze(1)
            assert packed[s].item() == pytest.approx(picked[trained[1:]].sum().item(), rel=1e-4), s
        # a rank whose share of the eval pairs ran out forwards an empty micro-batch with the others
        empty = batcher.empty()
        logps, no_reference = runner.sample_logps(model.loss, empty), (torch.zeros(0), torch.zeros(0))
        _, sums = Objective.of(recipe).micro_batch_loss(logps, empty, no_reference, 1.0, 1.0)
        assert sums.tolist() == [0.0] * len(sums)


def test_the_progress_line_carries_the_reward_accuracy_and_parses_back():
    from kubetune.contracts.progress_line import ProgressLine, format_line, parse_line

    line = format_line(ProgressLine(step=3, total=10, elapsed_s=30.0, loss=0.61, lr=1e-4, accuracy=0.75))
    assert "rewards/accuracies=0.7500" in line
    back = parse_line(f"2026-12-01T10:00:00Z {line}")
    assert back is not None and (back.step, back.loss, back.accuracy) == (3, 0.61, 0.75)
    assert parse_line(format_line(ProgressLine(step=3, total=10, elapsed_s=30.0, loss=0.61))).accuracy is None
