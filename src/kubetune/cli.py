"""The `kubetune` command table. Commands are thin: they parse, then call one function.

Heavy imports (torch, transformers, kubernetes, grpc) happen inside the commands so that
`kubetune --help` and the error paths stay fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from kubetune.contracts.engine import Limits

# the defaults of `kubetune serve`'s options, each declared once (both modules are torch-free and light)
from kubetune.contracts.serving import DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT, DRAIN_TIMEOUT_S, LOCAL_HOST
from kubetune.errors import UserError

app = typer.Typer(
    name="kubetune",
    help="Fine-tune LLMs from one YAML recipe: locally, with torchrun, or as a Kubeflow job.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
recipe_app = typer.Typer(help="Inspect recipes.", no_args_is_help=True)
k8s_app = typer.Typer(help="Run the recipe as a Kubernetes (Kubeflow) job.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")
app.add_typer(k8s_app, name="k8s")
data_app = typer.Typer(help="Make training data.", no_args_is_help=True)
app.add_typer(data_app, name="data")
# What only pods run (the daemons and the operator): out of --help, named by the charts and the
# manifests kubetune renders.
pod_app = typer.Typer(help="Entry points of kubetune's pods (the charts and rendered manifests run them).")
app.add_typer(pod_app, name="pod", hidden=True, no_args_is_help=True)


def _print_version(given: bool) -> None:
    if given:
        from kubetune import __version__

        typer.echo(f"kubetune {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print kubetune's version and exit."
    ),
) -> None:
    """The options before any command (the Typer's help above is the app's)."""


def _split_recipe_args(args: list[str]) -> tuple[str | None, list[str]]:
    """`[RECIPE] [key=value ...]`: the first argument is a recipe unless it has an `=`."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


@app.command(context_settings={"allow_extra_args": False})
def train(
    args: list[str] = typer.Argument(None, help="[RECIPE] [key=value ...]; no recipe = the embedded default."),
    nproc_per_node: str | None = typer.Option(
        None,
        "--nproc-per-node",
        help="Start torchrun with N local processes; auto = one per accelerator, or one per CPU core. "
        "Default on CPU: one process, or one per core where that measures faster (`kubetune kernels`).",
    ),
    nnodes: str | None = typer.Option(None, "--nnodes", help="torchrun --nnodes (N or MIN:MAX)."),
    node_rank: int | None = typer.Option(None, "--node-rank", help="torchrun --node-rank."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="torchrun --rdzv-endpoint HOST:PORT."),
    max_restarts: int | None = typer.Option(
        None,
        "--max-restarts",
        help="torchrun --max-restarts (elastic agent). Default: $PET_MAX_RESTARTS (set in the pods from "
        "k8s.elastic.max_restarts), else 0.",
    ),
):
    """Fine-tune (LoRA or full) as the recipe says; resumes from the newest checkpoint."""
    from kubetune.training.allocator import reexec_with_jemalloc

    reexec_with_jemalloc()  # before torch allocates anything (kubetune.training.allocator says why)
    recipe, overrides = _split_recipe_args(args or [])
    from kubetune.training.launch import (
        die_with_agent,
        launch_torchrun,
        needs_agent,
        precheck,
        refuse_foreign_run_dir,
        refuse_missing_chat_template,
    )

    die_with_agent()  # a torchrun worker: gone with its agent, never training on alone
    refuse_missing_chat_template(recipe, overrides)
    refuse_foreign_run_dir(recipe, overrides, nnodes)  # before the process count is measured
    nproc, overrides = _local_processes(nproc_per_node, nnodes, recipe, overrides)
    if nproc or nnodes:
        world = (nproc or 1) * int(nnodes or 1) if nnodes is None or str(nnodes).isdigit() else None
        _worker_environment(precheck(recipe, overrides, world or 0, nproc or 1) if world else {})
        raise typer.Exit(launch_torchrun(recipe, overrides, nproc or 1, nnodes, node_rank, rdzv_endpoint, max_restarts))
    if needs_agent():  # a Kubeflow pod that asks for torchrun (PET_* variables)
        _worker_environment({})
        raise typer.Exit(launch_torchrun(recipe, overrides, None, None, None, None, max_restarts))
    from kubetune.training.run import train_from_recipe

    train_from_recipe(recipe, overrides)


def _local_processes(
    nproc_per_node: str | None, nnodes: str | None, recipe: str | None, overrides: list[str]
) -> tuple[int | None, list[str]]:
    """`--nproc-per-node`, or where it is not given on a plain start, the measured choice
    between one process and one per core (with the batch split that keeps the recipe's)."""
    from kubetune.training.launch import local_processes, needs_agent
    from kubetune.training.processes import plan_processes, started_by_launcher

    if nproc_per_node is not None:
        return local_processes(nproc_per_node), overrides
    if nnodes or needs_agent() or started_by_launcher():
        return None, overrides
    plan = plan_processes(recipe, overrides)
    typer.echo(f"kubetune: {plan.describe()}", err=True)
    if plan.processes == 1:
        return None, overrides
    return plan.processes, [*overrides, *plan.overrides]


@app.command()
def kernels(
    args: list[str] = typer.Argument(None, help="[RECIPE] [key=value ...]; no recipe = the embedded default."),
    remeasure: bool = typer.Option(False, "--remeasure", help="Measure again and rewrite the cached decisions."),
):
    """What `kubetune train` chooses on this machine (precision, attention, processes), and why."""
    from kubetune.training.allocator import reexec_with_jemalloc

    reexec_with_jemalloc()  # measured under the allocator training runs on
    from kubetune.training.choices import describe_choices

    recipe, overrides = _split_recipe_args(args or [])
    typer.echo(describe_choices(recipe, overrides, remeasure))


@app.command("eval")
def eval_cmd(
    target: str = typer.Argument(..., help="A run directory or a recipe."),
    overrides: list[str] = typer.Argument(None, help="key=value overrides (recipe only)."),
    tasks: str | None = typer.Option(
        None,
        "--tasks",
        help="lm-eval tasks (names, or task YAML files/folders), comma-separated: base vs tuned model of the run "
        "(kubetune ships flashcards, flashcards_mc).",
    ),
    limit: int | None = typer.Option(None, "--limit", help="With --tasks: the first N examples of each task."),
):
    """Evaluation loss and perplexity on the recipe's eval data; with --tasks, lm-eval tasks (docs/evaluation.md)."""
    if tasks is not None:
        from kubetune.training.lm_tasks import evaluate_tasks

        if overrides:
            raise UserError(f"--tasks evaluates a run as it was trained: drop the overrides ({' '.join(overrides)})")
        evaluate_tasks(target, tasks, limit)
        return
    if limit is not None:
        raise UserError("--limit goes with --tasks: kubetune eval RUN_DIR --tasks flashcards --limit 8")
    from kubetune.training.evaluate import eval_target

    eval_target(target, overrides or [])


@app.command()
def export(
    run_dir: Path = typer.Argument(..., help="A finished (or checkpointed) run directory."),
    merged: bool = typer.Option(False, "--merged", help="Merge LoRA into the base weights (HF safetensors dir)."),
    gguf: bool = typer.Option(False, "--gguf", help="One GGUF file (llama.cpp, Ollama, LM Studio), LoRA merged."),
    gguf_type: str | None = typer.Option(None, "--gguf-type", help="With --gguf: f16 (default), bf16 or q8_0."),
    output: Path | None = typer.Option(
        None,
        "-o",
        "--output",
        help="Target directory (default RUN_DIR/merged); with --gguf the file (default RUN_DIR/<run>-<type>.gguf).",
    ),
    register: str | None = typer.Option(
        None,
        "--register",
        help="Register the exported weights with their lineage: mlflow (MLFLOW_TRACKING_URI) or kubeflow "
        "(Kubeflow Model Registry, --registry-url).",
    ),
    registered_name: str | None = typer.Option(
        None, "--registered-name", help="With --register: the registered model's name (default: the run's directory)."
    ),
    registry_url: str | None = typer.Option(
        None, "--registry-url", help="With --register kubeflow: the Model Registry's address."
    ),
    gate: bool = typer.Option(
        False,
        "--gate",
        help="Export only when the run's eval.gate passed (else say why, exit 0): the operator's export Job.",
    ),
):
    """Export the adapter (PEFT format), a merged HF model directory, or a GGUF file."""
    _check_register_flags(register, registered_name, registry_url, gguf)
    if gate:
        from kubetune.export.gate import check_before_export

        if not check_before_export(run_dir):
            typer.echo("not exported: the eval gate failed (docs/evaluation.md)")
            return
    if gguf or gguf_type is not None:
        from kubetune.export.gguf import DEFAULT_GGUF_TYPE, export_gguf

        if not gguf:
            raise UserError(f"--gguf-type {gguf_type} goes with --gguf: kubetune export RUN_DIR --gguf --gguf-type ...")
        if merged:
            raise UserError("--merged and --gguf are two exports (a GGUF is always merged): choose one")
        typer.echo(str(export_gguf(run_dir, gguf_type or DEFAULT_GGUF_TYPE, output)))
        return
    from kubetune.export.merged import export_run
    from kubetune.export.registry import REGISTRIES, register_and_report

    if register is not None and register not in REGISTRIES:
        raise UserError(f"--register {register}: not a registry kubetune knows; use one of {', '.join(REGISTRIES)}")
    out = export_run(run_dir, merged=merged, output=output)
    typer.echo(str(out))
    if register is not None:
        typer.echo(register_and_report(register, run_dir, out, merged, registered_name, registry_url).line())


def _check_register_flags(register: str | None, registered_name: str | None, registry_url: str | None, gguf: bool):
    if register is None and (registered_name or registry_url):
        raise UserError("--registered-name and --registry-url go with --register mlflow|kubeflow")
    if register is not None and gguf:
        raise UserError(
            "--register goes with the adapter or --merged, not --gguf: register a run's safetensors weights"
        )


@app.command()
def generate(
    target: str = typer.Argument(..., help="A run directory (base + adapter) or an HF model directory."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The question or instruction."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
):
    """Answer a prompt with a fine-tuned run or model, using the recipe's prompt template."""
    from kubetune.serve.generate import generate_cli

    typer.echo(generate_cli(target, prompt, max_new_tokens=max_new_tokens, temperature=temperature))


# `serve`'s options whose declarations take more than a line, named here so that its signature reads as a list
_serve_dtype_opt = typer.Option(
    "auto", "--dtype", help="auto (what training measured faster on this CPU, see `kubetune kernels`) | bf16 | fp32."
)
_prefix_caching_opt = typer.Option(
    Limits.prefix_caching, "--prefix-caching/--no-prefix-caching", help="Reuse the K/V of prompt prefixes seen before."
)
_max_waiting_opt = typer.Option(Limits.max_waiting, "--max-waiting", help="Requests queued behind them; more get 429.")
_max_model_len_opt = typer.Option(
    Limits.max_model_len, "--max-model-len", help="Prompt + generated tokens per sequence."
)
_prefill_chunk_opt = typer.Option(Limits.prefill_chunk, "--prefill-chunk", help="Prompt tokens read per engine step.")
_kv_cache_gib_opt = typer.Option(None, "--kv-cache-gib", help="KV-cache budget (default: from the memory limit).")
_drain_seconds_opt = typer.Option(
    float(DRAIN_TIMEOUT_S), "--drain-seconds", help="On SIGTERM, how long in-flight requests may finish."
)
_max_body_bytes_opt = typer.Option(
    DEFAULT_MAX_BODY_BYTES, "--max-body-bytes", help="Larger request bodies are refused with a 413."
)
_api_key_opt = typer.Option(
    None, "--api-key", help="Require `Authorization: Bearer KEY` (repeatable; also $KUBETUNE_API_KEY, K1,K2)."
)
_api_key_file_opt = typer.Option(None, "--api-key-file", help="A file of keys, one per line (# comments); repeatable.")
_allow_runtime_adapters_opt = typer.Option(
    False,
    "--allow-runtime-adapters",
    help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).",
)
_max_loras_opt = typer.Option(
    None,
    "--max-loras",
    help="Adapters in the model's layers at once; more stay registered and are loaded for their requests, "
    "evicting the least recently used idle one (as vLLM's --max-loras). Default: all, fused at start.",
)
_adapter_registry_opt = typer.Option(
    None,
    "--adapter-registry",
    help="A registry file (JSON: base, adapters with versions and weights): every version and alias is "
    "served before /ready answers 200.",
)
_adapter_root_opt = typer.Option(
    None,
    "--adapter-root",
    help="Runtime loads (POST /v1/load_lora_adapter) read only from inside this directory (a shared "
    "server's adapter volume); another lora_path is a 400.",
)
_served_model_name_opt = typer.Option(
    None, "--served-model-name", help="The base model's name in the API (repeatable: aliases; first in metrics)."
)
_chat_template_opt = typer.Option(
    None, "--chat-template", help="A Jinja chat template (a file, or the template itself) for every model."
)
_trust_request_chat_template_opt = typer.Option(
    False, "--trust-request-chat-template", help="Let requests send their own `chat_template` (Jinja)."
)
_trust_remote_code_opt = typer.Option(
    False,
    "--trust-remote-code",
    help="Run an HF model directory's own code (auto_map). A run directory uses its recipe's model.trust_remote_code.",
)


@app.command()
def serve(
    target: str = typer.Argument(..., help="A run directory (its base model and adapter) or an HF model directory."),
    adapter: list[str] = typer.Option(None, "--adapter", help="NAME=RUN_DIR: one more LoRA adapter, served as NAME."),
    host: str = typer.Option(LOCAL_HOST, "--host"),
    port: int = typer.Option(DEFAULT_PORT, "--port"),
    engine: str = typer.Option("auto", "--engine", help="auto | native | vllm (vLLM's OpenAI server, if installed)."),
    dtype: str = _serve_dtype_opt,
    max_num_seqs: int = typer.Option(Limits.max_num_seqs, "--max-num-seqs", help="Sequences decoded together."),
    max_waiting: int = _max_waiting_opt,
    max_model_len: int = _max_model_len_opt,
    max_prompt_tokens: int = typer.Option(Limits.max_prompt_tokens, "--max-prompt-tokens"),
    prefill_chunk: int = _prefill_chunk_opt,
    prefix_caching: bool = _prefix_caching_opt,
    kv_cache_gib: float | None = _kv_cache_gib_opt,
    threads: int | None = typer.Option(None, "--threads", help="Default: the container's CPU quota."),
    drain_seconds: float = _drain_seconds_opt,
    max_body_bytes: int = _max_body_bytes_opt,
    api_key: list[str] = _api_key_opt,
    api_key_file: list[Path] = _api_key_file_opt,
    allow_runtime_adapters: bool = _allow_runtime_adapters_opt,
    max_loras: int | None = _max_loras_opt,
    adapter_registry: str | None = _adapter_registry_opt,
    adapter_root: str | None = _adapter_root_opt,
    served_model_name: list[str] = _served_model_name_opt,
    chat_template: str | None = _chat_template_opt,
    trust_request_chat_template: bool = _trust_request_chat_template_opt,
    trust_remote_code: bool = _trust_remote_code_opt,
):
    """Serve a run behind an OpenAI-compatible API (continuous batching, many LoRA adapters)."""
    import os

    from kubetune.contracts.serving import parse_adapter, read_chat_template
    from kubetune.serve.http.auth import load_api_keys

    adapters = tuple(parse_adapter(a) for a in adapter or [])
    sizes = {"--max-num-seqs": max_num_seqs, "--max-waiting": max_waiting, "--max-model-len": max_model_len}
    sizes |= {"--prefill-chunk": prefill_chunk, "--port": port, "--max-body-bytes": max_body_bytes}
    _refuse_bad_serve_values(engine, sizes | ({} if max_loras is None else {"--max-loras": max_loras}))
    api_keys = load_api_keys(api_key or [], api_key_file or [], os.environ)
    template = read_chat_template(chat_template) if chat_template else None
    names = tuple(served_model_name or ())
    if _picked_engine(engine, target, adapter_registry) == "vllm":
        from kubetune.serve.vllm_engine import exec_vllm, vllm_options, with_api_options

        vllm = vllm_options(target, list(adapters), host, port, max_model_len, max_num_seqs, trust_remote_code)
        exec_vllm(with_api_options(vllm, names, chat_template, trust_request_chat_template), api_keys)
    from kubetune.serve.server import serve as run_server

    given = locals() | {"adapters": adapters, "api_keys": api_keys, "template": template, "names": names}
    run_server(_native_serve_options(given))


def _native_serve_options(given: dict[str, Any]) -> Any:
    """The native server's ServeOptions from `serve`'s parameters and what it derived, each by
    name: a flag renamed on one side fails here with its name, never lands in another field."""
    from kubetune.serve.http.state import ApiOptions
    from kubetune.serve.server import ServeOptions

    api = ApiOptions(
        max_body_bytes=given["max_body_bytes"],
        api_keys=given["api_keys"],
        chat_template=given["template"],
        trust_request_chat_template=given["trust_request_chat_template"],
        allow_runtime_adapters=given["allow_runtime_adapters"],
        adapter_root=given["adapter_root"],
    )
    sizes = ("max_num_seqs", "max_waiting", "max_model_len", "max_prompt_tokens", "prefill_chunk", "prefix_caching")
    kv_cache_gib = given["kv_cache_gib"]
    return ServeOptions(
        target=given["target"],
        adapters=given["adapters"],
        host=given["host"],
        port=given["port"],
        dtype=given["dtype"],
        limits=Limits(**{name: given[name] for name in sizes}),
        kv_cache_bytes=int(kv_cache_gib * 2**30) if kv_cache_gib else None,
        threads=given["threads"],
        drain_seconds=given["drain_seconds"],
        served_model_names=given["names"],
        api=api,
        trust_remote_code=given["trust_remote_code"],
        max_loras=given["max_loras"],
        adapter_registry=given["adapter_registry"],
    )


def _refuse_bad_serve_values(engine: str, sizes: dict[str, int]) -> None:
    """`serve`'s --engine and its counts (flag -> value), each refused in one line before anything loads."""
    from kubetune.contracts.serving import ENGINES

    if engine not in ENGINES:
        raise UserError(f"--engine {engine}: choose one of {', '.join(ENGINES)}")
    for name, value in sizes.items():
        if value < 1:
            raise UserError(f"{name} {value}: must be at least 1")


def _picked_engine(engine: str, target: str, registry: str | None = None) -> str:
    """--engine, with auto resolved: vLLM where it is installed and serves this target, else native.
    An adapter registry is the native engine's (vLLM reads no such file)."""
    if registry and engine == "vllm":
        raise UserError("--adapter-registry: served by --engine native only (vLLM reads no registry file)")
    if engine != "auto" or registry:
        return "native" if registry else engine
    from kubetune.serve.vllm_engine import auto_picks_vllm

    picked, why = auto_picks_vllm(target)
    if picked:  # the native engine names itself in its ready line
        typer.echo(f"kubetune: engine vllm ({why})", err=True)
    return "vllm" if picked else "native"


@data_app.command("make-preferences")
def data_make_preferences(
    args: list[str] = typer.Argument(None, help="[RECIPE] [key=value ...]; no recipe = the embedded default."),
    out: Path = typer.Option(..., "--out", "-o", help="The JSONL file of preference pairs to write."),
    limit: int | None = typer.Option(None, "--limit", help="Only the first N rows (a quick run)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Longest rejected (greedy) answer."),
):
    """Preference pairs from the recipe's training data: chosen = the reference answer, rejected = the
    base model's own greedy answer to the same prompt (docs/preference.md)."""
    from rich.console import Console

    from kubetune.serve.preferences import make_preferences

    recipe, overrides = _split_recipe_args(args or [])
    bar = Console(stderr=True) if sys.stderr.isatty() else None  # off a terminal: progress lines
    made = make_preferences(recipe, overrides, out, limit, max_new_tokens, lambda line: typer.echo(line, err=True), bar)
    typer.echo(made.summary())


@recipe_app.command("show")
def recipe_show(args: list[str] = typer.Argument(None, help="[RECIPE] [key=value ...]")):
    """Print the resolved recipe and where each value came from."""
    from rich.console import Console
    from rich.table import Table

    from kubetune.recipe.loader import _flatten, load_recipe

    recipe, overrides = _split_recipe_args(args or [])
    loaded = load_recipe(recipe, overrides)
    table = Table(title=f"recipe: {loaded.source}", show_lines=False)
    table.add_column("key")
    table.add_column("value")
    table.add_column("from")
    for key, value in _flatten(loaded.recipe.model_dump(mode="json")).items():
        table.add_row(key, repr(value), loaded.provenance.get(key, "default"))
    Console(width=160).print(table)


@recipe_app.command("from-helm-values")
def recipe_from_helm_values(
    path: Path = typer.Argument(..., help="A values file in the layout of Intel's huggingface-llm Helm chart."),
    release: str | None = typer.Option(
        None,
        "--release",
        help="The release name `helm install NAME` would be given: it names the job (output_dir) unless the values "
        "set `name` (default: the file's name).",
    ),
):
    """Print the recipe a values file of Intel's huggingface-llm Helm chart means, as the
    kubetune-finetune chart reads it; each key's place is a comment."""
    from kubetune.recipe.helm_values import read_values, recipe_yaml

    typer.echo(recipe_yaml(read_values(path), str(path), release), nl=False)


@recipe_app.command("list")
def recipe_list():
    """List the recipes shipped with kubetune."""
    from kubetune.recipe.loader import builtin_recipes

    for name, path in sorted(builtin_recipes().items()):
        first = next((ln[2:].strip() for ln in path.read_text().splitlines() if ln.startswith("# ")), "")
        typer.echo(f"{name:40s} {first}")


@recipe_app.command("reference")
def recipe_reference():
    """Print every recipe key with its default and meaning (markdown)."""
    from kubetune.recipe.loader import reference_markdown

    typer.echo(reference_markdown())


def _register_optional(module: str, *apps) -> None:
    """Command groups that live in other layers register themselves here."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("kubetune"):
            return  # that part of kubetune is not built yet
        raise
    mod.register(*apps)


_register_optional("kubetune.k8s.cli", k8s_app)
_register_optional("kubetune.cluster.cli", pod_app, k8s_app)
_register_optional("kubetune.operator.cli", app, pod_app)
_register_optional("kubetune.monitor.cli", app)

# Manifests applied before `kubetune pod ...` name these at the top level. Their image tag is
# kubetune's version, which a rebuilt image keeps, so a rescheduled pod would run this code
# with the old argv: the old spelling stays, hidden.
OLD_POD_SPELLINGS = ("device-plugin", "dra-driver", "scheduler-extender", "netprobe")
for _info in pod_app.registered_commands:
    if _info.name in OLD_POD_SPELLINGS and _info.callback is not None:
        app.command(_info.name, hidden=True, help=_info.help)(_info.callback)


def _worker_environment(comm_env: dict[str, str]) -> None:
    """The environment torchrun's workers inherit: the recipe's communication settings
    (where the user has not set them), and none of the operator's single-process variables,
    which would leak into the workers' rendezvous (torchrun sets them for each worker).
    With `monitor.port` set, local rank 0 serves the metrics of every worker of this node
    from a fresh prometheus-client multiprocess directory (kubetune.training.telemetry)."""
    import atexit
    import os
    import shutil
    import tempfile

    for key, value in comm_env.items():
        os.environ.setdefault(key, value)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    metrics_dir = tempfile.mkdtemp(prefix="kubetune-metrics-")
    atexit.register(shutil.rmtree, metrics_dir, ignore_errors=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir


def _process_environment() -> None:
    """Every process kubetune starts (and torchrun's workers, which run this entry point too):
    libraries stay quiet, since kubetune prints its own progress and library progress bars
    and deprecation chatter would bury the one line that matters (an error, or the step
    log); compiled kernels are cached in the kubetune cache so they outlive the process."""
    import os
    import warnings

    from kubetune.fsutil import cache_root

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")


def main() -> None:
    _process_environment()
    try:
        app()
    except UserError as e:
        from kubetune.training.launch import report_to_launcher

        if not report_to_launcher(e):  # a worker of `kubetune train`'s agent: its launcher prints it once
            for line in e.problems:
                print(f"kubetune: error: {line}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("kubetune: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        from kubetune.training.launch import peer_user_error, report_to_launcher

        peer = peer_user_error(e)  # this worker's reduction failed because a peer stopped on bad input
        if peer is None or not report_to_launcher(peer):
            raise
        sys.exit(peer.exit_code)
