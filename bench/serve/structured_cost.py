"""What constrained decoding (serve/native/structured.py, llguidance) costs per generated token.

Drives one `Constraint` through the tokens of a schema-valid document on the SmolLM2
tokenizer, as the engine would (mask the logits row, then advance with the token), and
prints the median and 90th percentile per token of the mask (llguidance's bitmask, then
applying it to a [vocab] float row) and of the advance, over `--rounds` passes after a
warm-up; also the one-time costs (the llguidance tokenizer, compiling the schema, a new
Constraint). `--decode-step` also times one decode step of SmolLM2-135M (one sequence,
HF's forward with its own cache, this process's threads) to set the figure beside.

    .venv/bin/python bench/serve/structured_cost.py
    .venv/bin/python bench/serve/structured_cost.py --rounds 50 --decode-step
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "patient": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "diagnoses": {"type": "array", "items": {"type": "string"}},
        "medications": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"drug": {"type": "string"}, "mg": {"type": "number"}, "daily": {"type": "boolean"}},
                "required": ["drug", "mg", "daily"],
                "additionalProperties": False,
            },
        },
        "urgency": {"enum": ["routine", "soon", "urgent"]},
    },
    "required": ["patient", "age", "diagnoses", "medications", "urgency"],
    "additionalProperties": False,
}
DOCUMENT = {
    "patient": "Maria Jensen, a retired schoolteacher from Aarhus",
    "age": 71,
    "diagnoses": ["type 2 diabetes mellitus", "hypertension", "chronic kidney disease stage 3a"],
    "medications": [
        {"drug": "metformin", "mg": 500, "daily": True},
        {"drug": "lisinopril", "mg": 10, "daily": True},
        {"drug": "atorvastatin", "mg": 20.5, "daily": False},
    ],
    "urgency": "soon",
}


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def per_token(factory: Any, tokens: list[int], rows: int, rounds: int) -> tuple[list[float], list[float]]:
    masks: list[float] = []
    advances: list[float] = []
    logits = torch.zeros(rows)
    for _ in range(rounds):
        constraint = factory()
        for token in tokens:
            logits.zero_()
            start = time.perf_counter()
            constraint.mask(logits)
            masked = time.perf_counter()
            assert torch.isfinite(logits[token]), "the document left the grammar"
            constraint.advance(token)
            masks.append(masked - start)
            advances.append(time.perf_counter() - masked)
    return masks, advances


def decode_step_ms(steps: int = 20) -> float:
    from kubetune.models.load import load_causal_lm, resolve_model

    lm = load_causal_lm(resolve_model("smollm2-135m-instruct"), torch.float32, "sdpa").eval()
    with torch.inference_mode():
        out = lm(torch.arange(100)[None] + 1000, use_cache=True)
        cache, times = out.cache, []
        for i in range(steps + 3):
            times.append(timed(lambda i=i: lm(torch.tensor([[1000 + i]]), cache=cache, use_cache=True)))
    return statistics.median(times[3:]) * 1e3


def quantiles_us(values: list[float]) -> str:
    ordered = sorted(values)
    return f"median {statistics.median(ordered) * 1e6:7.1f} us, p90 {ordered[int(0.9 * len(ordered))] * 1e6:7.1f} us"


def main() -> None:
    from kubetune.models.load import load_tokenizer, resolve_model
    from kubetune.serve.native.structured import Grammars

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--decode-step", action="store_true")
    args = ap.parse_args()
    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    text = json.dumps(DOCUMENT)  # json.dumps's separators: the spacing structured.py's grammar writes
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    start = time.perf_counter()
    grammars = Grammars(tokenizer)
    built = time.perf_counter() - start
    spec = {"type": "json_schema", "json_schema": {"name": "chart", "schema": SCHEMA}}
    compiled = timed(lambda: grammars.compile(spec))
    factory = grammars.compile(spec)
    assert factory is not None
    fresh = timed(factory)
    rows = len(tokenizer) + 64  # a head with padding rows
    per_token(factory, tokens, rows, 2)  # warm-up
    masks, advances = per_token(factory, tokens, rows, args.rounds)
    print(f"torch threads {torch.get_num_threads()}; document of {len(tokens)} tokens x {args.rounds} rounds")
    once = (
        f"llguidance tokenizer {built * 1e3:.0f} ms, compile {compiled * 1e3:.1f} ms, Constraint {fresh * 1e6:.0f} us"
    )
    print(f"one-time: {once}")
    print(f"mask    per token: {quantiles_us(masks)}")
    print(f"advance per token: {quantiles_us(advances)}")
    total = statistics.median(m + a for m, a in zip(masks, advances)) * 1e3
    print(f"mask + advance per token: median {total:.3f} ms")
    if args.decode_step:
        step = decode_step_ms()
        share = 100 * total / step
        print(f"decode step, SmolLM2-135M, 1 sequence: median {step:.2f} ms (mask + advance = {share:.1f}% of it)")


if __name__ == "__main__":
    main()
