"""GRPO's rollouts: the policy's completions, sampled by kubetune's engine inside the training
process, from the weights as they stand after the last optimizer step.

The engine (kubetune.engine.core) runs over the very model being trained: its decoder, its
head, and under LoRA the PEFT layers with the live adapter weights (no copy, no weight sync).
For the length of a rollout the model is put in eval mode (no dropout) and its attention is
switched to the engine's slot attention over a paged KV cache; then it is switched back. All
of a generation's completions decode together (continuous batching: every sequence's next
token in one forward, prompts read in chunks beside them), under the run's autocast, so the
K/V and the logits have the dtype training computes in.

Each completion's random stream is seeded from (train.seed, the generation, the prompt, the
completion's index in its group): a resumed run samples exactly what the uninterrupted run
would have, and data-parallel processes never share a stream.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kubetune.contracts.engine import Event, Limits, Request, Sampling
from kubetune.engine.core import Engine, NoMetrics
from kubetune.engine.kvcache import SlotCache
from kubetune.engine.kvcache import register as register_slot_attention
from kubetune.engine.lora import LoraBatch
from kubetune.models.decoding import AutocastFactory

# The rollout cache holds every sequence of a generation at its longest; memory beyond that buys nothing.
KV_FLOOR_BYTES = 64 << 20


@dataclass(frozen=True)
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int  # the prompt's index in its PromptSet
    prompt: list[int]
    tokens: list[int]  # the completion's tokens, EOS included when it stopped on it
    logprobs: list[float]  # the engine's log-probability of each token (the model's own logits)
    truncated: bool  # cut at max_completion_length, not ended by EOS


@dataclass(frozen=True)
class RolloutSettings:
    max_tokens: int
    temperature: float  # 0: greedy (evaluation)
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def stream_seed(seed: int, generation: int, prompt_index: int, member: int) -> int:
    """The random stream of one completion: a pure function of where it sits in the run."""
    return zlib.crc32(f"{seed}:{generation}:{prompt_index}:{member}".encode())


class Rollouts(Protocol):
    """Where GRPO's completions come from: this process's engine (LocalRollouts) or a
    `kubetune serve` (rollout_server.ServerRollouts)."""

    def policy_at(self, version: int) -> None:
        """The policy's weights now stand after `version` optimizer steps."""

    def sample(
        self, prompts: list[tuple[int, list[int]]], group: int, settings: RolloutSettings, generation: int
    ) -> list[Completion]: ...


class LocalRollouts:
    """Samples completions with kubetune's engine over the policy `lm` (a transformers *ForCausalLM;
    under LoRA the PEFT layers inside it)."""

    def __init__(self, lm: Any, eos_token_id: int | None, autocast: AutocastFactory, max_sequence: int, rows: int):
        self.lm, self.eos, self.autocast = lm, eos_token_id, autocast
        self.attention = register_slot_attention()
        config = lm.config
        dtype = self._compute_dtype(lm)
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * _head_dim(config) * dtype.itemsize
        budget = max(KV_FLOOR_BYTES, per_token * max_sequence * rows)
        self.cache = SlotCache.for_config(config, dtype, budget)
        limits = Limits(
            max_num_seqs=rows,
            max_waiting=1 << 30,  # a batch is submitted whole (an evaluation's prompts too); `rows` run at once
            max_model_len=max_sequence,
            max_prompt_tokens=max_sequence - 1,
            prefix_caching=True,  # a group's G prompts are one prompt: its K/V are read once
        )
        self.engine = Engine(lm, eos_token_id, self.cache, LoraBatch(), limits, NoMetrics())

    def _compute_dtype(self, lm: Any) -> torch.dtype:
        """The dtype K and V come out in: autocast's, else the (base) weights'."""
        device_type = lm.device.type
        with self.autocast():
            if torch.is_autocast_enabled(device_type):
                return torch.get_autocast_dtype(device_type)
        dtype: torch.dtype = lm.get_input_embeddings().weight.dtype
        return dtype

    def policy_at(self, version: int) -> None:
        """Nothing to do: the engine reads the live weights."""

    def sample(
        self, prompts: list[tuple[int, list[int]]], group: int, settings: RolloutSettings, generation: int
    ) -> list[Completion]:
        """`group` completions of each (prompt index, prompt tokens), in prompt order."""
        done: dict[int, list[Event]] = {}
        order: list[tuple[int, list[int]]] = []
        for index, ids in prompts:
            for member in range(group):
                sampling = Sampling(
                    max_tokens=settings.max_tokens,
                    temperature=settings.temperature,
                    top_p=settings.top_p,
                    top_k=settings.top_k,
                    seed=stream_seed(settings.seed, generation, index, member),
                    logprobs=0,
                )
                events = done.setdefault(len(order), [])
                order.append((index, ids))
                self.engine.submit(Request(f"{generation}-{index}-{member}", list(ids), sampling, events.append))
        with self._serving():
            self.engine.drain()
        return [_completion(index, ids, done[i], settings.max_tokens) for i, (index, ids) in enumerate(order)]

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """The model as the engine needs it: eval mode, slot attention, the run's autocast."""
        lm, was_training = self.lm, self.lm.training
        before = lm.config._attn_implementation
        lm.eval()
        lm.set_attn_implementation(self.attention)
        try:
            with self.autocast():
                yield
        finally:
            lm.set_attn_implementation(before)
            lm.train(was_training)
            self.engine.prefixes.clear()  # the next generation's weights differ: no K/V of this one is valid


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _completion(index: int, prompt: list[int], events: list[Event], max_tokens: int) -> Completion:
    end = events[-1]
    if end.finish_reason == "error":
        raise RuntimeError(f"a rollout failed: {end.error}")
    tokens = [e.token for e in events if e.token is not None]
    logprobs = [float(e.logprob or 0.0) for e in events if e.token is not None]
    truncated = end.finish_reason == "length" and len(tokens) >= max_tokens
    return Completion(index, prompt, tokens, logprobs, truncated)
