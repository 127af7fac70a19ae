"""Serving under load: kubetune serve vs a naive HF `generate` server vs vLLM CPU, in one run.

Three arms, one after another on the same machine (never concurrently), each server started
fresh and stopped after its arm:

- **kubetune**: `.venv/bin/kubetune serve MODEL_DIR --engine native` (for the mix, a second
  server with 4 adapter names, `--adapter a1=RUN ... a4=RUN`, from the LoRA run `--run`);
- **naive**: bench/serve/naive_server.py, FastAPI + HF `model.generate`, one request at a time;
- **vllm**: vLLM's OpenAI server from the virtualenv of scripts/vllm_venv.sh
  (`python -m vllm.entrypoints.openai.api_server`, the command kubetune.contracts.serving.vllm_argv
  builds). If it cannot start, the arm is recorded as `not run: <the reason line of its log>`
  and the run goes on.

Same model for all (the embedded default SmolLM2-135M-Instruct as an HF directory), same
dtype (bf16 where the CPU has AMX or AVX-512-BF16, fp32 otherwise: the rule kubetune serve
applies to itself; passed to the naive server and vLLM), same prompts (the questions of
../shared/data/medical_flashcards/test.jsonl as one user message each, in file order), the
same `max_tokens` (128) at temperature 0, streamed with `stream_options.include_usage`.
Closed-loop clients: each of C clients sends its next request when its previous one has
finished, at C = 1, 4, 16 and 64. Per arm and C: generated tokens/s (usage counts over the
level's wall time), requests/s, time to first token (the first chunk with content) and
end-to-end latency at p50 and p99, and the peak RSS of the server's process tree (psutil,
sampled every 0.25 s; children such as vLLM's engine core included). Then, for kubetune (and
for vLLM with `--mix-arms kubetune,vllm`, in a second server started with `--enable-lora`),
the 4-adapter mix at C=16: requests round-robin over the base and a1..a4, next to the same
load on the base alone in that server (its ratio to the main server's level at the same C is
the cost of holding adapters).

    .venv/bin/python bench/serve/serve_load.py --run runs/smollm2-135m-lora-cpu --json bench/results/serve-load.json
    .venv/bin/python bench/serve/serve_load.py --quick --arms naive            # smoke run (C = 1, 4; 16 tokens)

Nothing else should run on the machine meanwhile: the clients share its cores with the server
(as every arm's do), and the load average at the start of each arm is recorded.

How long: by default each level sends max(2, ceil(32/C)) requests per client (32, 32, 32 and
128 requests at C = 1, 4, 16, 64), so the naive arm alone generates about 25k tokens at its
~13 tokens/s (2 cores of the AVX2 EPYC, fp32): about 35 min. With vLLM (about 2.5 min to start,
most of it torch.compile; its `auto` CPU binding keeps one of 2 CPUs for its frontend, see
--vllm-omp-bind) and kubetune, a full run takes about an hour there. `--duration S` bounds
each level by time instead (requests in flight at the end still finish and count).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.common from this checkout

from bench.common.serving import (
    PROMPTS,
    REPO,
    Server,
    load_prompts,
    model_or_default,
    run_level,
    the_machine,
)

from kubetune.netutil import free_port

ARMS = ("kubetune", "naive", "vllm", "kubetune-json")
NOTES = re.compile(
    r"naive_server: |kernels:|dtype=torch|core ids=|reserved_cpus|Reducing Torch threads|KV cache size|threads="
)


# --- the arms ---------------------------------------------------------------------------------


@dataclass
class ArmSpec:
    name: str
    argv: list[str] | None  # None: cannot run (see `skip`)
    env: dict[str, str]
    ready_path: str
    dtype_note: str
    adapters: list[str] = field(default_factory=list)
    skip: str | None = None
    body: dict[str, Any] = field(default_factory=dict)  # added to every request (kubetune-json)


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return {**env, **(extra or {})}


def adapter_path(run: Path) -> Path:
    """The PEFT adapter of a kubetune LoRA run directory (or the directory itself if it is one)."""
    return run if (run / "adapter_config.json").is_file() else run / "adapter"


def kubetune_arm(args: argparse.Namespace, model_dir: str, port: int, dtype: str, lora: bool = False) -> ArmSpec:
    exe = REPO / ".venv" / "bin" / "kubetune"
    target = args.kubetune_target or model_dir
    argv = [str(exe), "serve", target, "--host", "127.0.0.1", "--port", str(port), "--engine", "native"]
    names = [f"a{i + 1}" for i in range(args.adapters)] if args.run and lora else []
    for n in names:
        argv += ["--adapter", f"{n}={args.run}"]
    note = (
        f"its own choice (kubetune serve picks bf16 where the CPU has AMX/AVX-512-BF16, fp32 otherwise: {dtype} here)"
    )
    skip = None if exe.exists() else f"{exe} is missing (scripts/bootstrap.sh installs it)"
    return ArmSpec("kubetune+lora" if names else "kubetune", argv, server_env(), "/ready", note, names, skip)


# kubetune-json: the same server and prompts, every answer constrained to this schema
# (structured output's cost per token against free text, issue 24's target: within 15%)
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"],
    "additionalProperties": False,
}


def kubetune_json_arm(args: argparse.Namespace, model_dir: str, port: int, dtype: str) -> ArmSpec:
    spec = kubetune_arm(args, model_dir, port, dtype)
    spec.name = "kubetune-json"
    spec.body = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}}
    return spec


def naive_arm(args: argparse.Namespace, model_dir: str, port: int, dtype: str) -> ArmSpec:
    argv = [sys.executable, str(REPO / "bench" / "serve" / "naive_server.py"), "--model", model_dir]
    argv += ["--served-name", args.served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    return ArmSpec("naive", argv, server_env(), "/ready", dtype)


def vllm_arm(args: argparse.Namespace, model_dir: str, port: int, dtype: str, lora: bool = False) -> ArmSpec:
    from kubetune.contracts.serving import Adapter, VllmOptions, vllm_argv, vllm_lora_rank

    python = Path(args.vllm_venv) / "bin" / "python"
    adapters: tuple[Adapter, ...] = ()
    rank = None
    if lora and args.run:
        path = adapter_path(Path(args.run))
        adapters = tuple(Adapter(f"a{i + 1}", str(path)) for i in range(args.adapters))
        try:
            rank = int(json.loads((path / "adapter_config.json").read_text())["r"])
        except (OSError, KeyError, ValueError):
            rank = None
    opts = VllmOptions(
        model=model_dir,
        served_name=args.served_name,
        adapters=adapters,
        port=port,
        max_model_len=args.vllm_max_model_len,
        max_lora_rank=vllm_lora_rank(rank) if rank else None,  # the rule `kubetune serve --engine vllm` applies
        dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
    )
    argv = vllm_argv(opts)
    argv[0] = str(python)
    extra = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib)}
    if args.vllm_omp_bind != "auto":  # vLLM's default `auto` keeps one CPU for its frontend: 1 of 2 computes here
        extra["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
        extra["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env = server_env(extra)
    skip = None if python.exists() else f"{python} is missing (scripts/vllm_venv.sh {args.vllm_venv} creates it)"
    names = [a.name for a in adapters]
    return ArmSpec("vllm+lora" if lora else "vllm", argv, env, "/health", dtype, names, skip)


def run_arm(
    spec: ArmSpec,
    args: argparse.Namespace,
    prompts: list[str],
    log_dir: Path,
    mix: bool = False,
    mix_only: bool = False,
) -> dict:
    record: dict[str, Any] = {"arm": spec.name, "argv": spec.argv, "dtype": spec.dtype_note}
    if spec.skip or spec.argv is None:
        record["status"] = f"not run: {spec.skip}"
        print(f"[{spec.name}] {record['status']}", flush=True)
        return record
    port = int(spec.argv[spec.argv.index("--port") + 1])
    log_path = log_dir / f"{spec.name}.log"
    record["log"] = str(log_path)
    record["load_average_at_start"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"[{spec.name}] starting: {' '.join(spec.argv)}", flush=True)
    server = Server(spec.name, spec.argv, spec.env, log_path, port)
    try:
        why = server.wait_ready(spec.ready_path, args.ready_timeout)
        if why:
            record["status"] = f"not run: {why}"
            print(f"[{spec.name}] {record['status']}\n[{spec.name}] log: {log_path}", flush=True)
            return record
        record["startup_s"] = round(time.perf_counter() - server.started, 1)
        served = server.models()
        bases = [m["id"] for m in served if not m.get("parent")]
        record["models"] = [{"id": m["id"], "parent": m.get("parent")} for m in served]
        base = args.served_name if args.served_name in bases else (bases[0] if bases else args.served_name)
        missing = [a for a in spec.adapters if a not in {m["id"] for m in served}]
        if missing:
            record["adapter_problem"] = f"adapters not listed in /v1/models: {missing}"
        print(f"[{spec.name}] ready in {record['startup_s']} s; models: {[m['id'] for m in served]}", flush=True)

        warm = min(args.warmup, max(args.concurrency))
        if warm:
            asyncio.run(run_level(server.base_url, [base], prompts, warm, args.max_tokens, 1, extra=spec.body))
        levels = [] if mix_only else args.concurrency
        record["levels"] = []
        for c in levels:
            server.reset_phase_peak()
            level = asyncio.run(
                run_level(server.base_url, [base], prompts, c, args.max_tokens, rpc(args, c), args.duration, spec.body)
            )
            level["peak_rss_bytes"] = server.phase_peak
            record["levels"].append(level)
            print(f"[{spec.name}] {fmt_level(level)}", flush=True)
        if mix and spec.adapters and not missing:
            c = args.mix_concurrency
            record["mix"] = {}
            for label, models in (("base_only", [base]), ("base+adapters", [base, *spec.adapters])):
                server.reset_phase_peak()
                level = asyncio.run(
                    run_level(server.base_url, models, prompts, c, args.max_tokens, rpc(args, c), args.duration)
                )
                level["peak_rss_bytes"] = server.phase_peak
                record["mix"][label] = level
                print(f"[{spec.name}] mix {label}: {fmt_level(level)}", flush=True)
        record["status"] = "ok"
    except Exception as e:
        record["status"] = f"failed: {type(e).__name__}: {e}; server: {server.reason()}"
        print(f"[{spec.name}] {record['status']}", flush=True)
    finally:
        record["exit_code"] = server.stop()
        record["peak_rss_bytes"] = server.peak_rss
        notes = [_around(ln, m) for ln in server.log_tail(2000) if (m := NOTES.search(ln))]
        if notes:
            record["server_notes"] = notes[:8]  # what the server said about its dtype, threads and KV cache
    return record


def _tree_cpu_seconds(server: Server) -> float:
    """User + system CPU seconds of the server's process tree so far."""
    import psutil

    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(server.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                t = p.cpu_times()
                total += t.user + t.system
    return total


def _settle(servers: list[Server], quiet: float = 0.05, window: float = 0.5, limit: float = 20.0) -> float:
    """Wait until the servers together burn under `quiet` CPU seconds per `window` (10% of a
    core), at most `limit` seconds; returns the wait. vLLM's engine keeps its threads busy for
    about a second after its last request, which, unwaited, fell on the first second of the
    next arm's level: the first requests of kubetune's levels that followed vLLM's took ~1 s
    longer to their first token (runs 7-9 of BENCHMARKS.md section 5, in bench/results/HISTORY.md)."""
    start = time.perf_counter()
    before = sum(_tree_cpu_seconds(s) for s in servers)
    while time.perf_counter() - start < limit:
        time.sleep(window)
        now = sum(_tree_cpu_seconds(s) for s in servers)
        if now - before < quiet:
            break
        before = now
    return time.perf_counter() - start


def run_interleaved(specs: list[ArmSpec], args: argparse.Namespace, prompts: list[str], log_dir: Path) -> dict:
    """Every arm's server up at once, idle but for its own levels, and the levels alternate:
    for each C, `--interleave` rounds, each running every arm once (ABBA order). On a shared VM
    whose speed drifts by a third within minutes, arms run one after the other compare moments,
    not servers; alternating puts both arms in every moment. The CPU the idle servers burn
    meanwhile is recorded too (an idle server must not slow the one under load)."""
    servers: dict[str, Server] = {}
    specs_by_name = {spec.name: spec for spec in specs}
    record: dict[str, Any] = {"rounds": args.interleave, "levels": {}, "idle_cpu_s": {}}
    try:
        bases: dict[str, str] = {}
        for spec in specs:
            assert spec.argv is not None, spec.skip
            port = int(spec.argv[spec.argv.index("--port") + 1])
            print(f"[{spec.name}] starting: {' '.join(spec.argv)}", flush=True)
            server = servers[spec.name] = Server(spec.name, spec.argv, spec.env, log_dir / f"{spec.name}.log", port)
            why = server.wait_ready(spec.ready_path, args.ready_timeout)
            if why:
                raise RuntimeError(f"{spec.name}: {why}")
            ids = [m["id"] for m in server.models() if not m.get("parent")]
            bases[spec.name] = args.served_name if args.served_name in ids else ids[0]
            print(f"[{spec.name}] ready in {time.perf_counter() - server.started:.1f} s", flush=True)
            warm = min(args.warmup, max(args.concurrency))
            asyncio.run(
                run_level(server.base_url, [bases[spec.name]], prompts, warm, args.max_tokens, 1, extra=spec.body)
            )
        names = list(servers)
        for c in args.concurrency:
            per_arm: dict[str, list[dict]] = {n: [] for n in names}
            for r in range(args.interleave):
                for name in names if r % 2 == 0 else names[::-1]:
                    settled = _settle(list(servers.values()))
                    others = {n: _tree_cpu_seconds(servers[n]) for n in names if n != name}
                    level = asyncio.run(
                        run_level(
                            servers[name].base_url,
                            [bases[name]],
                            prompts,
                            c,
                            args.max_tokens,
                            rpc(args, c),
                            args.duration,
                            specs_by_name[name].body,
                        )
                    )
                    level["idle_cpu_s_of_others"] = {
                        n: round(_tree_cpu_seconds(servers[n]) - t, 2) for n, t in others.items()
                    }
                    level["settle_s"] = round(settled, 2)
                    per_arm[name].append(level)
                    print(
                        f"[{name}] round {r + 1}: {fmt_level(level)}; "
                        f"idle servers' CPU {level['idle_cpu_s_of_others']} s (quiet after {settled:.1f} s)",
                        flush=True,
                    )
            record["levels"][str(c)] = per_arm
    finally:
        for name, server in servers.items():
            record.setdefault("peak_rss_bytes", {})[name] = server.peak_rss
            server.stop()
    return record


def interleaved_report(rec: dict) -> str:
    import statistics

    lines = [f"interleaved: {rec['rounds']} rounds per C, arms alternating (ABBA); generated tokens/s per round"]
    for c, per_arm in rec["levels"].items():
        names = list(per_arm)
        for name in names:
            tps = [lv["tokens_per_s"] or 0.0 for lv in per_arm[name]]
            lines.append(
                f"  C={c:>3} {name:<9} "
                + " ".join(f"{t:7.1f}" for t in tps)
                + f"   median {statistics.median(tps):7.1f}"
            )
        if len(names) == 2:
            a, b = names
            ratios = [
                (x["tokens_per_s"] or 0.0) / (y["tokens_per_s"] or float("inf")) for x, y in zip(per_arm[a], per_arm[b])
            ]
            lines.append(
                f"  C={c:>3} {a}/{b} per round "
                + " ".join(f"{q:.2f}" for q in ratios)
                + f"; median {statistics.median(ratios):.2f}"
            )
    return "\n".join(lines)


def _around(line: str, m: re.Match, width: int = 240) -> str:
    line = line.strip()
    if len(line) <= width:
        return line
    start = max(0, m.start() - width // 3)
    return "..." + line[start : start + width] + "..."


def rpc(args: argparse.Namespace, c: int) -> int | None:
    """Requests per client: the option, else enough for >= 32 requests per level (at least 2 each)."""
    if args.duration:
        return None
    return args.requests_per_client or max(2, math.ceil(32 / c))


# --- the report -------------------------------------------------------------------------------


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def fmt_level(lv: dict) -> str:
    return (
        f"C={lv['concurrency']}: {lv['requests']} requests ({lv['errors']} failed) in {lv['wall_s']:.1f} s, "
        f"{_s(lv['tokens_per_s'])} tok/s, {_s(lv['requests_per_s'])} req/s, "
        f"TTFT p50/p99 {_s(lv['ttft_p50_s'])}/{_s(lv['ttft_p99_s'])} s, "
        f"e2e p50/p99 {_s(lv['e2e_p50_s'])}/{_s(lv['e2e_p99_s'])} s"
    )


def ratios(arms: dict[str, dict]) -> dict:
    def tps(arm: str) -> dict[int, float]:
        rec = arms.get(arm) or {}
        return {lv["concurrency"]: lv["tokens_per_s"] for lv in rec.get("levels", []) if lv.get("tokens_per_s")}

    kt, vl, nv = tps("kubetune"), tps("vllm"), tps("naive")
    out: dict[str, Any] = {}
    for c in sorted(set(kt) | set(vl) | set(nv)):
        out[str(c)] = {
            "kubetune/vllm": kt[c] / vl[c] if c in kt and c in vl else None,
            "kubetune/naive": kt[c] / nv[c] if c in kt and c in nv else None,
            "vllm/naive": vl[c] / nv[c] if c in vl and c in nv else None,
        }
    for arm in ("kubetune+lora", "vllm+lora"):
        mix = (arms.get(arm) or {}).get("mix") or {}
        if mix.get("base_only", {}).get("tokens_per_s") and mix.get("base+adapters", {}).get("tokens_per_s"):
            out[f"{arm} mix/base_only"] = mix["base+adapters"]["tokens_per_s"] / mix["base_only"]["tokens_per_s"]
    return out


def report(result: dict) -> str:
    m = result["machine"]
    flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items())
    cfg = result["config"]
    lines = [
        f"machine: {m['cpu_model']}, {m.get('cpus_usable', m['cpus'])} CPUs usable, {m.get('memory_gib')} GiB; {flags}",
        (
            f"dtype: {cfg['dtype']} ({cfg['dtype_reason']}); {cfg['max_tokens']} new tokens, temperature 0, "
            f"{cfg['prompts']} prompts from {cfg['prompt_file']}"
        ),
        "",
        (
            f"{'arm':<10} {'C':>3} {'reqs':>5} {'err':>4} {'tok/s':>8} {'req/s':>7} {'TTFT p50':>9} {'p99':>7} "
            f"{'e2e p50':>8} {'p99':>7} {'out/req':>7} {'peak RSS':>9}"
        ),
    ]
    for name, rec in result["arms"].items():
        if rec.get("status") != "ok":
            lines.append(f"{name:<10} {rec.get('status')}")
            continue
        rows = [(str(lv["concurrency"]), lv) for lv in rec.get("levels", [])]
        rows += [(f"{lv['concurrency']}{'m' if k != 'base_only' else 'b'}", lv) for k, lv in rec.get("mix", {}).items()]
        for c, lv in rows:
            lines.append(
                f"{name:<10} {c:>3} {lv['requests']:>5} {lv['errors']:>4} {_s(lv['tokens_per_s']):>8} "
                f"{_s(lv['requests_per_s']):>7} {_s(lv['ttft_p50_s']):>9} {_s(lv['ttft_p99_s']):>7} "
                f"{_s(lv['e2e_p50_s']):>8} {_s(lv['e2e_p99_s']):>7} {_s(lv['mean_out_tokens']):>7} "
                f"{lv['peak_rss_bytes'] / 2**30:>7.2f}G"
            )
        lines.append(
            f"{'':<10} startup {rec.get('startup_s')} s, peak RSS over the arm {rec['peak_rss_bytes'] / 2**30:.2f} GiB"
        )
    lines.append(
        "(C = concurrency; Cb = the mix level's base-only run, Cm = base + adapters round-robin; TTFT/e2e in s;\n"
        " peak RSS = the largest sampled sum of the RSS of the server's processes)"
    )
    r = result["ratios"]
    if r:
        lines.append("")
        lines.append("generated tokens/s ratios:")
        for k, v in r.items():
            if isinstance(v, dict):
                lines.append(
                    f"  C={k}: kubetune/vllm {_s(v['kubetune/vllm'])}, kubetune/naive {_s(v['kubetune/naive'])}, "
                    f"vllm/naive {_s(v['vllm/naive'])}"
                )
            else:
                lines.append(f"  {k}: {_s(v)}")
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--arms",
        default="kubetune,naive,vllm",
        help="comma-separated, run in this order, of: " + ", ".join(ARMS) + " (default: %(default)s)",
    )
    ap.add_argument("--run", help="a kubetune LoRA run directory: its adapter is served as a1..a4 (kubetune, vLLM mix)")
    ap.add_argument("--model", help="the HF model directory every arm serves (default: the embedded SmolLM2-135M)")
    ap.add_argument("--kubetune-target", help="TARGET of `kubetune serve` (default: --model's directory)")
    ap.add_argument("--served-name", default="smollm2-135m-instruct", help="the base's model id (naive, vLLM)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="closed-loop client counts (default: %(default)s)")
    ap.add_argument("--requests-per-client", type=int, help="default: enough for >= 32 requests per level, >= 2 each")
    ap.add_argument("--duration", type=float, help="seconds per level instead of a request count")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4, help="adapter names pointing to --run (default: %(default)s)")
    ap.add_argument("--mix-concurrency", type=int, default=16)
    ap.add_argument("--mix-arms", default="kubetune", help="arms that also run the adapter mix: kubetune[,vllm]")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent at once before each arm")
    ap.add_argument("--prompts", default=str(PROMPTS), help="jsonl with `input` questions (default: %(default)s)")
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto")
    ap.add_argument("--vllm-venv", default=str(REPO / ".venv-vllm"))
    ap.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (default: %(default)s)")
    ap.add_argument("--vllm-max-model-len", type=int, default=2048)
    ap.add_argument(
        "--vllm-omp-bind",
        default="auto",
        help="VLLM_CPU_OMP_THREADS_BIND: `auto` (vLLM's default: one CPU reserved for its frontend, the\n"
        "others compute) or a CPU list such as 0-1 (then no CPU is reserved) (default: %(default)s)",
    )
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to load")
    ap.add_argument("--log-dir", help="where the servers' logs go (default: a new temporary directory)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="N: start every arm's server at once and alternate the arms' levels, N rounds per C\n"
        "(the ratios of a drifting VM; no mix levels)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4; 16 tokens; 2 requests per client")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.max_tokens = "1,4", 16
        args.requests_per_client = args.requests_per_client or 2
        args.mix_concurrency = min(args.mix_concurrency, 4)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    args.mix_arms = [a.strip() for a in args.mix_arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    if args.run and not (adapter_path(Path(args.run)) / "adapter_config.json").is_file():
        ap.error(f"--run {args.run}: no adapter/adapter_config.json (a finished kubetune LoRA run is needed)")
    if args.run:
        args.run = str(Path(args.run).resolve())
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model_dir = model_or_default(args.model)
    prompts = load_prompts(Path(args.prompts))
    mach, dtype, why = the_machine(args.dtype)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="serve_load-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"dtype: {dtype} ({why}); model {model_dir}; run {args.run or '(none: no adapters)'}; logs in {log_dir}")

    result: dict[str, Any] = {
        "bench": "serve_load",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": mach,
        "config": {
            "model": model_dir,
            "run": args.run,
            "dtype": dtype,
            "dtype_reason": why,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "concurrency": args.concurrency,
            "requests_per_client": {str(c): rpc(args, c) for c in args.concurrency},
            "duration_s": args.duration,
            "mix_concurrency": args.mix_concurrency,
            "adapters": args.adapters if args.run else 0,
            "prompt_file": args.prompts,
            "prompts": len(prompts),
            "vllm_kvcache_gib": args.vllm_kvcache_gib,
            "vllm_omp_bind": args.vllm_omp_bind,
            "argv": sys.argv[1:] if argv is None else argv,
        },
        "arms": {},
    }
    builders = {"kubetune": kubetune_arm, "naive": naive_arm, "vllm": vllm_arm, "kubetune-json": kubetune_json_arm}
    if args.interleave:
        specs = [builders[name](args, model_dir, free_port(), dtype) for name in args.arms]
        result["interleaved"] = run_interleaved(specs, args, prompts, log_dir)
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        print()
        print(interleaved_report(result["interleaved"]))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return result
    for name in args.arms:
        spec = builders[name](args, model_dir, free_port(), dtype)
        result["arms"][name] = run_arm(spec, args, prompts, log_dir)
        if (
            name in ("kubetune", "vllm")
            and name in args.mix_arms
            and args.run
            and result["arms"][name]["status"] == "ok"
        ):
            # the mix in a second server that holds the adapters, for both engines alike (a
            # server holding adapters does more work per token even for base requests)
            spec = builders[name](args, model_dir, free_port(), dtype, lora=True)
            result["arms"][f"{name}+lora"] = run_arm(spec, args, prompts, log_dir, mix=True, mix_only=True)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result["ratios"] = ratios(result["arms"])
    print()
    print(report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
