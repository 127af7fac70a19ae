"""How a step's packed rows are shaped, from the data alone (no model): the padding a micro-batch
gets when its rows are padded to the longest (what a CPU's flat micro-batches remove), and how
unevenly two data-parallel ranks' shares of a step cost, split by position (the batcher's), by
tokens, or by a cost that also counts the LM head on the target tokens.

    .venv/bin/python bench/experiments/step_rows.py                 # the shipped recipe's sample
    .venv/bin/python bench/experiments/step_rows.py --bench 160     # train_vs_hf.py's rows

The cost model weighs SmolLM2-135M: per token its decoder's forward and input-gradient passes
(~425 MFLOP), per target token its head's (~170 MFLOP).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

DECODER_MFLOP, HEAD_MFLOP = 425, 170


def padding_share(tokens: np.ndarray, micro: int) -> float:
    n = len(tokens) // micro * micro
    t = tokens[:n].reshape(-1, micro)
    return float((t.max(1) * micro - t.sum(1)).sum() / t.sum())


def split_excess(cost: np.ndarray, key: np.ndarray | None, micro: int) -> float:
    """Over the perfect split, the share a step waits for its slower rank (2 ranks, `micro` rows
    each). key None: rank r takes the step's rows r, r+2, ... (the batcher's deal); else the rows
    go largest `key` first, in snake order (0, 1, 1, 0, 0, 1, ...)."""
    per_step, slow, ideal = 2 * micro, 0.0, 0.0
    for s in range(len(cost) // per_step):
        window = np.arange(s * per_step, (s + 1) * per_step)
        order = window if key is None else window[np.argsort(-key[window], kind="stable")]
        ranks = [0.0, 0.0]
        for i, row in enumerate(order):
            snake = i % 2 if (i // 2) % 2 == 0 else 1 - i % 2
            ranks[i % 2 if key is None else snake] += cost[row]
        slow += max(ranks)
        ideal += sum(ranks) / 2
    return slow / ideal - 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", type=int, metavar="ROWS", help="train_vs_hf.py's recipe with this many rows")
    p.add_argument("--micro", type=int, default=2, help="rows per rank per step for the split")
    args = p.parse_args()
    from kubetune.data import Batcher, prepare_data
    from kubetune.models.load import load_tokenizer, resolve_model
    from kubetune.recipe import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        if args.bench:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
            import train_vs_hf

            bench_args = argparse.Namespace(rows=args.bench, eval_rows=8, kt_extra="")
            overrides = train_vs_hf.kubetune_overrides(bench_args, "fp32", tmp, 1, args.micro)
        else:
            overrides = [f"data.cache_dir={tmp}"]
        recipe = load_recipe(None, overrides).recipe
        tokenizer = load_tokenizer(str(resolve_model(recipe.model.name_or_path)))
        data = prepare_data(recipe, tokenizer).train
    batcher = Batcher(data, max_seq_len=recipe.data.max_seq_len, micro_batch_size=1, packing=True,
                      seed=recipe.train.seed, pad_id=0)  # fmt: skip
    rows = batcher.epoch_rows(0)
    tokens = np.array([sum(int(data.lengths[i]) for i in row) for row in rows])
    targets = np.array([sum(int(np.sum(data.sample(i)[1][1:])) for i in row) for row in rows])
    print(f"{len(rows)} rows; tokens mean {tokens.mean():.0f} (min {tokens.min()}, max {tokens.max()}); "
          f"targets mean {targets.mean():.0f}")  # fmt: skip
    for micro in (2, 4):
        print(
            f"padding, rows padded to the longest of {micro}: {100 * padding_share(tokens, micro):.2f}% of real tokens"
        )
    cost = tokens * DECODER_MFLOP + targets * HEAD_MFLOP
    for name, key in (("by position", None), ("by tokens", tokens), ("by tokens + head", cost)):
        print(
            f"2 ranks x {args.micro} rows, split {name}: slower rank +{100 * split_excess(cost, key, args.micro):.2f}%"
        )


if __name__ == "__main__":
    main()
