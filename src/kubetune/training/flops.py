"""Model FLOPs per trained token and the device's peak: the two halves of MFU.

MFU (model FLOPs utilisation) = useful model FLOPs per second / the device's peak. Useful
FLOPs count the matmuls the model needs, not what an implementation spends: a trained
token costs 2N FLOPs forward (N = matmul weights, the LM head included) and 2N backward to
the activations; weights that train add 2 per parameter for their own gradient. Attention
scores are left out (small at these lengths), as PaLM's and most trainers' MFU do.
"""

from __future__ import annotations

import time
from typing import Any

import torch

# Dense bf16 peaks from vendors' data sheets, FLOP/s per device (matched in the device name).
ACCELERATOR_PEAKS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "Gaudi3": 1835e12,  # Intel Gaudi 3 (HL-325)
    "HL-325": 1835e12,
    "Gaudi2": 432e12,
    "HL-225": 432e12,
}


def flops_per_token(config: Any, method: str, trainable_params: int) -> float:
    """Useful FLOPs of one trained token of a decoder with this transformers config."""
    h, layers = config.hidden_size, config.num_hidden_layers
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv_dim = kv * (getattr(config, "head_dim", None) or h // config.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * config.intermediate_size
    matmul_weights = layers * per_layer + h * config.vocab_size
    if method == "full":
        return 6.0 * matmul_weights
    return 4.0 * matmul_weights + 6.0 * trainable_params


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s of one device for `dtype` and how it was found: the data-sheet table for
    accelerators, a short measurement on CPUs (a square matmul on this process's threads, the
    best of a few, about 0.1-0.5 s), since CPU peaks vary by model, ISA and core count."""
    if device.type in ("cuda", "hpu"):
        name = _device_name(device)
        for key, peak in ACCELERATOR_PEAKS.items():
            if key.lower() in name.lower():
                return peak, f"{name}, data sheet"
        return 0.0, f"{name}: no peak in kubetune's table"
    return _measured_cpu_peak(dtype), f"CPU, measured {dtype} matmul"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        import habana_frameworks.torch.hpu as hthpu

        return str(hthpu.get_device_name())
    except (ImportError, AttributeError):
        return "Gaudi"


def _measured_cpu_peak(dtype: torch.dtype, n: int = 1024, budget_s: float = 0.5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # first call: oneDNN's kernel choice and page faults
    best, spent = float("inf"), 0.0
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        took = time.perf_counter() - t
        best, spent = min(best, took), spent + took
        if spent > budget_s:
            break
    return 2 * n**3 / best
