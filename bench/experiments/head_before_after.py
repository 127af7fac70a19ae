"""The chunked LM head before and after a commit, side by side in one run: forward + backward
of one default micro-batch's targets (1,100) through SmolLM2's head (576 x 49,152), fp32, one
thread, interleaved rounds alternating the order, medians; and the aten operators each version
dispatches for 4,000 targets in the CPU's pieces and in an accelerator's (`head_geometry`).

    .venv/bin/python bench/experiments/head_before_after.py --before c08dfe3~1
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kubetune.models import lm_loss as after

REPO = Path(__file__).resolve().parents[2]


def module_at(commit: str) -> Any:
    """kubetune.models.lm_loss as it was at `commit`, loaded as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:src/kubetune/models/lm_loss.py"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "lm_loss_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("lm_loss_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="c08dfe3~1", help="the commit to compare with (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    before = module_at(args.before)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(1100, 576, generator=g), torch.randn(49152, 576, generator=g) * 0.05
    targets = torch.randint(0, 49152, (1100,), generator=g)

    def run(module: Any, **geometry: int) -> None:
        x = hidden.clone().requires_grad_()
        module.target_cross_entropy(x, weight, targets, **geometry).backward()

    arms = {"before": before, "after": after}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for module in arms.values():
        run(module)
    for r in range(args.rounds):
        for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            t = time.perf_counter()
            run(arms[name])
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name:6s} {statistics.median(ts) * 1e3:8.1f} ms  (rounds: {[round(t * 1e3) for t in ts]})")
    print(f"after / before: {statistics.median(times['after']) / statistics.median(times['before']):.3f}")
    h, t = torch.randn(4000, 64, requires_grad=True), torch.randint(0, 49152, (4000,))
    w = torch.randn(49152, 64)
    for label, geometry in (
        ("CPU pieces", (256, 2048)),
        ("accelerator pieces", after.head_geometry(torch.device("cuda"), 49152)),
    ):
        with _Count() as ops:
            after.target_cross_entropy(h, w, t, chunk_rows=geometry[0], vocab_slice=geometry[1]).backward()
        print(f"{label} {geometry}: {ops.n} aten operators for 4,000 targets")
    print(f"CPU: {sys.platform}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
