"""The native serving engine: continuous batching over one model and many LoRA adapters.

One thread owns the model. Each turn of its loop it takes new and aborted requests, admits
waiting ones while the running limit and the KV-cache budget allow, reads up to
`prefill_chunk` prompt tokens (so a long prompt is read over several turns and never stalls
the running sequences for long), and runs one decode step for every sequence that is
generating, whichever adapter each uses. Sequences join and leave between steps.

Requests talk to the engine through `submit` / `abort` (any thread) and receive their
tokens through the `sink` callback they gave (called on the engine's thread).
"""

from __future__ import annotations

import collections
import inspect
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kubetune.serve.kvcache import PrefixCache, Rows, SlotCache
from kubetune.serve.lora import BASE, LoraBatch
from kubetune.serve.metrics import ServeMetrics


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
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class Event:
    """What a request hears from the engine: one new token, or the end (with its reason)."""

    token: int | None
    finish_reason: str | None = None  # "stop" (EOS), "length", "abort"


Sink = Callable[[Event], None]


@dataclass
class Request:
    id: str
    prompt: list[int]
    sampling: Sampling
    sink: Sink
    adapter: int = BASE
    adapter_name: str | None = None
    arrival: float = field(default_factory=time.monotonic)


class AdmissionError(Exception):
    """A request the engine will not take: `status` 400 (it can never fit) or 429 (full now)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class Sequence:
    request: Request
    tokens: list[int]  # prompt, then generated
    cached: int = 0  # tokens whose K/V are in the cache
    generated: int = 0
    started: float | None = None  # admitted (left the queue)
    last_token: float | None = None
    generator: torch.Generator | None = None
    slot: int = -1  # where its K/V live in the cache

    @property
    def prompt_left(self) -> int:
        return max(0, len(self.request.prompt) - self.cached)

    @property
    def reservation(self) -> int:
        return len(self.request.prompt) + self.request.sampling.max_tokens


class Engine:
    def __init__(
        self,
        lm: Any,
        eos_token_id: int | None,
        cache: SlotCache,
        lora: LoraBatch,
        limits: Limits,
        metrics: ServeMetrics,
    ) -> None:
        self.lm, self.eos, self.cache, self.lora, self.limits, self.metrics = (
            lm,
            eos_token_id,
            cache,
            lora,
            limits,
            metrics,
        )
        self.decoder, self.head = lm.get_decoder(), lm.get_output_embeddings()
        # a tenth of the KV budget holds prompt prefixes for reuse (0 turns reuse off)
        self.prefixes = PrefixCache(cache, cache.budget_tokens // 10 if limits.prefix_caching else 0)
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._slots: list[Sequence] = []  # decoding first, then prefilling (see kvcache)
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet taken by the loop (guarded by _lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None  # set when the loop died of a bug

    # --- the outside ---------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise AdmissionError(400) when a request can never run, naming the limit."""
        lim = self.limits
        if prompt_tokens > lim.max_prompt_tokens:
            raise AdmissionError(
                400,
                f"the prompt has {prompt_tokens} tokens; this server's limit is {lim.max_prompt_tokens} "
                "(--max-prompt-tokens)",
                "messages",
            )
        if prompt_tokens + max_tokens > lim.max_model_len:
            raise AdmissionError(
                400,
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is more than this server's "
                f"context of {lim.max_model_len} tokens (--max-model-len); lower max_tokens",
                "max_tokens",
            )
        if prompt_tokens + max_tokens > self.cache.budget_tokens:
            raise AdmissionError(
                400,
                f"the prompt plus max_tokens ({prompt_tokens + max_tokens} tokens) is more than the KV cache "
                f"holds ({self.cache.budget_tokens} tokens, --kv-cache-gib); lower max_tokens",
                "max_tokens",
            )

    def submit(self, request: Request) -> None:
        self.check(len(request.prompt), request.sampling.max_tokens)
        with self._lock:
            waiting = len(self._waiting) + self._pending
            if waiting >= self.limits.max_waiting:
                raise AdmissionError(429, f"the queue is full ({waiting} requests waiting, --max-waiting); retry later")
            self._pending += 1
            self._inbox.put(("submit", request))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (running, waiting or on their way in)."""
        return len(self._slots) + len(self._waiting) + self._pending

    def warm_up(self, prompt_tokens: int = 16) -> None:
        """A prefill and a decode step on slot 0 before the first request (which would otherwise
        pay for oneDNN's kernel choice and the cache's first allocation); nothing is counted."""
        with torch.inference_mode():
            self.cache.reserve(1, prompt_tokens + 1)
            ids = torch.ones(1, prompt_tokens, dtype=torch.long)
            zero, count = torch.zeros(1, dtype=torch.long), torch.tensor([prompt_tokens])
            self._forward(ids, torch.arange(prompt_tokens)[None], Rows(zero, zero, count, False, True), [BASE])
            start = torch.tensor([prompt_tokens])
            self._forward(
                ids[:, :1], start[:, None], Rows(zero, start, torch.ones(1, dtype=torch.long), True, False), [BASE]
            )

    def run(self) -> None:
        """Run the loop on the calling thread until `stop`. The server calls it on the thread
        that loaded the model: torch's OpenMP runtime (libgomp) keeps one pool of workers per
        thread that ever ran a parallel op, and once the pools hold more threads than there
        are cores it stops spinning between ops, which made every decode step ~1.5x slower
        (BENCHMARKS.md section 5)."""
        self._thread = threading.current_thread()
        self._run()

    def start(self) -> None:
        """Run the loop on a new thread (tests, benchmarks; see `run` for why the server does not)."""
        self._thread = threading.Thread(target=self._run, name="kubetune-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # --- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug: fail every request now, and /health reports it
            import traceback

            traceback.print_exc()
            self.error = e
            for seq in [*self._slots, *self._waiting]:
                seq.request.sink(Event(None, "error"))

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                self._take_inbox()
                self._admit()
                worked = self._prefill() | self._decode()
                self._publish()
                if not worked:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                with self._lock:
                    self._waiting.append(_new_sequence(item))
                    self._pending -= 1
            else:
                self._abort(item)
        self._order_slots()

    def _abort(self, request_id: str) -> None:
        for seq in list(self._waiting):
            if seq.request.id == request_id:
                self._waiting.remove(seq)
                self._finish(seq, "abort")
        for seq in list(self._slots):
            if seq.request.id == request_id:
                self._finish(seq, "abort")

    def _admit(self) -> None:
        while self._waiting and len(self._slots) < self.limits.max_num_seqs:
            seq = self._waiting[0]
            capacity = max([s.reservation for s in self._slots] + [seq.reservation])
            if not self.cache.fits(len(self._slots) + 1, capacity):
                return  # waits until running sequences finish and free the cache
            with self._lock:
                self._waiting.popleft()
            self.cache.reserve(len(self._slots) + 1, capacity, self.limits.max_num_seqs)
            seq.started = time.monotonic()
            self.metrics.queued(seq.started - seq.request.arrival)
            seq.slot = len(self._slots)  # free: slots 0..n-1 are taken in order (see _order_slots)
            seq.cached = self.prefixes.restore(seq.request.prompt, seq.request.adapter, seq.slot)
            self._slots.append(seq)  # a prefilling sequence: after every decoding one

    # --- prefill ---------------------------------------------------------------------------
    def _prefill(self) -> bool:
        budget, chosen = self.limits.prefill_chunk, []
        for seq in self._slots:
            if seq.prompt_left and budget:
                take = min(seq.prompt_left, budget)
                chosen.append((seq.slot, seq, take))
                budget -= take
        if not chosen:
            return False
        width = max(take for _, _, take in chosen)
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        for row, (_, seq, take) in enumerate(chosen):
            ids[row, :take] = torch.tensor(seq.tokens[seq.cached : seq.cached + take])
        starts = torch.tensor([seq.cached for _, seq, _ in chosen])
        rows = Rows(
            slots=torch.tensor([seq.slot for _, seq, _ in chosen]),
            starts=starts,
            counts=torch.tensor([take for _, _, take in chosen]),
            decode=False,
            fresh=bool((starts == 0).all()),
        )
        hidden = self._forward(
            ids, starts[:, None] + torch.arange(width), rows, [s.request.adapter for _, s, _ in chosen]
        )
        done = []
        for row, (_, seq, take) in enumerate(chosen):
            seq.cached += take
            if not seq.prompt_left:
                done.append((row, take - 1, seq))
                self.prefixes.remember(seq.request.prompt, seq.request.adapter, seq.slot)
        if done:
            last = hidden[[r for r, _, _ in done], [c for _, c, _ in done]]
            self._emit([s for _, _, s in done], self._sample(self.head(last).float(), [s for _, _, s in done]))
        self._order_slots()
        return True

    # --- decode ----------------------------------------------------------------------------
    def _decode(self) -> bool:
        seqs = [s for s in self._slots if not s.prompt_left]
        if not seqs:
            return False
        starts = torch.tensor([s.cached for s in seqs])
        n = len(seqs)
        rows = Rows(
            slots=torch.arange(n), starts=starts, counts=torch.ones(n, dtype=torch.long), decode=True, fresh=False
        )
        ids = torch.tensor([[s.tokens[-1]] for s in seqs])
        hidden = self._forward(ids, starts[:, None], rows, [s.request.adapter for s in seqs])
        for s in seqs:
            s.cached += 1
        self._emit(seqs, self._sample(self.head(hidden[:, 0]).float(), seqs))
        self._order_slots()
        return True

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, rows: Rows, adapters: list[int]) -> torch.Tensor:
        self.cache.rows = rows
        self.lora.set(adapters)
        mask = self.cache.mask(rows, ids.shape[1])
        out = self.decoder(
            input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, **{self._cache_kw: self.cache}
        )
        return out.last_hidden_state

    # --- tokens out ------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            if seq.request.sampling.temperature > 0:
                tokens[i] = _sample_row(logits[i], seq.request.sampling, seq.generator)
        return tokens

    def _emit(self, seqs: list[Sequence], tokens: list[int]) -> None:
        now = time.monotonic()
        for seq, token in zip(seqs, tokens):
            seq.tokens.append(token)
            seq.generated += 1
            if seq.last_token is None:
                self.metrics.first_token(now - seq.request.arrival)
            else:
                self.metrics.inter_token(now - seq.last_token)
            seq.last_token = now
            seq.request.sink(Event(token))
            if token == self.eos:
                self._finish(seq, "stop")
            elif seq.generated >= seq.request.sampling.max_tokens or len(seq.tokens) >= self.limits.max_model_len:
                self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq in self._slots:
            self._slots.remove(seq)  # its slot is reused after _order_slots
        self.metrics.finished(seq.request, len(seq.request.prompt) if seq.started else 0, seq.generated, reason)
        seq.request.sink(Event(None, reason))

    def _order_slots(self) -> None:
        """Put decoding sequences in slots 0..d-1 and prefilling ones right after them, in
        list order, moving the caches of those whose slot changes (a few per finished or
        newly decoding sequence; none on an ordinary step)."""
        wanted = [s for s in self._slots if not s.prompt_left] + [s for s in self._slots if s.prompt_left]
        occupant = {s.slot: s for s in wanted}
        for target, seq in enumerate(wanted):
            if seq.slot == target:
                continue
            other = occupant.get(target)
            if other is None:
                self.cache.move(seq.slot, target, seq.cached)
                del occupant[seq.slot]
            else:
                self.cache.swap(seq.slot, target, max(seq.cached, other.cached))
                other.slot = seq.slot
                occupant[seq.slot] = other
            seq.slot = target
            occupant[target] = seq
        self._slots = wanted

    def _publish(self) -> None:
        used = sum(s.cached for s in self._slots)
        self.metrics.state(
            len(self._slots), len(self._waiting), used / self.cache.budget_tokens, self._slots, self._waiting
        )


def _new_sequence(request: Request) -> Sequence:
    gen = None
    if request.sampling.temperature > 0:
        gen = torch.Generator()
        gen.manual_seed(request.sampling.seed if request.sampling.seed is not None else torch.seed())
    return Sequence(request, list(request.prompt), generator=gen)


def _sample_row(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    scaled = logits / sampling.temperature
    if sampling.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        beyond = probs.cumsum(-1) - probs > sampling.top_p  # keep the smallest prefix reaching top_p
        sorted_logits[beyond] = float("-inf")
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    return int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))
