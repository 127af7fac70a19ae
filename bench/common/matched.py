"""What a kubetune run takes to train as its HF / TRL baseline does in the A/B scripts: the same
LoRA, a constant learning rate without warm-up or weight decay, clipping at 1.0, the same seed, no
checkpoints, every step logged."""

from __future__ import annotations


def lora_overrides(r: int, alpha: float, dropout: float, targets: list[str]) -> list[str]:
    return [
        "finetune.method=lora",
        f"lora.r={r}",
        f"lora.alpha={alpha}",
        f"lora.dropout={dropout}",
        f"lora.target_modules=[{','.join(targets)}]",
    ]


def schedule_overrides(lr: float, precision: str, seed: int) -> list[str]:
    return [
        f"train.lr={lr}",
        "train.lr_schedule=constant",
        "train.warmup_steps=0",
        "train.weight_decay=0.0",
        "train.max_grad_norm=1.0",
        f"train.precision={precision}",
        f"train.seed={seed}",
        "train.save_every=0",
        "train.log_every=1",
        "eval.generate=0",
    ]
