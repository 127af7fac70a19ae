"""What an engine and its callers (the HTTP layer, GRPO's rollouts) say to each other, without torch.

The API (http/api.py) builds a `Request` per answer it wants (one per choice: `n` and lists of
prompts become several), hands it to `EngineClient.submit`, and hears `Event`s on the
request's `sink`: one per token, then the end with its reason. `abort` ends a request early.
The native engine (kubetune/engine/core.py) implements this; tests drive the API against a fake one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubetune.errors import UserError

BASE = -1  # the adapter index of a request for the base model
SAMPLING_EPS = 1e-5  # a temperature below this samples greedily (as vLLM does): 1/t would overflow


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int = 64  # sequences in the running batch
    max_waiting: int = 256  # requests queued behind them; more get 429
    max_model_len: int = 4096  # prompt + generated tokens of one sequence
    max_prompt_tokens: int = 4096
    prefill_chunk: int = 512  # prompt tokens read per engine turn
    prefix_caching: bool = True  # reuse the K/V of prompt prefixes seen before


@dataclass(frozen=True)
class Sampling:
    """How one answer picks its tokens, in vLLM's SamplingParams terms (the API checked every
    value). Penalties and biases apply to the model's logits before temperature; reported
    log-probabilities are the model's own (before any of them), as vLLM reports them by default."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # tokens less likely than this times the likeliest are dropped
    logprobs: int | None = None  # alternatives to report per token (0: the chosen token's only)
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS and stop_token_ids are not sampled before this many tokens
    ignore_eos: bool = False  # go on past EOS (benchmarks), up to max_tokens
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the model's logits before the choice (most requests: no)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
        )


@dataclass(frozen=True)
class Event:
    """What a request hears from the engine: one new token, or the end (with its reason)."""

    token: int | None
    finish_reason: str | None = None  # "stop" (EOS, a stop token or string, grammar done), "length", "abort", "error"
    error: str | None = None  # with "error": what failed
    status: int = 500  # with "error": 400 where the request asked for what cannot be done (RequestError)
    param: str | None = None  # with a 400: the request field to blame
    logprob: float | None = None  # of `token`, when the request asked for log-probabilities
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the most likely tokens at this step


Sink = Callable[[Event], None]


class Constraint(Protocol):
    """A grammar that the answer must follow (structured output), one per sequence."""

    def mask(self, logits: Any) -> None:
        """Set -inf in place where the grammar forbids the next token ([vocab] float row)."""

    def advance(self, token: int) -> bool:
        """Take the chosen token; True when the answer is complete and must stop now."""


@dataclass
class Request:
    id: str
    prompt: list[int]
    sampling: Sampling
    sink: Sink
    adapter: int = BASE
    adapter_name: str | None = None
    constraint: Constraint | None = None
    arrival: float = field(default_factory=time.monotonic)


class RequestError(Exception):
    """A request that turns out, while it runs, to ask for what cannot be done (a grammar whose
    text this model's vocabulary cannot write): its answer ends as a 400 naming `param`, not a
    500, and the engine goes on."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class AdmissionError(Exception):
    """A request the engine will not take: 400 (it can never fit), 429 (full now), 503 (failed)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class AdapterRequestError(UserError):
    """A runtime adapter load or unload the engine side refuses: `status` and the request field at fault."""

    def __init__(self, status: int, message: str, param: str) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class EngineClient(Protocol):
    """What the HTTP layer may use of an engine."""

    limits: Limits
    eos: int | None
    vocab_size: int  # token ids the model scores (its logits rows)
    error: BaseException | None  # set when the engine can no longer answer

    @property
    def in_flight(self) -> int: ...

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise AdmissionError(400) when a request of this size can never run."""

    def submit(self, request: Request) -> None:
        """Queue a request, or raise AdmissionError."""

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request early: the client went away ("abort") or a stop string matched ("stop")."""

    def call_between_steps(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the engine's thread between two steps (runtime adapters change the layers)."""
