"""The native engine in-process, for the serve benchmarks that time the engine without HTTP
(bench/experiments/serve_closed_loop.py, serve_burst.py): built and run on one thread, as `kubetune serve`
does (torch keeps one OpenMP pool per thread that ran a parallel op; see Engine.run), and the
chat prompts of the medical-flashcard questions, tokenized as the server does."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from bench.common.serving import PROMPTS


def start_engine(opts: Any) -> tuple[Any, Any, str]:
    """(served model, engine, summary line) of `kubetune.serve.native.build.build_engine(opts)`,
    its loop running on the thread that built it."""
    from kubetune.serve.native.build import build_engine

    built: dict = {}
    ready = threading.Event()

    def engine_thread() -> None:
        built["all"] = build_engine(opts)
        ready.set()
        built["all"][1].run()

    threading.Thread(target=engine_thread, daemon=True).start()
    ready.wait()
    served, engine, _, summary = built["all"]
    return served, engine, summary


def chat_prompts(tokenizer: Any, path: str | Path = PROMPTS) -> list[list[int]]:
    """Each question of `path` (jsonl, `input`) as a one-turn chat prompt's token ids."""
    questions = [json.loads(line)["input"] for line in Path(path).read_text().splitlines() if line.strip()]
    return [
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for q in questions
    ]
