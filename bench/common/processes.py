"""The resident memory of a process under test together with its descendants (a launcher and
its workers, a server and its engine), sampled in a thread: what `Server` (serving.py) and the
training side-by-sides report as peak RSS, one definition for both."""

from __future__ import annotations

import contextlib
import threading


class TreePeakRss:
    """The peak of the summed RSS of process `pid` and all its descendants, sampled every
    `interval` s until the process exits or `stop()`; `phase_peak` restarts at `reset_phase()`.
    A sum of RSS counts pages that processes share (libraries, a mapped checkpoint) once per
    process: it is an upper bound of what the tree holds."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0  # bytes
        self.phase_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                        total += p.memory_info().rss
            except psutil.NoSuchProcess:
                return
            self.peak = max(self.peak, total)
            self.phase_peak = max(self.phase_peak, total)
            self._stop.wait(self.interval)

    def reset_phase(self) -> None:
        self.phase_peak = 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
