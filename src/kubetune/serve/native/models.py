"""What one server serves: a base model, the LoRA adapters over it, their names, and the
prompt template each answers with.

`kubetune serve RUN_DIR` serves the run's base model under its recipe name (e.g.
`smollm2-135m-instruct`) and the run's adapter under the run directory's name; every
`--adapter NAME=RUN_DIR` adds one more adapter, which must have been trained on the same base.
A full fine-tune's run directory, or an HF model directory, is served as the base itself.
A run renders prompts with the template and system prompt it was trained with, exactly as
`kubetune generate` does, so both give the same greedy answer. A model with its own code
(`auto_map`) runs it as its recipe's `model.trust_remote_code` says, or, for an HF model
directory, which has no recipe, as `--trust-remote-code` says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kubetune.contracts.engine import AdapterRequestError
from kubetune.contracts.serving import Adapter
from kubetune.data.templates import PromptRenderer
from kubetune.engine.lora import (
    AdapterWeights,
    add_late_adapter,
    drop_late_adapters,
    install,
    read_adapter_files,
    read_adapters,
)
from kubetune.errors import RunDirError, UserError, first_line
from kubetune.fsutil import cache_root
from kubetune.models.load import load_causal_lm, load_config, load_tokenizer, model_config
from kubetune.models.runs import load_run
from kubetune.recipe import Recipe
from kubetune.rundir import RunDir


@dataclass
class Served:
    """A name clients send as `model`: the base (adapter None) or one adapter."""

    name: str
    renderer: PromptRenderer
    adapter: int = -1  # index into the engine's adapters; -1 = the base model
    parent: str | None = None


@dataclass
class ServedSet:
    lm: Any
    tokenizer: Any
    base_name: str
    models: dict[str, Served] = field(default_factory=dict)
    lora: Any = None
    max_rank: int = 0
    plan: Plan | None = None
    next_adapter: int = 0  # the index the next adapter loaded while serving gets (never reused)
    retired: set[int] = field(default_factory=set)  # unloaded, columns not yet dropped

    @property
    def adapter_names(self) -> list[str]:
        return [m.name for m in self.models.values() if m.parent]

    def grammars(self, eos: int | None) -> Any:
        """Structured output's grammars over this tokenizer (structured.Grammars), for the
        HTTP side to build on the first request that asks for one."""
        from kubetune.serve.native.structured import Grammars

        return Grammars(self.tokenizer, eos)

    def read_adapter(self, name: str, lora_path: str) -> tuple[Served, AdapterWeights]:
        """Check and read an adapter to load while serving (off the engine's thread): a kubetune LoRA
        run directory, or a PEFT adapter directory, trained on this server's base."""
        if name in self.models:
            raise AdapterRequestError(
                400, f"the name {name!r} is already served; unload it first or pick another", "lora_name"
            )
        path = Path(lora_path)
        assert self.plan is not None
        if RunDir(path).is_run():
            try:
                src = model_source(path)
                _check_adapters(self.plan.main, [(name, src)], self.base_name)
            except UserError as e:
                raise AdapterRequestError(400, str(e).replace("--adapter ", "lora_path: ", 1), "lora_path") from None
            weights_dir, renderer = src.weights, src.renderer(self.tokenizer)
        elif (path / "adapter_config.json").is_file():
            _check_peft_base(self.plan, path)
            weights_dir, renderer = path, self.models[self.base_name].renderer
        else:
            raise AdapterRequestError(
                400,
                f"lora_path {lora_path}: neither a kubetune run directory nor a PEFT adapter directory",
                "lora_path",
            )
        try:
            weights = read_adapter_files(name, str(weights_dir))
        except (UserError, OSError, ValueError) as e:
            raise AdapterRequestError(400, f"lora_path {lora_path}: {e}", "lora_path") from None
        return Served(name, renderer, self.next_adapter, self.base_name), weights

    def add_adapter(self, entry: Served, weights: AdapterWeights, idle: bool) -> None:
        """Stack the adapter into the model's layers and serve it; on the engine's thread, between
        steps. `idle`: no request is in flight, so retired adapters' columns can go too."""
        if entry.name in self.models:  # a second load of the same name raced this one
            raise AdapterRequestError(400, f"the name {entry.name!r} is already served", "lora_name")
        self._drop_retired(idle)
        entry.adapter = self.next_adapter  # given here, on one thread: two loads never share an index
        try:
            add_late_adapter(self.lm, self.lora, weights, entry.adapter)
        except UserError as e:
            raise AdapterRequestError(400, f"lora_path: {e}", "lora_path") from None
        self.models[entry.name] = entry
        self.next_adapter = entry.adapter + 1
        self.max_rank = max(self.max_rank, weights.rank)

    def retire_adapter(self, name: str, idle: bool) -> None:
        """Stop serving adapter `name` (new requests for it get 404 at once); on the engine's
        thread. Requests already accepted for it finish with it: its columns are dropped by a
        later load or unload that finds no request in flight (an adapter declared at start keeps
        its columns in the fused weight until the server restarts)."""
        entry = self.models.get(name)
        if entry is None or entry.parent is None:
            known = ", ".join(self.adapter_names) or "none"
            raise AdapterRequestError(404, f"no adapter named {name!r} is served (adapters: {known})", "lora_name")
        del self.models[name]
        self._drop_retired(idle)  # earlier ones; this one may still have a request on its way in
        self.retired.add(entry.adapter)

    def _drop_retired(self, idle: bool) -> None:
        if idle and self.retired:
            drop_late_adapters(self.lm, self.retired)
            self.retired.clear()


@dataclass(frozen=True)
class ModelSource:
    """A run directory or HF model directory, read without loading weights."""

    path: Path
    recipe: Recipe | None
    weights: Path
    trust_remote_code: bool  # run the model's own code: a run's recipe decides, else --trust-remote-code

    @property
    def is_lora(self) -> bool:
        return self.recipe is not None and self.recipe.finetune.method == "lora"

    def renderer(self, tokenizer: Any) -> PromptRenderer:
        if self.recipe is None:  # an HF model directory: its chat template, else alpaca
            return PromptRenderer("auto", tokenizer)
        return PromptRenderer(self.recipe.data.template, tokenizer, self.recipe.data.system_prompt)

    def load(self, dtype: torch.dtype, attn: str, with_adapter: bool = True) -> tuple[Any, Any]:
        """(model, tokenizer): a run's through `load_run`, an HF model directory as it is."""
        if self.recipe is not None:
            return load_run(RunDir(self.path), self.recipe, dtype, attn, with_adapter)
        weights, remote = str(self.weights), self.trust_remote_code
        return load_causal_lm(weights, dtype, attn, None, remote), load_tokenizer(weights, None, remote)


def model_source(target: str | Path, trust_remote_code: bool = False) -> ModelSource:
    """`target` as served; `trust_remote_code` (--trust-remote-code) applies to an HF model
    directory alone: a run directory keeps its recipe's `model.trust_remote_code`."""
    path = Path(target)
    run = RunDir(path)
    if run.is_run():
        recipe = run.recipe()
        return ModelSource(path, recipe, run.finished_weights(recipe), recipe.model.trust_remote_code)
    if (path / "config.json").is_file():
        return ModelSource(path, None, path, trust_remote_code)
    if not path.exists() and (local := named_model(str(target))) is not None:
        return ModelSource(local, None, local, trust_remote_code)
    raise RunDirError(f"{target}: neither a kubetune run directory nor an HF model directory (config.json)")


def named_model(name: str) -> Path | None:
    """A recipe's `model.name_or_path` that names a model instead of a directory, as a local HF
    directory: an embedded model or a .gguf file (converted once, as training loads it), or a hub
    id, downloaded to `<cache>/hub/<org>/<name>` so that the directory is named as the model (a
    PEFT adapter trained on the hub id then passes the base check). GRPO's rollout server serves
    the recipe's base model this way (`kubetune serve smollm2-135m-instruct --allow-runtime-adapters`).
    None when `name` is no model name at all (a path that does not exist)."""
    from kubetune.models.load import resolve_model

    try:
        resolved = resolve_model(name)
    except UserError:
        return None
    if Path(resolved).is_dir():
        return Path(resolved)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(resolved, local_dir=cache_root() / "hub" / resolved))
    except Exception as e:  # the hub's errors have many types: one line naming the model
        raise RunDirError(f"{name}: cannot download it from the Hugging Face Hub ({first_line(e)})") from None


@dataclass(frozen=True)
class Plan:
    """What will be served, read from the run directories without loading any weights."""

    main: ModelSource
    base_name: str
    adapters: list[tuple[str, ModelSource]]

    def base_config(self) -> Any:
        """The base model's config, read as the model will be loaded (a run's revision and remote code)."""
        recipe = self.main.recipe
        if recipe is not None and self.main.is_lora:
            return model_config(recipe.model)
        return load_config(str(self.main.weights), trust_remote_code=self.main.trust_remote_code)


def plan_served(target: str, adapters: list[Adapter], trust_remote_code: bool = False) -> Plan:
    """Check the target and the adapters (one clear line each) before anything is loaded.
    The adapters are LoRA runs, each read by its own recipe: only the target takes the flag."""
    main = model_source(target, trust_remote_code)
    extra = [(a.name, model_source(a.path)) for a in adapters]
    if main.is_lora:
        assert main.recipe is not None
        base_name = Path(main.recipe.model.name_or_path).name
        extra.insert(0, (main.path.resolve().name, main))
    else:
        base_name = main.path.resolve().name
    _check_adapters(main, extra, base_name)
    return Plan(main, base_name, extra)


def load_served(
    target: str,
    adapters: list[Adapter],
    dtype: torch.dtype,
    attn: str,
    fuse: bool = True,
    trust_remote_code: bool = False,
) -> ServedSet:
    plan = plan_served(target, adapters, trust_remote_code)
    main, base_name, extra = plan.main, plan.base_name, plan.adapters
    lm, tokenizer = main.load(dtype, attn, with_adapter=False)  # serving installs every adapter itself
    lm.eval()
    served = ServedSet(lm, tokenizer, base_name)
    served.models[base_name] = Served(base_name, main.renderer(tokenizer))
    weights = read_adapters(lm, [(name, str(src.weights)) for name, src in extra])
    served.lora = install(lm, weights, fuse)
    for i, (name, src) in enumerate(extra):
        served.models[name] = Served(name, src.renderer(tokenizer), i, base_name)
    served.max_rank = max((w.rank for w in weights), default=0)
    served.plan, served.next_adapter = plan, len(extra)
    return served


def _check_adapters(main: ModelSource, extra: list[tuple[str, ModelSource]], base_name: str) -> None:
    names = [base_name] + [name for name, _ in extra]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"--adapter: the name {dupes[0]!r} is used twice; give each adapter its own name")
    base = main.recipe.model.name_or_path if main.is_lora and main.recipe else None
    for name, src in extra:
        if not src.is_lora:
            raise UserError(f"--adapter {name}={src.path}: not a LoRA run; serve a full fine-tune on its own")
        assert src.recipe is not None
        if main.is_lora and src.recipe.model.name_or_path != base:
            raise UserError(
                f"--adapter {name}={src.path}: trained on {src.recipe.model.name_or_path}, but this server's base "
                f"is {base}; adapters must share the base model"
            )


def _check_peft_base(plan: Plan, path: Path) -> None:
    import json

    trained_on = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    base = plan.main.recipe.model.name_or_path if plan.main.is_lora and plan.main.recipe else str(plan.main.path)
    same = trained_on == base or Path(trained_on).name == Path(base).name
    if not same:
        raise AdapterRequestError(
            400,
            f"lora_path {path}: trained on {trained_on or 'an unnamed model'}, but this server's base is {base}; "
            "adapters must share the base model",
            "lora_path",
        )
