"""AdamW (fused where the device has it) and the warm-up + decay schedules."""

from __future__ import annotations

import math

import torch

from kubetune.recipe.schema import TrainSection


def build_optimizer(model, train: TrainSection, impl: str = "fused") -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; `impl` is fused | foreach | loop.

    fused: one kernel for all parameters (CPU and CUDA), for plain tensors. foreach: for
    sharded DTensor parameters (FSDP2). loop: for a mix of DTensor and plain parameters
    (tensor parallel), which neither multi-tensor path accepts.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)  # no decay on norms and biases
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.999), eps=1e-8, **kind)


def lr_lambda(step: int, warmup: int, total: int, schedule: str) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, train: TrainSection, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, train.warmup_steps, total_steps, train.lr_schedule)
    )
