"""The Helm values layout of Intel's huggingface-llm chart (Intel's Xeon fine-tuning guide) as a kubetune recipe.

`ALIASES` is the one table both readers of that layout use: `kubetune recipe from-helm-values` (here) and the
kubetune-finetune chart, whose `_helpers.tpl` walks the same table from `files/helm-values-aliases.json` and
whose `values.schema.json` holds `alias_schema()`; `python -m kubetune.recipe.helm_values CHART_DIR` writes both
files and a test fails when they drift. Each entry is one key of the layout:

- `to`: the recipe key it sets (a list of key segments: node labels have dots), or null: a key of Intel's program
  that kubetune replaces with its own (`why` says with what), accepted and listed as not used;
- `kind`: copy (the value as is), words (a space-separated string to a list), percent (a fraction, or a
  percentage over 1), const (the entry's `value` whenever the key is given);
- `values`: values with their own meaning (`"-"`: set nothing); with `only`, any other value is refused with
  `refuse`, the key named;
- `key_from`: the key whose value is the last segment of `to` (nodeSelectorLabel: nodeSelectorValue);
- `seed`: Intel's chart's default for the key, where kubetune's default for its recipe key differs: a values file
  in the layout that leaves the key unset gets kubetune's, so both readers list it (`left_unset`, NOTES.txt), with
  kubetune's default (`default`, filled in from the recipe schema when the chart's copy is written).

Two keys that set one recipe key must agree (cpuRequest and cpuLimit: requests always equal limits here), and a
key may not set what `recipe:` sets too. Keys outside the table are refused by the schema. Torch-free.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from kubetune.errors import RecipeError

Entry = dict[str, Any]
UNSET = "-"
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)
ALPACA_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
)
_PROMPT_REFUSAL = (
    "kubetune's templates have one preamble for rows with and without input: use Alpaca's own sentences "
    "(data.template alpaca) or set recipe.data.template (a template with {instruction} and {input})"
)
_NUMBER = ["number", "string"]  # Helm reads 200 as a number, 7500m and 226Gi as strings


def _to(dotted: str) -> list[str]:
    return dotted.split(".")


def _train(name: str, to: str | None, type_: Any = None, **kw: Any) -> Entry:
    return {"from": f"distributed.train.{name}", "to": to and _to(to), "type": type_, **kw}


def _unused(name: str, why: str, type_: Any = None, **kw: Any) -> Entry:
    return {"from": name, "to": None, "type": type_, "why": why, **kw}


ALIASES: list[Entry] = [
    _unused(
        "image.name",
        "Intel's image runs Intel's finetune.py; the pods run kubetune's image (recipe.k8s.image for your own build)",
        "string",
    ),
    _unused("image.tag", "the tag of image.name, which is not used", ["string", "number"]),
    {"from": "image.pullPolicy", "to": _to("k8s.image_pull_policy"), "type": "string"},
    _unused("distributed.script", "the pods run `kubetune train`, not a script", "string"),
    _unused("distributed.logLevel", "kubetune's trainer prints its progress lines at every level", "string"),
    {"from": "distributed.workers", "to": _to("k8s.replicas"), "type": "integer", "seed": "4"},
    {
        "from": "distributed.modelNameOrPath",
        "to": _to("model.name_or_path"),
        "type": "string",
        "seed": "meta-llama/Llama-2-7b-chat-hf",
    },
    _unused(
        "distributed.doTrain",
        "a FineTune always trains",
        "boolean",
        values={"true": UNSET},
        only=True,
        refuse="a FineTune always trains (doTrain=false would only evaluate); remove the key",
    ),
    {
        "from": "distributed.doEval",
        "to": _to("data.eval"),
        "type": "boolean",
        "values": {"true": UNSET, "false": None},
        "why": "true: kubetune evaluates by default (recipe.data.eval)",
    },
    _unused(
        "distributed.doBenchmark",
        "false: nothing to do",
        "boolean",
        values={"false": UNSET},
        only=True,
        refuse="kubetune's job does not benchmark; remove the key",
    ),
    _unused(
        "distributed.doQuantize",
        "false: nothing to do",
        "boolean",
        values={"false": UNSET},
        only=True,
        refuse="kubetune's job does not quantize; set export.merged and quantize the merged model (or export --gguf)",
    ),
    _unused("distributed.benchmark", "read by Intel's chart only with doBenchmark, which kubetune refuses", "object"),
    _unused("distributed.quantize", "read by Intel's chart only with doQuantize, which kubetune refuses", "object"),
    _train("modelName", "model.name_or_path", "string"),
    _train("datasetName", "data.train", "string", seed="medalpaca/medical_meadow_medical_flashcards"),
    _train("dataFile", "data.train", "string"),
    _train("datasetConcatenation", "data.packing", "boolean"),
    _train(
        "promptWithInput",
        "data.template",
        "string",
        values={ALPACA_WITH_INPUT: "alpaca"},
        only=True,
        refuse=_PROMPT_REFUSAL,
        seed="alpaca",
    ),
    _train(
        "promptWithoutInput",
        "data.template",
        "string",
        values={ALPACA_WITHOUT_INPUT: "alpaca"},
        only=True,
        refuse=_PROMPT_REFUSAL,
    ),
    _train("promptTemplate", "data.template", "string"),
    _train("perDeviceBatchSize", "train.micro_batch_size", "integer", seed="8"),
    _train("epochs", "train.epochs", "number"),
    _train("numEpochs", "train.epochs", "number"),
    _train(
        "maxSteps",
        "train.max_steps",
        "integer",
        values={"-1": UNSET},
        why="-1: the epochs decide (recipe.train.max_steps)",
    ),
    _train("gradientAccumulationSteps", "train.grad_accum", "integer"),
    _train("learningRate", "train.lr", "number", seed="2e-5"),
    _unused("distributed.train.ddpFindUnusedParameters", "kubetune wraps the model for DDP itself", "boolean"),
    _unused(
        "distributed.train.ddpBackend",
        "kubetune picks the backend per profile (gloo on cpu: docs/comm.md)",
        "string",
        values={"ccl": UNSET, "gloo": UNSET},
        only=True,
        refuse="kubetune picks the backend per profile (gloo on cpu, nccl on nvidia, hccl on gaudi): set profile",
    ),
    _unused("distributed.train.useFastTokenizer", "kubetune loads the model's own tokenizer", "boolean"),
    _unused(
        "distributed.train.outputDir", "the FineTune's run lives on its volume at /data (recipe.output_dir)", "string"
    ),
    _train("loggingSteps", "train.log_every", "integer"),
    _train("saveTotalLimit", "train.keep_last", "integer"),
    _train(
        "saveStrategy",
        "train.save_every",
        "string",
        values={"no": 0, "epoch": UNSET},
        why="epoch: kubetune checkpoints every recipe.train.save_every steps (50) and at the end",
        only=True,
        refuse="kubetune checkpoints every N steps: set recipe.train.save_every",
    ),
    _train("useLora", "finetune.method", "boolean", values={"true": "lora", "false": "full"}, only=True),
    _train("loraRank", "lora.r", "integer"),
    _train("loraAlpha", "lora.alpha", "number"),
    _train("loraDropout", "lora.dropout", "number", seed="0.1"),
    _train("loraTargetModules", "lora.target_modules", "string", kind="words"),
    _train("lora.r", "lora.r", "integer"),
    _train("lora.alpha", "lora.alpha", "number"),
    _train(
        "noCuda",
        "k8s.profile",
        "boolean",
        values={"true": "cpu"},
        only=True,
        refuse="noCuda=false asks for a GPU: remove it and set profile: nvidia",
    ),
    _unused(
        "distributed.train.overwriteOutputDir",
        "kubetune resumes from the newest checkpoint (train.resume auto)",
        "boolean",
    ),
    _train("bf16", "train.precision", "boolean", values={"true": "bf16", "false": "fp32"}, only=True, seed="bf16"),
    _unused("distributed.train.useIpex", "kubetune's own CPU kernels (bf16 autocast on AMX) replace IPEX", "boolean"),
    _train("instructionColumnName", "data.columns.instruction", "string"),
    _train("inputColumnName", "data.columns.input", "string"),
    _train("outputColumnName", "data.columns.output", "string"),
    {"from": "distributed.eval.perDeviceBatchSize", "to": _to("eval.batch_size"), "type": "integer"},
    {
        "from": "distributed.eval.validationSplitPercentage",
        "to": _to("data.eval"),
        "type": "number",
        "kind": "percent",
        "seed": "0.2",
    },
    {
        "from": "elasticPolicy",
        "to": _to("k8s.elastic.enabled"),
        "type": "object",
        "kind": "const",
        "value": True,
        "seed": "true",
    },
    {"from": "elasticPolicy.minReplicas", "to": _to("k8s.elastic.min_replicas"), "type": "integer"},
    {"from": "elasticPolicy.maxReplicas", "to": _to("k8s.elastic.max_replicas"), "type": "integer"},
    {"from": "elasticPolicy.maxRestarts", "to": _to("k8s.elastic.max_restarts"), "type": "integer"},
    _unused(
        "elasticPolicy.rdzvBackend",
        "c10d is what kubetune's elastic workers use",
        "string",
        values={"c10d": UNSET},
        only=True,
        refuse="kubetune's elastic workers rendezvous with c10d only; remove the key",
    ),
    _unused("envVars.ldPreload", "kubetune's image preloads its own allocator (jemalloc)", "string"),
    _unused("envVars.logLevel", "kubetune's trainer prints its progress lines at every level", "string"),
    _unused("envVars.transformersCache", "the caches live on the job's volume (/data)", "string"),
    _unused("envVars.hfDatasetsCache", "the caches live on the job's volume (/data)", "string"),
    _unused("envVars.hfHome", "the caches live on the job's volume (/data)", "string"),
    _unused(
        "envVars.cclWorkerCount", "no oneCCL on CPU: collectives run over gloo (docs/comm.md)", ["integer", "string"]
    ),
    {"from": "envVars.httpProxy", "to": _to("comm.extra_env.HTTP_PROXY"), "type": "string"},
    {"from": "envVars.httpsProxy", "to": _to("comm.extra_env.HTTPS_PROXY"), "type": "string"},
    {"from": "envVars.noProxy", "to": _to("comm.extra_env.NO_PROXY"), "type": "string"},
    {"from": "envVars.ftpProxy", "to": _to("comm.extra_env.FTP_PROXY"), "type": "string"},
    {"from": "envVars.socksProxy", "to": _to("comm.extra_env.ALL_PROXY"), "type": "string"},
    _unused(
        "deploy.env.enabled",
        "false: nothing to do",
        "boolean",
        values={"false": UNSET},
        only=True,
        refuse="the pods' environment comes from the recipe: set recipe.comm.extra_env",
    ),
    _unused(
        "deploy.env.configMapName",
        "read by Intel's chart only with deploy.env.enabled, which kubetune refuses",
        "string",
    ),
    {"from": "resources.cpuRequest", "to": _to("k8s.profile_resources.cpu.cpu"), "type": _NUMBER},
    {"from": "resources.cpuLimit", "to": _to("k8s.profile_resources.cpu.cpu"), "type": _NUMBER},
    {"from": "resources.memoryRequest", "to": _to("k8s.profile_resources.cpu.memory"), "type": "string"},
    {"from": "resources.memoryLimit", "to": _to("k8s.profile_resources.cpu.memory"), "type": "string"},
    _unused("resources.nodeSelectorLabel", "read as the label of resources.nodeSelectorValue", "string"),
    {
        "from": "resources.nodeSelectorValue",
        "to": _to("k8s.node_selector"),
        "type": "string",
        "key_from": "resources.nodeSelectorLabel",
    },
    {"from": "securityContext.runAsUser", "to": _to("k8s.run_as_user"), "type": "integer"},
    _unused(
        "securityContext.allowPrivilegeEscalation",
        "false: kubetune's non-root pods (cpu, nvidia) already run without privilege escalation",
        "boolean",
        values={"false": UNSET},
        only=True,
        refuse="kubetune's non-root pods never allow privilege escalation; remove the key",
    ),
    {
        "from": "storage.storageClassName",
        "to": _to("k8s.storage.storage_class"),
        "type": "string",
        "seed": "nfs-client",
    },
    {"from": "storage.resources", "to": _to("k8s.storage.size"), "type": "string", "seed": "50Gi"},
    _unused("storage.pvcMountPath", "kubetune mounts the volume at /data", "string"),
    # keys with no place in a FineTune: refused when they are not empty, with what to do instead
    _unused(
        "securityContext.runAsGroup",
        "",
        values={},
        only=True,
        refuse="kubetune sets runAsGroup and fsGroup to the UID (securityContext.runAsUser, recipe.k8s.run_as_user); "
        "remove the key",
    ),
    _unused(
        "securityContext.fsGroup",
        "",
        values={},
        only=True,
        refuse="kubetune sets runAsGroup and fsGroup to the UID (securityContext.runAsUser, recipe.k8s.run_as_user); "
        "remove the key",
    ),
]
# Keys the chart reads itself (not recipe keys): the Secret it renders from a token in values.
CHART_KEYS = {"secret.name": "string", "secret.encodedToken": "string"}
# The chart's own top-level values (a test holds them equal to values.yaml's); only `recipe` is a recipe's.
CHART_VALUES = (
    "global",
    "name",
    "recipe",
    "recipeRef",
    "profile",
    "api",
    "hfTokenSecretRef",
    "serve",
    "export",
    "suspend",
    "ttlSecondsAfterFinished",
    "volumeClaimRetention",
    "labels",
    "annotations",
    "test",
)
ALIAS_ROOTS = (
    "image",
    "distributed",
    "elasticPolicy",
    "envVars",
    "resources",
    "secret",
    "securityContext",
    "storage",
    "deploy",
)


def _leaf_schema(type_: Any) -> dict[str, Any]:
    # null is always allowed: the guide's values file leaves half its keys empty, which means "not set"
    if type_ is None:
        return {}
    types = type_ if isinstance(type_, list) else [type_]
    return {"type": [*types, "null"]}


def alias_schema() -> dict[str, Any]:
    """The JSON schema of the layout's keys (values.schema.json's properties for ALIAS_ROOTS)."""
    root: dict[str, Any] = {}
    leaves = {e["from"]: _leaf_schema(e["type"]) for e in ALIASES if e["type"] != "object"}
    leaves |= {k: _leaf_schema(t) for k, t in CHART_KEYS.items()}
    for dotted, schema in leaves.items():
        *parents, name = dotted.split(".")
        node = root
        for part in parents:
            node = node.setdefault(part, {"type": ["object", "null"], "additionalProperties": False, "properties": {}})
            node = node["properties"]
        node[name] = schema
    for e in ALIASES:
        if e["type"] == "object" and e["from"] not in ALIAS_ROOTS:  # Intel's own sub-maps: any keys
            parent, name = e["from"].split(".")
            root[parent]["properties"][name] = {"type": ["object", "null"]}
    return root


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where `2e-5` (the guide's learningRate) is a string; Helm reads it as YAML 1.2
    does, a number. The resolver below is YAML 1.2's float pattern, so both readers agree."""


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def read_values(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Yaml12Loader)  # a SafeLoader
    except OSError as e:
        raise RecipeError(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a values file is a YAML mapping")
    return data


class Mapping:
    """The recipe one values file means, with what each key of the layout became (for NOTES / comments)."""

    def __init__(self, recipe: dict[str, Any]) -> None:
        self.own_recipe = recipe
        self.recipe: dict[str, Any] = {}
        self.mapped: list[tuple[str, str]] = []  # (layout key, recipe key)
        self.unused: list[tuple[str, str]] = []  # (layout key, why)
        self._set_by: dict[str, tuple[str, Any]] = {}

    def left_unset(self) -> list[tuple[str, str, str, str]]:
        """(layout key, recipe key, kubetune's default, Intel's chart's default) of each key with a `seed`
        default that a values file in the layout leaves unset, its recipe key too: the job takes kubetune's
        default there, not the one Intel's chart would have given it. Nothing without the layout."""
        if not (self.mapped or self.unused):
            return []
        merged = self.merged()
        return [
            (e["from"], ".".join(e["to"]), e["default"], e["seed"])
            for e in chart_aliases()
            if "seed" in e and not _has_path(merged, e["to"])
        ]

    def set(self, source: str, to: list[str], value: Any) -> None:
        dotted = ".".join(to)
        if dotted in self._set_by and self._set_by[dotted][1] != value:
            other, was = self._set_by[dotted]
            raise RecipeError(
                f"{other} and {source} both set recipe.{dotted} ({_show(was)} and {_show(value)}); give one value"
            )
        if _has_path(self.own_recipe, to):
            raise RecipeError(f"{source} and recipe.{dotted} both set {dotted}; keep one of them")
        self._set_by[dotted] = (source, value)
        node = self.recipe
        for part in to[:-1]:
            node = node.setdefault(part, {})
        node[to[-1]] = value
        self.mapped.append((source, dotted))

    def set_by(self, dotted: str) -> tuple[str, Any] | None:
        """(layout key, value) of the key that set this recipe key, if one did."""
        return self._set_by.get(dotted)

    def merged(self) -> dict[str, Any]:
        return _merge(copy.deepcopy(self.own_recipe), self.recipe)


def _show(value: Any) -> str:
    return json.dumps(value)


def _shown(value: Any) -> str:
    """A default as both readers print it: a string bare, any other value as JSON (null, 2, 0.0002, false)."""
    return value if isinstance(value, str) else json.dumps(value)


def chart_aliases() -> list[Entry]:
    """ALIASES as the chart's copy holds them: each entry with a `seed` default also holds kubetune's
    default for its recipe key (`default`, from the recipe schema)."""
    from kubetune.recipe.schema import Recipe

    defaults = Recipe().model_dump(mode="json")
    return [{**e, "default": _shown(_get(defaults, ".".join(e["to"])))} if "seed" in e else e for e in ALIASES]


def _key(value: Any) -> str:
    # the text Helm's toString gives: true/false, 4, -1
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _get(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _has_path(data: dict[str, Any], path: list[str]) -> bool:
    node: Any = data
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _merge(into: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def _converted(entry: Entry, value: Any) -> Any:
    kind = entry.get("kind", "copy")
    if kind == "words":
        return str(value).split()
    if kind == "percent":
        return value if value < 1 else value / 100
    if kind == "const":
        return entry["value"]
    return value


def _apply(entry: Entry, values: dict[str, Any], out: Mapping) -> None:
    source, value = entry["from"], _get(values, entry["from"])
    if value is None or value == "" or value == {}:
        return  # the guide's values file leaves many keys empty: not set
    choices = entry.get("values", {})
    if _key(value) in choices:
        value = choices[_key(value)]
        if value == UNSET:
            out.unused.append((source, entry.get("why") or f"kubetune's default for recipe.{'.'.join(entry['to'])}"))
            return
    elif entry.get("only"):
        raise RecipeError(f"{source}: {entry.get('refuse') or 'must be one of ' + ', '.join(sorted(choices))}")
    elif entry["to"] is None:
        out.unused.append((source, entry["why"]))
        return
    else:
        value = _converted(entry, value)
    to = list(entry["to"])
    if "key_from" in entry:
        label = _get(values, entry["key_from"])
        if not label:
            raise RecipeError(f"{source}: goes with {entry['key_from']} (the node label it is the value of)")
        to.append(str(label))
    out.set(source, to, value)


def _schema_problems(values: dict[str, Any]) -> list[str]:
    schema = {"type": "object", "properties": alias_schema()}
    validator = jsonschema.Draft7Validator(schema)
    problems = []
    for err in sorted(validator.iter_errors(values), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in err.absolute_path)
        if err.validator == "additionalProperties":
            known = set(err.schema.get("properties", {}))
            for extra in sorted(set(err.instance) - known):
                problems.append(
                    f"{where}.{extra}: not a key of Intel's huggingface-llm layout (the chart README lists them)"
                )
        else:
            problems.append(f"{where}: {err.message}")
    return problems


TWO_RECIPES = (
    "set either recipe (or Intel's huggingface-llm layout) or recipeRef.name, "
    "not both (a FineTune has exactly one recipe)"
)
TOKEN_TWICE = (
    "secret.encodedToken and hfTokenSecretRef.name both give the Hugging Face token; "
    "keep hfTokenSecretRef (the Secret stays out of Helm's release)"
)
TOKEN_NOT_BASE64 = "secret.encodedToken: not base64; encode the token with `base64 -w0 hf-token`"
NAME_WITHOUT_TOKEN = (
    "secret.name names the Secret made from secret.encodedToken, which is empty; "
    "for a Secret of your own set hfTokenSecretRef.name"
)


def _token_problems(values: dict[str, Any]) -> list[str]:
    """The chart's refusals for secret.* (templates/_helpers.tpl, kubetune-finetune.tokenRef), word for word."""
    secret = values.get("secret") or {}
    token = secret.get("encodedToken")
    if token and _get(values, "hfTokenSecretRef.name"):
        return [TOKEN_TWICE]
    if token:
        try:
            base64.b64decode(str(token), validate=True)
        except binascii.Error:
            return [TOKEN_NOT_BASE64]
    elif secret.get("name"):
        return [NAME_WITHOUT_TOKEN]
    return []


def map_values(values: dict[str, Any]) -> Mapping:
    """The recipe Intel's huggingface-llm layout means, merged with the file's own `recipe:` (RecipeError names
    the key)."""
    unknown = sorted(set(values) - set(ALIAS_ROOTS) - set(CHART_VALUES))
    problems = [
        f"{key}: not a key of Intel's huggingface-llm layout nor of the kubetune-finetune chart" for key in unknown
    ]
    problems += _schema_problems(values) + _token_problems(values)
    if problems:
        raise RecipeError(*problems)
    out = Mapping(values.get("recipe") or {})
    for entry in ALIASES:
        _apply(entry, values, out)
    if (out.own_recipe or out.mapped) and _get(values, "recipeRef.name"):
        raise RecipeError(TWO_RECIPES)
    by_alias = out.set_by("k8s.profile")
    if by_alias and values.get("profile") not in (None, "", by_alias[1]):
        raise RecipeError(f"{by_alias[0]} and profile both set the profile; keep profile")
    return out


def job_name(values: dict[str, Any], release: str | None, source: str) -> tuple[str, str]:
    """(the name, where it came from) of the job a values file makes, as the chart names its FineTune: the
    values' `name`, else the release's (`helm install NAME`); without either, the file's (its stem)."""
    if values.get("name"):
        name, why = str(values["name"]), "the values' name"
    elif release:
        name, why = release, "the release, --release"
    else:  # a file name need not be a DNS label, as a release name is
        name = re.sub(r"[^a-z0-9-]+", "-", Path(source).stem.lower()).strip("-") or "kubetune"
        why = "the file's name; --release NAME names it as `helm install NAME` would"
    return name[:40].rstrip("-"), why  # the chart's fullname: trunc 40 | trimSuffix "-"


def recipe_yaml(values: dict[str, Any], source: str, release: str | None = None) -> str:
    """The recipe as YAML, with a comment that says where each key came from (`kubetune recipe from-helm-values`).
    Unless the recipe names its run, output_dir is the job's name on the volume, as the FineTune's would be."""
    from kubetune.recipe.loader import recipe_from_data

    mapping = map_values(values)
    recipe = mapping.merged()
    lines = [f"# The recipe of {source} as the kubetune-finetune chart reads it (`kubetune recipe from-helm-values`):"]
    if "output_dir" not in recipe and not _get(recipe, "k8s.name"):
        name, why = job_name(values, release, source)
        recipe["output_dir"] = f"/data/runs/{name}"
        lines.append(f"# The job is named {name} ({why}): output_dir /data/runs/{name}")
    recipe_from_data(copy.deepcopy(recipe))  # the same errors `kubetune k8s render` would give
    lines += [f"#   {src} -> {to}" for src, to in mapping.mapped]
    if unset := mapping.left_unset():
        lines.append(
            "# Left unset, so kubetune's default, not Intel's chart's (set the key for Intel's chart's value):"
        )
        lines += [f"#   {src} -> {to} = {default} (Intel's chart: {seed})" for src, to, default, seed in unset]
    if mapping.unused:
        lines.append("# Not used (kubetune does it its own way):")
        lines += [f"#   {src}: {why}" for src, why in mapping.unused]
    for key in ("profile", "api"):  # the chart's own keys: the FineTune's spec.profile / spec.api, over the recipe's
        if values.get(key):
            lines.append(
                f"# {key}: {values[key]} is the chart's (spec.{key}): `kubetune k8s render FILE --{key} {values[key]}`"
            )
    if _get(values, "secret.encodedToken"):
        lines.append("# secret.encodedToken is not a recipe key: `kubetune k8s submit RECIPE --hf-token-file FILE`")
    return "\n".join(lines) + "\n" + yaml.safe_dump(recipe, sort_keys=False)


def chart_files(chart: Path) -> dict[Path, str]:
    """The chart's copies of the table and the schema (`python -m kubetune.recipe.helm_values CHART_DIR`)."""
    schema_path = chart / "values.schema.json"
    schema = json.loads(schema_path.read_text())
    schema["properties"] |= alias_schema()
    return {
        chart / "files" / "helm-values-aliases.json": json.dumps(chart_aliases(), indent=1) + "\n",
        schema_path: json.dumps(schema, indent=2) + "\n",
    }


if __name__ == "__main__":
    for path, text in chart_files(Path(sys.argv[1])).items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
