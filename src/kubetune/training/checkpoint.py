"""Checkpoints that survive SIGKILL and resume step-exact, with any world size.

Layout of `output_dir/checkpoints/step-N/`:
  model_optim/   torch.distributed.checkpoint (DCP): trainable weights + optimizer state,
                 sharded per rank, re-shardable on load (2 processes -> 1 and back)
  rng-rank<R>.pt RNG states of each rank (python, numpy, torch, accelerator)
  meta.json      progress: step, epoch, data row, tokens, schedule, eval-before, world size
  recipe.yaml    the recipe that produced it
A checkpoint is written into a temporary sibling and renamed when complete (rank 0 renames
after every rank has written), so a directory named step-N is always whole; a kill leaves at
most a `.step-N.tmp-*` directory that the next save removes.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from kubetune.fsutil import atomic_write_json, atomic_write_text, fsync_dir, fsync_tree
from kubetune.training.dist import DistEnv, barrier
from kubetune.training.optim import restore_schedule

STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState:
    """Where the run is: what a checkpoint must carry to continue step-exact."""

    step: int = 0
    epoch: int = 0
    row: int = 0  # first unread row of `epoch`, counted over all data-parallel ranks
    tokens: int = 0  # real (non-padding) tokens trained on, all ranks
    train_time_s: float = 0.0
    eval_before: dict[str, Any] | None = None  # loss, perplexity, tokens, answers
    eval_history: list[list[float | None]] = field(default_factory=list)  # [step, eval loss] pairs
    resumes: int = 0  # times this run continued from a checkpoint (a restarted pod, a rerun)


@dataclass(frozen=True)
class CheckpointMeta:
    """meta.json of a checkpoint: the state, and the schedule it was planned with."""

    state: TrainState
    total_steps: int
    seed: int
    length: tuple[int | None, float]  # (train.max_steps, train.epochs) the schedule was planned for
    world_size: int = 1
    scheduler: dict[str, Any] = field(default_factory=dict)
    loss_scaler: dict[str, Any] | None = None  # fp16's GradScaler (scale, growth tracker): resumes step-exact

    def to_json(self) -> dict[str, Any]:
        # flat, as earlier kubetune versions wrote it, so that their checkpoints still resume
        return {
            **asdict(self.state),
            "total_steps": self.total_steps,
            "seed": self.seed,
            "length": list(self.length),
            "world_size": self.world_size,
            "scheduler": self.scheduler,
            "loss_scaler": self.loss_scaler,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CheckpointMeta:
        state = TrainState(**{f.name: d[f.name] for f in fields(TrainState) if f.name in d})
        length = d.get("length") or [None, 0.0]
        return cls(
            state=state,
            total_steps=int(d["total_steps"]),
            seed=int(d.get("seed", 0)),
            length=(length[0], float(length[1])),
            world_size=int(d.get("world_size", 1)),
            scheduler=d.get("scheduler", {}),
            loss_scaler=d.get("loss_scaler"),
        )


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / "meta.json").is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _options(strict: bool = True) -> StateDictOptions:
    # Only trainable tensors: a LoRA checkpoint is megabytes, not the whole base model.
    # Loading is non-strict only towards the frozen weights we chose not to save; dcp.load
    # itself fails if any trainable tensor is missing from the checkpoint.
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def _state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Trainable weights and optimizer state, as DCP state dicts.

    `ignore_frozen_params` looks at deduplicated parameters only, so a frozen weight tied
    to another (an LM head tied to the embedding) would still be saved under its second
    name: that is the whole embedding matrix in every LoRA checkpoint. Drop every name of
    a frozen parameter instead.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def save_checkpoint(
    root: Path,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    meta: CheckpointMeta,
    recipe_yaml: str,
    env: DistEnv,
    keep_last: int,
) -> Path:
    """Write checkpoints/step-N atomically (every rank its shards), keep the newest `keep_last`."""
    step = meta.state.step
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step-*.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier(env)
    model_sd, optim_sd = _state(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "model_optim"))
    torch.save(_rng_state(), tmp / f"rng-rank{env.rank}.pt")
    barrier(env)
    if env.is_main:
        meta = CheckpointMeta(
            state=meta.state,
            total_steps=meta.total_steps,
            seed=meta.seed,
            length=meta.length,
            world_size=env.world_size,
            scheduler=scheduler.state_dict(),
            loss_scaler=meta.loss_scaler,
        )
        atomic_write_json(tmp / "meta.json", meta.to_json())
        atomic_write_text(tmp / "recipe.yaml", recipe_yaml)
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(root)
        for old in list_checkpoints(root.parent)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(env)
    return final


def read_meta(path: Path) -> CheckpointMeta:
    return CheckpointMeta.from_json(json.loads((Path(path) / "meta.json").read_text()))


def load_checkpoint(path: Path, model: Any, optimizer: Any, scheduler: Any, env: DistEnv) -> CheckpointMeta:
    """Load weights, optimizer, scheduler and RNG; return meta. Works across world sizes
    and parallel layouts (the tensors are resharded by DCP)."""
    path = Path(path)
    model_sd, optim_sd = _state(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "model_optim"))
    # The saved param groups carry the saving run's AdamW implementation (fused for whole
    # tensors, a loop for tensor-parallel ones): keep this run's.
    impl = [{k: g.get(k) for k in ("fused", "foreach")} for g in optimizer.param_groups]
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(strict=False),
    )
    for g, kind in zip(optimizer.param_groups, impl):
        g.update(kind)
    meta = read_meta(path)
    restore_schedule(scheduler, optimizer, meta.scheduler)
    rng_file = path / f"rng-rank{env.rank}.pt"
    if rng_file.is_file() and meta.world_size == env.world_size:
        # Same world size: every rank continues its own random stream (dropout), step-exact.
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        # Different world size: streams can't map 1:1; reseed deterministically per rank.
        torch.manual_seed(meta.seed + 1000 * meta.state.step + env.rank)
    return meta
