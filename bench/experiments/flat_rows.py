"""What padding a CPU micro-batch's rows to the longest costs: forward + backward of the same
micro-batches of the shipped recipe (SmolLM2-135M, LoRA on all linear layers, fp32), as rows
padded to the longest (CUDA's layout) and as one flat row (the CPU's since `Batcher(flat=True)`),
interleaved micro-batch by micro-batch, medians of the per-round totals. The micro-batches are
spread evenly over the epoch.

    .venv/bin/python bench/experiments/flat_rows.py [--micro 4] [--batches 4] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro", type=int, default=4, help="rows per micro-batch (the shipped recipe's)")
    p.add_argument("--batches", type=int, default=4, help="micro-batches timed per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from kubetune.data import Batcher, prepare_data
    from kubetune.models.finetune import build_model
    from kubetune.models.load import load_tokenizer, resolve_model
    from kubetune.recipe import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(None, [f"data.cache_dir={tmp}", "train.precision=fp32"]).recipe
        recipe = recipe.with_kernels("fp32", "fp32")
        source = str(resolve_model(recipe.model.name_or_path))
        tokenizer = load_tokenizer(source)
        data = prepare_data(recipe, tokenizer)
    parts = build_model(recipe, source, torch.device("cpu"))
    layouts = {
        name: Batcher(
            data.train,
            max_seq_len=recipe.data.max_seq_len,
            micro_batch_size=args.micro,
            packing=True,
            seed=recipe.train.seed,
            pad_id=tokenizer.pad_token_id,
            flat=flat,
        )
        for name, flat in (("padded", False), ("flat", True))
    }
    # micro-batches spread over the epoch: its last rows are the least full, so the first ones
    # alone would understate the padding
    every = max(1, layouts["flat"].micro_batches_left(0) // args.batches)
    starts = [i * every * args.micro for i in range(args.batches)]
    batches = {name: [b.micro_batch(0, start)[0] for start in starts] for name, b in layouts.items()}
    real = sum(b.real_tokens for b in batches["flat"])
    for name, bs in batches.items():
        print(f"{name}: {sum(b.input_ids.numel() for b in bs)} positions for {real} real tokens")
    times: dict[str, list[float]] = {name: [] for name in batches}
    for r in range(args.rounds + 1):  # the first round warms both layouts up and is not counted
        spent = dict.fromkeys(batches, 0.0)
        for i in range(args.batches):
            for name in batches if i % 2 == 0 else reversed(list(batches)):
                b = batches[name][i]
                t = time.perf_counter()
                parts.loss(b.input_ids, b.position_ids, b.targets, b.cu_seqlens).backward()
                spent[name] += time.perf_counter() - t
        if r:
            for name, s in spent.items():
                times[name].append(s)
        parts.model.zero_grad(set_to_none=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, m in med.items():
        rounds = [round(t, 2) for t in times[name]]
        print(f"{name}: median {m:.2f} s per round ({real / m:.1f} real tokens/s), rounds {rounds}")
    print(f"flat / padded time: {med['flat'] / med['padded']:.3f}")


if __name__ == "__main__":
    main()
