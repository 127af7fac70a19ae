"""AdamW (fused where the device has it) and the warm-up + decay schedules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kubetune.recipe.schema import TrainSection
from kubetune.training.parallel import MeshLayout, clip_grad_norm, needs_replica_sync, sync_replicas


def build_optimizer(model: torch.nn.Module, train: TrainSection, impl: str = "fused") -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; `impl` is fused | foreach | loop.

    fused: one kernel for all parameters (CPU and CUDA), for plain tensors. foreach: for
    sharded DTensor parameters (FSDP2). loop: for a mix of DTensor and plain parameters
    (tensor parallel), which neither multi-tensor path accepts.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
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


def build_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainSection, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, train.warmup_steps, total_steps, train.lr_schedule)
    )


def restore_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Continue the schedule at a checkpoint's step, with this run's length.

    The loaded optimizer groups hold the learning rate of the saving run's schedule (whose
    length may differ); set each group's rate from this run's schedule at the saved step.
    The loop reads the rate from the groups (`Optimization.lr`), never the scheduler's cache.
    """
    scheduler.load_state_dict(state)
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)


@dataclass(frozen=True)
class Optimization:
    """What turns gradients into a step: optimizer, schedule, loss scaler, clipping."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    params: list[torch.nn.Parameter]
    max_grad_norm: float  # inf = no clipping
    max_scale: float | None = None  # cap on the fp16 loss scale (GradScaler has none)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, layout: MeshLayout) -> float:
        """Average replicas' gradients where no wrapper did, clip, step, advance the
        schedule; returns the global gradient norm (before clipping)."""
        if needs_replica_sync(layout):
            sync_replicas(self.params, layout)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.params, self.max_grad_norm, layout)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.update_scale(self.scaler)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return float(grad_norm)

    def update_scale(self, scaler: torch.amp.GradScaler) -> None:
        """Back off or grow the loss scale as torch does, then hold it under `max_scale`:
        GradScaler has no cap, so one is applied here, after its update."""
        scaler.update()
        if self.max_scale is not None and scaler.get_scale() > self.max_scale:
            scaler.update(new_scale=float(self.max_scale))


def build_scaler(train: TrainSection, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16's dynamic loss scaler with the recipe's settings (None for other precisions)."""
    if train.precision != "fp16":
        return None
    ls = train.loss_scale
    return torch.amp.GradScaler(
        device.type,
        init_scale=ls.init_scale,
        growth_factor=ls.growth_factor,
        backoff_factor=ls.backoff_factor,
        growth_interval=ls.growth_interval,
    )


def build_optimization(
    params_of: torch.nn.Module, train: TrainSection, layout: MeshLayout, device: torch.device, total_steps: int
) -> Optimization:
    # fused AdamW takes plain tensors; FSDP2's sharded DTensors need foreach; tensor
    # parallelism mixes DTensors and plain tensors, which only the loop accepts
    impl = "loop" if layout.tp > 1 else "foreach" if layout.sharded else "fused"
    optimizer = build_optimizer(params_of, train, impl=impl)
    return Optimization(
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, train, total_steps),
        scaler=build_scaler(train, device),
        params=[p for p in params_of.parameters() if p.requires_grad],
        max_grad_norm=train.max_grad_norm or float("inf"),
        max_scale=train.loss_scale.max_scale,
    )
