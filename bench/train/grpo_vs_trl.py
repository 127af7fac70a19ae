"""kubetune's GRPO vs TRL's GRPOTrainer + PEFT: rollout and training speed side by side, in one run, on the same CPU.

Both sides get the same model (SmolLM2-135M-Instruct, the embedded default, fp32 weights from the
same converted files: kubetune.models.load.resolve_model), the same prompts (rows {"prompt",
"answer"} of `--data`, or a deterministic arithmetic task generated into a temporary directory),
rendered by kubetune's own prompt pipeline (chat template) and handed to TRL as that text; TRL's
prompt token ids are checked equal to kubetune's before any step runs. Both sides get the same
G (`num_generations`), max_completion_length, temperature, top_p/top_k, LoRA (r 8, alpha 16,
dropout 0 on q_proj/v_proj), loss (dapo, group-scaled advantages, epsilon 0.2, beta 0: no
reference pass), AdamW (constant lr, no warm-up, no weight decay, clipping at 1.0), the same
prompts per optimizer step (`--prompts-per-step` x G completions, G completions per
micro-batch), the same steps, and the same reward: kubetune's built-in `accuracy`
(kubetune.training.rewards), the very callable TRL is handed as its `reward_funcs`. Each side
draws the prompts in its own shuffled order.

kubetune runs as `kubetune train` as a user types it (`train.resume=never`, into a temporary
directory): its start-up probes choose the precision and the processes (one single-thread
process per core where that measures faster). `--precision auto` gives TRL kubetune's choice
(bf16 = TRL's `bf16=True` autocast), as bench/train/dpo_vs_trl.py does. TRL runs with
torch.set_num_threads(os.cpu_count()), gradient checkpointing off (GRPOConfig's default is on:
off is the faster), in both of its CPU rollout modes, measured here: plain `generate`
(`trl-generate`) and transformers' continuous batching (`trl-cb`:
`use_transformers_continuous_batching=True`, which replaced `use_transformers_paged`), its paged
KV cache sized for one generation through `transformers_continuous_batching_config` (left to
its defaults, transformers sizes it from the machine's free memory and its attention masks for
8,192-token forwards, which on a CPU measured both slower and gigabytes larger). The faster
mode by optimizer steps/s is the one compared; the other's ratios are printed beside it.

Each side runs in its own process tree, the sides interleaved (kubetune, trl-generate, trl-cb,
then again, `--repeats` times); the figures are medians over repeats. Before the first repeat
each side runs once for one step, not recorded (`--no-warmup` skips it): the model files and
kubetune's probe results are then cached for every measured run alike, and a side that cannot
run fails within minutes rather than after an hour. Reported per side, over all steps:
  - completion tokens: the tokens sampled (EOS included where one was sampled);
  - rollout s: the generation phase of every step as the trainer times it (sampling, then
    scoring, advantages and batching; kubetune: `step_s.rollout` of metrics.jsonl, whose
    processes sample at the same time; TRL: `_generate_and_score_completions`), and within it
    sampling s (kubetune: `rollout/seconds` of its first process; TRL: `_generate_single_turn`);
  - completion tokens/s = completion tokens / rollout s (and / sampling s beside it);
  - train loop s: the optimizer steps from the start of each to its end (kubetune:
    summary.json's `train_time_s`; TRL: on_step_begin .. on_step_end), start-up and the final
    save outside it; training s = train loop s - rollout s (forward, backward, optimizer);
  - optimizer steps/s = steps / train loop s;
  - peak RSS: the summed RSS of the side's whole process tree (kubetune's launcher and its
    workers; TRL's one process), sampled every 0.1 s; beside it kubetune's own figure, the sum
    of its workers' peaks (summary.json).
Then the ratios kubetune / TRL, PASS/MISS against issue 36's targets (completion tokens/s and
optimizer steps/s >= 3x TRL's, peak RSS <= TRL's), and one JSON line for BENCHMARKS.md.

    .venv/bin/python bench/train/grpo_vs_trl.py                       # G 8, 64 tokens, 20 steps, 1 repeat
    .venv/bin/python bench/train/grpo_vs_trl.py --repeats 3 --steps 30
    .venv/bin/python bench/train/grpo_vs_trl.py --steps 2 --num-generations 4 --max-completion-length 16 \\
        --prompts-per-step 2 --rows 8 --no-warmup                     # a smoke run
    .venv/bin/python bench/train/grpo_vs_trl.py --data my_task.jsonl  # rows {"prompt": ..., "answer": ...}

Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout

from bench.common.matched import lora_overrides, schedule_overrides
from bench.common.processes import TreePeakRss

MODEL = "smollm2-135m-instruct"
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
# GRPO settings both sides get, by TRL's GRPOConfig names (kubetune's finetune.rl uses the same)
RL = {"beta": 0.0, "loss_type": "dapo", "scale_rewards": "group", "epsilon": 0.2, "top_p": 1.0, "top_k": 0}
REWARD = "accuracy"  # kubetune's built-in: the completion equals the row's `answer`
SEED = 42
# TRL's CPU rollout modes: use_transformers_continuous_batching off and on
TRL_ARMS = {"trl-generate": False, "trl-cb": True}
ARMS = ("kubetune", *TRL_ARMS)
# issue 36's targets: kubetune's completion tokens/s and optimizer steps/s at least this many
# times TRL's, its peak RSS at most this fraction of TRL's
SPEED_TARGET, MEMORY_TARGET = 3.0, 1.0
RSS_INTERVAL_S = 0.1
CB_PAGE_TOKENS = 256  # transformers' ContinuousBatchingConfig default page


@dataclass(frozen=True)
class Plan:
    """What one comparison runs: the same for every side."""

    steps: int
    prompts_per_step: int
    num_generations: int
    max_completion_length: int
    max_prompt_tokens: int  # kubetune's data.max_seq_len = this + max_completion_length
    temperature: float
    lr: float
    repeats: int
    warmup: bool
    precision: str  # auto = kubetune's choice, handed to TRL
    threads: int  # TRL's torch threads
    arms: tuple[str, ...]

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations


def refuse(message: str) -> NoReturn:
    """A setting that cannot run: one line, exit code 2."""
    print(f"grpo_vs_trl.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def plan_from_args(args: argparse.Namespace) -> Plan:
    arms = tuple(a for a in ARMS if a in args.arms.split(","))  # kubetune first: its precision is TRL's
    unknown = sorted(set(args.arms.split(",")) - set(ARMS) - {""})
    if unknown:
        refuse(f"--arms: unknown {','.join(unknown)}; choose from {','.join(ARMS)}")
    if not arms:
        refuse(f"--arms: name at least one of {','.join(ARMS)}")
    if args.precision == "auto" and "kubetune" not in arms:
        refuse("--precision auto is kubetune's choice: run the kubetune arm or give --precision fp32|bf16")
    for name in ("steps", "prompts_per_step", "max_completion_length", "max_prompt_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            refuse(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_generations < 2:
        refuse(f"--num-generations must be >= 2 (advantages compare a group's completions), got {args.num_generations}")
    if not args.temperature > 0:
        refuse(f"--temperature must be > 0 (GRPO samples), got {args.temperature}")
    return Plan(
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_prompt_tokens=args.max_prompt_tokens,
        temperature=args.temperature,
        lr=args.lr,
        repeats=args.repeats,
        warmup=not args.no_warmup,
        precision=args.precision,
        threads=args.threads,
        arms=arms,
    )


# ---------------------------------------------------------------------------------------------
# the prompts
# ---------------------------------------------------------------------------------------------


def arithmetic_rows(n: int, seed: int = SEED) -> list[dict]:
    """n sums of two numbers with their answers, the same for a given seed: a verifiable task
    whose prompts are all about as long, so that the two sides' different orders cost alike."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}? Reply with the number only.", "answer": str(a + b)})
    return rows


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checked_data(path: Path) -> Path:
    """`--data`: a JSONL of rows with a `prompt` and the `answer` the accuracy reward reads."""
    if not path.is_file():
        refuse(f"--data {path}: no such file; give a JSONL of rows {{'prompt': ..., 'answer': ...}}")
    try:
        rows = read_jsonl(path)
    except json.JSONDecodeError as e:
        refuse(f"--data {path}: not JSON Lines ({e}); give one JSON object per line")
    missing = next((i for i, r in enumerate(rows) if not ({"prompt", "answer"} <= set(r))), None)
    if not rows or missing is not None:
        where = "has no rows" if not rows else f"row {missing} lacks `prompt` or `answer`"
        refuse(f"--data {path}: {where}; every row needs both (the accuracy reward reads `answer`)")
    return path


# ---------------------------------------------------------------------------------------------
# kubetune's side: `kubetune train` in its own process tree
# ---------------------------------------------------------------------------------------------


def kubetune_overrides(plan: Plan, data: Path, tmp: str, precision: str, steps: int) -> list[str]:
    """The run as recipe overrides: G completions per micro-batch, prompts_per_step x G per
    optimizer step whatever number of processes kubetune's probe starts (train.global_batch_size)."""
    return [
        f"model.name_or_path={MODEL}",
        f"data.train={data}",
        "data.eval=null",
        "data.template=chat",
        f"data.max_seq_len={plan.max_prompt_tokens + plan.max_completion_length}",
        f"data.cache_dir={tmp}/cache",
        *lora_overrides(LORA["r"], LORA["alpha"], LORA["dropout"], LORA["targets"]),
        "finetune.objective=grpo",
        f"finetune.rl.num_generations={plan.num_generations}",
        f"finetune.rl.max_completion_length={plan.max_completion_length}",
        f"finetune.rl.temperature={plan.temperature}",
        *(f"finetune.rl.{key}={value}" for key, value in RL.items()),
        f"finetune.rl.reward_funcs=[{REWARD}]",
        "finetune.rl.log_completions=false",  # TRL's default: no completions table
        f"train.max_steps={steps}",
        f"train.micro_batch_size={plan.num_generations}",
        f"train.global_batch_size={plan.completions_per_step}",
        "train.grad_accum=1",  # derived from the global batch (1 is the value that says so)
        *schedule_overrides(plan.lr, precision, SEED),  # every step logged: its phases and rollout figures
        "train.resume=never",
        f"output_dir={tmp}/run",
    ]


def kubetune_figures(rows: list[dict], summary: dict, plan: Plan) -> dict:
    """The side's raw figures from its metrics.jsonl rows and summary.json."""
    steps = [r for r in rows if "step_s" in r]
    if len(steps) != summary["steps"] or any("rollout/seconds" not in r for r in steps):
        raise SystemExit(
            f"kubetune: metrics.jsonl has {len(steps)} step rows with rollout figures for {summary['steps']} "
            "steps; the bench reads every step's row (train.log_every=1)"
        )
    return {
        "steps": len(steps),
        "completion_tokens": sum(r["completions/mean_length"] for r in steps) * plan.completions_per_step,
        "rollout_s": sum(r["step_s"]["rollout"] for r in steps),
        "sampling_s": sum(r["rollout/seconds"] for r in steps),
        "loop_s": summary["train_time_s"],
        "precision": summary["precision"],
        "workers_peak_rss_mb": sum(summary["peak_rss_mb_per_rank"]),
    }


PROCESSES_LINE = re.compile(r"processes: (.*)")


def arm_kubetune(plan: Plan, data: Path, precision: str, steps: int) -> dict:
    """`kubetune train` as a user types it; its metrics.jsonl and summary.json give the figures."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "kubetune", "train", *kubetune_overrides(plan, data, tmp, precision, steps)]
        _, err, peak_mb = run_watched("kubetune", cmd, tmp)
        run = Path(tmp) / "run"
        figures = kubetune_figures(
            read_jsonl(run / "metrics.jsonl"), json.loads((run / "summary.json").read_text()), plan
        )
    processes = next((m.group(1) for m in map(PROCESSES_LINE.search, err.splitlines()) if m), "")
    return figures | {"peak_rss_mb": peak_mb, "processes": processes.split(" (")[0]}


# ---------------------------------------------------------------------------------------------
# TRL's side: GRPOTrainer in a process of its own (this file with --arm)
# ---------------------------------------------------------------------------------------------


def trl_config(plan: Plan, output_dir: str, precision: str, continuous_batching: bool, steps: int):
    """GRPOConfig with the plan's settings, in TRL's fastest CPU setting but for the rollout
    mode (`continuous_batching`), which is measured both ways."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=plan.num_generations,  # completions per micro-batch, as kubetune's
        gradient_accumulation_steps=plan.prompts_per_step,  # one generation of all the step's prompts
        num_generations=plan.num_generations,
        max_completion_length=plan.max_completion_length,
        temperature=plan.temperature,
        **RL,
        max_steps=steps,
        learning_rate=plan.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        activation_checkpointing=False,  # TRL turns it on by default (as gradient_checkpointing): off is the faster
        bf16=precision == "bf16",  # GRPOConfig's default is True: fp32 must say so
        use_cpu=True,
        use_transformers_continuous_batching=continuous_batching,
        transformers_continuous_batching_config=continuous_batching_sizes(plan) if continuous_batching else None,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        seed=SEED,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def continuous_batching_sizes(plan: Plan) -> dict:
    """The continuous-batching KV cache sized for one generation (every completion of the step,
    prompt and completion, in whole pages) and a forward that holds every prompt at once. Left
    to itself, transformers sizes the cache from the free memory (gigabytes on a CPU) and its
    attention masks from 8,192-token forwards."""
    pages = math.ceil((plan.max_prompt_tokens + plan.max_completion_length) / CB_PAGE_TOKENS)
    return {
        "page_size": CB_PAGE_TOKENS,
        "num_blocks": plan.completions_per_step * pages,
        "max_batch_tokens": plan.completions_per_step * plan.max_prompt_tokens,
    }


def kubetune_prompts(plan: Plan, data: Path, tmp: str, tokenizer):
    """The prompts as kubetune's run renders and tokenizes them (its own data pipeline)."""
    from kubetune.data import prepare_data
    from kubetune.recipe import load_recipe

    recipe = load_recipe(None, kubetune_overrides(plan, data, tmp, "auto", plan.steps)).recipe
    return prepare_data(recipe, tokenizer).prompts


def trl_dataset(prompts, tokenizer):
    """TRL's rows: kubetune's rendered prompt text and the row's other columns (the reward's
    `answer`). TRL tokenizes the text itself: its ids must be kubetune's."""
    from datasets import Dataset

    from kubetune.training.grpo import prompt_ids

    theirs = tokenizer(text=prompts.texts)["input_ids"]  # what GRPOTrainer does with text prompts
    for i, ids in enumerate(theirs):
        ours = prompt_ids(prompts, i)
        if list(ids) != ours:
            raise SystemExit(f"TRL tokenizes prompt {i} as {list(ids)[:8]}..({len(ids)}), kubetune {ours[:8]}..")
    return Dataset.from_list([{"prompt": text, **prompts.columns[i]} for i, text in enumerate(prompts.texts)])


def arm_trl(plan: Plan, data: Path, precision: str, continuous_batching: bool, steps: int) -> dict:
    import torch
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from kubetune.models.load import load_tokenizer, resolve_model
    from kubetune.training.rewards import build_rewards

    class StepClock(TrainerCallback):
        """The optimizer steps' time, each from its first micro-batch (and its generation) to its end."""

        def __init__(self) -> None:
            self.loop_s, self.started = 0.0, 0.0

        def on_step_begin(self, *args, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.loop_s += time.perf_counter() - self.started

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that times its generation phase and, within it, the sampling, and counts
        the completion tokens sampled."""

        rollout_s = sampling_s = 0.0
        completion_tokens = 0

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.rollout_s += time.perf_counter() - t

        def _generate_single_turn(self, *args, **kwargs):
            t = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            self.sampling_s += time.perf_counter() - t
            self.completion_tokens += sum(len(c) for c in completion_ids)
            return completion_ids, logprobs

    torch.set_num_threads(plan.threads)
    source = resolve_model(MODEL)
    tokenizer = load_tokenizer(source)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        dataset = trl_dataset(kubetune_prompts(plan, data, tmp, tokenizer), tokenizer)
        trainer = TimedGRPOTrainer(
            model=source,
            reward_funcs=build_rewards([REWARD])[0].func,
            args=trl_config(plan, tmp, precision, continuous_batching, steps),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
            peft_config=LoraConfig(
                r=LORA["r"],
                lora_alpha=LORA["alpha"],
                lora_dropout=LORA["dropout"],
                target_modules=LORA["targets"],
                task_type="CAUSAL_LM",
            ),
        )
        trainer.train()
    return {
        "steps": trainer.state.global_step,
        "completion_tokens": trainer.completion_tokens,
        "rollout_s": trainer.rollout_s,
        "sampling_s": trainer.sampling_s,
        "loop_s": clock.loop_s,
        "precision": precision,
    }


def run_trl(name: str, plan: Plan, data: Path, precision: str, steps: int) -> dict:
    """A TRL arm in a fresh process (this file with --arm), its result the last line of its stdout."""
    cmd = [sys.executable, __file__, "--arm", name, "--arm-plan", json.dumps(asdict(plan)), "--data", str(data)]
    cmd += ["--precision", precision, "--steps", str(steps)]
    with tempfile.TemporaryDirectory() as tmp:
        out, _, peak_mb = run_watched(name, cmd, tmp)
    return json.loads(out.strip().splitlines()[-1]) | {"peak_rss_mb": peak_mb}


# ---------------------------------------------------------------------------------------------
# running the sides
# ---------------------------------------------------------------------------------------------


def side_env() -> dict[str, str]:
    """Every side's environment: offline, quiet, and no OMP_NUM_THREADS (each side sets its own threads)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return env | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }


def run_watched(name: str, cmd: list[str], tmp: str) -> tuple[str, str, float]:
    """Run `cmd` with its process tree's RSS sampled; (stdout, stderr, peak RSS in MB). A side
    that fails stops the benchmark, with the tail of what it printed."""
    out_path, err_path = Path(tmp) / f"{name}.out", Path(tmp) / f"{name}.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=side_env())
        rss = TreePeakRss(proc.pid, RSS_INTERVAL_S)
        code = proc.wait()
        rss.stop()
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"{name} failed (exit code {code}):\n{stdout[-1500:]}\n{stderr[-3000:]}")
    return stdout, stderr, rss.peak / 2**20


def run_arm(name: str, plan: Plan, data: Path, precision: str, steps: int) -> dict:
    if name == "kubetune":
        return arm_kubetune(plan, data, precision, steps)
    return run_trl(name, plan, data, precision, steps)


def run_rounds(plan: Plan, data: Path) -> tuple[dict[str, list[dict]], str]:
    """Warm-up (one step per side), then every side once per repeat, kubetune first: with
    `--precision auto` its probe's choice is TRL's precision. Returns the runs and that precision."""
    precision = plan.precision
    rounds = [("warm-up", 1)] * plan.warmup + [
        (f"repeat {r + 1}/{plan.repeats}", plan.steps) for r in range(plan.repeats)
    ]
    results: dict[str, list[dict]] = {name: [] for name in plan.arms}
    for label, steps in rounds:
        for name in plan.arms:
            t = time.perf_counter()
            run = run_arm(name, plan, data, plan.precision if name == "kubetune" else precision, steps)
            if name == "kubetune":
                precision = run["precision"]
            if label != "warm-up":
                results[name].append(run)
            print(f"{label}: {name} ({steps} step(s)) done in {time.perf_counter() - t:.0f} s", flush=True)
    return results, precision


# ---------------------------------------------------------------------------------------------
# the figures
# ---------------------------------------------------------------------------------------------


def derived(run: dict, plan: Plan) -> dict:
    """A run's figures: its raw ones and the rates and times the report compares."""
    rollout, loop = run["rollout_s"], run["loop_s"]
    return run | {
        "completion_tokens_per_s": run["completion_tokens"] / rollout,
        "sampled_tokens_per_s": run["completion_tokens"] / run["sampling_s"],
        "steps_per_s": run["steps"] / loop,
        "training_s": loop - rollout,
        "mean_length": run["completion_tokens"] / (run["steps"] * plan.completions_per_step),
    }


NUMBERS = (
    "completion_tokens",
    "mean_length",
    "rollout_s",
    "sampling_s",
    "completion_tokens_per_s",
    "sampled_tokens_per_s",
    "training_s",
    "loop_s",
    "steps_per_s",
    "peak_rss_mb",
)


def medians(runs: list[dict], plan: Plan) -> dict:
    """Each figure's median over the repeats (of each figure on its own)."""
    rows = [derived(r, plan) for r in runs]
    out = {key: statistics.median(r[key] for r in rows) for key in NUMBERS}
    if "workers_peak_rss_mb" in rows[0]:
        out["workers_peak_rss_mb"] = statistics.median(r["workers_peak_rss_mb"] for r in rows)
    return out


def faster_trl(figures: dict[str, dict]) -> str | None:
    """TRL's fastest CPU setting here, by optimizer steps/s."""
    return max((n for n in figures if n in TRL_ARMS), key=lambda n: figures[n]["steps_per_s"], default=None)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


ROWS = (  # label, figure, format
    ("completion tokens", "completion_tokens", "{:.0f}"),
    ("mean completion length", "mean_length", "{:.1f}"),
    ("rollout s", "rollout_s", "{:.1f}"),
    ("  of which sampling s", "sampling_s", "{:.1f}"),
    ("completion tokens/s", "completion_tokens_per_s", "{:.1f}"),
    ("  per sampling s", "sampled_tokens_per_s", "{:.1f}"),
    ("training s (fwd/bwd/opt)", "training_s", "{:.1f}"),
    ("train loop s", "loop_s", "{:.1f}"),
    ("optimizer steps/s", "steps_per_s", "{:.4f}"),
    ("peak RSS MB (tree)", "peak_rss_mb", "{:.0f}"),
)


def table(figures: dict[str, dict], trl: str | None) -> list[str]:
    """One row per figure, one column per side, and kubetune / TRL's faster setting."""
    names = list(figures)
    ratio = "kubetune" in figures and trl is not None
    head = f"{'':26s}" + "".join(f"{n:>14s}" for n in names) + (f"{'ratio':>9s}" if ratio else "")
    lines = [head]
    for label, key, fmt in ROWS:
        cells = "".join(f"{fmt.format(figures[n][key]):>14s}" for n in names)
        tail = f"{figures['kubetune'][key] / figures[trl][key]:>8.2f}x" if ratio else ""
        lines.append(f"{label:26s}{cells}{tail}")
    return lines


def comparison(figures: dict[str, dict], trl: str) -> dict:
    """kubetune / TRL's faster setting, and issue 36's targets."""
    kt, base = figures["kubetune"], figures[trl]
    ratios = {
        key: kt[key] / base[key]
        for key in ("completion_tokens_per_s", "steps_per_s", "peak_rss_mb", "rollout_s", "training_s")
    }
    targets = {
        "completion_tokens_per_s": ratios["completion_tokens_per_s"] >= SPEED_TARGET,
        "steps_per_s": ratios["steps_per_s"] >= SPEED_TARGET,
        "peak_rss_mb": ratios["peak_rss_mb"] <= MEMORY_TARGET,
    }
    return {"trl_arm": trl, "ratios": ratios, "targets": targets}


def report(plan: Plan, results: dict[str, list[dict]], precision: str, source: str) -> None:
    from kubetune.models.measure import cpu_model

    figures = {name: medians(runs, plan) for name, runs in results.items()}
    trl = faster_trl(figures)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; TRL torch threads {plan.threads}; precision {precision}")
    print(
        f"prompts: {source}; {plan.prompts_per_step} per step x G {plan.num_generations} = "
        f"{plan.completions_per_step} completions of <= {plan.max_completion_length} tokens; {plan.steps} steps, "
        f"{plan.repeats} repeat(s) interleaved (medians), warm-up {'on' if plan.warmup else 'off'}"
    )
    if "kubetune" in results:
        print(f"kubetune processes: {results['kubetune'][0]['processes'] or 'one'}")
    print("\n".join(table(figures, trl)))
    summary: dict = {"benchmark": "grpo_vs_trl", "cpu": cpu_model(), "cores": os.cpu_count(), "plan": asdict(plan)}
    summary |= {"precision": precision, "prompts": source, "figures": figures}
    if "kubetune" in figures:
        workers = figures["kubetune"]["workers_peak_rss_mb"]
        print(f"kubetune's workers' own peak RSS (summary.json, summed): {workers:.0f} MB")
    if "kubetune" in figures and trl is not None:
        c = comparison(figures, trl)
        r, t = c["ratios"], c["targets"]
        print(f"TRL's faster CPU setting here: {trl} (use_transformers_continuous_batching={TRL_ARMS[trl]})")
        print(
            f"kubetune / TRL ({trl}): completion tokens/s x{r['completion_tokens_per_s']:.2f} "
            f"(target >= {SPEED_TARGET}: {verdict(t['completion_tokens_per_s'])}), optimizer steps/s "
            f"x{r['steps_per_s']:.2f} (target >= {SPEED_TARGET}: {verdict(t['steps_per_s'])}), peak RSS "
            f"x{r['peak_rss_mb']:.2f} (target <= {MEMORY_TARGET}: {verdict(t['peak_rss_mb'])})"
        )
        summary |= c
        for other in (n for n in figures if n in TRL_ARMS and n != trl):
            r = comparison(figures, other)["ratios"]
            print(
                f"kubetune / TRL ({other}): completion tokens/s x{r['completion_tokens_per_s']:.2f}, optimizer "
                f"steps/s x{r['steps_per_s']:.2f}, peak RSS x{r['peak_rss_mb']:.2f}"
            )
    print(json.dumps(summary))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="What each figure is, and how it is measured: the docstring of bench/train/grpo_vs_trl.py.",
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per side and repeat (default %(default)s)")
    p.add_argument(
        "--prompts-per-step",
        type=int,
        default=4,
        help="prompts per optimizer step; a multiple of the processes kubetune starts (default %(default)s)",
    )
    p.add_argument("--num-generations", type=int, default=8, help="G: completions per prompt (default %(default)s)")
    p.add_argument(
        "--max-completion-length", type=int, default=64, help="longest completion in tokens (default %(default)s)"
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=128,
        help="room for the prompt: kubetune's data.max_seq_len is this plus --max-completion-length; TRL does not "
        "cut prompts (default %(default)s)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default %(default)s)")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate, constant (default %(default)s)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="interleaved repeats of every side, medians over them (default %(default)s)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the one-step run of each side before the repeats")
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="both sides' precision; auto = kubetune's probe's choice, given to TRL (default %(default)s)",
    )
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="TRL's torch threads (default: all cores, %(default)s)"
    )
    p.add_argument(
        "--data", type=Path, help="a JSONL of rows {prompt, answer}; without it, a generated task of --rows sums"
    )
    p.add_argument("--rows", type=int, default=64, help="rows of the generated task (default %(default)s)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated sides to run (default %(default)s)")
    p.add_argument("--arm", choices=sorted(TRL_ARMS), help=argparse.SUPPRESS)
    p.add_argument("--arm-plan", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:  # one TRL arm, in the process the driver started for it
        plan = Plan(**{**json.loads(args.arm_plan), "arms": ()})
        print(json.dumps(arm_trl(plan, args.data, args.precision, TRL_ARMS[args.arm], args.steps)))
        return
    plan = plan_from_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.data:
            data, source = checked_data(args.data), str(args.data)
        else:
            if args.rows < 1:
                refuse(f"--rows must be >= 1, got {args.rows}")
            data, source = Path(tmp) / "arithmetic.jsonl", f"{args.rows} generated sums (seed {SEED})"
            data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(args.rows)))
        results, precision = run_rounds(plan, data)
    report(plan, results, precision, source)


if __name__ == "__main__":
    main()
