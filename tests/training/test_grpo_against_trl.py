"""kubetune's GRPO loss against TRL's own `GRPOTrainer._compute_loss` (the installed TRL), for
every loss_type kubetune offers: the same per-token log-probabilities, old and reference
log-probabilities, advantages and masks give the same loss, the same gradient and the same
clip-ratio and KL metrics.

TRL's method runs unbound over a stand-in trainer that holds exactly the attributes it reads
(its config's values as kubetune's recipe sets them); the model forward it would call returns
the log-probabilities under test, so what is compared is TRL's formulas and normalisation,
token by token, not two forwards."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch

from kubetune.training.grpo_loss import Reduction, token_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

EPS_LOW, EPS_HIGH, MAX_LEN = 0.2, 0.28, 6
LENGTHS = torch.tensor([6, 3, 5])  # three completions' tokens, padded to MAX_LEN in TRL's layout


class _OneProcess:
    """What TRL asks of accelerate's Accelerator on one process."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_trainer(loss_type: str, beta: float, accum: int, steps_per_generation: int, logps: torch.Tensor):
    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=steps_per_generation)
    entropies = torch.zeros_like(logps)
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=args,
        loss_type=loss_type,
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accum,
        max_completion_length=MAX_LEN,
        accelerator=_OneProcess(),
        _entropy_bonus_enabled=False,
        _metrics={"train": collections.defaultdict(list)},
    )


def _case(seed: int):
    """Three completions of 6, 3 and 5 tokens (padded to 6), the second one masked after 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(MAX_LEN)[None, :] < LENGTHS[:, None]).float()
    mask[1, 2:] = 0.0
    old = -torch.rand(3, MAX_LEN, generator=g) * 3
    logps = old + torch.randn(3, MAX_LEN, generator=g) * 0.4  # ratios on both sides of the clip range
    ref = old + torch.randn(3, MAX_LEN, generator=g) * 0.3
    advantages = torch.tensor([1.3, -0.7, -0.6])
    return logps, old, ref, advantages, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_loss_its_gradient_and_metrics_equal_trls(loss_type, beta):
    logps, old, ref, advantages, mask = _case(seed=7)
    accum, steps_per_generation, generation_tokens = 2, 4, 40.0

    theirs_logps = logps.clone().requires_grad_()
    trainer = _trl_trainer(loss_type, beta, accum, steps_per_generation, theirs_logps)
    inputs = {
        "prompt_ids": torch.zeros(3, 2, dtype=torch.long),
        "prompt_mask": torch.ones(3, 2),
        "completion_ids": torch.zeros(3, MAX_LEN, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(generation_tokens),
    }
    theirs = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    theirs.backward()

    # kubetune's layout: the completions' tokens one after another, each with its completion's index
    flat = torch.arange(MAX_LEN)[None, :] < LENGTHS[:, None]
    seq = torch.arange(3)[:, None].expand(3, MAX_LEN)[flat]
    ours_logps = logps[flat].clone().requires_grad_()
    terms = token_loss(ours_logps, old[flat], advantages[seq], EPS_LOW, EPS_HIGH, beta, ref[flat])
    reduce = Reduction(loss_type, accum, MAX_LEN, generation_tokens, steps_per_generation)
    ours = reduce(terms.loss, mask[flat], seq, 3)
    ours.backward()

    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert ours_logps.grad.tolist() == pytest.approx(theirs_logps.grad[flat].tolist(), rel=1e-5, abs=1e-8)
    m = mask[flat]
    metrics = trainer._metrics["train"]
    assert (terms.low_clipped * m).sum().item() / m.sum().item() == pytest.approx(metrics["clip_ratio/low_mean"][0])
    assert (terms.high_clipped * m).sum().item() / m.sum().item() == pytest.approx(metrics["clip_ratio/high_mean"][0])
    assert 0 < metrics["clip_ratio/region_mean"][0] < 1  # the case clips some tokens, not all
    if beta:
        assert (terms.kl * m).sum().item() / m.sum().item() == pytest.approx(metrics["kl"][0], rel=1e-6)
