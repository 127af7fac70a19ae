"""Loopback helpers shared by the product (the extender's test server), the tests and bench/:
a free port, and waiting until a started server answers. Stdlib only, so any layer may use it."""

from __future__ import annotations

import functools
import http.client
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

LOG_TAIL_CHARS = 3000  # enough for a traceback's last frames and the error line


class NotReadyError(RuntimeError):
    """A server did not become ready: its process exited (code and log tail), or the timeout passed."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now: the OS picks it, the socket is closed before it is used."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET `url` answers 200. Never through a proxy: these servers are on loopback."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (OSError, http.client.HTTPException):  # refused, reset, timed out, 4xx/5xx (URLError is an OSError)
        return False


def http_answers(url: str, timeout: float = 1.0) -> bool:
    """True when anything answers at `url` over HTTP, whatever the status (the server is up)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, http.client.HTTPException):
        return False


def tcp_accepts(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when a TCP connection to host:port is accepted (servers that do not speak HTTP)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def wait_ready(
    ready: str | Callable[[], bool],
    timeout: float,
    process: subprocess.Popen | None = None,
    log: Path | None = None,
    interval: float = 0.1,
    name: str = "",
) -> None:
    """Poll every `interval` s until `ready` (a URL that must answer 200, or a function) is true.

    Fails fast with NotReadyError when `process` exits meanwhile, carrying its exit code and the
    tail of its output (`log`, or what the process's stdout/stderr pipe holds), so a server that
    crashes at start-up is reported by its own error instead of by a timeout. `name` says what
    is awaited in the error (a URL names itself).
    """
    check = functools.partial(http_ok, ready) if isinstance(ready, str) else ready
    what = name or (ready if isinstance(ready, str) else getattr(ready, "__name__", "the server"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = output_tail(process, log)
            raise NotReadyError(f"exited with code {process.returncode} before {what} was ready: {tail}")
        if check():
            return
        time.sleep(interval)
    tail = output_tail(process, log)
    raise NotReadyError(f"{what} not ready in {timeout:g} s{': ' + tail if tail else ''}")


def output_tail(process: subprocess.Popen | None, log: Path | None = None) -> str:
    """The last LOG_TAIL_CHARS of `log`, or of the process's piped output once it has exited."""
    if log is not None:
        try:
            return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""
    if process is None or process.poll() is None:
        return ""  # reading a live process's pipe would block until it exits
    pipe = process.stdout or process.stderr
    text = pipe.read() if pipe is not None else ""
    return (text.decode(errors="replace") if isinstance(text, bytes) else text)[-LOG_TAIL_CHARS:]
