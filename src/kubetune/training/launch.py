"""Starting several processes: torchrun's elastic agent, from flags or from a job's env.

`kubetune train --nproc-per-node N [--nnodes M ...]` and a pod whose operator asks for
several processes per node (Kubeflow PyTorchJob `nprocPerNode` > 1, Trainer v2 TrainJob,
elastic PyTorchJobs) both end up here: we run torchrun's agent (torch.distributed.run)
with `-m kubetune train ...` as its worker command. torchrun reads the operator's `PET_*`
variables as its own flags, so a pod needs no arguments beyond the recipe.
"""

from __future__ import annotations

import os
import sys

from kubetune.errors import RecipeError


def needs_agent(env: dict[str, str] | None = None) -> bool:
    """True when this process should start torchrun instead of training itself.

    - under torchrun already (LOCAL_RANK / TORCHELASTIC_RUN_ID set): no;
    - PyTorchJob, one process per pod: MASTER_ADDR/RANK/WORLD_SIZE are set and
      PET_NPROC_PER_NODE is absent or 1: no, train directly;
    - TrainJob or elastic PyTorchJob (PET_NNODES without RANK), or several processes per
      pod (PET_NPROC_PER_NODE > 1 or `auto`/`gpu`/`cpu`): yes.
    """
    env = dict(os.environ if env is None else env)
    if "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env:
        return False
    nproc = env.get("PET_NPROC_PER_NODE")
    if nproc is not None and nproc != "1":
        return True
    return "PET_NNODES" in env and "RANK" not in env


def die_with_agent(env: dict[str, str] | None = None) -> None:
    """Make this torchrun worker die with its agent. An agent killed by SIGKILL (the OOM
    killer, `kill -9` of `kubetune train`) cannot stop its workers, which would go on
    training into the run directory beside the next run."""
    env = dict(os.environ if env is None else env)
    if "TORCHELASTIC_RUN_ID" not in env or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    agent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != agent:  # the agent died before the request took effect
        os._exit(1)


def local_processes(value: str) -> int:
    """`--nproc-per-node`: a number, or `auto`: one process per accelerator, else one per
    physical CPU core, each with one thread (BENCHMARKS.md measures this against one
    process with several threads)."""
    if value == "auto":
        import psutil

        from kubetune.training.dist import accelerator_count

        if accelerators := accelerator_count():
            return accelerators
        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        return max(1, min(cores, len(os.sched_getaffinity(0))))  # a container may allow fewer
    if not value.isdigit() or int(value) < 1:
        from kubetune.errors import UserError

        raise UserError(f"--nproc-per-node {value}: give a number of processes (1 or more) or auto")
    return int(value)


def precheck(recipe: str | None, overrides: list[str], world_size: int, nproc_per_node: int) -> dict[str, str]:
    """Fail in the launcher, once, with one line, instead of in every worker; return the
    communication environment (the recipe's `comm` section) for the local workers."""
    from kubetune.recipe import load_recipe
    from kubetune.recipe.comm import comm_env, comm_warnings
    from kubetune.recipe.layout import check_model, check_recipe, layout_for

    r = load_recipe(recipe, overrides).recipe
    layout = layout_for(r.parallel, world_size)
    if layout.tp > 1 or layout.pp > 1:  # can the model be split this way? (its config is enough)
        from transformers import AutoConfig

        from kubetune.models.load import resolve_model

        config = AutoConfig.from_pretrained(
            resolve_model(r.model.name_or_path), revision=r.model.revision, trust_remote_code=r.model.trust_remote_code
        )
        check_model(layout, config, r)
    check_recipe(layout, r)
    kind = _accelerator_kind()
    for line in comm_warnings(r.comm, kind):  # what `k8s render` warns about, said locally too
        print(f"kubetune: warning: {line}", file=sys.stderr)
    return comm_env(
        r.comm,
        kind,
        cpus_per_process=max(1, (os.cpu_count() or 1) // nproc_per_node),
        processes_per_host=nproc_per_node,
    )


def refuse_missing_chat_template(recipe: str | None, overrides: list[str], env: dict[str, str] | None = None) -> None:
    """`data.template: chat` on a tokenizer without a chat template, refused before anything
    waits on anything: the pods' rendezvous, the model's load. What render could not tell
    offline (an unlisted hub id, a GGUF file) costs one tokenizer load here; the workers of
    a torchrun agent skip it, their agent has checked."""
    from kubetune.recipe import load_recipe
    from kubetune.recipe.chat_template import chat_template_problem, known_chat_template

    env = dict(os.environ if env is None else env)
    r = load_recipe(recipe, overrides).recipe
    if "TORCHELASTIC_RUN_ID" in env or r.data.template != "chat":
        return
    has_template = known_chat_template(r.model.name_or_path)
    if has_template is None:
        from kubetune.models.load import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(r.model.name_or_path), r.model.revision, r.model.trust_remote_code)
        has_template = bool(getattr(tokenizer, "chat_template", None))
    if problem := chat_template_problem(r, has_template):
        raise RecipeError(problem)


def _accelerator_kind() -> str:
    import torch

    if torch.cuda.is_available():
        return "nvidia"
    try:
        import habana_frameworks.torch.hpu as hthpu  # noqa: F401

        return "gaudi"
    except ImportError:
        return "cpu"


def launch_torchrun(
    recipe: str | None,
    overrides: list[str],
    nproc_per_node: int | str | None,
    nnodes: str | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    max_restarts: int,
) -> int:
    """Run torchrun's elastic agent in this process; returns the agent's exit code. The
    workers inherit this process's environment (the CLI prepares it)."""
    from torch.distributed.run import get_args_parser, run

    argv: list[str] = []
    if nproc_per_node is not None:
        argv += ["--nproc-per-node", str(nproc_per_node)]
    if nnodes is not None:
        argv += ["--nnodes", str(nnodes)]
    if node_rank is not None:
        argv += ["--node-rank", str(node_rank)]
    if rdzv_endpoint is not None:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
    elif not any(k in os.environ for k in ("PET_RDZV_ENDPOINT", "PET_MASTER_ADDR")) and (nnodes in (None, "1")):
        argv += ["--standalone"]  # one node: a private rendezvous on a free local port
    argv += ["--max-restarts", str(max_restarts)]
    argv += ["-m", "kubetune", "train"] + ([recipe] if recipe else []) + list(overrides)
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except Exception as e:  # ChildFailedError carries the failing rank's summary
        print(f"kubetune: error: training processes failed: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    return 0
