"""Everything a run trains with, built once: `setup(recipe, env) -> TrainParts`.

The order matters where processes must agree: the mesh first (a collective), then the
model (each pipeline rank builds only its stage), the parallel wrapping, and last the
optimizer over the wrapped parameters.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kubetune.data import Batcher, PreparedData, prepare_data
from kubetune.data.packing import flat_rows, static_shapes
from kubetune.data.tokenize import TokenizedData
from kubetune.errors import DataError, RunDirError
from kubetune.models.attention import seqlens_from_cu
from kubetune.models.decoding import AutocastFactory
from kubetune.models.finetune import (
    COMPILE_BACKENDS,
    ModelParts,
    build_model,
    compile_regions,
    compiled_regions,
    compiles_mlp,
)
from kubetune.models.kernels import KernelPlan, ModelShapes, autocast_context
from kubetune.models.kernels import choose as choose_kernels
from kubetune.models.load import DTYPES, load_config, load_tokenizer, resolve_model
from kubetune.models.stages import Stage
from kubetune.recipe import Recipe
from kubetune.recipe.layout import Layout, check_model, check_recipe, global_batch, grad_accum_for, with_grad_accum
from kubetune.recipe.schema import OFFLOADS
from kubetune.rundir import RunDir
from kubetune.training import checkpoint as ckpt
from kubetune.training import preference
from kubetune.training.auto_compile import AutoCompile
from kubetune.training.dist import DistEnv, gather_objects
from kubetune.training.grpo import GRPOTraining
from kubetune.training.optim import Optimization, build_optimization
from kubetune.training.parallel import MeshLayout
from kubetune.training.parallel import wrap as wrap_parallel
from kubetune.training.pipeline import PipelineRunner
from kubetune.training.preference import PreferenceTraining
from kubetune.training.runner import LocalRunner, StepRunner
from kubetune.training.telemetry import Telemetry, open_metrics, start_telemetry
from kubetune.training.tracking import Tracking


@dataclass(frozen=True)
class TrainParts:
    recipe: Recipe  # with this machine's kernel choices in place of `auto`
    recipe_as_given: Recipe  # what the run record and its fingerprint hold
    kernels: KernelPlan
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
    telemetry: Telemetry  # Prometheus metrics (monitor.port) and Kubeflow progress
    tracking: Tracking  # rank 0's experiment trackers (monitor.report_to), opened by resume_or_start; none elsewhere
    auto_compile: AutoCompile | None  # train.compile=auto: decided on the first steps
    preference: PreferenceTraining | None = None  # finetune.objective = dpo | orpo | simpo (None: sft)
    rl: GRPOTraining | None = None  # finetune.objective = grpo


def setup(given: Recipe, env: DistEnv, layout: MeshLayout, run_dir: RunDir, started_at: float) -> TrainParts:
    check_recipe(layout, given)  # the batch and the layout's demands, before the data and the model load
    configure_threads(given.train.num_threads, env)
    metrics = open_metrics(given, env)  # first: a taken port fails before the model loads
    torch.manual_seed(given.train.seed)
    source = resolve_model(given.model.name_or_path)
    tokenizer = load_tokenizer(source, given.model.revision, given.model.trust_remote_code)
    data = prepare_data(given, tokenizer)
    batcher = batcher_for(given, data, tokenizer.pad_token_id, layout, env.device.type)
    config = load_config(source, given.model.revision, given.model.trust_remote_code)
    check_model(layout, config, given)
    kernels = resolve_kernels(given, config, batcher, env)
    recipe = with_grad_accum(given.with_kernels(kernels.precision, kernels.attention), layout.data_parallel_size)
    log_warnings(recipe, batcher, layout, env)
    stage = Stage(layout.pp_rank, layout.pp) if layout.pp > 1 else None
    model = build_model(recipe, source, env.device, stage, kernels.grouped_up_to)
    autocast = autocast_context(recipe.train.precision, env.device)
    resume_from = resume_path(recipe.train.resume, run_dir)
    total_steps = plan_steps(recipe, batcher, resume_from)
    # a pipeline stage is set up on the unwrapped layers; tensor parallelism then splits them in place
    pipeline = pipeline_runner(recipe, model, layout, env, autocast, tokenizer.pad_token_id) if layout.pp > 1 else None
    precompute = preference.precomputes(recipe, total_steps, steps_per_epoch(recipe, batcher))
    start = preference_start(recipe, model, precompute, env)  # before wrapping: the starting weights
    wrapped = wrap_parallel(model.loss, model.layers, layout, env, recipe.train.precision)
    optim = build_optimization(model.model, recipe.train, layout, env.device, total_steps)
    runner = pipeline or LocalRunner(
        wrapped,
        model.loss,
        env.device,
        autocast,
        optim.scaler,
        offload=recipe.train.gradient_checkpointing in OFFLOADS,
    )
    trainable = sum(p.numel() for p in optim.params)
    telemetry = start_telemetry(metrics, recipe, env, config, trainable, total_steps, wrapped)
    parts = TrainParts(
        recipe=recipe,
        recipe_as_given=given,
        kernels=kernels,
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
        eval_batcher=eval_batcher(recipe, data, tokenizer.pad_token_id, layout, env.device.type),
        autocast=autocast,
        total_steps=total_steps,
        resume_from=resume_from,
        started_at=started_at,
        telemetry=telemetry,
        tracking=Tracking(),
        auto_compile=auto_compile(recipe, model, env, config),
    )
    return with_objective(parts, start, precompute)


def with_objective(parts: TrainParts, start: torch.nn.Module | None, precompute: bool) -> TrainParts:
    """The parts with their objective's trainer: GRPO's, a preference objective's, or none (SFT)."""
    if parts.recipe.finetune.objective == "grpo":
        return dataclasses.replace(parts, rl=grpo_training(parts, start))
    return dataclasses.replace(parts, preference=preference_training(parts, start, precompute))


def batcher_for(recipe: Recipe, data: PreparedData, pad_id: int, layout: Layout, device_type: str) -> Batcher:
    """What a step reads: GRPO's prompts, or the training rows."""
    if recipe.finetune.objective == "grpo":
        return prompt_batcher(recipe, data, pad_id, layout)
    return train_batcher(recipe, data, pad_id, layout, device_type)


def log_warnings(recipe: Recipe, batcher: Batcher, layout: MeshLayout, env: DistEnv) -> None:
    """The recipe's warnings for this run, logged once (by the main process)."""
    warnings = recipe.train.loss_scale_warnings() + batch_warnings(recipe, batcher, layout)
    for line in warnings if env.is_main else []:
        logging.getLogger("kubetune").warning("warning: %s", line)


def batch_warnings(recipe: Recipe, batcher: Batcher, layout: MeshLayout) -> list[str]:
    """A global batch beyond the data: each epoch would be a single optimizer step (or less)."""
    rows = len(batcher.epoch_rows(0))
    step = global_batch(recipe.train, layout.data_parallel_size)
    if step <= rows:
        return []
    if recipe.train.global_batch_size:
        what, fix = "train.global_batch_size", f"lower train.global_batch_size to at most {rows}"
    else:
        what = f"train.micro_batch_size x train.grad_accum x {layout.data_parallel_size} data-parallel replica(s)"
        fix = f"lower train.micro_batch_size or train.grad_accum until a step is at most {rows} rows"
    line = (
        f"a step of {step} rows ({what}) is more than the {rows} rows of an epoch (samples packed into "
        f"data.max_seq_len={recipe.data.max_seq_len} tokens): every epoch is one optimizer step; {fix}"
    )
    return [line]


def auto_compile(recipe: Recipe, model: ModelParts, env: DistEnv, config: Any) -> AutoCompile | None:
    """What `train.compile=auto` compiles, and what its measurements depend on (None: nothing
    to decide). GRPO's rollouts run the same layers under another attention and other shapes:
    compiled regions would recompile around every generation, so `auto` leaves them eager."""
    if recipe.train.compile != "auto" or recipe.finetune.objective == "grpo":
        return None
    mlp, backend = compiles_mlp(recipe), COMPILE_BACKENDS.get(env.device.type, "inductor")
    key = {
        "device": env.device.type,
        "processes": env.world_size,
        "layer": {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "intermediate_size")},
        "precision": recipe.train.precision,
        "finetune": recipe.finetune.method,
        "lora": recipe.lora.model_dump(mode="json"),
        "rows": [recipe.train.micro_batch_size, recipe.data.max_seq_len],
        "mlp": mlp,
        # a preference step (its reference forward, its per-sample head) compiles another share of its work
        **({"objective": recipe.finetune.objective} if recipe.finetune.objective != "sft" else {}),
    }
    regions = compiled_regions(model.lm, mlp)
    return AutoCompile(regions, lambda: compile_regions(model.lm, mlp, backend), key, env)


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
        offload=recipe.train.gradient_checkpointing in OFFLOADS,
    )


def resolve_kernels(recipe: Recipe, config: Any, batcher: Batcher, env: DistEnv) -> KernelPlan:
    """The recipe's `auto` precision and attention kernel, measured on this machine (see
    kubetune.models.kernels). Rank 0 decides alone (its probe is not disturbed by the others,
    which wait here) and every rank takes its choice: ranks must agree on dtypes."""
    plan = None
    if env.is_main:
        shapes = ModelShapes.of(config, first_row_samples(batcher))
        plan = choose_kernels(recipe.train.precision, recipe.model.packed_attention, shapes, env.device)
    plan = gather_objects(plan, env)[0]
    assert plan is not None
    return plan


def first_row_samples(batcher: Batcher) -> list[int]:
    """The sample lengths of the first packed row of the data: what attention really sees."""
    lengths = seqlens_from_cu(batcher.micro_batch(0, 0)[0].cu_seqlens)
    row: list[int] = []
    total = 0
    for n in lengths:
        if row and total + n > batcher.max_seq_len:
            break
        row.append(n)
        total += n
    return row


def configure_threads(num_threads: int | None, env: DistEnv) -> None:
    if env.device.type != "cpu":
        return
    n = (
        num_threads
        or int(os.environ.get("OMP_NUM_THREADS", "0"))
        or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    )
    torch.set_num_threads(n)


def train_batcher(recipe: Recipe, data: PreparedData, pad_id: int, layout: Layout, device_type: str = "cpu") -> Batcher:
    batcher = Batcher(
        data.train,
        max_seq_len=recipe.data.max_seq_len,
        micro_batch_size=recipe.train.micro_batch_size,
        packing=recipe.data.packing,
        seed=recipe.train.seed,
        pad_id=pad_id,
        dp_rank=layout.data_parallel_rank,
        dp_size=layout.data_parallel_size,
        buckets=static_shapes(device_type, recipe.data.max_seq_len),
        flat=flat_rows(device_type, layout.pp),
    )
    if batcher.micro_batches_left(0, 0) == 0:
        raise DataError(
            f"data.train: {len(batcher.epoch_rows(0))} packed rows cannot feed "
            f"{layout.data_parallel_size} processes; use more data or fewer processes"
        )
    return batcher


def eval_batcher(
    recipe: Recipe, data: PreparedData, pad_id: int, layout: Layout, device_type: str = "cpu"
) -> Batcher | None:
    if data.eval is None or len(data.eval) == 0 or recipe.finetune.objective == "grpo":  # GRPO evaluates by sampling
        return None
    ev = data.eval
    if recipe.eval.max_samples and len(ev) > recipe.eval.max_samples:
        ev = ev.subset(range(recipe.eval.max_samples))
    return every_row_batcher(recipe, ev, pad_id, layout, device_type)


def every_row_batcher(
    recipe: Recipe, data: TokenizedData, pad_id: int, layout: Layout, device_type: str = "cpu"
) -> Batcher:
    """Every row of `data` in order, in eval's micro-batches (a share of them per replica)."""
    # A pipeline's micro-batches have one shape, the training one.
    rows = recipe.train.micro_batch_size if layout.pp > 1 else recipe.eval.batch_size
    return Batcher(
        data,
        max_seq_len=recipe.data.max_seq_len,
        micro_batch_size=rows,
        packing=True,
        seed=0,
        pad_id=pad_id,
        dp_rank=layout.data_parallel_rank,
        dp_size=layout.data_parallel_size,
        shuffle=False,
        every_row=True,
        buckets=static_shapes(device_type, recipe.data.max_seq_len),
        flat=flat_rows(device_type, layout.pp),
    )


def plan_steps(recipe: Recipe, batcher: Batcher, resume_from: Path | None) -> int:
    """Optimizer steps of the whole run. A resumed run keeps the schedule of the checkpointed
    run (its world size may differ), unless the recipe now asks for a different length."""
    total = recipe.train.max_steps or max(1, math.ceil(recipe.train.epochs * steps_per_epoch(recipe, batcher)))
    if resume_from is not None:
        meta = ckpt.read_meta(resume_from)
        if meta.length == (recipe.train.max_steps, recipe.train.epochs):
            total = meta.total_steps
    return total


def steps_per_epoch(recipe: Recipe, batcher: Batcher) -> int:
    if recipe.finetune.objective == "grpo":  # a micro-batch of prompts is one generation
        rl = recipe.finetune.rl
        steps = rl.generation_steps(recipe.train.grad_accum) // recipe.train.grad_accum * rl.num_iterations
        return batcher.micro_batches_left(0, 0) * steps
    return math.ceil(batcher.micro_batches_left(0, 0) / recipe.train.grad_accum)


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


def prompt_batcher(recipe: Recipe, data: PreparedData, pad_id: int, layout: Layout) -> Batcher:
    """GRPO's prompts: one micro-batch is one generation's prompts of this process."""
    rl, accum = recipe.finetune.rl, grad_accum_for(recipe.train, layout.data_parallel_size)
    per_generation = recipe.train.micro_batch_size * rl.generation_steps(accum) // rl.num_generations
    batcher = Batcher(
        data.train,
        max_seq_len=recipe.data.max_seq_len,
        micro_batch_size=per_generation,
        packing=False,
        seed=recipe.train.seed,
        pad_id=pad_id,
        dp_rank=layout.data_parallel_rank,
        dp_size=layout.data_parallel_size,
    )
    if batcher.micro_batches_left(0, 0) == 0:
        raise DataError(
            f"data.train: {len(data.train)} prompts cannot give {layout.data_parallel_size} process(es) "
            f"{per_generation} prompts each per generation; use more prompts or fewer processes"
        )
    return batcher


def grpo_training(parts: TrainParts, start: torch.nn.Module | None) -> GRPOTraining:
    runner = parts.runner
    assert isinstance(runner, LocalRunner)  # the recipe check refuses pipelines for grpo
    return GRPOTraining(
        parts.recipe,
        runner,
        parts.model,
        parts.tokenizer,
        parts.data,
        parts.batcher,
        parts.layout,
        parts.env,
        parts.autocast,
        parts.run_dir.path,
        start,
    )


def preference_start(recipe: Recipe, model: ModelParts, precompute: bool, env: DistEnv) -> torch.nn.Module | None:
    """DPO's reference as a frozen copy of the starting weights, when the run needs one: reference=copy
    (auto under full fine-tuning) with the log-probs computed on the fly. Precomputed, the reference
    is the model itself before step 1, and no copy is made."""
    if recipe.finetune.objective == "grpo":  # full fine-tuning's KL reference
        wanted = recipe.finetune.rl.beta > 0 and recipe.finetune.method == "full"
        return preference.frozen_copy(model.loss) if wanted else None
    if recipe.finetune.objective != "dpo" or preference.reference_kind(recipe) != "copy" or precompute:
        return None
    preference.check_copy_fits(model.loss, env)
    return preference.frozen_copy(model.loss)


def preference_training(
    parts: TrainParts, start: torch.nn.Module | None, precompute: bool
) -> PreferenceTraining | None:
    """The objective and its reference; with precomputed reference log-probs, their tables
    (computed here, before any checkpoint is loaded: the model still holds the starting weights)."""
    recipe = parts.recipe
    if recipe.finetune.objective == "sft":
        return None
    training = preference.build(recipe, parts.runner, parts.model.model, start)
    if training.reference is None or not precompute:
        return training
    pad, device_type = parts.tokenizer.pad_token_id, parts.env.device.type
    every_pair = every_row_batcher(recipe, parts.batcher.data, pad, parts.layout, device_type)
    path = parts.run_dir.path / preference.REFERENCE_FILE
    training.precompute(path, every_pair, parts.eval_batcher, parts.layout, parts.env)
    return training
