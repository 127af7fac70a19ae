"""`WaitForDriver`: a hardware backend that answers "no cards" until the node has its driver."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kubetune.cluster.devices.discovery import AllocateSpec, Card, Discovery, DriverAbsent
from kubetune.errors import UserError

log = logging.getLogger(__name__)


class WaitForDriver:
    """A hardware backend on a node that may have no driver: zero cards until it has one.

    The vendor plugins behave this way (NVIDIA's with `failOnInitError: false`): a DaemonSet
    pod on a node without the driver keeps running and advertises nothing, rather than exit
    and crash-loop. Opening the backend is tried again at most every `retry` seconds (from the
    health loop and the plugin's card check); a backend that opens but finds no card counts as
    absent too (the driver may still be probing), so the cards are picked up once they appear.
    A `UserError` that is not `DriverAbsent` (e.g. nvidia-ml-py missing from the image) is the
    image's fault and is raised at once.
    """

    def __init__(self, resource: str, open_backend: Callable[[], Discovery], retry: float = 5.0):
        self.resource = resource
        self.retry = retry
        self._open = open_backend
        self._backend: Discovery | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self.absent_reason: str | None = None
        self._backend_now()

    @property
    def present(self) -> bool:
        return self._backend is not None

    def _backend_now(self) -> Discovery | None:
        with self._lock:
            if self._backend is None and time.monotonic() >= self._next_try:
                self._next_try = time.monotonic() + self.retry
                self._backend = self._try_open()
            return self._backend

    def _try_open(self) -> Discovery | None:
        try:
            backend = self._open()
            cards = backend.devices()  # sysfs scans here, NVML when opened
        except DriverAbsent as e:
            self._absent(str(e))
            return None
        if not cards:
            backend.close()
            self._absent(f"the driver is there but no {self.resource} card is (yet)")
            return None
        if self.absent_reason is not None:
            log.warning("%s: driver found, %d cards: advertising them", self.resource, len(cards))
        self.absent_reason = None
        return backend

    def _absent(self, reason: str) -> None:
        if reason != self.absent_reason:  # one line per new state, not one per retry
            log.warning(
                "%s: no cards to advertise: %s. Advertising 0 cards and looking again every %g s "
                "(a node without these cards should not run this DaemonSet: render-components selects "
                "nodes by their Node Feature Discovery PCI labels, --node-selector to change it)",
                self.resource,
                reason,
                self.retry,
            )
        self.absent_reason = reason

    def devices(self) -> list[Card]:
        backend = self._backend_now()
        return backend.devices() if backend else []

    def probe(self) -> dict[str, str]:
        backend = self._backend_now()
        return backend.probe() if backend else {}

    def allocate_spec(self, cards: list[Card]) -> AllocateSpec:
        if self._backend is None:  # the plugin refuses unknown ids first: with no cards, every id is unknown
            raise UserError(f"{self.resource}: no cards on this node")
        return self._backend.allocate_spec(cards)

    def free_memory_mib(self) -> dict[str, int]:
        return self._backend.free_memory_mib() if self._backend is not None else {}

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
