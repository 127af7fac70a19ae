"""Packed-row attention alternatives, forward + backward of one layer (2 rows x 512 tokens,
SmolLM2 shapes): kubetune's per-sample fp32 flash SDPA, samples padded into one call
(fp32/bf16), nested jagged tensors (one SDPA call over all samples), per-sample math
attention in the inputs' dtype, flex_attention with a document mask; then the cost of one LoRA
dropout mask.
`--dtype` is the training dtype the inputs arrive in (fp32 where the CPU has no bf16 units).

    .venv/bin/python bench/experiments/attention_alternatives.py [--dtype bf16|fp32]
"""

import argparse
import itertools
import time

import numpy as np
import torch
import torch.nn.functional as F

from kubetune.models.attention import packed_attention_forward, seqlens_from_cu

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}[ap.parse_args().dtype]
torch.set_num_threads(2)
B, T, H, KV, D = 2, 512, 9, 3, 64
rng = np.random.default_rng(0)
cu = [0]
for r in range(B):
    cur = 0
    while (n := int(rng.integers(40, 200))) + cur <= T:
        cur += n
        cu.append(r * T + cur)
    cu.append((r + 1) * T)
lengths = seqlens_from_cu(cu)


class L:
    training = True


def per_sample(q, k, v):
    return packed_attention_forward(L(), q, k, v, None, kubetune_seqlens=lengths)[0]


# padded: gather samples into [S,H,Lmax,D]
def padded(q, k, v, dtype=torch.float32):
    b, h, t, d = q.shape
    k = k.repeat_interleave(h // k.shape[1], 1)
    v = v.repeat_interleave(h // v.shape[1], 1)
    Lm = max(lengths)
    S = len(lengths)
    idx = torch.full((S, Lm), b * t, dtype=torch.long)  # points at a zero row
    st = 0
    for i, n in enumerate(lengths):
        idx[i, :n] = torch.arange(st, st + n)
        st += n

    def g(x):
        flat = x.transpose(1, 2).reshape(b * t, h, d).to(dtype)
        flat = torch.cat([flat, flat.new_zeros(1, h, d)])
        return flat[idx].transpose(1, 2)  # S,H,Lm,D

    o = F.scaled_dot_product_attention(g(q), g(k), g(v), is_causal=True)  # S,H,Lm,D
    o = o.transpose(1, 2).reshape(S * Lm, h, d)
    valid = idx.reshape(-1) < b * t
    out = o[valid]
    return out.reshape(b, t, h, d).to(q.dtype)


def nested(q, k, v, dtype=torch.float32):
    """All samples in one SDPA call as a nested jagged tensor [samples, heads, (length), dim]."""
    b, h, t, d = q.shape
    offsets = torch.tensor(cu, dtype=torch.long)

    def nj(x):
        x = x.repeat_interleave(h // x.shape[1], 1)  # GQA: every query head its K/V
        values = x.transpose(1, 2).reshape(b * t, h, d).to(dtype)
        return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)

    o = F.scaled_dot_product_attention(nj(q), nj(k), nj(v), is_causal=True)
    return o.transpose(1, 2).values().reshape(b, t, h, d).to(q.dtype)


# math attention per sample with bmm (softmax in fp32)
def per_sample_math(q, k, v):
    b, h, t, d = q.shape
    k = k.repeat_interleave(h // k.shape[1], 1)
    v = v.repeat_interleave(h // v.shape[1], 1)

    def segs(x):
        return x.transpose(1, 2).reshape(b * t, h, d).split(lengths)

    outs = []
    for qi, ki, vi in zip(segs(q), segs(k), segs(v)):
        qi, ki, vi = [x.transpose(0, 1) for x in (qi, ki, vi)]
        n = qi.shape[1]
        s = (qi @ ki.transpose(1, 2)).float() * d**-0.5
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        p = s.softmax(-1).to(vi.dtype)
        outs.append((p @ vi).transpose(0, 1))
    return torch.cat(outs).reshape(b, t, h, d)


fns = {
    "per_sample": per_sample,
    "padded_fp32": padded,
    "padded_bf16": lambda q, k, v: padded(q, k, v, torch.bfloat16),
    "nested_fp32": nested,
    "nested_bf16": lambda q, k, v: nested(q, k, v, torch.bfloat16),
    "math_per_sample": per_sample_math,
}
try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seg = torch.zeros(B * T, dtype=torch.long)
    for i, (s, e) in enumerate(itertools.pairwise(cu)):
        seg[s:e] = i
    seg = seg.view(B, T)

    def mask_mod(b, h, qi, ki):
        return (seg[b, qi] == seg[b, ki]) & (qi >= ki)

    bm = create_block_mask(mask_mod, B, None, T, T, device="cpu")
    cflex = torch.compile(flex_attention)

    def flex(q, k, v):
        return cflex(q, k, v, block_mask=bm, enable_gqa=True).transpose(1, 2)

    fns["flex_bf16"] = flex
except Exception as e:
    print("flex unavailable", e)
q = torch.randn(B, H, T, D, dtype=DTYPE, requires_grad=True)
k = torch.randn(B, KV, T, D, dtype=DTYPE, requires_grad=True)
v = torch.randn(B, KV, T, D, dtype=DTYPE, requires_grad=True)
ref = per_sample(q, k, v).float()
for name, fn in fns.items():
    try:
        o = fn(q, k, v)
        diff = (o.float() - ref).abs().max().item()
        for _ in range(2):
            fn(q, k, v).float().sum().backward()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn(q, k, v).float().sum().backward()
            ts.append((time.perf_counter() - t) * 1000)
        print(f"{name:12s} {min(ts):7.1f} ms  diff {diff:.4f}")
    except Exception as e:
        print(name, "failed", repr(e)[:300])

# Dropout masks (LoRA dropout draws one per adapted module): the CPU generator's rate
x = torch.randn(1024, 576, dtype=torch.bfloat16)


def per_call_ms(f, n=50):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1000


for name, f in (
    ("F.dropout bf16", lambda: F.dropout(x, 0.05, True)),
    ("bernoulli_ bool", lambda: torch.empty(x.shape, dtype=torch.bool).bernoulli_(0.95)),
    ("rand bf16", lambda: torch.rand(x.shape, dtype=torch.bfloat16)),
    ("randint uint8", lambda: torch.randint(0, 256, x.shape, dtype=torch.uint8)),
):
    print(f"mask 1024x576 {name:16s} {per_call_ms(f):6.2f} ms")
