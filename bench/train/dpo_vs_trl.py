"""kubetune's DPO vs TRL's DPOTrainer + PEFT, side by side in one run, on the same machine.

Both sides get the same model (SmolLM2-135M-Instruct, the embedded default, fp32 weights from
the same files), the same pairs in the same order (prompt / chosen / rejected rows built from
the first rows of medical_flashcards train.jsonl, never test.jsonl, or `--pairs FILE`, e.g. the
file `kubetune data make-preferences` writes), the same prompt text (kubetune's PromptRenderer
renders every prompt; TRL is handed the text and its tokenization is checked against
kubetune's, token for token, BOS/EOS included, before any step runs), the same LoRA (r 8,
alpha 16, dropout 0 on q_proj/v_proj), beta 0.1 (sigmoid loss), the same AdamW (constant lr,
no warm-up, no weight decay, clipping at 1.0), the same pairs per optimizer step and steps.
The precision is kubetune's: `--precision auto` runs kubetune first and gives TRL the one its
start-up probe chose (bf16 = TRL's `bf16=True` autocast; fp32 = fp32).

TRL runs in its fastest CPU setting, measured here: the reference pass on the fly
(`precompute_ref_log_probs=False`) and precomputed (`True`) are both run, and the faster one is
the one compared. Gradient checkpointing is off (DPOConfig turns it on by default; off is the
faster on CPU). TRL 1.x has no padding-free DPO (`padding_free=True` warns and pads), so there
is no such setting to try. kubetune runs as `kubetune train` as a user types it (precision,
processes and the reference pass chosen by its own probes); the verdicts are its. Beside it,
`kubetune-1proc` (`--nproc-per-node 1`: one process with every thread, one model in memory)
shows what the probe's choice of processes gives and costs.

Each arm runs in its own process, interleaved (kubetune, kubetune-1proc, TRL, TRL-precompute,
then again, for `--rounds`); figures are medians over rounds. Reported:
  - per step, first 20 steps: loss and rewards/accuracies of both sides, and max |diff|;
  - pairs/s from steady-state step times (the first `--skip` steps left out), plus the time of
    a precomputed reference pass spread over the pairs it served;
  - peak RSS (VmHWM) of the training process; the ratios kubetune/TRL;
  - PASS/MISS against issue 28's targets: pairs/s >= 2x TRL, peak RSS <= 0.6x TRL, and curves
    that agree within run-to-run noise. The noise is measured: TRL once more with another seed
    (another LoRA initialisation, the same pairs); kubetune's curves agree where their max |diff|
    from TRL's is at most twice TRL's own seed-to-seed max |diff| (with a floor of 0.01 on loss
    and 0.25 on accuracy, one pair in a step of four, where the noise measures ~0).

    .venv/bin/python bench/train/dpo_vs_trl.py                    # the full comparison (30 steps, 2 rounds)
    .venv/bin/python bench/train/dpo_vs_trl.py --quick            # a smoke run: 4 steps, 1 round
    .venv/bin/python bench/train/dpo_vs_trl.py --pairs data/flashcards-pairs.jsonl

Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout

from bench.common.matched import lora_overrides, schedule_overrides

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data" / "medical_flashcards"
MODEL = "smollm2-135m-instruct"
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
BETA, LR, SEED, MAX_LEN = 0.1, 1e-4, 42, 512
CURVE_STEPS = 20  # issue 28 compares the first 20 steps
# the targets of issue 28: kubetune's pairs/s at least this many times TRL's, its peak RSS at most
# this fraction of TRL's
SPEED_TARGET, MEMORY_TARGET = 2.0, 0.6
# floors of the curve criterion where TRL's seed-to-seed noise measures ~0
NOISE_FLOOR = {"loss": 0.01, "rewards/accuracies": 0.25}
CURVES = ("loss", "rewards/accuracies")


@dataclass(frozen=True)
class Plan:
    """What one comparison runs: the same for every arm."""

    steps: int
    pairs_per_step: int
    rounds: int
    skip: int  # steps left out of the steady-state step time (start-up, first allocations)
    threads: int
    precision: str  # auto = kubetune's choice, handed to TRL
    arms: tuple[str, ...]

    @property
    def pairs(self) -> int:
        return self.steps * self.pairs_per_step


ARMS = ("kubetune", "kubetune-1proc", "trl", "trl-precompute")


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan of a run: `--quick` is a smoke run of a few steps and one round."""
    steps, rounds, skip = (4, 1, 1) if args.quick else (args.steps, args.rounds, args.skip)
    if skip < 1:
        raise SystemExit("--skip must be >= 1: kubetune's metrics.jsonl does not time step 1")
    if steps <= skip:
        raise SystemExit(f"--steps {steps} leaves no steady-state step after --skip {skip}; raise --steps")
    arms = tuple(sorted((a for a in args.arms.split(",") if a), key=lambda a: a != "kubetune"))
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {','.join(unknown)}; choose from {','.join(ARMS)}")
    if args.precision == "auto" and "kubetune" not in arms:
        raise SystemExit("--precision auto is kubetune's choice: run the kubetune arm or give --precision fp32|bf16")
    return Plan(steps, args.pairs_per_step, rounds, skip, args.threads, args.precision, arms)


# ---------------------------------------------------------------------------------------------
# the pairs
# ---------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def flashcard_pairs(n: int, path: Path = SHARED / "train.jsonl") -> list[dict]:
    """n preference rows from the first n flashcards: chosen = the card's answer, rejected = the
    next card's answer (fluent, on the subject, wrong for this question). A speed and agreement
    benchmark needs real text of real lengths, not good pairs; dpo_quality.py trains on the pairs
    `kubetune data make-preferences` writes."""
    # a card without an answer cannot be either side of a pair (kubetune refuses an empty answer)
    cards = [c for c in read_jsonl(path) if c["output"].strip()][: n + 1]
    if len(cards) < n + 1:
        raise SystemExit(f"{path} has {len(cards)} rows with an answer; {n + 1} are needed for {n} pairs")
    return [
        {"instruction": c["instruction"], "input": c["input"], "chosen": c["output"], "rejected": nxt["output"]}
        for c, nxt in pairwise(cards)
    ]


def kubetune_overrides(plan: Plan, pairs_file: Path, tmp: str, precision: str) -> list[str]:
    """The kubetune side as recipe overrides: one pair per unpacked row, `pairs_per_step` rows a
    step, so that every step trains the pairs TRL's step trains."""
    return [
        f"model.name_or_path={MODEL}",
        f"data.train={pairs_file}",
        "data.eval=null",
        "data.template=chat",
        f"data.max_seq_len={MAX_LEN}",
        "data.truncate=false",  # TRL truncates differently (the whole sequence): refuse instead
        "data.packing=false",  # packed rows hold a varying number of pairs: not TRL's steps
        f"data.cache_dir={tmp}/cache",
        *lora_overrides(LORA["r"], LORA["alpha"], LORA["dropout"], LORA["targets"]),
        "finetune.objective=dpo",
        f"finetune.preference.beta={BETA}",
        f"train.max_steps={plan.steps}",
        f"train.micro_batch_size={plan.pairs_per_step}",
        "train.grad_accum=1",
        *schedule_overrides(LR, precision, SEED),
        f"output_dir={tmp}/run",
    ]


def kubetune_steps(plan: Plan, pairs_file: Path, tmp: str):
    """What kubetune's run trains on, from its own data code: the pair indices of each step in
    order, and the tokenized pairs (sample 2k = pair k's prompt + chosen, 2k+1 + rejected)."""
    from kubetune.data import prepare_data
    from kubetune.models.load import load_tokenizer, resolve_model
    from kubetune.recipe import load_recipe
    from kubetune.recipe.layout import data_parallel_only
    from kubetune.training.setup import train_batcher

    recipe = load_recipe(None, kubetune_overrides(plan, pairs_file, tmp, "auto")).recipe
    tokenizer = load_tokenizer(resolve_model(recipe.model.name_or_path))
    data = prepare_data(recipe, tokenizer)
    batcher = train_batcher(recipe, data, tokenizer.pad_token_id, data_parallel_only(1, 0))
    order: list[int] = []
    start = 0
    for _ in range(plan.steps):
        batch, start = batcher.micro_batch(0, start)
        order += batch.pair_ids.tolist()
    return order, data


def pair_tokens(data, pair: int) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) token ids of a pair of kubetune's tokenized pair data."""
    chosen, chosen_trained = data.sample(2 * pair)
    rejected, rejected_trained = data.sample(2 * pair + 1)
    return chosen[~chosen_trained].tolist(), chosen[chosen_trained].tolist(), rejected[rejected_trained].tolist()


def first_token_mismatch(trl_rows, kubetune_rows) -> str | None:
    """Where TRL's tokenization (prompt_ids, chosen_ids, rejected_ids) differs from kubetune's."""
    if len(trl_rows) != len(kubetune_rows):
        return f"TRL kept {len(trl_rows)} of the {len(kubetune_rows)} pairs"
    for i, (trl_row, kt) in enumerate(zip(trl_rows, kubetune_rows)):
        for key, ours in zip(("prompt_ids", "chosen_ids", "rejected_ids"), kt):
            theirs = list(trl_row[key])
            if theirs != ours:
                return f"pair {i} {key}: TRL {theirs[:8]}..{theirs[-4:]}, kubetune {ours[:8]}..{ours[-4:]}"
    return None


# ---------------------------------------------------------------------------------------------
# the arms (each in its own process)
# ---------------------------------------------------------------------------------------------


def vm_hwm_mb() -> float:
    """Peak resident memory of this process (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def trl_dataset(rows: list[dict], order: list[int], renderer):
    """TRL's rows (prompt text, chosen, rejected) in kubetune's step order, the prompt rendered by
    kubetune's PromptRenderer: TRL tokenizes this text itself."""
    from datasets import Dataset

    return Dataset.from_list(
        [
            {"prompt": renderer.prompt(rows[i]), "chosen": rows[i]["chosen"], "rejected": rows[i]["rejected"]}
            for i in order
        ]
    )


def trl_lora_model(source: str, seed: int):
    """The model in fp32 with the same LoRA, initialised under `seed` (before the Trainer seeds)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa")
    lora = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules=LORA["targets"],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def trl_config(plan: Plan, output_dir: str, precision: str, precompute: bool, seed: int):
    """DPOConfig with kubetune's settings, in TRL's fastest CPU setting but for the reference pass
    (`precompute`), which is measured both ways."""
    from trl import DPOConfig

    return DPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=plan.pairs_per_step,
        gradient_accumulation_steps=1,
        max_steps=plan.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=MAX_LEN,
        precompute_ref_log_probs=precompute,
        gradient_checkpointing=False,  # DPOConfig's default is on: off is the faster
        train_sampling_strategy="sequential",  # the dataset is already in kubetune's step order
        bf16=precision == "bf16",  # DPOConfig's default is True: fp32 must say so
        use_cpu=True,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def arm_trl(plan: Plan, pairs_file: Path, precision: str, precompute: bool, seed: int) -> dict:
    import torch
    from transformers import TrainerCallback
    from trl import DPOTrainer

    from kubetune.models.load import load_tokenizer, resolve_model

    class StepClock(TrainerCallback):
        """When each optimizer step ended (data loading, logging and the step itself between two)."""

        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_begin(self, *args, **kwargs):
            self.ends = [time.perf_counter()]

        def on_step_end(self, *args, **kwargs):
            self.ends.append(time.perf_counter())

    class TimedDPOTrainer(DPOTrainer):
        """DPOTrainer that times its reference pass where it precomputes one (in __init__)."""

        reference_s = 0.0

        def _precompute_ref_logps(self, *args, **kwargs):
            t = time.perf_counter()
            try:
                return super()._precompute_ref_logps(*args, **kwargs)
            finally:
                self.reference_s += time.perf_counter() - t

    torch.set_num_threads(plan.threads)
    src = resolve_model(MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        order, kubetune_data = kubetune_steps(plan, pairs_file, tmp)
    dataset = trl_dataset(read_jsonl(pairs_file), order, kubetune_data.renderer)
    model = trl_lora_model(src, seed)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TimedDPOTrainer(
            model=model,
            args=trl_config(plan, tmp, precision, precompute, seed),
            train_dataset=dataset,
            processing_class=load_tokenizer(src),
            callbacks=[clock],
        )
        mismatch = first_token_mismatch(trainer.train_dataset, [pair_tokens(kubetune_data.train, i) for i in order])
        if mismatch:
            raise SystemExit(f"TRL and kubetune tokenize the pairs differently: {mismatch}")
        trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    return {
        "curves": {key: [h[key] for h in logged] for key in CURVES},
        "step_s": [b - a for a, b in pairwise(clock.ends)],
        "reference_s": trainer.reference_s,
        "peak_rss_mb": vm_hwm_mb(),
        "precision": precision,
        "pairs_checked": len(order),
    }


REFERENCE_LINE = re.compile(r"reference log-probs of \d+ pairs computed in ([0-9.]+) s")


def arm_kubetune(plan: Plan, pairs_file: Path, precision: str, cli: tuple[str, ...] = ()) -> dict:
    """`kubetune train` as a user runs it (its probes choose precision, processes and the
    reference pass; `cli` adds options); its metrics.jsonl gives the curves and the step times.
    Its seed is SEED: train.seed also orders the pairs, which TRL's arms follow."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = kubetune_overrides(plan, pairs_file, tmp, precision)
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        res = subprocess.run(
            [sys.executable, "-m", "kubetune", "train", *cli, *overrides], capture_output=True, text=True, env=env
        )
        if res.returncode != 0:
            raise SystemExit(res.stdout[-2000:] + res.stderr[-3000:])
        run = Path(tmp) / "run"
        summary = json.loads((run / "summary.json").read_text())
        logged = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m and "step" in m]
    elapsed = [m["elapsed_s"] for m in logged]
    reference = REFERENCE_LINE.search(res.stderr)
    processes = next((ln.split("kubetune: ", 1)[1] for ln in res.stderr.splitlines() if "processes:" in ln), "")
    return {
        "curves": {key: [m[key] for m in logged] for key in CURVES},
        # step 1's start is not in metrics.jsonl (it counts from the process start): NaN, and
        # plan.skip >= 1 leaves it out
        "step_s": [float("nan")] + [b - a for a, b in pairwise(elapsed)],
        "reference_s": float(reference.group(1)) if reference else 0.0,
        "peak_rss_mb": sum(summary["peak_rss_mb_per_rank"]),  # all processes together
        "precision": summary["precision"],
        "processes": processes,
    }


ARM_RUNNERS = {
    "kubetune": lambda plan, pairs, precision, seed: arm_kubetune(plan, pairs, precision),
    # one process with every thread, where the probe chose one per core: its memory is one model's
    "kubetune-1proc": lambda plan, pairs, precision, seed: arm_kubetune(
        plan, pairs, precision, ("--nproc-per-node", "1")
    ),
    "trl": lambda plan, pairs, precision, seed: arm_trl(plan, pairs, precision, False, seed),
    "trl-precompute": lambda plan, pairs, precision, seed: arm_trl(plan, pairs, precision, True, seed),
}


def run_arm(name: str, plan: Plan, pairs_file: Path, precision: str, seed: int = SEED) -> dict:
    """One arm in a fresh process (its own peak RSS), its result as the last line of stdout."""
    cmd = [
        sys.executable,
        __file__,
        "--arm",
        name,
        "--arm-plan",
        json.dumps(asdict(plan)),
        "--pairs",
        str(pairs_file),
        "--precision",
        precision,
        "--seed",
        str(seed),
    ]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"arm {name} failed:\n{res.stdout[-1500:]}\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# the figures
# ---------------------------------------------------------------------------------------------


def pairs_per_s(result: dict, plan: Plan) -> float:
    """Steady-state throughput: the median step time after the first `skip` steps, and a
    precomputed reference pass's time spread over the pairs it served."""
    steady = statistics.median(result["step_s"][plan.skip :])
    return plan.pairs / (steady * plan.steps + result.get("reference_s", 0.0))


def max_abs_diff(a: list[float], b: list[float], steps: int = CURVE_STEPS) -> float:
    n = min(len(a), len(b), steps)
    return max((abs(x - y) for x, y in zip(a[:n], b[:n])), default=float("nan"))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per arm (>= 20: the curves compare 20)")
    p.add_argument("--pairs-per-step", type=int, default=4, help="preference pairs per optimizer step")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every arm (medians over them)")
    p.add_argument("--skip", type=int, default=3, help="first steps left out of the steady-state step time")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of TRL's arms")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="auto = kubetune's choice")
    p.add_argument("--pairs", type=Path, help="a JSONL of preference rows (default: built from train.jsonl)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 steps, 1 round")
    p.add_argument("--arm", choices=sorted(ARM_RUNNERS), help=argparse.SUPPRESS)
    p.add_argument("--arm-plan", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=SEED, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        plan = Plan(**{**json.loads(args.arm_plan), "arms": ()})
        print(json.dumps(ARM_RUNNERS[args.arm](plan, args.pairs, args.precision, args.seed)))
        return
    plan = plan_from_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        pairs_file = Path(tmp) / "pairs.jsonl"
        rows = read_jsonl(args.pairs)[: plan.pairs] if args.pairs else flashcard_pairs(plan.pairs)
        if len(rows) < plan.pairs:
            raise SystemExit(f"--pairs {args.pairs}: {len(rows)} rows, {plan.pairs} needed (steps x pairs per step)")
        pairs_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        results = run_rounds(plan, pairs_file)
    report(
        plan, results, str(args.pairs) if args.pairs else "built from train.jsonl: rejected = the next card's answer"
    )


def run_rounds(plan: Plan, pairs_file: Path) -> dict[str, list[dict]]:
    """Every arm once per round, kubetune first (with `--precision auto` its probe's choice is
    the precision of TRL's arms), then the faster TRL setting once more with another seed."""
    results: dict[str, list[dict]] = {name: [] for name in plan.arms}
    precision = plan.precision  # TRL's: kubetune's choice once kubetune has run
    for round_ in range(plan.rounds):
        for name in plan.arms:
            t = time.perf_counter()
            results[name].append(run_arm(name, plan, pairs_file, plan.precision if name == "kubetune" else precision))
            if name == "kubetune" and plan.precision == "auto":
                precision = results[name][0]["precision"]
            print(f"round {round_ + 1}/{plan.rounds}: {name} done in {time.perf_counter() - t:.0f} s", flush=True)
    faster = faster_trl(plan, results)
    if faster:
        results["noise"] = [run_arm(faster, plan, pairs_file, precision, seed=SEED + 1)]
    return results


def faster_trl(plan: Plan, results: dict[str, list[dict]]) -> str | None:
    """TRL's fastest CPU setting, by measured pairs/s."""
    trl = [n for n in results if n.startswith("trl")]
    return max(trl, key=lambda n: median_speed(results[n], plan), default=None)


def median_speed(runs: list[dict], plan: Plan) -> float:
    return statistics.median(pairs_per_s(r, plan) for r in runs)


def curve_table(kubetune: dict, trl: dict) -> list[str]:
    loss_k, loss_t = kubetune["curves"]["loss"], trl["curves"]["loss"]
    acc_k, acc_t = kubetune["curves"]["rewards/accuracies"], trl["curves"]["rewards/accuracies"]
    lines = [
        f"{'step':>4s} {'loss kubetune':>13s} {'loss TRL':>9s} {'|diff|':>7s} {'acc kubetune':>12s} {'acc TRL':>8s}"
    ]
    for i in range(min(len(loss_k), len(loss_t), CURVE_STEPS)):
        lines.append(
            f"{i + 1:4d} {loss_k[i]:13.4f} {loss_t[i]:9.4f} {abs(loss_k[i] - loss_t[i]):7.4f} "
            f"{acc_k[i]:12.3f} {acc_t[i]:8.3f}"
        )
    return lines


def curve_verdicts(kubetune: dict, trl: dict, noise: dict | None) -> dict[str, dict]:
    """Per curve: kubetune's max |diff| from TRL, TRL's own seed-to-seed max |diff|, and whether
    the first is within twice the second (or the floor)."""
    out = {}
    for key in CURVES:
        diff = max_abs_diff(kubetune["curves"][key], trl["curves"][key])
        seeds = max_abs_diff(noise["curves"][key], trl["curves"][key]) if noise else None
        bound = max(2 * seeds, NOISE_FLOOR[key]) if seeds is not None else None
        out[key] = {
            "max_abs_diff": diff,
            "trl_seed_to_seed": seeds,
            "bound": bound,
            "ok": bound is not None and diff <= bound,
        }
    return out


def report(plan: Plan, results: dict[str, list[dict]], source: str) -> None:
    from kubetune.models.measure import cpu_model

    arms = [n for n in results if n != "noise"]
    speed = {n: median_speed(results[n], plan) for n in arms}
    rss = {n: statistics.median(r["peak_rss_mb"] for r in results[n]) for n in arms}
    precision = results["kubetune"][0]["precision"] if "kubetune" in results else plan.precision
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; TRL torch threads {plan.threads}; precision {precision}")
    print(
        f"pairs: {plan.pairs} ({source}), {plan.pairs_per_step} per step, {plan.steps} steps, "
        f"{plan.rounds} round(s) interleaved; step times from step {plan.skip + 1} on"
    )
    trl_runs = [r for n in arms if n.startswith("trl") for r in results[n]]
    if trl_runs:
        print(f"tokens: TRL's prompt/chosen/rejected ids equal kubetune's on all {trl_runs[0]['pairs_checked']} pairs")
    print(f"{'arm':15s} {'pairs/s':>8s} {'peak RSS':>9s}  reference pass")
    for n in arms:
        ref = statistics.median(r["reference_s"] for r in results[n])
        how = f"precomputed, {ref:.1f} s (counted)" if ref else "on the fly"
        print(f"{n:15s} {speed[n]:8.3f} {rss[n]:7.0f}MB  {how}")
        if results[n][0].get("processes"):
            print(f"{'':15s} {results[n][0]['processes']}")
    faster = faster_trl(plan, {n: results[n] for n in arms})
    summary: dict = {"plan": asdict(plan), "precision": precision, "pairs_per_s": speed, "peak_rss_mb": rss}
    if faster and "kubetune" in results:
        kt, trl = results["kubetune"][0], results[faster][0]
        print(f"TRL's faster CPU setting here: {faster} (precompute_ref_log_probs={faster == 'trl-precompute'})")
        print("\n".join(curve_table(kt, trl)))
        curves = curve_verdicts(kt, trl, results.get("noise", [None])[0])
        speed_ratio, rss_ratio = speed["kubetune"] / speed[faster], rss["kubetune"] / rss[faster]
        for key, c in curves.items():
            seeds = (
                "no seed-to-seed run"
                if c["trl_seed_to_seed"] is None
                else f"TRL seed-to-seed {c['trl_seed_to_seed']:.4f}, bound {c['bound']:.4f}"
            )
            print(f"{key}: max |diff| over the first {CURVE_STEPS} steps {c['max_abs_diff']:.4f} ({seeds})")
        agree = all(c["ok"] for c in curves.values())
        print(
            f"kubetune / TRL ({faster}): pairs/s x{speed_ratio:.2f} (target >= {SPEED_TARGET}: "
            f"{verdict(speed_ratio >= SPEED_TARGET)}), peak RSS x{rss_ratio:.2f} (target <= {MEMORY_TARGET}: "
            f"{verdict(rss_ratio <= MEMORY_TARGET)}), curves within run-to-run noise: {verdict(agree)}"
        )
        summary |= {"trl_arm": faster, "speed_ratio": speed_ratio, "rss_ratio": rss_ratio, "curves": curves}
    for n in (n for n in arms if n.startswith("kubetune-") and faster):
        print(f"{n} / TRL ({faster}): pairs/s x{speed[n] / speed[faster]:.2f}, peak RSS x{rss[n] / rss[faster]:.2f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
