"""Which decode path should the native engine use? One run, same model, same 16 prompts,
same greedy tokens budget:

- kubetune's engine, eager (what `kubetune serve` runs);
- kubetune's engine with the decoder under `torch.compile(dynamic=True)` (batch and length
  change every step, so static shapes would recompile);
- transformers' own continuous batching with paged attention (`model.generate_batch`);
- one static batch through HF `generate` (left-padded), the textbook baseline.

Prints generated tokens/s for each and the ratio to kubetune eager. The compile arm also
reports its compile (first-call) time.

    .venv/bin/python bench/serve/serve_engine_choices.py [--requests 16] [--max-tokens 64] [--arms ...]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "medical_flashcards" / "test.jsonl"


def prompts(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in SHARED.read_text().splitlines()[:n]]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["input"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def kubetune_arm(model_dir: str, ids: list[list[int]], max_tokens: int, compile_decoder: bool) -> dict:
    from kubetune.contracts.engine import Limits, Request, Sampling
    from kubetune.engine.core import Engine
    from kubetune.engine.kvcache import SlotCache, register
    from kubetune.serve.native.metrics import ServeMetrics
    from kubetune.serve.native.models import load_served
    from kubetune.serve.native.packed import pack

    served = load_served(model_dir, [], torch.float32, register())
    print("  ", pack(served.lm, rows=16))  # as `kubetune serve` does
    cache = SlotCache.for_config(served.lm.config, torch.float32, 2 << 30)
    engine = Engine(served.lm, None, cache, served.lora, Limits(), ServeMetrics(served.base_name, 0, []))
    first_call = 0.0
    if compile_decoder:
        engine.decoder = torch.compile(engine.decoder, dynamic=True)
        t0 = time.perf_counter()
        engine.warm_up()
        first_call = time.perf_counter() - t0
    engine.warm_up()
    engine.start()
    done = [threading.Event() for _ in ids]
    counts = [0] * len(ids)

    def sink(i):
        def on(ev):
            if ev.token is not None:
                counts[i] += 1
            if ev.finish_reason:
                done[i].set()

        return on

    t0 = time.perf_counter()
    for i, prompt in enumerate(ids):
        engine.submit(Request(f"r{i}", prompt, Sampling(max_tokens), sink(i)))
    for d in done:
        d.wait()
    wall = time.perf_counter() - t0
    engine.stop()
    return {"tokens": sum(counts), "seconds": wall, "first_call_s": first_call}


def hf_continuous_arm(model_dir: str, ids: list[list[int]], max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="paged|sdpa")
    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(ids[:2], generation_config=cfg, max_new_tokens=4)  # warm-up
    t0 = time.perf_counter()
    out = model.generate_batch(ids, generation_config=cfg)
    wall = time.perf_counter() - t0
    return {"tokens": sum(len(o.generated_tokens) for o in out.values()), "seconds": wall}


def hf_static_arm(model_dir: str, ids: list[list[int]], max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in ids)
    batch = torch.tensor([[0] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    with torch.inference_mode():
        model.generate(batch[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        out = model.generate(
            batch,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        wall = time.perf_counter() - t0
    return {"tokens": (out.shape[1] - width) * len(ids), "seconds": wall}


def main() -> None:
    from kubetune.models.load import load_tokenizer, resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--arms", default="kubetune,kubetune-compile,hf-continuous,hf-static")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2-135m-instruct")
    ids = prompts(load_tokenizer(model_dir), args.requests)
    arms = {
        "kubetune": lambda: kubetune_arm(model_dir, ids, args.max_tokens, False),
        "kubetune-compile": lambda: kubetune_arm(model_dir, ids, args.max_tokens, True),
        "hf-continuous": lambda: hf_continuous_arm(model_dir, ids, args.max_tokens),
        "hf-static": lambda: hf_static_arm(model_dir, ids, args.max_tokens),
    }
    print(f"{args.requests} requests x {args.max_tokens} new tokens, fp32, {torch.get_num_threads()} threads")
    results = {}
    for name in args.arms.split(","):
        try:
            results[name] = arms[name]()
        except Exception as e:  # an arm that cannot run is a result too
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        r = results[name]
        if "error" in r:
            print(f"{name:18s} not run: {r['error']}")
            continue
        rate = r["tokens"] / r["seconds"]
        ref = results.get("kubetune")
        ratio = rate / (ref["tokens"] / ref["seconds"]) if ref and "error" not in ref else float("nan")
        extra = f"  (first call {r['first_call_s']:.1f} s)" if r.get("first_call_s") else ""
        print(f"{name:18s} {r['tokens']:5d} tokens in {r['seconds']:6.2f} s = {rate:7.1f} tok/s  x{ratio:.2f}{extra}")


if __name__ == "__main__":
    main()
