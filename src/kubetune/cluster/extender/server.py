"""Run the extender app under uvicorn: in the foreground (CLI) or in a thread (tests, bench)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kubetune.netutil import free_port

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def tune_for_large_bodies() -> list[str]:
    """Process settings for 20 MB request bodies; returns what was changed (for the log).

    - glibc serves allocations above 128 KiB with fresh mmap()s and returns them on free,
      so every 20 MB body is page-faulted in again (BENCHMARKS.md, section 4). Raising
      the mmap and trim thresholds keeps that memory in the heap between requests.
    - gc.freeze(): the imported modules (fastapi, pydantic) are moved out of the collector's
      view, so the full collections the per-node objects trigger stay short (p99 spikes).
    """
    import ctypes
    import gc

    done = []
    try:
        libc = ctypes.CDLL("libc.so.6")
        if libc.mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024) and libc.mallopt(M_TRIM_THRESHOLD, 512 * 1024 * 1024):
            done.append("malloc: mmap threshold 32 MiB, trim threshold 512 MiB")
    except (OSError, AttributeError):
        pass  # not glibc (musl, macOS): correct anyway, only slower on huge bodies
    gc.collect()
    gc.freeze()
    done.append("gc: startup objects frozen")
    return done


def serve_forever(app, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


@contextmanager
def running(app, host: str = "127.0.0.1", port: int | None = None, timeout: float = 10.0) -> Iterator[str]:
    """Serve `app` on a loopback port in a background thread; yields the base URL; always stops."""
    import uvicorn

    port = port or free_port(host)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off")
    )
    thread = threading.Thread(target=server.run, name="extender-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the extender did not start on {host}:{port}")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
