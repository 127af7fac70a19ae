"""Per-sample attention of packed rows, forward + backward of one layer: flash (torch's CPU SDPA
kernel, key/value heads repeated) against kubetune's grouped kernel (the query heads of each
key/value head stacked into the rows of batched matmuls, in blocks of query positions;
kubetune.models.attention). SmolLM2-135M's heads (9 query, 3 key/value, 64 dims), fp32, one
thread (what each of the training's single-thread processes runs).

Rows: sets of sample lengths, from short samples to one of 500 tokens, then the first rows of
the bench recipe's data (`bench/train/train_vs_hf.py`'s 160 rows of medical_flashcards, packed
to 512 tokens as `kubetune train` packs them). Each arm warmed, then interleaved rounds, medians.

    .venv/bin/python bench/experiments/grouped_attention.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kubetune.models.attention import GROUPED_MAX_TOKENS, per_sample_attention

HEADS, KV_HEADS, DIM = 9, 3, 64
SYNTHETIC = (
    [60, 70, 50, 80, 90, 100, 50],
    [130, 120, 140, 122],
    [200, 180, 130],
    [230, 250],
    [256, 256],
    [500],
)


def data_rows(count: int) -> list[list[int]]:
    """The sample lengths of the first `count` packed rows of the bench recipe's data."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
    from train_vs_hf import SHARED, load_rows, tokenized

    from kubetune.data import Batcher
    from kubetune.models.attention import seqlens_from_cu
    from kubetune.models.load import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    data = tokenized(load_rows(160, SHARED / "train.jsonl"), tokenizer)
    batcher = Batcher(data, max_seq_len=512, micro_batch_size=1, packing=True, seed=42, pad_id=0)
    return [seqlens_from_cu(batcher.collate([row]).cu_seqlens) for row in batcher.epoch_rows(0)[:count]]


def one_layer(lengths: list[int], grouped_up_to: int):
    t = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, t, DIM, generator=g, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, t, DIM, generator=g, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, t, HEADS, DIM, generator=g)

    def run() -> None:
        per_sample_attention(q, k, v, lengths, None, 0.0, True, grouped_up_to=grouped_up_to).backward(grad)

    return run


def compare(lengths: list[int], rounds: int, calls: int = 4) -> tuple[float, float]:
    arms = {"flash": one_layer(lengths, 0), "grouped": one_layer(lengths, GROUPED_MAX_TOKENS)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for run in arms.values():
        run(), run()
    for r in range(rounds):
        for name in arms if r % 2 == 0 else reversed(arms):
            t = time.perf_counter()
            for _ in range(calls):
                arms[name]()
            times[name].append((time.perf_counter() - t) / calls * 1e3)
    return statistics.median(times["flash"]), statistics.median(times["grouped"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--data-rows", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"one layer, forward + backward, fp32, 1 thread, medians of {args.rounds} interleaved rounds")
    print(f"{'samples in the row':44s} {'flash ms':>9s} {'grouped ms':>10s} {'ratio':>6s}")
    totals = [0.0, 0.0]
    for label, rows in (("synthetic", list(SYNTHETIC)), ("bench data", data_rows(args.data_rows))):
        for lengths in rows:
            flash, grouped = compare(lengths, args.rounds)
            if label == "bench data":
                totals[0] += flash
                totals[1] += grouped
            print(f"{label + ' ' + str(lengths):44s} {flash:9.2f} {grouped:10.2f} {grouped / flash:6.2f}")
    flash, grouped = totals
    print(f"bench data rows together: flash {flash:.1f} ms, grouped {grouped:.1f} ms: {grouped / flash:.2f}")


if __name__ == "__main__":
    main()
