"""Bad input: one clear line on stderr naming the key or file and the fix, exit code 2,
no traceback, and nothing written to output_dir. One case through a real CLI process, every
case through the same `kubetune.cli.main` in this process."""

import importlib.util
import json

import pytest
import torch

from tests.kit.cli import run_cli_in_process, run_cli_subprocess

pytestmark = pytest.mark.process


def _cases(tiny_model_dir, qa_file, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    other_cols = tmp_path / "cols.jsonl"
    other_cols.write_text(json.dumps({"question": "q?", "answer": "a."}) + "\n")
    base = [
        f"model.name_or_path={tiny_model_dir}",
        f"data.train={qa_file}",
        f"data.cache_dir={tmp_path / 'c'}",
        "train.max_steps=1",
    ]
    return {
        "unknown key": (base + ["train.learning_rate=1e-4"], ["train.learning_rate", "train.lr"]),
        "wrong type": (base + ["train.micro_batch_size=four"], ["train.micro_batch_size"]),
        "missing recipe file": (["no-such-recipe.yaml"], ["no-such-recipe.yaml"]),
        "missing data file": (base + [f"data.train={tmp_path}/missing.jsonl"], ["data.train", "missing.jsonl"]),
        "missing column": (base + [f"data.train={other_cols}"], ["data.columns.instruction", "answer, question"]),
        "empty dataset": (base + [f"data.train={empty}"], ["data.train", "empty"]),
        "absent target module": (base + ["lora.target_modules=[q_proj,qkv_proj]"], ["lora.target_modules", "qkv_proj"]),
        "no target module": (base + ["lora.target_modules=[]"], ["lora.target_modules", "all-linear"]),
        "prompt longer than max_seq_len": (base + ["data.max_seq_len=16"], ["data.max_seq_len=16"]),
        "missing model dir": (base + [f"model.name_or_path={tmp_path}/nomodel"], ["model.name_or_path"]),
        # the suite runs where torch has no GPU and no Habana bridge (a CUDA box skips these)
        "no CUDA GPU": (base + ["train.device=cuda"], ["train.device=cuda", "train.device=auto"]),
        "no Gaudi bridge": (base + ["train.device=hpu"], ["train.device=hpu", "habana_frameworks"]),
    }


CASES = [
    "unknown key",
    "wrong type",
    "missing recipe file",
    "missing data file",
    "missing column",
    "empty dataset",
    "absent target module",
    "no target module",
    "prompt longer than max_seq_len",
    "missing model dir",
    *(() if torch.cuda.is_available() else ("no CUDA GPU",)),
    *(() if importlib.util.find_spec("habana_frameworks") else ("no Gaudi bridge",)),
]


# The real process: a ModelError from deep in the run (the model and PEFT imported and
# loaded), where a library's warning on stderr would break the one line.
IN_A_PROCESS = "absent target module"


def train_argv(args: list[str], out) -> list[str]:
    return ["train", *args, f"output_dir={out}"] if "=" in args[-1] or len(args) > 1 else ["train", *args]


def assert_one_line(case: str, res, words: list[str], out) -> None:
    assert res.returncode == 2, f"{case}: {res.stderr}"
    assert "Traceback" not in res.stderr, case
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{case}: {res.stderr}"
    for word in words:
        assert word in lines[0], f"{case}: {lines[0]}"
    assert not out.exists() or not any(out.iterdir()), case


def test_bad_input_is_one_line_and_exit_2(tiny_model_dir, qa_file, tmp_path, capfd):
    cases = _cases(tiny_model_dir, qa_file, tmp_path)
    args, words = cases[IN_A_PROCESS]
    out = tmp_path / "out-process"
    assert_one_line(IN_A_PROCESS, run_cli_subprocess(train_argv(args, out)), words, out)
    for case in CASES:
        args, words = cases[case]
        out = tmp_path / f"out-{CASES.index(case)}"
        assert_one_line(case, run_cli_in_process(train_argv(args, out), capfd), words, out)


def test_export_of_a_non_run_is_a_clear_error(tmp_path):
    res = run_cli_subprocess(["export", str(tmp_path), "--merged"])
    assert res.returncode == 2 and "not a kubetune run directory" in res.stderr and "Traceback" not in res.stderr
