"""The serving benchmarks' shared parts: the machine's CPU (and the dtype rule every arm
follows), the flashcard prompts, a closed-loop OpenAI streaming client and its level
statistics, and a server process under test (its own session, log and peak RSS). The CLI
that runs arms of these is bench/serve/serve_load.py; one-off harnesses in
bench/experiments/ import the same parts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common.processes import TreePeakRss
from kubetune.netutil import NotReadyError, wait_ready

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO.parent / "shared" / "data" / "medical_flashcards" / "test.jsonl"
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
REASON = re.compile(r"(Error|error|ERROR|Exception|Illegal instruction|not supported|unsupported|Traceback)")


# --- the machine ------------------------------------------------------------------------------


def machine() -> dict:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = set(fields.get("Flags", "").split())
    info["cpu_model"] = fields.get("Model name", platform.processor() or "unknown")
    info["cores_per_socket"] = fields.get("Core(s) per socket")
    info["threads_per_core"] = fields.get("Thread(s) per core")
    info["flags"] = {f: f in flags for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")}
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def choose_dtype(flags: dict[str, bool], requested: str) -> tuple[str, str]:
    if requested != "auto":
        return requested, "requested with --dtype"
    have = [f for f in BF16_FLAGS if flags.get(f)]
    if have:
        return "bf16", f"the CPU has {', '.join(have)}"
    return "fp32", f"the CPU has none of {', '.join(BF16_FLAGS)} (bf16 would be emulated)"


def the_machine(requested_dtype: str) -> tuple[dict, str, str]:
    """The machine, the dtype every arm runs (and why), after one line on stdout naming the CPU."""
    mach = machine()
    dtype, why = choose_dtype(mach["flags"], requested_dtype)
    print(f"machine: {mach['cpu_model']}, {mach.get('cpus_usable')} CPUs; flags {mach['flags']}", flush=True)
    return mach, dtype, why


def model_or_default(model: str | None) -> str:
    """`--model` as given, else the embedded default's converted directory (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model:
        return model
    from kubetune.models.load import resolve_model

    return str(resolve_model("smollm2-135m-instruct"))


# --- the prompts ------------------------------------------------------------------------------


def load_prompts(path: Path) -> list[str]:
    """The questions of a flashcards jsonl file (`input`, else `instruction`), in file order."""
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            question = row.get("input") or row.get("instruction")
            if question:
                out.append(str(question))
    if not out:
        raise SystemExit(f"{path}: no questions found (expected an `input` field per line)")
    return out


# --- one request and one level of load --------------------------------------------------------


@dataclass
class Result:
    ok: bool
    model: str
    ttft: float | None = None
    e2e: float | None = None
    out_tokens: int = 0
    prompt_tokens: int = 0
    usage_reported: bool = False
    error: str | None = None


async def stream_chat(
    client: Any, base_url: str, model: str, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None
) -> Result:
    """One streaming chat request; TTFT is taken at the first chunk that carries content."""
    body = {
        **(extra or {}),
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    res = Result(ok=False, model=model)
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                # parse every chunk until the first content, then only those that can carry usage
                if ttft is not None and '"usage"' not in data and '"error"' not in data:
                    chunks += 1
                    continue
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = str(obj["error"])[:200]
                    return res
                for choice in obj.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                usage = obj.get("usage")
                if usage:
                    res.out_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.usage_reported = True
    except Exception as e:  # a dropped connection or a timeout is a failed request, not a crashed bench
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2e = time.perf_counter() - t0
    res.ttft = ttft if ttft is not None else res.e2e
    if not res.usage_reported:
        res.out_tokens = chunks  # a server without include_usage: content chunks, about one token each
    res.ok = True
    return res


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between the closest ranks."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    out_tokens = sum(r.out_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "requests": len(ok),
        "errors": len(errors),
        "first_errors": sorted({e for e in errors if e})[:3],
        "wall_s": round(wall, 3),
        "generated_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "usage_reported": all(r.usage_reported for r in ok) if ok else None,
        "tokens_per_s": out_tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "mean_out_tokens": out_tokens / len(ok) if ok else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "e2e_p50_s": percentile(e2es, 50),
        "e2e_p99_s": percentile(e2es, 99),
    }


async def run_level(
    base_url: str,
    models: list[str],
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    requests_per_client: int | None = None,
    duration: float | None = None,
    extra: dict[str, Any] | None = None,
) -> dict:
    """C closed-loop clients. Each sends a request, waits for its last byte, sends the next:
    `requests_per_client` each, or until `duration` seconds have passed (the requests in flight
    then still finish and count). Prompts are taken in file order and `model` round-robin over
    `models`, from one counter shared by the clients, so every arm sees the same requests."""
    import httpx

    counter = iter(range(10**9))
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(connect=30.0, read=3600.0, write=60.0, pool=3600.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        start = time.perf_counter()

        async def client_loop() -> None:
            done = 0
            while True:
                if requests_per_client is not None and done >= requests_per_client:
                    return
                if duration is not None and time.perf_counter() - start >= duration:
                    return
                k = next(counter)
                model, prompt = models[k % len(models)], prompts[k % len(prompts)]
                r = await stream_chat(client, base_url, model, prompt, max_tokens, extra)
                results.append(r)
                done += 1

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    out = {"concurrency": concurrency, "models": models, **summarize(results, wall)}
    out["samples"] = {  # per request, in completion order: for other percentiles or plots later
        "model": [r.model for r in results],
        "ttft_s": [None if r.ttft is None else round(r.ttft, 4) for r in results],
        "e2e_s": [None if r.e2e is None else round(r.e2e, 4) for r in results],
        "out_tokens": [r.out_tokens for r in results],
    }
    if len(models) > 1:
        out["per_model"] = {
            m: summarize([r for r in results if r.model == m], wall)["tokens_per_s"] for m in models
        }  # each model's share of the level's generated tokens/s
    return out


# --- a server under test ----------------------------------------------------------------------


class Server:
    """A server process (its own session, so its whole tree can be stopped), its log, and the
    peak RSS of its process tree sampled in a thread."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, port: int) -> None:
        self.name, self.argv, self.log_path, self.port = name, argv, log_path, port
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        self.started = time.perf_counter()
        self._rss = TreePeakRss(self.proc.pid)

    @property
    def peak_rss(self) -> int:
        return self._rss.peak

    @property
    def phase_peak(self) -> int:
        return self._rss.phase_peak

    def reset_phase_peak(self) -> None:
        self._rss.reset_phase()

    def log_tail(self, n: int = 40) -> list[str]:
        if not self._log.closed:
            self._log.flush()
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line for line in lines if line.strip()][-n:]

    def reason(self) -> str:
        """The line of the log that says why the server is not up: the last error-looking line."""
        tail = self.log_tail(200)
        boxes = [i for i, line in enumerate(tail) if line.lstrip().startswith("╭─ Error")]
        if boxes:  # a typer/rich error box (kubetune's CLI): its content, on one line
            body = []
            for line in tail[boxes[-1] + 1 :]:
                if line.lstrip().startswith("╰"):
                    break
                body.append(line.strip().strip("│").strip())
            return " ".join(b for b in body if b)[:300]
        for line in reversed(tail):
            if REASON.search(line) and not line.lstrip().startswith("File "):
                return line.strip()[:300]
        return tail[-1].strip()[:300] if tail else "no output"

    def wait_ready(self, path: str, timeout: float) -> str | None:
        """None once `path` answers 200; otherwise why not (the process exited, or the timeout),
        with the reason line of its log rather than the whole tail: the report prints it."""
        try:
            wait_ready(self.base_url + path, timeout, process=self.proc, interval=0.5)
        except NotReadyError:
            if self.proc.poll() is not None:
                return f"the server exited with code {self.proc.returncode}: {self.reason()}"
            return f"not ready on {path} after {timeout:.0f} s: {self.reason()}"
        return None

    def models(self) -> list[dict]:
        import httpx

        r = httpx.get(self.base_url + "/v1/models", timeout=10.0, trust_env=False)
        r.raise_for_status()
        return list(r.json().get("data") or [])

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM to the server's process group (the server and its own children only), SIGKILL after `grace` s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._rss.stop()
        self._log.close()
        return self.proc.returncode
