"""How the engine picks each sequence's next token from the model's logits: a request's
penalties, biases, minimum length and grammar on its row, then greedy or seeded sampling
(temperature, top-k, min-p, top-p), and the log-probabilities it asked for.

One request's failure is never the batch's: a row whose adjustment or sampling raises comes
back as a `Failed`, which the engine ends alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kubetune.contracts.engine import Event, Request, Sampling


class Sampled(Protocol):
    """What sampling reads of a running sequence (core.Sequence)."""

    request: Request
    tokens: list[int]  # prompt, then generated
    generated: int
    generator: torch.Generator | None


@dataclass(frozen=True)
class Failed:
    """A row whose next token could not be had: `what` failed, with `error`."""

    error: Exception
    what: str


def new_generator(sampling: Sampling) -> torch.Generator | None:
    """A request's own random stream (seeded when it gave a seed); None when it samples greedily."""
    if sampling.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
    return gen


def next_tokens(logits: torch.Tensor, seqs: Sequence[Sampled], eos: int | None) -> list[Event | Failed]:
    """The next token of each sequence, as the Event its request will hear, or why it failed.
    `logits` stay the model's own: log-probabilities are reported from them."""
    chosen, failed = logits, {}
    adjusted = [i for i, s in enumerate(seqs) if s.request.sampling.adjusts_logits or s.request.constraint]
    if adjusted:  # most batches have none: no copy
        chosen = logits.clone()
    for i in adjusted:
        try:
            adjust(chosen[i], seqs[i], eos)
        except Exception as e:  # this request alone ends
            failed[i] = Failed(e, "adjusting the logits failed")
    best = chosen.argmax(dim=-1).tolist()
    return [failed[i] if i in failed else _pick(best[i], chosen, logits, i, seq) for i, seq in enumerate(seqs)]


def _pick(best: int, chosen: torch.Tensor, logits: torch.Tensor, i: int, seq: Sampled) -> Event | Failed:
    sampling = seq.request.sampling
    try:
        token = best if sampling.greedy else sample_row(chosen[i], sampling, seq.generator)
        return token_event(token, logits[i], sampling.logprobs)
    except Exception as e:
        return Failed(e, "sampling failed")


def adjust(row: torch.Tensor, seq: Sampled, eos: int | None) -> None:
    """A request's penalties, biases, minimum length and grammar, on its logits row, in place."""
    s, prompt_len = seq.request.sampling, len(seq.request.prompt)
    if s.logit_bias:
        ids, bias = zip(*s.logit_bias)
        row.index_add_(0, torch.tensor(ids), torch.tensor(bias, dtype=row.dtype))
    if s.repetition_penalty != 1.0:  # as vLLM: over the prompt and the answer
        seen = torch.tensor(seq.tokens).unique()
        v = row[seen]
        row[seen] = torch.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
    answer = seq.tokens[prompt_len:]
    if (s.presence_penalty or s.frequency_penalty) and answer:  # as OpenAI: over the answer
        counts = torch.bincount(torch.tensor(answer), minlength=row.numel())[: row.numel()].to(row.dtype)
        row -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(row.dtype)
    if seq.generated < s.min_tokens:
        ends = [*s.stop_token_ids, *([] if eos is None else [eos])]
        row[ends] = float("-inf")
    if seq.request.constraint is not None:
        seq.request.constraint.mask(row)


def token_event(token: int, logits: torch.Tensor, alternatives: int | None) -> Event:
    if alternatives is None:
        return Event(token)
    logprobs = logits.log_softmax(-1)
    top: tuple[tuple[int, float], ...] = ()
    if alternatives:
        values, ids = logprobs.topk(alternatives)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return Event(token, logprob=float(logprobs[token]), top_logprobs=top)


def sample_row(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    scaled = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < scaled.numel():
        kth = scaled.topk(sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.min_p > 0.0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < sampling.min_p * probs.max(), float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        beyond = probs.cumsum(-1) - probs > sampling.top_p  # keep the smallest prefix reaching top_p
        sorted_logits[beyond] = float("-inf")
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    return int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))
