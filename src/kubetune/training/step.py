"""One optimizer step and one evaluation pass, for any layout (the runner hides it).

Every number here is global: losses and token counts are summed over the data-parallel
replicas (one reporting rank per replica, see `Layout.reporter`), so every rank returns
the same result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from kubetune.data import Batcher
from kubetune.data.packing import Batch
from kubetune.recipe.layout import Layout
from kubetune.training.checkpoint import TrainState
from kubetune.training.dist import DistEnv, all_reduce_sum
from kubetune.training.optim import Optimization
from kubetune.training.parallel import MeshLayout
from kubetune.training.runner import StepRunner


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over the step's target tokens, all replicas
    grad_norm: float
    tokens: int  # real (non-padding) tokens of the step, all replicas
    # seconds of this rank by phase: compute (forward + backward, with DDP's overlapped bucket
    # all-reduces), optimizer (replica sync where no wrapper did it, clipping, the update) and
    # communication (the step's own reductions: target count, loss, tokens); `fit` adds data
    phases: dict[str, float] = field(default_factory=dict)
    # the objective's own metrics under TRL's names: preference (`rewards/chosen`, ...;
    # kubetune.training.preference) and GRPO (`reward`, `kl`, ...; kubetune.training.grpo)
    objective_metrics: dict[str, float] = field(default_factory=dict)


def replica_sum(value: float, env: DistEnv, layout: Layout) -> float:
    """Sum over data-parallel replicas of a number every rank of a replica knows (or, for the
    loss, only the last pipeline stage knows): one reporting rank per replica contributes."""
    return all_reduce_sum(value if layout.reporter else 0, env)


def next_micro_batches(batcher: Batcher, state: TrainState, n: int) -> list[Batch]:
    """Up to n micro-batches from the current position; a step never spans two epochs."""
    out: list[Batch] = []
    while len(out) < n:
        if batcher.micro_batches_left(state.epoch, state.row) == 0:
            if out:
                break
            state.epoch, state.row = state.epoch + 1, 0
            continue
        batch, state.row = batcher.micro_batch(state.epoch, state.row)
        out.append(batch)
    return out


def train_step(
    runner: StepRunner, optim: Optimization, batches: list[Batch], layout: MeshLayout, env: DistEnv
) -> StepResult:
    """One optimizer step over `batches` (this rank's share of the step)."""
    # Normalise by the target tokens of the whole step on all replicas, so that N replicas
    # with grad_accum k compute exactly the gradient of 1 process with grad_accum N*k.
    t0 = time.perf_counter()
    n_targets = replica_sum(sum(b.target_tokens for b in batches), env, layout)
    scale = layout.data_parallel_size / max(n_targets, 1.0)  # gradients are averaged over replicas; undo that
    t1 = time.perf_counter()
    loss_sum = runner.forward_backward(batches, scale)
    t2 = time.perf_counter()
    grad_norm = optim.step(layout)
    t3 = time.perf_counter()
    total_loss = replica_sum(loss_sum, env, layout)
    tokens = int(replica_sum(sum(b.real_tokens for b in batches), env, layout))
    phases = {"compute": t2 - t1, "optimizer": t3 - t2, "communication": (t1 - t0) + (time.perf_counter() - t3)}
    return StepResult(loss=total_loss / max(n_targets, 1.0), grad_norm=grad_norm, tokens=tokens, phases=phases)


@dataclass(frozen=True)
class EvalResult:
    loss: float | None  # None: nothing to score (not a perfect perplexity of 1.0)
    perplexity: float | None
    tokens: int
    # the objective's eval metrics under TRL's names: preference (`eval_rewards/accuracies`, ...;
    # the loss is the objective's, the perplexity and tokens those of the chosen answers) and
    # GRPO (`eval_reward`, ...; no loss or perplexity)
    objective_metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float | int | None]:
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens, **self.objective_metrics}


NOTHING_SCORED = EvalResult(loss=None, perplexity=None, tokens=0)


def evaluate(runner: StepRunner, batcher: Batcher | None, layout: Layout, env: DistEnv) -> EvalResult:
    """Token-averaged loss over the eval targets, and its perplexity (exp of it)."""
    if batcher is None:
        return NOTHING_SCORED
    was_training = runner.training
    runner.train(False)
    loss_sum, n, row = 0.0, 0, 0
    while batcher.micro_batches_left(0, row) > 0:
        batches: list[Batch] = []
        while batcher.micro_batches_left(0, row) > 0 and len(batches) < runner.micro_batches:
            b, row = batcher.micro_batch(0, row)
            batches.append(b)
        loss_sum += runner.loss_sum(batches)
        n += sum(b.target_tokens for b in batches)
    runner.train(was_training)
    loss_sum, total = replica_sum(loss_sum, env, layout), replica_sum(n, env, layout)
    if total == 0:
        return NOTHING_SCORED
    loss = loss_sum / total
    return EvalResult(loss=round(loss, 6), perplexity=round(math.exp(loss), 4), tokens=int(total))
