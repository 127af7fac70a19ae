"""Everything a run trains with, built once: `setup(recipe, env) -> TrainParts`.

The order matters where processes must agree: the mesh first (a collective), then the
model (each pipeline rank builds only its stage), the parallel wrapping, and last the
optimizer over the wrapped parameters.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kubetune.data import Batcher, PreparedData, prepare_data
from kubetune.errors import DataError, RunDirError
from kubetune.models.finetune import ModelParts, build_model
from kubetune.models.generate import AutocastFactory
from kubetune.models.load import DTYPES, load_tokenizer, resolve_model
from kubetune.models.stages import Stage
from kubetune.recipe import Recipe
from kubetune.recipe.layout import Layout, check_model
from kubetune.rundir import RunDir
from kubetune.training import checkpoint as ckpt
from kubetune.training.dist import DistEnv
from kubetune.training.optim import Optimization, build_optimization
from kubetune.training.parallel import MeshLayout
from kubetune.training.parallel import wrap as wrap_parallel
from kubetune.training.pipeline import PipelineRunner
from kubetune.training.runner import LocalRunner, StepRunner


@dataclass(frozen=True)
class TrainParts:
    recipe: Recipe
    env: DistEnv
    layout: MeshLayout
    run_dir: RunDir
    source: str  # what `from_pretrained` loads the base model from
    tokenizer: Any
    data: PreparedData
    model: ModelParts  # this rank's model (its stage, under a pipeline)
    runner: StepRunner
    optim: Optimization
    batcher: Batcher
    eval_batcher: Batcher | None
    autocast: AutocastFactory
    total_steps: int
    resume_from: Path | None  # the checkpoint to continue from, None for a fresh start
    started_at: float  # time.monotonic() when the command started


def setup(recipe: Recipe, env: DistEnv, layout: MeshLayout, run_dir: RunDir, started_at: float) -> TrainParts:
    configure_threads(recipe.train.num_threads, env)
    torch.manual_seed(recipe.train.seed)
    source = resolve_model(recipe.model.name_or_path)
    tokenizer = load_tokenizer(source, recipe.model.revision, recipe.model.trust_remote_code)
    data = prepare_data(recipe, tokenizer)
    model = build_model(recipe, source, env.device, Stage(layout.pp_rank, layout.pp) if layout.pp > 1 else None)
    check_model(layout, model.lm.config, recipe)
    autocast = autocast_context(recipe.train.precision, env.device)
    resume_from = resume_path(recipe.train.resume, run_dir)
    batcher = train_batcher(recipe, data, tokenizer.pad_token_id, layout)
    total_steps = plan_steps(recipe, batcher, resume_from)
    # a pipeline stage is set up on the unwrapped layers; tensor parallelism then splits them in place
    pipeline = pipeline_runner(recipe, model, layout, env, autocast, tokenizer.pad_token_id) if layout.pp > 1 else None
    wrapped = wrap_parallel(model.loss, model.layers, layout, env, recipe.train.precision)
    optim = build_optimization(model.model, recipe.train, layout, env.device, total_steps)
    runner = pipeline or LocalRunner(
        wrapped,
        model.loss,
        env.device,
        autocast,
        optim.scaler,
        offload=recipe.train.gradient_checkpointing == "offload",
    )
    return TrainParts(
        recipe=recipe,
        env=env,
        layout=layout,
        run_dir=run_dir,
        source=source,
        tokenizer=tokenizer,
        data=data,
        model=model,
        runner=runner,
        optim=optim,
        batcher=batcher,
        eval_batcher=eval_batcher(recipe, data, tokenizer.pad_token_id, layout),
        autocast=autocast,
        total_steps=total_steps,
        resume_from=resume_from,
        started_at=started_at,
    )


def pipeline_runner(
    recipe: Recipe, model: ModelParts, layout: MeshLayout, env: DistEnv, autocast: AutocastFactory, pad_id: int
) -> PipelineRunner:
    return PipelineRunner(
        model,
        layout,
        env,
        recipe.train.micro_batch_size,
        recipe.data.max_seq_len,
        recipe.train.grad_accum,
        pad_id,
        autocast,
        DTYPES[recipe.base_dtype_name()],
        recipe.parallel.pp_schedule,
        offload=recipe.train.gradient_checkpointing == "offload",
    )


def configure_threads(num_threads: int | None, env: DistEnv) -> None:
    if env.device.type != "cpu":
        return
    n = (
        num_threads
        or int(os.environ.get("OMP_NUM_THREADS", "0"))
        or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    )
    torch.set_num_threads(n)


def autocast_context(precision: str, device: torch.device) -> AutocastFactory:
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


def train_batcher(recipe: Recipe, data: PreparedData, pad_id: int, layout: Layout) -> Batcher:
    batcher = Batcher(
        data.train,
        max_seq_len=recipe.data.max_seq_len,
        micro_batch_size=recipe.train.micro_batch_size,
        packing=recipe.data.packing,
        seed=recipe.train.seed,
        pad_id=pad_id,
        dp_rank=layout.data_parallel_rank,
        dp_size=layout.data_parallel_size,
    )
    if batcher.micro_batches_left(0, 0) == 0:
        raise DataError(
            f"data.train: {len(batcher.epoch_rows(0))} packed rows cannot feed "
            f"{layout.data_parallel_size} processes; use more data or fewer processes"
        )
    return batcher


def eval_batcher(recipe: Recipe, data: PreparedData, pad_id: int, layout: Layout) -> Batcher | None:
    if data.eval is None or len(data.eval) == 0:
        return None
    ev = data.eval
    if recipe.eval.max_samples and len(ev) > recipe.eval.max_samples:
        ev = ev.subset(range(recipe.eval.max_samples))
    # A pipeline's micro-batches have one shape, the training one.
    rows = recipe.train.micro_batch_size if layout.pp > 1 else recipe.eval.batch_size
    return Batcher(
        ev,
        max_seq_len=recipe.data.max_seq_len,
        micro_batch_size=rows,
        packing=True,
        seed=0,
        pad_id=pad_id,
        dp_rank=layout.data_parallel_rank,
        dp_size=layout.data_parallel_size,
        shuffle=False,
    )


def plan_steps(recipe: Recipe, batcher: Batcher, resume_from: Path | None) -> int:
    """Optimizer steps of the whole run. A resumed run keeps the schedule of the checkpointed
    run (its world size may differ), unless the recipe now asks for a different length."""
    steps_per_epoch = math.ceil(batcher.micro_batches_left(0, 0) / recipe.train.grad_accum)
    total = recipe.train.max_steps or max(1, math.ceil(recipe.train.epochs * steps_per_epoch))
    if resume_from is not None:
        meta = ckpt.read_meta(resume_from)
        if meta.length == (recipe.train.max_steps, recipe.train.epochs):
            total = meta.total_steps
    return total


def resume_path(mode: str, run_dir: RunDir) -> Path | None:
    """`train.resume`: auto (the newest checkpoint, if any), never, or a checkpoint directory."""
    if mode == "never":
        if ckpt.latest_checkpoint(run_dir.path) is not None:
            raise RunDirError(
                f"train.resume=never but {run_dir.path} already holds checkpoints; "
                f"choose another output_dir=... or use train.resume=auto"
            )
        return None
    if mode == "auto":
        return ckpt.latest_checkpoint(run_dir.path)
    path = Path(mode)
    if not (path / "meta.json").is_file():
        raise RunDirError(
            f"train.resume={mode}: not a kubetune checkpoint (no meta.json); "
            f"use auto, never, or a checkpoints/step-N directory"
        )
    return path
