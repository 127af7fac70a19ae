"""Serving: `kubetune serve` (OpenAI-compatible API, continuous batching, many LoRA adapters).

`contract` is pure (no torch) and shared with the cluster renderer (`k8s render-serve`);
the engine and the HTTP app import torch/transformers and FastAPI.
"""
