"""GRPO's arithmetic: advantages from grouped rewards, the clipped token loss, the KL term and
the four ways of summing token losses. Each formula is TRL's GRPOTrainer (v1.16,
`_generate_and_score_completions` and `_compute_loss`), written out where it is used.

Tensors are flat over one micro-batch's completion tokens ([tokens]), with `seq` giving each
token's completion (0..n-1 in the micro-batch); advantages are per completion ([n]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's `nanstd`: the std ignoring NaNs, with Bessel's correction (NaN from fewer than 2 values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(
    rewards: torch.Tensor, group: int, scale: str, batch_std: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [n], whether each completion's reward std is zero [n]) from rewards [n]
    (NaN: unscorable), in groups of `group` consecutive completions of one prompt.

    advantage = reward - mean of its group, divided by (std + 1e-4) of its group (`group`) or
    of the whole step (`batch`: `batch_std`, all processes' rewards) or not at all (`none`);
    an unscorable completion's advantage is 0."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = (batch_std if batch_std is not None else nanstd(rewards)).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    std_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), std_zero


@dataclass(frozen=True)
class TokenLoss:
    """Per-token terms of one micro-batch."""

    loss: torch.Tensor  # [tokens] the clipped policy term, plus beta x KL
    kl: torch.Tensor | None  # [tokens], beta > 0 only
    low_clipped: torch.Tensor  # [tokens] bool: ratio < 1 - eps_low where the advantage is negative
    high_clipped: torch.Tensor  # [tokens] bool: ratio > 1 + eps_high where the advantage is positive


def token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
) -> TokenLoss:
    """TRL's token loss: ratio = exp(logp - old); -min(ratio x A, clip(ratio, 1 - eps_low,
    1 + eps_high) x A), plus beta x (exp(ref - logp) - (ref - logp) - 1), the k3 estimate of
    KL(policy || reference). `advantages` are per token (each its completion's)."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if beta != 0.0:
        assert ref_logps is not None
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
    return TokenLoss(loss, kl, (ratio < 1 - eps_low) & (advantages < 0), (ratio > 1 + eps_high) & (advantages > 0))


@dataclass(frozen=True)
class Reduction:
    """How a micro-batch's token losses become its share of the step's loss (TRL's per loss_type)."""

    loss_type: str
    accum: int  # micro-batches per optimizer step on each process
    max_completion_length: int
    tokens_per_process: float  # dapo: the generation batch's completion tokens (all processes) / processes
    generation_steps: int  # micro-steps one generation batch feeds (TRL's steps_per_generation)

    def __call__(self, token_losses: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, n_seqs: int) -> torch.Tensor:
        """grpo: mean per completion, then over completions; bnpo: mean over tokens; dr_grpo: sum
        / (completions x max_completion_length); each / accum (the micro-batches of a step), as
        TRL. dapo: sum / (generation tokens / processes) x steps_per_generation / accum."""
        masked = token_losses * mask
        if self.loss_type == "grpo":
            per_seq = torch.zeros(n_seqs, dtype=masked.dtype).index_add_(0, seq, masked)
            counts = torch.zeros(n_seqs, dtype=masked.dtype).index_add_(0, seq, mask.to(masked.dtype))
            return (per_seq / counts.clamp(min=1.0)).mean() / self.accum
        if self.loss_type == "bnpo":
            return masked.sum() / mask.sum().clamp(min=1.0) / self.accum
        if self.loss_type == "dr_grpo":
            return masked.sum() / (n_seqs * self.max_completion_length) / self.accum
        normalizer = max(self.tokens_per_process, 1.0) * self.accum / self.generation_steps
        return masked.sum() / normalizer
