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

from kubetune.contracts.adapters import AdapterRegistry, Alias, check_adapter_name, split_version
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
from kubetune.engine.resident import ResidentAdapters
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
    aliases: dict[str, Alias] = field(default_factory=dict)  # NAME -> its versions by weight (NAME@vN)
    resident: ResidentAdapters | None = None  # --max-loras: adapters come and go from the layers

    def resolve(self, name: str, route: bool = True) -> Served | None:
        """The model a request for `name` is answered by: a served name as it is, an alias one
        of its versions by weight (picked once per request: every choice and chunk is its).
        `route` False: the alias's heaviest version, without counting a request (tokenizing)."""
        alias = self.aliases.get(name)
        if alias is None:
            return self.models.get(name)
        return self.models.get(alias.pick() if route else max(alias.weights, key=alias.weights.__getitem__))

    def set_alias(self, name: str, weights: dict[str, int]) -> None:
        """Route `name` to served adapters by weight (on the event loop, as requests resolve)."""
        if name in self.models:
            raise AdapterRequestError(400, f"alias: {name!r} is already a served model's name; pick another", "alias")
        if "@" in name or not name:
            why = f"alias: {name!r}: an alias is a plain NAME (its versions: NAME@vN)"
            raise AdapterRequestError(400, why, "alias")
        unknown = sorted(t for t in weights if t not in self.models or self.models[t].parent is None)
        if unknown:
            known = ", ".join(self.adapter_names) or "none"
            raise AdapterRequestError(
                400, f"weights: {unknown[0]!r} is not a served adapter (adapters: {known}); load it first", "weights"
            )
        try:
            alias = Alias(weights)
        except ValueError as e:
            raise AdapterRequestError(400, f"weights: {e}", "weights") from None
        self.aliases[name] = alias

    def alias_of_new_version(self, name: str) -> None:
        """A version NAME@vN just loaded: NAME routes to it at 100 if NAME has no route yet."""
        parts = split_version(name)
        if parts and parts[0] not in self.aliases and parts[0] not in self.models:
            self.aliases[parts[0]] = Alias({name: 100})

    def check_unroutable(self, name: str) -> None:
        """Refuse to unload a version an alias still sends requests to (set its weight to 0 first),
        unless it is the alias's last version: then the alias goes with it, as a plain adapter goes."""
        for alias_name, alias in self.aliases.items():
            if alias.weights.get(name, 0) > 0 and self._other_versions(alias_name, name):
                raise AdapterRequestError(
                    400,
                    f"the alias {alias_name!r} still routes to {name!r} (weight {alias.weights[name]}); "
                    f"set its weight to 0 with POST /v1/lora_aliases first",
                    "lora_name",
                )

    def _other_versions(self, alias_name: str, name: str) -> list[str]:
        """The served versions of `alias_name` besides `name`, and what its route names."""
        versions = [m for m in self.models if m != name and (split_version(m) or ("",))[0] == alias_name]
        return versions + [t for t in self.aliases[alias_name].weights if t != name and t in self.models]

    def forget_routes_to(self, name: str) -> None:
        """An unloaded version leaves the aliases (at weight 0, or it could not be unloaded)."""
        for alias_name, alias in list(self.aliases.items()):
            if name in alias.weights:
                rest = {t: w for t, w in alias.weights.items() if t != name}
                if any(w > 0 for w in rest.values()):
                    self.aliases[alias_name] = Alias(rest)
                else:
                    del self.aliases[alias_name]

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
        if name in self.models or name in self.aliases:
            what = "an alias" if name in self.aliases else "already served"
            raise AdapterRequestError(400, f"the name {name!r} is {what}; unload it first or pick another", "lora_name")
        why = check_adapter_name(name)
        if why:
            raise AdapterRequestError(400, f"lora_name {why}", "lora_name")
        assert self.plan is not None
        weights_dir, src = adapter_dir(self.plan, self.base_name, name, lora_path)
        renderer = src.renderer(self.tokenizer) if src else self.models[self.base_name].renderer
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
            if self.resident is not None:
                self.resident.register(entry.adapter, weights)
            else:
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
        if self.resident is not None:  # it goes once no running or waiting request uses it
            self.resident.retire(entry.adapter)
            return
        self._drop_retired(idle)  # earlier ones; this one may still have a request on its way in
        self.retired.add(entry.adapter)

    def register_registry(self, registry: AdapterRegistry, folder: Path) -> None:
        """Every version and alias of `--adapter-registry` (before the engine runs, on its thread)."""
        for name, path in registry.versions(folder):
            entry, weights = self.read_adapter(name, str(path))
            self.add_adapter(entry, weights, idle=True)
        for alias, route in registry.aliases().items():
            self.set_alias(alias, route)

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
    max_loras: int | None = None,
) -> ServedSet:
    """The model and its adapters. With `max_loras`, no adapter is fused into the start-up
    weights: each is registered with `ResidentAdapters`, which keeps at most that many in the layers."""
    plan = plan_served(target, adapters, trust_remote_code)
    main, base_name, extra = plan.main, plan.base_name, plan.adapters
    lm, tokenizer = main.load(dtype, attn, with_adapter=False)  # serving installs every adapter itself
    lm.eval()
    served = ServedSet(lm, tokenizer, base_name)
    served.models[base_name] = Served(base_name, main.renderer(tokenizer))
    weights = read_adapters(lm, [(name, str(src.weights)) for name, src in extra])
    served.lora = install(lm, [] if max_loras else weights, fuse)
    if max_loras:
        served.resident = ResidentAdapters(lm, served.lora, max_loras)
    for i, (name, src) in enumerate(extra):
        served.models[name] = Served(name, src.renderer(tokenizer), i, base_name)
        if served.resident is not None:
            served.resident.register(i, weights[i])
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


def adapter_dir(plan: Plan, base_name: str, name: str, lora_path: str) -> tuple[Path, ModelSource | None]:
    """(the PEFT weights' directory, the run when it is one) of an adapter to serve over `plan`'s
    base: a kubetune LoRA run directory or a PEFT adapter directory trained on that base; else a
    400 naming `lora_path`."""
    path = Path(lora_path)
    if RunDir(path).is_run():
        try:
            src = model_source(path)
            _check_adapters(plan.main, [(name, src)], base_name)
        except UserError as e:
            raise AdapterRequestError(400, str(e).replace("--adapter ", "lora_path: ", 1), "lora_path") from None
        return src.weights, src
    if (path / "adapter_config.json").is_file():
        _check_peft_base(plan, path)
        return path, None
    raise AdapterRequestError(
        400, f"lora_path {lora_path}: neither a kubetune run directory nor a PEFT adapter directory", "lora_path"
    )


def served_base(plan: Plan) -> str:
    """The base model the adapters must have been trained on, as their configs name it."""
    return plan.main.recipe.model.name_or_path if plan.main.is_lora and plan.main.recipe else str(plan.main.path)


def same_base(a: str, b: str) -> bool:
    """The same model, named as a hub id or as a local copy's path (compared by their last part)."""
    return a == b or Path(a).name == Path(b).name


def check_registry(plan: Plan, registry: AdapterRegistry, folder: Path, where: str) -> None:
    """Everything of `--adapter-registry` that can be checked before a model loads: its base
    against the served one, each version's directory and the base it was trained on, names."""
    base = served_base(plan)
    if not same_base(registry.base.name, base):
        raise UserError(f"{where}: base.name is {registry.base.name}, but this server's base is {base}")
    served = {plan.base_name, *(n for n, _ in plan.adapters)}
    for name in registry.adapters:
        if name in served:
            raise UserError(f"{where}: adapters.{name}: the name is already served (--adapter); pick another")
    for name, path in registry.versions(folder):
        alias, _, version = name.partition("@")
        try:
            adapter_dir(plan, plan.base_name, name, str(path))
        except AdapterRequestError as e:
            why = e.message.removeprefix("lora_path: ").removeprefix("lora_path ")
            raise UserError(f"{where}: adapters.{alias}.versions.{version}: {why}") from None


def _check_peft_base(plan: Plan, path: Path) -> None:
    import json

    trained_on = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    base = served_base(plan)
    if not same_base(trained_on, base):
        raise AdapterRequestError(
            400,
            f"lora_path {path}: trained on {trained_on or 'an unnamed model'}, but this server's base is {base}; "
            "adapters must share the base model",
            "lora_path",
        )
