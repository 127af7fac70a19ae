"""The training benchmarks' kubetune arms ask for recipes that load: a recipe key renamed or
a value newly refused fails here, not half an hour into a benchmark run."""

from __future__ import annotations

import argparse

import pytest

from kubetune.recipe import load_recipe
from tests.conftest import load_bench


def test_train_vs_hf_kubetune_arms_load(tmp_path):
    bench = load_bench("train/train_vs_hf")
    args = argparse.Namespace(rows=8, eval_rows=4, threads=2, batch=8, kt_micro=2)
    for threads, micro in ((2, 2), (1, 1)):  # one process with every thread; one per core
        recipe = load_recipe(None, bench.kubetune_overrides(args, "auto", str(tmp_path), threads, micro)).recipe
        assert (recipe.train.num_threads, recipe.train.micro_batch_size) == (threads, micro)
        assert recipe.lora.target_modules == bench.LORA["targets"]


def test_lora_1b_kubetune_arm_loads(tmp_path):
    bench = load_bench("train/lora_1b")
    data = tmp_path / "train.jsonl"  # --data: a copy of the flashcards (an offline GPU box's)
    args = argparse.Namespace(steps=3, rows=2, device="cpu", data=str(data))
    recipe = load_recipe(None, bench.kubetune_overrides(tmp_path / "model", args, str(tmp_path))).recipe
    assert recipe.data.train == str(data)
    assert recipe.data.eval is None
    assert (recipe.lora.r, recipe.lora.target_modules) == (16, "all-linear")


@pytest.mark.parametrize(("bf16", "expected"), [(0.3e9, "fp32"), (40e9, "bf16")])
def test_lora_1b_runs_hf_in_fp32_only_where_bf16_has_no_units(bf16, expected):
    assert load_bench("train/lora_1b").hf_precision({"fp32": 135e9, "bf16": bf16}) == expected


def test_attention_gpu_candidates_fill_the_rows_and_agree_on_a_cpu():
    """bench/train/attention_gpu.py's rows are full and its CPU-runnable kernels agree with the
    per-sample loop (varlen is CUDA's alone and is not offered here)."""
    import torch

    bench = load_bench("train/attention_gpu")
    lengths = bench.packed_lengths(rows=3, seq=128)
    assert sum(lengths) == 3 * 128 and all(n > 0 for n in lengths)
    fns = bench.candidates("cpu")
    assert "flash varlen" not in fns
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, bench.HEADS, 128, 8, generator=g)
    k, v = (torch.randn(3, bench.KV_HEADS, 128, 8, generator=g) for _ in range(2))
    reference = fns["per-sample loop"](q, k, v, lengths)
    torch.testing.assert_close(fns["one masked call"](q, k, v, lengths), reference, atol=1e-5, rtol=1e-5)
    assert reference.shape == fns["causal SDPA, no packing mask (floor)"](q, k, v, lengths).shape


def test_lora_1b_profile_reports_a_stall_among_its_steady_windows(capsys):
    """The steady figure is a median over the run's second half, and a window that stalled is
    named among the slowest, not averaged away."""
    logged, elapsed = [], 0.0
    for step in range(5, 65, 5):
        elapsed += 2.5 if step == 45 else 1.0  # steps 40-45 lost 1.5 s
        logged.append({"step": step, "tokens": step * 1000, "elapsed_s": elapsed})
    load_bench("train/lora_1b_profile").print_windows(logged)
    line = capsys.readouterr().out.strip()
    assert line.startswith("steady windows: 5, median 5,000 tokens/s")
    assert "slowest steps 40-45 2,000" in line


def test_train_vs_hf_reports_the_processes_choice_not_the_timing_announcement():
    log = (
        "kubetune: processes: timing 1 x 2 threads against 2 x 1 on a decoder layer (once; the answer is cached)\n"
        "kubetune: processes: 2 x 1 thread each (processes 139.0 ms vs threads 182.4 ms per 1k tokens, 7 rounds)\n"
        "kubetune: kernels: precision=fp32, attention=fp32\n"
    )
    choice = load_bench("train/train_vs_hf").processes_choice(log)
    assert choice.startswith("processes: 2 x 1 thread each")
    assert load_bench("train/train_vs_hf").processes_choice("kubetune: kernels: precision=fp32\n") == ""
