"""Loading and unloading LoRA adapters while serving, with vLLM's routes and switch.

`POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter`
`{"lora_name"}` exist only when the server is started with `--allow-runtime-adapters` or with
vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; otherwise they are 404, as in vLLM. Declared
adapters (`--adapter`) are the default because every replica of a Deployment then serves the
same set and nothing is lost on restart; adapters loaded here live in one process only.

The files are read and checked off the engine's thread; the weights are stacked into the
layers on it, between two steps (`Engine.call_between_steps`), so no forward sees half an
adapter. A name already served is a 400; a path that is not a LoRA adapter of this base is a
400 naming `lora_path`. Unloading takes the name away at once (new requests for it get 404);
requests already accepted finish with the adapter, whose weights go at a later load or unload
that finds no request in flight (see engine/models.py, `ServedSet.retire_adapter`).

Versions and aliases: a name `NAME@vN` is version N of NAME; the first version loaded makes
`NAME` an alias routing to it. `POST /v1/lora_aliases` `{"alias": "NAME", "weights":
{"NAME@v1": 90, "NAME@v2": 10}}` sets the weights (a canary, a rollout, a rollback with 0);
`GET /v1/lora_aliases` lists them. A version an alias still routes to cannot be unloaded (400
naming the alias). Aliases live on the event loop, where requests resolve them.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from kubetune.contracts.engine import AdapterRequestError, AdmissionError
from kubetune.serve.http.protocol import STRICT, Text
from kubetune.serve.http.state import ApiError, ServerState, served_or_503

VLLM_SWITCH = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ENGINE_CALL_TIMEOUT_S = 120.0  # the engine runs the call between two steps; a step is far shorter


class LoadLoraAdapter(BaseModel):
    model_config = STRICT

    lora_name: Text = Field(min_length=1)
    lora_path: Text = Field(min_length=1)


class UnloadLoraAdapter(BaseModel):
    model_config = STRICT

    lora_name: Text = Field(min_length=1)


class LoraAlias(BaseModel):
    """`NAME` -> its versions by weight (a weight of 0: listed, sent nothing)."""

    model_config = STRICT

    alias: Text = Field(min_length=1)
    weights: dict[str, int] = Field(min_length=1)


def runtime_adapters_allowed(flag: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """The flag, or vLLM's switch (vLLM reads "true" and "1", in any case)."""
    return flag or environ.get(VLLM_SWITCH, "").strip().lower() in ("true", "1")


def add_adapter_routes(app: FastAPI, state: ServerState) -> None:
    if not runtime_adapters_allowed(state.options.allow_runtime_adapters):
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapter) -> PlainTextResponse:
        served = served_or_503(state)
        _check_inside_root(body.lora_path, state.options.adapter_root)
        try:
            entry, weights = await asyncio.to_thread(served.read_adapter, body.lora_name, body.lora_path)
        except AdapterRequestError as e:
            raise ApiError(e.status, e.message, e.param) from None
        engine = state.engine
        await _on_engine(state, lambda: served.add_adapter(entry, weights, engine.in_flight == 0))
        served.alias_of_new_version(body.lora_name)
        _say(f"adapter {body.lora_name} loaded from {body.lora_path}")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapter) -> PlainTextResponse:
        served = served_or_503(state)
        engine = state.engine
        _refused(lambda: served.check_unroutable(body.lora_name))
        await _on_engine(state, lambda: served.retire_adapter(body.lora_name, engine.in_flight == 0))
        served.forget_routes_to(body.lora_name)
        _say(f"adapter {body.lora_name} unloaded")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/lora_aliases")
    async def set_lora_alias(body: LoraAlias) -> dict[str, Any]:
        served = served_or_503(state)
        _refused(lambda: served.set_alias(body.alias, body.weights))
        return {"alias": body.alias, "weights": served.aliases[body.alias].weights}

    @app.get("/v1/lora_aliases")
    async def list_lora_aliases() -> dict[str, Any]:
        served = served_or_503(state)
        return {"object": "list", "data": [{"alias": n, "weights": a.weights} for n, a in served.aliases.items()]}


def _check_inside_root(lora_path: str, root: str | None) -> None:
    """--adapter-root: a path that resolves (symbolic links and `..` followed) outside it is refused,
    so a client with the key still reads nothing but the adapter volume."""
    if root is None:
        return
    if not os.path.realpath(lora_path).startswith(os.path.join(os.path.realpath(root), "")):
        raise ApiError(
            400, f"lora_path {lora_path}: outside the server's adapter root {root} (--adapter-root)", "lora_path"
        )


def _refused(fn: Callable[[], Any]) -> Any:
    """`fn` on the event loop (aliases change where requests resolve them); its refusal as the API's error."""
    try:
        return fn()
    except AdapterRequestError as e:
        raise ApiError(e.status, e.message, e.param) from None


def _say(text: str) -> None:
    """A line in the server's log: which adapters came and went (GRPO's trainer pushes one per step)."""
    print(f"kubetune: {text}", file=sys.stderr, flush=True)


async def _on_engine(state: ServerState, fn: Callable[[], Any]) -> Any:
    """`fn` on the engine's thread between two steps; its refusal as the API's error."""
    future = state.engine.call_between_steps(fn)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), ENGINE_CALL_TIMEOUT_S)
    except (AdapterRequestError, AdmissionError) as e:
        raise ApiError(e.status, e.message, e.param) from None
    except TimeoutError:
        raise ApiError(503, state.failed or "the engine did not take the adapter change in time; retry") from None
