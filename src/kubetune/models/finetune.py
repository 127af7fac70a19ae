"""Turn a loaded causal LM into the thing we train: LoRA or full, precision, checkpointing,
and the loss that only looks at target positions."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from kubetune.data.packing import IGNORE
from kubetune.errors import ModelError
from kubetune.models.attention import PREFIXES_KWARG, SEQLENS_KWARG, seqlens_from_cu
from kubetune.models.attention import register as register_attention
from kubetune.models.dropout import use_fast_dropout
from kubetune.models.fused_norm import use_fused_norms
from kubetune.models.lm_loss import sample_logprobs, target_cross_entropy
from kubetune.models.load import DTYPES, load_causal_lm, load_causal_lm_stage
from kubetune.models.stages import Stage, decoder_layers
from kubetune.recipe.schema import RECOMPUTES, Recipe


@dataclass(frozen=True)
class ModelParts:
    """Every handle on one built model, taken once, so that each consumer is handed the one
    it needs instead of unwrapping: the optimizer and export take `model`, generation and
    the config `lm`, training and checkpoints `loss` (its state-dict names are the
    checkpoint's), parallel wrappers `layers`."""

    model: nn.Module  # the PEFT model (LoRA) or the *ForCausalLM itself (full)
    lm: Any  # the transformers *ForCausalLM inside; under a pipeline, this rank's stage of it
    loss: TargetLoss

    @classmethod
    def of(cls, model: nn.Module, lm: Any | None = None) -> ModelParts:
        """`lm` defaults to the base model of a PEFT model, else `model` itself."""
        if lm is None:
            base_of = getattr(model, "get_base_model", None)
            lm = base_of() if base_of is not None else model
        return cls(model=model, lm=lm, loss=TargetLoss(model, lm))

    @property
    def layers(self) -> list[nn.Module]:
        return decoder_layers(self.lm)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def build_model(
    recipe: Recipe, source: str, device: torch.device, stage: Stage | None = None, grouped_up_to: int = 0
) -> ModelParts:
    """The model to train, on `device`: the whole model, or only `stage` of it. The recipe's
    `auto` kernel choices must be resolved (Recipe.with_kernels) before; samples of at most
    `grouped_up_to` tokens take the grouped attention kernel (KernelPlan.grouped_up_to)."""
    attn: str = recipe.model.attn_implementation
    if attn == "sdpa":  # kubetune's per-sample attention for packed rows (stock SDPA otherwise)
        kind = "native" if recipe.model.packed_attention == "native" else "fp32"
        attn = register_attention(kind, grouped_up_to)
    dtype = DTYPES[recipe.base_dtype_name()]
    revision, remote = recipe.model.revision, recipe.model.trust_remote_code
    if stage is not None and stage.count > 1:
        lm = load_causal_lm_stage(source, dtype, attn, stage, revision, remote)
    else:
        lm = load_causal_lm(source, dtype, attn, revision, remote)
    model = prepare_for_training(lm, recipe, device.type).to(device)
    return ModelParts.of(model, lm)


def linear_module_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def apply_lora(model: Any, recipe: Recipe) -> Any:
    from peft import LoraConfig, get_peft_model

    from kubetune.models.fused_lora import use_fused_lora

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
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT annotates int; scale = alpha / r takes any number
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        bias="none",
    )
    model = get_peft_model(model, config)
    use_fast_dropout(model)  # the same dropout, a quarter of the random draws (kubetune.models.dropout)
    use_fused_lora(model)  # plain LoRA's forward and backward as one function (kubetune.models.fused_lora)
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


def prepare_for_training(lm: Any, recipe: Recipe, device_type: str = "cpu") -> Any:
    """LoRA adapters (or every weight trainable), fused norms, checkpointing and compiled
    regions on a loaded *ForCausalLM; returns the model to train (the PEFT model for LoRA)."""
    if device_type in FUSED_NORM_DEVICES:
        use_fused_norms(lm)
    if recipe.finetune.method == "lora":
        model = apply_lora(lm, recipe)
    else:
        model = lm
        for p in model.parameters():
            p.requires_grad_(True)  # tied embeddings stay tied: the trainable copy is the same tensor
    if recipe.train.gradient_checkpointing in RECOMPUTES:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recipe.train.compile is True:  # `auto` is decided during training (kubetune.training.auto_compile)
        compile_regions(lm, mlp=compiles_mlp(recipe), backend=COMPILE_BACKENDS.get(device_type, "inductor"))
    return model


def compiles_mlp(recipe: Recipe) -> bool:
    """A tensor-parallel MLP runs DTensor hooks that the compiled region's backward does not
    survive (recursion in autograd): only the norms are compiled then."""
    return recipe.parallel.tp == 1


# where kubetune.models.fused_norm's autograd function runs; Gaudi keeps the model's own norm,
# which Habana's graph compiler fuses
FUSED_NORM_DEVICES = ("cpu", "cuda")

# Gaudi compiles through Habana's own dynamo backend; inductor does not know the device
COMPILE_BACKENDS = {"hpu": "hpu_backend"}


def compile_regions(lm: Any, mlp: bool = True, backend: str = "inductor") -> None:
    """Regional torch.compile: each decoder layer's MLP and norms.

    The attention runs a Python loop over packed samples whose count changes every batch;
    compiling the whole model would recompile on every batch. The MLP and norms have
    static structure, hold most of the elementwise work (SiLU*up, RMSNorm, casts), and one
    compiled graph serves all layers. The CLI points the inductor cache at the kubetune
    cache (kubetune.cli), so that compiled code outlives the process.
    """
    for module in compiled_regions(lm, mlp):
        module.compile(dynamic=True, backend=backend)


def compiled_regions(lm: Any, mlp: bool = True) -> list[nn.Module]:
    """The modules regional compile compiles: each decoder layer's norms, and its MLP."""
    out: list[nn.Module] = []
    for layer in decoder_layers(lm):
        out += [layer.mlp] if mlp else []
        out += [layer.input_layernorm, layer.post_attention_layernorm]
    return out


class TargetLoss(nn.Module):
    """Summed next-token cross-entropy over target positions only.

    The LM head (49k x 576 for SmolLM2) is applied to the hidden states of target positions
    only: prompt tokens never need logits, which saves about half of the head's work and
    memory. Returns the sum (not the mean) so the loop can normalise by the number of
    target tokens across micro-batches and ranks.
    """

    lm: Any  # set in __init__, outside the module registry

    def __init__(self, model: nn.Module, lm: Any):
        super().__init__()
        self.model = model  # keeps PEFT's module tree (and its state-dict names)
        # The *ForCausalLM inside `model`, kept outside nn.Module's registry so that its
        # parameters are not listed (and checkpointed) a second time under another name.
        self.__dict__["lm"] = lm

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        cu_seqlens: list[int] | None = None,
        target_sample: torch.Tensor | None = None,
        n_samples: int = 0,
        temperature: float = 1.0,
        entropy: torch.Tensor | None = None,
        prefixes: list[int] | None = None,
    ) -> torch.Tensor:
        """The summed loss; with `target_sample` (each target position's sample, -1 elsewhere)
        the summed target log-probability of each of the `n_samples` samples instead (the
        preference objectives' input, kubetune.training.preference; GRPO's, one sample per
        token, of the logits divided by `temperature`, with their `entropy` filled in).
        `prefixes` (Batch.prefixes) lets segments continue a shared prompt."""
        lm = self.lm
        kwargs: dict[str, Any] = {}
        if cu_seqlens is not None:  # packed rows: per-sample attention
            kwargs[SEQLENS_KWARG] = seqlens_from_cu(cu_seqlens)
            if prefixes is not None:
                kwargs[PREFIXES_KWARG] = prefixes
        hidden = lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).last_hidden_state
        if target_sample is not None:
            if temperature != 1.0:  # logits / T = (hidden / T) @ W.T: the head stays one chunked pass
                hidden = hidden / temperature
            return head_logps(lm.lm_head, hidden, targets, target_sample, n_samples, entropy=entropy)
        return head_loss(lm.lm_head, hidden, targets)


def head_loss(
    lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, static_shapes: bool | None = None
) -> torch.Tensor:
    """Summed cross-entropy of the target positions (`targets` != -100) through `lm_head`:
    chunked, without the whole logits (kubetune.models.lm_loss), where the head is a plain
    linear layer; through the module otherwise (a head with a bias or a wrapped one).

    Selecting the targets gives a shape that changes with every batch, which an HPU graph
    would recompile for; there (`static_shapes`, default: on HPU) every position goes
    through the head and the ignored ones weigh 0."""
    if static_shapes is None:
        static_shapes = hidden.device.type == "hpu"
    if static_shapes:
        rows, wanted = hidden.flatten(0, -2), targets.flatten()
    else:
        mask = targets != IGNORE
        rows, wanted = hidden[mask], targets[mask]
    ignore = IGNORE if static_shapes else None
    weight = getattr(lm_head, "weight", None)
    if type(lm_head) is nn.Linear and lm_head.bias is None and isinstance(weight, torch.Tensor):
        return target_cross_entropy(rows, weight, wanted, ignore_index=ignore)
    logits = lm_head(rows).float()
    return F.cross_entropy(logits, wanted, ignore_index=IGNORE, reduction="sum")


def head_logps(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    target_sample: torch.Tensor,
    n_samples: int,
    static_shapes: bool | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed target log-probabilities per sample [n_samples] through `lm_head`, the rows
    chosen as `head_loss` chooses them (every position under static shapes, where the rows
    of no sample weigh 0); `entropy`, when given, receives each sample's summed entropy."""
    if static_shapes is None:
        static_shapes = hidden.device.type == "hpu"
    if static_shapes:
        rows, wanted, samples = hidden.flatten(0, -2), targets.flatten(), target_sample.flatten()
    else:
        mask = target_sample >= 0
        rows, wanted, samples = hidden[mask], targets[mask], target_sample[mask]
    weight = getattr(lm_head, "weight", None)
    if type(lm_head) is nn.Linear and lm_head.bias is None and isinstance(weight, torch.Tensor):
        return sample_logprobs(rows, weight, wanted, samples, n_samples, entropy=entropy)
    logits = lm_head(rows).float()
    picked = -F.cross_entropy(logits, wanted.clamp(min=0), reduction="none")
    kept = torch.where(samples >= 0, picked, 0.0)
    if entropy is not None:
        with torch.no_grad():
            h_rows = torch.distributions.Categorical(logits=logits).entropy()
            entropy.index_add_(0, samples.clamp(min=0), torch.where(samples >= 0, h_rows, 0.0))
    return torch.zeros(n_samples, device=rows.device).index_add_(0, samples.clamp(min=0), kept)
