"""The training loop on a tiny model: it learns, it reports, it resumes step-exact."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kubetune.errors import RunDirError
from kubetune.training.run import train_from_recipe
from tests.kit.cli import run_cli_in_process
from tests.kit.processes import kill_after_checkpoint, start_kubetune

from ..conftest import resumed_here, tiny_recipe, write_qa_file

pytestmark = pytest.mark.process

METRIC_KEYS = {"step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"}
SUMMARY_KEYS = {
    "eval_loss_before",
    "eval_loss_after",
    "perplexity_before",
    "perplexity_after",
    "train_tokens",
    "tokens_per_s",
    "wall_s",
    "peak_rss_mb",
    "samples",
}


def test_lora_training_learns_reports_and_exports(tmp_path, tiny_overrides, tiny_model_dir):
    out = tmp_path / "run"
    summary = train_from_recipe(None, tiny_overrides + [f"output_dir={out}", "train.max_steps=12"])
    assert set(summary.as_dict()) >= SUMMARY_KEYS
    assert summary.eval_loss_after < summary.eval_loss_before
    assert summary.perplexity_after < summary.perplexity_before
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all(set(r) >= METRIC_KEYS for r in records)
    assert records[-1]["tokens"] == summary.train_tokens > 0
    assert records[-1]["loss"] < records[0]["loss"]
    assert (out / "loss_curve.png").stat().st_size > 1000
    # PEFT adapter: every LoRA B matrix moved away from its zero init
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    lora_b = {k: v for k, v in adapter.items() if "lora_B" in k}
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values())
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-10", "step-12"]  # keep_last=2


def test_full_finetune_changes_every_weight(tmp_path, tiny_overrides, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "full"
    train_from_recipe(
        None,
        tiny_overrides
        + [f"output_dir={out}", "finetune.method=full", "train.max_steps=2", "train.lr=1e-3", "eval.generate=0"],
    )
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    for name, tensor in before.items():
        assert not torch.equal(tensor, after[name]), f"{name} did not change"


def test_a_different_recipe_never_clobbers_a_run(tmp_path, tiny_overrides):
    out = tmp_path / "run"
    train_from_recipe(None, tiny_overrides + [f"output_dir={out}", "train.max_steps=2", "eval.generate=0"])
    summary_before = (out / "summary.json").read_bytes()
    with pytest.raises(RunDirError, match="different recipe"):
        train_from_recipe(None, tiny_overrides + [f"output_dir={out}", "train.max_steps=2", "train.lr=5e-3"])
    assert (out / "summary.json").read_bytes() == summary_before


def test_sigkill_then_rerun_matches_the_uninterrupted_run(tmp_path, tiny_overrides, caplog):
    common = tiny_overrides + ["train.max_steps=10", "train.save_every=3", "eval.generate=0", "lora.dropout=0.1"]
    straight = train_from_recipe(None, common + [f"output_dir={tmp_path / 'straight'}"])

    out = tmp_path / "killed"
    kill_after_checkpoint(start_kubetune(["train", *common, f"output_dir={out}", "train.log_every=1"]), out, step=6)
    assert not (out / "summary.json").exists()
    resumed_here(common + [f"output_dir={out}"], caplog)
    final = json.loads((out / "summary.json").read_text())
    assert abs(final["eval_loss_after"] - straight.eval_loss_after) < 1e-3
    a = [json.loads(ln) for ln in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == list(range(1, 11))
    assert abs(a[-1]["loss"] - b[-1]["loss"]) < 1e-3
    assert a[-1]["tokens"] == b[-1]["tokens"]


def _loss_curve(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


SHORT = ["train.max_steps=3", "eval.generate=0", "train.save_every=0"]


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory, tiny_model_dir) -> list[float]:
    """The loss curve of the SHORT tiny run without gradient checkpointing, trained once for
    both modes to compare with."""
    root = tmp_path_factory.mktemp("plain")
    recipe = tiny_recipe(tiny_model_dir, write_qa_file(root / "qa.jsonl"), root / "cache")
    train_from_recipe(None, [*recipe, *SHORT, f"output_dir={root / 'run'}"])
    return _loss_curve(root / "run")


@pytest.mark.parametrize("mode", ["on", "offload"])
def test_gradient_checkpointing_changes_memory_not_math(tmp_path, tiny_overrides, plain_losses, mode):
    train_from_recipe(
        None, [*tiny_overrides, *SHORT, f"output_dir={tmp_path / mode}", f"train.gradient_checkpointing={mode}"]
    )
    checkpointed = _loss_curve(tmp_path / mode)
    assert len(checkpointed) == len(plain_losses) == 3
    for a, b in zip(plain_losses, checkpointed):
        assert abs(a - b) < 1e-5


def test_fp16_with_loss_scaling_and_bf16_train(tmp_path, tiny_overrides):
    for precision in ("fp16", "bf16"):
        s = train_from_recipe(
            None,
            tiny_overrides
            + [
                "train.max_steps=3",
                "eval.generate=0",
                f"train.precision={precision}",
                f"output_dir={tmp_path / precision}",
                # seed 000's scaler (fp16 only; bf16 ignores it): capped at its start, grows every 100 steps
                "train.loss_scale.max_scale=65536",
                "train.loss_scale.growth_interval=100",
            ],
        )
        losses = _loss_curve(tmp_path / precision)
        assert all(x == x and x < 20 for x in losses), losses  # finite
        assert s.eval_loss_after < s.eval_loss_before


@pytest.mark.slow  # CI: fp16 loss scaling (test_fp16_with_loss_scaling_and_bf16_train) and exact resume (sigkill) apart
def test_fp16_resume_continues_the_loss_scale(tmp_path, tiny_overrides):
    """The GradScaler's scale and growth tracker are checkpointed: a resumed fp16 run ends
    with the scale of the uninterrupted one (it would restart at init_scale otherwise)."""
    common = [
        *tiny_overrides,
        "eval.generate=0",
        "train.precision=fp16",
        "train.loss_scale.init_scale=1024",
        "train.loss_scale.growth_interval=1",  # the scale doubles after every clean step
        "train.save_every=1",
    ]

    def final_scale(run):
        last = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
        return json.loads((last / "meta.json").read_text())["loss_scaler"]["scale"]

    train_from_recipe(None, [*common, "train.max_steps=4", f"output_dir={tmp_path / 'straight'}"])
    train_from_recipe(None, [*common, "train.max_steps=2", f"output_dir={tmp_path / 'resumed'}"])
    train_from_recipe(None, [*common, "train.max_steps=4", f"output_dir={tmp_path / 'resumed'}"])
    assert final_scale(tmp_path / "straight") == final_scale(tmp_path / "resumed") > 1024


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_compile_runs_and_matches_eager(tmp_path, tiny_overrides):
    common = tiny_overrides + ["train.max_steps=2", "eval.generate=0", "train.save_every=0"]
    train_from_recipe(None, common + [f"output_dir={tmp_path / 'eager'}"])
    train_from_recipe(None, common + [f"output_dir={tmp_path / 'compiled'}", "train.compile=true"])
    for a, b in zip(_loss_curve(tmp_path / "eager"), _loss_curve(tmp_path / "compiled")):
        assert abs(a - b) < 1e-4


def test_eval_and_recipe_show_commands(tmp_path, tiny_overrides, capfd):
    from kubetune.training.evaluate import eval_target

    out = tmp_path / "run"
    s = train_from_recipe(None, tiny_overrides + ["train.max_steps=2", "eval.generate=0", f"output_dir={out}"])
    res = eval_target(str(out), [])
    assert abs(res.loss - s.eval_loss_after) < 1e-4
    shown = run_cli_in_process(["recipe", "show", "train.lr=3e-4"], capfd)
    assert shown.returncode == 0, shown.stderr
    assert "train.lr" in shown.stdout and "command line" in shown.stdout and "0.0003" in shown.stdout


def test_memory_budget_stops_with_a_checkpoint_and_resumes(tmp_path, tiny_overrides, caplog, capfd, monkeypatch):
    """Over KUBETUNE_MEMORY_BUDGET (set by the cluster job), every rank saves and the run
    stops with one line naming the knobs; rerunning without the squeeze resumes. Both runs
    through kubetune.cli.main / train_from_recipe in this process (tests/test_cli_errors.py's
    real process shows a UserError from inside the run printed as its one line)."""
    out = tmp_path / "squeezed"
    common = tiny_overrides + ["eval.generate=0", "train.save_every=0", f"output_dir={out}"]
    monkeypatch.setenv("KUBETUNE_MEMORY_BUDGET", str(50 * 2**20))
    res = run_cli_in_process(["train", *common], capfd)
    monkeypatch.delenv("KUBETUNE_MEMORY_BUDGET")
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("kubetune: error")]
    assert len(errors) == 1 and "KUBETUNE_MEMORY_BUDGET" in errors[0] and "train.micro_batch_size" in errors[0]
    assert "Traceback" not in res.stderr
    assert (out / "checkpoints" / "step-1" / "meta.json").is_file()
    resumed_here(common, caplog)
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


def test_memory_is_read_from_the_cgroup(tmp_path, monkeypatch):
    from kubetune.training import memory

    v2, v1 = tmp_path / "v2.stat", tmp_path / "v1.stat"
    v2.write_text("anon 1000\nfile 5000\nshmem 24\n")
    v1.write_text("cache 7\nrss 1\ntotal_rss 300\ntotal_shmem 20\n")
    assert memory.cgroup_unreclaimable(((v2, ("anon", "shmem")),)) == 1024
    assert memory.cgroup_unreclaimable(((tmp_path / "absent", ("anon",)), (v1, ("total_rss", "total_shmem")))) == 320
    assert memory.cgroup_unreclaimable(((tmp_path / "absent", ("anon",)),)) is None
    monkeypatch.setenv(memory.ENV, "not-a-number")
    assert memory.budget_bytes() is None and memory.over_budget(1) is None
    monkeypatch.setenv(memory.ENV, str(2**50))
    assert memory.over_budget(1) is None
    monkeypatch.setenv(memory.ENV, "1")
    assert "over KUBETUNE_MEMORY_BUDGET" in memory.over_budget(1)


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_global_batch_derives_grad_accum_and_trains_as_it(tmp_path, tiny_overrides, caplog):
    """train.global_batch_size=8 with micro-batches of 2 in one process is grad_accum 4, step for step; a
    grad_accum that disagrees is refused before anything loads. The run's first lines say the batch and
    the prompt template."""
    import logging

    from kubetune.errors import RecipeError

    common = [o for o in tiny_overrides if not o.startswith("train.grad_accum")]
    common += ["train.max_steps=2", "eval.generate=0", "train.compile=false"]
    refused = tmp_path / "refused"
    with pytest.raises(RecipeError, match=r"train.grad_accum=2 disagrees with train.global_batch_size=8, which gives"):
        train_from_recipe(None, [*common, "train.grad_accum=2", "train.global_batch_size=8", f"output_dir={refused}"])
    assert not refused.exists()
    train_from_recipe(None, [*common, "train.grad_accum=4", f"output_dir={tmp_path / 'accum'}"])
    with caplog.at_level(logging.INFO, logger="kubetune"):
        # the default recipe's grad_accum 2 is replaced by 1: derived from the global batch
        train_from_recipe(
            None, [*common, "train.grad_accum=1", "train.global_batch_size=8", f"output_dir={tmp_path / 'global'}"]
        )
    assert _losses(tmp_path / "global") == _losses(tmp_path / "accum")
    assert "x 8 rows of <= 128 tokens (global batch: 8 rows" in caplog.text
    assert "prompt template: chat (data.template)" in caplog.text
