"""kubetune's engine as an lm-eval-harness model backend (`lm_eval --model kubetune`).

Generation (`generate_until`) is the serving engine's continuous batching over its KV cache, in
this process, without a server: every request of a task is submitted at once and the engine
reads and decodes them together, as `make-preferences` and GRPO's rollouts use it.

Scoring (`loglikelihood`, `loglikelihood_rolling`) is one flat forward per batch of requests
through the same engine (`Engine.read_prompts`: the prompts side by side in one row, each
attending to its own tokens only, so there is no padding), with the engine's prefix cache: a
multiple-choice question is read once and only its choices after it, and a few-shot header
once per task. Only the rows of the continuation go through the LM head, never a
[batch, tokens, vocabulary] tensor.

Base and tuned: one engine holds the base model and a LoRA run's adapter side by side (the
engine's mixed-adapter batches); `EngineLM.pair` gives an LM for each, so a run's base and
tuned model are evaluated over one loaded model. The semantics (tokenisation of context and
continuation, `is_greedy`, rolling windows, stop sequences) are lm-eval's HFLM's, through its
own helpers; tests/training/test_lmeval.py compares the numbers with HFLM's.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from kubetune.contracts.engine import BASE, Event, Limits, Request, Sampling
from kubetune.engine.core import Engine, NoMetrics
from kubetune.engine.kvcache import SlotCache
from kubetune.engine.kvcache import register as register_slot_attention
from kubetune.engine.lora import install, read_adapters
from kubetune.models.load import load_causal_lm, load_tokenizer

KV_BUDGET_BYTES = 1 << 30  # the KV cache of an evaluation: ~30k tokens of SmolLM2-135M in fp32
FORWARD_TOKENS = 4096  # prompt tokens per scoring forward (slots x longest prompt)
DEFAULT_MAX_GEN_TOKS = 256  # as HFLM
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class SharedEngine:
    """One model (and a LoRA run's adapter) in an engine, shared by the LMs of `EngineLM.pair`."""

    def __init__(self, lm: Any, tokenizer: Any, adapters: list[Any], max_length: int | None = None) -> None:
        lm.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length or int(getattr(lm.config, "max_position_embeddings", 0) or 2048)
        dtype = lm.get_input_embeddings().weight.dtype
        cache = SlotCache.for_config(lm.config, dtype, KV_BUDGET_BYTES)
        limits = Limits(
            max_num_seqs=Limits().max_num_seqs,
            max_waiting=1 << 30,  # a task's requests are submitted whole
            max_model_len=self.max_length,
            max_prompt_tokens=self.max_length,
            prefix_caching=True,  # few-shot headers and multiple-choice questions are read once
        )
        self.engine = Engine(lm, tokenizer.eos_token_id, cache, install(lm, adapters), limits, NoMetrics())


def load_engine(
    pretrained: str, adapter: str | None = None, dtype: torch.dtype = torch.float32, max_length: int | None = None
) -> SharedEngine:
    """A model directory (and a PEFT adapter directory) in an engine with the slot attention."""
    lm = load_causal_lm(pretrained, dtype, register_slot_attention())
    tokenizer = load_tokenizer(pretrained)
    adapters = read_adapters(lm, [("tuned", adapter)]) if adapter else []
    return SharedEngine(lm, tokenizer, adapters, max_length)


@register_model("kubetune")
class EngineLM(TemplateLM):
    """An lm-eval LM over kubetune's engine; `adapter` is BASE or the engine's adapter index.
    From the command line: `lm_eval --model kubetune --model_args pretrained=DIR[,peft=ADAPTER_DIR]`
    (with `peft`, the adapter is on: `adapter_on=false` evaluates the base through the same engine)."""

    def __init__(
        self,
        pretrained: str | None = None,
        peft: str | None = None,
        adapter_on: bool = True,
        dtype: str = "float32",
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        shared: SharedEngine | None = None,
        adapter: int = BASE,
        **_ignored: Any,  # lm-eval's batch_size, device: the engine sizes its own batches, on the CPU
    ) -> None:
        super().__init__()
        if shared is None:
            if pretrained is None:
                raise ValueError("model_args: give pretrained=MODEL_DIR")
            if dtype not in DTYPES:
                raise ValueError(f"model_args dtype={dtype}: choose one of {', '.join(DTYPES)}")
            shared = load_engine(pretrained, peft, DTYPES[dtype], max_length)
            adapter = 0 if peft and _truthy(adapter_on) else BASE
        self.shared, self.adapter = shared, adapter
        self.tokenizer = shared.tokenizer
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token

    @classmethod
    def pair(cls, shared: SharedEngine) -> tuple[EngineLM, EngineLM]:
        """(base, tuned) over one engine whose adapter 0 is the tuned run's."""
        return cls(shared=shared, adapter=BASE), cls(shared=shared, adapter=0)

    # --- what TemplateLM and the evaluator read ------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int:
        return self.shared.max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text: str = self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )
        return text

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs: Any
    ) -> list[int]:
        """HFLM's: no BOS added to a string that starts with it."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding: list[int] = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    # --- scoring ---------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, whether greedy decoding gives it) per
        (key, context tokens, continuation tokens), as HFLM: the last max_length tokens of
        context + continuation, less the final one, are read."""
        prompts = []
        for _, context, continuation in requests:
            prompts.append(((context + continuation)[-(self.max_length + 1) :][:-1], continuation))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(prompts)
        for batch in self._scoring_batches(prompts):
            read = self.shared.engine.read_prompts(
                [(prompts[i][0], self.adapter, len(prompts[i][0]) - len(prompts[i][1])) for i in batch]
            )
            for i, hidden in zip(batch, read):
                results[i] = self._score(hidden, prompts[i][1])
        return results

    def _score(self, hidden: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
        with torch.inference_mode():
            logprobs = torch.log_softmax(self.shared.engine.head(hidden).float(), dim=-1)
        target = torch.tensor(continuation)
        picked = logprobs.gather(1, target[:, None]).squeeze(1)
        return float(picked.sum()), bool((logprobs.argmax(dim=-1) == target).all())

    def _scoring_batches(self, prompts: list[tuple[list[int], list[int]]]) -> Iterable[list[int]]:
        """Request indices in batches of at most FORWARD_TOKENS slot positions, longest first
        (as HFLM orders them); prompts that share a context come one after another, and the first
        of each context goes in an earlier batch than the rest, which then reuse its K/V."""
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i][0]), prompts[i][0]))
        seen: set[tuple[int, ...]] = set()
        firsts: list[int] = []
        rest: list[int] = []
        for i in order:
            context = tuple(prompts[i][0][: len(prompts[i][0]) - len(prompts[i][1])])
            (rest if context in seen else firsts).append(i)
            seen.add(context)
        cache = self.shared.engine.cache
        for group in (firsts, rest):
            batch: list[int] = []
            for i in group:
                longest = max([len(prompts[j][0]) for j in batch] + [len(prompts[i][0])])
                too_big = (len(batch) + 1) * longest > FORWARD_TOKENS or not cache.fits(len(batch) + 1, longest)
                if batch and too_big:
                    yield batch
                    batch = []
                batch.append(i)
            if batch:
                yield batch

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """HFLM's rolling windows (max_length tokens each, one token of context), summed per text."""
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        return totals

    # --- generation ------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Every request submitted to the engine at once; each answer ends at EOS, at
        `max_gen_toks` or once its text holds one of `until` (then cut there, as HFLM cuts)."""
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        engine = self.shared.engine
        answers: list[Answer] = []
        for index, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - max_gen_toks)
            sampling = Sampling(max_tokens=max_gen_toks, temperature=float(kwargs.get("temperature") or 0.0))
            answer = Answer(f"lm-eval-{index}", self.tokenizer, until, engine)
            answers.append(answer)
            engine.submit(Request(answer.id, prompt, sampling, answer.receive, adapter=self.adapter))
        engine.drain()
        failed = [a.error for a in answers if a.error]
        if failed:
            raise RuntimeError(f"the engine failed while generating: {failed[0]}")
        return [postprocess_generated_text(a.text(), a.until, None) for a in answers]


class Answer:
    """One generation's tokens; it asks the engine to stop once its text holds a stop sequence."""

    def __init__(self, id: str, tokenizer: Any, until: list[str], engine: Engine) -> None:
        self.id, self.tokenizer, self.until, self.engine = id, tokenizer, until, engine
        self.tokens: list[int] = []
        self.error: str | None = None
        self.stopped = False

    def text(self) -> str:
        text: str = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return text

    def receive(self, event: Event) -> None:
        if event.token is not None:
            self.tokens.append(event.token)
            if not self.stopped and any(stop and stop in self.text() for stop in self.until):
                self.stopped = True
                self.engine.abort(self.id, "stop")
        if event.finish_reason == "error":
            self.error = event.error or "unknown error"


def _truthy(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() not in ("false", "0", "no", "off")


def shipped_tasks() -> Path:
    """The folder of kubetune's own lm-eval tasks (flashcards, flashcards_mc), for TaskManager's include_path."""
    from importlib.resources import files

    return Path(str(files("kubetune.data") / "lm_tasks"))
