"""Process-group setup from whatever launched us.

One code path reads the environment every launcher leaves behind:
- a plain process: nothing set -> world of 1, no process group;
- torchrun / Kubeflow PyTorchJob with torchrun (PET_*) / Trainer v2: RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT set by torchrun's agent;
- Kubeflow PyTorchJob with one process per pod: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK
  set by the operator (LOCAL_RANK absent -> 0).
The backend follows the device: gloo on CPU, nccl on CUDA, hccl on Gaudi.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist

from kubetune.errors import RecipeError


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif _hpu_available():
            name = "hpu"
        else:
            name = "cpu"
    check_device(name, local_rank)
    if name == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if name == "hpu":
        return torch.device("hpu")
    return torch.device("cpu")


def check_device(name: str, local_rank: int = 0) -> None:
    """A recipe's train.device that this process cannot use is bad input: one line (RecipeError)
    before anything starts, instead of torch's traceback at the first call."""
    if name == "cuda":
        _check_cuda(local_rank)
    elif name == "hpu":
        try:
            import habana_frameworks.torch.core  # noqa: F401  (registers the device)
        except ImportError:
            raise RecipeError(
                "train.device=hpu: Habana's PyTorch bridge (habana_frameworks) is not installed here; "
                "run in Intel's Gaudi image, or set train.device=auto"
            ) from None


def _check_cuda(local_rank: int) -> None:
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise RecipeError(
            f"train.device=cuda: torch sees no CUDA GPU here (torch {torch.__version__}, {build}); "
            "set train.device=auto or cpu, or run where a GPU and a CUDA build of torch are"
        )
    if local_rank >= torch.cuda.device_count():
        raise RecipeError(
            f"train.device=cuda: local rank {local_rank} has no GPU (this machine has "
            f"{torch.cuda.device_count()}); start at most that many processes per node"
        )


def _hpu_available() -> bool:
    return hpu_count() > 0


def hpu_count() -> int:
    """Gaudi cards this process can see (0 without Habana's PyTorch bridge)."""
    try:
        import habana_frameworks.torch.hpu as hthpu
    except ImportError:
        return 0
    return int(hthpu.device_count()) if hthpu.is_available() else 0


def accelerator_count() -> int:
    """CUDA GPUs, else Gaudi cards, else 0."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return hpu_count()


def backend_for(device: torch.device, requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "nccl"
    if device.type == "hpu":
        import habana_frameworks.torch.distributed.hccl  # noqa: F401

        return "hccl"
    return "gloo"


def init_distributed(device_name: str = "auto", backend: str = "auto", timeout_s: int = 1800) -> DistEnv:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = pick_device(device_name, local_rank)
    env = DistEnv(rank, world, local_rank, local_world, device)
    if world > 1 and not torch_dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        torch_dist.init_process_group(
            backend=backend_for(device, backend),
            timeout=timeout,
            rank=rank,
            world_size=world,
            store=_restart_store(rank, world, timeout),
        )
    return env


def _restart_store(rank: int, world: int, timeout: datetime.timedelta):
    """Under torchrun's agent, a store namespace of our own for each restart attempt.

    The agent's store outlives the workers. After a restart, gloo's full-mesh setup would
    read the addresses the *previous* workers published there and fail connecting to dead
    ports; a per-attempt prefix makes every attempt start clean. Without the agent
    (Kubeflow's one process per pod), rank 0 hosts the store as usual: return None.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = torch_dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
    )
    return torch_dist.PrefixStore(f"kubetune/attempt-{attempt}/", store)


# --- timing the collectives kubetune issues ---------------------------------------------
# One observer per process (the run's telemetry, when monitoring is on) is told of every
# collective kubetune issues itself: (op, bytes, seconds from issue to completion).
CollectiveObserver = Callable[[str, int, float], None]
_observer: CollectiveObserver | None = None


def observe_collectives(observer: CollectiveObserver | None) -> None:
    global _observer
    _observer = observer


def report_collective(op: str, nbytes: int, seconds: float) -> None:
    """For collectives that complete asynchronously (DDP's buckets): the observer, if any."""
    if _observer is not None:
        _observer(op, nbytes, seconds)


@contextlib.contextmanager
def timed_collective(op: str, nbytes: int) -> Iterator[None]:
    """Report the collective run inside to the observer; free when nobody observes."""
    observer = _observer
    if observer is None:
        yield
        return
    t0 = time.perf_counter()
    yield
    observer(op, nbytes, time.perf_counter() - t0)


def all_reduce_sum(value: float | int, env: DistEnv) -> float:
    if not env.distributed:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=env.device)
    with timed_collective("all_reduce", t.element_size()):
        torch_dist.all_reduce(t)
    return float(t.item())


def all_reduce_sums(values: list[float], env: DistEnv) -> list[float]:
    """`all_reduce_sum` of several numbers in one collective."""
    if not env.distributed:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    with timed_collective("all_reduce", t.numel() * t.element_size()):
        torch_dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def barrier(env: DistEnv) -> None:
    if env.distributed:
        with timed_collective("barrier", 0):
            torch_dist.barrier()


def shutdown(env: DistEnv) -> None:
    if env.distributed and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


# --- gathering ----------------------------------------------------------------------------


def gather_objects(value: Any, env: DistEnv) -> list[Any]:
    """`value` of every rank, in rank order, on every rank."""
    if not env.distributed:
        return [value]
    out: list[Any] = [None] * env.world_size
    torch_dist.all_gather_object(out, value)
    return out


def gather_trainable(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) trainable weights of a sharded loss module, on CPU, names without
    the loss module's `model.` prefix (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    )
    return {k.removeprefix("model."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def gather_stages(module: torch.nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """Every pipeline stage's trainable weights (whole tensors, on CPU), merged on every rank."""
    local = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t  # tensor-parallel slices
            local[name.removeprefix("model.")] = t.cpu()
    merged: dict[str, torch.Tensor] = {}
    for part in gather_objects(local, env):
        merged.update(part)
    return merged
