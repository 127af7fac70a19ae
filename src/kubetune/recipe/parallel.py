"""The `parallel` recipe section: how one recipe spreads over processes (the degrees).

Only the settings live here. Their arithmetic (does dp x fsdp x tp x pp equal the process
count, which combinations are refused) is `kubetune.recipe.layout`, shared by training and
`kubetune k8s render`; the device mesh is built in `kubetune.training.parallel`. The
collective-communication environment is the `comm` section (`kubetune.recipe.comm`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kubetune.recipe.base import Section


class ParallelSection(Section):
    """Degrees of parallelism on one DeviceMesh ("pp", "dp", "fsdp", "tp"); their product must
    equal the world size (`layout.layout_for` checks it, and refuses pp together with fsdp).

    `dp` = -1 means "whatever is left" (world size divided by the other degrees).
    """

    dp: int = Field(-1, description="Data-parallel (DDP) degree; -1 = world size / (fsdp*tp*pp).")
    fsdp: int = Field(1, ge=1, description="FSDP2 (fully_shard) degree: parameters, grads and optimizer state sharded.")
    tp: int = Field(
        1, ge=1, description="Tensor-parallel degree (DTensor: attention and MLP projections, LoRA included)."
    )
    pp: int = Field(
        1,
        ge=1,
        description="Pipeline stages (torch.distributed.pipelining; a step's grad_accum micro-batches flow "
        "through them in the order pp_schedule names).",
    )
    pp_schedule: Literal["gpipe", "1f1b"] = Field(
        "gpipe",
        description="Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b (keeps at most "
        "pp micro-batches of activations; needs train.grad_accum >= parallel.pp).",
    )
    timeout_s: int = Field(1800, ge=10, description="Collective timeout in seconds for the process group.")
    backend: str = Field("auto", description="auto | gloo | nccl | hccl (auto follows the device).")
