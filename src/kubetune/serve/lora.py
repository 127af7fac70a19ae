"""Many LoRA adapters over one base model, in one batch.

PEFT reads each adapter (its file format, key names and scaling), then its layers are
unloaded and every targeted linear layer becomes a `MultiLoraLinear` holding all adapters
side by side: A concatenated to [sum of ranks, in], B (times the adapter's scaling) to
[out, sum of ranks]. A forward whose tokens use different adapters then costs two small
matmuls and one mask per layer, whatever the number of adapters (the idea of Punica /
S-LoRA's batched kernels), instead of one sub-batch per adapter as PEFT's mixed-batch
forward does. Tokens of the base model get a zero mask; a batch of base tokens only skips
the adapters altogether.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kubetune.errors import ModelError

BASE = -1  # the adapter index of a row that uses the base model


@dataclass
class LoraBatch:
    """The adapter of each token of the current forward, shared by every MultiLoraLinear."""

    tokens: torch.Tensor | None = None  # [tokens] adapter index per token, BASE for the base model
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def set(self, adapters: list[int]) -> None:
        self.tokens = None if all(a == BASE for a in adapters) else torch.tensor(adapters)
        self._masks.clear()

    def mask(self, layer: MultiLoraLinear, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, sum of ranks]: 1 where the column belongs to the token's adapter. Layers
        with the same adapters share one mask per step."""
        key = layer.layout_key
        if key not in self._masks:
            assert self.tokens is not None
            self._masks[key] = (self.tokens[:, None] == layer.column_owner).to(dtype)
        return self._masks[key]


class MultiLoraLinear(nn.Module):
    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [out, sum of ranks], scaled
    column_owner: torch.Tensor  # [sum of ranks]: the adapter index of each column

    def __init__(self, base: nn.Linear, batch: LoraBatch, layout_key: int) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.layout_key = layout_key
        self.register_buffer("a", torch.empty(0, base.in_features, dtype=base.weight.dtype), persistent=False)
        self.register_buffer("b", torch.empty(base.out_features, 0, dtype=base.weight.dtype), persistent=False)
        self.register_buffer("column_owner", torch.empty(0, dtype=torch.long), persistent=False)

    def add(self, index: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        dtype = self.base.weight.dtype
        self.a = torch.cat([self.a, a.to(dtype)])
        self.b = torch.cat([self.b, (b.float() * scaling).to(dtype)], dim=1)
        self.column_owner = torch.cat([self.column_owner, torch.full((a.shape[0],), index)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.tokens is None or not len(self.column_owner):
            return y
        h = nn.functional.linear(x, self.a) * self.batch.mask(self, x.dtype)
        return y + nn.functional.linear(h, self.b)


@dataclass(frozen=True)
class AdapterWeights:
    name: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module path -> (A, B, scaling)
    rank: int


def read_adapters(base: Any, adapters: list[tuple[str, str]]) -> list[AdapterWeights]:
    """Each (name, PEFT adapter dir) read through PEFT onto `base`; `base` is left as it was."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not adapters:
        return []
    first_name, first_path = adapters[0]
    peft_model = PeftModel.from_pretrained(base, first_path, adapter_name=first_name)
    for name, path in adapters[1:]:
        peft_model.load_adapter(path, adapter_name=name)
    found: list[AdapterWeights] = []
    for name, path in adapters:
        config: Any = peft_model.peft_config[name]
        if getattr(config, "use_dora", False):
            raise ModelError(
                f"adapter {name} ({path}): DoRA adapters cannot be served; merge it (kubetune export --merged)"
            )
        layers = {}
        inner: Any = peft_model.base_model.model
        for module_path, module in inner.named_modules():
            if isinstance(module, LoraLayer) and name in module.lora_A:
                lora: Any = module
                a, b = lora.lora_A[name].weight.detach(), lora.lora_B[name].weight.detach()
                layers[module_path] = (a.clone(), b.clone(), float(lora.scaling[name]))
        found.append(AdapterWeights(name, layers, int(config.r)))
    peft_model.unload()  # the base's own Linear layers back in place, unmerged
    return found


def install(model: nn.Module, adapters: list[AdapterWeights]) -> LoraBatch:
    """Replace every targeted Linear of `model` with a MultiLoraLinear holding `adapters`
    (adapter index i = position in the list)."""
    batch = LoraBatch()
    wrapped: dict[str, MultiLoraLinear] = {}
    layouts: dict[tuple[int, ...], int] = {}
    targets = sorted({path for adapter in adapters for path in adapter.layers})
    for path in targets:
        users = tuple(i for i, adapter in enumerate(adapters) if path in adapter.layers)
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = MultiLoraLinear(getattr(parent, child), batch, layouts.setdefault(users, len(layouts)))
        for i in users:
            layer.add(i, *adapters[i].layers[path])
        setattr(parent, child, layer)
        wrapped[path] = layer
    return batch
