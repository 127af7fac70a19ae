"""LoRA throughput on a ~1B Llama (TinyLlama-1.1B's shapes, random weights): kubetune vs HF
Trainer + PEFT, side by side in one run, on whatever device this machine has.

Random weights are fine for speed: the FLOPs and kernels are those of the real model. LoRA
r 16 on every linear layer, rows of the real medical flashcards (../shared/data), the same
number of optimizer steps for both arms. MFU = useful model FLOPs (forward + backward to the
activations of the frozen base, 4 x params per token, plus the adapters' weight gradients)
over the device's peak in the arm's dtype: the data sheet for GPUs, measured (2048^3 matmul)
on CPUs. HF Trainer runs bf16=True, except on a CPU whose bf16 matmuls reach under a tenth of
fp32's (AVX2 only: no bf16 units), where it runs fp32 (`--hf-precision` overrides); kubetune
runs its defaults (precision chosen by its probe) on the allocator `kubetune train` uses.

    .venv/bin/python bench/train/lora_1b.py --steps 6 --rows 2          # CPU: a few minutes
    python bench/train/lora_1b.py --steps 30 --rows 8 --device cuda     # what accelerator_check.sh runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kubetune.training.allocator import find_jemalloc, preload_env

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data" / "medical_flashcards" / "train.jsonl"
# TinyLlama-1.1B-intermediate-step-1431k-3T's config.json (Llama architecture)
TINYLLAMA = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 49152,  # the embedded default's tokenizer (TinyLlama's own has 32000): the data uses it
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
SEQ = 512


def make_model(root: Path, tokenizer: str | None) -> Path:
    """A random TinyLlama-shaped model with the embedded default's tokenizer (or the one saved
    at `tokenizer`: a machine without the embedded model, such as an offline GPU box)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kubetune.models.load import load_tokenizer, resolve_model

    out = root / "tinyllama-random"
    torch.manual_seed(0)
    config = LlamaConfig(**TINYLLAMA)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(tokenizer or resolve_model("smollm2-135m-instruct")).save_pretrained(out)
    return out


def flops_per_token(r: int = 16) -> float:
    c = TINYLLAMA
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    base = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * c["vocab_size"]
    adapters = layers * r * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter))
    return 4 * base + 6 * adapters


def device_peak(device: str, threads: int) -> tuple[dict[str, float], str]:
    """Peak FLOP/s per dtype: the data sheet's dense bf16 on GPUs, a 2048^3 matmul on CPUs."""
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name()
        from kubetune.training.flops import ACCELERATOR_PEAKS  # dense bf16, vendors' data sheets

        for key, peak in ACCELERATOR_PEAKS.items():
            if key in name:
                return {"bf16": peak}, f"{name} (data sheet, dense bf16)"
        return {}, f"{name} (no peak in the table)"
    torch.set_num_threads(threads)
    best = {}
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        a @ b
        t = time.perf_counter()
        a @ b
        best[label] = 2 * 2048**3 / (time.perf_counter() - t)
    return best, f"CPU, measured 2048^3 (fp32 {best['fp32'] / 1e9:.0f}, bf16 {best['bf16'] / 1e9:.1f} GFLOP/s)"


def hf_precision(peaks: dict[str, float]) -> str:
    """bf16 for HF Trainer, unless this CPU's bf16 matmuls run at under a tenth of fp32's
    (no bf16 units: AVX2 only), where bf16=True would take hours: fp32 then."""
    if "fp32" in peaks and peaks["bf16"] < 0.1 * peaks["fp32"]:
        return "fp32"
    return "bf16"


def kubetune_overrides(model: Path, args: argparse.Namespace, tmp: str) -> list[str]:
    return [
        f"model.name_or_path={model}",
        f"data.train={args.data}",
        f"data.max_train_samples={args.steps * args.rows * 8}",
        "data.eval=null",
        f"data.max_seq_len={SEQ}",
        f"data.cache_dir={tmp}/cache",
        "lora.r=16",
        "lora.alpha=32",
        "lora.target_modules=all-linear",
        f"train.max_steps={args.steps}",
        f"train.micro_batch_size={args.rows}",
        "train.save_every=0",
        "train.log_every=1000",
        "eval.generate=0",
        f"train.device={args.device}",
        f"output_dir={tmp}/run",
    ]


def arm_kubetune(model: Path, args: argparse.Namespace, tmp: str) -> dict:
    from kubetune.training.run import train_from_recipe

    summary = train_from_recipe(None, kubetune_overrides(model, args, tmp))
    assert summary is not None
    return {"tokens_per_s": summary.tokens_per_s, "tokens": summary.train_tokens, "precision": summary.precision}


def arm_hf(model: Path, args: argparse.Namespace, tmp: str) -> dict:
    """HF Trainer + PEFT (bf16=True, or fp32 where `--hf-precision` says), rows of the same
    data padded per batch."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[: args.steps * args.rows]]
    texts = [f"{r.get('input', '')}\n{r.get('output', '')}" for r in rows]
    enc = [tok(t, truncation=True, max_length=SEQ)["input_ids"] for t in texts]
    ds = Dataset.from_dict({"input_ids": enc, "labels": enc})
    bf16 = args.hf_precision == "bf16"
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if bf16 else torch.float32)
    lm = get_peft_model(lm, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    targs = TrainingArguments(
        output_dir=f"{tmp}/hf", per_device_train_batch_size=args.rows, max_steps=args.steps, bf16=bf16,
        logging_steps=1000, save_strategy="no", report_to=[], use_cpu=args.device == "cpu",
    )  # fmt: skip
    trainer = Trainer(model=lm, args=targs, train_dataset=ds, data_collator=DataCollatorForSeq2Seq(tok))
    t0 = time.perf_counter()
    trainer.train()
    real = sum(len(e) for e in enc)
    return {"tokens_per_s": real / (time.perf_counter() - t0), "tokens": real, "precision": args.hf_precision}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rows", type=int, default=2, help="rows per step (kubetune: packed rows of 512 tokens)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=str(DATA), help="a JSONL of the medical flashcards' train split")
    p.add_argument("--tokenizer", help="a saved tokenizer's folder (default: the embedded model's)")
    p.add_argument("--arm", choices=["kubetune", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--hf-precision", choices=["auto", "bf16", "fp32"], default="auto", help="HF Trainer's dtype")
    args = p.parse_args()
    if args.arm:
        with tempfile.TemporaryDirectory() as tmp:
            fn = arm_kubetune if args.arm == "kubetune" else arm_hf
            print(json.dumps(fn(Path(args.model), args, tmp)))
        return
    peaks, where = device_peak(args.device, args.threads)
    hf_dtype = hf_precision(peaks) if args.hf_precision == "auto" else args.hf_precision
    library = find_jemalloc()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp), args.tokenizer)
        results = {}
        for arm in ("kubetune", "hf"):
            cmd = [sys.executable, __file__, "--arm", arm, "--model", str(model), *sys.argv[1:]]
            cmd += ["--hf-precision", hf_dtype]
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            if arm == "kubetune" and library:  # what `kubetune train` runs on (kubetune.training.allocator)
                env = preload_env(env, library)
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            results[arm] = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
            if res.returncode != 0:
                print(f"{arm}: failed:", *res.stderr.strip().splitlines()[-30:], sep="\n")
    fpt = flops_per_token()
    shown = ", ".join(f"{k} {v / 1e12:.3f}" for k, v in peaks.items())
    print(f"peak TFLOP/s: {shown} ({where}); useful FLOPs per token {fpt / 1e9:.2f} G; MFU in each arm's dtype")
    for arm, r in results.items():
        if r:
            peak = peaks.get(r["precision"]) or max(peaks.values(), default=0.0)
            mfu = r["tokens_per_s"] * fpt / peak if peak else float("nan")
            speed = f"{r['tokens_per_s']:9.1f} tokens/s  MFU {mfu:6.1%}"
            print(f"{arm:9s} {r['precision']:>5s} {speed}  ({r['tokens']} tokens)")
    if results.get("kubetune") and results.get("hf"):
        print(f"kubetune / HF Trainer: x{results['kubetune']['tokens_per_s'] / results['hf']['tokens_per_s']:.2f}")
    print(json.dumps({"peaks": peaks, "results": results}))


if __name__ == "__main__":
    main()
