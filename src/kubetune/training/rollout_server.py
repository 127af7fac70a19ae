"""GRPO's rollouts from a separate `kubetune serve` (finetune.rl.rollout = server): TRL's server
mode, on kubetune's own engine in another process (a pod of its own on a cluster).

The trainer keeps the weights; the server samples. Before a generation is sampled from weights
the server has not seen (after an optimizer step; the first time), rank 0 writes the policy's
adapter in PEFT format to `<run>/rollout-adapters/v<N>` (N: the optimizer steps the weights have
taken), loads it as `<name>-step<N>` through the server's runtime-adapter route
(`--allow-runtime-adapters`) and unloads the version before it, whose last request has ended;
the other processes wait on a barrier. The push is lazy: steps that reuse one generation
(steps_per_generation, num_iterations) push nothing.

Each completion is one `POST /v1/completions` with the prompt's token ids, its own seed (the
same `stream_seed` LocalRollouts gives it) and `return_tokens_as_token_ids`, so the answer
carries the exact ids sampled, EOS included, with their log-probabilities; the requests go out
together (the server batches them continuously). An answer's `model` must be the version asked
for: anything else means the server sampled from another policy, and the run stops.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kubetune.contracts.serving import ROLLOUT_WAIT_ENV
from kubetune.errors import UserError
from kubetune.export.weights import save_trained
from kubetune.training.dist import DistEnv, barrier
from kubetune.training.rollout import Completion, RolloutSettings, stream_seed

ADAPTERS_DIR = "rollout-adapters"
CONCURRENT_REQUESTS = 64  # in flight at once; the server queues and batches them
CONNECT_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 1800.0  # one completion of a loaded server can wait behind a whole generation
BUSY_RETRY_S = 0.5  # a 429 (the server's queue is full) is retried after this
READY_POLL_S = 2.0  # waiting for a server that is still loading (ROLLOUT_WAIT_ENV)


class RolloutServerError(UserError):
    """The rollout server cannot be used, or stopped answering, or answered for another policy."""


def server_command(base_model: str) -> str:
    return f"kubetune serve {base_model} --allow-runtime-adapters"


class ServerRollouts:
    """Samples completions with the `kubetune serve` at `url`, from the policy's adapter as it
    stands after the optimizer steps GRPOTraining reports (`policy_at`)."""

    def __init__(self, url: str, name: str, model: Any, base_model: str, run_dir: Path, env: DistEnv) -> None:
        self.url, self.name, self.model, self.base_model = url.rstrip("/"), name, model, base_model
        self.adapters, self.env = run_dir / ADAPTERS_DIR, env
        timeout = httpx.Timeout(ANSWER_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=CONCURRENT_REQUESTS, max_keepalive_connections=CONCURRENT_REQUESTS)
        # never through a proxy: the server is on this host or in the cluster
        self.http = httpx.Client(base_url=self.url, timeout=timeout, limits=limits, trust_env=False)
        self.version = 0  # the optimizer steps the policy's weights have taken
        self.served: int | None = None  # the version the server holds
        self._check_server()
        if env.is_main:
            print(
                f"kubetune: rollouts from {self.url} (finetune.rl.rollout=server); the policy's adapter is pushed "
                f"through {self.adapters}/ as {name}-step<optimizer steps>",
                file=sys.stderr,
                flush=True,
            )

    # --- the policy's versions ---------------------------------------------------------------
    def policy_at(self, version: int) -> None:
        """The weights now stand after `version` optimizer steps; pushed before the next sample."""
        self.version = version

    def model_name(self, version: int) -> str:
        return f"{self.name}-step{version}"

    def _push(self) -> None:
        """The current adapter onto the server (rank 0), the previous one off; every rank waits."""
        if self.env.is_main:
            path = self.adapters / f"v{self.version}"
            save_trained(self.model, None, None, "lora", path)
            self._load(self.model_name(self.version), path)
            if self.served is not None and self.served != self.version:
                self._post("/v1/unload_lora_adapter", {"lora_name": self.model_name(self.served)})
                shutil.rmtree(self.adapters / f"v{self.served}", ignore_errors=True)  # the server read it at load
        barrier(self.env)
        self.served = self.version

    def _load(self, lora_name: str, path: Path) -> None:
        body = {"lora_name": lora_name, "lora_path": str(path)}
        r = self._post("/v1/load_lora_adapter", body)
        if r.status_code == 400 and "already served" in r.text:  # left by an earlier run (a resume): replace it
            self._post("/v1/unload_lora_adapter", {"lora_name": lora_name})
            r = self._post("/v1/load_lora_adapter", body)
        if r.status_code != 200:
            raise self._refused("loading the policy's adapter", r)

    # --- sampling ------------------------------------------------------------------------------
    def sample(
        self, prompts: list[tuple[int, list[int]]], group: int, settings: RolloutSettings, generation: int
    ) -> list[Completion]:
        """`group` completions of each (prompt index, prompt tokens), in prompt order."""
        if self.served != self.version:
            self._push()
        model = self.model_name(self.version)
        jobs = [(index, ids, member) for index, ids in prompts for member in range(group)]
        if not jobs:
            return []

        def one(job: tuple[int, list[int], int]) -> Completion:
            index, ids, member = job
            return self._complete(model, index, ids, settings, stream_seed(settings.seed, generation, index, member))

        with ThreadPoolExecutor(min(len(jobs), CONCURRENT_REQUESTS)) as pool:
            return list(pool.map(one, jobs))

    def _complete(self, model: str, index: int, ids: list[int], settings: RolloutSettings, seed: int) -> Completion:
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": settings.max_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
            "seed": seed,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        r = self._post("/v1/completions", body)
        if r.status_code != 200:
            raise self._refused(f"sampling from {model}", r)
        answer = r.json()
        if answer.get("model") != model:
            raise RolloutServerError(
                f"finetune.rl.server_url {self.url} answered with model {answer.get('model')!r} where {model!r} "
                "was asked for: another policy was sampled; give this run a server of its own"
            )
        return completion_of(answer["choices"][0], index, ids, settings.max_tokens)

    # --- HTTP ----------------------------------------------------------------------------------
    def _post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        """The server's answer to `body` at `route` (a full queue's 429 retried); gone: the run stops."""
        while True:
            try:
                r = self.http.post(route, json=body)
            except httpx.HTTPError as e:
                raise RolloutServerError(
                    f"finetune.rl.server_url {self.url} stopped answering ({type(e).__name__}: {e}); the "
                    "checkpoints written so far are kept: start the server again "
                    f"(`{server_command(self.base_model)}`) and rerun the same command to resume"
                ) from None
            if r.status_code != 429:
                return r
            time.sleep(BUSY_RETRY_S)  # the server's queue is full: it takes the request once a slot frees

    def _refused(self, what: str, r: httpx.Response) -> RolloutServerError:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:300]
        return RolloutServerError(f"finetune.rl.server_url {self.url}: {what} failed ({r.status_code}: {message})")

    def _check_server(self) -> None:
        """Before step 1: a kubetune serve answers at the URL, with its runtime-adapter routes."""
        self._wait_ready(float(os.environ.get(ROLLOUT_WAIT_ENV) or 0))
        try:
            probe = self.http.post("/v1/unload_lora_adapter", json={"lora_name": f"{self.name}@probe"})
        except httpx.HTTPError as e:
            problem = type(e).__name__
            raise RolloutServerError(f"finetune.rl.server_url {self.url} stopped answering ({problem})") from None
        routed = probe.status_code == 404 and _error_param(probe) == "lora_name"  # "no such adapter": the route is on
        if not routed:
            raise RolloutServerError(
                f"finetune.rl.server_url {self.url} does not load adapters at run time; start it with "
                f"`{server_command(self.base_model)}`"
            )

    def _wait_ready(self, wait_s: float) -> None:
        """Until the server lists its models (503 while it loads), for at most `wait_s` seconds."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                r = self.http.get("/v1/models", timeout=CONNECT_TIMEOUT_S)
                if r.status_code == 200:
                    return
                problem = f"GET /v1/models answered {r.status_code}"
            except httpx.HTTPError as e:
                problem = type(e).__name__
            if time.monotonic() >= deadline:
                waited = f" in {wait_s:.0f} s" if wait_s else ""
                raise RolloutServerError(
                    f"finetune.rl.server_url {self.url}: no kubetune serve answers there{waited} ({problem}); start "
                    f"one with `{server_command(self.base_model)}` or set finetune.rl.server_url to its address"
                )
            time.sleep(READY_POLL_S)

    def close(self) -> None:
        self.http.close()


def _error_param(r: httpx.Response) -> str | None:
    try:
        param = r.json()["error"]["param"]
        return str(param) if param is not None else None
    except (ValueError, KeyError, TypeError):
        return None


def completion_of(choice: dict[str, Any], index: int, prompt: list[int], max_tokens: int) -> Completion:
    """A completions answer's choice (with return_tokens_as_token_ids) as a Completion."""
    logprobs = choice["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    values = [float(v) for v in logprobs["token_logprobs"]]
    truncated = choice["finish_reason"] == "length" and len(tokens) >= max_tokens
    return Completion(index, prompt, tokens, values, truncated)
