"""One streamed chat request at a time against a running server, with the official openai
client: chunks per second and the median gap between chunks (the C=1 check of BENCHMARKS.md
section 5, for A/B runs of two builds of the server on the same port).

    .venv/bin/kubetune serve MODEL_DIR --port 8765 &
    .venv/bin/python bench/experiments/serve_one_stream.py --url http://127.0.0.1:8765/v1 --requests 3
"""

from __future__ import annotations

import argparse
import itertools
import time


def main() -> None:
    import openai

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8765/v1")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--question", default="What are the symptoms of anemia?")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="unused")
    model = client.models.list().data[0].id
    for _ in range(args.requests):
        t0, arrivals = time.perf_counter(), []
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": args.question}],
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
        took = time.perf_counter() - t0
        gaps = sorted(b - a for a, b in itertools.pairwise(arrivals))
        median = gaps[len(gaps) // 2] * 1e3 if gaps else float("nan")
        print(f"{len(arrivals)} chunks in {took:.2f} s = {len(arrivals) / took:.1f}/s; median gap {median:.1f} ms")


if __name__ == "__main__":
    main()
