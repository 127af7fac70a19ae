"""`kubetune serve --engine vllm`: the same run directory behind vLLM's OpenAI server.

The run's base model and its adapters map onto vLLM's flags (`--model BASE --enable-lora
--lora-modules NAME=ADAPTER_DIR ...`, or the full fine-tune's model directory), under the same
model names as the native engine, so clients change nothing. The process is replaced by
vLLM's (exec), so SIGTERM from Kubernetes reaches vLLM directly.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from kubetune.contracts.serving import Adapter, VllmOptions, VllmRun, vllm_argv, vllm_cpu_kvcache_gib, vllm_run_options
from kubetune.errors import UserError
from kubetune.serve.http.auth import VLLM_API_KEY_ENV, describe
from kubetune.serve.native import host

VLLM_PYTHON_ENV = "KUBETUNE_VLLM_PYTHON"  # a python with vLLM (e.g. .venv-vllm/bin/python), if not this one


def vllm_python() -> str | None:
    """The interpreter that has vLLM: $KUBETUNE_VLLM_PYTHON, else this one when vLLM imports here."""
    explicit = os.environ.get(VLLM_PYTHON_ENV)
    if explicit:
        return explicit if Path(explicit).exists() else None
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_options(
    target: str,
    adapters: list[Adapter],
    host_addr: str,
    port: int,
    max_model_len: int | None,
    max_num_seqs: int | None,
    trust_remote_code: bool = False,
) -> VllmOptions:
    """What vLLM serves for TARGET (`vllm_run_options` for a run; any other directory as it is),
    under the native engine's names: the run directory's for its adapter or model, the base's last
    path component. The embedded GGUF default becomes the HF directory it converts to.
    `trust_remote_code` (--trust-remote-code) is an HF model directory's; a run's recipe decides its own."""
    from kubetune.models.load import resolve_model
    from kubetune.rundir import RunDir

    name = Path(target).resolve().name
    run = RunDir(Path(target))
    if not run.is_run():
        return VllmOptions(
            str(target),
            name,
            tuple(adapters),
            host_addr,
            port,
            max_model_len,
            max_num_seqs,
            trust_remote_code=trust_remote_code,
        )
    recipe = run.recipe()
    run.finished_weights(recipe)
    base = resolve_model(recipe.model.name_or_path) if recipe.finetune.method == "lora" else ""
    extra = tuple(Adapter(a.name, str(_adapter_dir(a.path))) for a in adapters)
    ranks = tuple(RunDir(Path(a.path)).recipe().lora.r for a in adapters if RunDir(Path(a.path)).is_run())
    method = recipe.finetune.method
    lora_rank = recipe.lora.r if method == "lora" else None
    base_name = Path(recipe.model.name_or_path).name
    model = recipe.model
    vllm_run = VllmRun(
        run.weights(method).as_posix(),
        lora_rank,
        name,
        base,
        base_name,
        extra,
        ranks,
        revision=model.revision,
        trust_remote_code=model.trust_remote_code,
    )
    return vllm_run_options(vllm_run, host_addr, port, max_model_len, max_num_seqs)


def with_api_options(
    opts: VllmOptions, names: tuple[str, ...], chat_template: str | None, trust_request_template: bool
) -> VllmOptions:
    """`--served-model-name`, `--chat-template` and `--trust-request-chat-template`, as vLLM takes them."""
    import dataclasses

    extra = list(opts.extra)
    if chat_template:
        extra += ["--chat-template", chat_template]
    if trust_request_template:
        extra += ["--trust-request-chat-template"]
    served = " ".join(names) if names else opts.served_name
    return dataclasses.replace(opts, served_name=served, extra=tuple(extra))


def _adapter_dir(path: str) -> Path:
    from kubetune.rundir import RunDir

    run = RunDir(Path(path))
    return run.finished_weights(run.recipe()) if run.is_run() else Path(path)


def exec_vllm(opts: VllmOptions, api_keys: tuple[str, ...] = ()) -> None:
    python = vllm_python()
    if python is None:
        raise UserError(
            "--engine vllm: vLLM is not installed here; install it (CPU: scripts/vllm_venv.sh, then "
            f"{VLLM_PYTHON_ENV}=.venv-vllm/bin/python) or use --engine native"
        )
    argv = vllm_argv(opts)
    print(f"kubetune: {describe(api_keys)}", file=sys.stderr, flush=True)
    env = dict(os.environ)
    if "VLLM_CPU_KVCACHE_SPACE" not in env:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(vllm_cpu_kvcache_gib(host.memory_limit(), 1 << 30))
    key_args = _pass_api_keys(api_keys, env)
    print(
        f"kubetune: exec {python} {' '.join(argv[1:])}{' --api-key ...' if key_args else ''}",
        file=sys.stderr,
        flush=True,
    )
    os.execve(python, [python, *argv[1:], *key_args], env)


def _pass_api_keys(api_keys: tuple[str, ...], env: dict[str, str]) -> list[str]:
    """The keys as vLLM takes them: one in its VLLM_API_KEY (an environment stays private to the
    process, a command line does not), several as `--api-key K1 K2 ...` (VLLM_API_KEY holds one)."""
    env.pop(VLLM_API_KEY_ENV, None)  # already among api_keys; vLLM must see exactly these
    if len(api_keys) == 1:
        env[VLLM_API_KEY_ENV] = api_keys[0]
        return []
    return ["--api-key", *api_keys] if api_keys else []


def auto_picks_vllm(target: str) -> tuple[bool, str]:
    """`--engine auto`: vLLM where it is installed and answers as the native engine would (the
    run renders prompts with the tokenizer's chat template and no system prompt of its own,
    which is what vLLM's server does), else native. (Which engine is faster depends on the CPU
    and the load: BENCHMARKS.md, section 5.)"""
    from kubetune.rundir import RunDir

    if vllm_python() is None:
        return False, "vLLM is not installed"
    run = RunDir(Path(target))
    if run.is_run():
        from kubetune.recipe.chat_template import offline_template

        recipe = run.recipe()  # data.template=auto: chat for a tokenizer with a chat template
        if offline_template(recipe) != "chat" or recipe.data.system_prompt:
            return False, "the run's prompt template is not the bare chat template vLLM renders"
    return True, "vLLM is installed"
