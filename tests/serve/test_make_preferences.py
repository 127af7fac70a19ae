"""`kubetune data make-preferences` on the tiny Llama: chosen = the reference answer, rejected = the
model's own greedy answer (the same tokens `kubetune generate`'s decoding gives), pairs whose
greedy answer is the reference left out and counted, one error line for a bad path or recipe."""

from __future__ import annotations

import io
import json

import pytest
import torch

from kubetune.errors import UserError
from tests.kit.cli import run_cli_in_process, run_cli_subprocess
from tests.kit.models import save_tiny_model

MAX_NEW = 8


@pytest.fixture(scope="module")
def answering_model_dir(tmp_path_factory, tokenizer):
    """The suite's tiny Llama, but with its own LM head and larger weights: the shared one (tied
    embeddings, small init) answers every chat prompt with newlines, which would not show whose
    answer a row holds."""
    out = tmp_path_factory.mktemp("answering-llama")
    return save_tiny_model(out, tokenizer, tie_word_embeddings=False, initializer_range=0.5)


def _recipe(answering_model_dir, data) -> list[str]:
    return [
        f"model.name_or_path={answering_model_dir}",
        f"data.train={data}",
        "train.precision=fp32",
        "train.num_threads=1",
    ]


def _direct_answers(answering_model_dir, rows: list[dict]) -> list[str]:
    """Each row's greedy answer from transformers' generate, one prompt at a time (models/decoding.py)."""
    from kubetune.data.templates import PromptRenderer
    from kubetune.models.decoding import generate_text
    from kubetune.models.load import load_causal_lm, load_tokenizer

    lm = load_causal_lm(str(answering_model_dir), torch.float32).eval()
    tokenizer = load_tokenizer(str(answering_model_dir))
    renderer = PromptRenderer("chat", tokenizer)
    return [
        generate_text(lm, tokenizer, renderer.prompt(r), MAX_NEW, add_special_tokens=False, device=torch.device("cpu"))
        for r in rows
    ]


def test_rejected_is_the_models_greedy_answer_and_identical_pairs_are_left_out(answering_model_dir, qa_file, tmp_path):
    from kubetune.serve.preferences import make_preferences

    rows = [json.loads(line) for line in qa_file.read_text().splitlines()[:5]]
    greedy = _direct_answers(answering_model_dir, rows)
    assert len(set(greedy)) > 1 and all(greedy), greedy  # answers that tell the rows apart
    rows[2]["output"] = greedy[2]  # this row's model already answers with its reference
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "made" / "pairs.jsonl"
    progress: list[str] = []

    made = make_preferences(None, _recipe(answering_model_dir, data), out, max_new_tokens=MAX_NEW, echo=progress.append)

    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert (made.rows, made.written, made.left_out) == (5, 4, {"identical": 1})
    assert "wrote 4 preference pairs" in made.summary()
    assert "left out 1 whose greedy answer equals the reference, 0 without a reference answer" in made.summary()
    assert progress[-1].startswith("make-preferences: 5/5 answered")
    kept = [i for i in range(5) if i != 2]
    assert [set(w) for w in written] == [{"instruction", "input", "chosen", "rejected"}] * 4
    assert [w["input"] for w in written] == [rows[i]["input"] for i in kept]
    assert [w["instruction"] for w in written] == [rows[i]["instruction"] for i in kept]
    assert [w["chosen"] for w in written] == [rows[i]["output"] for i in kept]
    assert [w["rejected"] for w in written] == [greedy[i] for i in kept]


def test_off_a_terminal_each_phase_is_a_line_before_the_first_answer(answering_model_dir, qa_file, tmp_path):
    # seen: nothing printed for the first ~70 s (loading the model)
    from kubetune.serve.preferences import make_preferences

    lines: list[str] = []
    overrides = _recipe(answering_model_dir, qa_file)
    make_preferences(None, overrides, tmp_path / "p.jsonl", limit=2, max_new_tokens=MAX_NEW, echo=lines.append)

    assert lines[0].startswith(f"make-preferences: loading {answering_model_dir} (2 rows to answer) (")
    assert lines[1].startswith("make-preferences: answering 2 rows (")
    assert lines[-1].startswith("make-preferences: 2/2 answered (")


def test_on_a_terminal_one_bar_shows_every_phase(answering_model_dir, qa_file, tmp_path):
    from rich.console import Console

    from kubetune.serve.preferences import make_preferences

    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=400)
    lines: list[str] = []
    overrides = _recipe(answering_model_dir, qa_file)
    make_preferences(None, overrides, tmp_path / "p.jsonl", 2, MAX_NEW, echo=lines.append, console=terminal)

    drawn = screen.getvalue()
    assert lines == []  # the bar instead of the lines
    loading, answering = drawn.index(f"loading {answering_model_dir}"), drawn.index("answering 2 rows")
    assert loading < answering and "2/2" in drawn[answering:]


@pytest.mark.process  # the real command on a terminal: stderr is a pseudo-terminal's end
def test_the_cli_draws_the_bar_on_a_terminal(answering_model_dir, qa_file, tmp_path):
    import os
    import pty
    import subprocess
    import sys

    from tests.kit.paths import REPO

    out = tmp_path / "p.jsonl"
    args = ["data", "make-preferences", *_recipe(answering_model_dir, qa_file), "--limit", "1", "--max-new-tokens", "2"]
    terminal, its_end = pty.openpty()
    command = [sys.executable, "-m", "kubetune", *args, "--out", str(out)]
    wide = {**os.environ, "COLUMNS": "400"}  # the line names the model's path: rich cuts it to the width
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=its_end, text=True, cwd=REPO, env=wide)
    os.close(its_end)
    drawn = b""
    while chunk := _read_or_empty(terminal):
        drawn += chunk
    assert proc.wait(timeout=300) == 0 and "wrote" in proc.stdout.read()
    screen = drawn.decode(errors="replace")
    assert "\x1b[" in screen  # drawn (ANSI), not printed as lines
    assert f"loading {answering_model_dir}" in screen and "1/1" in screen[screen.index("answering 1 rows") :]


def _read_or_empty(fd: int) -> bytes:
    import os

    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: the other end closed (Linux)
        return b""


def test_limit_takes_the_first_rows_and_chat_rows_keep_their_history(answering_model_dir, tmp_path):
    from kubetune.serve.preferences import make_preferences

    chats = [
        {
            "conv": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]
        }
        for i in range(4)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chats))
    out = tmp_path / "pairs.jsonl"
    overrides = [*_recipe(answering_model_dir, data), "data.columns.messages=conv"]

    made = make_preferences(None, overrides, out, limit=2, max_new_tokens=MAX_NEW, echo=lambda _: None)

    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert made.rows == 2 and len(written) == 2
    assert [w["messages"] for w in written] == [c["conv"][:1] for c in chats[:2]]
    assert [w["chosen"] for w in written] == [c["conv"][1]["content"] for c in chats[:2]]
    assert all(w["rejected"] and w["rejected"] != w["chosen"] for w in written)


@pytest.mark.parametrize(
    ("out_name", "limit", "says"),
    [
        ("dir", None, "is a directory"),
        ("pairs.json", None, "ending in .jsonl"),
        ("pairs.jsonl", 0, "--limit 0"),
    ],
)
def test_a_bad_output_or_limit_is_refused_before_the_model_loads(tmp_path, out_name, limit, says):
    from kubetune.serve.preferences import make_preferences

    (tmp_path / "dir").mkdir()
    with pytest.raises(UserError, match=says):
        make_preferences(None, ["model.name_or_path=/no/such/model"], tmp_path / out_name, limit)


def _one_error_line(result, names: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("kubetune: error: "), result.stderr
    assert names in lines[0]


def test_the_cli_prints_one_error_line_for_a_missing_data_file(tmp_path, capfd):
    out = tmp_path / "p.jsonl"
    args = ["data", "make-preferences", f"data.train={tmp_path}/none.jsonl", "--out", str(out)]
    _one_error_line(run_cli_in_process(args, capfd), "data.train")
    assert not out.exists()


def test_a_file_of_pairs_is_refused_naming_what_to_read_instead(tmp_path):
    from kubetune.serve.preferences import make_preferences

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"instruction": "q", "input": "", "chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(UserError, match="holds preference pairs already") as e:
        make_preferences(None, [f"data.train={pairs}"], tmp_path / "out.jsonl")
    assert "data.train=builtin:medical_flashcards_sample" in str(e.value)


@pytest.mark.process  # the real process once: exit code and stderr as a shell sees them
def test_the_cli_prints_one_error_line_for_an_unknown_recipe(tmp_path):
    out = tmp_path / "p.jsonl"
    _one_error_line(
        run_cli_subprocess(["data", "make-preferences", "no-such-recipe.yaml", "--out", str(out)]), "no-such-recipe"
    )
    assert not out.exists()
