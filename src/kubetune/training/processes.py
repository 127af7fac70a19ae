"""One process with a thread per core, or one single-thread process per core: measured.

A CPU training step mixes large matmuls, which scale with threads, with many small
operations (per-sample attention, norms, casts, the Python that issues each of them),
which do not: a second thread mostly waits for them. N single-thread processes with data
parallelism run all of it N-wide, at the cost of a copy of the model per process and one
gradient all-reduce per step. Which wins depends on the CPU and the model, so
`kubetune train` without `--nproc-per-node` times both on the model's own decoder layer
and the layer's share of the LM head (forward and backward over the recipe's first
micro-batch, in the precision training will use), by the fair rules of
`kubetune.models.measure`: warmed, interleaved, medians, cached per machine, shapes and
adapters for a week (starting the probe's processes costs seconds, so it is not re-checked
at every start). The head is there because it scales differently: its softmax passes over
the vocabulary gain more from N processes than the layer's matmuls do, so a probe of the
layer alone undervalues the processes (`probe_vocab`).

N processes keep the recipe's global batch: `train.grad_accum` (or else
`train.micro_batch_size`) is divided by N, so the rows of every optimizer step are the
same as in one process (kubetune.training.step normalises by the step's target tokens);
with `train.global_batch_size` set, grad_accum is derived from it for N processes alike.
A run resumes with the process count it started with.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune.errors import UserError, first_line
from kubetune.models.measure import Decision, Question, Workload

MARGIN = 0.95  # N processes cost N model copies and a gradient all-reduce per step: clearly faster, or one
MAX_AGE_S = 7 * 86400  # starting the probe processes costs seconds: a decision is kept a week, then re-measured
MEMORY_SHARE = 0.7  # of the memory this process may use: N processes must fit under it
DIST_ENV = (
    "LOCAL_RANK",
    "TORCHELASTIC_RUN_ID",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
)


@dataclass(frozen=True)
class ProcessPlan:
    """How `kubetune train` runs here: `processes` local processes with `overrides` added."""

    processes: int
    overrides: tuple[str, ...] = ()
    why: str = ""

    def describe(self) -> str:
        threads = "1 thread each" if self.processes > 1 else f"{os.cpu_count()} thread(s)"
        return f"processes: {self.processes} x {threads} ({self.why})"


def started_by_launcher(env: Mapping[str, str] | None = None) -> bool:
    """torchrun, a Kubeflow pod or an MPI-style launcher has set this process's rank."""
    env = os.environ if env is None else env
    return any(k in env for k in DIST_ENV)


def plan_processes(recipe_arg: str | None, overrides: list[str], remeasure: bool = False) -> ProcessPlan:
    """One process, or one per core where that measures faster and the batch splits evenly."""
    from kubetune.recipe import load_recipe
    from kubetune.recipe.layout import grad_accum_for
    from kubetune.training.dist import check_device

    recipe = load_recipe(recipe_arg, overrides).recipe
    check_device(recipe.train.device)  # a named device this machine lacks: one line, not a plan
    fixed = _fixed_reason(recipe)
    if fixed:
        return ProcessPlan(1, why=fixed)
    started = _started_with(Path(recipe.output_dir))
    n = started or _cores()
    t = recipe.train
    accum = grad_accum_for(t, 1)  # one process's (train.global_batch_size, where set, is kept by any split)
    split = batch_split(t.micro_batch_size, accum, n)
    if split is None:
        return ProcessPlan(
            1,
            why=f"train.micro_batch_size={t.micro_batch_size} and train.grad_accum={accum}: "
            f"neither divides by {n}, so {n} processes would change the batch",
        )
    if started is not None:
        return _plan(started, split, f"as the run in {recipe.output_dir} started")
    no_room = _memory_for(recipe, n)
    if no_room:
        return ProcessPlan(1, why=no_room)
    try:
        decision = measure_processes(recipe, n, split, remeasure)
    except UserError:
        raise  # bad input: training would stop on it too, with the same line
    except Exception as e:  # the probe itself failed: train anyway, as one process
        return ProcessPlan(1, why=f"the measurement failed ({first_line(e)}); --nproc-per-node N to choose")
    return _plan(n if decision.choice == "processes" else 1, split, decision.describe())


def _plan(processes: int, split: tuple[int, int], why: str) -> ProcessPlan:
    if processes == 1:
        return ProcessPlan(1, why=why)
    micro, accum = split
    return ProcessPlan(processes, (f"train.micro_batch_size={micro}", f"train.grad_accum={accum}"), why)


def batch_split(micro: int, accum: int, n: int) -> tuple[int, int] | None:
    """(micro-batch, grad_accum) per process that keep micro x accum rows per step over n
    processes: grad_accum divided first (the micro-batch, i.e. the kernels' shapes, stay)."""
    if accum % n == 0:
        return micro, accum // n
    if micro % n == 0:
        return micro // n, accum
    return None


def _cores() -> int:
    import psutil

    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return max(1, min(physical, len(os.sched_getaffinity(0))))


def _fixed_reason(recipe: Any, env: Mapping[str, str] | None = None) -> str | None:
    """Why there is nothing to measure: the processes are given, or only one makes sense."""
    env = os.environ if env is None else env
    cores = _cores()
    if started_by_launcher(env):
        return "started by a launcher"
    if cores < 2:
        return "one core"
    if recipe.train.device not in ("auto", "cpu") or _has_accelerator():
        return "an accelerator: one process per device is --nproc-per-node auto"
    if recipe.train.num_threads or env.get("OMP_NUM_THREADS"):
        return "threads set (train.num_threads or OMP_NUM_THREADS); --nproc-per-node N for processes"
    p = recipe.parallel
    if p.tp > 1 or p.pp > 1 or p.fsdp > 1 or p.dp not in (-1, cores):
        return "parallel.* names its own layout: give --nproc-per-node"
    return None


def _has_accelerator() -> bool:
    from kubetune.training.dist import accelerator_count

    return accelerator_count() > 0


def _started_with(output_dir: Path) -> int | None:
    """The world size of the newest checkpoint in `output_dir`, if the run has one."""
    from kubetune.training import checkpoint as ckpt

    newest = ckpt.latest_checkpoint(output_dir)
    return ckpt.read_meta(newest).world_size if newest is not None else None


def _memory_for(recipe: Any, n: int) -> str | None:
    """Why `n` copies of the model would not fit in memory (None when they would)."""
    import psutil

    from kubetune.training import memory

    need = n * _process_bytes(recipe)
    room = MEMORY_SHARE * min(memory.limit_bytes(), psutil.virtual_memory().available)
    if need <= room:
        return None
    return f"{n} processes would need ~{need / 2**30:.1f} GiB, {room / 2**30:.1f} GiB is free to use"


def _process_bytes(recipe: Any) -> float:
    """A rough peak for one training process (`recipe.footprint.process_bytes`, which render's
    memory check uses too), from the parameters of the model itself."""
    import torch

    from kubetune.models.load import build_causal_lm, model_config
    from kubetune.recipe.footprint import process_bytes, weight_width

    config = model_config(recipe.model)
    with torch.device("meta"):
        params = sum(p.numel() for p in build_causal_lm(config, recipe.model.trust_remote_code).parameters())
    return process_bytes(params, weight_width(recipe))


# --- the measurement --------------------------------------------------------------------


def measure_processes(recipe: Any, cores: int, split: tuple[int, int], remeasure: bool = False) -> Decision:
    """Time one decoder layer (with the recipe's adapters) forward and backward over the
    recipe's first micro-batch: here with the threads one training process would use, and
    in `cores` single-thread processes at once, each on its share of the batch."""
    import torch

    from kubetune.models import kernels, measure
    from kubetune.models.attention import seqlens_from_cu
    from kubetune.training import allocator

    torch.set_num_threads(os.cpu_count() or 1)  # as kubetune.training.setup.configure_threads does
    config, batcher = probe_inputs(recipe)
    first = batcher.micro_batch(0, 0)[0]
    lengths = seqlens_from_cu(first.cu_seqlens)
    precision = kernels.compute_precision(recipe.train.precision, config, torch.device("cpu"))
    per_process = lengths[: max(1, len(lengths) * split[0] // recipe.train.micro_batch_size)]
    targets = first.target_tokens
    per_process_targets = round(targets * sum(per_process) / max(sum(lengths), 1))
    spec = LayerSpec(recipe.with_kernels(precision, "fp32").model_dump(mode="json"), config.to_dict())
    head = {"vocab": probe_vocab(config), "targets": targets, "per_process": per_process_targets}
    q = Question(
        name="processes",
        default="threads",
        challenger="processes",
        margin=MARGIN,
        key={"cores": cores, "jemalloc": allocator.jemalloc_loaded(), "samples": lengths, "per_process": per_process}
        | {"head": head}
        | spec.key(),
        unit=UNIT,
        max_age_s=MAX_AGE_S,
    )
    units = {"threads": sum(lengths) / 1000, "processes": cores * sum(per_process) / 1000}
    with contextlib.ExitStack() as stack:

        def workloads() -> dict[str, Workload]:  # only when measuring: starting processes costs seconds
            here = layer_workload(spec, lengths, targets)  # first: a bad recipe fails here, in one line
            # a first decision can take minutes (a slow precision, a large layer): say what runs
            print(f"kubetune: processes: timing 1 x {cores} threads against {cores} x 1 on a decoder layer "
                  "(once; the answer is cached)", file=sys.stderr, flush=True)  # fmt: skip
            pool = stack.enter_context(WorkerPool(cores, spec, per_process, per_process_targets))
            return {"threads": here, "processes": pool.run}

        return measure.settle(q, workloads, remeasure=remeasure, units=units)


def probe_inputs(recipe: Any) -> tuple[Any, Any]:
    """The model's config and the recipe's training batcher (one process)."""
    from kubetune.data import prepare_data
    from kubetune.models.load import model_config, model_tokenizer
    from kubetune.recipe.layout import data_parallel_only
    from kubetune.training.setup import train_batcher

    tokenizer = model_tokenizer(recipe.model)
    data = prepare_data(recipe, tokenizer)  # cached on disk: the training processes read it again for free
    batcher = train_batcher(recipe, data, tokenizer.pad_token_id, data_parallel_only(1, 0))
    return model_config(recipe.model), batcher


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as the recipe trains it (its kernel choices resolved), in JSON for
    the probe processes."""

    recipe: dict[str, Any]
    config: dict[str, Any]

    def key(self) -> dict[str, Any]:
        """What the timing depends on: the layer's shapes, the precision, the adapters."""
        shapes = {k: self.config.get(k) for k in LAYER_FIELDS}
        r = self.recipe
        return {"layer": shapes, "precision": r["train"]["precision"], "finetune": r["finetune"], "lora": r["lora"]}


LAYER_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
UNIT = "per 1k tokens of a decoder layer and its share of the head"


def probe_vocab(config: Any) -> int:
    """The vocabulary of the probe's head: the model's over its layers, so that one layer
    carries its share of the head's work, in whole slices of the chunked head (whose
    per-slice passes are what the probe must time)."""
    from kubetune.models.lm_loss import VOCAB_SLICE

    share = -(-config.vocab_size // max(config.num_hidden_layers, 1))
    return int(min(config.vocab_size, -(-share // VOCAB_SLICE) * VOCAB_SLICE))


def layer_workload(spec: LayerSpec, lengths: list[int], targets: int) -> Workload:
    """Forward and backward of one decoder layer over packed samples of `lengths`, and of the
    head (`probe_vocab` wide) on `targets` of their positions, built the way training builds
    the model (kubetune.models.finetune: LoRA or full; the head's loss is training's)."""
    import torch

    from kubetune.data.packing import IGNORE
    from kubetune.models.attention import SEQLENS_KWARG, register
    from kubetune.models.finetune import head_loss, prepare_for_training
    from kubetune.models.kernels import autocast_context
    from kubetune.models.load import DTYPES, build_causal_lm, config_from_dict
    from kubetune.recipe import Recipe

    recipe = Recipe.model_validate(spec.recipe)
    cfg = config_from_dict(copy.deepcopy(spec.config), recipe.model)
    cfg.vocab_size = probe_vocab(cfg)
    cfg.num_hidden_layers = 1
    dtype = DTYPES[recipe.base_dtype_name()]
    remote = recipe.model.trust_remote_code
    lm = build_causal_lm(cfg, remote, attn_implementation=register("fp32"), dtype=dtype)
    prepare_for_training(lm, recipe.model_copy(update={"train": recipe.train.model_copy(update={"compile": False})}))
    lm.train()
    layer, rotary = lm.model.layers[0], lm.model.rotary_emb
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, sum(lengths), cfg.hidden_size, generator=g).to(dtype).requires_grad_(True)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = torch.full((1, sum(lengths)), IGNORE)
    labels[0, :targets] = torch.randint(0, cfg.vocab_size, (min(targets, labels.shape[1]),), generator=g)
    autocast = autocast_context(recipe.train.precision, torch.device("cpu"))
    kwargs = {SEQLENS_KWARG: lengths}

    def run(calls: int) -> None:
        for _ in range(calls):
            with autocast():
                out = layer(hidden, position_ids=positions, position_embeddings=rotary(hidden, positions), **kwargs)
                loss = head_loss(lm.lm_head, out, labels) if targets else out.float().sum()
            loss.backward()

    return run


class WorkerPool:
    """`n` single-thread processes (`python -m kubetune.training.processes`) that run the
    layer workload together on command: one line per command over their stdin and stdout."""

    def __init__(self, n: int, spec: LayerSpec, lengths: list[int], targets: int) -> None:
        job = {"spec": dataclasses.asdict(spec), "lengths": lengths, "targets": targets}
        self.n, self.payload = n, json.dumps(job)
        self.procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> WorkerPool:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # their OpenMP pools, from the first op
        for _ in range(self.n):
            proc = subprocess.Popen(
                [sys.executable, "-m", "kubetune.training.processes"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            assert proc.stdin is not None
            proc.stdin.write(self.payload + "\n")
            proc.stdin.flush()
            self.procs.append(proc)
        for proc in self.procs:
            self._expect(proc, "ready")
        return self

    def run(self, calls: int) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{calls}\n")
            proc.stdin.flush()
        for proc in self.procs:
            self._expect(proc, "done")

    @staticmethod
    def _expect(proc: subprocess.Popen[str], word: str) -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"a probe process stopped: {line or 'no answer'}")

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):  # a worker that already died
                assert proc.stdin is not None
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _worker_main() -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, once per probe

    torch.set_num_threads(1)
    job = json.loads(sys.stdin.readline())
    try:
        run = layer_workload(LayerSpec(**job["spec"]), job["lengths"], job["targets"])
    except Exception as e:  # the parent reports it in one line
        print(f"failed to build the layer: {first_line(e)}", flush=True)
        sys.exit(1)
    print("ready", flush=True)
    for line in sys.stdin:
        run(int(line))
        print("done", flush=True)


if __name__ == "__main__":
    _worker_main()
