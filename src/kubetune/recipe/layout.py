"""How many processes do what: the arithmetic of the `parallel` section, without torch.

Rendering a cluster job and starting training both need it (is dp x fsdp x tp x pp the
process count? does tp divide the heads?), so it lives here, in the pure recipe layer.
The device mesh that realises a layout is built in `kubetune.training.parallel`.

The mesh has four named dimensions, outermost first: ("pp", "dp", "fsdp", "tp"). The ranks
that share (dp, fsdp) coordinates are one data-parallel replica: they read the same
micro-batches. There are dp x fsdp replicas, each with its own shard of the data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kubetune.errors import ModelError, RecipeError
from kubetune.recipe.dist import ParallelSection
from kubetune.recipe.schema import DEFAULT_MODEL, Recipe

MESH_DIMS = ("pp", "dp", "fsdp", "tp")


@dataclass(frozen=True)
class Layout:
    """The degrees of each mesh dimension, and this rank's coordinates on the mesh."""

    dp: int
    fsdp: int
    tp: int = 1
    pp: int = 1
    coord: tuple[int, int, int, int] = (0, 0, 0, 0)  # this rank's (pp, dp, fsdp, tp)

    @property
    def world_size(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp

    @property
    def data_parallel_size(self) -> int:
        return self.dp * self.fsdp

    @property
    def data_parallel_rank(self) -> int:
        _, dp, fsdp, _ = self.coord
        return dp * self.fsdp + fsdp

    @property
    def pp_rank(self) -> int:
        return self.coord[0]

    @property
    def tp_rank(self) -> int:
        return self.coord[3]

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors (FSDP2 shards or tensor-parallel slices)."""
        return self.fsdp > 1 or self.tp > 1

    @property
    def reporter(self) -> bool:
        """The one rank of each data-parallel replica whose numbers count in sums (the last
        pipeline stage holds the loss; tensor-parallel ranks hold the same numbers)."""
        return self.tp_rank == 0 and self.pp_rank == self.pp - 1

    def describe(self) -> str:
        parts = [
            f"{name} {n}"
            for name, n in (("dp", self.dp), ("fsdp", self.fsdp), ("tp", self.tp), ("pp", self.pp))
            if n > 1
        ]
        return " x ".join(parts) if parts else "no parallelism"


def data_parallel_only(world_size: int, rank: int) -> Layout:
    """Every rank a whole replica (what `kubetune eval` and unsplit callers assume)."""
    return Layout(dp=world_size, fsdp=1, coord=(0, rank, 0, 0))


def layout_for(parallel: ParallelSection, world: int) -> Layout:
    """The degrees for `world` processes, or a RecipeError saying what to change."""
    if parallel.pp > 1 and parallel.fsdp > 1:
        raise RecipeError(
            "parallel.pp with parallel.fsdp: pipeline stages are replicated with parallel.dp, "
            "not sharded; set parallel.fsdp=1"
        )
    fixed = parallel.fsdp * parallel.tp * parallel.pp
    dp = parallel.dp if parallel.dp != -1 else max(1, world // fixed)
    if dp * fixed != world:
        raise RecipeError(
            f"parallel: dp x fsdp x tp x pp = {dp} x {parallel.fsdp} x {parallel.tp} x {parallel.pp} = {dp * fixed}, "
            f"but {world} process(es) run; make the product equal the number of processes (parallel.dp=-1 fills in dp)"
        )
    return Layout(dp=dp, fsdp=parallel.fsdp, tp=parallel.tp, pp=parallel.pp)


class ModelShape(Protocol):
    """What a layout needs to know of a model: the fields of a transformers config (read-only,
    so a frozen `KnownShape` fits too)."""

    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...


def check_model(layout: Layout, config: ModelShape, recipe: Recipe) -> None:
    """Refuse, in one line, degrees that this model or recipe cannot be split by."""
    if layout.tp > 1:
        sizes = {
            "attention heads (num_attention_heads)": config.num_attention_heads,
            "key/value heads (num_key_value_heads)": config.num_key_value_heads,
            "MLP width (intermediate_size)": config.intermediate_size,
        }
        for what, n in sizes.items():
            if n % layout.tp:
                raise ModelError(
                    f"parallel.tp={layout.tp} does not divide the model's {n} {what}; "
                    f"choose a tp that divides {', '.join(str(v) for v in sizes.values())}"
                )
    if layout.pp > 1:
        if layout.pp > config.num_hidden_layers:
            raise ModelError(
                f"parallel.pp={layout.pp} is more stages than the model's {config.num_hidden_layers} "
                f"decoder layers; use at most {config.num_hidden_layers}"
            )
        if recipe.finetune.method == "full" and getattr(config, "tie_word_embeddings", False):
            raise ModelError(
                "parallel.pp with finetune.method=full: this model ties its input embedding to the "
                "output head, which live on different stages; use finetune.method=lora or parallel.fsdp"
            )
    check_recipe(layout, recipe)


def check_recipe(layout: Layout, recipe: Recipe) -> None:
    """The layout's demands on the rest of the recipe (no model needed)."""
    if recipe.finetune.objective != "sft" and (layout.tp > 1 or layout.pp > 1):
        raise RecipeError(
            f"finetune.objective={recipe.finetune.objective} runs data parallel (processes, parallel.fsdp), not "
            f"under parallel.tp or parallel.pp; set parallel.tp=1 and parallel.pp=1"
        )
    if layout.pp > 1 and recipe.parallel.pp_schedule == "1f1b" and recipe.train.grad_accum < layout.pp:
        raise RecipeError(
            f"parallel.pp_schedule=1f1b needs at least parallel.pp={layout.pp} micro-batches per step; "
            f"set train.grad_accum>={layout.pp} (it is {recipe.train.grad_accum}) or use gpipe"
        )
    if (layout.tp > 1 or layout.pp > 1) and recipe.train.precision == "fp16":
        raise RecipeError(
            "train.precision=fp16 with parallel.tp/pp: the loss scale's inf/nan check is per rank, so ranks "
            "would skip different steps; use train.precision=bf16 (Gaudi, NVIDIA since Ampere, Xeon with AMX: "
            "fp32's exponent range, no loss scale needed), or keep fp16 with parallel.tp=1 and parallel.pp=1 "
            "(data parallel or FSDP)"
        )


# ------------------------------------------------------------------------ shapes without torch
# `kubetune k8s render` checks tp and pp against the model before any pod starts, without
# torch, transformers or the network: a local model directory's config.json, the embedded
# default's known shape, or this table of well-known hub architectures.


@dataclass(frozen=True)
class KnownShape:
    """A model's shape as far as a layout cares (a `ModelShape` without transformers)."""

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool = False


# From each repository's config.json on huggingface.co (num_attention_heads,
# num_key_value_heads, intermediate_size, num_hidden_layers, tie_word_embeddings); the chat /
# instruct variants share their base model's architecture. Keys are compared lower-case.
_LLAMA2_7B = KnownShape(32, 32, 11008, 32)
_LLAMA2_13B = KnownShape(40, 40, 13824, 40)
_LLAMA2_70B = KnownShape(64, 8, 28672, 80)  # grouped-query attention: 8 KV heads
_LLAMA3_8B = KnownShape(32, 8, 14336, 32)
_LLAMA3_70B = KnownShape(64, 8, 28672, 80)
_MISTRAL_7B = KnownShape(32, 8, 14336, 32)
_SMOLLM2_135M = KnownShape(9, 3, 1536, 30, tie_word_embeddings=True)
KNOWN_SHAPES: dict[str, KnownShape] = {
    **dict.fromkeys(("meta-llama/llama-2-7b-hf", "meta-llama/llama-2-7b-chat-hf"), _LLAMA2_7B),
    **dict.fromkeys(("meta-llama/llama-2-13b-hf", "meta-llama/llama-2-13b-chat-hf"), _LLAMA2_13B),
    **dict.fromkeys(("meta-llama/llama-2-70b-hf", "meta-llama/llama-2-70b-chat-hf"), _LLAMA2_70B),
    **dict.fromkeys(
        (
            "meta-llama/meta-llama-3-8b",
            "meta-llama/meta-llama-3-8b-instruct",
            "meta-llama/llama-3.1-8b",
            "meta-llama/llama-3.1-8b-instruct",
        ),
        _LLAMA3_8B,
    ),
    **dict.fromkeys(
        (
            "meta-llama/meta-llama-3-70b",
            "meta-llama/meta-llama-3-70b-instruct",
            "meta-llama/llama-3.1-70b",
            "meta-llama/llama-3.1-70b-instruct",
        ),
        _LLAMA3_70B,
    ),
    **dict.fromkeys(
        (
            "mistralai/mistral-7b-v0.1",
            "mistralai/mistral-7b-instruct-v0.1",
            "mistralai/mistral-7b-instruct-v0.2",
            "mistralai/mistral-7b-v0.3",
            "mistralai/mistral-7b-instruct-v0.3",
        ),
        _MISTRAL_7B,
    ),
    **dict.fromkeys(
        ("huggingfacetb/smollm2-135m", "huggingfacetb/smollm2-135m-instruct", DEFAULT_MODEL), _SMOLLM2_135M
    ),
}


def shape_from_config(path: Path) -> KnownShape | None:
    """The shape in an HF `config.json`, or None when it lacks a field (another architecture)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    heads = config.get("num_attention_heads")
    kv_heads, width, layers = (
        config.get("num_key_value_heads", heads),
        config.get("intermediate_size"),
        config.get("num_hidden_layers"),
    )
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(width, int)):
        return None
    if not isinstance(layers, int):
        return None
    # Llama-family configs that omit it do not tie (LlamaConfig's default).
    return KnownShape(
        heads, kv_heads, width, layers, tie_word_embeddings=bool(config.get("tie_word_embeddings", False))
    )


def model_shape(name_or_path: str) -> KnownShape | None:
    """The model's shape without loading it: a local directory's config.json, the embedded
    default, or a well-known hub id; None when unknown (a GGUF file, another hub id)."""
    config = Path(name_or_path).expanduser() / "config.json"
    if config.is_file():
        return shape_from_config(config)
    return KNOWN_SHAPES.get(name_or_path.lower())
