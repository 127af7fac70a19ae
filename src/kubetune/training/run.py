"""`kubetune train`: claim the run directory -> set up -> resume or start -> fit -> finish.

Each phase is one function below, in the order they run. It is the same code for one
process and for N processes on M nodes: rank 0 does the I/O that must happen once, every
rank reads its own shard of the data, and collectives are only used where the math needs
them (gradient reduction inside the parallel wrappers, one token count per step, eval sums,
and a vote on the memory budget when KUBETUNE_MEMORY_BUDGET is set).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from kubetune.data.packing import Batch
from kubetune.errors import MemoryBudgetError, RunDirError
from kubetune.export.weights import save_trained
from kubetune.recipe import Recipe, load_recipe, recipe_to_yaml
from kubetune.rundir import RunDir
from kubetune.training import allocator, memory
from kubetune.training import checkpoint as ckpt
from kubetune.training.answers import sample_answers, whole_model
from kubetune.training.checkpoint import CheckpointMeta, TrainState
from kubetune.training.dist import DistEnv, all_reduce_sum, gather_objects, init_distributed, shutdown
from kubetune.training.parallel import plan_layout
from kubetune.training.report import Summary, fmt_number, peak_rss_mb, print_report, setup_logging
from kubetune.training.runlog import RunLog, plot_loss_curve, print_eval_line
from kubetune.training.setup import TrainParts, setup
from kubetune.training.step import EvalResult, StepResult, evaluate, next_micro_batches, train_step
from kubetune.training.tracking import refuse_unreachable

log = logging.getLogger("kubetune")


def train_from_recipe(recipe_arg: str | None, overrides: list[str]) -> Summary | None:
    """Train as the recipe says; returns the summary on rank 0 (None on other ranks)."""
    started_at = time.monotonic()
    recipe = load_recipe(recipe_arg, overrides).recipe
    check_eval_tasks(recipe)
    env = init_distributed(recipe.train.device, recipe.parallel.backend, recipe.parallel.timeout_s)
    setup_logging(env)
    try:
        layout = plan_layout(recipe.parallel, env)
        run_dir = claim_run_dir(recipe, env)
        parts = setup(recipe, env, layout, run_dir, started_at)
        try:
            state = resume_or_start(parts)
            fit(parts, state)
            return finish(parts, state)
        finally:
            parts.telemetry.close()  # the port and the collective observer, for a next run in this process
            parts.tracking.close(finished=False)  # a run that stopped early (finish closed a finished one)
    finally:
        shutdown(env)


def check_eval_tasks(recipe: Recipe) -> None:
    """eval.tasks known and their data at hand before step 1, not after the last (one line, exit 2)."""
    if recipe.eval.tasks:
        from kubetune.training.lm_tasks import parse_tasks, task_manager

        task_manager(parse_tasks(",".join(recipe.eval.tasks), "eval.tasks"))


def claim_run_dir(recipe: Recipe, env: DistEnv) -> RunDir:
    """Rank 0 alone judges the directory (others could see its half-written files) and tells
    every rank, so that all of them stop together instead of waiting on a collective."""
    run_dir = RunDir(Path(recipe.output_dir))
    problems = None
    if env.is_main:
        try:
            run_dir.claim(recipe)
        except RunDirError as e:
            problems = e.problems
    problems = gather_objects(problems, env)[0]
    if problems:
        raise RunDirError(*problems)
    return run_dir


def resume_or_start(parts: TrainParts) -> TrainState:
    """The state to continue from: a checkpoint's, or a fresh one evaluated before training."""
    if parts.resume_from is not None:
        meta = ckpt.load_checkpoint(
            parts.resume_from, parts.model.loss, parts.optim.optimizer, parts.optim.scheduler, parts.env
        )
        if parts.optim.scaler is not None and meta.loss_scaler:
            parts.optim.scaler.load_state_dict(meta.loss_scaler)
        log.info("resumed from %s (step %d/%d)", parts.resume_from, meta.state.step, parts.total_steps)
        state = meta.state
        state.resumes += 1
    else:
        state = TrainState()
    if parts.env.is_main:
        parts.run_dir.write_record(parts.recipe_as_given, "running")
    start_tracking(parts, state)
    log.info("%s", describe_run(parts))
    train = parts.recipe.train
    if hint := micro_batch_hint(
        parts.env.device.type,
        train.micro_batch_size,
        train.grad_accum,
        train.global_batch_size is not None,
        parts.layout.pp > 1 or parts.rl is not None,
    ):
        log.info("%s", hint)
    log.info("%s", parts.data.renderer.describe())  # data.template=auto: which one, and why
    log.info("%s", parts.kernels.describe())
    if parts.env.device.type == "cpu":
        log.info("memory allocator: %s", allocator.describe())
    if state.eval_before is None:
        answers = sample_answers(parts, whole_model(parts, trained=False)) if parts.recipe.eval.generate else []
        before = evaluate_and_print(parts, epoch_of(parts, state))
        state.eval_before = {**before.as_dict(), "answers": answers}
        parts.telemetry.evaluated(before.loss)
        log.info("eval before: loss %s perplexity %s", fmt_number(before.loss), fmt_number(before.perplexity))
    return state


def start_tracking(parts: TrainParts, state: TrainState) -> None:
    """Rank 0's experiment trackers, opened once the run record is written (their files then lie in
    a run directory); with monitor.report_to_required, one that cannot be reached stops every rank
    here, before step 1 (rank 0 tells the others, as in `claim_run_dir`)."""
    problems = parts.tracking.open(parts.recipe_as_given, parts.run_dir, parts.env.is_main)
    refuse_unreachable(gather_objects(problems, parts.env)[0])
    parts.tracking.start(parts.recipe, state.step)


def fit(parts: TrainParts, state: TrainState) -> None:
    """Optimizer steps until the planned total, with logging, evaluation, checkpoints and
    the memory guard between them."""
    recipe, env, telemetry = parts.recipe, parts.env, parts.telemetry
    run_log = RunLog(
        parts.run_dir.metrics_file,
        parts.total_steps,
        state.step,
        writes_metrics=env.is_main,
        prints=env.local_rank == 0,  # every node's first process: any pod's log shows training
        rank=env.rank if env.distributed else None,
        rows_per_step=rows_in_a_step(parts),
        on_row=parts.tracking.row,
    )
    last_saved = state.step if parts.resume_from else -1
    telemetry.started(state.step, state.epoch, state.resumes)
    parts.runner.train()
    while state.step < parts.total_steps:
        if parts.auto_compile:
            parts.auto_compile.before_step()
        t0 = time.perf_counter()
        if parts.rl is not None:  # it takes its prompts when it samples a generation
            result = parts.rl.train_step(parts.optim, state)
        else:
            batches = next_micro_batches(parts.batcher, state, recipe.train.grad_accum)
            data_s = time.perf_counter() - t0
            result = one_step(parts, batches)
            result = dataclasses.replace(result, phases={"data": data_s, **result.phases})
        step_s = time.perf_counter() - t0
        state.train_time_s += step_s
        state.step += 1
        state.tokens += result.tokens
        if parts.auto_compile and (
            decided := parts.auto_compile.after_step(step_s, result.tokens, parts.total_steps - state.step)
        ):
            log.info("%s", decided)
        telemetry.step(state.step, result.phases, result.loss, result.grad_norm, result.tokens)
        run_log.trained(result.loss)
        if state.step % recipe.train.log_every == 0 or state.step == parts.total_steps:
            epoch = epoch_of(parts, state)
            run_log.step(state, result, parts.optim.lr, epoch, time.monotonic() - parts.started_at)
            tps = state.tokens / max(state.train_time_s, 1e-9)
            telemetry.logged(state.step, epoch, result.loss, parts.optim.lr, result.grad_norm, tps)
            telemetry.objective(result.objective_metrics)
        if recipe.train.eval_every and state.step % recipe.train.eval_every == 0 and state.step < parts.total_steps:
            state.eval_history.append([state.step, evaluate_and_print(parts, epoch_of(parts, state)).loss])
            telemetry.evaluated(state.eval_history[-1][1])
            parts.runner.train()
        if recipe.train.save_every and state.step % recipe.train.save_every == 0 and resumable(parts):
            last_saved = save(parts, state)
        if memory.budget_bytes() is not None:
            last_saved = stop_if_over_budget(parts, state, last_saved, run_log)
    run_log.trained_to_the_end(epoch_of(parts, state))
    run_log.close()
    if last_saved != state.step:
        save(parts, state)


def finish(parts: TrainParts, state: TrainState) -> Summary | None:
    """Evaluate after training, export the trained weights, write the summary and report."""
    recipe, env, run_dir = parts.recipe, parts.env, parts.run_dir
    after = evaluate_and_print(parts, epoch_of(parts, state))
    parts.telemetry.evaluated(after.loss)
    parts.telemetry.finished(state.step)
    whole = whole_model(parts, trained=True)
    answers = sample_answers(parts, whole)
    rss_per_rank = gather_objects(peak_rss_mb(), env)
    if not env.is_main or whole.parts is None:
        return None
    save_trained(
        whole.parts.model,
        whole.parts.lm,
        parts.tokenizer,
        recipe.finetune.method,
        run_dir.weights(recipe.finetune.method),
        whole.state,
    )
    summary = Summary.of(
        recipe.model.name_or_path,
        recipe.finetune.method,
        state,
        after,
        answers,
        parts.started_at,
        rss_per_rank,
        parts.kernels,
        recipe.finetune.objective,
    )
    summary.write(run_dir)
    plot_loss_curve(run_dir.metrics_file, run_dir.loss_curve, state.eval_history)
    parts.tracking.artifacts(run_dir, run_dir.weights(recipe.finetune.method))
    parts.tracking.close(finished=True)
    run_dir.write_record(parts.recipe_as_given, "finished")
    print_report(summary, run_dir)
    judge_run(recipe, run_dir)
    return summary


def judge_run(recipe: Recipe, run_dir: RunDir) -> None:
    """eval.tasks on the base and tuned model (lm-eval), then eval.gate's verdict, into summary.json.
    A failed gate leaves the exit status 0: the model was trained and saved (docs/evaluation.md)."""
    if not recipe.eval.tasks and recipe.eval.gate is None:
        return
    import json

    from kubetune.export import gate
    from kubetune.fsutil import atomic_write_json

    if recipe.eval.tasks:
        from kubetune.training.lm_tasks import parse_tasks, print_table, record, run_tasks, task_manager

        spec = parse_tasks(",".join(recipe.eval.tasks), "eval.tasks")
        table = run_tasks(run_dir, spec.names, task_manager(spec), recipe.eval.tasks_limit)
        print_table(table, run_dir)
        record(run_dir, table)
    if recipe.eval.gate is not None:
        summary = json.loads(run_dir.summary_file.read_text())
        summary["gate"] = gate.verdict(recipe.eval.gate, summary)
        atomic_write_json(run_dir.summary_file, summary)
        print(gate.line(summary["gate"]))


def save(parts: TrainParts, state: TrainState) -> int:
    """A checkpoint of this step (every rank takes part); returns the step saved."""
    train = parts.recipe.train
    scaler = parts.optim.scaler
    t0 = time.perf_counter()
    meta = CheckpointMeta(
        state=state,
        total_steps=parts.total_steps,
        seed=train.seed,
        length=(train.max_steps, train.epochs),
        loss_scaler=scaler.state_dict() if scaler is not None else None,
    )
    ckpt.save_checkpoint(
        parts.run_dir.checkpoints,
        parts.model.loss,
        parts.optim.optimizer,
        parts.optim.scheduler,
        meta,
        recipe_to_yaml(parts.recipe),
        parts.env,
        train.keep_last,
    )
    parts.telemetry.checkpointed(time.perf_counter() - t0)
    return state.step


def stop_if_over_budget(parts: TrainParts, state: TrainState, last_saved: int, run_log: RunLog) -> int:
    """Over KUBETUNE_MEMORY_BUDGET on any rank: every rank saves, and the run stops with one
    line. The budget is the same on every rank (the pods share their env): they stop together."""
    over = memory.over_budget(parts.env.local_world_size)
    if all_reduce_sum(1 if over else 0, parts.env) == 0:
        return last_saved
    if last_saved != state.step:
        save(parts, state)
    run_log.close()
    raise MemoryBudgetError(
        f"{over or 'memory: another process of this job is over its budget'}; "
        f"{memory.advice(state.step, str(parts.run_dir.checkpoint(state.step)))}"
    )


def resumable(parts: TrainParts) -> bool:
    """A checkpoint now resumes exactly: not in the middle of a GRPO generation (whose
    completions a resumed run could not sample again from the same weights)."""
    return parts.rl is None or parts.rl.between_generations


def one_step(parts: TrainParts, batches: list[Batch]) -> StepResult:
    """The objective's optimizer step: SFT's, or the preference objective's."""
    if parts.preference is not None:
        return parts.preference.train_step(parts.optim, batches, parts.layout, parts.env)
    return train_step(parts.runner, parts.optim, batches, parts.layout, parts.env)


def epoch_of(parts: TrainParts, state: TrainState) -> float:
    """Epochs done, with the fraction of the current one (what the logs and the Trainer's lines show)."""
    return state.epoch + state.row / max(1, parts.batcher.usable_rows(state.epoch))


def micro_batch_hint(device_type: str, micro: int, accum: int, global_set: bool, scheduled: bool) -> str | None:
    """On CUDA, a step of several micro-batches where one would compute the same gradient: each
    micro-batch costs the host the same kernel launches whatever its rows, and small ones leave
    the GPU waiting (BENCHMARKS.md, "12-04, evening: the H200 again"). Pipeline stages and RL
    steps use their micro-batches for their schedules, and are left alone."""
    if device_type != "cuda" or accum == 1 or scheduled:
        return None
    rows = micro * accum
    fix = f"train.micro_batch_size={rows}" + ("" if global_set else " train.grad_accum=1")
    return (
        f"micro-batches: {accum} of {micro} rows per step on a GPU, which waits on the host's launches for each; "
        f"{fix} computes the same step as one, where its activations fit in memory (docs/start-up-choices.md)"
    )


def rows_in_a_step(parts: TrainParts) -> int:
    train = parts.recipe.train
    return train.micro_batch_size * train.grad_accum * parts.layout.data_parallel_size


def evaluate_and_print(parts: TrainParts, epoch: float) -> EvalResult:
    """Evaluate, and print the Trainer's eval line; its samples and steps count as the Trainer's do
    (eval rows, and rows / (micro-batch x data-parallel replicas) rounded up)."""
    t0 = time.monotonic()
    if parts.preference is not None:
        result = parts.preference.evaluate(parts.eval_batcher, parts.layout, parts.env)
    elif parts.rl is not None:
        result = parts.rl.evaluate()
    else:
        result = evaluate(parts.runner, parts.eval_batcher, parts.layout, parts.env)
    samples = len(parts.data.eval) if parts.data.eval else 0
    per_batch = parts.recipe.train.micro_batch_size * parts.layout.data_parallel_size
    steps = -(-samples // per_batch)
    shows = parts.env.local_rank == 0
    print_eval_line(shows, result.loss, time.monotonic() - t0, samples, steps, epoch, result.objective_metrics)
    parts.telemetry.objective(result.objective_metrics)
    return result


def describe_run(parts: TrainParts) -> str:
    recipe, data, layout, env = parts.recipe, parts.data, parts.layout, parts.env
    rows_per_step = rows_in_a_step(parts)
    trainable = sum(p.numel() for p in parts.optim.params)
    mean_row = int(sum(parts.batcher.data.lengths) / max(1, len(parts.batcher.epoch_rows(0))))
    return (
        f"model {recipe.model.name_or_path} ({recipe.finetune.method}, {trainable:,} trainable params"
        f"{' on this stage' if layout.pp > 1 else ''}) | {len(data.train)} train / "
        f"{len(data.eval) if data.eval else 0} eval samples | {parts.total_steps} steps x {rows_per_step} rows "
        f"of <= {recipe.data.max_seq_len} tokens (global batch: {rows_per_step} rows, ~{rows_per_step * mean_row} "
        f"tokens) | {env.world_size} process(es) on {env.device}, {layout.describe()}"
    )
