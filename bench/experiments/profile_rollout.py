"""Where a GRPO rollout goes: kubetune's in-process rollouts (LocalRollouts over the PEFT model
being trained) on SmolLM2-135M-Instruct, timed and profiled by Python function.

One process, one thread (the planner's per-core launch on 2 cores), LoRA r 8 on q/v, fp32 (or
the precision given); P arithmetic prompts x G completions of up to T tokens, sampled at
temperature 1. One warm-up rollout, one timed, one under cProfile (its total is longer: the
profiler's own cost), then the functions with the most time of their own.

    .venv/bin/python bench/experiments/profile_rollout.py [--prompts 2] [--group 8] [--tokens 64]
        [--precision fp32] [--threads 1] [--top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from kubetune.models.finetune import build_model
from kubetune.models.kernels import autocast_context
from kubetune.models.load import load_tokenizer, resolve_model
from kubetune.recipe import load_recipe
from kubetune.training.rollout import LocalRollouts, RolloutSettings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--tokens", type=int, default=64, help="max completion tokens")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=18, help="functions listed")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    source = resolve_model("smollm2-135m-instruct")
    tokenizer = load_tokenizer(source)
    lora = ["lora.r=8", "lora.alpha=16", "lora.target_modules=[q_proj,v_proj]"]
    recipe = load_recipe(None, [f"train.precision={args.precision}", *lora]).recipe
    parts = build_model(recipe, source, torch.device("cpu"))
    autocast = autocast_context(args.precision, torch.device("cpu"))
    rollouts = LocalRollouts(parts.lm, tokenizer.eos_token_id, autocast, 512, args.prompts * args.group)
    prompts = [(i, _prompt_ids(tokenizer, i)) for i in range(args.prompts)]
    settings = RolloutSettings(max_tokens=args.tokens, temperature=1.0, seed=1)

    rollouts.sample(prompts, args.group, settings, 0)  # warm-up: the cache's pages, the kernels' first calls
    t0 = time.perf_counter()
    out = rollouts.sample(prompts, args.group, settings, 1)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.tokens) for c in out)
    print(f"{len(out)} completions, {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} completion tokens/s")

    profile = cProfile.Profile()
    profile.runcall(rollouts.sample, prompts, args.group, settings, 2)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())


def _prompt_ids(tokenizer, i: int) -> list[int]:
    question = f"What is {i} + {i + 3}? Answer with only the number."
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


if __name__ == "__main__":
    main()
