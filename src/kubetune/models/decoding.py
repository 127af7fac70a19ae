"""Decoding one answer with a causal LM (greedy, or sampled at a temperature) through
transformers' `generate`: what `kubetune generate` and a run's sample answers share, so that
both give the same greedy answer for the same prompt. Serving has its own batched loop
(engine/core.py); its tests hold it to the same greedy tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]


@torch.no_grad()
def generate_text(
    lm: Any,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int,
    add_special_tokens: bool,
    device: torch.device,
    autocast: AutocastFactory = contextlib.nullcontext,
    temperature: float = 0.0,
) -> str:
    """The answer to an already rendered prompt, stopping at the tokenizer's EOS.

    `add_special_tokens` is False when the prompt was rendered by a chat template (which
    already holds the special tokens), True for plain templates.
    """
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=add_special_tokens).to(device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with autocast():
        out = lm.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            use_cache=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
    text: str = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return text.strip()
