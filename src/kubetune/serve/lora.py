"""Many LoRA adapters over one base model, in one batch.

PEFT reads each adapter (its file format, key names and scaling), then its layers are
unloaded and every targeted linear layer becomes a `MultiLoraLinear` holding all adapters
side by side: A concatenated to [sum of ranks, in], B (times the adapter's scaling) to
[out, sum of ranks]. A forward whose tokens use different adapters then costs two small
matmuls and one mask per layer, whatever the number of adapters (the idea of Punica /
S-LoRA's batched kernels), instead of one sub-batch per adapter as PEFT's mixed-batch
forward does. Tokens of the base model get a zero mask; a batch of base tokens only skips
the adapters altogether.

Layers that read the same tensor (q/k/v of an attention, gate/up of an MLP: vLLM fuses
their base weights for the same reason) share a `LoraGroup`: the first to run multiplies
the input by every member's A at once and masks it once, the others take their columns;
each layer's B rides in its base weight (see MultiLoraLinear). At 16 decode rows these
small ops cost more in per-call overhead than in arithmetic, so fewer calls is what makes a
mixed batch cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kubetune.errors import ModelError

BASE = -1  # the adapter index of a token that uses the base model
# siblings that transformers' decoder layers call on the very same input tensor
SHARED_INPUT = (frozenset({"q_proj", "k_proj", "v_proj"}), frozenset({"gate_proj", "up_proj"}))


@dataclass
class LoraBatch:
    """The adapter of each token of the current forward, shared by every MultiLoraLinear."""

    tokens: torch.Tensor | None = None  # [tokens] adapter index per token, BASE for the base model
    forward: int = 0  # counts forwards, so that groups never reuse an earlier forward's inputs
    _masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # by group columns

    def set(self, adapters: list[int]) -> None:
        self.tokens = None if all(a == BASE for a in adapters) else torch.tensor(adapters)
        self.forward += 1
        self._masks.clear()

    def mask(self, group: LoraGroup, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, columns]: 1 where a column of `group` belongs to the token's adapter. Groups
        with the same columns (the same layer kinds of every decoder layer) share one mask per forward."""
        mask = self._masks.get(group.owners)
        if mask is None:
            assert self.tokens is not None
            mask = self._masks[group.owners] = (self.tokens[:, None] == group.owner_ids).to(dtype)
        return mask


class LoraGroup:
    """The adapters' A of layers that read the same input, as one matrix."""

    def __init__(self, batch: LoraBatch) -> None:
        self.batch = batch
        self.a = torch.empty(0)  # [columns of every member, in]
        self.owners: tuple[int, ...] = ()  # the adapter of each column
        self.owner_ids = torch.empty(0, dtype=torch.long)  # the same, as a tensor
        self._seen: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (forward, input, masked h)

    def join(self, a: torch.Tensor, owners: list[int]) -> slice:
        """Add a member's A (its adapters side by side); returns its columns in the group's h."""
        first = len(self.owners)
        self.a = a if not first else torch.cat([self.a, a])
        self.owners += tuple(owners)
        self.owner_ids = torch.tensor(self.owners)
        return slice(first, len(self.owners))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x @ A.T, masked per token (zeros when no token uses an adapter): computed by the
        first member to run, reused by the rest."""
        seen = self._seen
        if seen is None or seen[0] != self.batch.forward or seen[1] is not x:
            if self.batch.tokens is None:
                h = x.new_zeros(*x.shape[:-1], len(self.owners))
            else:
                h = nn.functional.linear(x, self.a) * self.batch.mask(self, x.dtype)
            seen = self._seen = (self.batch.forward, x, h)
        return seen[2]


class MultiLoraLinear(nn.Module):
    """y = x W.T + h B.T as one matmul, [x | h] @ [W | B].T: the adapters' B rides in the
    base layer's weight along the input axis, so the base GEMM (packed for oneDNN where that
    is faster, see serve.packed) does the adapters' second matmul and the sum too. Measured
    at 16 rows on 576 -> 1536: 295 us against 336 for the base GEMM plus an addmm (base alone
    266). A batch without adapter tokens multiplies zeros for h."""

    def __init__(self, base: nn.Linear, group: LoraGroup, a: torch.Tensor, b: torch.Tensor, owners: list[int]) -> None:
        super().__init__()
        dtype = base.weight.dtype
        self.group = group
        self.columns = group.join(a.to(dtype), owners)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.joint = nn.Linear(base.in_features + b.shape[1], base.out_features, base.bias is not None, dtype=dtype)
        with torch.no_grad():
            self.joint.weight.copy_(torch.cat([base.weight.detach(), b.to(dtype)], dim=1))
            if base.bias is not None:
                self.joint.bias.copy_(base.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.group.hidden(x)[..., self.columns]
        return self.joint(torch.cat([x, h], dim=-1))


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
    (adapter index i = position in the list), siblings that share an input in one group."""
    batch = LoraBatch()
    groups: dict[tuple[str, frozenset[str] | str], LoraGroup] = {}
    for path in sorted({path for adapter in adapters for path in adapter.layers}):
        held = [(i, adapters[i].layers[path]) for i in range(len(adapters)) if path in adapters[i].layers]
        parent_path, _, child = path.rpartition(".")
        family = next((f for f in SHARED_INPUT if child in f), child)
        group = groups.setdefault((parent_path, family), LoraGroup(batch))
        a = torch.cat([a for _, (a, _, _) in held])
        b = torch.cat([b.float() * scaling for _, (_, b, scaling) in held], dim=1)
        owners = [i for i, (a, _, _) in held for _ in range(a.shape[0])]
        parent = model.get_submodule(parent_path)
        setattr(parent, child, MultiLoraLinear(getattr(parent, child), group, a, b, owners))
    return batch
