"""GRPO (finetune.objective = grpo): online RL with verifiable rewards, TRL's GRPOTrainer on
kubetune's engine.

A generation: each process takes its share of the prompts (whole groups: a prompt's
`num_generations` completions are sampled on one process), samples them with the engine
in this process over the live weights (kubetune.training.rollout), scores them with the
reward functions (kubetune.training.rewards) and turns the rewards into advantages within
each group. The completions are then packed into micro-batches of `train.micro_batch_size`
completions (per-sample attention, as SFT's packed rows; a group's prompt is read once for all
of its completions, `pack_completions`), and the generation feeds
`steps_per_generation / grad_accum` optimizer steps, `num_iterations` times.
Old-policy log-probabilities are computed only when a generation outlives one step (μ > 1 or
steps_per_generation > grad_accum), the reference's only when beta > 0 (the adapter switched
off under LoRA; a frozen copy under full fine-tuning).

The metrics are TRL's, by name (`reward`, `reward_std`, `rewards/<func>/mean`,
`completions/mean_length`, `kl`, `entropy`, `clip_ratio/*`, ...); evaluation samples one
greedy completion per held-out prompt and reports `eval_reward`, `eval_rewards/<func>/mean`
and `eval_accuracy` (the `accuracy` reward's mean).
"""

from __future__ import annotations

import collections
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kubetune.data import Batcher, PreparedData
from kubetune.data.packing import IGNORE, Batch, pack_rows
from kubetune.data.prompts import PromptSet
from kubetune.models.decoding import AutocastFactory
from kubetune.models.finetune import ModelParts
from kubetune.recipe import Recipe
from kubetune.recipe.layout import grad_accum_for
from kubetune.training.checkpoint import TrainState
from kubetune.training.dist import DistEnv, all_reduce_sums, gather_objects
from kubetune.training.grpo_loss import Reduction, group_advantages, token_loss
from kubetune.training.optim import Optimization
from kubetune.training.parallel import MeshLayout
from kubetune.training.rewards import Reward, build_rewards, score
from kubetune.training.rollout import Completion, LocalRollouts, Rollouts, RolloutSettings
from kubetune.training.runner import LocalRunner
from kubetune.training.step import EvalResult, StepResult

COMPLETIONS_FILE = "completions.jsonl"
ACCURACY_REWARD = "accuracy"  # the reward whose mean is `eval_accuracy`
# what a micro-batch sums for the step's metrics, in order (masked token sums and counts)
TOKEN_SUMS = ("loss", "entropy", "tokens", "kl", "clip_low", "clip_high")


@dataclass
class MicroBatch:
    """Packed completions of one micro-batch, and what their token losses need."""

    batch: Batch  # target_sample: each completion token's index in the flat token order
    seq: torch.Tensor  # [tokens] each token's completion (0..n-1)
    advantages: torch.Tensor  # [n]
    mask: torch.Tensor  # [tokens] 1.0, or 0.0 for a truncated completion's tokens (mask_truncated_completions)
    old_logps: torch.Tensor | None = None  # [tokens], when a generation outlives one step
    ref_logps: torch.Tensor | None = None  # [tokens], when beta > 0

    @property
    def n_seqs(self) -> int:
        return len(self.advantages)

    @property
    def n_tokens(self) -> int:
        return len(self.seq)


def pack_completions(
    completions: list[Completion], max_seq_len: int, pad_id: int, share_prompts: bool = True
) -> tuple[Batch, torch.Tensor]:
    """Prompt + completion of each, packed into rows of <= max_seq_len tokens; targets on the
    completion tokens only. The target tokens are numbered in completion order (completion 0's
    tokens first), wherever packing put them; returns the batch and each target token's completion.

    With `share_prompts`, the completions of one prompt that sit next to each other (a group)
    read the prompt once: its tokens but the last are one attention segment, and each
    completion is a segment of the prompt's last token and its own tokens that attends to that
    prefix as well as to itself (`Batch.prefixes`). Every completion token sees exactly what it
    saw after its own copy of the prompt, so the log-probabilities and their gradients are the
    same, and a group of G short answers to a long prompt costs one prompt, not G."""
    counts = [len(c.tokens) for c in completions]
    first = np.concatenate([[0], np.cumsum(counts)])
    units = _prompt_units(completions, max_seq_len, share_prompts)
    lengths = np.asarray([_unit_length(completions, prefix, members) for prefix, members in units])
    rows = pack_rows(lengths, np.arange(len(units)), max_seq_len)
    t = max(sum(int(lengths[u]) for u in row) for row in rows)
    out = _Rows(len(rows), t, pad_id)
    for r, row in enumerate(rows):
        cur = 0
        for u in row:
            prefix, members = units[u]
            shared = -1
            if prefix:
                shared = len(out.segments)
                cur = out.segment(r, cur, prefix, 0, -1)
            for i in members:
                c = completions[i]
                head = c.prompt[len(prefix) :]  # the whole prompt, or only its last token after a shared prefix
                # the target at position j is token j + 1: the completion's tokens are the targets
                # of the head's last token and of every completion token but the last
                at = cur + len(head) - 1
                out.targets[r, at : at + counts[i]] = c.tokens
                out.owner[r, at : at + counts[i]] = np.arange(first[i], first[i] + counts[i])
                cur = out.segment(r, cur, [*head, *c.tokens], len(prefix), shared)
        out.segment(r, cur, [pad_id] * (t - cur), 0, -1)
    batch = Batch(
        input_ids=torch.from_numpy(out.ids),
        position_ids=torch.from_numpy(out.pos),
        targets=torch.from_numpy(out.targets),
        cu_seqlens=np.concatenate([[0], np.cumsum(out.segments)]).tolist(),
        real_tokens=int(lengths.sum()),
        target_tokens=int(first[-1]),
        target_sample=torch.from_numpy(out.owner),
        prefixes=out.prefixes if share_prompts else None,
    )
    return batch, torch.repeat_interleave(torch.arange(len(completions)), torch.tensor(counts))


class _Rows:
    """The arrays of a packed batch being filled, and its attention segments in flat order."""

    def __init__(self, rows: int, t: int, pad_id: int) -> None:
        self.ids = np.full((rows, t), pad_id, dtype=np.int64)
        self.pos = np.zeros((rows, t), dtype=np.int64)
        self.targets = np.full((rows, t), IGNORE, dtype=np.int64)
        self.owner = np.full((rows, t), -1, dtype=np.int64)  # each target's token index, -1 elsewhere
        self.segments: list[int] = []  # each attention segment's length
        self.prefixes: list[int] = []  # the segment each one continues (-1: none)

    def segment(self, r: int, cur: int, tokens: list[int], start: int, prefix: int) -> int:
        """`tokens` at row r from column `cur`, positions from `start`, as one segment; returns
        the next free column. An empty segment is no segment (seqlens_from_cu drops it)."""
        if not tokens:
            return cur
        self.ids[r, cur : cur + len(tokens)] = tokens
        self.pos[r, cur : cur + len(tokens)] = np.arange(start, start + len(tokens))
        self.segments.append(len(tokens))
        self.prefixes.append(prefix)
        return cur + len(tokens)


def _prompt_units(
    completions: list[Completion], max_seq_len: int, share_prompts: bool
) -> list[tuple[list[int], list[int]]]:
    """(shared prefix, the completions that read it) for each packing unit, in completion order.
    Without sharing each completion is its own unit with no prefix. A group too long for one
    row is split, each part with its own copy of the prefix (a unit never straddles rows)."""
    if not share_prompts:
        return [([], [i]) for i in range(len(completions))]
    units: list[tuple[list[int], list[int]]] = []
    for i, c in enumerate(completions):
        prefix = c.prompt[:-1]
        if units and units[-1][1] and _same_prompt(completions[units[-1][1][0]], c):
            grown = units[-1][1] + [i]
            if _unit_length(completions, prefix, grown) <= max_seq_len:
                units[-1] = (prefix, grown)
                continue
        units.append((prefix, [i]))
    return units


def _same_prompt(a: Completion, b: Completion) -> bool:
    return a.prompt_index == b.prompt_index and a.prompt == b.prompt


def _unit_length(completions: list[Completion], prefix: list[int], members: list[int]) -> int:
    """Tokens of a unit: its prefix once, and each member's prompt tail and completion."""
    return len(prefix) + sum(len(completions[i].prompt) - len(prefix) + len(completions[i].tokens) for i in members)


@dataclass(frozen=True)
class Scored:
    """A generation's completions with their rewards ([n, functions], NaN = not scored) and advantages."""

    completions: list[Completion]
    texts: list[str]
    per_function: torch.Tensor
    rewards: torch.Tensor  # [n] weighted sum over the functions that scored it; NaN when none did
    advantages: torch.Tensor
    std_zero: torch.Tensor


class GRPOTraining:
    """A GRPO run's generations, optimizer steps and evaluations."""

    def __init__(
        self,
        recipe: Recipe,
        runner: LocalRunner,
        model: ModelParts,
        tokenizer: Any,
        data: PreparedData,
        prompts: Batcher,
        layout: MeshLayout,
        env: DistEnv,
        autocast: AutocastFactory,
        run_dir: Path,
        reference: torch.nn.Module | None,
    ) -> None:
        assert data.prompts is not None
        self.recipe, self.rl, self.runner, self.model = recipe, recipe.finetune.rl, runner, model
        self.tokenizer, self.data, self.prompts, self.layout, self.env = tokenizer, data, prompts, layout, env
        self.autocast, self.completions_file, self.reference = autocast, run_dir / COMPLETIONS_FILE, reference
        self.rewards: list[Reward] = build_rewards(_reward_spec(recipe), self.rl.reward_weights)
        self.accum = grad_accum_for(recipe.train, layout.data_parallel_size)
        self.generation_steps = self.rl.generation_steps(self.accum)
        rows = recipe.train.micro_batch_size * self.generation_steps  # completions per generation, this process
        self.rollouts = rollouts_for(recipe, model, tokenizer, autocast, rows, run_dir, env)
        self.buffer: collections.deque[list[MicroBatch]] = collections.deque()  # the generation's steps to come
        self.generation_metrics: dict[str, float] = {}
        self.rollout_s = 0.0
        self.reduction = self._reduction(1.0)  # the current generation's; set by each _generate

    # --- steps --------------------------------------------------------------------------------
    @property
    def between_generations(self) -> bool:
        """No generation is half used: a checkpoint here resumes exactly."""
        return not self.buffer

    def train_step(self, optim: Optimization, state: TrainState) -> StepResult:
        t0 = time.perf_counter()
        fresh = not self.buffer
        if fresh:
            self._generate(state)
        micro = self.buffer.popleft()
        t1 = time.perf_counter()
        sums = self.runner.backward_each(len(micro), lambda module, i: self._micro_loss(module, micro[i]))
        t2 = time.perf_counter()
        grad_norm = optim.step(self.layout)
        self.rollouts.policy_at(state.step + 1)
        t3 = time.perf_counter()
        real = float(sum(m.batch.real_tokens for m in micro))
        totals = dict(zip((*TOKEN_SUMS, "real"), all_reduce_sums([*sums.tolist(), real], self.env)))
        metrics = self._step_metrics(totals)
        if fresh:
            metrics.update(self.generation_metrics)
        phases = {"rollout": t1 - t0 if fresh else 0.0, "compute": t2 - t1, "optimizer": t3 - t2}
        phases["communication"] = time.perf_counter() - t3
        loss = totals["loss"] / self.layout.data_parallel_size
        return StepResult(loss, grad_norm, int(totals["real"]), phases, {"loss": loss, **metrics})

    def _step_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        tokens = max(totals["tokens"], 1.0)
        out = {"entropy": totals["entropy"] / tokens}
        if self.rl.beta:
            out["kl"] = totals["kl"] / tokens
        low, high = totals["clip_low"] / tokens, totals["clip_high"] / tokens
        out.update({"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low + high})
        return out

    def _micro_loss(self, module: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        entropy = torch.zeros(mb.n_tokens)
        logps = self._logps(module, mb.batch, entropy)
        old = mb.old_logps if mb.old_logps is not None else logps.detach()
        terms = token_loss(
            logps, old, mb.advantages[mb.seq], self.rl.epsilon, self.rl.upper_epsilon, self.rl.beta, mb.ref_logps
        )
        loss = self.reduction(terms.loss, mb.mask, mb.seq, mb.n_seqs)
        mask = mb.mask
        kl = (terms.kl.detach() * mask).sum() if terms.kl is not None else torch.zeros(())
        sums = torch.stack(
            [
                loss.detach().double(),
                (entropy * mask).sum().double(),
                mask.sum().double(),
                kl.double(),
                (terms.low_clipped * mask).sum().double(),
                (terms.high_clipped * mask).sum().double(),
            ]
        )
        return loss, sums

    def _reduction(self, tokens_per_process: float) -> Reduction:
        return Reduction(
            self.rl.loss_type, self.accum, self.rl.max_completion_length, tokens_per_process, self.generation_steps
        )

    def _logps(self, module: torch.nn.Module, b: Batch, entropy: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token log-probabilities of the completion tokens (logits / temperature, as TRL)."""
        device = self.runner.device
        assert b.target_sample is not None
        with self.autocast():
            logps: torch.Tensor = module(
                b.input_ids.to(device),
                b.position_ids.to(device),
                b.targets.to(device),
                b.cu_seqlens,
                b.target_sample.to(device),
                b.target_tokens,
                temperature=self.rl.temperature,
                entropy=entropy,
                prefixes=b.prefixes,
            )
        return logps

    # --- a generation ---------------------------------------------------------------------------
    def _generate(self, state: TrainState) -> None:
        t0 = time.perf_counter()
        indices = take_prompts(self.prompts, state)
        prompt_set = self.data.prompts
        assert prompt_set is not None
        settings = RolloutSettings(
            self.rl.max_completion_length, self.rl.temperature, self.rl.top_p, self.rl.top_k, self.recipe.train.seed
        )
        pairs = [(i, prompt_ids(prompt_set, i)) for i in indices]
        self.rollouts.policy_at(state.step)
        completions = self.rollouts.sample(pairs, self.rl.num_generations, settings, generation=state.step)
        self.rollout_s = time.perf_counter() - t0
        scored = self._score(completions, prompt_set, self.rl.num_generations, self.rl.scale_rewards)
        micro = self._micro_batches(scored)
        self.reduction = self._reduction(self._generation_tokens(micro))
        self._old_and_reference(micro)
        self.generation_metrics = self._generation_metrics(scored, self.rollout_s)
        self._log_completions(scored, state.step + 1)
        steps = [micro[i : i + self.accum] for i in range(0, len(micro), self.accum)]
        for _ in range(self.rl.num_iterations):
            self.buffer.extend(steps)

    def _score(self, completions: list[Completion], prompt_set: PromptSet, group: int, scale: str) -> Scored:
        texts = self.tokenizer.batch_decode([c.tokens for c in completions], skip_special_tokens=True)
        rows = [c.prompt_index for c in completions]
        columns = {k: [prompt_set.columns[r].get(k) for r in rows] for k in prompt_set.columns[0]}
        prompts = [prompt_set.texts[r] for r in rows]
        scores = score(self.rewards, prompts, texts, columns, rows, [c.tokens for c in completions])
        per_function = torch.tensor(scores.per_function, dtype=torch.float64).reshape(len(completions), -1)
        rewards = torch.tensor(scores.total, dtype=torch.float64)
        batch_std = self._batch_std(rewards) if scale == "batch" else None
        advantages, std_zero = group_advantages(rewards, group, scale, batch_std)
        return Scored(completions, texts, per_function, rewards, advantages.float(), std_zero)

    def _batch_std(self, rewards: torch.Tensor) -> torch.Tensor:
        """The std of every process's rewards (scale_rewards=batch), from their sums."""
        ok = rewards[~torch.isnan(rewards)]
        n, s, sq = all_reduce_sums([float(len(ok)), float(ok.sum()), float((ok**2).sum())], self.env)
        if n < 2:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return torch.tensor(math.sqrt(max(sq - s * s / n, 0.0) / (n - 1)), dtype=torch.float64)

    def _micro_batches(self, scored: Scored) -> list[MicroBatch]:
        size, rl = self.recipe.train.micro_batch_size, self.rl
        out: list[MicroBatch] = []
        for start in range(0, len(scored.completions), size):
            chunk = scored.completions[start : start + size]
            batch, seq = pack_completions(chunk, self.recipe.data.max_seq_len, self.tokenizer.pad_token_id)
            truncated = torch.tensor([c.truncated for c in chunk])
            mask = (~truncated[seq]).float() if rl.mask_truncated_completions else torch.ones(len(seq))
            out.append(MicroBatch(batch, seq, scored.advantages[start : start + size], mask))
        return out

    def _generation_tokens(self, micro: list[MicroBatch]) -> float:
        """dapo's normaliser: the generation's unmasked completion tokens on all processes, per process."""
        local = float(sum(m.mask.sum() for m in micro))
        return all_reduce_sums([local], self.env)[0] / self.env.world_size

    @torch.no_grad()
    def _old_and_reference(self, micro: list[MicroBatch]) -> None:
        """The old policy's log-probs (a generation used over several steps) and the reference's (beta > 0)."""
        needs_old = self.rl.num_iterations > 1 or self.generation_steps > self.accum
        for mb in micro:
            if needs_old:
                mb.old_logps = self._logps(self.runner.eval_module, mb.batch)
            if self.rl.beta:
                mb.ref_logps = self._reference_logps(mb.batch)

    def _reference_logps(self, b: Batch) -> torch.Tensor:
        if self.reference is not None:  # full fine-tuning: a frozen copy of the starting weights
            return self._logps(self.reference, b)
        peft_model: Any = self.model.model
        with peft_model.disable_adapter():  # LoRA: the same base with the adapter off
            return self._logps(self.runner.eval_module, b)

    def _generation_metrics(self, scored: Scored, rollout_s: float) -> dict[str, float]:
        """TRL's reward and completion metrics over every process's completions of this generation."""
        names = [r.name for r in self.rewards]
        local = _reward_sums(scored, names) + _length_sums(scored.completions)
        totals = dict(zip(_reward_keys(names) + LENGTH_KEYS, all_reduce_sums(local, self.env)))
        lengths = [len(c.tokens) for c in scored.completions]
        everyone = [x for part in gather_objects((min(lengths), max(lengths)), self.env) for x in part]
        out = _reward_means(totals, names)
        n = max(totals["n"], 1.0)
        terminated = max(totals["terminated"], 1.0)
        out.update(
            {
                "completions/mean_length": totals["length"] / n,
                "completions/min_length": float(min(everyone)),
                "completions/max_length": float(max(everyone)),
                "completions/clipped_ratio": totals["clipped"] / n,
                "completions/mean_terminated_length": totals["terminated_length"] / terminated,
                "rollout/seconds": rollout_s,
                "rollout/completion_tokens_per_second": totals["length"] / self.env.world_size / max(rollout_s, 1e-9),
            }
        )
        return out

    def _log_completions(self, scored: Scored, step: int) -> None:
        """A sample of the generation's completions with their rewards (TRL's log_completions), rank 0."""
        if not (self.rl.log_completions and self.env.is_main) or step % self.recipe.train.log_every:
            return
        names = [r.name for r in self.rewards]
        prompts = self.data.prompts
        assert prompts is not None
        with self.completions_file.open("a") as f:
            for i in range(min(self.rl.num_completions_to_print, len(scored.completions))):
                row = {
                    "step": step,
                    "prompt": prompts.texts[scored.completions[i].prompt_index],
                    "completion": scored.texts[i],
                    "rewards": {n: _finite(scored.per_function[i, j]) for j, n in enumerate(names)},
                    "reward": _finite(scored.rewards[i]),
                    "advantage": round(float(scored.advantages[i]), 6),
                }
                f.write(json.dumps(row) + "\n")

    # --- evaluation -----------------------------------------------------------------------------
    def evaluate(self) -> EvalResult:
        """One greedy completion per held-out prompt (each process its share), scored: the mean
        reward, each function's mean and `eval_accuracy`."""
        prompt_set = self.data.eval_prompts
        if prompt_set is None:
            return EvalResult(loss=None, perplexity=None, tokens=0)
        limit = self.recipe.eval.max_samples or len(prompt_set)
        mine = list(range(self.layout.data_parallel_rank, min(limit, len(prompt_set)), self.layout.data_parallel_size))
        settings = RolloutSettings(self.rl.max_completion_length, temperature=0.0)
        completions = self.rollouts.sample([(i, prompt_ids(prompt_set, i)) for i in mine], 1, settings, -1)
        names = [r.name for r in self.rewards]
        local = [0.0] * (len(_reward_keys(names)) + len(LENGTH_KEYS))
        if completions:
            scored = self._score(completions, prompt_set, group=1, scale="none")  # groups of one: no advantages
            local = _reward_sums(scored, names) + _length_sums(completions)
        totals = dict(zip(_reward_keys(names) + LENGTH_KEYS, all_reduce_sums(local, self.env)))
        means = _reward_means(totals, names)
        metrics = {f"eval_{k}": round(v, 6) for k, v in means.items() if not k.endswith("/std") and k != "reward_std"}
        metrics["eval_completions/mean_length"] = round(totals["length"] / max(totals["n"], 1.0), 3)
        if ACCURACY_REWARD in names:
            metrics["eval_accuracy"] = metrics[f"eval_rewards/{ACCURACY_REWARD}/mean"]
        return EvalResult(loss=None, perplexity=None, tokens=int(totals["length"]), objective_metrics=metrics)


def rollouts_for(
    recipe: Recipe, model: ModelParts, tokenizer: Any, autocast: AutocastFactory, rows: int, run_dir: Path, env: DistEnv
) -> Rollouts:
    """finetune.rl.rollout: the engine in this process, or a `kubetune serve` at server_url."""
    rl = recipe.finetune.rl
    if rl.rollout == "server":
        from kubetune.training.rollout_server import ServerRollouts  # httpx only where a server is used

        assert rl.server_url is not None  # the recipe check requires it
        return ServerRollouts(rl.server_url, run_dir.name, model.model, recipe.model.name_or_path, run_dir, env)
    return LocalRollouts(model.lm, tokenizer.eos_token_id, autocast, recipe.data.max_seq_len, rows)


def take_prompts(batcher: Batcher, state: TrainState) -> list[int]:
    """This process's prompts of the next generation (a generation never spans two epochs)."""
    if batcher.micro_batches_left(state.epoch, state.row) == 0:
        state.epoch, state.row = state.epoch + 1, 0
    rows, state.row = batcher.rows_at(state.epoch, state.row)
    return [row[0] for row in rows]


def prompt_ids(prompts: PromptSet, i: int) -> list[int]:
    return [int(t) for t in prompts.tokens.sample(i)[0]]


def _reward_spec(recipe: Recipe) -> list[Any]:
    return [f if isinstance(f, str) else f.model_dump() for f in recipe.finetune.rl.reward_funcs]


def _finite(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else round(v, 6)


# --- metric sums: each process sums, one all-reduce adds them, the means follow ------------------

LENGTH_KEYS = ["n", "length", "clipped", "terminated", "terminated_length"]


def _reward_keys(names: list[str]) -> list[str]:
    per = [f"{k}:{n}" for n in names for k in ("sum", "sq", "count")]
    return ["reward_sum", "reward_sq", "reward_count", "std_zero", "groups", *per]


def _reward_sums(scored: Scored, names: list[str]) -> list[float]:
    rewards = scored.rewards
    ok = rewards[~torch.isnan(rewards)]
    out = [float(ok.sum()), float((ok**2).sum()), float(len(ok)), float(scored.std_zero.sum()), float(len(rewards))]
    for j in range(len(names)):
        col = scored.per_function[:, j]
        col = col[~torch.isnan(col)]
        out += [float(col.sum()), float((col**2).sum()), float(len(col))]
    return out


def _length_sums(completions: list[Completion]) -> list[float]:
    lengths = [len(c.tokens) for c in completions]
    ended = [n for c, n in zip(completions, lengths) if not c.truncated]
    return [
        float(len(lengths)),
        float(sum(lengths)),
        float(len(lengths) - len(ended)),
        float(len(ended)),
        float(sum(ended)),
    ]


def _mean_std(total: float, squares: float, count: float) -> tuple[float, float]:
    if count == 0:
        return math.nan, math.nan
    mean = total / count
    std = math.sqrt(max(squares - total * total / count, 0.0) / (count - 1)) if count > 1 else math.nan
    return mean, std


def _reward_means(totals: dict[str, float], names: list[str]) -> dict[str, float]:
    mean, std = _mean_std(totals["reward_sum"], totals["reward_sq"], totals["reward_count"])
    out = {"reward": mean, "reward_std": std}
    for n in names:
        m, s = _mean_std(totals[f"sum:{n}"], totals[f"sq:{n}"], totals[f"count:{n}"])
        out[f"rewards/{n}/mean"], out[f"rewards/{n}/std"] = m, s
    out["frac_reward_zero_std"] = totals["std_zero"] / max(totals["groups"], 1.0)
    return out
