"""bench/run.py reads the figures of each headline benchmark from what the benchmark prints:
here from the outputs recorded in bench/results/ and lines as the scripts print them, so a
summary line that changes shape fails here rather than as a "figures not found" row after an
hour of benchmarks."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import load_bench
from tests.kit.paths import REPO

run = load_bench("run")
RESULTS = REPO / "bench" / "results"


def test_train_vs_hf_speed_and_memory_rows():
    speed, memory = run.read_train_vs_hf((RESULTS / "train_vs_hf-icelake-run2.txt").read_text(), RESULTS)
    assert speed.ratio == pytest.approx(float(speed.kubetune.split()[0]) / float(speed.baseline.split()[0]), rel=0.01)
    assert speed.ratio > 1 and memory.ratio < 1  # what that run recorded: faster, less memory than HF fp32


def test_serve_row_is_the_highest_level_both_arms_ran(tmp_path):
    shutil.copy(RESULTS / "serve-load-run5-kubetune-vllm.json", tmp_path / "serve-load.json")
    (row,) = run.read_serve_load("", tmp_path)
    assert row.benchmark == "serving tokens/s at 64 clients" and row.baseline.endswith("(vllm)")


def test_monitor_row():
    (row,) = run.read_monitor((RESULTS / "monitor-overhead-tiny.txt").read_text(), RESULTS)
    assert (row.kubetune, row.baseline) == ("4359.1", "4095.9 (metrics off)")


def test_cluster_and_structured_rows_from_their_summary_lines():
    placement = (
        "offered load 0.90 of 2,048 cards, 200 jobs (gangs of 2-16 workers x 1/2/4/8 cards)\n"
        "kubetune vs default: jobs placed 193 vs 165 (x1.170); on the 163 jobs both placed, cross-leaf pairs "
        "593 vs 6049 (x0.098, 90.2% fewer); stranded free cards x0.19; whole free nodes x2.33\n"
    )
    assert run.read_placement(placement, RESULTS)[0].ratio == pytest.approx(593 / 6049)
    extender = "worst p99 at 1000 nodes: 68.9 ms (target < 100 ms: met)\n"
    assert run.read_extender(extender, RESULTS)[0].ratio == pytest.approx(0.689)
    structured = (
        "mask + advance per token: median 0.258 ms\n"
        "decode step, SmolLM2-135M, 1 sequence: median 47.00 ms (mask + advance = 0.5% of it)\n"
    )
    assert run.read_structured_cost(structured, RESULTS)[0].ratio == pytest.approx(0.258 / 47)


def test_a_missing_summary_line_is_named():
    with pytest.raises(ValueError, match="worst p99"):
        run.read_extender("the extender did not start\n", RESULTS)


def test_table_has_one_row_per_figure_and_the_cpu():
    rows = [run.Row("a", "2", "1 (x)", 2.0), run.Row("b", "-", "failed", None)]
    lines = run.table(rows, "Some CPU").splitlines()
    assert lines[2] == "| a | 2 | 1 (x) | 2 | Some CPU |" and lines[3].startswith("| b | - | failed | - |")


def test_only_refuses_an_unknown_benchmark():
    with pytest.raises(SystemExit):
        run.parse_args(["--headline", "--only", "train,nope"])


def test_the_training_guard_flags_a_drop_of_more_than_15_percent_for_the_same_cpu_class(tmp_path):
    record = {"avx2": {"quick": {"ratio": 2.0, "date": "2026-12-02", "commit": "abc1234"}}}

    def guard(ratio, cpu="avx2", settings="quick"):
        rows = [run.Row("training tokens/s (LoRA, SmolLM2-135M)", "1", "1", ratio), run.Row("x", "1", "1", 9.0)]
        return run.training_guard(rows, cpu, settings, record)

    assert guard(1.69).startswith("DROP") and "-16%" in guard(1.69)
    assert guard(1.71).startswith("ok")  # -14.5%: within the guard
    assert guard(2.4).startswith("ok")
    assert "none recorded" in guard(1.0, cpu="amx") and "none recorded" in guard(1.0, settings="full")
    path = tmp_path / "record.json"
    run.record_training([run.Row("training tokens/s (LoRA)", "200 (fp32)", "80 (HF fp32)", 2.5)], "avx2", "full", path)
    kept = json.loads(path.read_text())["avx2"]["full"]
    assert kept["ratio"] == 2.5 and kept["kubetune"] == "200 (fp32)" and kept["commit"]


def test_cpu_classes_follow_the_fastest_matmul_unit():
    flags = dict.fromkeys(("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"), False)
    assert run.cpu_class({**flags, "avx2": True}) == "avx2"
    assert run.cpu_class({**flags, "avx2": True, "avx512f": True}) == "avx512"
    assert run.cpu_class({**flags, "avx512f": True, "avx512_bf16": True}) == "avx512-bf16"
    assert run.cpu_class({**flags, "amx_bf16": True, "avx512_bf16": True}) == "amx"
