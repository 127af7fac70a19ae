"""Microbenchmark timing by the fair rules: every arm warmed, then rounds whose order
alternates (A B, B A, ...), so that a machine whose speed drifts weighs on every arm alike;
the caller takes medians."""

from __future__ import annotations

import time
from collections.abc import Callable


def time_interleaved(arms: dict[str, Callable[[], object]], rounds: int, calls: int = 3) -> dict[str, list[float]]:
    """Seconds per call of each arm, one figure per round (the mean of `calls` calls)."""
    for fn in arms.values():
        fn(), fn()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        order = list(arms.items()) if r % 2 == 0 else list(reversed(arms.items()))
        for name, fn in order:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls)
    return times
