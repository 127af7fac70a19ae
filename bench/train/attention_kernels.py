"""Packed-row attention kernels, side by side: block-diagonal mask (what transformers does
for packed position_ids) vs kubetune's per-sample causal SDPA. Forward + backward of one
layer's attention for 4 rows x 512 tokens of random-length samples (SmolLM2 shapes).

    .venv/bin/python bench/train/attention_kernels.py
"""

import itertools
import time

import numpy as np
import torch
import torch.nn.functional as F

from kubetune.models.attention import packed_attention_forward, seqlens_from_cu

B, T, H, KV, D = 4, 512, 9, 3, 64


class _Layer:
    training = True


def main() -> None:
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    cu = [0]
    for r in range(B):
        cur = 0
        while (n := int(rng.integers(40, 200))) + cur <= T:
            cur += n
            cu.append(r * T + cur)
        cu.append((r + 1) * T)
    seg = torch.zeros(B * T, dtype=torch.long)
    for i, (s, e) in enumerate(itertools.pairwise(cu)):
        seg[s:e] = i
    seg = seg.view(B, T)
    mask = (seg[:, :, None] == seg[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    lengths = seqlens_from_cu(cu)

    def masked(q, k, v):
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask[:, None]
        ).transpose(1, 2)

    def per_sample(q, k, v):
        return packed_attention_forward(_Layer(), q, k, v, None, kubetune_seqlens=lengths)[0]

    q = torch.randn(B, H, T, D, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, T, D, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, T, D, dtype=torch.bfloat16, requires_grad=True)
    diff = (per_sample(q, k, v).float() - masked(q, k, v).float()).abs().max().item()
    times = {"block-diagonal mask (bf16)": [], "kubetune per-sample causal": []}
    for _ in range(5):  # interleaved repeats, min taken: robust to a noisy neighbour
        for name, fn in zip(times, (masked, per_sample)):
            t = time.perf_counter()
            for _ in range(3):
                fn(q, k, v).float().sum().backward()
            times[name].append((time.perf_counter() - t) / 3 * 1000)
    base = min(times["block-diagonal mask (bf16)"])
    print(f"{len(lengths)} segments in {B}x{T} tokens; max |difference| {diff:.4f}")
    for name, ts in times.items():
        print(f"{name:30s} {min(ts):7.1f} ms/layer (fwd+bwd)   speed-up x{base / min(ts):.2f}")


if __name__ == "__main__":
    main()
