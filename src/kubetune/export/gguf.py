"""`kubetune export RUN_DIR --gguf`: a run's trained model as one GGUF file, the format
llama.cpp, Ollama and LM Studio load.

A LoRA run is merged into its base first (in fp32, `export.weights.load_merged`); a full fine-tune
is written as it is. Tensor names come from the `gguf` package's tensor-name map, the
metadata keys from its writer, so that they are the ones llama.cpp reads. What a
well-formed file carries was checked against the SmolLM2 GGUF kubetune embeds: the
`llama.*` hyperparameters, a byte-level BPE tokenizer (`tokenizer.ggml.model` = gpt2:
tokens, token types, merges, special token ids, the add-BOS flag, the chat template) and
`general.*` (name, architecture, file type).

llama.cpp computes rotary embeddings on interleaved pairs, Hugging Face's Llama on two
halves: q_proj and k_proj rows are permuted for the `llama` architecture as llama.cpp's
converter does (`LlamaModel.permute`); transformers' GGUF loader undoes it when reading.
Nothing here imports the training engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kubetune.errors import UserError
from kubetune.fsutil import fsync_dir
from kubetune.rundir import RunDir

GGUF_TYPES = ("f16", "bf16", "q8_0")
# f16 by default, as llama.cpp's convert_hf_to_gguf.py: every llama.cpp backend (CPU, CUDA,
# Metal, Vulkan) and so Ollama and LM Studio compute in f16 at full speed, while bf16 has
# no or slow kernels on older GPUs and Macs. A trained model's weights are far inside f16's
# range (|w| < 65504), and f16 keeps 3 more mantissa bits than bf16.
DEFAULT_GGUF_TYPE = "f16"


@dataclass(frozen=True)
class _Arch:
    gguf: Any  # gguf.MODEL_ARCH
    permute_qk: bool  # llama.cpp's rotary layout (LLaMA family); Qwen2 uses the HF layout


def _archs() -> dict[str, _Arch]:
    """HF model_type -> how llama.cpp's converter writes it. Mistral is written as llama,
    as llama.cpp does (one architecture, same tensors)."""
    import gguf

    return {
        "llama": _Arch(gguf.MODEL_ARCH.LLAMA, True),
        "mistral": _Arch(gguf.MODEL_ARCH.LLAMA, True),
        "qwen2": _Arch(gguf.MODEL_ARCH.QWEN2, False),
    }


def default_output(run: RunDir, gguf_type: str) -> Path:
    """RUN_DIR/<run name>-<type>.gguf, the run name being the run directory's name."""
    return run.path / f"{run.path.resolve().name}-{gguf_type}.gguf"


def export_gguf(run_dir: Path, gguf_type: str = DEFAULT_GGUF_TYPE, output: Path | None = None) -> Path:
    """Write the run's trained model (merged, for LoRA) as a GGUF file; return its path."""
    check_gguf_type(gguf_type)
    run = RunDir(Path(run_dir))
    recipe = run.recipe()
    weights = run.finished_weights(recipe)

    from kubetune.data.templates import resolve_template
    from kubetune.export.weights import load_merged
    from kubetune.models.load import load_config, resolve_model

    # the architecture is checked on the config, before minutes of loading and merging
    source = str(weights) if recipe.finetune.method == "full" else resolve_model(recipe.model.name_or_path)
    check_config(load_config(source, recipe.model.revision, recipe.model.trust_remote_code))
    if output is None:
        output = default_output(run, gguf_type)
    elif Path(output).is_dir():  # -o DIR: the default file name in that directory
        output = Path(output) / default_output(run, gguf_type).name
    model, tokenizer = load_merged(run, recipe)
    template = resolve_template(recipe.data.template, tokenizer)  # `auto`: what the run trained with
    if template != "chat":
        _warn(
            f"the run was trained with data.template={template!r}, not with the chat template "
            f"the GGUF carries: prompt it with text in that template (a plain completion), not through chat"
        )
    write_gguf(model, tokenizer, Path(output), gguf_type, name=run.path.resolve().name)
    return Path(output)


def check_gguf_type(gguf_type: str) -> None:
    if gguf_type not in GGUF_TYPES:
        raise UserError(f"--gguf-type {gguf_type}: unknown GGUF type; choose one of {', '.join(GGUF_TYPES)}")


def check_config(config: Any) -> _Arch:
    """The GGUF architecture for this HF config, or a UserError naming what is not supported."""
    model_type = getattr(config, "model_type", None)
    arch = _archs().get(str(model_type))
    if arch is None:
        raise UserError(
            f"GGUF export supports the llama, mistral and qwen2 architectures, not {model_type} "
            f"({', '.join(getattr(config, 'architectures', None) or []) or 'no architectures in config.json'})"
        )
    rope_type = _rope(config).get("rope_type", _rope(config).get("type", "default"))
    if rope_type not in (None, "default"):
        raise UserError(
            f"GGUF export: the model's rope scaling {rope_type!r} is not supported yet (only unscaled RoPE)"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(f"GGUF export: {model_type} with hidden_act={config.hidden_act} is not supported (only silu)")
    return arch


def _rope(config: Any) -> dict[str, Any]:
    """transformers 5 keeps the rotary settings in `rope_parameters`; older configs in
    `rope_theta` / `rope_scaling`."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params)


def _warn(line: str) -> None:
    print(f"kubetune: warning: {line}", file=sys.stderr)


# ---------------------------------------------------------------------------- writing


def write_gguf(model: Any, tokenizer: Any, output: Path, gguf_type: str = DEFAULT_GGUF_TYPE, name: str = "") -> None:
    """Write an HF causal LM (Llama, Mistral, Qwen2) and its tokenizer as a GGUF file, atomically."""
    import gguf

    check_gguf_type(gguf_type)
    config = model.config
    arch = check_config(config)
    arch_name = gguf.MODEL_ARCH_NAMES[arch.gguf]
    with _atomic_file(Path(output)) as tmp:
        writer = gguf.GGUFWriter(tmp, arch_name)
        try:
            writer.add_type(gguf.GGUFType.MODEL)
            writer.add_name(name or getattr(config, "_name_or_path", "") or arch_name)
            writer.add_file_type(int(_types(gguf_type)[0]))
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            _add_hparams(writer, config)
            _add_tokenizer(writer, tokenizer, config.vocab_size)
            _add_tensors(writer, model, arch, gguf_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()


def _types(gguf_type: str) -> tuple[int, Any]:
    """(general.file_type, the type of the 2-D weights) for a --gguf-type."""
    import gguf

    q = gguf.GGMLQuantizationType
    f = gguf.LlamaFileType
    return {
        "f16": (f.MOSTLY_F16, q.F16),
        "bf16": (f.MOSTLY_BF16, q.BF16),
        "q8_0": (f.MOSTLY_Q8_0, q.Q8_0),
    }[gguf_type]


def _add_hparams(writer: Any, config: Any) -> None:
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    rope = _rope(config)
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    if head_dim * n_head != config.hidden_size:  # llama.cpp assumes hidden / heads otherwise
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    window = getattr(config, "sliding_window", None) or 0
    windowed = config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
    if windowed and 0 < window < config.max_position_embeddings:
        _warn(
            f"the model attends over a sliding window of {window} tokens; llama.cpp attends over "
            f"the whole context, so answers differ past {window} tokens"
        )


# ---------------------------------------------------------------------------- tensors


def permute_qk(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """HF's rotary layout (two halves per head) -> llama.cpp's (interleaved pairs), as
    llama.cpp's `LlamaModel.permute`; for k_proj the heads are the key/value heads."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    rows = weights.shape[0]
    return weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _add_tensors(writer: Any, model: Any, arch: _Arch, gguf_type: str) -> None:
    import gguf
    from gguf.quants import QuantError, quantize

    config = model.config
    names = gguf.get_tensor_name_map(arch.gguf, config.num_hidden_layers)
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    tied = bool(getattr(config, "tie_word_embeddings", False))
    wanted = _types(gguf_type)[1]
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads token_embd for the output when there is no output.weight
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UserError(
                f"GGUF export: the {config.model_type} model has a tensor {hf_name} that GGUF's "
                f"{gguf.MODEL_ARCH_NAMES[arch.gguf]} architecture has no name for"
            )
        data = tensor.detach().to("cpu").float().numpy()
        if arch.permute_qk and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            data = permute_qk(data, n_head, n_head)
        elif arch.permute_qk and hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            data = permute_qk(data, n_head, n_kv)
        # norms and biases (1-D, small) stay f32, as llama.cpp's converter keeps them
        qtype = wanted if data.ndim > 1 else gguf.GGMLQuantizationType.F32
        try:
            packed = quantize(data, qtype)
        except QuantError:  # a row length that is not a multiple of q8_0's block: f16, as llama.cpp does
            qtype = gguf.GGMLQuantizationType.F16
            packed = quantize(data, qtype)
        writer.add_tensor(name, packed, raw_dtype=qtype)


# ---------------------------------------------------------------------------- tokenizer


def _add_tokenizer(writer: Any, tokenizer: Any, vocab_size: int) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" model: its tokens as the tokenizer
    spells them (byte-level alphabet), token types, merges, special ids, flags, chat template."""
    import gguf

    with tempfile.TemporaryDirectory(prefix="kubetune-gguf-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        spec_file = Path(tmp) / "tokenizer.json"
        spec = json.loads(spec_file.read_text()) if spec_file.is_file() else {}
        if not _byte_level_bpe(spec):
            kind = spec.get("model", {}).get("type", "no tokenizer.json")
            raise UserError(
                f"GGUF export supports byte-level BPE tokenizers (GPT-2 style, like SmolLM2's, Llama 3's, "
                f"Qwen2's), not this {type(tokenizer).__name__} ({kind})"
            )
        special = gguf.SpecialVocab(tmp, load_merges=True, n_vocab=vocab_size)
    tokens, types = _tokens(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_add_space_prefix(_byte_level_prefix_space(spec))
    # what the tokenizer really does, rather than what its config files happen to state
    special.special_token_ids = {
        kind: token_id
        for kind in ("bos", "eos", "unk", "pad")
        if (token_id := getattr(tokenizer, f"{kind}_token_id", None)) is not None and token_id < vocab_size
    }
    probe = tokenizer("a")["input_ids"]
    special.add_special_token = {
        "bos": tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id],
        "eos": tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id],
    }
    special.chat_template = tokenizer.chat_template or None
    special.add_to_gguf(writer, quiet=True)


def _tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token strings and types by id, for the model's whole embedding (ids the tokenizer does
    not have are `[PAD<id>]`, UNUSED, as llama.cpp's converter writes them)."""
    import gguf

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder  # id -> AddedToken
    if by_id and max(by_id) >= vocab_size:
        raise UserError(f"GGUF export: the tokenizer has token id {max(by_id)}, the model only {vocab_size} embeddings")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _pre_steps(spec: dict[str, Any]) -> list[dict[str, Any]]:
    pre = spec.get("pre_tokenizer") or {}
    return list(pre.get("pretokenizers", [])) if pre.get("type") == "Sequence" else [pre] if pre else []


def _byte_level_bpe(spec: dict[str, Any]) -> bool:
    return spec.get("model", {}).get("type") == "BPE" and any(s.get("type") == "ByteLevel" for s in _pre_steps(spec))


def _byte_level_prefix_space(spec: dict[str, Any]) -> bool:
    return any(bool(s.get("add_prefix_space")) for s in _pre_steps(spec) if s.get("type") == "ByteLevel")


def _pre_tokenizer(spec: dict[str, Any]) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) for how this tokenizer splits text before BPE,
    read from its tokenizer.json: the split regex picks llama.cpp's, which reproduces it."""
    steps = [{k: v for k, v in s.items() if k in ("type", "use_regex", "individual_digits")} for s in _pre_steps(spec)]
    if steps == [{"type": "ByteLevel", "use_regex": True}]:
        return "gpt-2"  # GPT-2's own regex (also what transformers builds from SmolLM2's GGUF)
    if steps == [{"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", "use_regex": True}]:
        return "smollm"  # digits one by one, then GPT-2's regex
    raw = _pre_steps(spec)
    if len(raw) == 2 and raw[0].get("type") == "Split" and steps[1] == {"type": "ByteLevel", "use_regex": False}:
        regex = (raw[0].get("pattern") or {}).get("Regex")
        for pre, known in _known_splits().items():
            if regex == known:
                return pre
    _warn(
        "GGUF export: llama.cpp has no pre-tokenizer known to match this tokenizer's; wrote 'default', "
        "so llama.cpp may split some text differently from training"
    )
    return "default"


def _known_splits() -> dict[str, str]:
    """llama.cpp pre-tokenizer name -> its split regex, as transformers' GGUF reader maps them
    (the first name per regex, which is the one llama.cpp's converter writes)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # an older or newer transformers without that table
        return {}
    first: dict[str, str] = {}
    for pre, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        if regex not in first.values():
            first[pre] = regex
    return first


@contextlib.contextmanager
def _atomic_file(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success fsync it and rename it into place
    (a reader never sees half a GGUF file), on an exception remove it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
