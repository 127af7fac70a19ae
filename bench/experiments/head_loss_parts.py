"""The training LM head's loss and gradient, part by part, at training size: the logits matmul
(whole, in vocabulary slices, against a contiguous transposed copy), the softmax passes
(torch.logsumexp then sub_/exp_, against one in-place pass), the gradient matmul, and a whole
chunk's loss and gradient as 12-03's code computed them against kubetune's vocabulary-sliced
`target_cross_entropy`. One thread, fp32, interleaved rounds, medians. SmolLM2's shapes.

    .venv/bin/python bench/experiments/head_loss_parts.py [--rows 256] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout
from bench.common.timing import time_interleaved

from kubetune.models.lm_loss import VOCAB_SLICE, target_cross_entropy

HIDDEN, VOCAB = 576, 49152


def softmax_in_place(logits: torch.Tensor) -> torch.Tensor:
    top = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(top).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    probs.div_(total)
    return (top + total.log()).squeeze(1)


def chunk_now(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """One chunk's loss and hidden-state gradient as kubetune.models.lm_loss did it (11-30 to 12-03)."""
    logits = h @ w.t()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, t[:, None]).squeeze(1)
    probs = logits.sub_(lse[:, None]).exp_()
    probs[torch.arange(len(t)), t] -= 1.0
    return probs @ w, (lse - picked).sum()


def sliced_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, n: int) -> Callable[[], object]:
    """kubetune's head loss and gradient (kubetune.models.lm_loss), as training calls it."""
    return lambda: target_cross_entropy(h, w, targets, vocab_slice=n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    h, w = torch.randn(args.rows, HIDDEN), torch.randn(VOCAB, HIDDEN) * 0.05
    w_t = w.t().contiguous()
    targets = torch.randint(0, VOCAB, (args.rows,))
    h_grad = h.clone().requires_grad_()  # the training path: the loss computes the gradient as it goes
    logits = h @ w.t()
    buf = torch.empty_like(logits)

    def sliced(size: int) -> Callable[[], object]:
        parts = w.split(size)  # each slice's logits in its own buffer, as a sliced loss would keep them
        outs = [torch.empty(args.rows, len(part)) for part in parts]
        return lambda: [torch.mm(h, part.t(), out=o) for part, o in zip(parts, outs)]

    def two_pass() -> object:
        buf.copy_(logits)
        lse = torch.logsumexp(buf, dim=-1)
        return buf.sub_(lse[:, None]).exp_()

    def one_pass() -> object:
        buf.copy_(logits)
        return softmax_in_place(buf)

    arms: dict[str, Callable[[], object]] = {
        "logits: h @ w.t()": lambda: torch.mm(h, w.t(), out=buf),
        "logits: h @ contiguous w.t()": lambda: torch.mm(h, w_t, out=buf),
        "logits: 4096-column slices": sliced(4096),
        "copy (the softmax arms' reset)": lambda: buf.copy_(logits),
        "softmax: logsumexp, sub_, exp_": two_pass,
        "softmax: amax, sub_, exp_, sum, div_": one_pass,
        "grad: probs @ w": lambda: logits @ w,
        "whole chunk, as 12-03": lambda: chunk_now(h, w, targets),
        **{f"whole chunk, kubetune, {n}-column slices": sliced_loss(h_grad, w, targets, n) for n in (2048, 4096)},
    }
    g0, l0 = chunk_now(h, w, targets)
    l1 = target_cross_entropy(h_grad, w, targets, vocab_slice=VOCAB_SLICE)
    l1.backward()
    assert h_grad.grad is not None
    diff = (h_grad.grad - g0).abs().max().item()
    print(f"kubetune vs whole: loss {l1.item():.6f} vs {l0.item():.6f}, gradient max |diff| {diff:.2e}")
    times = time_interleaved(arms, args.rounds)
    flop = 2 * args.rows * VOCAB * HIDDEN
    print(f"torch {torch.__version__}, 1 thread, fp32, {args.rows} rows x vocab {VOCAB} x hidden {HIDDEN}, medians:")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        rate = f"{flop / median / 1e9:5.1f} GFLOP/s" if name.startswith(("logits", "grad")) else ""
        print(f"  {name:40s} {median * 1e3:7.1f} ms  {rate}")


if __name__ == "__main__":
    main()
