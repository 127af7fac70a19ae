"""The tiny randomly initialised models the tests train, export and serve: one builder, with the
suite's tiny Llama as its default and the variants a test needs as overrides of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The suite's tiny Llama (2 layers x 32 dims, 4 heads, 2 key/value heads, tied embeddings): it
# trains in milliseconds; a test that needs other shapes overrides these fields.
TINY_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}


def tiny_config(tokenizer=None, arch: str = "llama", **overrides: Any):
    """TINY_LLAMA's config for `arch` (a transformers model type), sized to `tokenizer`'s
    vocabulary with its special tokens where one is given."""
    from transformers import AutoConfig

    tokens = {}
    if tokenizer is not None:
        tokens = {
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    return AutoConfig.for_model(arch, **{**TINY_LLAMA, **tokens, **overrides})


def tiny_model(tokenizer=None, arch: str = "llama", seed: int = 0, **overrides: Any):
    """A randomly initialised model of `tiny_config`, the same weights for the same seed."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(tokenizer, arch, **overrides))
    model.config.architectures = [type(model).__name__]
    return model


def save_tiny_model(out: Path, tokenizer=None, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """`tiny_model` saved as a model directory at `out`, with `tokenizer` beside it where given."""
    tiny_model(tokenizer, arch, seed, **overrides).save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


OWN_CONFIG_CODE = """from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "{model_type}"
"""
OWN_MODEL_CODE = """from transformers import LlamaForCausalLM

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


def give_own_code(model_dir: Path, model_type: str) -> Path:
    """Make a saved tiny Llama a model with its own code: a model type transformers does not
    know, whose config and model classes are the directory's .py files (`auto_map`), so that it
    loads only with trust_remote_code."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        model_type=model_type,
        architectures=["TinyRemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyRemoteConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM",
        },
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "configuration_tiny.py").write_text(OWN_CONFIG_CODE.format(model_type=model_type))
    (model_dir / "modeling_tiny.py").write_text(OWN_MODEL_CODE)
    return model_dir


def loss_and_grads(model, **inputs):
    """One forward and backward of `model` on `inputs` (with labels): the loss and every
    parameter's gradient, for comparing two implementations of the same step."""
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same_step(first, second, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """Two `loss_and_grads` results agree: the loss, and every gradient to the tolerance."""
    import torch

    torch.testing.assert_close(second[0], first[0])
    for a, b in zip(first[1], second[1], strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
