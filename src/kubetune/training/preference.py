"""Preference tuning (finetune.objective = dpo | orpo | simpo): the losses, the reference
log-probabilities, one optimizer step and one evaluation over pairs.

The losses are TRL's (v1.16; the formulas are written out at each function), and so are the
metric names, so that a TRL user reads the same curves: `loss`, `rewards/chosen`,
`rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`,
`logps/rejected`, with `eval_` in front for held-out pairs.

Every sequence's log-probability is the sum of its target log-probabilities, computed in
the same forward pass and the same chunked LM head as SFT's loss (kubetune.models.lm_loss).
DPO's reference is the starting model:
- LoRA (`reference: adapter_off`): the same model with the PEFT adapter switched off, under
  no_grad, so no second copy of the weights exists;
- full fine-tuning (`reference: copy`): a frozen copy of the starting weights.
With `reference_logps: precompute` the reference runs once over the training and held-out
pairs before step 1 (before a checkpoint is loaded, so that the model itself is the reference
of full fine-tuning and no copy is made), and its log-probabilities are kept per pair in the
run directory, where a resumed run reads them back. ORPO and SimPO need no reference.

Like the SFT loss, a step's loss is normalised over the whole step on every replica (its
pairs, and for ORPO's NLL term its chosen tokens), so N replicas compute the gradient of
one process with N times the micro-batches.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kubetune.data import Batcher
from kubetune.data.packing import Batch
from kubetune.errors import UserError
from kubetune.fsutil import atomic_write_bytes
from kubetune.recipe import Recipe
from kubetune.recipe.layout import Layout
from kubetune.training import memory
from kubetune.training.dist import DistEnv, all_reduce_sums
from kubetune.training.optim import Optimization
from kubetune.training.parallel import MeshLayout
from kubetune.training.runner import LocalRunner, StepRunner
from kubetune.training.step import EvalResult, StepResult

log = logging.getLogger("kubetune")

# TRL's names, in the order the stats vector below holds their sums over pairs
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# what a micro-batch sums (Objective.micro_batch_loss), in order: summed over micro-batches and replicas
SUMS = ("loss", *PAIR_METRICS, "pairs", "chosen_nll", "chosen_tokens")
REFERENCE_FILE = "reference_logps.pt"


# ----------------------------------------------------------------------------- the losses


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss per pair, and the rewards beta x (log pi - log pi_ref).

    TRL's DPOTrainer (loss_type="sigmoid"): -logsigmoid(beta x delta), delta = (chosen -
    ref_chosen) - (rejected - ref_rejected); with label smoothing eps, conservative DPO (cDPO,
    the sigmoid loss of TRL before 1.0): -(1 - eps) logsigmoid(beta delta) - eps
    logsigmoid(-beta delta), equal to the plain loss at eps = 0."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    z = beta * (chosen_ratio - rejected_ratio)
    losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2 (TRL's)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term per pair (to add to the NLL of the chosen answers), from the
    per-token mean log-probabilities, and the rewards beta x mean log-prob.

    TRL's ORPOTrainer.odds_ratio_loss: log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r)),
    term = -beta x logsigmoid(log_odds) (TRL's loss is nll - mean(beta x logsigmoid))."""
    c, r = chosen_mean.float(), rejected_mean.float()
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    return -beta * F.logsigmoid(log_odds), beta * c.detach(), beta * r.detach()


def simpo_loss(
    chosen_mean: torch.Tensor,
    rejected_mean: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO's loss per pair from the per-token mean log-probabilities, and the rewards
    beta x mean log-prob.

    TRL's CPOTrainer (loss_type="simpo", cpo_alpha=0): z = beta x ((c - r) - gamma / beta),
    loss = -(1 - eps) logsigmoid(z) - eps logsigmoid(-z)."""
    z = beta * ((chosen_mean - rejected_mean) - gamma / beta)
    losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, beta * chosen_mean.detach(), beta * rejected_mean.detach()


# ----------------------------------------------------------------------------- one micro-batch


@dataclass(frozen=True)
class PairIndex:
    """A pair batch's pair fields (kubetune.data.packing.Batch), there by construction."""

    target_sample: torch.Tensor  # [B, T]: each target's sample, -1 elsewhere
    chosen: torch.Tensor  # [P]: each pair's chosen sample
    rejected: torch.Tensor  # [P]
    pair_ids: torch.Tensor  # [P]: each pair's index in its data

    @classmethod
    def of(cls, b: Batch) -> PairIndex:
        if b.target_sample is None or b.chosen is None or b.rejected is None or b.pair_ids is None:
            raise TypeError("a preference objective needs pair batches (TokenizedData.pairs)")
        return cls(b.target_sample, b.chosen, b.rejected, b.pair_ids)


@dataclass(frozen=True)
class Pairs:
    """A micro-batch's pairs: each one's target tokens, chosen then rejected."""

    chosen_tokens: torch.Tensor  # [P] float
    rejected_tokens: torch.Tensor

    @classmethod
    def of(cls, b: Batch) -> Pairs:
        ix = PairIndex.of(b)
        counts = torch.bincount(ix.target_sample[ix.target_sample >= 0], minlength=2 * len(ix.chosen)).double()
        return cls(chosen_tokens=counts[ix.chosen], rejected_tokens=counts[ix.rejected])

    def __len__(self) -> int:
        return len(self.chosen_tokens)


@dataclass(frozen=True)
class Objective:
    """One run's preference objective and its settings."""

    name: str  # dpo | orpo | simpo
    beta: float
    label_smoothing: float
    simpo_gamma: float

    @classmethod
    def of(cls, recipe: Recipe) -> Objective:
        ft = recipe.finetune
        pref = ft.preference
        return cls(ft.objective, ft.beta, pref.label_smoothing, pref.simpo_gamma)

    @property
    def needs_reference(self) -> bool:
        return self.name == "dpo"

    def pair_losses(
        self, logps: torch.Tensor, b: Batch, pairs: Pairs, reference: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-pair loss, chosen rewards, rejected rewards, the chosen and rejected log-probs
        TRL reports) of the samples' summed log-probs `logps`."""
        chosen, rejected = split_pairs(logps, b)
        if self.name == "dpo":
            assert reference is not None
            losses, rc, rr = dpo_loss(chosen, rejected, *reference, self.beta, self.label_smoothing)
            return losses, rc, rr, chosen, rejected
        c_mean = chosen / pairs.chosen_tokens.to(chosen).clamp(min=1)
        r_mean = rejected / pairs.rejected_tokens.to(rejected).clamp(min=1)
        if self.name == "orpo":
            losses, rc, rr = orpo_loss(c_mean, r_mean, self.beta)
        else:
            losses, rc, rr = simpo_loss(c_mean, r_mean, self.beta, self.simpo_gamma, self.label_smoothing)
        return losses, rc, rr, c_mean, r_mean

    def micro_batch_loss(
        self,
        logps: torch.Tensor,
        b: Batch,
        reference: tuple[torch.Tensor, torch.Tensor] | None,
        per_pair: float,
        per_chosen_token: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's share of the step's loss (its pairs' losses x `per_pair`, and
        ORPO's chosen NLL x `per_chosen_token`), and its sums, in the order of SUMS (the
        chosen answers' NLL and tokens give eval its perplexity)."""
        pairs = Pairs.of(b)
        losses, rc, rr, logp_c, logp_r = self.pair_losses(logps, b, pairs, reference)
        nll = -split_pairs(logps, b)[0].sum()
        loss = losses.sum() * per_pair
        if self.name == "orpo":
            loss = loss + nll * per_chosen_token
        acc = (rc > rr).float()
        sums = torch.stack(
            [
                loss.detach().double(),
                *(x.detach().double().sum() for x in (rc, rr, acc, rc - rr, logp_c, logp_r)),
                torch.tensor(float(len(pairs)), dtype=torch.float64, device=logps.device),
                nll.detach().double(),
                pairs.chosen_tokens.sum().to(device=logps.device),
            ]
        )
        return loss, sums


# ----------------------------------------------------------------------------- references


class Reference(Protocol):
    def logps(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's summed log-probs of the micro-batch's chosen and rejected answers."""
        ...


def split_pairs(logps: torch.Tensor, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    ix = PairIndex.of(b)
    return logps[ix.chosen.to(logps.device)], logps[ix.rejected.to(logps.device)]


class AdapterOff:
    """The LoRA model with its adapter switched off: the frozen base, no second copy."""

    def __init__(self, runner: LocalRunner, peft_model: Any):
        self.runner, self.peft_model = runner, peft_model

    @torch.no_grad()
    def logps(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with self.peft_model.disable_adapter():
            return split_pairs(self.runner.sample_logps(self.runner.eval_module, b), b)


class FrozenCopy:
    """A frozen copy of the starting weights (reference: copy)."""

    def __init__(self, runner: LocalRunner, module: torch.nn.Module):
        self.runner, self.module = runner, module

    @torch.no_grad()
    def logps(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return split_pairs(self.runner.sample_logps(self.module, b), b)


class Precomputed:
    """The reference's log-probs of every training pair, computed once (`reference_logps:
    precompute`): a table [pairs, 2] indexed by the batch's pair ids."""

    def __init__(self, table: torch.Tensor, device: torch.device):
        self.table = table.to(device)

    def logps(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.table[PairIndex.of(b).pair_ids.to(self.table.device)]
        return rows[:, 0], rows[:, 1]


def frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    """The loss module with a copy of the starting weights, frozen (before any wrapping)."""
    dup = copy.deepcopy(module)
    for p in dup.parameters():
        p.requires_grad_(False)
    return dup.eval()


def reference_kind(recipe: Recipe) -> str:
    """`reference: auto` is the adapter switched off for LoRA, a frozen copy for full."""
    chosen = recipe.finetune.preference.reference
    if chosen != "auto":
        return chosen
    return "adapter_off" if recipe.finetune.method == "lora" else "copy"


def precomputes(recipe: Recipe, total_steps: int, steps_per_epoch: int) -> bool:
    """`reference_logps: auto`: precompute when the run trains an epoch or more. A reference
    log-prob costs one no_grad forward of its pair either way: on the fly, every pair pays it
    again each epoch; precomputed, once before step 1, also for the pairs a short run (a few
    steps of a large set) would never see. Precomputed, `reference: copy` holds no copy."""
    mode = recipe.finetune.preference.reference_logps
    if mode != "auto":
        return mode == "precompute"
    return total_steps >= steps_per_epoch


def check_copy_fits(module: torch.nn.Module, env: DistEnv) -> None:
    """On CPU, refuse a frozen copy of the weights that would not fit in KUBETUNE_MEMORY_BUDGET
    (a cluster job's), else in the pod's or the machine's memory. (An accelerator's copy is in
    its own memory, which the allocator there reports on its own.)"""
    if env.device.type != "cpu":
        return
    budget = memory.budget_bytes()
    limit, what = (budget, f"{memory.ENV}=") if budget is not None else (memory.limit_bytes(), "the memory limit ")
    cost = sum(p.numel() * p.element_size() for p in module.parameters())
    used = memory.used_bytes(env.local_world_size)
    if used + cost * env.local_world_size > limit:
        gib = 1024**3
        raise UserError(
            f"finetune.preference.reference=copy: a frozen copy of the weights costs {cost / gib:.2f} GiB per "
            f"process, over {what}{limit / gib:.2f} GiB with {used / gib:.2f} GiB in use; set "
            f"finetune.preference.reference_logps=precompute (computed once before training, no copy held) or "
            f"finetune.method=lora (reference=adapter_off)"
        )


def reference_table(
    runner: LocalRunner, reference: Reference, batcher: Batcher, layout: Layout, env: DistEnv
) -> torch.Tensor:
    """The reference's [chosen, rejected] log-probs of every pair of `batcher` (an every-row
    batcher: this rank's share of them, summed over ranks): a table [pairs, 2] on CPU."""
    n_pairs = len(batcher.data)
    table = torch.zeros(n_pairs, 2, dtype=torch.float64)
    was_training = runner.training
    runner.train(False)
    row = 0
    while batcher.micro_batches_left(0, row) > 0:
        b, row = batcher.micro_batch(0, row)  # an empty one too: a sharded model's ranks forward together
        c, r = reference.logps(b)
        table[PairIndex.of(b).pair_ids, 0] = c.double().cpu()
        table[PairIndex.of(b).pair_ids, 1] = r.double().cpu()
    runner.train(was_training)
    return torch.tensor(replica_sums(table.flatten(), env, layout), dtype=torch.float32).view(n_pairs, 2)


def load_or_precompute(
    path: Path, compute: Callable[[], dict[str, torch.Tensor]], sizes: dict[str, int], env: DistEnv
) -> dict[str, torch.Tensor]:
    """The run directory's tables when they hold `sizes` pairs (a resumed run does not recompute
    them; eval.* may change on a resume, and the held-out pairs with it), else computed now and
    written by rank 0. Either is right: this runs before a checkpoint is loaded, so the model
    still holds the starting weights."""
    if path.is_file():
        tables: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
        if {k: len(v) for k, v in tables.items()} == sizes:
            log.info("reference log-probs read from %s", path)
            return tables
    t0 = time.perf_counter()
    tables = compute()
    if env.is_main:
        buf = io.BytesIO()
        torch.save(tables, buf)
        atomic_write_bytes(path, buf.getvalue())
    log.info("reference log-probs of %d pairs computed in %.1f s", sum(sizes.values()), time.perf_counter() - t0)
    return tables


# ----------------------------------------------------------------------------- step and eval


def replica_sums(values: torch.Tensor, env: DistEnv, layout: Layout) -> list[float]:
    """Sums over data-parallel replicas (one reporting rank per replica, as `replica_sum`)."""
    mine = values.tolist() if layout.reporter else [0.0] * len(values)
    return all_reduce_sums(mine, env)


def named_totals(sums: torch.Tensor, env: DistEnv, layout: Layout) -> dict[str, float]:
    """The micro-batches' SUMS (and any after them, e.g. tokens) over all replicas, by name."""
    return dict(zip((*SUMS, "tokens"), replica_sums(sums, env, layout), strict=False))


def step_norms(batches: list[Batch], env: DistEnv, layout: Layout) -> tuple[float, float]:
    """The step's pairs and chosen target tokens over all replicas."""
    mine = torch.zeros(2, dtype=torch.float64)
    for b in batches:
        pairs = Pairs.of(b)
        mine += torch.tensor([float(len(pairs)), float(pairs.chosen_tokens.sum())], dtype=torch.float64)
    n_pairs, chosen_tokens = replica_sums(mine, env, layout)
    return n_pairs, chosen_tokens


@dataclass
class PreferenceTraining:
    """What a preference run's steps and evaluations use: the objective, the runner, and the
    reference of the training and of the held-out pairs (None for ORPO and SimPO; tables
    once precomputed)."""

    objective: Objective
    runner: LocalRunner
    reference: Reference | None
    eval_reference: Reference | None

    def precompute(self, path: Path, train: Batcher, held_out: Batcher | None, layout: Layout, env: DistEnv) -> None:
        """Replace the reference by its log-probs of every training and held-out pair."""
        reference = self.reference
        assert reference is not None
        device = self.runner.device

        def compute() -> dict[str, torch.Tensor]:
            tables = {"train": reference_table(self.runner, reference, train, layout, env)}
            if held_out is not None:
                tables["eval"] = reference_table(self.runner, reference, held_out, layout, env)
            return tables

        sizes = {"train": len(train.data), **({"eval": len(held_out.data)} if held_out is not None else {})}
        tables = load_or_precompute(path, compute, sizes, env)
        self.reference = Precomputed(tables["train"], device)
        self.eval_reference = Precomputed(tables["eval"], device) if "eval" in tables else None

    def train_step(self, optim: Optimization, batches: list[Batch], layout: MeshLayout, env: DistEnv) -> StepResult:
        """One optimizer step over `batches`: the mean loss over the step's pairs on every replica."""
        t0 = time.perf_counter()
        n_pairs, chosen_tokens = step_norms(batches, env, layout)
        # gradients are averaged over replicas: scale by their count to undo it (as train_step does)
        per_pair = layout.data_parallel_size / max(n_pairs, 1.0)
        per_token = layout.data_parallel_size / max(chosen_tokens, 1.0)
        t1 = time.perf_counter()

        def reference_of(b: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
            return self.reference.logps(b) if self.reference is not None else None

        def loss_of(b: Batch, logps: torch.Tensor, reference: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return self.objective.micro_batch_loss(logps, b, reference, per_pair, per_token)

        sums = self.runner.pairs_backward(batches, reference_of, loss_of)
        t2 = time.perf_counter()
        grad_norm = optim.step(layout)
        t3 = time.perf_counter()
        real_tokens = torch.tensor([float(sum(b.real_tokens for b in batches))], dtype=torch.float64)
        totals = named_totals(torch.cat([sums.cpu(), real_tokens]), env, layout)
        phases = {"compute": t2 - t1, "optimizer": t3 - t2, "communication": (t1 - t0) + (time.perf_counter() - t3)}
        loss = totals["loss"] / layout.data_parallel_size  # each replica's share was scaled by their count
        return StepResult(
            loss=loss,
            grad_norm=grad_norm,
            tokens=int(totals["tokens"]),
            phases=phases,
            objective_metrics=pair_means(totals, loss),
        )

    def evaluate(self, batcher: Batcher | None, layout: Layout, env: DistEnv) -> EvalResult:
        """The objective's loss and TRL's metrics over the held-out pairs, and the perplexity
        of their chosen (reference) answers."""
        if batcher is None:
            return EvalResult(loss=None, perplexity=None, tokens=0)
        runner = self.runner
        was_training = runner.training
        runner.train(False)
        sums = torch.zeros(len(SUMS), dtype=torch.float64)
        row = 0
        with torch.no_grad():
            while batcher.micro_batches_left(0, row) > 0:
                b, row = batcher.micro_batch(0, row)  # an empty one too: a sharded model's ranks forward together
                logps = runner.sample_logps(runner.eval_module, b)
                reference = self.eval_reference.logps(b) if self.eval_reference is not None else None
                # per-pair and per-token weights of 1: sums, divided below
                _, s = self.objective.micro_batch_loss(logps, b, reference, 1.0, 1.0)
                sums += s.cpu()
        runner.train(was_training)
        totals = named_totals(sums, env, layout)
        n_pairs, nll, chosen_tokens = totals["pairs"], totals["chosen_nll"], max(totals["chosen_tokens"], 1.0)
        if n_pairs == 0:
            return EvalResult(loss=None, perplexity=None, tokens=0)
        loss = totals["loss"] / n_pairs
        if self.objective.name == "orpo":  # the pairs' mean odds term, plus the chosen answers' NLL per token
            loss = (totals["loss"] - nll) / n_pairs + nll / chosen_tokens
        return EvalResult(
            loss=round(loss, 6),
            perplexity=round(math.exp(nll / chosen_tokens), 4),
            tokens=int(totals["chosen_tokens"]),
            objective_metrics={f"eval_{k}": round(v, 6) for k, v in pair_means(totals, loss).items() if k != "loss"},
        )


def pair_means(totals: dict[str, float], loss: float) -> dict[str, float]:
    """TRL's metrics of a step (or an evaluation): `loss` and the means over its pairs."""
    n = max(totals["pairs"], 1.0)
    return {"loss": loss, **{name: totals[name] / n for name in PAIR_METRICS}}


def build(recipe: Recipe, runner: StepRunner, peft_model: Any, start: torch.nn.Module | None) -> PreferenceTraining:
    """The objective and its reference for a run: `start` is the frozen copy of the starting
    weights (reference: copy), `peft_model` the model whose adapter is switched off."""
    if not isinstance(runner, LocalRunner):  # the recipe check refuses pipelines before this
        raise TypeError("preference objectives run on a LocalRunner")
    objective = Objective.of(recipe)
    reference: Reference | None = None
    if objective.needs_reference:
        if reference_kind(recipe) == "adapter_off":
            reference = AdapterOff(runner, peft_model)
        else:  # the copy, or (precomputed before step 1) the model itself, which holds the starting weights then
            reference = FrozenCopy(runner, start if start is not None else runner.eval_module)
    return PreferenceTraining(objective, runner, reference, reference)
