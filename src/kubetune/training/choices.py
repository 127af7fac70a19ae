"""`kubetune kernels`: what `kubetune train` chooses on this machine, and from what.

The choices are the ones a run makes at start-up (kubetune.models.kernels for precision
and attention, kubetune.training.processes for processes or threads), in the order a run
makes them and with the thread count it would use; `--remeasure` measures each again and
rewrites the cache.
"""

from __future__ import annotations

import os

from kubetune.models import measure


def describe_choices(recipe_arg: str | None, overrides: list[str], remeasure: bool = False) -> str:
    import torch

    from kubetune.models import kernels
    from kubetune.recipe import load_recipe
    from kubetune.training.processes import plan_processes, probe_inputs
    from kubetune.training.setup import first_row_samples

    recipe = load_recipe(recipe_arg, overrides).recipe
    lines = [_machine_line()]
    procs = plan_processes(recipe_arg, overrides, remeasure)
    threads = recipe.train.num_threads or (1 if procs.processes > 1 else os.cpu_count() or 1)
    torch.set_num_threads(threads)
    config, batcher = probe_inputs(recipe)
    shapes = kernels.ModelShapes.of(config, first_row_samples(batcher))
    cpu = torch.device("cpu")
    plan = kernels.choose(recipe.train.precision, recipe.model.packed_attention, shapes, cpu, remeasure=remeasure)
    lines.append(f"{procs.describe()}")
    lines.append(f"{plan.describe()} [{threads} thread(s) per process]")
    lines.append(f"cache: {measure.cache_root_kernels()}")
    lines.append(
        "override: train.precision=bf16|fp32, model.packed_attention=fp32|native, --nproc-per-node N "
        "(or train.num_threads); --remeasure to measure again"
    )
    return "\n".join(lines)


def _machine_line() -> str:
    import torch

    from kubetune.models.kernels import BF16_FLAGS

    flags = measure.cpu_flags()
    units = [f for f in BF16_FLAGS if f in flags]
    return (
        f"machine: {measure.cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"(ISA {torch.backends.cpu.get_cpu_capability()}); bf16 units: {', '.join(units) or 'none'}"
    )
