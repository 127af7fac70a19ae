"""How the processes split the work: the `parallel` recipe section on one DeviceMesh.

The mesh has four named dimensions, outermost first: ("pp", "dp", "fsdp", "tp").

- tp (innermost, so that a tensor-parallel group is made of neighbouring ranks, i.e. the
  same node): DTensor tensor parallelism of every decoder layer. q/k/v and gate/up are
  split by output features (ColwiseParallel), o and down by input features
  (RowwiseParallel): one all-reduce after attention and one after the MLP per layer. With
  LoRA, each adapter follows its base layer (see `_tp_plan`).
- fsdp: FSDP2 `fully_shard` groups (parameters, gradients, optimizer state sharded,
  all-gathered per decoder layer).
- dp: replicas. Alone, DDP; with FSDP2, the replicate dimension of HSDP; with tp or pp,
  gradients are averaged over the dp group after backward (`sync_replicas`).
- pp (outermost): pipeline stages over consecutive decoder layers (see pipeline.py).

The ranks that share (dp, fsdp) coordinates are one data-parallel replica: they read the
same micro-batches. There are dp x fsdp replicas, each with its own shard of the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from kubetune.errors import ModelError, RecipeError
from kubetune.recipe.dist import ParallelSection
from kubetune.training.dist import DistEnv

MESH_DIMS = ("pp", "dp", "fsdp", "tp")


@dataclass
class Layout:
    dp: int
    fsdp: int
    tp: int = 1
    pp: int = 1
    mesh: object | None = None
    coord: tuple[int, int, int, int] = (0, 0, 0, 0)  # this rank's (pp, dp, fsdp, tp)

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

    def group(self, dim: str):
        return self.mesh[dim].get_group() if self.mesh is not None else None


def data_parallel_only(env: DistEnv) -> Layout:
    """Every rank a whole replica (what `kubetune eval` and unsplit callers assume)."""
    return Layout(dp=env.world_size, fsdp=1, coord=(0, env.rank, 0, 0))


def layout_for(parallel: ParallelSection, world: int) -> Layout:
    """The degrees for `world` processes, or a RecipeError saying what to change (pure)."""
    if parallel.pp > 1 and parallel.fsdp > 1:
        raise RecipeError("parallel.pp with parallel.fsdp: pipeline stages are replicated with parallel.dp, "
                          "not sharded; set parallel.fsdp=1")
    fixed = parallel.fsdp * parallel.tp * parallel.pp
    dp = parallel.dp if parallel.dp != -1 else max(1, world // fixed)
    if dp * fixed != world:
        raise RecipeError(
            f"parallel: dp x fsdp x tp x pp = {dp} x {parallel.fsdp} x {parallel.tp} x {parallel.pp} = {dp * fixed}, "
            f"but {world} process(es) run; make the product equal the number of processes (parallel.dp=-1 fills in dp)"
        )
    return Layout(dp=dp, fsdp=parallel.fsdp, tp=parallel.tp, pp=parallel.pp)


def plan_layout(parallel: ParallelSection, env: DistEnv) -> Layout:
    layout = layout_for(parallel, env.world_size)
    if env.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        layout.mesh = init_device_mesh(env.device.type, (layout.pp, layout.dp, layout.fsdp, layout.tp),
                                       mesh_dim_names=MESH_DIMS)
        layout.coord = tuple(layout.mesh.get_coordinate())
    return layout


def check_model(layout: Layout, config, recipe) -> None:
    """Refuse, in one line, degrees that this model or recipe cannot be split by."""
    if layout.tp > 1:
        sizes = {"attention heads (num_attention_heads)": config.num_attention_heads,
                 "key/value heads (num_key_value_heads)": config.num_key_value_heads,
                 "MLP width (intermediate_size)": config.intermediate_size}
        for what, n in sizes.items():
            if n % layout.tp:
                raise ModelError(f"parallel.tp={layout.tp} does not divide the model's {n} {what}; "
                                 f"choose a tp that divides {', '.join(str(v) for v in sizes.values())}")
    if layout.pp > 1:
        if layout.pp > config.num_hidden_layers:
            raise ModelError(f"parallel.pp={layout.pp} is more stages than the model's {config.num_hidden_layers} "
                             f"decoder layers; use at most {config.num_hidden_layers}")
        if recipe.finetune.method == "full" and getattr(config, "tie_word_embeddings", False):
            raise ModelError("parallel.pp with finetune.method=full: this model ties its input embedding to the "
                             "output head, which live on different stages; use finetune.method=lora or parallel.fsdp")
    if layout.pp > 1 and recipe.parallel.pp_schedule == "1f1b" and recipe.train.grad_accum < layout.pp:
        raise RecipeError(f"parallel.pp_schedule=1f1b needs at least parallel.pp={layout.pp} micro-batches per step; "
                          f"set train.grad_accum>={layout.pp} (it is {recipe.train.grad_accum}) or use gpipe")
    if (layout.tp > 1 or layout.pp > 1) and recipe.train.precision == "fp16":
        raise RecipeError("train.precision=fp16 with parallel.tp/pp: loss scaling would skip steps on some ranks "
                          "only; use train.precision=bf16")


# --- tensor parallel --------------------------------------------------------------------

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def _tp_plan(layer: nn.Module) -> dict:
    """The parallelize_module plan of one decoder layer, LoRA adapters included.

    A column-parallel projection W (output split) with an adapter B @ A: A sees the whole,
    replicated input and stays replicated; B is split by output like W, so base + B(A(x))
    is this rank's slice of the output. A row-parallel projection (input split): A is split
    by input like W, so A(x) needs the same all-reduce as W(x); B then stays replicated.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, module in layer.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in COLWISE + ROWWISE:
            continue
        col = leaf in COLWISE
        style = ColwiseParallel if col else RowwiseParallel
        if hasattr(module, "base_layer"):  # a PEFT LoRA layer
            plan[f"{name}.base_layer"] = style()
            for adapter in getattr(module, "lora_A", {}):
                plan[f"{name}.{'lora_B' if col else 'lora_A'}.{adapter}"] = style()
        else:
            plan[name] = style()
    return plan


def apply_tensor_parallel(decoder_layers, layout: Layout) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh = layout.mesh["tp"]
    for layer in decoder_layers:
        parallelize_module(layer, tp_mesh, _tp_plan(layer))


# --- wrapping ---------------------------------------------------------------------------

def wrap(module: nn.Module, decoder_layers, layout: Layout, env: DistEnv, precision: str) -> nn.Module:
    """Tensor parallel first, then FSDP2 (per decoder layer, then the root), HSDP over dp,
    or DDP when the model is whole on every rank. Pipeline stages are cut before this
    (pipeline.py) and replicas of a stage or a tensor-parallel group average their gradients
    with `sync_replicas` instead of DDP."""
    if env.world_size == 1:
        return module
    if layout.tp > 1:
        apply_tensor_parallel(decoder_layers, layout)
    if layout.fsdp > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Compute in bf16/fp16 when the recipe asks for it, reduce gradients in fp32.
        param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        mesh = layout.mesh["dp", "fsdp"] if layout.dp > 1 else layout.mesh["fsdp"]  # 2D mesh = HSDP
        for layer in decoder_layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(module, mesh=mesh, mp_policy=mp)
        return module
    if layout.tp > 1 or layout.pp > 1:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [env.device.index] if env.device.type == "cuda" else None
    # Gradients as views into the all-reduce buckets: no copy in and out of the buckets.
    return DDP(module, device_ids=ids, gradient_as_bucket_view=True)


def needs_replica_sync(layout: Layout) -> bool:
    """Replicas whose gradients neither DDP nor FSDP2 average (dp with tp or pp)."""
    return layout.dp > 1 and layout.fsdp == 1 and (layout.tp > 1 or layout.pp > 1)


def sync_replicas(params: list[torch.nn.Parameter], layout: Layout) -> None:
    """Average gradients over the dp group: one flat all-reduce per dtype."""
    import torch.distributed as dist

    group = layout.group("dp")
    grads = [_local(p.grad) for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= layout.dp
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, layout: Layout) -> torch.Tensor:
    """The global gradient norm over every parameter of every stage and shard, clipped.

    Parameters may mix DTensors (shards: their squared norms are reduced over their mesh,
    and FSDP2 with tp gives two meshes) and plain tensors (whole on each rank of a tensor-
    parallel group). Pipeline stages hold disjoint parameters, so their squared norms add
    up over the pp group.
    """
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(getattr(g, "device_mesh", None), []).append(g)
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for mesh, same in groups.items():
        norm = torch.nn.utils.get_total_norm(same, 2.0)
        sq = sq + (norm.full_tensor() if mesh is not None else norm).float() ** 2
    if layout.pp > 1:
        import torch.distributed as dist

        dist.all_reduce(sq, group=layout.group("pp"))
    total = sq.sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for same in groups.values():
            torch._foreach_mul_([_local(g) for g in same], coef)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
