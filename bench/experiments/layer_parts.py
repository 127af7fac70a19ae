"""Each part of a SmolLM2 decoder layer alone, forward + backward on one packed row, one thread,
interleaved rounds, medians: the norm, rotary, the MLP's matmuls and its SiLU gate, a
LoRA-adapted q_proj (PEFT's path and kubetune's fused one), per-sample attention and a
residual add. Shows what a step spends outside the matmuls, part by part.

    .venv/bin/python bench/experiments/layer_parts.py [--lengths 130,120,140,122] [--dropout 0.05]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout
from bench.common.timing import time_interleaved

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536


def backward_of(make: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]]) -> Callable[[], None]:
    """Forward, then backward with a ones gradient on every output."""

    def run() -> None:
        out = make()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return run


def lora_arms(tokens: int, dropout: float) -> dict[str, Callable[[], None]]:
    from peft import LoraConfig, get_peft_model

    from kubetune.models.dropout import use_fast_dropout
    from kubetune.models.fused_lora import use_fused_lora

    class Proj(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q_proj(x)

    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["q_proj"])
    peft_model = get_peft_model(Proj(), config).train()
    use_fast_dropout(peft_model)
    fused = copy.deepcopy(peft_model)
    use_fused_lora(fused)
    x = torch.randn(tokens, HIDDEN, requires_grad=True)
    return {
        "q_proj + LoRA, PEFT": backward_of(lambda: peft_model(x)),
        "q_proj + LoRA, fused": backward_of(lambda: fused(x)),
    }


def part_arms(lengths: list[int], dropout: float) -> dict[str, Callable[[], None]]:
    from transformers.models.llama.modeling_llama import (
        LlamaConfig,
        LlamaMLP,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from kubetune.models.attention import per_sample_attention

    t = sum(lengths)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE,
        rope_theta=100000,
    )
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, t, HIDDEN), positions)
    norm, mlp = LlamaRMSNorm(HIDDEN), LlamaMLP(config).requires_grad_(False)

    def grad_input(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, requires_grad=True)

    x, x2 = grad_input(1, t, HIDDEN), grad_input(1, t, HIDDEN)
    q = grad_input(1, HEADS, t, HEAD_DIM)
    k, v = grad_input(1, KV_HEADS, t, HEAD_DIM), grad_input(1, KV_HEADS, t, HEAD_DIM)
    gate, up = grad_input(t, INTERMEDIATE), grad_input(t, INTERMEDIATE)
    return {
        "RMSNorm": backward_of(lambda: norm(x)),
        "rotary (q and k)": backward_of(lambda: apply_rotary_pos_emb(q, k, cos, sin)),
        "MLP (3 matmuls + SiLU gate)": backward_of(lambda: mlp(x)),
        "SiLU gate alone": backward_of(lambda: F.silu(gate) * up),
        "per-sample attention": backward_of(lambda: per_sample_attention(q, k, v, lengths, None, 0.0, False)),
        "residual add": backward_of(lambda: x + x2),
        **lora_arms(t, dropout),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="130,120,140,122", help="the packed samples' lengths in one row")
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args()
    torch.set_num_threads(1)
    lengths = [int(n) for n in args.lengths.split(",")]
    times = time_interleaved(part_arms(lengths, args.dropout), args.rounds)
    print(f"one row of {sum(lengths)} tokens ({args.lengths}), forward + backward, one thread, medians:")
    for name, ts in times.items():
        print(f"  {name:30} {statistics.median(ts) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
