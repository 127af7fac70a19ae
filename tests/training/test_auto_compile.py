"""`train.compile=auto`: compile only where the run can pay it back, keep it only if faster.

The step times are given (the policy is a function of them); the regions are real modules
compiled with torch's `eager` backend, so switching between compiled and eager is real."""

from __future__ import annotations

import json

import pytest
import torch

from kubetune.models import measure
from kubetune.training import auto_compile
from kubetune.training.auto_compile import AB_STEPS, WARM_STEPS, AutoCompile
from kubetune.training.dist import DistEnv

TOKENS = 4000


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


class Regions:
    def __init__(self) -> None:
        self.modules = [torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)]
        self.compiles = 0

    def compile(self) -> None:
        self.compiles += 1
        for m in self.modules:
            m.compile(backend="eager")

    def compiled_now(self) -> list[bool]:
        return [m._compiled_call_impl is not None for m in self.modules]


def policy(regions: Regions) -> AutoCompile:
    return AutoCompile(regions.modules, regions.compile, {"model": "test"}, DistEnv())


def run(p: AutoCompile, total: int, eager_s: float, compiled_s: float, compile_s: float = 5.0) -> list[str]:
    """Drive `total` steps: eager steps take eager_s, compiled ones compiled_s, the compiling one more."""
    lines = []
    for step in range(1, total + 1):
        p.before_step()
        seconds = eager_s if p.mode == "eager" else compiled_s
        if step == WARM_STEPS + 1 and p.mode == "compiled":
            seconds += compile_s
        if step == 1:
            seconds *= 3  # one-off costs of a first step: never counted
        line = p.after_step(seconds, TOKENS, total - step)
        lines += [line] if line else []
    return lines


def test_a_short_run_stays_eager_without_compiling(cache):
    regions = Regions()
    lines = run(policy(regions), total=10, eager_s=2.0, compiled_s=1.0)
    assert regions.compiles == 0 and not any(regions.compiled_now())
    assert len(lines) == 1 and lines[0].startswith("compile: eager (the remaining 7 steps could save ~2 s")


def test_a_long_run_compiles_and_keeps_it_when_compiled_steps_are_faster(cache):
    regions = Regions()
    p = policy(regions)
    lines = run(p, total=400, eager_s=2.0, compiled_s=1.5, compile_s=30.0)
    assert regions.compiles == 1 and all(regions.compiled_now())
    assert lines[0].startswith("compile: trying regional compile")
    assert lines[-1].startswith("compile: compiled (compiled 375.0 ms") and "the compile took ~30 s" in lines[-1]
    excess = 30.0 + 1.5 - 2.0  # the compiling step over an eager one
    assert len(p.samples["compiled"]) == len(p.samples["eager"]) == AB_STEPS // 2
    (path,) = cache.glob("compile-*.json")
    assert measure.Decision.from_json(json.loads(path.read_text())).extra["compile_s"] == pytest.approx(excess)


def test_compiled_steps_that_are_not_faster_are_dropped_and_not_tried_again(cache):
    regions = Regions()
    lines = run(policy(regions), total=400, eager_s=2.0, compiled_s=2.05)
    assert regions.compiles == 1 and not any(regions.compiled_now())  # eager again
    assert lines[-1].startswith("compile: eager")
    again = Regions()
    lines = run(policy(again), total=2000, eager_s=2.0, compiled_s=1.0)  # the same machine: it measured 0%
    assert again.compiles == 0 and "at 0%" in lines[0] and "as measured here before" in lines[0]


def test_the_alternating_steps_run_compiled_and_eager_in_turn(cache):
    regions = Regions()
    p = policy(regions)
    modes = []
    for step in range(1, WARM_STEPS + 2 + AB_STEPS):
        p.before_step()
        modes.append(p.mode)
        assert all(regions.compiled_now()) == (p.mode == "compiled")
        p.after_step(1.0 if step > 1 else 3.0, TOKENS, 1000)
    ab = modes[WARM_STEPS + 1 :]
    assert modes[:WARM_STEPS] == ["eager"] * WARM_STEPS and modes[WARM_STEPS] == "compiled"
    assert ab == list(auto_compile.AB_ORDER * (AB_STEPS // len(auto_compile.AB_ORDER)))
    x = torch.randn(3, 2)
    assert torch.equal(
        regions.modules[0](x), torch.nn.functional.linear(x, regions.modules[0].weight, regions.modules[0].bias)
    )
