"""The native serving engine: continuous batching over one model and many LoRA adapters.

One thread owns the model. Each turn of its loop it takes new and aborted requests, admits
waiting ones while the running limit and the KV-cache budget allow, and runs one forward
over the next token of every sequence that is generating, whichever adapter each uses, plus
up to `prefill_chunk` tokens of the prompts being read (so a long prompt is read over
several turns and never stalls the running sequences for long). Sequences join and leave
between turns.

Requests talk to the engine through `submit` / `abort` (any thread) and receive their
tokens through the `sink` callback they gave (called on the engine's thread).
"""

from __future__ import annotations

import collections
import concurrent.futures
import inspect
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kubetune.contracts.engine import AdmissionError, Event, Limits, Request, RequestError
from kubetune.engine.kvcache import BATCH_KWARG, Batch, PrefixCache, SlotCache
from kubetune.engine.lora import BASE, LoraBatch
from kubetune.engine.resident import ResidentAdapters
from kubetune.engine.sampling import Failed, new_generator, next_tokens

MAX_FAILED_STEPS = 3  # forwards failing one after another: the engine is broken, not one request


class EngineMetrics(Protocol):
    """What the engine reports as it runs (a server's are vLLM's metrics: kubetune.serve.native.metrics)."""

    def prefix_lookup(self, queried: int, hits: int) -> None: ...
    def first_token(self, seq: Any, now: float) -> None: ...
    def inter_token(self, seq: Any, now: float) -> None: ...
    def finished(self, seq: Any, reason: str) -> None: ...
    def state(self, running: int, waiting: int, kv_usage: float, running_seqs: Any, waiting_seqs: Any) -> None: ...


class NoMetrics:
    """An engine nobody scrapes (GRPO's rollouts report their own figures)."""

    def prefix_lookup(self, queried: int, hits: int) -> None:
        pass

    def first_token(self, seq: Any, now: float) -> None:
        pass

    def inter_token(self, seq: Any, now: float) -> None:
        pass

    def finished(self, seq: Any, reason: str) -> None:
        pass

    def state(self, running: int, waiting: int, kv_usage: float, running_seqs: Any, waiting_seqs: Any) -> None:
        pass


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
        metrics: EngineMetrics,
        adapters: ResidentAdapters | None = None,
    ) -> None:
        self.lm, self.eos, self.cache, self.lora, self.limits, self.metrics = (
            lm,
            eos_token_id,
            cache,
            lora,
            limits,
            metrics,
        )
        self.adapters = adapters  # --max-loras: which adapters are in the layers (None: all of them)
        self.decoder, self.head = lm.get_decoder(), lm.get_output_embeddings()
        self.vocab_size = int(lm.config.vocab_size)
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
        if self.error is not None:
            raise AdmissionError(503, f"the engine has failed ({self.error!r}); the server must be restarted")
        self.check(len(request.prompt), request.sampling.max_tokens)
        with self._lock:
            waiting = len(self._waiting) + self._pending
            if waiting >= self.limits.max_waiting:
                raise AdmissionError(429, f"the queue is full ({waiting} requests waiting, --max-waiting); retry later")
            self._pending += 1
            self._inbox.put(("submit", request))
        self._wake.set()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request early: the client went away ("abort") or a stop string matched ("stop")."""
        self._inbox.put(("abort", (request_id, reason)))
        self._wake.set()

    def call_between_steps(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn` on the engine's thread between two steps (loading adapters changes the
        layers a forward reads); its result or exception comes in the future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.error is not None:
            future.set_exception(AdmissionError(503, f"the engine has failed ({self.error!r})"))
            return future
        self._inbox.put(("call", (fn, future)))
        self._wake.set()
        return future

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (running, waiting or on their way in); none
        once the engine has failed (they were all ended with an error)."""
        if self.error is not None:
            return 0
        return len(self._slots) + len(self._waiting) + self._pending

    def warm_up(self, prompt_tokens: int = 16) -> None:
        """A prompt chunk and a decode step on slot 0 before the first request (which would
        otherwise pay for oneDNN's kernel choice and the cache's first allocation); nothing is counted."""
        with torch.inference_mode():
            self.cache.reserve(1, prompt_tokens + 1)
            self._forward(torch.ones(prompt_tokens, dtype=torch.long), Batch.of([], [(0, 0, prompt_tokens)]), [BASE])
            self._forward(torch.ones(1, dtype=torch.long), Batch.of([prompt_tokens], []), [BASE])

    def run(self) -> None:
        """Run the loop on the calling thread until `stop`. The server calls it on the thread
        that loaded the model: torch's OpenMP runtime (libgomp) keeps one pool of workers per
        thread that ever ran a parallel op, and once the pools hold more threads than there
        are cores it stops spinning between ops, which slows every decode step (BENCHMARKS.md,
        "What the serving engine's choices measured")."""
        self._thread = threading.current_thread()
        self._run()

    def drain(self) -> None:
        """Run turns on the calling thread until every submitted request has ended, then return
        (batch use: GRPO's rollouts submit a generation's requests, then drain). A failing
        forward raises here: a training run stops on it instead of scoring broken completions."""
        self._thread = threading.current_thread()
        with torch.inference_mode():
            while True:
                self._take_inbox()
                self._admit()
                worked = self._step()
                self._publish()
                if not worked and not self.in_flight:
                    return

    def read_prompts(self, prompts: list[tuple[list[int], int, int]]) -> list[torch.Tensor]:
        """Batch scoring (lm-eval's log-likelihoods): read every (tokens, adapter, first) prompt
        in one forward over slots 0..n-1 and return the last hidden states of its tokens from
        `first` on ([len(tokens) - first, hidden] each). The prefix cache gives what it knows of
        a prompt before `first` (a shared few-shot header, a multiple-choice question scored once
        per choice) and keeps what this forward reads. Only between drains: no sequence may be
        running, and the caller sized the batch to the cache (`cache.fits`)."""
        if self.in_flight:
            raise RuntimeError("read_prompts runs between drains, with no request in flight")
        with torch.inference_mode():
            self.cache.reserve(len(prompts), max(len(tokens) for tokens, _, _ in prompts))
            starts = [
                self.prefixes.restore(tokens[: first + 1], adapter, slot)
                for slot, (tokens, adapter, first) in enumerate(prompts)
            ]
            chunks = [
                (slot, start, len(tokens) - start) for slot, ((tokens, _, _), start) in enumerate(zip(prompts, starts))
            ]
            ids = [t for (tokens, _, _), start in zip(prompts, starts) for t in tokens[start:]]
            adapters = [adapter for (tokens, adapter, _), start in zip(prompts, starts) for _ in tokens[start:]]
            hidden = self._forward(torch.tensor(ids), Batch.of([], chunks), adapters)
            self.cache.batch = None
            for slot, (tokens, adapter, _) in enumerate(prompts):
                self.prefixes.remember(tokens, adapter, slot, len(tokens))
        parts = hidden.split([count for _, _, count in chunks])
        return [part[first - start :] for part, (_, _, first), start in zip(parts, prompts, starts)]

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
        except BaseException as e:  # a bug: fail every request now; /health and /ready report it
            import traceback

            traceback.print_exc()
            self.error = e
            while True:  # and those still on their way in
                try:
                    kind, item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    self._waiting.append(_new_sequence(item))
            for seq in [*self._slots, *self._waiting]:
                seq.request.sink(Event(None, "error", f"the engine failed: {e!r}"))

    def _loop(self) -> None:
        failed_steps = 0
        with torch.inference_mode():
            while not self._stopping:
                self._take_inbox()
                self._admit()
                try:
                    worked = self._step()
                    if worked:  # a forward that worked: earlier failures were the requests', not the engine's
                        failed_steps = 0
                except Exception as e:  # the step's requests end; the loop goes on
                    failed_steps += 1
                    if failed_steps >= MAX_FAILED_STEPS:
                        raise
                    self._fail_running(e)
                    worked = True
                self._publish()
                if not worked:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()

    def _fail_running(self, e: Exception) -> None:
        """A forward failed: end the sequences it held, with the error, and free their slots."""
        import traceback

        traceback.print_exc()
        for seq in list(self._slots):
            self._finish(seq, "error", f"the forward pass failed: {e!r}")
        self.cache.batch = None

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
            elif kind == "call":  # call_between_steps: fn runs here, between two forwards
                fn, future = item
                try:
                    future.set_result(fn())
                except Exception as e:
                    future.set_exception(e)
            else:
                self._abort(*item)
        self._order_slots()

    def _abort(self, request_id: str, reason: str) -> None:
        for seq in list(self._waiting):
            if seq.request.id == request_id:
                self._waiting.remove(seq)
                self._finish(seq, reason)
        for seq in list(self._slots):
            if seq.request.id == request_id:
                self._finish(seq, reason)

    def _admit(self) -> None:
        if self.adapters is not None:
            self.adapters.sweep({s.request.adapter for s in [*self._slots, *self._waiting]})
        for seq in list(self._waiting):
            if len(self._slots) >= self.limits.max_num_seqs:
                return
            capacity = max([s.reservation for s in self._slots] + [seq.reservation])
            if not self.cache.fits(len(self._slots) + 1, capacity):
                return  # waits until running sequences finish and free the cache
            if not self._resident(seq):
                continue  # every resident adapter is in use: it waits, the requests behind it may run
            with self._lock:
                self._waiting.remove(seq)
            self.cache.reserve(len(self._slots) + 1, capacity, self.limits.max_num_seqs)
            seq.started = time.monotonic()
            seq.slot = len(self._slots)  # free: slots 0..n-1 are taken in order (see _order_slots)
            self._slots.append(seq)  # a prefilling sequence: after every decoding one

    def _resident(self, seq: Sequence) -> bool:
        """Whether the sequence's adapter is in the layers now (loaded here if it can be)."""
        if self.adapters is None:
            return True
        return self.adapters.ensure(seq.request.adapter, {s.request.adapter for s in self._slots})

    # --- one forward per turn ---------------------------------------------------------------
    def _step(self) -> bool:
        """The next token of every decoding sequence and the next chunks of prompts, in one
        forward; returns False when there was nothing to do."""
        decoding = [s for s in self._slots if not s.prompt_left]  # in slots 0..d-1 (see _order_slots)
        chunks = self._prompt_chunks()
        if not decoding and not chunks:
            return False
        ids = [s.tokens[-1] for s in decoding]
        for seq, take in chunks:
            ids += seq.tokens[seq.cached : seq.cached + take]
        batch = Batch.of([s.cached for s in decoding], [(s.slot, s.cached, take) for s, take in chunks])
        adapters = [s.request.adapter for s in decoding]
        for seq, take in chunks:
            adapters += [seq.request.adapter] * take
        hidden = self._forward(torch.tensor(ids), batch, adapters)
        # a sequence samples from its last token: every decoding one, and each prompt read to the end
        sampled, rows = list(decoding), list(range(len(decoding)))
        for seq in decoding:
            seq.cached += 1
        for (seq, take), chunk in zip(chunks, batch.chunks):
            seq.cached += take
            self.prefixes.remember(seq.request.prompt, seq.request.adapter, seq.slot, seq.cached)
            if not seq.prompt_left:
                sampled.append(seq)
                rows.append(chunk.offset + take - 1)
        if sampled:
            self._emit(sampled, next_tokens(self.head(hidden[rows]).float(), sampled, self.eos))
        self._order_slots()
        return True

    def _prompt_chunks(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to read) for prompts being read, oldest first, `prefill_chunk` in
        all. A prompt takes what the prefix cache knows of it when its first chunk is about to
        be read, not when it was admitted; and a prompt whose next unknown block another chunk
        of this turn is writing waits one turn and takes it from the cache. So of a burst of
        chat requests with a header not yet cached, the first one reads the header and the others
        only their own text: more of the prompts is reused and the burst's slowest first token
        comes sooner (BENCHMARKS.md, "What the serving engine's choices measured")."""
        budget, chosen = self.limits.prefill_chunk, []
        written: set[int] = set()  # blocks this turn's chunks complete
        for seq in sorted((s for s in self._slots if s.prompt_left), key=lambda s: s.started or 0.0):
            if not budget:
                break
            prompt, adapter = seq.request.prompt, seq.request.adapter
            if seq.cached == 0:
                if self.prefixes.first_unknown(prompt, adapter) in written:
                    continue
                seq.cached = self.prefixes.restore(prompt, adapter, seq.slot)
                if self.prefixes.max_blocks:  # as vLLM: lookups count where prefix caching is on
                    self.metrics.prefix_lookup(len(prompt), seq.cached)
            take = min(seq.prompt_left, budget)
            chosen.append((seq, take))
            written |= self.prefixes.completed_by(prompt, adapter, seq.cached, seq.cached + take)
            budget -= take
        return chosen

    def _forward(self, ids: torch.Tensor, batch: Batch, adapters: list[int]) -> torch.Tensor:
        """[tokens] ids -> [tokens, hidden] last hidden states."""
        self.cache.batch = batch
        self.lora.set(adapters)
        # a 4-D mask passes through transformers untouched; slot_attention reads the batch instead
        mask = batch.decode_mask if batch.decode_mask is not None else torch.ones(1, 1, 1, 1, dtype=torch.bool)
        out = self.decoder(
            input_ids=ids[None],
            position_ids=batch.positions[None],
            attention_mask=mask,
            use_cache=True,
            **{self._cache_kw: self.cache, BATCH_KWARG: batch},
        )
        return out.last_hidden_state[0]

    # --- tokens out ------------------------------------------------------------------------
    def _emit(self, seqs: list[Sequence], events: list[Event | Failed]) -> None:
        """Each sequence's new token to its request, and the end where it stops; a failed row ends alone."""
        now = time.monotonic()
        for seq, event in zip(seqs, events):
            if isinstance(event, Failed):
                self._fail(seq, event.error, event.what)
                continue
            token, request = event.token, seq.request
            assert token is not None
            try:
                complete = request.constraint is not None and request.constraint.advance(token)
            except Exception as e:  # a token the grammar refuses: this answer ends
                self._fail(seq, e, "the grammar failed")
                continue
            seq.tokens.append(token)
            seq.generated += 1
            if seq.last_token is None:
                self.metrics.first_token(seq, now)
            else:
                self.metrics.inter_token(seq, now)
            seq.last_token = now
            request.sink(event)
            sampling = request.sampling
            if complete or (token == self.eos and not sampling.ignore_eos) or token in sampling.stop_token_ids:
                self._finish(seq, "stop")
            elif seq.generated >= sampling.max_tokens or len(seq.tokens) >= self.limits.max_model_len:
                self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self._end(seq, Event(None, reason, error))

    def _fail(self, seq: Sequence, e: Exception, what: str) -> None:
        """End one sequence with an error: the request's (a 400 naming its field) or ours (500)."""
        if isinstance(e, RequestError):
            self._end(seq, Event(None, "error", str(e), status=400, param=e.param))
        else:
            self._end(seq, Event(None, "error", f"{what}: {e!r}"))

    def _end(self, seq: Sequence, event: Event) -> None:
        if seq in self._slots:
            self._slots.remove(seq)  # its slot is reused after _order_slots
        self.metrics.finished(seq, event.finish_reason or "error")
        seq.request.sink(event)

    def _order_slots(self) -> None:
        """Put decoding sequences in slots 0..d-1 and prefilling ones in d..n-1, moving as few
        caches as possible: a sequence already in its range stays, the others fill the free
        slots of theirs (one move per finished or newly decoding sequence, none on an ordinary
        step; keeping the list's order instead moved every later sequence down one slot when
        one finished). The list then follows the slots."""
        d, n = sum(1 for s in self._slots if not s.prompt_left), len(self._slots)

        def placed(seq: Sequence) -> bool:
            return d <= seq.slot < n if seq.prompt_left else seq.slot < d

        staying = {s.slot for s in self._slots if placed(s)}
        free_decode = (t for t in range(d) if t not in staying)
        free_prefill = (t for t in range(d, n) if t not in staying)
        wanted: list[Sequence] = list(self._slots)
        for seq in self._slots:
            wanted[seq.slot if placed(seq) else next(free_prefill if seq.prompt_left else free_decode)] = seq
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
    return Sequence(request, list(request.prompt), generator=new_generator(request.sampling))
