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

The degrees themselves, and the checks on them, are pure arithmetic: kubetune.recipe.layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from kubetune.recipe.layout import MESH_DIMS, Layout, layout_for
from kubetune.recipe.parallel import ParallelSection
from kubetune.training.dist import DistEnv, report_collective, timed_collective


@dataclass(frozen=True)
class MeshLayout(Layout):
    """A layout realised on this process group: the pure degrees plus the DeviceMesh
    (None in a single process)."""

    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh

    def group(self, dim: str) -> Any:
        return self.mesh[dim].get_group() if self.mesh is not None else None


def plan_layout(parallel: ParallelSection, env: DistEnv) -> MeshLayout:
    layout = layout_for(parallel, env.world_size)
    if env.world_size == 1:
        return MeshLayout(dp=layout.dp, fsdp=layout.fsdp, tp=layout.tp, pp=layout.pp)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(env.device.type, (layout.pp, layout.dp, layout.fsdp, layout.tp), mesh_dim_names=MESH_DIMS)
    coord = mesh.get_coordinate()
    assert coord is not None  # every rank of the world is on the mesh
    pp, dp, fsdp, tp = coord
    return MeshLayout(dp=layout.dp, fsdp=layout.fsdp, tp=layout.tp, pp=layout.pp, coord=(pp, dp, fsdp, tp), mesh=mesh)


def single_process() -> MeshLayout:
    return MeshLayout(dp=1, fsdp=1)


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


def apply_tensor_parallel(decoder_layers, layout: MeshLayout) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh = layout.mesh["tp"]
    for layer in decoder_layers:
        parallelize_module(layer, tp_mesh, _tp_plan(layer))


# --- wrapping ---------------------------------------------------------------------------


def wrap(module: nn.Module, decoder_layers, layout: MeshLayout, env: DistEnv, precision: str) -> nn.Module:
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


def time_ddp_buckets(module: nn.Module) -> bool:
    """Time DDP's gradient-bucket all-reduces (issue to completion) for the run's telemetry: a
    communication hook around DDP's default one, so the arithmetic is unchanged. Only when
    monitoring is on (a Python hook per bucket); False when `module` is not DDP."""
    import time

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not isinstance(module, DDP):
        return False

    # no annotations: DDP checks them against dist.GradBucket, and this module's are strings
    def timed_allreduce(state, bucket):
        t0, buf = time.perf_counter(), bucket.buffer()
        nbytes = buf.numel() * buf.element_size()

        def done(fut):
            report_collective("all_reduce", nbytes, time.perf_counter() - t0)
            return fut.value()

        return allreduce_hook(state, bucket).then(done)

    module.register_comm_hook(None, timed_allreduce)
    return True


def needs_replica_sync(layout: Layout) -> bool:
    """Replicas whose gradients neither DDP nor FSDP2 average (dp with tp or pp)."""
    return layout.dp > 1 and layout.fsdp == 1 and (layout.tp > 1 or layout.pp > 1)


def sync_replicas(params: list[torch.nn.Parameter], layout: MeshLayout) -> None:
    """Average gradients over the dp group: one flat all-reduce per dtype."""
    import torch.distributed as dist

    group = layout.group("dp")
    grads = [_local(p.grad) for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        with timed_collective("all_reduce", flat.numel() * flat.element_size()):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= layout.dp
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, layout: MeshLayout) -> torch.Tensor:
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
        norm: Any = torch.nn.utils.get_total_norm(same, 2.0)  # a DTensor when the grads are
        sq = sq + (norm.full_tensor() if mesh is not None else norm).float() ** 2
    if layout.pp > 1:
        import torch.distributed as dist

        with timed_collective("all_reduce", sq.element_size()):
            dist.all_reduce(sq, group=layout.group("pp"))
    total = sq.sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for same in groups.values():
            torch._foreach_mul_([_local(g) for g in same], coef)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
