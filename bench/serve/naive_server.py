"""The serving baseline most tutorials show: FastAPI + HF `model.generate`, one request at a time.

An OpenAI-compatible `POST /v1/chat/completions` (streaming as server-sent events through
transformers' TextIteratorStreamer, and not), `GET /v1/models`, `GET /ready` (503 until the
model is loaded) and `GET /health`, over one HF model directory and optionally one PEFT
adapter (served under its own name, with `parent` = the base). Requests are served strictly
one after another (an asyncio lock around each generation): there is no batching, which is
the point of this arm in bench/serve/serve_load.py.

    .venv/bin/python bench/serve/naive_server.py --model DIR [--adapter NAME=RUN_OR_ADAPTER_DIR] [--port 8000]

The dtype is bf16 where the CPU has bf16 units (AMX or AVX-512-BF16 in /proc/cpuinfo) and fp32
otherwise (`--dtype auto`, the rule bench/serve/serve_load.py applies to every arm); the choice is
printed at start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the (string) annotation of `chat` here

BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def choose_dtype(requested: str = "auto") -> tuple[str, str]:
    """(`bf16`|`fp32`, why): bf16 only where the CPU has bf16 units; never fp16 on CPU."""
    if requested != "auto":
        return requested, "requested"
    have = [f for f in BF16_FLAGS if f in cpu_flags()]
    if have:
        return "bf16", f"CPU has {', '.join(have)}"
    return "fp32", f"CPU has none of {', '.join(BF16_FLAGS)}"


def adapter_dir(path: str) -> Path:
    """A PEFT adapter directory, or a kubetune LoRA run directory (its adapter/ subdirectory)."""
    p = Path(path)
    if (p / "adapter_config.json").is_file():
        return p
    if (p / "adapter" / "adapter_config.json").is_file():
        return p / "adapter"
    raise SystemExit(f"--adapter {path}: neither a PEFT adapter directory nor a kubetune LoRA run directory")


def error(status: int, message: str, kind: str = "invalid_request_error") -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


class Engine:
    """The model behind a lock: one `generate` at a time."""

    def __init__(self, model_dir: str, dtype: str, served_name: str, adapter: tuple[str, str] | None) -> None:
        self.model_dir, self.dtype, self.served_name = model_dir, dtype, served_name
        self.adapter_name = adapter[0] if adapter else None
        self.adapter_path = adapter[1] if adapter else None
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.lock = asyncio.Lock()
        self.model: Any = None
        self.tokenizer: Any = None
        self.created = int(time.time())

    def load(self) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            torch_dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float32
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch_dtype)
            if self.adapter_path:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, self.adapter_path)
            self.model = model.eval()
            self.ready.set()
            print(f"naive_server: ready ({self.model_dir}, dtype={self.dtype}, threads={torch.get_num_threads()})")
        except Exception as e:  # reported on /ready and in the log; the process stays up for inspection
            self.load_error = f"{type(e).__name__}: {e}"
            print(f"naive_server: loading failed: {self.load_error}")

    def models(self) -> list[str]:
        return [self.served_name] + ([self.adapter_name] if self.adapter_name else [])

    def prepare(self, body: dict) -> tuple[Any, dict]:
        """(input ids, generate kwargs) of a chat request; ValueError for a bad one."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
        kwargs: dict[str, Any] = {"max_new_tokens": int(max_tokens), "pad_token_id": self.tokenizer.eos_token_id}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p") or 1.0))
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return ids, kwargs

    def generate(self, ids: Any, kwargs: dict, use_adapter: bool, seed: int | None) -> Any:
        """Blocking: the generated ids (without the prompt)."""
        import torch

        if seed is not None:
            torch.manual_seed(int(seed))
        off = (
            self.model.disable_adapter()
            if self.adapter_path and not use_adapter
            else contextlib.nullcontext()  # the base without the adapter, or the adapter
        )
        with torch.inference_mode(), off:
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, ids.shape[1] :]

    def finish_reason(self, new_ids: Any, max_new: int) -> str:
        eos = self.tokenizer.eos_token_id
        stopped = (len(new_ids) > 0 and int(new_ids[-1]) == eos) or len(new_ids) < max_new
        return "stop" if stopped else "length"


def build_app(engine: Engine) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        threading.Thread(target=engine.load, daemon=True).start()  # /ready says 503 until it is done
        yield

    app = FastAPI(title="naive HF generate server", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Any:
        if engine.ready.is_set():
            return {"status": "ready"}
        return JSONResponse({"status": engine.load_error or "loading"}, 503)

    @app.get("/v1/models")
    async def models() -> dict:
        data = [{"id": engine.served_name, "object": "model", "created": engine.created, "owned_by": "naive"}]
        if engine.adapter_name:
            data.append(
                {
                    "id": engine.adapter_name,
                    "object": "model",
                    "created": engine.created,
                    "owned_by": "naive",
                    "parent": engine.served_name,
                }
            )
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        if not engine.ready.is_set():
            return error(503, "the model is not loaded yet", "service_unavailable")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error(400, "the body is not JSON")
        name = body.get("model") or engine.served_name
        if name not in engine.models():
            return error(404, f"The model `{name}` does not exist.", "NotFoundError")
        try:
            ids, kwargs = engine.prepare(body)
        except (ValueError, TypeError) as e:
            return error(400, str(e))
        use_adapter = name == engine.adapter_name
        seed = body.get("seed")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = int(ids.shape[1])

        def usage(n: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

        if not body.get("stream"):
            async with engine.lock:
                new = await asyncio.to_thread(engine.generate, ids, kwargs, use_adapter, seed)
            text = engine.tokenizer.decode(new, skip_special_tokens=True)
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": engine.finish_reason(new, kwargs["max_new_tokens"]),
                    }
                ],
                "usage": usage(len(new)),
            }

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict, finish: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name, "choices": [choice]}
            return f"data: {json.dumps(obj)}\n\n"

        async def events() -> Any:
            from transformers import TextIteratorStreamer

            async with engine.lock:
                streamer = TextIteratorStreamer(engine.tokenizer, skip_prompt=True, skip_special_tokens=True)
                result: dict[str, Any] = {}

                def run() -> None:
                    try:
                        result["ids"] = engine.generate(ids, {**kwargs, "streamer": streamer}, use_adapter, seed)
                    except Exception as e:
                        result["error"] = e
                        streamer.end()

                worker = threading.Thread(target=run, daemon=True)
                worker.start()
                yield chunk({"role": "assistant", "content": ""})
                pieces = iter(streamer)
                while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                    if piece:
                        yield chunk({"content": piece})
                await asyncio.to_thread(worker.join)
            if "error" in result:
                err = {"error": {"message": str(result["error"]), "type": "internal_error"}}
                yield f"data: {json.dumps(err)}\n\n"
                yield "data: [DONE]\n\n"
                return
            new = result["ids"]
            yield chunk({}, engine.finish_reason(new, kwargs["max_new_tokens"]))
            if include_usage:
                obj = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": name,
                    "choices": [],
                    "usage": usage(len(new)),
                }
                yield f"data: {json.dumps(obj)}\n\n"
            yield "data: [DONE]\n\n"

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--served-name", help="the base's `model` id (default: the directory's name)")
    ap.add_argument("--adapter", help="NAME=DIR: one PEFT adapter (or a kubetune LoRA run directory)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    model = args.model
    if not model:
        from kubetune.models.load import resolve_model

        model = resolve_model("smollm2-135m-instruct")
    adapter = None
    if args.adapter:
        name, sep, path = args.adapter.partition("=")
        if not sep:
            raise SystemExit(f"--adapter {args.adapter!r}: expected NAME=DIR")
        adapter = (name, str(adapter_dir(path)))
    dtype, why = choose_dtype(args.dtype)
    print(f"naive_server: dtype={dtype} ({why}); one request at a time; loading {model}", flush=True)
    engine = Engine(str(model), dtype, args.served_name or Path(model).name, adapter)

    import uvicorn

    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
