"""Health: probes push changes into a queue; the plugin drains it and resends the list.

The probe is the backend's (`Discovery.probe()`): device node present and driver bound for
Gaudi, NVML critical XID events for NVIDIA, the `health:` field for an inventory. The
monitor only polls it and reports *changes*, so a flapping card produces one event per
flip and an idle node produces none.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from kubetune.cluster.devices.discovery import Discovery

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthEvent:
    device_id: str
    health: str  # HEALTHY | UNHEALTHY


class HealthMonitor:
    """Polls `discovery.probe()` every `interval` seconds in a daemon thread."""

    def __init__(self, discovery: Discovery, events: queue.Queue[HealthEvent], interval: float = 5.0):
        self.discovery = discovery
        self.events = events
        self.interval = interval
        self._last: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> list[HealthEvent]:
        """Probe now; push and return the changes since the last probe."""
        try:
            now = self.discovery.probe()
        except Exception:  # a probe bug must not kill the loop; the cards keep their last state
            log.exception("health probe of %s failed", self.discovery.resource)
            return []
        changes = [HealthEvent(dev, health) for dev, health in now.items() if self._last.get(dev) != health]
        self._last = dict(now)
        for event in changes:
            self.events.put(event)
        return changes

    def start(self, baseline: dict[str, str]) -> None:
        """Report changes relative to `baseline` (the health the first list was sent with)."""
        self._last = dict(baseline)
        self._thread = threading.Thread(target=self._run, name=f"health-{self.discovery.resource}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for event in self.check_once():
                log.warning("%s: device %s is now %s", self.discovery.resource, event.device_id, event.health)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
