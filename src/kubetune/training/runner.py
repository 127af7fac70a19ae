"""Step runners: how one rank runs forward and backward over a step's micro-batches.

`train_step` and `evaluate` take a `StepRunner` and never ask which layout runs under it:
- `LocalRunner`: the model (whole, or its DDP / FSDP2 / tensor-parallel wrapping) on this
  rank, one micro-batch at a time, gradients synchronised on the last one only;
- `PipelineRunner` (pipeline.py): this rank's stage in a GPipe / 1F1B schedule over the
  whole step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kubetune.data.packing import Batch
from kubetune.models.decoding import AutocastFactory


class StepRunner(Protocol):
    micro_batches: int  # micro-batches one `loss_sum` call takes at most (eval groups them so)

    def forward_backward(self, batches: list[Batch], scale: float) -> float:
        """Gradients of `scale` x the summed target loss of `batches`, accumulated into the
        parameters' .grad; returns the summed loss this rank saw (0 where it has none)."""
        ...

    def loss_sum(self, batches: list[Batch]) -> float:
        """The summed target loss of `batches`, without gradients."""
        ...

    def train(self, mode: bool = True) -> None: ...

    @property
    def training(self) -> bool: ...


def activation_offload(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """`train.gradient_checkpointing=offload | on_offload`: saved tensors wait in CPU memory.

    With `on_offload` the layers are also checkpointed (torch's non-reentrant checkpoint): a
    checkpointed layer saves only its inputs, and it saves them through autograd's
    saved-tensor hooks before its own hook takes over, so these hooks move exactly those
    boundary tensors to CPU, and the layer is recomputed from them in backward. That is
    FairScale's `checkpoint_wrapper(offload_to_cpu=True)`, which seed 000 uses.
    """
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


class LocalRunner:
    """The whole model's loss on this rank.

    `module` is what trains (the loss module, or its DDP wrapper); `eval_module` what
    evaluates (the unwrapped loss module: DDP has nothing to synchronise without gradients).
    FSDP2 and tensor parallelism wrap the loss module in place, so both are the same object.
    """

    micro_batches = 1

    def __init__(
        self,
        module: torch.nn.Module,
        eval_module: torch.nn.Module,
        device: torch.device,
        autocast: AutocastFactory,
        scaler: torch.amp.GradScaler | None = None,
        offload: bool = False,
    ):
        self.module, self.eval_module, self.device = module, eval_module, device
        self.autocast, self.scaler, self.offload = autocast, scaler, offload

    def _loss(self, module: torch.nn.Module, b: Batch) -> torch.Tensor:
        with self.autocast():
            loss: torch.Tensor = module(
                b.input_ids.to(self.device), b.position_ids.to(self.device), b.targets.to(self.device), b.cu_seqlens
            )
        return loss

    def forward_backward(self, batches: list[Batch], scale: float) -> float:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, b in enumerate(batches):
            # DDP all-reduces on every backward unless told not to: only the last one syncs
            sync = i == len(batches) - 1 or not hasattr(self.module, "no_sync")
            no_sync = contextlib.nullcontext() if sync else getattr(self.module, "no_sync")()  # noqa: B009 (DDP only)
            with no_sync, activation_offload(self.offload, self.device):
                loss = self._loss(self.module, b)
                scaled = loss * scale
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach()
        return float(total.item())

    def sample_logps(self, module: torch.nn.Module, b: Batch) -> torch.Tensor:
        """Summed target log-probs of each sample of a pair batch [samples] (preference objectives)."""
        assert b.target_sample is not None and b.chosen is not None
        with self.autocast():
            logps: torch.Tensor = module(
                b.input_ids.to(self.device),
                b.position_ids.to(self.device),
                b.targets.to(self.device),
                b.cu_seqlens,
                b.target_sample.to(self.device),
                2 * len(b.chosen),
            )
        return logps

    def pairs_backward(
        self,
        batches: list[Batch],
        before: Callable[[Batch], Any],
        loss_of: Callable[[Batch, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Gradients of the preference loss of `batches`: for each micro-batch, `before(batch)`
        (the reference's log-probs, run before the policy's forward so that a sharded model's
        backward follows its own forward), then `loss_of(batch, its samples' log-probs, that)`:
        the micro-batch's scaled loss and its metric sums. Returns the sums' total."""
        total: torch.Tensor | None = None
        for i, b in enumerate(batches):
            sync = i == len(batches) - 1 or not hasattr(self.module, "no_sync")
            no_sync = contextlib.nullcontext() if sync else getattr(self.module, "no_sync")()  # noqa: B009 (DDP only)
            first = before(b)
            with no_sync, activation_offload(self.offload, self.device):
                loss, sums = loss_of(b, self.sample_logps(self.module, b), first)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total = sums if total is None else total + sums
        assert total is not None
        return total

    def backward_each(
        self, count: int, loss_of: Callable[[torch.nn.Module, int], tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Gradients of `count` micro-batches: `loss_of(module, i)` gives micro-batch i's scaled
        loss and its metric sums (GRPO's); DDP all-reduces on the last backward only. Returns the
        sums' total."""
        total: torch.Tensor | None = None
        for i in range(count):
            sync = i == count - 1 or not hasattr(self.module, "no_sync")
            no_sync = contextlib.nullcontext() if sync else getattr(self.module, "no_sync")()  # noqa: B009 (DDP only)
            with no_sync, activation_offload(self.offload, self.device):
                loss, sums = loss_of(self.module, i)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total = sums if total is None else total + sums
        assert total is not None
        return total

    @torch.no_grad()
    def loss_sum(self, batches: list[Batch]) -> float:
        return sum(float(self._loss(self.eval_module, b)) for b in batches)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @property
    def training(self) -> bool:
        return self.module.training
