"""Kernel choices are measured on the machine, cached per machine, and overridable."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kubetune.models import kernels
from kubetune.models.attention import per_sample_attention
from kubetune.models.kernels import KernelPlan, ModelShapes
from kubetune.training.run import train_from_recipe

SHAPES = ModelShapes(hidden=64, intermediate=128, heads=4, head_dim=16, sample_lengths=(20, 35, 9))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def timings(bf16: float, fp32: float, attn_half: float = 2.0, attn_fp32: float = 1.0) -> dict[str, float]:
    return {"matmul_bf16": bf16, "matmul_fp32": fp32, "attention_half": attn_half, "attention_fp32": attn_fp32}


def test_bf16_only_where_it_is_clearly_faster():
    assert kernels._plan_from(timings(bf16=40.0, fp32=100.0), "auto", "auto").precision == "bf16"
    assert kernels._plan_from(timings(bf16=95.0, fp32=100.0), "auto", "auto").precision == "fp32"  # within margin
    assert kernels._plan_from(timings(bf16=900.0, fp32=30.0), "auto", "auto").precision == "fp32"


def test_attention_kernel_follows_the_measurement_and_the_recipe_wins():
    native = kernels._plan_from(timings(40.0, 100.0, attn_half=1.0, attn_fp32=3.0), "auto", "auto")
    upcast = kernels._plan_from(timings(40.0, 100.0, attn_half=3.0, attn_fp32=1.0), "auto", "auto")
    assert (native.attention, upcast.attention) == ("native", "fp32")
    forced = kernels._plan_from(timings(40.0, 100.0, attn_half=3.0, attn_fp32=1.0), "auto", "native")
    assert forced.attention == "native"
    assert kernels._plan_from(timings(900.0, 30.0), "bf16", "auto").precision == "bf16"  # explicit precision
    assert "bf16 40.0 ms vs fp32 100.0 ms" in native.describe()


def test_choose_probes_once_then_reads_the_cache(cache):
    first = kernels.choose("auto", "auto", SHAPES, torch.device("cpu"))
    assert not first.cached and first.precision in ("bf16", "fp32") and first.evidence
    files = list(cache.glob("*.json"))
    assert len(files) == 1
    recorded = json.loads(files[0].read_text())
    attention = {"attention_half", "attention_fp32"}
    # attention is timed only where half precision won: an fp32 run has no attention question
    assert set(recorded) == {"matmul_bf16", "matmul_fp32"} | (attention if first.precision == "bf16" else set())
    assert all(v > 0 for v in recorded.values())
    again = kernels.choose("auto", "auto", SHAPES, torch.device("cpu"))
    assert again.cached and (again.precision, again.attention) == (first.precision, first.attention)
    other = ModelShapes(64, 256, 4, 16, (20, 35, 9))  # another model: its own probe
    kernels.choose("auto", "auto", other, torch.device("cpu"))
    assert len(list(cache.glob("*.json"))) == 2


def test_attention_is_probed_later_when_a_recipe_asks_for_half_precision(cache, monkeypatch):
    monkeypatch.setattr(kernels, "probe_matmuls", lambda shapes: {"matmul_bf16": 900.0, "matmul_fp32": 30.0})
    assert kernels.choose("auto", "auto", SHAPES, torch.device("cpu")).precision == "fp32"
    (path,) = cache.glob("*.json")
    assert set(json.loads(path.read_text())) == {"matmul_bf16", "matmul_fp32"}  # no attention timed
    plan = kernels.choose("bf16", "auto", SHAPES, torch.device("cpu"))  # the same machine, bf16 forced
    assert plan.precision == "bf16" and plan.attention in ("native", "fp32") and not plan.cached
    assert set(json.loads(path.read_text())) == {"matmul_bf16", "matmul_fp32", "attention_half", "attention_fp32"}
    assert kernels.choose("bf16", "auto", SHAPES, torch.device("cpu")).cached


def test_nothing_to_probe_when_the_recipe_says(cache):
    assert kernels.choose("fp32", "auto", SHAPES, torch.device("cpu")) == KernelPlan("fp32", "fp32")
    assert kernels.choose("bf16", "native", SHAPES, torch.device("cpu")) == KernelPlan("bf16", "native")
    assert not cache.exists()


def test_a_far_slower_candidate_is_timed_once():
    calls = []

    def slow():
        calls.append(1)
        torch.ones(300, 300) @ torch.ones(300, 300)

    assert kernels._time(slow, rival=1e-6) > 0
    assert len(calls) == 1
    kernels._time(slow)
    assert len(calls) == 1 + 4  # warm-up and three timed calls


def test_both_attention_kernels_compute_the_same_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 16, generator=g) for _ in range(3))
    lengths = [20, 35, 9]
    ref = per_sample_attention(q, k, v, lengths, None, 0.0, upcast=True)
    assert torch.allclose(per_sample_attention(q, k, v, lengths, None, 0.0, upcast=False), ref, atol=1e-6)
    half = per_sample_attention(*(t.bfloat16() for t in (q, k, v)), lengths, None, 0.0, upcast=False)
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), ref, atol=3e-2)


def test_training_with_auto_kernels_logs_its_choice(tmp_path, tiny_overrides, cache, caplog):
    overrides = [o for o in tiny_overrides if not o.startswith("train.precision")]
    caplog.set_level(logging.INFO, logger="kubetune")
    summary = train_from_recipe(
        None,
        [*overrides, "train.precision=auto", "train.max_steps=2", "eval.generate=0", f"output_dir={tmp_path / 'r'}"],
    )
    assert summary is not None and summary.steps == 2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    assert len(lines) == 1 and "precision=" in lines[0] and "ms" in lines[0]
    recorded = (tmp_path / "r" / "recipe.yaml").read_text()
    assert "precision: auto" in recorded  # the run record keeps the recipe as given
