"""LoRA throughput on a ~1B Llama (TinyLlama-1.1B's shapes, random weights): kubetune vs HF
Trainer + PEFT, side by side in one run, on whatever device this machine has.

Random weights are fine for speed: the FLOPs and kernels are those of the real model. LoRA
r 16 on every linear layer, rows of the real medical flashcards (../shared/data), the same
number of optimizer steps for both arms. MFU = useful model FLOPs (forward + backward to the
activations of the frozen base, 4 x params per token, plus the adapters' weight gradients)
over the device's peak: the table below for GPUs, measured (2048^3 matmul) on CPUs.

    .venv/bin/python bench/lora_1b.py --steps 6 --rows 2          # CPU: a few minutes
    python bench/lora_1b.py --steps 30 --rows 8 --device cuda     # what accelerator_check.sh runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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


def make_model(root: Path) -> Path:
    """A random TinyLlama-shaped model with the embedded default's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kubetune.models.load import load_tokenizer, resolve_model

    out = root / "tinyllama-random"
    torch.manual_seed(0)
    config = LlamaConfig(**TINYLLAMA)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(resolve_model("smollm2-135m-instruct")).save_pretrained(out)
    return out


def flops_per_token(r: int = 16) -> float:
    c = TINYLLAMA
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    base = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * c["vocab_size"]
    adapters = layers * r * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter))
    return 4 * base + 6 * adapters


def device_peak(device: str, threads: int) -> tuple[float, str]:
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name()
        from kubetune.training.flops import ACCELERATOR_PEAKS  # dense bf16, vendors' data sheets

        for key, peak in ACCELERATOR_PEAKS.items():
            if key in name:
                return peak, f"{name} (data sheet, dense bf16)"
        return 0.0, f"{name} (no peak in the table)"
    torch.set_num_threads(threads)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        a @ b
        t = time.perf_counter()
        a @ b
        best[dtype] = 2 * 2048**3 / (time.perf_counter() - t)
    return max(
        best.values()
    ), f"CPU, measured 2048^3 (fp32 {best[torch.float32] / 1e9:.0f}, bf16 {best[torch.bfloat16] / 1e9:.0f} GFLOP/s)"


def arm_kubetune(model: Path, args: argparse.Namespace, tmp: str) -> dict:
    from kubetune.training.run import train_from_recipe

    summary = train_from_recipe(
        None,
        [
            f"model.name_or_path={model}",
            f"data.train={DATA}",
            f"data.max_train_samples={args.steps * args.rows * 8}",
            "data.eval=0",
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
        ],
    )
    assert summary is not None
    return {"tokens_per_s": summary.tokens_per_s, "tokens": summary.train_tokens, "precision": summary.precision}


def arm_hf(model: Path, args: argparse.Namespace, tmp: str) -> dict:
    """HF Trainer + PEFT, bf16=True, rows of the same data padded per batch."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[: args.steps * args.rows]]
    texts = [f"{r.get('input', '')}\n{r.get('output', '')}" for r in rows]
    enc = [tok(t, truncation=True, max_length=SEQ)["input_ids"] for t in texts]
    ds = Dataset.from_dict({"input_ids": enc, "labels": enc})
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    lm = get_peft_model(lm, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    targs = TrainingArguments(
        output_dir=f"{tmp}/hf", per_device_train_batch_size=args.rows, max_steps=args.steps, bf16=True,
        logging_steps=1000, save_strategy="no", report_to=[], use_cpu=args.device == "cpu",
    )  # fmt: skip
    trainer = Trainer(model=lm, args=targs, train_dataset=ds, data_collator=DataCollatorForSeq2Seq(tok))
    t0 = time.perf_counter()
    trainer.train()
    real = sum(len(e) for e in enc)
    return {"tokens_per_s": real / (time.perf_counter() - t0), "tokens": real, "precision": "bf16"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rows", type=int, default=2, help="rows per step (kubetune: packed rows of 512 tokens)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--arm", choices=["kubetune", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        with tempfile.TemporaryDirectory() as tmp:
            fn = arm_kubetune if args.arm == "kubetune" else arm_hf
            print(json.dumps(fn(Path(args.model), args, tmp)))
        return
    peak, where = device_peak(args.device, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        results = {}
        for arm in ("kubetune", "hf"):
            cmd = [sys.executable, __file__, "--arm", arm, "--model", str(model), *sys.argv[1:]]
            res = subprocess.run(cmd, capture_output=True, text=True)
            results[arm] = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
            if res.returncode != 0:
                print(f"{arm}: failed: {res.stderr.strip().splitlines()[-1:]}")
    fpt = flops_per_token()
    print(f"peak: {peak / 1e12:.3f} TFLOP/s ({where}); useful FLOPs per token {fpt / 1e9:.2f} G")
    for arm, r in results.items():
        if r:
            mfu = r["tokens_per_s"] * fpt / peak if peak else float("nan")
            speed = f"{r['tokens_per_s']:9.1f} tokens/s  MFU {mfu:6.1%}"
            print(f"{arm:9s} {r['precision']:>5s} {speed}  ({r['tokens']} tokens)")
    if results.get("kubetune") and results.get("hf"):
        print(f"kubetune / HF Trainer: x{results['kubetune']['tokens_per_s'] / results['hf']['tokens_per_s']:.2f}")
    print(json.dumps({"peak": peak, "results": results}))


if __name__ == "__main__":
    main()
