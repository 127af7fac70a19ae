"""`kubetune serve`: start the HTTP server at once (so /health answers and /ready says
"loading"), load the model and adapters, then admit requests.

On SIGTERM (a pod being stopped) the server stops admitting (/ready 503, new requests 503),
lets the requests in flight finish up to `drain_seconds`, aborts what is left, and exits 0.
A second SIGTERM or Ctrl-C stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from kubetune.contracts.engine import Limits
from kubetune.contracts.serving import DEFAULT_PORT, DRAIN_TIMEOUT_S, LOCAL_HOST, Adapter
from kubetune.serve.http.api import create_app
from kubetune.serve.http.auth import describe
from kubetune.serve.http.state import ApiOptions, ServerState

log = logging.getLogger("kubetune.serve")


@dataclass(frozen=True)
class ServeOptions:
    target: str
    adapters: tuple[Adapter, ...] = ()
    host: str = LOCAL_HOST
    port: int = DEFAULT_PORT
    dtype: str = "auto"  # auto | bf16 | fp32
    limits: Limits = field(default_factory=Limits)
    kv_cache_bytes: int | None = None
    threads: int | None = None
    # the pod's terminationGracePeriodSeconds is rendered from the same constant (k8s/serve/deployment.py)
    drain_seconds: float = float(DRAIN_TIMEOUT_S)
    served_model_names: tuple[str, ...] = ()  # the base model's names (default: its recipe's)
    api: ApiOptions = field(default_factory=ApiOptions)  # the HTTP side's: body limit, API keys, chat template
    trust_remote_code: bool = False  # an HF model directory's own code (a run's recipe decides for the run)
    max_loras: int | None = None  # adapters in the layers at once; None: every adapter, fused at start
    adapter_registry: str | None = None  # a registry file (contracts.adapters): its versions and aliases


def serve(opts: ServeOptions) -> None:
    from kubetune.serve.native.build import check_dtype
    from kubetune.serve.native.models import plan_served

    # A bad target or adapter fails here, in one line, before the server starts; so does an HF model
    # directory's config (its own code without --trust-remote-code), a local read, unlike a run's base.
    plan = plan_served(opts.target, list(opts.adapters), opts.trust_remote_code)
    if plan.main.recipe is None:
        plan.base_config()
    if opts.adapter_registry:
        _check_registry(plan, opts.adapter_registry)
    check_dtype(opts.dtype)
    _say(describe(opts.api.api_keys))
    state = ServerState(opts.api)
    app = create_app(state)
    config = uvicorn.Config(
        app, host=opts.host, port=opts.port, log_level="warning", access_log=False, timeout_graceful_shutdown=5
    )
    server = DrainingServer(config, state, opts.drain_seconds)
    loader = threading.Thread(target=_load_into, args=(state, opts, server), name="kubetune-engine", daemon=True)
    loader.start()
    server.run()
    if state.engine is not None:
        state.engine.stop()
    if server.load_error is not None:
        raise server.load_error


def _check_registry(plan: Any, registry_path: str) -> None:
    from pathlib import Path

    from kubetune.contracts.adapters import read_registry
    from kubetune.serve.native.models import check_registry

    path = Path(registry_path)
    if not path.exists():  # a ModelServer's fresh volume: the first adapter export writes the file
        _say(f"--adapter-registry {path}: no registry yet; serving the base until an adapter is registered")
        return
    check_registry(plan, read_registry(path), path.parent, f"--adapter-registry {path}")


def _load_into(state: ServerState, opts: ServeOptions, server: Any) -> None:
    """Load the model, then run the engine on this thread until the server stops."""
    try:
        from kubetune.serve.native.build import build_engine

        t0 = time.monotonic()
        served, engine, metrics, summary = build_engine(opts)
    except BaseException as e:  # a bad target or adapter: report it and stop the server
        server.load_error = e
        server.should_exit = True
        return
    state.served, state.engine, state.metrics = served, engine, metrics
    _say(f"{summary} | loaded in {time.monotonic() - t0:.1f} s; ready on http://{opts.host}:{opts.port}")
    engine.run()  # on this thread, the one that loaded the model (see Engine.run)


def _say(text: str) -> None:
    import sys

    print(f"kubetune: {text}", file=sys.stderr, flush=True)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, with SIGTERM meaning: drain first, then exit."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_seconds: float) -> None:
        super().__init__(config)
        self.state, self.drain_seconds = state, drain_seconds
        self.load_error: BaseException | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        state = self.state
        if sig == signal.SIGTERM and not state.draining and state.engine is not None and not state.failed:
            state.draining = True
            _say(f"SIGTERM: draining ({state.engine.in_flight} in flight, at most {self.drain_seconds:.0f} s)")
            threading.Thread(target=self._drain, daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        engine = self.state.engine
        deadline = time.monotonic() + self.drain_seconds
        while engine.in_flight and engine.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        left = engine.in_flight
        _say(f"drained; {left} request(s) cut at the deadline" if left else "drained; exiting")
        self.should_exit = True
