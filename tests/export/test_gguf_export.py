"""GGUF export: the file transformers' GGUF loader reads back gives the logits of the merged
model (within the rounding of f16 / bf16 / q8_0), and its tokenizer encodes text to the
same ids as the run's tokenizer.

Reading a GGUF with SmolLM2's full 49k-token vocabulary takes gguf-py seconds per pass, so
the per-type and end-to-end tests use a vocabulary cut to SmolLM2's first tokens (the same
byte-level BPE, pre-tokenizer, special tokens and chat template); the full tokenizer is
read back once, in its own test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kubetune.export.gguf import export_gguf, permute_qk, write_gguf
from tests.kit.cli import run_cli_in_process, run_cli_subprocess
from tests.kit.models import tiny_model

pytestmark = pytest.mark.process

SMALL_VOCAB = 2048
TEXT = "Answer this question truthfully\n\nWhat is fact number 37? It's 74 <|im_end|>, café."


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory, smollm_dir) -> Path:
    """SmolLM2's tokenizer with its vocabulary cut to the first SMALL_VOCAB ids (BPE merges
    build tokens from lower ids, so the merges among them are a consistent prefix)."""
    out = tmp_path_factory.mktemp("small-tokenizer")
    for f in smollm_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    spec = json.loads((smollm_dir / "tokenizer.json").read_text())
    vocab = {t: i for t, i in spec["model"]["vocab"].items() if i < SMALL_VOCAB}
    spec["model"]["vocab"] = vocab
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if m[0] + m[1] in vocab]
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < SMALL_VOCAB]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@pytest.fixture(scope="session")
def small_tokenizer(small_tokenizer_dir):
    from kubetune.models.load import load_tokenizer

    return load_tokenizer(str(small_tokenizer_dir))


def _tiny(arch: str, tokenizer, tied: bool = True):
    """A randomly initialised model: hidden 64, 2 layers, 4 heads, 2 key/value heads."""
    model = tiny_model(
        tokenizer,
        arch,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        initializer_range=0.05,
    )
    with torch.no_grad():  # biases start at zero: give them values, so that they are checked too
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    return model.eval()


def _read_back(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _logits(model, tokenizer, text: str = TEXT) -> torch.Tensor:
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits[0]


# max |logit difference| / max |logit|, and the share of positions whose argmax must agree
TOLERANCE = {"f16": (2e-3, 1.0), "bf16": (1.5e-2, 0.9), "q8_0": (4e-2, 0.8)}


@pytest.mark.parametrize(
    "arch,gguf_type,tied",
    [
        ("llama", "f16", True),
        ("llama", "bf16", False),  # untied: an output.weight
        ("llama", "q8_0", True),
        ("mistral", "f16", False),  # written as llama, as llama.cpp does
        ("qwen2", "bf16", True),  # its own architecture: q/k/v biases, no q/k permutation
    ],
)
def test_gguf_read_back_gives_the_models_logits(tmp_path, small_tokenizer, arch, gguf_type, tied):
    model = _tiny(arch, small_tokenizer, tied)
    path = tmp_path / f"m-{gguf_type}.gguf"
    write_gguf(model, small_tokenizer, path, gguf_type, name="tiny")
    assert path.is_file() and not list(tmp_path.glob(".*tmp*"))
    back = _read_back(path)
    assert back.config.model_type == ("llama" if arch == "mistral" else arch)
    want, got = _logits(model, small_tokenizer), _logits(back, small_tokenizer)
    rel, agree = TOLERANCE[gguf_type]
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < rel, f"{gguf_type}: relative logit error {err:.2e}"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= agree


def test_gguf_metadata_and_tensor_types(tmp_path, small_tokenizer):
    """The keys the embedded SmolLM2 GGUF carries, with this model's values; 2-D weights in the
    requested type, 1-D ones in f32; no output.weight when the embeddings are tied."""
    import gguf

    model = _tiny("llama", small_tokenizer, tied=True)
    path = tmp_path / "m.gguf"
    write_gguf(model, small_tokenizer, path, "q8_0", name="my-run")
    r = gguf.GGUFReader(path)
    v = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    cfg = model.config
    expected = {
        "general.architecture": "llama",
        "general.name": "my-run",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0),
        "llama.context_length": 512,
        "llama.embedding_length": 64,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 16,
        "llama.vocab_size": SMALL_VOCAB,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": small_tokenizer.bos_token_id,
        "tokenizer.ggml.eos_token_id": small_tokenizer.eos_token_id,
        "tokenizer.ggml.padding_token_id": small_tokenizer.pad_token_id,
        "tokenizer.ggml.unknown_token_id": small_tokenizer.unk_token_id,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": small_tokenizer.chat_template,
    }
    assert {k: v.get(k) for k in expected} == expected
    assert v["llama.rope.freq_base"] == pytest.approx(cfg.rope_parameters["rope_theta"])
    assert v["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert len(v["tokenizer.ggml.tokens"]) == SMALL_VOCAB and len(v["tokenizer.ggml.merges"]) > 1000
    types = v["tokenizer.ggml.token_type"]
    assert types[small_tokenizer.eos_token_id] == gguf.TokenType.CONTROL and types[100] == gguf.TokenType.NORMAL
    tensors = {t.name: t.tensor_type for t in r.tensors}
    assert "output.weight" not in tensors and "token_embd.weight" in tensors
    assert tensors["blk.1.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert tensors["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert tensors["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert len(tensors) == 1 + 1 + 2 * 9  # embeddings, final norm, 9 per block


def test_q_and_k_rows_are_permuted_as_llama_cpp_does():
    # 1 head of dimension 4: HF rotates (x0, x2) and (x1, x3); llama.cpp adjacent pairs
    w = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3).numpy()
    assert permute_qk(w, 1).tolist() == w[[0, 2, 1, 3]].tolist()
    # k_proj of 1 key/value head (of dimension 8) under 4 query heads: permuted per key/value head
    kv = torch.arange(8, dtype=torch.float32).reshape(8, 1).numpy()
    assert permute_qk(kv, 4, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_full_smollm2_tokenizer_reads_back_the_same(tmp_path, tokenizer, tiny_model_dir):
    """The real 49k-token SmolLM2 tokenizer: transformers' GGUF tokenizer encodes to the same
    ids, has the same special tokens and renders the same chat prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    path = tmp_path / "tiny.gguf"
    write_gguf(model, tokenizer, path, "f16")
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert back(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(back, attr) == getattr(tokenizer, attr), attr
    chat = [{"role": "user", "content": "What does insulin do?"}]
    assert back.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory, small_tokenizer) -> Path:
    out = tmp_path_factory.mktemp("small-llama")
    _tiny("llama", small_tokenizer).save_pretrained(out, safe_serialization=True)
    small_tokenizer.save_pretrained(out)
    return out


def test_lora_run_gguf_equals_merged_model(tmp_path, tiny_overrides, small_model_dir, capfd):
    """A short LoRA run, exported through the CLI (kubetune.cli.main, in this process) with the
    default name and type (f16): its logits are the merged model's, and differ from the base
    model's."""
    from kubetune.export.weights import load_merged
    from kubetune.rundir import RunDir
    from kubetune.training.run import train_from_recipe

    run = tmp_path / "run"
    train_from_recipe(
        None,
        tiny_overrides
        + [f"model.name_or_path={small_model_dir}", f"output_dir={run}", "train.max_steps=3"]
        + ["train.lr=5e-2", "eval.generate=0"],
    )
    res = run_cli_in_process(["export", str(run), "--gguf"], capfd)
    assert res.returncode == 0, res.stderr[-2000:]
    path = run / "run-f16.gguf"
    assert res.stdout.strip() == str(path) and path.is_file()
    merged, tokenizer = load_merged(RunDir(run), RunDir(run).recipe())
    merged.eval()
    want, got = _logits(merged, tokenizer), _logits(_read_back(path), tokenizer)
    assert (got - want).abs().max().item() / want.abs().max().item() < TOLERANCE["f16"][0]
    base = _logits(_read_back_base(small_model_dir), tokenizer)
    assert (base - want).abs().max().item() > 10 * (got - want).abs().max().item()  # the adapter counts
    # -o DIR: the default name in that directory
    q8 = export_gguf(run, "q8_0", tmp_path)
    assert q8 == tmp_path / "run-q8_0.gguf" and q8.stat().st_size < path.stat().st_size


def _read_back_base(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _fake_full_run(root: Path, tiny_model_dir: Path, weights) -> Path:
    """A finished full fine-tune run directory whose model/ holds `weights` (a config, or a
    model directory to copy)."""
    from kubetune.recipe.loader import load_recipe
    from kubetune.rundir import RunDir

    recipe = load_recipe(None, [f"model.name_or_path={tiny_model_dir}", "finetune.method=full"]).recipe
    run = RunDir(root)
    run.write_record(recipe, "finished")
    if isinstance(weights, Path):
        shutil.copytree(weights, run.weights("full"))
    else:
        weights.save_pretrained(run.weights("full"))
    return root


def test_full_fine_tune_is_written_as_it_is(tmp_path, tiny_model_dir, small_model_dir, small_tokenizer):
    from transformers import AutoModelForCausalLM

    run = _fake_full_run(tmp_path / "full", tiny_model_dir, small_model_dir)
    path = export_gguf(run, "bf16", tmp_path / "sub" / "full.gguf")
    assert path == tmp_path / "sub" / "full.gguf"
    model = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32).eval()
    want, got = _logits(model, small_tokenizer), _logits(_read_back(path), small_tokenizer)
    assert (got - want).abs().max().item() / want.abs().max().item() < TOLERANCE["bf16"][0]


def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_model_dir, capfd):
    """Each case through `kubetune.cli.main` in this process; the architecture refusal (from
    deep in the export, gguf and transformers loaded) through a real process too."""
    from transformers import GPT2Config

    gpt2_run = _fake_full_run(
        tmp_path / "gpt2-run",
        tiny_model_dir,
        GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]),
    )
    cases = [
        (["export", str(tmp_path), "--gguf"], ["not a kubetune run directory"]),
        (["export", str(gpt2_run), "--gguf", "--gguf-type", "q4_0"], ["--gguf-type q4_0", "f16, bf16, q8_0"]),
        (["export", str(gpt2_run), "--gguf"], ["llama", "gpt2", "GPT2LMHeadModel"]),
        (["export", str(gpt2_run), "--gguf-type", "bf16"], ["--gguf-type bf16 goes with --gguf"]),
    ]
    answers = [(args, words, run_cli_in_process(args, capfd)) for args, words in cases]
    args, words = cases[2]
    answers.append((args, words, run_cli_subprocess(args)))  # the real process
    for args, must_mention, res in answers:
        assert res.returncode == 2, (args, res.stderr)
        assert "Traceback" not in res.stderr
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1, res.stderr
        for word in must_mention:
            assert word in lines[0], lines[0]
    assert not list(gpt2_run.glob("*.gguf")) and not list(gpt2_run.glob(".*tmp*"))


def test_export_gguf_refuses_before_loading(tmp_path, tiny_model_dir):
    """export_gguf itself raises the UserError (the CLI only prints it)."""
    from transformers import GPT2Config

    from kubetune.errors import UserError

    run = _fake_full_run(
        tmp_path / "run", tiny_model_dir, GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"])
    )
    with pytest.raises(UserError, match="not gpt2"):
        export_gguf(run)
