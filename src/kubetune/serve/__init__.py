"""Serving: `kubetune serve` (OpenAI-compatible API, continuous batching, many LoRA adapters).

What the server promises the cluster renderer (`k8s render-serve`) is `kubetune.contracts.serving`;
the engine and the HTTP app import torch/transformers and FastAPI.
"""
