"""Packed-row attention on a GPU: kubetune's per-sample loop (its CPU path) vs one masked SDPA
call over whole rows (its CUDA path) vs flash-attention's varlen kernel (torch.nn.attention.varlen,
where this torch has it), forward + backward of one layer, side by side in one run.

TinyLlama-1.1B's attention shapes (32 query heads, 4 key/value heads, head_dim 64), 8 rows of
512 tokens packed with samples of the medical flashcards' lengths (40 to 250 tokens), bf16.
Each candidate is warmed, then the candidates are timed in interleaved rounds with CUDA
events; the medians are printed with their ratio to the per-sample loop.

    python bench/train/attention_gpu.py            # on a machine with a CUDA GPU; seconds
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kubetune.models.attention import expand_kv_heads, fused_packed_attention, per_sample_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 64


def packed_lengths(rows: int, seq: int, seed: int = 0) -> list[int]:
    """Sample lengths that fill `rows` rows of `seq` tokens (the last segment of a row takes the rest)."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(rows):
        left = seq
        while left > 0:
            n = min(left, rng.randint(40, 250))
            lengths.append(n)
            left -= n
    return lengths


def varlen_call() -> Callable | None:
    """torch's flash varlen attention, causal, as this torch release spells it; None if absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else None

    def run(q, k, v, lengths):
        b, h, t, d = q.shape
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
        if gqa is None:
            k, v = expand_kv_heads(k, v, h)
        flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (q, k, v)]
        out = varlen_attn(*flat, cu, cu, max(lengths), max(lengths), **causal, **(gqa or {}))
        return out.view(b, t, h, d)

    return run


def candidates(device: str) -> dict[str, Callable]:
    found = {
        "per-sample loop": lambda q, k, v, n: per_sample_attention(q, k, v, n, None, 0.0, upcast=False),
        "one masked call": lambda q, k, v, n: fused_packed_attention(q, k, v, n, None, 0.0, kernel=None),
        "causal SDPA, no packing mask (floor)": lambda q, k, v, n: F.scaled_dot_product_attention(
            q, *expand_kv_heads(k, v, HEADS), is_causal=True
        ).transpose(1, 2),
    }
    varlen = varlen_call() if device == "cuda" else None  # flash kernels are CUDA's alone
    if varlen is not None:
        found["flash varlen"] = varlen
    return found


def timed(fn: Callable, inputs: tuple, lengths: list[int]) -> float:
    """Milliseconds of one forward + backward (CUDA events on a GPU, the wall clock elsewhere)."""
    if inputs[0].device.type != "cuda":
        t = time.perf_counter()
        fn(*inputs, lengths).float().square().mean().backward()
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn(*inputs, lengths)
    out.float().square().mean().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = p.parse_args()
    lengths = packed_lengths(args.rows, args.seq)
    g = torch.Generator(device=args.device).manual_seed(0)

    def rand(h: int) -> torch.Tensor:
        x = torch.randn(args.rows, h, args.seq, HEAD_DIM, device=args.device, generator=g, dtype=torch.bfloat16)
        return x.requires_grad_()

    inputs = (rand(HEADS), rand(KV_HEADS), rand(KV_HEADS))
    fns = candidates(args.device)
    reference = fns["per-sample loop"](*inputs, lengths).float()
    for name, fn in list(fns.items()):
        try:
            err = (fn(*inputs, lengths).float() - reference).abs().max().item()
            for _ in range(3):
                timed(fn, inputs, lengths)
        except (RuntimeError, TypeError, NotImplementedError) as e:  # a kernel this torch or GPU lacks
            print(f"{name}: cannot run here ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            del fns[name]
            continue
        if "floor" not in name:
            print(f"{name}: max |difference| to the per-sample loop {err:.3g}")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):  # interleaved: a slow moment costs every candidate alike
        for name, fn in fns.items():
            times[name].append(timed(fn, inputs, lengths))
    base = statistics.median(times["per-sample loop"])
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{where}, torch {torch.__version__}: {len(lengths)} samples in {args.rows} x {args.seq}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:38s} {med:8.3f} ms fwd+bwd per layer   x{base / med:5.2f} vs the per-sample loop")


if __name__ == "__main__":
    main()
