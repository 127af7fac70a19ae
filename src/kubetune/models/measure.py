"""Decisions by measurement that one slow call cannot fool, and the cache that keeps them.

Some choices (compute precision, attention kernel, processes or threads) can only be made by
timing the candidates on the machine at hand, and that machine is usually shared. The rules
here make such a timing fair:

- every candidate is warmed first (oneDNN creates its primitives and JITs AMX kernels on a
  first call; the first touch of fresh memory faults pages in);
- candidates are timed interleaved, in alternating order (A B B A ...), so that a busy
  neighbour or a frequency change lands on both of them;
- each sample is long enough to be more than a scheduler tick (`MIN_SAMPLE_S`), and the
  decision is on medians; the spread (quartiles) is kept with it;
- a candidate may be dropped early only on warmed timings, two of them, both far slower, and
  never the one the facts predict (the CPU flags' choice, else the default): two stalls of a
  busy machine must not remove the safe answer without it being timed;
- where the medians' spreads overlap, or the answer contradicts what the CPU's flags
  predict, more rounds are timed before deciding;
- a cached decision is confirmed by a short round at the next start, and measured again
  (and rewritten) when that round clearly contradicts it.

`race` times, `judge` decides (a pure function of the timings, tested with an injected
clock), `settle` combines them with the cache. The questions themselves live with the code
they concern: `kubetune.models.kernels` (precision, attention) and
`kubetune.training.processes` (one process with N threads, or N processes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubetune.fsutil import atomic_write_json, cache_root

Clock = Callable[[], float]
Workload = Callable[[int], object]  # runs `calls` units of a candidate's work

MIN_SAMPLE_S = 0.02  # one sample of the fastest candidate lasts at least this: longer than a scheduler tick
ROUNDS = 7  # interleaved samples per candidate for a first decision
EXTRA_ROUNDS = 4  # added while the evidence is unclear ...
MAX_ROUNDS = 23  # ... up to this many; then the medians decide
CONFIRM_ROUNDS = 3  # the check of a cached decision at a start
HOPELESS = 4.0  # two warmed calls this many times slower than the best: stop timing the candidate
CACHE_VERSION = 2  # bump when a workload changes: old cached decisions are then ignored


@dataclass(frozen=True)
class Race:
    """Milliseconds per unit of work of each candidate, one sample per interleaved round.
    A hopeless candidate keeps only its two warmed calls."""

    samples: dict[str, tuple[float, ...]]
    hopeless: frozenset[str] = frozenset()

    @property
    def rounds(self) -> int:
        return max((len(v) for k, v in self.samples.items() if k not in self.hopeless), default=0)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def quartiles(self, name: str) -> tuple[float, float]:
        s = sorted(self.samples[name])
        if len(s) < 4:
            return s[0], s[-1]
        q = statistics.quantiles(s, n=4, method="inclusive")
        return q[0], q[2]

    def __add__(self, other: Race) -> Race:
        names = self.samples.keys() | other.samples.keys()
        merged = {n: self.samples.get(n, ()) + other.samples.get(n, ()) for n in names}
        return Race(merged, self.hopeless | other.hopeless)


def race(
    workloads: Mapping[str, Workload],
    rounds: int,
    clock: Clock = time.perf_counter,
    units: Mapping[str, float] | None = None,
    keep: frozenset[str] = frozenset(),
) -> Race:
    """Warm every candidate, drop the hopeless ones on warmed timings, then time the rest in
    `rounds` interleaved rounds. `units[name]`: units of work one call of that candidate does
    (N processes working at once do N times the work), so that samples compare work per second.
    `keep`: candidates timed in full however slow their warm calls were."""
    units = units or {}
    names = list(workloads)
    for name in names:
        workloads[name](1)  # cold: primitive creation, JIT, page faults; never timed
    warm: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(2):
        for name in names:
            warm[name].append(_timed(workloads[name], 1, clock))
    fastest_call = min(min(v) for v in warm.values())
    per_unit = {name: [t / units.get(name, 1) for t in warm[name]] for name in names}
    best_unit = min(min(v) for v in per_unit.values())
    hopeless = frozenset(n for n in names if n not in keep and min(per_unit[n]) > HOPELESS * best_unit)
    live = [n for n in names if n not in hopeless]
    calls = max(1, math.ceil(MIN_SAMPLE_S * 1e3 / max(fastest_call, 1e-6)))
    samples: dict[str, list[float]] = {n: [] for n in live}
    for r in range(rounds):
        for name in live if r % 2 == 0 else reversed(live):
            samples[name].append(_timed(workloads[name], calls, clock) / (calls * units.get(name, 1)))
    out = {n: tuple(samples[n]) for n in live} | {n: tuple(per_unit[n]) for n in hopeless}
    return Race(out, hopeless)


def _timed(workload: Workload, calls: int, clock: Clock) -> float:
    t0 = clock()
    workload(calls)
    return (clock() - t0) * 1e3


@dataclass(frozen=True)
class Question:
    """One choice between a default and a challenger that must beat it by `margin`.

    `prior` is what facts other than timing predict (a CPU's bf16 flags), None when they
    predict nothing; timings that contradict it are measured longer before they are believed."""

    name: str  # what is decided: precision, attention, processes
    default: str
    challenger: str
    margin: float  # the challenger wins when its median <= margin x the default's
    key: Mapping[str, Any]  # everything the answer depends on besides the machine
    prior: str | None = None
    unit: str = "per call"  # how the evidence names one unit of work
    # None: a cached decision is confirmed by a short round at every start. A number: the
    # cache is trusted this many seconds, then measured again (for questions whose
    # candidates cost seconds to set up, such as starting processes).
    max_age_s: float | None = None


@dataclass(frozen=True)
class Verdict:
    choice: str
    settled: bool  # clear: spreads apart and (where there is a prior) agreeing with it


def judge(q: Question, r: Race) -> Verdict:
    """The choice the timings support, and whether they support it clearly."""
    if q.challenger in r.hopeless or q.default in r.hopeless:
        return Verdict(q.default if q.challenger in r.hopeless else q.challenger, settled=True)
    choice = q.challenger if r.median(q.challenger) <= q.margin * r.median(q.default) else q.default
    (lo_c, hi_c), (lo_d, hi_d) = r.quartiles(q.challenger), r.quartiles(q.default)
    apart = hi_c < lo_d or hi_d < lo_c
    return Verdict(choice, settled=apart and (q.prior is None or choice == q.prior))


@dataclass(frozen=True)
class Decision:
    """A choice with the evidence behind it, as cached and as logged."""

    question: str
    choice: str
    medians: dict[str, float]
    quartiles: dict[str, tuple[float, float]]
    rounds: int
    hopeless: tuple[str, ...] = ()
    prior: str | None = None
    unit: str = "per call"
    settled: bool = True
    decided_at: float = 0.0  # time.time() of the measurement
    cached: bool = False  # read from the cache (and confirmed) at this start
    remeasured: bool = False  # the cache said otherwise and the confirming round contradicted it
    confirmed_by: dict[str, float] = field(default_factory=dict)  # the confirming round's medians
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """e.g. `bf16 7.3 ms [7.1-7.6] vs fp32 17.8 ms [17.2-18.5] per matmul pair, 7 rounds`."""
        parts = []
        for name in sorted(self.medians, key=lambda n: n != self.choice):
            lo, hi = self.quartiles[name]
            gone = ", dropped after 2 warm calls" if name in self.hopeless else ""
            parts.append(f"{name} {self.medians[name]:.1f} ms [{lo:.1f}-{hi:.1f}{gone}]")
        text = f"{' vs '.join(parts)} {self.unit}, {self.rounds} rounds"
        if self.prior is not None and self.choice != self.prior:
            text += f", against the CPU flags ({self.prior} expected)"
        if not self.settled:
            text += ", spreads overlap"
        if self.remeasured:
            text += ", re-measured: the cached choice was contradicted"
        elif self.cached:
            now = " vs ".join(f"{n} {m:.1f}" for n, m in sorted(self.confirmed_by.items(), key=lambda p: p[1]))
            text += f", cached; confirmed now: {now} ms" if now else f", cached {_age(self.decided_at)} ago"
        return text

    def as_json(self) -> dict[str, Any]:
        transient = ("cached", "remeasured", "confirmed_by")  # about this start, not the decision
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in transient}
        d["quartiles"] = {k: list(v) for k, v in self.quartiles.items()}
        d["hopeless"] = list(self.hopeless)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Decision:
        return cls(
            question=str(d["question"]),
            choice=str(d["choice"]),
            medians={k: float(v) for k, v in d["medians"].items()},
            quartiles={k: (float(v[0]), float(v[1])) for k, v in d["quartiles"].items()},
            rounds=int(d["rounds"]),
            hopeless=tuple(d.get("hopeless", ())),
            prior=d.get("prior"),
            unit=str(d.get("unit", "per call")),
            settled=bool(d.get("settled", True)),
            decided_at=float(d.get("decided_at", 0.0)),
            extra=dict(d.get("extra", {})),
        )


def decide(q: Question, workloads: Mapping[str, Workload], clock: Clock = time.perf_counter, **kw: Any) -> Decision:
    """Measure until the evidence is clear (or MAX_ROUNDS), then decide on medians."""
    r = race(workloads, ROUNDS, clock, keep=expected(q), **kw)
    verdict = judge(q, r)
    while not verdict.settled and r.rounds < MAX_ROUNDS:
        r = r + race(workloads, EXTRA_ROUNDS, clock, keep=expected(q), **kw)
        verdict = judge(q, r)
    return _decision(q, r, verdict)


def expected(q: Question) -> frozenset[str]:
    """The candidate the facts predict: never dropped on two warm calls."""
    return frozenset({q.prior or q.default})


def _decision(q: Question, r: Race, verdict: Verdict) -> Decision:
    return Decision(
        question=q.name,
        choice=verdict.choice,
        medians={n: r.median(n) for n in r.samples},
        quartiles={n: r.quartiles(n) for n in r.samples},
        rounds=r.rounds,
        hopeless=tuple(sorted(r.hopeless)),
        prior=q.prior,
        unit=q.unit,
        settled=verdict.settled,
        decided_at=time.time(),
    )


def settle(
    q: Question,
    workloads: Callable[[], Mapping[str, Workload]],
    clock: Clock = time.perf_counter,
    remeasure: bool = False,
    **kw: Any,
) -> Decision:
    """The cached decision if a short confirming round agrees, else a new measurement
    (written to the cache). `workloads` builds the candidates (they allocate, so only
    when timing)."""
    cached = None if remeasure else read_decision(q)
    if cached is not None and q.max_age_s is not None:
        if time.time() - cached.decided_at < q.max_age_s:
            return _with(cached, cached=True)
        cached = None  # expired: measured again, as if new
    built = workloads()
    if cached is not None:
        check = race(built, CONFIRM_ROUNDS, clock, keep=expected(q) | {cached.choice}, **kw)
        verdict = judge(q, check)
        contradicted = verdict.choice != cached.choice and _clear(q, check)
        if not contradicted:
            return _with(cached, cached=True, confirmed_by={n: check.median(n) for n in check.samples})
    decision = decide(q, built, clock, **kw)
    write_decision(q, decision)
    return _with(decision, remeasured=cached is not None)


def _age(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s / 86400:.1f} d" if s >= 86400 else f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


def _clear(q: Question, r: Race) -> bool:
    """Spreads apart (the prior is not asked: the confirming round is short)."""
    return judge(dataclasses.replace(q, prior=None), r).settled


def _with(d: Decision, **changes: Any) -> Decision:
    return dataclasses.replace(d, **changes)


# --- the cache --------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What every decision depends on besides its own question: the CPU, its ISA level as
    torch sees it, and the torch version."""
    import torch

    return {"cpu": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    return frozenset(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))


def cache_root_kernels() -> Path:
    return cache_root() / "kernels"


def cache_file(q: Question) -> Path:
    parts = {"version": CACHE_VERSION, "question": q.name, "machine": machine(), "key": dict(q.key)}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_root_kernels() / f"{q.name}-{digest}.json"


def read_decision(q: Question) -> Decision | None:
    try:
        return Decision.from_json(json.loads(cache_file(q).read_text()))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None  # absent, or written by another version: measure again


def write_decision(q: Question, d: Decision) -> None:
    path = cache_file(q)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {**d.as_json(), "key": dict(q.key), "machine": machine()})
