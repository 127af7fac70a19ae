"""Turn a loaded causal LM into the thing we train: LoRA or full, precision, checkpointing,
and the loss that only looks at target positions."""

from __future__ import annotations

import math
import os
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from kubetune.errors import ModelError
from kubetune.fsutil import cache_root
from kubetune.models.attention import SEQLENS_KWARG, seqlens_from_cu
from kubetune.recipe.schema import Recipe


def linear_module_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def apply_lora(model, recipe: Recipe):
    from peft import LoraConfig, get_peft_model

    lora = recipe.lora
    targets = lora.target_modules
    if targets != "all-linear":
        available = linear_module_names(model) - {"lm_head"}
        missing = [t for t in targets if t not in available]
        if missing:
            raise ModelError(
                f"lora.target_modules: {', '.join(missing)} not in this model; its linear modules are "
                f"{', '.join(sorted(available))} (or use all-linear)"
            )
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=targets, task_type="CAUSAL_LM", bias="none")
    model = get_peft_model(model, config)
    # PEFT draws each lora_A from the global generator in module order, so a pipeline stage
    # that holds layers 15-29 would draw what layer 0 gets in one process. Draw each from a
    # generator seeded by (seed, parameter name) instead: the same init in every layout.
    for name, p in model.named_parameters():
        if ".lora_A." in name:
            g = torch.Generator().manual_seed(recipe.train.seed * 1_000_003 + zlib.crc32(name.encode()))
            nn.init.kaiming_uniform_(p.data, a=math.sqrt(5), generator=g)  # PEFT's own init, reseeded
    # Frozen base weights may be bf16; the adapters train in fp32 (their optimizer state too).
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if recipe.train.precision != "fp32":
        # Under autocast the adapter matmuls run in half precision anyway; PEFT's default
        # cast of every LoRA input to fp32 costs a full activation copy per adapted module.
        for m in model.modules():
            if hasattr(m, "cast_input_dtype_enabled"):
                m.cast_input_dtype_enabled = False
    return model


def prepare_for_training(model, recipe: Recipe):
    if recipe.finetune.method == "lora":
        model = apply_lora(model, recipe)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
        # tied embeddings stay tied; the trainable copy is the same tensor
    if recipe.train.gradient_checkpointing == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recipe.train.compile:
        # A tensor-parallel MLP runs DTensor hooks that the compiled region's backward does
        # not survive (recursion in autograd): compile only the norms then.
        compile_regions(model, mlp=recipe.parallel.tp == 1)
    return model


def compile_regions(model, mlp: bool = True) -> None:
    """Regional torch.compile: each decoder layer's MLP and norms.

    The attention runs a Python loop over packed samples whose count changes every batch;
    compiling the whole model would recompile on every batch. The MLP and norms have
    static structure, hold most of the elementwise work (SiLU*up, RMSNorm, casts), and one
    compiled graph serves all layers. The inductor cache persists in the kubetune cache.
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    decoder = causal_lm(model).model
    for layer in decoder.layers:
        if mlp:
            layer.mlp.compile(dynamic=True)
        layer.input_layernorm.compile(dynamic=True)
        layer.post_attention_layernorm.compile(dynamic=True)


def causal_lm(model):
    """The transformers *ForCausalLM inside TargetLoss / PEFT / DDP / compile wrappers."""
    m = model
    while True:
        if isinstance(m, TargetLoss):
            m = m.model
        elif hasattr(m, "module") and isinstance(m.module, nn.Module):  # DDP
            m = m.module
        elif hasattr(m, "get_base_model"):  # PEFT
            m = m.get_base_model()
        elif hasattr(m, "_orig_mod"):
            m = m._orig_mod
        else:
            return m


class TargetLoss(nn.Module):
    """Summed next-token cross-entropy over target positions only.

    The LM head (49k x 576 for SmolLM2) is applied to the hidden states of target positions
    only: prompt tokens never need logits, which saves about half of the head's work and
    memory. Returns the sum (not the mean) so the loop can normalise by the number of
    target tokens across micro-batches and ranks.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model  # keeps PEFT's module tree (and its state-dict names)

    def forward(self, input_ids, position_ids, targets, cu_seqlens=None):
        lm = causal_lm(self.model)
        kwargs = {}
        if cu_seqlens is not None:  # packed rows: per-sample attention
            kwargs[SEQLENS_KWARG] = seqlens_from_cu(cu_seqlens)
        hidden = lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).last_hidden_state
        mask = targets != -100
        logits = lm.lm_head(hidden[mask]).float()
        return F.cross_entropy(logits, targets[mask], reduction="sum")
