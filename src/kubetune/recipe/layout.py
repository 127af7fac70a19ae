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
from kubetune.recipe.parallel import ParallelSection
from kubetune.recipe.schema import DEFAULT_MODEL, Recipe, TrainSection

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


def check_hosts(layout: Layout, per_host: int) -> None:
    """Refuse tensor-parallel groups that would span hosts (pods). A group is `tp` consecutive
    ranks (tp is the mesh's innermost dimension) and a host runs `per_host` consecutive ranks,
    so a group stays on one host exactly when tp divides per_host; its all-reduces run in every
    layer, over the cards' own links inside a host, over the network between hosts."""
    if layout.tp > 1 and per_host % layout.tp:
        raise RecipeError(
            f"parallel.tp={layout.tp} splits tensor-parallel groups across pods (hosts) of {per_host} process(es) "
            f"(each layer's all-reduce would cross the network); set parallel.tp to a divisor of {per_host} "
            f"({_listed(_divisors(per_host))}) and raise parallel.pp or parallel.dp to keep the process count, "
            f"or run a multiple of {layout.tp} processes per pod (k8s.nproc_per_node; --nproc-per-node on a host)"
        )


def grad_accum_for(train: TrainSection, data_parallel: int) -> int:
    """Micro-batches per optimizer step and replica: train.grad_accum, or where
    train.global_batch_size is set, global / (micro-batch x data-parallel replicas), which must
    come out whole (RecipeError naming the valid choices otherwise)."""
    glob = train.global_batch_size
    if glob is None:
        return train.grad_accum
    per_pass = train.micro_batch_size * data_parallel
    accum, rest = divmod(glob, per_pass)
    if rest or not accum:
        lower = [glob - rest] if accum else []
        fix = f"set train.global_batch_size to a multiple of {per_pass} ({_listed([*lower, (accum + 1) * per_pass])})"
        if glob % data_parallel == 0:
            fix += f", or train.micro_batch_size to a divisor of {glob // data_parallel} "
            fix += f"({_listed(_divisors(glob // data_parallel))})"
        what = "is fewer rows than one pass of" if not accum else "is not a whole number of passes of"
        raise RecipeError(
            f"train.global_batch_size={glob} {what} train.micro_batch_size={train.micro_batch_size} x "
            f"{data_parallel} data-parallel replica(s) = {per_pass} rows; {fix}"
        )
    if train.grad_accum not in (1, accum):
        raise RecipeError(
            f"train.grad_accum={train.grad_accum} disagrees with train.global_batch_size={glob}, which gives "
            f"{glob} / ({train.micro_batch_size} x {data_parallel} replica(s)) = {accum}; remove train.grad_accum or "
            f"set it to 1 (it is derived), or set train.global_batch_size=null"
        )
    return accum


def with_grad_accum(recipe: Recipe, data_parallel: int) -> Recipe:
    """The recipe with train.grad_accum as this many replicas train it (`grad_accum_for`)."""
    train = recipe.train.model_copy(update={"grad_accum": grad_accum_for(recipe.train, data_parallel)})
    return recipe.model_copy(update={"train": train})


def global_batch(train: TrainSection, data_parallel: int) -> int:
    """Rows per optimizer step over all replicas (train.global_batch_size where set)."""
    return train.micro_batch_size * grad_accum_for(train, data_parallel) * data_parallel


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listed(values: list[int]) -> str:
    """A few values in a line: all of up to 6, else the first 3, ... and the last 2."""
    shown = [str(v) for v in values]
    return ", ".join(shown if len(shown) <= 6 else [*shown[:3], "...", *shown[-2:]])


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
    accum = grad_accum_for(recipe.train, layout.data_parallel_size)
    if recipe.finetune.objective == "grpo":
        check_grpo(layout, recipe, accum)
    if layout.pp > 1 and recipe.parallel.pp_schedule == "1f1b" and accum < layout.pp:
        glob = recipe.train.global_batch_size
        fix = (
            f"set train.grad_accum>={layout.pp} (it is {accum})"
            if glob is None
            else f"train.global_batch_size={glob} gives {accum}: lower train.micro_batch_size to at most "
            f"{max(1, glob // (layout.data_parallel_size * layout.pp))}"
        )
        raise RecipeError(
            f"parallel.pp_schedule=1f1b needs at least parallel.pp={layout.pp} micro-batches per step; "
            f"{fix} or use gpipe"
        )
    if (layout.tp > 1 or layout.pp > 1) and recipe.train.precision == "fp16":
        raise RecipeError(
            "train.precision=fp16 with parallel.tp/pp: the loss scale's inf/nan check is per rank, so ranks "
            "would skip different steps; use train.precision=bf16 (Gaudi, NVIDIA since Ampere, Xeon with AMX: "
            "fp32's exponent range, no loss scale needed), or keep fp16 with parallel.tp=1 and parallel.pp=1 "
            "(data parallel or FSDP)"
        )


def check_grpo(layout: Layout, recipe: Recipe, accum: int) -> None:
    """GRPO samples with each process's whole model, in whole groups per process."""
    rl = recipe.finetune.rl
    if rl.rollout == "server":
        check_rollout_server(recipe)
    if layout.fsdp > 1:
        raise RecipeError(
            "finetune.objective=grpo samples its completions with each process's whole model; set parallel.fsdp=1 "
            "(data-parallel processes share the prompts instead)"
        )
    per_process = recipe.train.micro_batch_size * accum
    if per_process % rl.num_generations:
        raise RecipeError(
            f"finetune.rl.num_generations={rl.num_generations} must divide the completions each process trains on "
            f"per step (train.micro_batch_size x grad_accum = {recipe.train.micro_batch_size} x {accum} = "
            f"{per_process}), so that every group of completions sits on one process; raise train.grad_accum or "
            f"train.micro_batch_size, or lower num_generations"
        )
    generation = rl.generation_steps(accum)
    if generation % accum:
        raise RecipeError(
            f"finetune.rl.steps_per_generation={generation} must be a multiple of train.grad_accum={accum} "
            "(a generation batch feeds whole optimizer steps)"
        )


def check_rollout_server(recipe: Recipe) -> None:
    """rollout=server: a server to ask, and an adapter to push to it after each step."""
    rl, base = recipe.finetune.rl, recipe.model.name_or_path
    if not rl.server_url:
        raise RecipeError(
            "finetune.rl.rollout=server needs finetune.rl.server_url, the address of a `kubetune serve "
            f"{base} --allow-runtime-adapters` (`kubetune k8s render` adds one and sets it)"
        )
    if recipe.finetune.method != "lora":
        raise RecipeError(
            f"finetune.rl.rollout=server pushes the policy's LoRA adapter to the server after each step; "
            f"finetune.method={recipe.finetune.method} has none: use finetune.method=lora or finetune.rl.rollout=local"
        )


# ------------------------------------------------------------------------ shapes without torch
# `kubetune k8s render` checks tp and pp against the model before any pod starts, without
# torch, transformers or the network: a local model directory's config.json, the embedded
# default's known shape, or this table of well-known hub architectures.


@dataclass(frozen=True)
class KnownShape:
    """A model's shape as far as a layout cares (a `ModelShape` without transformers), and its
    width and vocabulary where known, which give its parameter count (`parameters`)."""

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool = False
    hidden_size: int | None = None
    vocab_size: int | None = None

    @property
    def parameters(self) -> int | None:
        """A Llama-architecture decoder's parameter count (embeddings, attention with grouped
        key/value heads, gated MLP, RMSNorms, an untied head), or None without width and vocabulary."""
        hidden, vocab = self.hidden_size, self.vocab_size
        if hidden is None or vocab is None:
            return None
        kv_width = hidden // self.num_attention_heads * self.num_key_value_heads
        attention = 2 * hidden * hidden + 2 * hidden * kv_width  # q, o; k, v
        layer = attention + 3 * hidden * self.intermediate_size + 2 * hidden
        head = 0 if self.tie_word_embeddings else vocab * hidden
        return vocab * hidden + self.num_hidden_layers * layer + hidden + head


# From each repository's config.json on huggingface.co (num_attention_heads,
# num_key_value_heads, intermediate_size, num_hidden_layers, tie_word_embeddings); the chat /
# instruct variants share their base model's architecture. Keys are compared lower-case.
# hidden_size and vocab_size too, for the parameter count.
_LLAMA2_7B = KnownShape(32, 32, 11008, 32, hidden_size=4096, vocab_size=32000)
_LLAMA2_13B = KnownShape(40, 40, 13824, 40, hidden_size=5120, vocab_size=32000)
_LLAMA2_70B = KnownShape(64, 8, 28672, 80, hidden_size=8192, vocab_size=32000)  # grouped-query attention: 8 KV heads
_LLAMA3_8B = KnownShape(32, 8, 14336, 32, hidden_size=4096, vocab_size=128256)
_LLAMA3_70B = KnownShape(64, 8, 28672, 80, hidden_size=8192, vocab_size=128256)
_MISTRAL_7B = KnownShape(32, 8, 14336, 32, hidden_size=4096, vocab_size=32000)
_MISTRAL_7B_V03 = KnownShape(32, 8, 14336, 32, hidden_size=4096, vocab_size=32768)  # v0.3 extended the vocabulary
_SMOLLM2_135M = KnownShape(9, 3, 1536, 30, tie_word_embeddings=True, hidden_size=576, vocab_size=49152)
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
        ("mistralai/mistral-7b-v0.1", "mistralai/mistral-7b-instruct-v0.1", "mistralai/mistral-7b-instruct-v0.2"),
        _MISTRAL_7B,
    ),
    **dict.fromkeys(("mistralai/mistral-7b-v0.3", "mistralai/mistral-7b-instruct-v0.3"), _MISTRAL_7B_V03),
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
    hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
    # Llama-family configs that omit it do not tie (LlamaConfig's default).
    return KnownShape(
        heads,
        kv_heads,
        width,
        layers,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_size=hidden if isinstance(hidden, int) else None,
        vocab_size=vocab if isinstance(vocab, int) else None,
    )


def model_shape(name_or_path: str) -> KnownShape | None:
    """The model's shape without loading it: a local directory's config.json, the embedded
    default, or a well-known hub id; None when unknown (a GGUF file, another hub id)."""
    config = Path(name_or_path).expanduser() / "config.json"
    if config.is_file():
        return shape_from_config(config)
    return KNOWN_SHAPES.get(name_or_path.lower())
