"""What monitoring costs a training run: tokens/s with `monitor.port` on vs off, side by side;
with `--measure tracking`, with the experiment trackers (`monitor.report_to`) on vs off.

The same recipe runs alternately with and without metrics (ABAB..., so that drift of the
machine falls on both arms), each arm in its own `kubetune train` process, and steady-state
tokens/s is read from each run's metrics.jsonl (the first steps, which include warm-up, are
left out). With monitoring on, a scraper reads /metrics every second during the run, as a
Prometheus would, so the cost of exposition is counted too.

Two workloads:
- `tiny`: a random 2-layer Llama, two processes (DDP over gloo, so collectives are timed and
  local rank 0 serves both ranks from prometheus-client's multiprocess files), ~20 ms steps:
  the worst case, where a per-step cost is largest relative to the step;
- `smollm2`: the embedded default model (SmolLM2-135M-Instruct, LoRA), one process, the
  Quick start's settings with shorter rows: a real step.

    .venv/bin/python bench/monitor/monitor_overhead.py --workload tiny --rounds 3
    .venv/bin/python bench/monitor/monitor_overhead.py --workload smollm2 --rounds 2 --steps 12
    .venv/bin/python bench/monitor/monitor_overhead.py --measure tracking --workload smollm2 --rounds 3 --steps 16

With `--measure tracking` the "on" arm logs to TensorBoard and MLflow (its default store in the
run directory, no server; MLFLOW_TRACKING_URI unset) with system metrics, as `report_to`
does; everything it logs at the end (artifacts) falls after the last step and is not counted.

Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from kubetune.netutil import free_port

REPO = Path(__file__).resolve().parents[2]
FLASHCARDS = REPO.parent / "shared" / "data" / "medical_flashcards" / "train.jsonl"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = set(fields.get("Flags", "").split())
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{fields.get('Model name', 'unknown')} ({os.cpu_count()} CPUs; {' '.join(isa)})"


def tiny_model(root: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kubetune.models.load import load_tokenizer, resolve_model

    out = root / "tiny"
    torch.manual_seed(0)
    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def workload_args(name: str, root: Path, steps: int) -> tuple[list[str], list[str]]:
    """(launcher flags, recipe overrides) of a workload."""
    common = [f"data.train={FLASHCARDS}", "data.eval=null", "eval.generate=0", "train.save_every=0"]
    if name == "tiny":
        model = tiny_model(root)
        return ["--nproc-per-node", "2"], [
            *common,
            f"model.name_or_path={model}",
            "data.max_train_samples=2000",
            "data.max_seq_len=128",
            "train.micro_batch_size=2",
            "train.precision=fp32",
            f"train.max_steps={steps}",
        ]
    return [], [
        *common,
        "data.max_train_samples=400",
        "data.max_seq_len=256",
        "train.micro_batch_size=2",
        f"train.max_steps={steps}",
    ]


def scrape_until_done(proc: subprocess.Popen, port: int, counts: list[int]) -> None:
    while proc.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
            counts[0] += 1
        except OSError:
            pass
        time.sleep(1.0)


TRACKERS = "monitor.report_to=[tensorboard,mlflow]"


def run_arm(launch: list[str], overrides: list[str], out: Path, monitored: bool, measure: str = "metrics") -> dict:
    port = free_port()
    on = [f"monitor.port={port}"] if measure == "metrics" else [TRACKERS]
    args = [*launch, *overrides, f"output_dir={out}"] + (on if monitored else [])
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetune", "train", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    scrapes = [0]
    scraping = monitored and measure == "metrics"
    scraper = threading.Thread(target=scrape_until_done, args=(proc, port, scrapes)) if scraping else None
    if scraper:
        scraper.start()
    log = proc.communicate()[0].decode(errors="replace")
    if scraper:
        scraper.join()
    if proc.returncode != 0:
        sys.exit(f"arm failed:\n{log[-3000:]}")
    return {"tokens_per_s": steady_tokens_per_s(out / "metrics.jsonl"), "scrapes": scrapes[0]}


def steady_tokens_per_s(metrics: Path) -> float:
    """Tokens per second of wall time between the end of the first fifth of the steps and the
    last step (wall time: whatever monitoring costs between steps counts too)."""
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    start, end = rows[max(0, len(rows) // 5 - 1)], rows[-1]
    return (end["tokens"] - start["tokens"]) / (end["elapsed_s"] - start["elapsed_s"])


def per_step_cost_us(steps: int = 2000) -> dict[str, float]:
    """Microseconds the fit loop spends in telemetry per step (one process, plain registry): the
    step's histograms and counters, a logged step's gauges, and five timed collectives."""
    from kubetune.training.telemetry import Identity, Telemetry, TrainMetrics

    telemetry = Telemetry(TrainMetrics(Identity("bench", 0, "n"), multiprocess=False), None, steps, 2, 1e6, 1e11)
    telemetry.started(0, 0.0, 0)
    phases = {"data": 0.001, "compute": 0.02, "optimizer": 0.003, "communication": 0.001}
    out = {}
    t = time.perf_counter()
    for i in range(steps):
        telemetry.step(i + 1, phases, 1.0, 1.0, 512)
    out["step"] = (time.perf_counter() - t) / steps * 1e6
    t = time.perf_counter()
    for i in range(steps):
        telemetry.logged(i + 1, 0.1, 1.0, 1e-4, 1.0, 4000.0)
    out["logged step"] = (time.perf_counter() - t) / steps * 1e6
    t = time.perf_counter()
    for _ in range(steps):
        for _ in range(5):
            telemetry.collective("all_reduce", 8, 0.001)
    out["5 collectives"] = (time.perf_counter() - t) / steps * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--rounds", type=int, default=3, help="ABAB rounds (one arm of each per round)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--measure", choices=("metrics", "tracking"), default="metrics", help="monitor.port, or monitor.report_to"
    )
    args = parser.parse_args()
    print(f"machine: {cpu_model()}")
    costs = per_step_cost_us()
    print("telemetry per step: " + ", ".join(f"{k} {v:.0f} us" for k, v in costs.items()))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        launch, overrides = workload_args(args.workload, root, args.steps)
        results: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(args.rounds):
            for arm in ("off", "on") if i % 2 == 0 else ("on", "off"):
                r = run_arm(launch, overrides, root / f"{arm}-{i}", arm == "on", args.measure)
                results[arm].append(r["tokens_per_s"])
                scraped = f", {r['scrapes']} scrapes" if arm == "on" and args.measure == "metrics" else ""
                print(f"round {i + 1} {args.measure} {arm:3}: {r['tokens_per_s']:9.1f} tokens/s{scraped}", flush=True)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    spread = max(results["off"]) / min(results["off"]) - 1
    print(f"\n{args.workload}, {args.measure}: median tokens/s off {off:.1f}, on {on:.1f}; on/off = {on / off:.3f}")
    print(f"(the off arm's own spread, max/min - 1: {spread:.3f}: the noise the ratio is read against)")
    print(f"(each arm: {args.steps} steps, {args.rounds} runs; the issue's bound is on/off >= 0.98)")


if __name__ == "__main__":
    main()
