"""Starting several processes: torchrun's elastic agent, from flags or from a job's env.

`kubetune train --nproc-per-node N [--nnodes M ...]` and a pod whose operator asks for
several processes per node (Kubeflow PyTorchJob `nprocPerNode` > 1, Trainer v2 TrainJob,
elastic PyTorchJobs) both end up here: we run torchrun's agent (torch.distributed.run)
with `-m kubetune train ...` as its worker command. torchrun reads the operator's `PET_*`
variables as its own flags, so a pod needs no arguments beyond the recipe.

Bad input found inside the workers is one line and exit code 2 here too, as in one
process. torch's agent reports a failed worker in several lines (`Sending process ...
closing signal SIGTERM` for the others, `failed (exitcode: 2)`, then ChildFailedError's
report), and every worker that meets the same input prints the same error. So:

- a worker of this launcher that stops on a UserError does not print it: it records it in
  the error file its agent gives it (TORCHELASTIC_ERROR_FILE, in the format of torch's
  `errors.record`, the problems under USER_ERROR_KEY) and exits 2;
- from then on the agent's lines about stopping the workers are held back: they only say
  that a worker stopped;
- the agent raises ChildFailedError with each failed worker's file; when every failed
  worker recorded a UserError or was stopped by the agent after one did, the launcher
  raises that UserError (each distinct problem once), which the CLI prints as one line
  with exit code 2. Anything else (a crash, a worker killed, another exception) keeps
  torch's lines, the worker's traceback and torch's full report, and exit code 1.

Under a torchrun of your own (`torchrun -m kubetune train`), torch's agent is the process
you started: kubetune cannot quiet it or choose its exit code, and each worker prints its
own error line; `kubetune train --nproc-per-node N` runs the same agent with one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubetune.errors import RecipeError, UserError, first_line

if TYPE_CHECKING:
    from kubetune.recipe.layout import ModelShape
    from kubetune.recipe.schema import Recipe

USER_ERROR_KEY = "kubetune_user_error"  # in a worker's error file: its problems, one line each
LAUNCHER_PRINTS = "KUBETUNE_LAUNCHER_PRINTS_USER_ERRORS"  # set for the workers of launch_torchrun
# how the agent ends the other workers once one failed (SIGKILL after its shutdown timeout)
STOPPED_BY_AGENT = frozenset({-signal.SIGTERM, -signal.SIGKILL})
PEER_GONE = ("peer", "connection reset", "connection closed", "broken pipe")  # gloo's words for a peer that left
AGENT_PROCESS_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # "Sending process", "failed (exitcode"


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
        raise UserError(f"--nproc-per-node {value}: give a number of processes (1 or more) or auto")
    return int(value)


def precheck(recipe: str | None, overrides: list[str], world_size: int, nproc_per_node: int) -> dict[str, str]:
    """Fail in the launcher, once, with one line, instead of in every worker; return the
    communication environment (the recipe's `comm` section) for the local workers."""
    from kubetune.recipe import load_recipe
    from kubetune.recipe.comm import comm_env, comm_warnings
    from kubetune.recipe.layout import check_hosts, check_model, check_recipe, layout_for

    r = load_recipe(recipe, overrides).recipe
    layout = layout_for(r.parallel, world_size)
    check_hosts(layout, nproc_per_node)  # a tensor-parallel group on one host (its all-reduces run every layer)
    if layout.tp > 1 or layout.pp > 1:  # can the model be split this way? (its shape is enough)
        check_model(layout, _model_shape(r), r)
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


def _model_shape(r: Recipe) -> ModelShape:
    """The model's shape as `k8s render` knows it (a local config.json, a well-known hub id: no network, so
    a host without the Hub's access, or without the gated model's token yet, is still told about its
    layout), else its config from the Hub, whose failure is one line (ModelError), not a traceback."""
    from kubetune.models.load import model_config
    from kubetune.recipe.layout import model_shape

    if (shape := model_shape(r.model.name_or_path)) is not None:
        return shape
    return model_config(r.model)


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
    has_template = known_chat_template(r.model.name_or_path, r.model.revision)
    if has_template is None:
        from kubetune.models.load import model_tokenizer

        tokenizer = model_tokenizer(r.model)
        has_template = bool(getattr(tokenizer, "chat_template", None))
    if problem := chat_template_problem(r, has_template):
        raise RecipeError(problem)


def refuse_foreign_run_dir(
    recipe: str | None, overrides: list[str], nnodes: str | None, env: Mapping[str, str] | None = None
) -> None:
    """The run directory of another recipe (or a directory that is no run), refused by a
    start that is alone on it, before it measures or starts anything. The processes of a
    multi-node or operator-started job are not alone: one of them could see rank 0's first
    files before its run.json; rank 0 judges for them in training (run.claim_run_dir)."""
    from kubetune.recipe import load_recipe
    from kubetune.rundir import RunDir
    from kubetune.training.processes import started_by_launcher

    if started_by_launcher(env) or nnodes not in (None, "1"):  # a torchrun, an operator's pod, several nodes
        return
    r = load_recipe(recipe, overrides).recipe
    RunDir(Path(r.output_dir)).claim(r)


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
    max_restarts: int | None,
) -> int:
    """Run torchrun's elastic agent in this process; returns the agent's exit code. The
    workers inherit this process's environment (the CLI prepares it)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = agent_argv(nproc_per_node, nnodes, node_rank, rdzv_endpoint, max_restarts)
    with contextlib.ExitStack() as stack:
        log_dir = _agent_log_dir(stack)
        argv += ["--log-dir", log_dir]  # where the agent puts each worker's error file
        argv += ["-m", "kubetune", "train"] + ([recipe] if recipe else []) + list(overrides)
        args = get_args_parser().parse_args(argv)
        stack.enter_context(_workers_report_user_errors(Path(log_dir)))
        try:
            run(args)
        except ChildFailedError as e:
            if problems := user_problems(e.failures):
                raise UserError(*problems) from None
            print(f"kubetune: error: training processes failed:{e}", file=sys.stderr)  # torch's whole report
            return 1
        except Exception as e:  # the agent itself: rendezvous, a signal
            print(f"kubetune: error: training processes failed: {first_line(e)}", file=sys.stderr)
            return 1
    return 0


def agent_argv(
    nproc_per_node: int | str | None,
    nnodes: str | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    max_restarts: int | None,
) -> list[str]:
    """torchrun's options for what the CLI was given. An option not given is left out, so that
    torchrun's parser takes it from the pod's `PET_*` variable (the Kubeflow operator sets
    `PET_MAX_RESTARTS` from the recipe's `k8s.elastic.max_restarts`), else its own default."""
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
    if max_restarts is not None:
        argv += ["--max-restarts", str(max_restarts)]
    return argv


def report_to_launcher(error: UserError, env: Mapping[str, str] | None = None) -> bool:
    """In a worker of `launch_torchrun`: record `error` in the error file the agent gave this
    worker, for the launcher to print once. False when this process must print it itself:
    no such launcher above it (a torchrun of the user's own), or no file could be written."""
    env = os.environ if env is None else env
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path or env.get(LAUNCHER_PRINTS) != "1":
        return False
    from kubetune.fsutil import atomic_write_json

    text = "\n".join(error.problems)
    info = {"py_callstack": text, "timestamp": str(int(time.time()))}  # torch's report shows the line, no traceback
    try:
        atomic_write_json(Path(path), {"message": {"message": text, "extraInfo": info}, USER_ERROR_KEY: error.problems})
    except OSError:
        return False
    return True


def peer_user_error(
    error: BaseException, env: Mapping[str, str] | None = None, wait_s: float = 5.0
) -> UserError | None:
    """In a worker of `launch_torchrun` whose collective failed because a peer left: the
    UserError a peer on this node recorded before it stopped, else None. A peer that stops on
    bad input closes its connections, and the processes waiting for it in a reduction fail
    with gloo's "Connection closed by peer"; their tracebacks would bury the one line. The
    peer writes its file before it exits; `wait_s` covers a file still being written."""
    env = os.environ if env is None else env
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not isinstance(error, (RuntimeError, ConnectionError)) or not path or env.get(LAUNCHER_PRINTS) != "1":
        return None
    attempt = Path(path).parent.parent  # <log dir>/<run id>/attempt_<n>/<local rank>/error.json
    if not any(word in str(error).lower() for word in PEER_GONE):
        wait_s = 0.0  # another failure: only a file already there makes it a consequence
    deadline = time.monotonic() + wait_s
    while True:
        for peer in sorted(attempt.glob("*/error.json")):
            problems = _recorded_problems(peer)
            if problems:
                return UserError(*problems)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def user_problems(failures: Mapping[int, Any]) -> list[str]:
    """The problems the workers recorded, when bad input is why the group failed: each failed
    worker (torch's ProcessFailure) recorded a UserError, or the agent stopped it after one
    did. Each distinct line once, the first failure's first. Empty for anything else."""
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    recorded = [failure.error_file_data.get(USER_ERROR_KEY) for _, failure in ordered]
    if not any(recorded):
        return []
    if any(not lines and failure.exitcode not in STOPPED_BY_AGENT for lines, (_, failure) in zip(recorded, ordered)):
        return []  # a worker that crashed on its own: torch's report says which
    return list(dict.fromkeys(line for lines in recorded if lines for line in lines))


def _agent_log_dir(stack: contextlib.ExitStack) -> str:
    """A fresh directory for this launch's worker files (error.json): inside PET_LOG_DIR when
    the operator or the user sets one (kept there), else a temporary one."""
    parent = os.environ.get("PET_LOG_DIR")
    if parent:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix="kubetune-", dir=parent)
    return stack.enter_context(tempfile.TemporaryDirectory(prefix="kubetune-agent-"))


@contextlib.contextmanager
def _workers_report_user_errors(log_dir: Path) -> Iterator[None]:
    """While the agent runs: its workers record their UserErrors for this launcher, and the
    agent's lines about stopping them are held back once one has."""
    quiet = _QuietAfterUserError(log_dir)
    agent_log = logging.getLogger(AGENT_PROCESS_LOGGER)
    before = os.environ.get(LAUNCHER_PRINTS)
    os.environ[LAUNCHER_PRINTS] = "1"  # the workers inherit this process's environment
    agent_log.addFilter(quiet)
    try:
        yield
    finally:
        agent_log.removeFilter(quiet)
        if before is None:
            os.environ.pop(LAUNCHER_PRINTS, None)
        else:
            os.environ[LAUNCHER_PRINTS] = before


class _QuietAfterUserError(logging.Filter):
    """Drops the agent's records once a worker under `log_dir` has recorded a UserError. A
    worker writes its file before it exits, so the file is there before the agent notices
    the exit and logs about it."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self.log_dir = log_dir

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(_records_user_error(path) for path in self.log_dir.rglob("error.json"))


def _records_user_error(path: Path) -> bool:
    return bool(_recorded_problems(path))


def _recorded_problems(path: Path) -> list[str]:
    try:
        problems = json.loads(path.read_text()).get(USER_ERROR_KEY)
    except (OSError, ValueError, AttributeError):  # a crash's file, or one being written
        return []
    return list(problems) if isinstance(problems, list) else []
