"""kubetune vs HF Trainer + PEFT, side by side in one run, on the same machine.

Same model (SmolLM2-135M-Instruct, the embedded default), same LoRA (r=8, alpha=16,
dropout 0.05 on q_proj/v_proj), same rows (the first N of medical_flashcards train.jsonl,
one epoch), same tokens (kubetune's tokenizer pipeline: chat template, labels on the
response, one EOS), same optimizer settings. HF Trainer gets padded batches (the usual
DataCollatorForSeq2Seq dynamic padding), in fp32 and with bf16=True (CPU autocast).
kubetune runs its defaults (packed rows; precision, attention kernel and processes chosen by
its start-up probes: bf16 base weights with fp32 adapters where bf16 measures faster, fp32
where it does not; one process, or one single-thread process per core where that measures
faster): the `kubetune` arm is `kubetune train` as a user types it, and its output names
the probes' choices. Beside it: one process with all threads (`kubetune-1proc`), one
single-thread process per core forced (`kubetune-per-core`, `--nproc-per-node`, same global
batch), and, where the probe did not choose bf16, the defaults with bf16 forced
(`kubetune-bf16`), so that the choice can be checked against the alternative.

Reported per arm: real (non-padding) tokens per second over the whole training loop, peak
RSS of the process, eval loss and perplexity on the first M rows of test.jsonl (the same
evaluation code for every arm: mean cross-entropy over response tokens), and the fraction
of this machine's matmul peak in the dtype the arm computes in, measured at the start of
the run twice: on 2048^3 and on the step's own shape ([tokens x hidden] @ [hidden x MLP]).
The header names the CPU model and its ISA flags (AMX, AVX-512-BF16, ...).

kubetune's arms run on jemalloc where it is installed, as `kubetune train` does (see
kubetune.training.allocator); HF's arm runs on glibc malloc as a plain script does, and once more on
jemalloc (`hf-fp32-jemalloc`), so that the allocator's share of the memory gap is visible.

An arm whose compute dtype runs at under a tenth of the fp32 peak on this CPU (HF's bf16=True
on a CPU without bf16 units) is not run: its line says so and gives the measured peaks.

    .venv/bin/python bench/train/train_vs_hf.py                       # defaults below
    .venv/bin/python bench/train/train_vs_hf.py --rows 96 --eval-rows 100

Each arm runs in its own process (so peak RSS is per arm; the per-core arm reports the sum of
its processes); nothing else should run on the
machine meanwhile.

`--repeat N` runs the arms N times, in alternating order (A B, B A, ...), so that a shared VM
whose speed drifts over minutes weighs on every arm alike; each arm's row is its median run,
and its line lists every run's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kubetune.training.allocator import find_jemalloc, jemalloc_loaded, preload_env

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data" / "medical_flashcards"
LORA = {"r": 8, "alpha": 16, "dropout": 0.05, "targets": ["q_proj", "v_proj"]}
LR, WARMUP, SEED = 2e-4, 5, 42


def matmul_peak(threads: int, m: int = 2048, k: int = 2048, n: int = 2048) -> dict:
    """FLOP/s of [m x k] @ [k x n] per dtype: best of 5 rounds (fewer when a round takes > 2 s)."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(3):
                a @ b
            best = min(best, (time.perf_counter() - t) / 3)
            if best > 2.0:  # a slow dtype on this CPU: one round says enough
                break
        out[name] = 2 * m * k * n / best
    return out


def isa_flags() -> str:
    """The CPU flags that decide bf16 speed, and torch's view of the ISA."""
    import torch

    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    present = [f for f in wanted if f in flags]
    return f"{' '.join(present) or 'none of ' + ','.join(wanted)}; torch ISA {torch.backends.cpu.get_cpu_capability()}"


def flops_per_token(config, target_fraction: float) -> float:
    """Model FLOPs of one trained token with frozen base weights (LoRA): forward (2N) plus
    the backward pass to the activations (2N); the LM head only where there is a target."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    head = h * config.vocab_size
    return 4 * layers * per_layer + 4 * head * target_fraction


def load_rows(n: int, path: Path):
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return rows[:n]


def tokenized(rows, tokenizer, max_len=512):
    from kubetune.data.templates import PromptRenderer
    from kubetune.data.tokenize import tokenize_rows

    return tokenize_rows(rows, PromptRenderer("chat", tokenizer), tokenizer, max_len, True)


def eval_loss(model, tokenizer, eval_rows) -> dict:
    """The same metric for every arm: token-averaged loss on response tokens of test rows."""
    import torch

    from kubetune.data import Batcher
    from kubetune.models.finetune import ModelParts
    from kubetune.recipe.layout import data_parallel_only
    from kubetune.training.dist import DistEnv
    from kubetune.training.runner import LocalRunner
    from kubetune.training.step import evaluate

    data = tokenized(eval_rows, tokenizer)
    batcher = Batcher(
        data, max_seq_len=512, micro_batch_size=8, packing=True, seed=0, pad_id=tokenizer.pad_token_id, shuffle=False
    )
    loss = ModelParts.of(model).loss
    runner = LocalRunner(loss, loss, torch.device("cpu"), lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    return evaluate(runner, batcher, data_parallel_only(1, 0), DistEnv()).as_dict()


def arm_hf(args, precision: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from kubetune.models.load import load_tokenizer, resolve_model

    torch.set_num_threads(args.threads)
    src = resolve_model("smollm2-135m-instruct")
    tokenizer = load_tokenizer(src)
    data = tokenized(load_rows(args.rows, SHARED / "train.jsonl"), tokenizer)
    ids, labels = [], []
    for i in range(len(data)):
        s_ids, s_tr = data.sample(i)
        ids.append(s_ids.tolist())
        labels.append([t if tr else -100 for t, tr in zip(s_ids.tolist(), s_tr.tolist())])
    ds = Dataset.from_dict({"input_ids": ids, "labels": labels, "attention_mask": [[1] * len(x) for x in ids]})
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(
        model,
        LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules=LORA["targets"],
            task_type="CAUSAL_LM",
        ),
    )
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    real_tokens = int(sum(len(x) for x in ids))
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=1,
            num_train_epochs=1,
            learning_rate=LR,
            lr_scheduler_type="cosine",
            warmup_steps=WARMUP,
            weight_decay=0.0,
            max_grad_norm=1.0,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            bf16=precision == "bf16",
            use_cpu=True,
            dataloader_num_workers=0,
            seed=SEED,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=ds, data_collator=collator)
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
    padded = sum(
        len(b["input_ids"]) * max(len(x) for x in b["input_ids"])
        for b in [ds[i : i + args.batch] for i in range(0, len(ds), args.batch)]
    )
    model.eval()
    ev = eval_loss(model, tokenizer, load_rows(args.eval_rows, SHARED / "test.jsonl"))
    return {
        "train_tokens": real_tokens,
        "padded_tokens": padded,
        "train_s": train_s,
        "tokens_per_s": real_tokens / train_s,
        "eval_loss": ev["loss"],
        "perplexity": ev["perplexity"],
    }


def kubetune_overrides(args, precision: str, tmp: str, threads: int, micro: int) -> list[str]:
    return [
        f"data.train={SHARED / 'train.jsonl'}",
        f"data.eval={SHARED / 'test.jsonl'}",
        f"data.max_train_samples={args.rows}",
        f"eval.max_samples={args.eval_rows}",
        "eval.generate=0",
        "eval.batch_size=8",
        f"lora.r={LORA['r']}",
        f"lora.alpha={LORA['alpha']}",
        f"lora.dropout={LORA['dropout']}",
        f"lora.target_modules=[{','.join(LORA['targets'])}]",
        "train.epochs=1",
        f"train.micro_batch_size={micro}",
        "train.grad_accum=1",
        f"train.lr={LR}",
        "train.lr_schedule=cosine",
        f"train.warmup_steps={WARMUP}",
        f"train.precision={precision}",
        f"train.seed={SEED}",
        "train.save_every=0",
        f"train.num_threads={threads}",
        f"data.cache_dir={tmp}/cache",
        f"output_dir={tmp}/run",
        "train.log_every=1000",
        *getattr(args, "kt_extra", "").split(),  # last, so that they win (ab_step_time passes none)
    ]


def arm_kubetune_cli(args, precision: str) -> dict:
    """`kubetune train` as a user runs it: no --nproc-per-node, no thread count, so its
    start-up probes choose the precision and one process or one per core."""
    overrides = [o for o in kubetune_overrides(args, precision, "{tmp}", 1, args.kt_micro) if "num_threads" not in o]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "kubetune", "train", *(o.replace("{tmp}", tmp) for o in overrides)]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise SystemExit(res.stdout[-2000:] + res.stderr[-2000:])
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    out = _kubetune_result(summary)
    out["peak_rss_mb"] = sum(summary["peak_rss_mb_per_rank"])  # all processes together
    out["processes"] = processes_choice(res.stderr)
    return out


def processes_choice(stderr: str) -> str:
    """The processes line of a `kubetune train` log: the choice, which comes after the line
    announcing a first (uncached) timing."""
    lines = [ln.split("kubetune: ", 1)[1] for ln in stderr.splitlines() if "kubetune: processes:" in ln]
    return lines[-1] if lines else ""


def arm_kubetune(args, precision: str) -> dict:
    from kubetune.training.run import train_from_recipe

    with tempfile.TemporaryDirectory() as tmp:
        summary = train_from_recipe(None, kubetune_overrides(args, precision, tmp, args.threads, args.kt_micro))
    assert summary is not None
    return _kubetune_result(summary.as_dict())


def arm_kubetune_per_core(args, precision: str) -> dict:
    """`--nproc-per-node <threads>`: one single-thread process per core, each taking half of
    the micro-batch rows (the same global batch, so the same math as `kubetune`)."""
    procs = args.threads
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "kubetune",
            "train",
            "--nproc-per-node",
            str(procs),
            *kubetune_overrides(args, precision, tmp, 1, max(1, args.kt_micro // procs)),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if res.returncode != 0:
            raise SystemExit(res.stdout[-2000:] + res.stderr[-2000:])
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    out = _kubetune_result(summary)
    out["peak_rss_mb"] = sum(summary["peak_rss_mb_per_rank"])  # all processes together
    return out


def _kubetune_result(summary: dict) -> dict:
    # eval in summary uses the same evaluate() on the same rows as the HF arms
    return {
        "train_tokens": summary["train_tokens"],
        "padded_tokens": summary["train_tokens"],
        "train_s": summary["train_time_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "eval_loss": summary["eval_loss_after"],
        "perplexity": summary["perplexity_after"],
        "eval_loss_before": summary["eval_loss_before"],
        "perplexity_before": summary["perplexity_before"],
        "dtype": summary.get("precision") or "bf16",
        "kernels": summary.get("kernels", ""),
    }


ARMS = {
    "hf-fp32": lambda a: arm_hf(a, "fp32"),
    "hf-fp32-jemalloc": lambda a: arm_hf(a, "fp32"),  # run_arm preloads jemalloc: the allocator alone
    "hf-bf16": lambda a: arm_hf(a, "bf16"),
    "kubetune": lambda a: arm_kubetune_cli(a, "auto"),  # the defaults: every start-up choice measured
    "kubetune-1proc": lambda a: arm_kubetune(a, "auto"),
    "kubetune-per-core": lambda a: arm_kubetune_per_core(a, "auto"),
    "kubetune-bf16": lambda a: arm_kubetune_cli(a, "bf16"),  # run only where the probe chose otherwise
}
# kubetune's arms report the dtype they chose
FIXED_DTYPE = {"hf-fp32": "fp32", "hf-fp32-jemalloc": "fp32", "hf-bf16": "bf16"}


def run_arm(name: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--arm",
        name,
        "--rows",
        str(args.rows),
        "--eval-rows",
        str(args.eval_rows),
        "--threads",
        str(args.threads),
        "--batch",
        str(args.batch),
        "--kt-micro",
        str(args.kt_micro),
        "--kt-extra",
        args.kt_extra,
    ]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    env.pop("LD_PRELOAD", None)
    library = find_jemalloc()
    # kubetune's arms run on what `kubetune train` runs on (jemalloc where installed, see
    # kubetune.training.allocator); HF's on glibc malloc, as `python train.py` does, and once on jemalloc
    if library and (name.startswith("kubetune") or name.endswith("jemalloc")):
        env = preload_env(env, library)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"arm {name} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def reason_to_skip(name: str, runs: dict[str, list[dict]], peak: dict[str, float]) -> str | None:
    """Why an arm is not run: its dtype has no units here, or the probe chose it already."""
    if name == "kubetune-bf16" and runs.get("kubetune", [{}])[0].get("dtype") == "bf16":
        return "not run: the probe chose bf16 for the kubetune arm already"
    dtype = FIXED_DTYPE.get(name)
    if dtype and peak[dtype] < 0.1 * peak["fp32"]:
        return (
            f"not run: {dtype} matmuls reach {peak[dtype] / 1e9:.1f} GFLOP/s on this CPU vs fp32 "
            f"{peak['fp32'] / 1e9:.1f} (no {dtype} units); the arm would take hours"
        )
    return None


def median_run(arm_runs: list[dict]) -> dict:
    """The arm's run of median tokens/s (the lower middle of an even count), with every run's."""
    ordered = sorted(arm_runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_tokens_per_s": [r["tokens_per_s"] for r in arm_runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=160, help="training rows (the same for every arm)")
    p.add_argument("--eval-rows", type=int, default=150, help="test.jsonl rows for the eval loss")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="HF per-device batch (rows)")
    p.add_argument("--kt-micro", type=int, default=2, help="kubetune micro batch (packed rows of 512 tokens)")
    p.add_argument(
        "--kt-extra", default="", help="key=value overrides for kubetune's arms, space-separated (e.g. a slowdown)"
    )
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms to run")
    p.add_argument("--repeat", type=int, default=1, help="run the arms this many times, alternating their order")
    p.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        result = ARMS[args.arm](args)
        result.setdefault("peak_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        result.setdefault("dtype", FIXED_DTYPE.get(args.arm, "fp32"))
        result["allocator"] = "jemalloc" if jemalloc_loaded() else "glibc"
        print(json.dumps(result))
        return

    from transformers import AutoConfig

    from kubetune.models.load import load_tokenizer, resolve_model

    config = AutoConfig.from_pretrained(resolve_model("smollm2-135m-instruct"))
    peak = matmul_peak(args.threads)
    step_tokens = args.kt_micro * 512  # the rows of one kubetune micro-batch: the step's real matmul
    shape_peak = matmul_peak(args.threads, step_tokens, config.hidden_size, config.intermediate_size)
    runs: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    names = args.arms.split(",")
    for round_ in range(args.repeat):
        for name in names if round_ % 2 == 0 else names[::-1]:
            why = reason_to_skip(name, runs, peak)
            if why:
                skipped[name] = why
                continue
            runs.setdefault(name, []).append(run_arm(name, args))
    results = {name: median_run(arm_runs) for name, arm_runs in runs.items()}
    tok_data = tokenized(
        load_rows(args.rows, SHARED / "train.jsonl"), load_tokenizer(resolve_model("smollm2-135m-instruct"))
    )
    target_frac = float(tok_data.trainable.mean())
    fpt = flops_per_token(config, target_frac)
    from kubetune.models.measure import cpu_model

    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch threads {args.threads}; flags: {isa_flags()}")
    for label, pk in (
        ("2048^3", peak),
        (f"step shape {step_tokens}x{config.hidden_size}x{config.intermediate_size}", shape_peak),
    ):
        print(f"matmul peak ({label}): bf16 {pk['bf16'] / 1e12:.3f} TFLOP/s, fp32 {pk['fp32'] / 1e12:.3f} TFLOP/s")
    print(f"budget: {args.rows} rows of train.jsonl, one epoch; eval on {args.eval_rows} rows of test.jsonl")
    print(
        f"useful model FLOPs per trained token: {fpt / 1e6:.0f} M "
        f"(frozen base: forward + backward to activations; LM head on the {target_frac:.0%} target tokens)"
    )
    base = {k: results[k]["tokens_per_s"] for k in ("hf-fp32", "hf-bf16") if k in results}
    print(
        f"{'arm':17s} {'dtype':>5s} {'tokens/s':>9s} {'x hf-fp32':>9s} {'x hf-bf16':>9s} {'pad%':>5s} "
        f"{'peak RSS':>9s} {'eval loss':>9s} {'ppl':>7s} {'% peak':>7s} {'% shape pk':>10s}"
    )
    for name, r in results.items():
        ratios = [f"{r['tokens_per_s'] / base[k]:9.2f}" if k in base else f"{'-':>9s}" for k in ("hf-fp32", "hf-bf16")]
        flops = r["tokens_per_s"] * fpt
        pad = 100 * (1 - r["train_tokens"] / r["padded_tokens"])
        print(
            f"{name:17s} {r['dtype']:>5s} {r['tokens_per_s']:9.1f} {ratios[0]} {ratios[1]} {pad:5.1f} "
            f"{r['peak_rss_mb']:7.0f}MB {r['eval_loss']:9.4f} {r['perplexity']:7.3f} "
            f"{100 * flops / peak[r['dtype']]:6.1f}% {100 * flops / shape_peak[r['dtype']]:9.1f}%"
        )
        print(f"{'':17s} allocator: {r['allocator']}{'; ' + r['kernels'] if r.get('kernels') else ''}")
        if len(r["runs_tokens_per_s"]) > 1:
            print(f"{'':17s} tokens/s of each run, in order: {', '.join(f'{x:.1f}' for x in r['runs_tokens_per_s'])}")
        if r.get("processes"):
            print(f"{'':17s} {r['processes']}")
    for name, why in skipped.items():
        print(f"{name:17s} {why}")
    kt = results.get("kubetune")
    if kt:
        print(f"the probe's choice (kubetune arm): precision={kt['dtype']}; {kt.get('processes', '')}")
        before = f"eval loss {kt['eval_loss_before']:.4f}, perplexity {kt['perplexity_before']:.3f}"
        print(f"base model before training: {before}")
    print(json.dumps({"peak": peak, "shape_peak": shape_peak, "results": results, "skipped": skipped}))


if __name__ == "__main__":
    main()
