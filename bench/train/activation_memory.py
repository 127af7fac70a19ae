"""Where a training step's memory goes: the tensors autograd saves for the backward pass,
attributed to the module that saved them, for one micro-batch of a recipe.

A saved tensor is counted once per storage (a view of a saved tensor costs nothing more),
under the innermost module whose forward was running when it was saved. Parameters (the
frozen base, the adapters) are not activations and are listed apart.

    .venv/bin/python bench/train/activation_memory.py                        # the default recipe
    .venv/bin/python bench/train/activation_memory.py train.micro_batch_size=2 lora.target_modules=[q_proj,v_proj]
"""

from __future__ import annotations

import collections
import re
import sys
import tempfile

import torch


def build(overrides: list[str]):
    """The training parts `kubetune train` would build, and its first micro-batch."""
    import time

    from kubetune.recipe import load_recipe
    from kubetune.training.dist import init_distributed
    from kubetune.training.parallel import plan_layout
    from kubetune.training.run import claim_run_dir
    from kubetune.training.setup import setup

    recipe = load_recipe(None, overrides).recipe
    env = init_distributed(recipe.train.device, recipe.parallel.backend, recipe.parallel.timeout_s)
    layout = plan_layout(recipe.parallel, env)
    parts = setup(recipe, env, layout, claim_run_dir(recipe, env), time.monotonic())
    batch, _ = parts.batcher.micro_batch(0, 0)
    return parts, batch


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        parts, batch = build([f"output_dir={tmp}/r", *overrides])
        params = {p.untyped_storage().data_ptr() for p in parts.model.loss.parameters()}
        stack: list[str] = []
        saved: dict[int, tuple[int, str]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in saved:
                saved[ptr] = (t.untyped_storage().nbytes(), stack[-1] if stack else "(top)")
            return t

        def enter(name: str):
            return lambda *_: stack.append(name)

        def leave(*_):
            stack.pop()

        for name, module in parts.model.loss.named_modules():
            generic = re.sub(r"\.\d+\.", ".N.", name) or "(loss)"
            module.register_forward_pre_hook(enter(generic))
            module.register_forward_hook(leave)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), parts.runner.autocast():
            loss = parts.model.loss(batch.input_ids, batch.position_ids, batch.targets, batch.cu_seqlens)
        total = sum(n for n, _ in saved.values())
        by_module: collections.Counter[str] = collections.Counter()
        for n, where in saved.values():
            by_module[where] += n
        tokens = batch.input_ids.numel()
        print(f"{parts.recipe.train.precision}, {tokens} tokens in the micro-batch, loss {float(loss.detach()):.4f}")
        print(f"saved for backward: {total / 2**20:,.0f} MiB ({total / tokens / 1024:.1f} KiB per token)")
        for where, n in by_module.most_common(25):
            print(f"  {n / 2**20:9,.1f} MiB  {100 * n / total:5.1f}%  {where}")
        weights = sum(p.numel() * p.element_size() for p in parts.model.loss.parameters())
        print(f"parameters: {weights / 2**20:,.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
