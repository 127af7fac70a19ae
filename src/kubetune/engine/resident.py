"""More adapters than fit: at most `max_loras` of the registered adapters are resident in the
model's layers, the others wait in memory, read and checked (vLLM's `--max-loras` over its
`--max-cpu-loras` cache, with kubetune's LRU choice).

The engine asks `ensure` before it admits a sequence (on its own thread, between two forwards):
an adapter that is resident is marked used; one that is not is stacked into the layers, taking
the place of the least recently used resident adapter that no running sequence uses; when all
of them are in use the sequence waits in the queue, and the engine admits others meanwhile.
Every adapter keeps its index while registered, so the prefix cache's K/V (keyed by index)
stay right across an eviction and a reload. Adapters are held in `LateAdapters` (engine.lora):
a column set per adapter that can come and go, unlike the fused start-up weight.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubetune.contracts.engine import BASE
from kubetune.engine.lora import AdapterWeights, LoraBatch, add_late_adapter, check_fits, drop_late_adapters


class ResidencyMetrics(Protocol):
    def adapter_loaded(self, seconds: float) -> None: ...
    def adapter_evicted(self) -> None: ...
    def adapters_resident(self, count: int) -> None: ...


class NoResidencyMetrics:
    def adapter_loaded(self, seconds: float) -> None:
        pass

    def adapter_evicted(self) -> None:
        pass

    def adapters_resident(self, count: int) -> None:
        pass


@dataclass
class ResidentAdapters:
    lm: Any
    batch: LoraBatch
    max_loras: int
    metrics: ResidencyMetrics = field(default_factory=NoResidencyMetrics)
    known: dict[int, AdapterWeights] = field(default_factory=dict)  # index -> weights, registered
    resident: OrderedDict[int, None] = field(default_factory=OrderedDict)  # least recently used first
    retired: set[int] = field(default_factory=set)  # unregistered, kept while a request still uses them

    def register(self, index: int, weights: AdapterWeights) -> None:
        """Know adapter `index` (its layers checked against the model now, not at its first
        request); stacked at once while there is room."""
        check_fits(self.lm, weights)
        self.known[index] = weights
        if len(self.resident) < self.max_loras:
            self._load(index)

    def retire(self, index: int) -> None:
        """No new request may name it; it goes once no request in flight uses it (`sweep`)."""
        if index in self.known:
            self.retired.add(index)

    def sweep(self, in_use: set[int]) -> None:
        """Forget the retired adapters no request uses any more (call between forwards)."""
        for index in sorted(self.retired - in_use):
            self.retired.discard(index)
            self.known.pop(index, None)
            if index in self.resident:
                self._evict(index, counted=False)

    def ensure(self, index: int, busy: set[int]) -> bool:
        """Make `index` resident for a sequence about to run; False while every resident
        adapter is `busy` (has a running sequence), when the sequence must wait."""
        if index == BASE or index not in self.known:  # the base, or an adapter fused at start
            return True
        if index in self.resident:
            self.resident.move_to_end(index)
            return True
        if len(self.resident) >= self.max_loras:
            idle = next((i for i in self.resident if i not in busy), None)
            if idle is None:
                return False
            self._evict(idle, counted=True)
        self._load(index)
        return True

    def _load(self, index: int) -> None:
        start = time.monotonic()
        add_late_adapter(self.lm, self.batch, self.known[index], index)
        self.resident[index] = None
        self.metrics.adapter_loaded(time.monotonic() - start)
        self.metrics.adapters_resident(len(self.resident))

    def _evict(self, index: int, counted: bool) -> None:
        drop_late_adapters(self.lm, {index})
        del self.resident[index]
        if counted:
            self.metrics.adapter_evicted()
        self.metrics.adapters_resident(len(self.resident))
