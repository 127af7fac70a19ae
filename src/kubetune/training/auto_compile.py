"""`train.compile=auto`: compile the model's regions only where that pays, decided on the
run's own steps.

Regional compile (kubetune.models.finetune.compile_regions) costs a long first compile on a
machine with a cold inductor cache and about a second once cached, and what it saves per
step depends on the device, the model and the batch: it can be nothing. So a run with `auto`

1. trains its first `WARM_STEPS` steps eagerly and times them (the first is not counted);
2. stays eager where the rest of the run could not pay back a compile, even if compiling
   saved as much as it last did on this machine (`MAX_GAIN` before anything was measured)
   and cost what it last cost here (`FIRST_COST_S` before that);
3. otherwise compiles, then alternates compiled and eager steps (A B B A ...), timed per 1k
   tokens, and keeps the faster by the fair judgement of every start-up choice
   (kubetune.models.measure); the compile's own cost is the first compiled step's excess;
4. caches what it measured, so that the next run's step 2 decides from it.

Rank 0 times and decides; every rank takes its choice at the same step (a collective).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kubetune.models import measure
from kubetune.models.measure import Decision, Question, Race
from kubetune.training.dist import DistEnv, gather_objects

WARM_STEPS = 3  # eager steps timed before deciding; the first pays one-off costs and is not counted
AB_STEPS = 8  # compiled and eager steps alternated after the compile
MAX_GAIN = 0.15  # until measured here: an optimistic bound on the share of a step compiling the regions saves
FIRST_COST_S = 60.0  # until measured here: what a first compile (cold inductor cache) is assumed to cost
MARGIN = 0.97  # compiled steps must be >= 3% faster per token to be kept
AB_ORDER = ("compiled", "eager", "eager", "compiled")
MAX_AGE_S = 7 * 86400  # what a compile cost and saved is re-measured after a week


class AutoCompile:
    """Eager, then (where it may pay) compiled and eager alternately, then the faster."""

    def __init__(self, regions: list[Any], compile_fn: Any, key: dict[str, Any], env: DistEnv) -> None:
        self.regions = regions  # the modules compile_regions compiles (nn.Module.compile, in place)
        self.compile_fn = compile_fn
        self.question = Question("compile", "eager", "compiled", MARGIN, key, unit="per 1k tokens", max_age_s=MAX_AGE_S)
        self.env = env
        self.steps = 0
        self.eager_ms: list[float] = []  # per 1k tokens, the warm eager steps
        self.eager_s: list[float] = []  # per step, the same steps
        self.samples: dict[str, list[float]] = {"eager": [], "compiled": []}
        self.compiled_impls: list[Any] = []
        self.compile_s = 0.0
        self.mode = "eager"
        self.done = False

    def before_step(self) -> None:
        """Set compiled or eager for the step about to run."""
        i = self.steps - WARM_STEPS - 1  # index among the A/B steps (the compile step is -1)
        if not self.done and self.compiled_impls and 0 <= i < AB_STEPS:
            self._use(AB_ORDER[i % len(AB_ORDER)])

    def after_step(self, seconds: float, tokens: int, remaining_steps: int) -> str | None:
        """Record a step; returns a log line when a decision was made."""
        self.steps += 1
        if self.done:
            return None
        per_k = seconds * 1e6 / max(tokens, 1)  # ms per 1k tokens
        if self.steps <= WARM_STEPS:
            if self.steps > 1:
                self.eager_ms.append(per_k)
                self.eager_s.append(seconds)
            return self._maybe_compile(remaining_steps) if self.steps == WARM_STEPS else None
        if self.steps == WARM_STEPS + 1:  # the step that compiled
            self.compile_s = max(0.0, seconds - statistics.median(self.eager_ms) * tokens / 1e6)
            return None
        self.samples[self.mode].append(per_k)
        return self._decide() if self.steps == WARM_STEPS + 1 + AB_STEPS else None

    def _maybe_compile(self, remaining_steps: int) -> str | None:
        worth = None
        if self.env.is_main:
            worth = self._worth_trying(remaining_steps)
        try_it, why = gather_objects(worth, self.env)[0]
        if not try_it:
            self.done = True
            return f"compile: eager ({why})"
        self.compile_fn()
        self.compiled_impls = [m._compiled_call_impl for m in self.regions]
        self.mode = "compiled"
        return f"compile: trying regional compile ({why})"

    def _worth_trying(self, remaining_steps: int) -> tuple[bool, str]:
        if not self.eager_s:
            return False, "too few steps to time"
        gain, cost, source = MAX_GAIN, FIRST_COST_S, "assumed: not measured here yet"
        known = measure.read_decision(self.question)
        if known is not None and time.time() - known.decided_at < MAX_AGE_S:
            gain = max(0.0, 1 - known.medians["compiled"] / known.medians["eager"])
            cost, source = float(known.extra.get("compile_s", cost)), "as measured here before"
        saving = remaining_steps * statistics.median(self.eager_s) * gain
        text = (
            f"the remaining {remaining_steps} steps could save ~{saving:.0f} s at {gain:.0%}, "
            f"a compile costs ~{cost:.0f} s, {source}"
        )
        return saving > cost, text

    def _decide(self) -> str:
        outcome = self._judge() if self.env.is_main else None
        choice, why = gather_objects(outcome, self.env)[0]
        self._use(choice)
        self.done = True
        return f"compile: {choice} ({why}; the compile took ~{self.compile_s:.0f} s)"

    def _judge(self) -> tuple[str, str]:
        """Rank 0: the faster of the A/B steps, cached with what the compile cost."""
        race = Race({k: tuple(v) for k, v in self.samples.items()})
        verdict = measure.judge(self.question, race)
        decision = Decision(
            "compile",
            verdict.choice,
            {k: race.median(k) for k in race.samples},
            {k: race.quartiles(k) for k in race.samples},
            race.rounds,
            unit=self.question.unit,
            settled=verdict.settled,
            decided_at=time.time(),
            extra={"compile_s": self.compile_s},
        )
        measure.write_decision(self.question, decision)
        return verdict.choice, decision.describe()

    def _use(self, mode: str) -> None:
        for module, impl in zip(self.regions, self.compiled_impls):
            # nn.Module.compile() keeps the compiled callable here; None runs the module eagerly
            module._compiled_call_impl = impl if mode == "compiled" else None
        self.mode = mode
