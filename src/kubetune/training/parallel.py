"""How the processes split the work: the `parallel` recipe section on one DeviceMesh.

The mesh has the dimensions ("dp", "fsdp"): `dp` replicas (DDP: each holds the whole
trainable model, gradients all-reduced) of `fsdp`-way sharded groups (FSDP2 `fully_shard`:
parameters, gradients and optimizer state sharded, all-gathered per decoder layer). Every
one of the dp x fsdp ranks reads its own shard of the data. Tensor and pipeline parallelism
(`parallel.tp`, `parallel.pp`) are refused with a clear message until they land.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from kubetune.errors import RecipeError
from kubetune.recipe.dist import ParallelSection
from kubetune.training.dist import DistEnv


@dataclass
class Layout:
    dp: int
    fsdp: int
    tp: int = 1
    pp: int = 1
    mesh: object | None = None

    @property
    def data_parallel_size(self) -> int:
        return self.dp * self.fsdp

    @property
    def sharded(self) -> bool:
        return self.fsdp > 1


def layout_for(parallel: ParallelSection, world: int) -> Layout:
    """The degrees for `world` processes, or a RecipeError saying what to change (pure)."""
    fixed = parallel.fsdp * parallel.tp * parallel.pp
    dp = parallel.dp if parallel.dp != -1 else max(1, world // fixed)
    if dp * fixed != world:
        raise RecipeError(
            f"parallel: dp x fsdp x tp x pp = {dp} x {parallel.fsdp} x {parallel.tp} x {parallel.pp} = {dp * fixed}, "
            f"but {world} process(es) run; make the product equal the number of processes (parallel.dp=-1 fills in dp)"
        )
    if parallel.tp > 1 or parallel.pp > 1:
        raise RecipeError("parallel.tp / parallel.pp > 1: tensor and pipeline parallelism are not available in this "
                          "version; use parallel.fsdp (sharding) and parallel.dp (replicas)")
    return Layout(dp=dp, fsdp=parallel.fsdp)


def plan_layout(parallel: ParallelSection, env: DistEnv) -> Layout:
    layout = layout_for(parallel, env.world_size)
    if env.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        layout.mesh = init_device_mesh(env.device.type, (layout.dp, layout.fsdp), mesh_dim_names=("dp", "fsdp"))
    return layout


def wrap(module: nn.Module, decoder_layers, layout: Layout, env: DistEnv, precision: str) -> nn.Module:
    """DDP over all ranks, or FSDP2 (per decoder layer, then the root) with dp replicas."""
    if env.world_size == 1:
        return module
    if layout.sharded:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Compute in bf16/fp16 when the recipe asks for it, reduce gradients in fp32.
        param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        mesh = layout.mesh if layout.dp > 1 else layout.mesh["fsdp"]  # 2D mesh = HSDP
        for layer in decoder_layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(module, mesh=mesh, mp_policy=mp)
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(module, device_ids=ids)
