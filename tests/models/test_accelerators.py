"""Accelerator paths at their boundary, with the device layer faked where no device exists."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from kubetune.models import kernels
from kubetune.models.finetune import compile_regions
from kubetune.training.launch import local_processes

SHAPES = kernels.ModelShapes(64, 128, 4, 16, (10, 20))


@pytest.fixture
def fake_gaudi(monkeypatch):
    """Habana's PyTorch bridge as kubetune sees it: `habana_frameworks.torch.hpu` with 4 cards."""
    hpu = types.ModuleType("habana_frameworks.torch.hpu")
    hpu.is_available = lambda: True
    hpu.device_count = lambda: 4
    for name, module in (
        ("habana_frameworks", types.ModuleType("habana_frameworks")),
        ("habana_frameworks.torch", types.ModuleType("habana_frameworks.torch")),
        ("habana_frameworks.torch.hpu", hpu),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_nproc_auto_counts_gaudi_cards(fake_gaudi):
    assert local_processes("auto") == 4


def test_nproc_auto_without_accelerators_is_one_per_core(monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)  # import fails: no bridge
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert 1 <= local_processes("auto") <= len(os.sched_getaffinity(0))  # never more than this process may use


class _Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.compiled_with: dict = {}

    def compile(self, **kwargs):  # what nn.Module.compile would receive
        self.compiled_with = kwargs


def _fake_lm(layers: int = 2):
    layer = [
        types.SimpleNamespace(mlp=_Recorder(), input_layernorm=_Recorder(), post_attention_layernorm=_Recorder())
        for _ in range(layers)
    ]
    return types.SimpleNamespace(model=types.SimpleNamespace(layers=layer)), layer


def test_compile_on_gaudi_uses_habanas_backend():
    lm, layers = _fake_lm()
    compile_regions(lm, backend="hpu_backend")
    assert all(r.compiled_with.get("backend") == "hpu_backend" for layer in layers for r in vars(layer).values())


def test_compile_with_tensor_parallel_leaves_the_mlp_eager():
    lm, layers = _fake_lm()
    compile_regions(lm, mlp=False)
    assert all(layer.mlp.compiled_with == {} and layer.input_layernorm.compiled_with for layer in layers)


@pytest.mark.parametrize(("bf16", "expected"), [(True, "bf16"), (False, "fp16")])
def test_cuda_runs_attention_in_the_training_dtype(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    plan = kernels.choose("auto", "auto", SHAPES, torch.device("cuda", 0))
    assert (plan.precision, plan.attention) == (expected, "native")  # fused SDPA kernels, no fp32 upcast


def test_gaudi_trains_in_bf16_with_native_attention():
    plan = kernels.choose("auto", "auto", SHAPES, torch.device("hpu"))
    assert (plan.precision, plan.attention) == ("bf16", "native")
    assert kernels.choose("fp32", "fp32", SHAPES, torch.device("hpu")).precision == "fp32"  # the recipe wins
