"""The served model's linear layers: sibling projections fused into one GEMM, and many LoRA
adapters over one base model in one batch.

**Fusion.** Layers that transformers' decoder calls on the very same tensor (q/k/v of an
attention, gate/up of an MLP) become one `FusedLinear` whose weight is theirs stacked: one
GEMM reads the input once and streams one larger weight, as vLLM's QKVParallelLinear /
MergedColumnParallelLinear do. Small weights stream from memory more slowly than large ones,
so fewer, larger GEMMs matter most where a step is a few rows (measured in BENCHMARKS.md,
"What the serving engine's choices measured"). Each original layer is replaced by a `Member`
that returns its columns of the shared result, so transformers' model code runs unchanged.

**Adapters.** PEFT reads each adapter (its file format, key names and scaling), then its
layers are unloaded, and every targeted layer holds all adapters side by side: the members'
A concatenated to [columns, in], each B (times the adapter's scaling) to [out, columns]. A
forward whose tokens use different adapters multiplies the input by every A at once, masks
the columns that are not the token's adapter (Punica / S-LoRA's idea: one batch, whatever
the mix, instead of one sub-batch per adapter as PEFT's mixed-batch forward does), and the Bs
ride in the base weight along the input axis: [x | h] @ [W | B].T is the base GEMM, the
adapters' second matmul and the sum in one call, cheaper than the base GEMM plus an addmm
(BENCHMARKS.md, "What the serving engine's choices measured"). In a fused layer each member's
B sits in its own columns (block diagonal). Tokens of the base model get a zero mask.

**Adapters loaded while serving** (`POST /v1/load_lora_adapter`) sit beside the joint weight
in `LateAdapters`, not in it: that weight may be oneDNN-packed (serve.packed keeps no plain
copy to re-stack), and a layer no adapter targeted at start is a plain or packed linear layer
that gets wrapped (`Adapted`). They cost one more masked A matmul and one B matmul in the
layers they target, only in forwards that have adapter tokens. Adapter indices are never
reused, so the prefix cache (keyed by index) never hands one adapter's K/V to another.

**Batch independence.** A token's result depends on the other tokens of its forward only
through the GEMM kernels' choices by row count (measured: the first difference between an
adapter token alone and batched appears in a GEMM whose inputs are bitwise equal, base rows
alike, and an adapter merged into the base and served as the base drifts as much); the
masks and the fusion add none (tests/serve/test_lora_batch.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kubetune.contracts.engine import BASE
from kubetune.errors import ModelError

# siblings that transformers' decoder layers call on the very same input tensor, in call order
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class LoraBatch:
    """The adapter of each token of the current forward, shared by every FusedLinear."""

    tokens: torch.Tensor | None = None  # [tokens] adapter index per token; None: base only
    _masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # by column owners

    def set(self, adapters: list[int]) -> None:
        self.tokens = None if all(a == BASE for a in adapters) else torch.tensor(adapters)
        self._masks.clear()

    def mask(self, owners: tuple[int, ...], owner_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, columns]: 1 where a column belongs to the token's adapter. Layers with the
        same column owners (the same kinds in every decoder layer) share one mask per forward."""
        mask = self._masks.get(owners)
        if mask is None:
            assert self.tokens is not None
            mask = self._masks[owners] = (self.tokens[:, None] == owner_ids).to(dtype)
        return mask


@dataclass(frozen=True)
class Lora:
    """One base layer's adapters: A [columns, in], B times scaling [out, columns], the adapter of each column."""

    a: torch.Tensor
    b: torch.Tensor
    owners: list[int]


class FusedLinear(nn.Module):
    """The layers of one input, as one `joint` nn.Linear (packed for oneDNN where that is
    faster, see serve.packed): weight [sum of outs, in + adapter columns]."""

    def __init__(self, bases: list[nn.Linear], loras: list[Lora | None], batch: LoraBatch) -> None:
        super().__init__()
        dtype = bases[0].weight.dtype
        self.batch = batch
        self.in_features = bases[0].in_features
        self.splits = [b.out_features for b in bases]
        self.out_features = sum(self.splits)
        self.a = torch.cat([lo.a for lo in loras if lo]).to(dtype) if any(loras) else None
        self.owners = tuple(o for lo in loras if lo for o in lo.owners)
        self.owner_ids = torch.tensor(self.owners, dtype=torch.long)
        has_bias = any(getattr(b, "bias", None) is not None for b in bases)
        columns = len(self.owners)
        self.joint = nn.Linear(bases[0].in_features + columns, sum(self.splits), has_bias, dtype=dtype)
        with torch.no_grad():
            self.joint.weight.zero_()
            row, col = 0, bases[0].in_features
            for base, lora in zip(bases, loras):
                rows = slice(row, row + base.out_features)
                self.joint.weight[rows, : base.in_features] = base.weight.detach()
                if lora:
                    self.joint.weight[rows, col : col + len(lora.owners)] = lora.b.to(dtype)
                    col += len(lora.owners)
                bias = getattr(base, "bias", None)  # None for bias-free layers, whatever the stubs say
                if has_bias:
                    self.joint.bias[rows] = 0 if bias is None else bias.detach()
                row += base.out_features
        self._last: tuple[torch.Tensor, list[torch.Tensor], set[int]] | None = None  # (input, outputs, not yet taken)
        self.late: LateAdapters | None = None  # adapters loaded while serving

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joint_in = x
        if self.a is not None:
            if self.batch.tokens is None:
                h = x.new_zeros(*x.shape[:-1], len(self.owners))
            else:
                h = nn.functional.linear(x, self.a) * self.batch.mask(self.owners, self.owner_ids, x.dtype)
            joint_in = torch.cat([x, h], dim=-1)
        out = self.joint(joint_in)
        return out if self.late is None else self.late(x, out)

    def take(self, x: torch.Tensor, member: int) -> torch.Tensor:
        """Member `member`'s output for input `x`: the first member to ask runs the GEMM, the
        others take their columns of it; the result is dropped once every member has."""
        last = self._last
        if last is None or last[0] is not x or member not in last[2]:
            last = self._last = (x, list(self.forward(x).split(self.splits, dim=-1)), set(range(len(self.splits))))
        last[2].discard(member)
        if not last[2]:
            self._last = None
        return last[1][member]


class Member(nn.Module):
    """Stands where one of a FusedLinear's original layers stood."""

    def __init__(self, fused: FusedLinear, index: int) -> None:
        super().__init__()
        self.index = index
        self.in_features, self.out_features = fused.in_features, fused.splits[index]
        if index == 0:  # the first member owns it, so it appears once in state and module walks
            self.fused = fused
        self._shared = (fused,)  # a tuple: not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared[0].take(x, self.index)


class LateAdapters:
    """One layer's adapters loaded while serving: A [columns, in], B times scaling [out, columns]
    (zero outside the rows of the member each column belongs to), the adapter of each column."""

    def __init__(self, batch: LoraBatch, out_features: int) -> None:
        self.batch, self.out_features = batch, out_features
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.owners: tuple[int, ...] = ()
        self.owner_ids = torch.zeros(0, dtype=torch.long)

    def add(self, adapter: int, a: torch.Tensor, b: torch.Tensor, rows: slice) -> None:
        full_b = a.new_zeros(self.out_features, a.shape[0])
        full_b[rows] = b
        self.a = a if self.a is None else torch.cat([self.a, a])
        self.b = full_b if self.b is None else torch.cat([self.b, full_b], dim=1)
        self._set_owners(self.owners + (adapter,) * a.shape[0])

    def remove(self, adapters: set[int]) -> None:
        keep = [i for i, owner in enumerate(self.owners) if owner not in adapters]
        if self.a is None or self.b is None or len(keep) == len(self.owners):
            return
        self.a, self.b = (self.a[keep], self.b[:, keep]) if keep else (None, None)
        self._set_owners(tuple(self.owners[i] for i in keep))

    def _set_owners(self, owners: tuple[int, ...]) -> None:
        self.owners, self.owner_ids = owners, torch.tensor(owners, dtype=torch.long)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.a is None or self.b is None or self.batch.tokens is None:
            return out
        h = nn.functional.linear(x, self.a) * self.batch.mask(self.owners, self.owner_ids, x.dtype)
        return out + nn.functional.linear(h, self.b)


class Adapted(nn.Module):
    """Stands where a linear layer no adapter targeted at start stood, once one loaded later does."""

    def __init__(self, base: Any, batch: LoraBatch) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.late = LateAdapters(batch, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(x, self.base(x))


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


def _lora_of(path: str, adapters: list[AdapterWeights]) -> Lora | None:
    held = [(i, adapters[i].layers[path]) for i in range(len(adapters)) if path in adapters[i].layers]
    if not held:
        return None
    a = torch.cat([a for _, (a, _, _) in held])
    b = torch.cat([b.float() * scaling for _, (_, b, scaling) in held], dim=1)
    return Lora(a, b, [i for i, (a, _, _) in held for _ in range(a.shape[0])])


def _families(model: nn.Module, fuse: bool) -> list[tuple[str, list[str]]]:
    """(parent path, child names) of every linear layer, siblings of one input together."""
    found = []
    for parent_path, parent in model.named_modules():
        linear = {n for n, c in parent.named_children() if type(c) is nn.Linear}
        for family in SHARED_INPUT if fuse else ():
            if set(family) <= linear and len({getattr(parent, n).in_features for n in family}) == 1:
                found.append((parent_path, list(family)))
                linear -= set(family)
        found += [(parent_path, [n]) for n in sorted(linear)]
    return found


def install(model: nn.Module, adapters: list[AdapterWeights], fuse: bool = True) -> LoraBatch:
    """Fuse siblings (unless `fuse` is False: benchmarks compare) and hold `adapters` (adapter
    index i = position in the list) in every layer they target; linear layers that are neither
    fused nor targeted stay as they are."""
    batch = LoraBatch()
    for parent_path, names in _families(model, fuse):
        parent = model.get_submodule(parent_path)
        prefix = f"{parent_path}." if parent_path else ""
        loras = [_lora_of(prefix + n, adapters) for n in names]
        if len(names) == 1 and loras[0] is None:
            continue
        fused = FusedLinear([getattr(parent, n) for n in names], loras, batch)
        if len(names) == 1:
            setattr(parent, names[0], fused)
        else:
            for i, n in enumerate(names):
                setattr(parent, n, Member(fused, i))
    return batch


LORA_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<part>[AB])\.weight$")


def read_adapter_files(name: str, path: str) -> AdapterWeights:
    """A PEFT adapter directory read from its files, without a model to load it onto (the served
    model's layers are fused and packed, which PEFT cannot target): PEFT's own config, weights
    loader and rank/alpha patterns, so the scaling is the one `read_adapters` gives."""
    from peft import PeftConfig
    from peft.utils import load_peft_weights
    from peft.utils.other import get_pattern_key

    config: Any = PeftConfig.from_pretrained(path)
    if getattr(config, "peft_type", None) != "LORA" or getattr(config, "use_dora", False):
        raise ModelError(f"adapter {name} ({path}): only plain LoRA adapters can be loaded (not DoRA, not other types)")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_peft_weights(path, device="cpu").items():
        match = LORA_KEY.match(key)
        if match is None:
            raise ModelError(f"adapter {name} ({path}): holds {key}, not a LoRA A or B weight of a linear layer")
        parts.setdefault(match["path"], {})[match["part"]] = tensor
    layers = {}
    for module_path, ab in parts.items():
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module_path), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module_path), config.lora_alpha)
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        layers[module_path] = (ab["A"], ab["B"], float(scaling))
    return AdapterWeights(name, layers, int(config.r))


def _late_holder(model: nn.Module, path: str, batch: LoraBatch) -> tuple[LateAdapters, slice]:
    """The LateAdapters of the layer at `path` (wrapping a plain one) and the output rows that are that layer's."""
    module = model.get_submodule(path)
    if isinstance(module, Member):
        fused = module._shared[0]
        start = sum(fused.splits[: module.index])
        if fused.late is None:
            fused.late = LateAdapters(batch, sum(fused.splits))
        return fused.late, slice(start, start + fused.splits[module.index])
    if isinstance(module, FusedLinear):
        if module.late is None:
            module.late = LateAdapters(batch, sum(module.splits))
        return module.late, slice(None)
    if isinstance(module, Adapted):
        return module.late, slice(None)
    if not (hasattr(module, "in_features") and hasattr(module, "out_features")):
        raise ModelError(f"the layer {path} ({type(module).__name__}) is not a linear layer; it cannot hold an adapter")
    parent_path, _, child = path.rpartition(".")
    adapted = Adapted(module, batch)
    setattr(model.get_submodule(parent_path), child, adapted)
    return adapted.late, slice(None)


def check_fits(model: nn.Module, weights: AdapterWeights) -> None:
    """Every layer the adapter targets exists and has its shapes, checked before any is changed."""
    names = dict(model.named_modules())
    for path, (a, b, _) in weights.layers.items():
        module = names.get(path)
        if module is None:
            raise ModelError(f"adapter {weights.name}: the base model has no layer {path}; trained on another base?")
        in_features, out_features = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if (a.shape[1], b.shape[0]) != (in_features, out_features) or a.shape[0] != b.shape[1]:
            raise ModelError(
                f"adapter {weights.name}: {path} is {in_features} -> {out_features} in the base model, the adapter's "
                f"A and B are {tuple(a.shape)} and {tuple(b.shape)}; was it trained on another base?"
            )


def add_late_adapter(model: nn.Module, batch: LoraBatch, weights: AdapterWeights, index: int) -> None:
    """Hold `weights` as adapter `index` in every layer it targets (call between forwards)."""
    check_fits(model, weights)
    embeddings: Any = model.get_input_embeddings()  # type: ignore[operator]
    dtype = embeddings.weight.dtype
    for path, (a, b, scaling) in weights.layers.items():
        late, rows = _late_holder(model, path, batch)
        late.add(index, a.to(dtype), (b.float() * scaling).to(dtype), rows)


def drop_late_adapters(model: nn.Module, indices: set[int]) -> None:
    """Remove the columns of adapters loaded while serving (call between forwards)."""
    for module in model.modules():
        late = getattr(module, "late", None)
        if isinstance(late, LateAdapters):
            late.remove(indices)
