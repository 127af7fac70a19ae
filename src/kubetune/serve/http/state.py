"""What the HTTP routes share: the server's state (the engine and what it serves, once
loaded), the API's error, and the check every model route starts with. The runtime adapter
routes (adapter_routes.py) read these as the API's own routes (api.py) do."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kubetune.contracts.serving import DEFAULT_MAX_BODY_BYTES


class Mailbox:
    """Engine events to the requests' queues on the event loop, with at most one wake-up of the
    loop per engine step (instead of one per token of every running sequence)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[Any], event: Any) -> None:
        with self._lock:
            self._items.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, event in items:
            queue.put_nowait(event)


@dataclass(frozen=True)
class ApiOptions:
    """What `kubetune serve`'s options set of the HTTP side (server.ServeOptions.api)."""

    default_max_tokens: int = 512  # a request's max_tokens when it sends none (capped by the context)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_keys: tuple[str, ...] = ()  # none: every route is open (kubetune.serve.http.auth)
    chat_template: str | None = None  # --chat-template: for every model, instead of the tokenizer's
    trust_request_chat_template: bool = False  # a request's own `chat_template` (Jinja from the network)
    allow_runtime_adapters: bool = False  # --allow-runtime-adapters: the routes of adapter_routes.py
    adapter_root: str | None = None  # --adapter-root: runtime loads only from inside this directory


@dataclass
class ServerState:
    """What the routes need; `served` and `engine` are None until the model has loaded."""

    options: ApiOptions = field(default_factory=ApiOptions)
    served: Any = None
    engine: Any = None
    metrics: Any = None
    draining: bool = False
    mailbox: Mailbox | None = None
    grammars: Any = None  # the engine side's grammars (ServedSet.grammars), built on first use (they take a while)
    tokens: Any = None  # completions.Tokens: ids to text for log-probabilities
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def failed(self) -> str | None:
        """Why the engine can no longer answer (its loop died), None while it can."""
        error = getattr(self.engine, "error", None)
        return None if error is None else f"the engine failed ({error!r}); the server must be restarted"

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and self.failed is None


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def served_or_503(state: ServerState) -> Any:
    if state.failed:
        raise ApiError(503, state.failed)
    if not state.ready:
        raise ApiError(
            503,
            "the server is draining" if state.draining else "the model is still loading; retry shortly",
            headers={"Retry-After": "1"},
        )
    return state.served
