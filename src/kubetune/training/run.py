"""`kubetune train`: setup -> evaluate (before) -> fit -> evaluate (after) -> save.

The whole algorithm reads top to bottom in `train_from_recipe`. It is the same code for one
process and for N processes on M nodes: rank 0 does the I/O that must happen once, every
rank reads its own shard of the data, and collectives are only used where the math needs
them (gradient all-reduce inside DDP, one token count per step, eval sums, and a vote on
the memory budget when KUBETUNE_MEMORY_BUDGET is set).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kubetune.data import Batcher, PreparedData, prepare_data
from kubetune.errors import DataError, MemoryBudgetError, RunDirError
from kubetune.fsutil import atomic_write_json
from kubetune.models.attention import register as register_attention
from kubetune.models.finetune import TargetLoss, causal_lm, prepare_for_training
from kubetune.models.load import DTYPES, load_causal_lm, load_causal_lm_part, load_tokenizer, resolve_model
from kubetune.recipe import Recipe, load_recipe, recipe_to_yaml
from kubetune.training import checkpoint as ckpt
from kubetune.training import memory
from kubetune.training import rundir
from kubetune.training.dist import DistEnv, all_reduce_sum, init_distributed, shutdown
from kubetune.training.metrics import MetricsLog, Progress, plot_loss_curve
from kubetune.training.optim import build_optimizer, build_scheduler
from kubetune.recipe.layout import Layout, check_model, data_parallel_only
from kubetune.training.parallel import (
    clip_grad_norm,
    needs_replica_sync,
    plan_layout,
    sync_replicas,
)
from kubetune.training.parallel import wrap as wrap_parallel
from kubetune.training.pipeline import Pipeline, keep_stage

log = logging.getLogger("kubetune")


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    row: int = 0  # first unread row of `epoch`, counted over all data-parallel ranks
    tokens: int = 0  # real (non-padding) tokens trained on, all ranks
    train_time_s: float = 0.0
    eval_before: dict | None = None
    eval_history: list = field(default_factory=list)


def train_from_recipe(recipe_arg: str | None, overrides: list[str]) -> dict | None:
    wall0 = time.monotonic()
    recipe = load_recipe(recipe_arg, overrides).recipe
    env = init_distributed(recipe.train.device, recipe.parallel.backend, recipe.parallel.timeout_s)
    _setup_logging(env)
    try:
        return _train(recipe, env, wall0)
    finally:
        shutdown(env)


def _train(recipe: Recipe, env: DistEnv, wall0: float) -> dict | None:
    run_dir = Path(recipe.output_dir)
    layout = plan_layout(recipe.parallel, env)
    # Rank 0 alone judges the directory (others could see its half-written files) and tells
    # every rank, so that all of them stop together instead of waiting on a collective.
    problems = None
    if env.is_main:
        try:
            rundir.claim(run_dir, recipe)
        except RunDirError as e:
            problems = e.problems
    problems = gather_objects(problems, env)[0]
    if problems:
        raise RunDirError(*problems)
    _configure_threads(recipe, env)
    torch.manual_seed(recipe.train.seed)

    # --- setup: model, data, optimizer ------------------------------------------------
    source = resolve_model(recipe.model.name_or_path)
    tokenizer = load_tokenizer(source, recipe.model.revision, recipe.model.trust_remote_code)
    data = prepare_data(recipe, tokenizer)
    model = build_model(recipe, source, env, layout)
    check_model(layout, causal_lm(model).config, recipe)
    loss_module = TargetLoss(model)
    resume_from = _resume_path(recipe, run_dir)
    autocast = autocast_context(recipe, env)
    # The answers before training come from the whole model, before it is split over ranks
    # (a pipeline rank holds one stage: rank 0 loads the whole model for them, then frees it).
    answers_before = None
    if resume_from is None and (env.is_main or layout.pp == 1) and recipe.eval.generate:
        whole = build_model(recipe, source, env) if layout.pp > 1 else model
        answers_before = generate_answers(whole, tokenizer, data, recipe, env, autocast)
        del whole
    pipeline = None
    if layout.pp > 1:
        pipeline = Pipeline(loss_module, layout, env, recipe.train.micro_batch_size, recipe.data.max_seq_len,
                            recipe.train.grad_accum, tokenizer.pad_token_id, autocast, DTYPES[recipe.base_dtype_name()],
                            recipe.parallel.pp_schedule)
    train_module = wrap_parallel(loss_module, decoder_layers(model), layout, env, recipe.train.precision)
    optimizer = build_optimizer(model, recipe.train, impl="loop" if layout.tp > 1 else
                                "foreach" if layout.sharded else "fused")
    dp_rank, dp_size = layout.data_parallel_rank, layout.data_parallel_size
    batcher = Batcher(data.train, max_seq_len=recipe.data.max_seq_len, micro_batch_size=recipe.train.micro_batch_size,
                      packing=recipe.data.packing, seed=recipe.train.seed, pad_id=tokenizer.pad_token_id,
                      dp_rank=dp_rank, dp_size=dp_size)
    micro_per_epoch = batcher.micro_batches_left(0, 0)
    if micro_per_epoch == 0:
        raise DataError(f"data.train: {len(batcher.epoch_rows(0))} packed rows cannot feed {dp_size} processes; "
                        f"use more data or fewer processes")
    steps_per_epoch = math.ceil(micro_per_epoch / recipe.train.grad_accum)
    total_steps = recipe.train.max_steps or max(1, math.ceil(recipe.train.epochs * steps_per_epoch))
    # --- resume -----------------------------------------------------------------------
    if resume_from is not None:
        # Keep the schedule of the checkpointed run (its world size may differ), unless the
        # recipe now asks for a different length: then the new length wins.
        meta = ckpt.read_meta(resume_from)
        if meta.get("length") == [recipe.train.max_steps, recipe.train.epochs]:
            total_steps = meta.get("total_steps", total_steps)
    scheduler = build_scheduler(optimizer, recipe.train, total_steps)
    scaler = torch.amp.GradScaler(env.device.type) if recipe.train.precision == "fp16" else None
    state = TrainState()
    if resume_from is not None:
        meta = ckpt.load_checkpoint(resume_from, loss_module, optimizer, scheduler, env)
        state = TrainState(**{k: meta[k] for k in asdict(TrainState()) if k in meta})
        log.info("resumed from %s (step %d/%d)", resume_from, state.step, total_steps)
    if env.is_main:
        rundir.write_run(run_dir, recipe, "running")
    rows_per_step = recipe.train.micro_batch_size * recipe.train.grad_accum * dp_size
    log.info("model %s (%s, %s trainable params%s) | %d train / %d eval samples | %d steps x %d rows of <= %d "
             "tokens (global batch: %d rows, ~%d tokens) | %d process(es) on %s, %s",
             recipe.model.name_or_path, recipe.finetune.method, f"{_count_trainable(model):,}",
             " on stage 0" if layout.pp > 1 else "", len(data.train), len(data.eval) if data.eval else 0, total_steps,
             rows_per_step, recipe.data.max_seq_len, rows_per_step, rows_per_step * _mean_row_tokens(batcher),
             env.world_size, env.device, describe(layout))

    eval_batcher = make_eval_batcher(recipe, data, tokenizer, env, layout)
    if state.eval_before is None:
        state.eval_before = evaluate(loss_module, eval_batcher, env, autocast, layout, pipeline)
        state.eval_before["answers"] = answers_before or []
        log.info("eval before: loss %s perplexity %s", _f(state.eval_before["loss"]), _f(state.eval_before["perplexity"]))

    # --- fit --------------------------------------------------------------------------
    metrics = MetricsLog(run_dir / "metrics.jsonl", state.step) if env.is_main else None
    progress = Progress(total_steps, state.step, enabled=env.is_main)
    params = [p for p in model.parameters() if p.requires_grad]
    train_module.train()
    last_saved = state.step if resume_from else -1
    guard_memory = memory.budget_bytes() is not None
    while state.step < total_steps:
        t0 = time.perf_counter()
        batches = next_micro_batches(batcher, state, recipe.train.grad_accum)
        loss, grad_norm, tokens = train_step(pipeline or train_module, batches, optimizer, scheduler, scaler, params,
                                             recipe, env, autocast, layout)
        state.train_time_s += time.perf_counter() - t0
        state.step += 1
        state.tokens += tokens
        if env.is_main and (state.step % recipe.train.log_every == 0 or state.step == total_steps):
            tps = state.tokens / max(state.train_time_s, 1e-9)
            record = {"step": state.step, "total_steps": total_steps,
                      "epoch": round(state.epoch + state.row / max(1, batcher.usable_rows(state.epoch)), 4),
                      "loss": loss, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                      "tokens": state.tokens, "tokens_per_s": round(tps, 2),
                      "elapsed_s": round(time.monotonic() - wall0, 2)}
            metrics.write(record)
            progress.update(state.step, loss, record["lr"], state.tokens, tps)
        if recipe.train.eval_every and state.step % recipe.train.eval_every == 0 and state.step < total_steps:
            ev = evaluate(loss_module, eval_batcher, env, autocast, layout, pipeline)
            state.eval_history.append([state.step, ev["loss"]])
            (pipeline or train_module).train()
        if recipe.train.save_every and state.step % recipe.train.save_every == 0:
            save(run_dir, state, total_steps, loss_module, optimizer, scheduler, recipe, env)
            last_saved = state.step
        if guard_memory:  # the same on every rank (the pods share their env): stop together
            over = memory.over_budget(env.local_world_size)
            if all_reduce_sum(1 if over else 0, env) > 0:
                if last_saved != state.step:
                    save(run_dir, state, total_steps, loss_module, optimizer, scheduler, recipe, env)
                progress.close()
                raise MemoryBudgetError(f"{over or 'memory: another process of this job is over its budget'}; "
                                        f"{memory.advice(state.step, run_dir / 'checkpoints' / f'step-{state.step}')}")
    progress.close()
    if last_saved != state.step:
        save(run_dir, state, total_steps, loss_module, optimizer, scheduler, recipe, env)

    # --- evaluate (after) and export --------------------------------------------------
    after = evaluate(loss_module, eval_batcher, env, autocast, layout, pipeline)
    if layout.pp > 1:
        # Stages hold disjoint layers: rank 0 puts the trained weights into a whole model.
        full_state = gather_stages(loss_module, env)
        if env.is_main:
            model = build_model(recipe, source, env)
            load_trainable(model, full_state)
            full_state = None
        answers = generate_answers(model, tokenizer, data, recipe, env, autocast)
    else:
        answers = generate_answers(model, tokenizer, data, recipe, env, autocast, layout, loss_module)
        full_state = gather_trainable(loss_module) if layout.sharded else None  # a collective: all ranks
    rss_per_rank = gather_objects(_peak_rss_mb(), env)
    summary = None
    if env.is_main:
        export_trained(model, tokenizer, recipe, run_dir, full_state)
        summary = write_summary(run_dir, recipe, state, after, answers, wall0, rss_per_rank)
        if metrics is not None:
            metrics.close()
            plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss_curve.png", state.eval_history)
        rundir.write_run(run_dir, recipe, "finished")
        print_report(summary, run_dir)
    return summary


# --- parts -----------------------------------------------------------------------------

def build_model(recipe: Recipe, source: str, env: DistEnv, layout: Layout | None = None):
    """The model to train; with pipeline stages, only this rank's stage of it."""
    attn = register_attention() if recipe.model.attn_implementation == "sdpa" else recipe.model.attn_implementation
    dtype = DTYPES[recipe.base_dtype_name()]
    model = None
    if layout is not None and layout.pp > 1:
        model = load_causal_lm_part(source, dtype, attn, lambda lm: keep_stage(lm, layout.pp_rank, layout.pp),
                                    recipe.model.revision, recipe.model.trust_remote_code)
    if model is None:
        model = load_causal_lm(source, dtype, attn, recipe.model.revision, recipe.model.trust_remote_code)
    model = prepare_for_training(model, recipe)
    return model.to(env.device)


def decoder_layers(model) -> list:
    layers = causal_lm(model).model.layers
    return list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)


def describe(layout: Layout) -> str:
    parts = [f"{name} {n}" for name, n in (("dp", layout.dp), ("fsdp", layout.fsdp), ("tp", layout.tp),
                                           ("pp", layout.pp)) if n > 1]
    return " x ".join(parts) if parts else "no parallelism"


def replica_sum(value: float | int, env: DistEnv, layout: Layout) -> float:
    """Sum over data-parallel replicas of a number every rank of a replica knows (or, for the
    loss, only the last pipeline stage knows): one reporting rank per replica contributes."""
    return all_reduce_sum(value if layout.reporter else 0, env)


def autocast_context(recipe: Recipe, env: DistEnv):
    precision = recipe.train.precision
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(env.device.type, dtype=dtype)


def next_micro_batches(batcher: Batcher, state: TrainState, n: int) -> list:
    """Up to n micro-batches from the current position; a step never spans two epochs."""
    out = []
    while len(out) < n:
        if batcher.micro_batches_left(state.epoch, state.row) == 0:
            if out:
                break
            state.epoch, state.row = state.epoch + 1, 0
            continue
        batch, state.row = batcher.micro_batch(state.epoch, state.row)
        out.append(batch)
    return out


def train_step(module, batches, optimizer, scheduler, scaler, params, recipe: Recipe, env: DistEnv, autocast,
               layout: Layout):
    """One optimizer step over `batches`; returns (mean loss, grad norm, real tokens), all ranks.

    `module` is the (DDP / FSDP2 / tensor-parallel) loss module, or the Pipeline of this stage.
    """
    device = env.device
    # Normalise by the target tokens of the whole step on all replicas, so that N replicas
    # with grad_accum k compute exactly the gradient of 1 process with grad_accum N*k.
    n_targets = replica_sum(sum(b.target_tokens for b in batches), env, layout)
    scale = layout.data_parallel_size / max(n_targets, 1.0)  # gradients are averaged over replicas; undo that
    offload = (torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
               if recipe.train.gradient_checkpointing == "offload" else contextlib.nullcontext())
    if isinstance(module, Pipeline):
        with offload:
            loss_sum = module.step(batches, scale)
    else:
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, b in enumerate(batches):
            sync = i == len(batches) - 1 or not hasattr(module, "no_sync")
            with (contextlib.nullcontext() if sync else module.no_sync()), offload:
                with autocast():
                    loss = module(b.input_ids.to(device), b.position_ids.to(device), b.targets.to(device),
                                  b.cu_seqlens)
                scaled = loss * scale
                (scaler.scale(scaled) if scaler else scaled).backward()
            loss_sum += loss.detach()
        loss_sum = loss_sum.item()
    if needs_replica_sync(layout):
        sync_replicas(params, layout)
    if scaler:
        scaler.unscale_(optimizer)
    max_norm = recipe.train.max_grad_norm if recipe.train.max_grad_norm else float("inf")
    grad_norm = clip_grad_norm(params, max_norm, layout)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    total_loss = replica_sum(loss_sum, env, layout)
    tokens = int(replica_sum(sum(b.real_tokens for b in batches), env, layout))
    return total_loss / max(n_targets, 1.0), float(grad_norm), tokens


def make_eval_batcher(recipe: Recipe, data: PreparedData, tokenizer, env: DistEnv,
                      layout: Layout | None = None) -> Batcher | None:
    if data.eval is None or len(data.eval) == 0:
        return None
    ev = data.eval
    if recipe.eval.max_samples and len(ev) > recipe.eval.max_samples:
        ev = ev.subset(range(recipe.eval.max_samples))
    layout = layout or data_parallel_only(env.world_size, env.rank)
    # A pipeline's micro-batches have one shape, the training one.
    rows = recipe.train.micro_batch_size if layout.pp > 1 else recipe.eval.batch_size
    return Batcher(ev, max_seq_len=recipe.data.max_seq_len, micro_batch_size=rows, packing=True, seed=0,
                   pad_id=tokenizer.pad_token_id, dp_rank=layout.data_parallel_rank,
                   dp_size=layout.data_parallel_size, shuffle=False)


@torch.no_grad()
def evaluate(loss_module, batcher: Batcher | None, env: DistEnv, autocast, layout: Layout | None = None,
             pipeline: Pipeline | None = None) -> dict:
    """Token-averaged loss over the eval targets, and its perplexity (exp of it)."""
    if batcher is None:
        return {"loss": None, "perplexity": None, "tokens": 0}
    layout = layout or data_parallel_only(env.world_size, env.rank)
    was_training = loss_module.training
    (pipeline or loss_module).train(False)
    loss_sum, n, row = 0.0, 0, 0
    while batcher.micro_batches_left(0, row) > 0:
        batches = []
        while batcher.micro_batches_left(0, row) > 0 and len(batches) < (pipeline.n_micro if pipeline else 1):
            b, row = batcher.micro_batch(0, row)
            batches.append(b)
        if pipeline is not None:
            loss_sum += pipeline.loss_sum(batches)
        else:
            b = batches[0]
            with autocast():
                loss_sum += float(loss_module(b.input_ids.to(env.device), b.position_ids.to(env.device),
                                              b.targets.to(env.device), b.cu_seqlens))
        n += sum(b.target_tokens for b in batches)
    (pipeline or loss_module).train(was_training)
    loss_sum, n = replica_sum(loss_sum, env, layout), replica_sum(n, env, layout)
    if n == 0:  # nothing to score: say so instead of reporting a perfect perplexity of 1.0
        return {"loss": None, "perplexity": None, "tokens": 0}
    loss = loss_sum / n
    return {"loss": round(loss, 6), "perplexity": round(math.exp(loss), 4), "tokens": int(n)}


@torch.no_grad()
def generate_answers(model, tokenizer, data: PreparedData, recipe: Recipe, env: DistEnv, autocast,
                     layout: Layout | None = None, loss_module=None) -> list[dict]:
    """Greedy answers to the first few eval prompts, kept by rank 0.

    A whole model: only rank 0 generates. Sharded (FSDP2 or tensor parallel), every rank must
    take part in each forward's collectives: all ranks decode greedily in lockstep (the
    same tokens everywhere).
    """
    sharded = layout is not None and layout.sharded
    if (not env.is_main and not sharded) or recipe.eval.generate == 0 or not data.eval_rows:
        return []
    lm = causal_lm(model)
    was_training = lm.training
    lm.eval()
    fsdp = sharded and layout.fsdp > 1
    if fsdp:
        loss_module.unshard()  # the root's own parameters (embeddings, head) are used outside its forward
    out = []
    for row in data.eval_rows[: recipe.eval.generate]:
        prompt = data.renderer.prompt(row)
        out.append({"prompt": prompt, "reference": row.get("output") or row.get("messages", [{}])[-1].get("content"),
                    "answer": generate_text(lm, tokenizer, prompt, recipe.eval.max_new_tokens,
                                            add_special_tokens=not data.renderer.uses_chat_template,
                                            device=env.device, autocast=autocast)})
    if fsdp:
        loss_module.reshard()
    lm.train(was_training)
    return out if env.is_main else []


def generate_text(lm, tokenizer, prompt: str, max_new_tokens: int, add_special_tokens: bool, device,
                  autocast=contextlib.nullcontext, temperature: float = 0.0) -> str:
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=add_special_tokens).to(device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with autocast():
        out = lm.generate(**enc, max_new_tokens=max_new_tokens, use_cache=True, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id, **sampling)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def save(run_dir, state: TrainState, total_steps, loss_module, optimizer, scheduler, recipe: Recipe, env: DistEnv):
    meta = {**asdict(state), "total_steps": total_steps, "seed": recipe.train.seed,
            "length": [recipe.train.max_steps, recipe.train.epochs]}
    ckpt.save_checkpoint(run_dir, state.step, loss_module, optimizer, scheduler, meta, recipe_to_yaml(recipe), env,
                         recipe.train.keep_last)


def _resume_path(recipe: Recipe, run_dir: Path) -> Path | None:
    mode = recipe.train.resume
    if mode == "never":
        if ckpt.latest_checkpoint(run_dir) is not None:
            raise RunDirError(f"train.resume=never but {run_dir} already holds checkpoints; "
                              f"choose another output_dir=... or use train.resume=auto")
        return None
    if mode == "auto":
        return ckpt.latest_checkpoint(run_dir)
    path = Path(mode)
    if not (path / "meta.json").is_file():
        raise RunDirError(f"train.resume={mode}: not a kubetune checkpoint (no meta.json); "
                          f"use auto, never, or a checkpoints/step-N directory")
    return path


def gather_trainable(loss_module) -> dict:
    """Full (unsharded) trainable weights on CPU, names without the TargetLoss prefix."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(loss_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                    ignore_frozen_params=True))
    return {k.removeprefix("model."): v for k, v in sd.items()}


def gather_stages(loss_module, env: DistEnv) -> dict:
    """Every pipeline stage's trainable weights (whole tensors, on CPU), merged on every rank."""
    local = {}
    for name, p in loss_module.named_parameters():
        if p.requires_grad:
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t  # tensor-parallel slices
            local[name.removeprefix("model.")] = t.cpu()
    merged = {}
    for part in gather_objects(local, env):
        merged.update(part)
    return merged


def load_trainable(model, state: dict) -> None:
    """Put trained weights (names as `gather_trainable` gives them) into a freshly built model."""
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"trained weights the model does not have: {result.unexpected_keys[:3]}")


def export_trained(model, tokenizer, recipe: Recipe, run_dir: Path, full_state: dict | None = None) -> None:
    """LoRA: output_dir/adapter (PEFT format). Full: output_dir/model (HF directory).

    `full_state` holds the gathered weights of a sharded (FSDP2) run: the model's own
    tensors are shards there, so they are written from the gathered copy instead.
    """
    from kubetune.fsutil import atomic_dir

    target = run_dir / ("adapter" if recipe.finetune.method == "lora" else "model")
    with atomic_dir(target) as tmp:
        if full_state is None:
            model.save_pretrained(tmp, safe_serialization=True)
        elif recipe.finetune.method == "lora":
            from peft.utils import get_peft_model_state_dict
            from safetensors.torch import save_file

            adapter = get_peft_model_state_dict(model, state_dict=full_state)
            save_file({k: v.contiguous() for k, v in adapter.items()}, tmp / "adapter_model.safetensors")
            model.peft_config["default"].save_pretrained(tmp)
        else:
            causal_lm(model).save_pretrained(tmp, state_dict=full_state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def gather_objects(value, env: DistEnv) -> list:
    if not env.distributed:
        return [value]
    out = [None] * env.world_size
    torch.distributed.all_gather_object(out, value)
    return out


def write_summary(run_dir: Path, recipe: Recipe, state: TrainState, after: dict, answers: list, wall0: float,
                  rss_per_rank: list[float]) -> dict:
    before = state.eval_before or {}
    before_answers = {a["prompt"]: a["answer"] for a in before.get("answers", [])}
    summary = {
        "model": recipe.model.name_or_path,
        "method": recipe.finetune.method,
        "steps": state.step,
        "eval_loss_before": before.get("loss"),
        "eval_loss_after": after["loss"],
        "perplexity_before": before.get("perplexity"),
        "perplexity_after": after["perplexity"],
        "eval_tokens": after["tokens"],
        "train_tokens": state.tokens,
        "tokens_per_s": round(state.tokens / max(state.train_time_s, 1e-9), 2),
        "train_time_s": round(state.train_time_s, 2),
        "wall_s": round(time.monotonic() - wall0, 2),
        "peak_rss_mb": rss_per_rank[0],
        "peak_rss_mb_per_rank": rss_per_rank,
        "world_size": len(rss_per_rank),
        "samples": [{**a, "answer_before": before_answers.get(a["prompt"])} for a in answers],
    }
    atomic_write_json(run_dir / "summary.json", summary)
    return summary


def print_report(summary: dict, run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    table = Table(title=f"kubetune: {summary['model']} ({summary['method']}), {summary['steps']} steps")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_row("eval loss", _f(summary["eval_loss_before"]), _f(summary["eval_loss_after"]))
    table.add_row("perplexity", _f(summary["perplexity_before"]), _f(summary["perplexity_after"]))
    console.print(table)
    console.print(f"trained on {summary['train_tokens']:,} tokens at {summary['tokens_per_s']:.0f} tokens/s; "
                  f"wall {summary['wall_s']:.0f} s; peak RSS {summary['peak_rss_mb']:.0f} MB")
    for s in summary["samples"][:1]:
        question = s["prompt"].split("user\n")[-1].split("<|im_end|>")[0].strip() if "user\n" in s["prompt"] else s["prompt"]
        console.print(f"\n[bold]question:[/bold] {question}")
        if s.get("answer_before") is not None:
            console.print(f"[bold]before:[/bold]   {s['answer_before']}")
        console.print(f"[bold]after:[/bold]    {s['answer']}")
        console.print(f"[bold]reference:[/bold] {s['reference']}")
    console.print(f"\noutputs in {run_dir}/ (summary.json, metrics.jsonl, loss_curve.png, adapter/, checkpoints/)")


def eval_target(target: str, overrides: list[str]) -> dict:
    """`kubetune eval RUN_DIR|RECIPE`: loss and perplexity of the trained (or base) model."""
    from kubetune.export import load_trained

    run = Path(target)
    env = init_distributed("auto")
    _setup_logging(env)
    if (run / "run.json").is_file():
        recipe = load_recipe(run / "recipe.yaml", overrides).recipe
        model, tokenizer = load_trained(run, recipe, for_training=True)
    else:
        recipe = load_recipe(target, overrides).recipe
        source = resolve_model(recipe.model.name_or_path)
        tokenizer = load_tokenizer(source, recipe.model.revision, recipe.model.trust_remote_code)
        model = load_causal_lm(source, DTYPES[recipe.base_dtype_name()], register_attention())
    _configure_threads(recipe, env)
    data = prepare_data(recipe, tokenizer)
    res = evaluate(TargetLoss(model), make_eval_batcher(recipe, data, tokenizer, env), env,
                   autocast_context(recipe, env))
    print(f"eval loss {_f(res['loss'])}  perplexity {_f(res['perplexity'])}  ({res['tokens']} target tokens)")
    return res


def _configure_threads(recipe: Recipe, env: DistEnv) -> None:
    if env.device.type != "cpu":
        return
    n = recipe.train.num_threads or int(os.environ.get("OMP_NUM_THREADS", "0")) or max(
        1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    torch.set_num_threads(n)


def _count_trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _mean_row_tokens(batcher: Batcher) -> int:
    rows = batcher.epoch_rows(0)
    return int(sum(batcher.data.lengths) / max(1, len(rows)))


def _f(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _setup_logging(env: DistEnv) -> None:
    level = logging.INFO if env.is_main else logging.WARNING
    logging.basicConfig(level=level, format=f"kubetune[{env.rank}]: %(message)s" if env.distributed else "kubetune: %(message)s")
    for noisy in ("transformers", "datasets", "torch.distributed.checkpoint", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
