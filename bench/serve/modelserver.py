"""Issue 37's targets for a ModelServer (many LoRA adapters in one shared `kubetune serve`), in one run.

Three parts, each selected with --parts (default: all three, one after another, never
concurrently); every server is started fresh for its part and stopped after it. Same model for
all (the embedded default SmolLM2-135M-Instruct as an HF directory, as bench/serve/serve_load.py
serves it), the same prompts (the questions of ../shared/data/medical_flashcards/test.jsonl)
and the same closed-loop streaming clients (bench/common/serving.py). The adapters: one LoRA
run (`--run DIR`, a finished kubetune LoRA run; else a tiny one is trained first on the shipped
sample, `kubetune train smollm2-135m-lora-cpu train.max_steps=2 ...`, about a minute), copied N
times with lora_B perturbed by seeded noise (tests/operator/test_modelserver_operator.py
`_variant`): N adapters with weights of their own and the same shapes. Each is installed with
the adapter-export Job's command (`kubetune.export.adapter_install`) into an adapter volume, as
a ModelServer's replicas read it (`--adapter-registry ROOT/registry.json`).

- **memory** (target: 20 adapters on one ModelServer <= 0.1x the memory of 20 merged-model
  Deployments of the same base). One `kubetune serve BASE --adapter-registry REG --max-loras
  N` holding `--memory-adapters` (20) adapters, after each has answered one request (C=1, the
  adapters round-robin), against one `kubetune serve MERGED` of the run's merged model
  (`kubetune export RUN --merged`) after answering the same number of requests. Per server:
  the peak RSS of its process tree over its life and the steady RSS (the peak over
  `--settle` s idle after the last answer), sampled by psutil every 0.25 s
  (bench/common/processes.py). 20 Deployments of the merged model hold 20 such servers: their
  total is taken as 20x the one measured (printed as such). Ratio: one / (20 x merged).
- **mix** (target: at C=16 with requests over 8 adapters, tokens/s >= 0.8x the base alone on
  the same server). One server with `--mix-adapters` (8) adapters in its registry and
  `--max-loras` 8; closed-loop C=16, serve_load.py's prompts and max_tokens (128, temperature
  0). Arm A: every request to the base; arm B: requests round-robin over the 8 adapters (their
  aliases, as clients name them). Both arms warmed first, then A/B/A/B... for `--rounds`
  rounds each, the server's CPU settled between levels; the verdict on the medians: B/A.
- **latency** (a figure to record: from a FineTune's success to its adapter answering on every
  replica). Two replicas started as a ModelServer renders them (`kubetune serve BASE
  --allow-runtime-adapters --adapter-registry ROOT/registry.json --max-loras K`), then per
  repetition (`--reps`, medians reported):
  - `--latency-mode operator` (default): the real operator (kopf, in this process, against
    kmock's Kubernetes emulation over loopback HTTP, as tests/operator/ run it) with a
    ModelServer and a FineTune of `spec.serve.server`; the PyTorchJob is marked Succeeded; the
    export Job the operator creates has its command run here as its pod would
    (`python -m kubetune.export.adapter_install RUN --name X --version v1 --base ... --root
    ROOT`, timed: (a)); then the Job is marked succeeded and timed from that moment: (b) until
    the adapter answers a request on every replica (each replica polled on its own), and until
    the FineTune's AdapterLoaded condition is True. Total = (a) + (b).
  - `--latency-mode direct`: the same export command (a), then the runtime load the operator
    sends, `POST /v1/load_lora_adapter` to each replica at once, until the first answer from the
    adapter on every replica (b); no operator.
  - `both`: the two, on the same replicas.

  What the operator adds in a cluster: here its timers run every 0.25 s (tests/operator's
  INTERVAL). `kubetune operator` runs them every `--interval` s, 15 by default (the FineTune's
  and the ModelServer's timer, src/kubetune/operator/handlers.py and modelserver.py: the
  FineTune's timer sees the Job succeeded and registers the version, the ModelServer's timer
  loads it on the replicas, the FineTune's next tick writes AdapterLoaded). Each step waits up
  to one period for its timer: in a cluster add up to 2 periods (30 s) to the answer and 3 to
  AdapterLoaded, plus the Job pod's own scheduling and start.

    .venv/bin/python bench/serve/modelserver.py --run runs/smollm2-135m-lora-cpu --json bench/results/modelserver.json
    .venv/bin/python bench/serve/modelserver.py --parts mix --rounds 4 --run runs/smollm2-135m-lora-cpu
    .venv/bin/python bench/serve/modelserver.py --quick        # smoke run: few adapters, 16 tokens, seconds of load

Nothing else should run on the machine meanwhile: clients, servers and (in the latency part) the
operator share its cores, and the load average at the start of each part is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: bench.* and tests.* of this checkout

from bench.common.serving import PROMPTS, REPO, Server, load_prompts, model_or_default, run_level, the_machine
from bench.serve.serve_load import _settle, adapter_path, fmt_level, server_env

from kubetune.netutil import free_port

PARTS = ("memory", "mix", "latency")
RUN_FILES = ("recipe.yaml", "run.json", "summary.json")  # what adapter_install --gate reads beside adapter/


# --- the adapters -----------------------------------------------------------------------------


def train_tiny_run(out: Path, log: Path) -> Path:
    """A two-step LoRA run of the embedded default recipe on the shipped sample (its adapter's
    shapes are the recipe's: r 16 on every linear layer)."""
    argv = [sys.executable, "-m", "kubetune", "train", "smollm2-135m-lora-cpu", "train.max_steps=2", "train.epochs=1"]
    argv += ["eval.max_samples=4", "eval.generate=0", "data.max_seq_len=128", f"output_dir={out}"]
    argv += ["--nproc-per-node", "1"]
    print(f"[adapters] no --run: training one: {' '.join(argv[1:])}", flush=True)
    with open(log, "wb") as sink:
        rc = subprocess.run(argv, env=server_env(_pythonpath()), stdout=sink, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not (out / "adapter" / "adapter_config.json").is_file():
        raise SystemExit(f"training the tiny run failed (exit {rc}); its log: {log}")
    return out


def slim_run(run: Path, dest: Path) -> Path:
    """The run's adapter and the files the export command reads, without its checkpoints."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(adapter_path(run), dest / "adapter", dirs_exist_ok=True)
    for name in RUN_FILES:
        if (run / name).is_file():
            shutil.copy2(run / name, dest / name)
    return dest


def make_variants(run: Path, work: Path, count: int) -> list[Path]:
    """`count` run directories whose adapters differ in lora_B (seeded noise, same shapes)."""
    from tests.operator.test_modelserver_operator import _variant

    base = slim_run(run, work / "run-slim")
    out = []
    for i in range(count):
        dest = work / "variants" / f"v{i + 1:02d}"
        out.append(dest if dest.is_dir() else _variant(base, dest, seed=1000 + i))
    return out


def install(run_dir: Path, name: str, base: str, root: Path, version: str = "v1") -> float:
    """The adapter-export Job's command as its pod runs it, in a process of its own; its seconds."""
    argv = [sys.executable, "-m", "kubetune.export.adapter_install", str(run_dir), "--name", name]
    argv += ["--version", version, "--base", base, "--root", str(root)]
    return run_command(argv)


def run_command(argv: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=server_env(_pythonpath()), capture_output=True, text=True)
    took = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}")
    return took


def registry_root(variants: list[Path], names: list[str], base: str, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for run, name in zip(variants, names, strict=True):
        install(run, name, base, root)
    return root / "registry.json"


def _pythonpath() -> dict[str, str]:
    """This checkout's src first, for the servers and commands started from here."""
    paths = [str(REPO / "src"), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


# --- servers ----------------------------------------------------------------------------------


def serve_argv(target: str, port: int, args: argparse.Namespace, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "kubetune", "serve", target, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--engine", "native", *extra]
    if args.dtype != "auto":
        argv += ["--dtype", args.dtype]
    if args.kv_cache_gib:
        argv += ["--kv-cache-gib", str(args.kv_cache_gib)]
    return argv


def start(name: str, argv: list[str], log_dir: Path, args: argparse.Namespace) -> Server:
    return start_all({name: argv}, log_dir, args)[0]


def start_all(argvs: dict[str, list[str]], log_dir: Path, args: argparse.Namespace) -> list[Server]:
    """The servers started together, each waited for until /ready answers (all stopped if one fails)."""
    servers = []
    for name, argv in argvs.items():
        port = int(argv[argv.index("--port") + 1])
        print(f"[{name}] starting: {' '.join(argv[1:])}", flush=True)
        servers.append(Server(name, argv, server_env(_pythonpath()), log_dir / f"{name}.log", port))
    for server in servers:
        why = server.wait_ready("/ready", args.ready_timeout)
        if why:
            for s in servers:
                s.stop()
            raise RuntimeError(f"{server.name}: {why} (log {server.log_path})")
        print(f"[{server.name}] ready in {time.perf_counter() - server.started:.1f} s", flush=True)
    return servers


def base_id(server: Server) -> str:
    return next(m["id"] for m in server.models() if not m.get("parent"))


def answer(url: str, model: str, max_tokens: int = 1, timeout: float = 120.0) -> tuple[int, str]:
    """One non-streamed chat request: (HTTP status, text)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "temperature": 0}, timeout=timeout, trust_env=False)
    except httpx.TransportError as e:
        return 0, f"{type(e).__name__}: {e}"
    return r.status_code, r.text[:300]


# --- 1. memory --------------------------------------------------------------------------------


def measure_server_memory(server: Server, models: list[str], args: argparse.Namespace, prompts: list[str]) -> dict:
    """Every model answers one request (C=1, round-robin); then the tree's RSS over `settle` s idle."""
    level = asyncio.run(run_level(server.base_url, models, prompts, 1, args.max_tokens, len(models)))
    if level["errors"]:
        raise RuntimeError(f"{server.name}: {level['errors']} requests failed: {level['first_errors']}")
    server.reset_phase_peak()
    time.sleep(args.settle)
    return {
        "answered": level["requests"],
        "steady_rss_bytes": server.phase_peak,
        "peak_rss_bytes": server.peak_rss,
        "wall_s": level["wall_s"],
    }


def part_memory(args: argparse.Namespace, ctx: dict[str, Any]) -> dict:
    n = args.memory_adapters
    names = [f"m{i + 1:02d}" for i in range(n)]
    registry = registry_root(ctx["variants"][:n], names, ctx["model_dir"], ctx["work"] / "memory-adapters")
    merged = ctx["work"] / "merged"
    if not (merged / "config.json").is_file():
        print(f"[memory] kubetune export {ctx['run']} --merged -o {merged}", flush=True)
        run_command([sys.executable, "-m", "kubetune", "export", str(ctx["run"]), "--merged", "-o", str(merged)])
    out: dict[str, Any] = {"adapters": n, "max_loras": args.memory_max_loras or n, "registry": str(registry)}
    extra = ["--adapter-registry", str(registry), "--max-loras", str(args.memory_max_loras or n)]
    arms = (
        ("shared", serve_argv(ctx["model_dir"], free_port(), args, *extra)),
        ("merged", serve_argv(str(merged), free_port(), args)),
    )
    for label, argv in arms:
        out.setdefault("load_average_at_start", {})[label] = os.getloadavg()
        server = start(f"memory-{label}", argv, ctx["log_dir"], args)
        try:
            served = {m["id"] for m in server.models()}
            models = [a for a in names if a in served] if label == "shared" else [base_id(server)] * n
            if label == "shared" and len(models) != n:
                raise RuntimeError(f"the shared server lists {sorted(served)}, not the {n} adapters")
            out[label] = {"argv": argv, **measure_server_memory(server, models, args, ctx["prompts"])}
        finally:
            server.stop()
            out[label]["peak_rss_bytes"] = server.peak_rss
        print(
            f"[memory] {label}: {_gib(out[label]['steady_rss_bytes'])} steady, "
            f"{_gib(out[label]['peak_rss_bytes'])} peak",
            flush=True,
        )
    deployments = args.deployments
    for kind in ("steady", "peak"):
        one, merged_one = out["shared"][f"{kind}_rss_bytes"], out["merged"][f"{kind}_rss_bytes"]
        out[f"ratio_{kind}"] = one / (deployments * merged_one) if merged_one else None
    out["deployments"] = deployments
    return out


# --- 2. mix -----------------------------------------------------------------------------------


def part_mix(args: argparse.Namespace, ctx: dict[str, Any]) -> dict:
    n = args.mix_adapters
    names = [f"x{i + 1:02d}" for i in range(n)]
    registry = registry_root(ctx["variants"][:n], names, ctx["model_dir"], ctx["work"] / "mix-adapters")
    max_loras = args.max_loras or n
    extra = ["--adapter-registry", str(registry), "--max-loras", str(max_loras)]
    argv = serve_argv(ctx["model_dir"], free_port(), args, *extra)
    out: dict[str, Any] = {"adapters": n, "max_loras": max_loras, "concurrency": args.concurrency, "argv": argv}
    out["load_average_at_start"] = os.getloadavg()
    server = start("mix", argv, ctx["log_dir"], args)
    try:
        served = {m["id"] for m in server.models()}
        missing = [a for a in names if a not in served]
        if missing:
            raise RuntimeError(f"adapters not listed in /v1/models: {missing}")
        arms = {"A": [base_id(server)], "B": names}
        c, rpc = args.concurrency, None if args.duration else max(2, math.ceil(32 / args.concurrency))
        if args.requests_per_client:
            rpc = args.requests_per_client
        for label, models in arms.items():  # warm: C requests at once (every model of the arm among them)
            warm = asyncio.run(
                run_level(server.base_url, models, ctx["prompts"], max(c, len(models)), args.max_tokens, 1)
            )
            print(f"[mix] warm {label}: {warm['requests']} requests, {warm['errors']} failed", flush=True)
        out["rounds"] = {"A": [], "B": []}
        for r in range(args.rounds):
            for label in ("A", "B"):
                settled = _settle([server])
                level = asyncio.run(
                    run_level(server.base_url, arms[label], ctx["prompts"], c, args.max_tokens, rpc, args.duration)
                )
                level.pop("samples", None)
                level["settle_s"] = round(settled, 2)
                out["rounds"][label].append(level)
                print(f"[mix] round {r + 1} {label}: {fmt_level(level)}", flush=True)
    finally:
        server.stop()
        out["peak_rss_bytes"] = server.peak_rss
    tps = {k: [lv["tokens_per_s"] or 0.0 for lv in v] for k, v in out["rounds"].items()}
    out["tokens_per_s"] = tps
    out["median_tokens_per_s"] = {k: statistics.median(v) for k, v in tps.items()}
    a, b = out["median_tokens_per_s"]["A"], out["median_tokens_per_s"]["B"]
    out["ratio_b_over_a"] = b / a if a else None
    out["ratio_per_round"] = [y / x if x else None for x, y in zip(tps["A"], tps["B"], strict=True)]
    out["errors"] = sum(lv["errors"] for v in out["rounds"].values() for lv in v)
    return out


# --- 3. latency -------------------------------------------------------------------------------


class AnswerWatch:
    """One thread per replica, each sending the adapter a request every `interval` s until one
    is answered (200): the seconds from `start` to each replica's first answer (`first`), and to
    the sending of that request (`first_sent`: the adapter was there by then)."""

    def __init__(self, urls: list[str], model: str, interval: float = 0.1) -> None:
        self.start = time.perf_counter()
        self.first: dict[str, float] = {}
        self.first_sent: dict[str, float] = {}
        self.last_error: dict[str, str] = {}
        self._threads = [threading.Thread(target=self._poll, args=(u, model, interval), daemon=True) for u in urls]
        self._deadline = self.start + 600
        for t in self._threads:
            t.start()

    def _poll(self, url: str, model: str, interval: float) -> None:
        import httpx

        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
        with httpx.Client(timeout=60, trust_env=False) as client:  # one connection: light on the GIL and the CPUs
            while time.perf_counter() < self._deadline:
                sent = time.perf_counter()
                try:
                    r = client.post(f"{url}/v1/chat/completions", json=body)
                    status, text = r.status_code, r.text[:120]
                except httpx.TransportError as e:
                    status, text = 0, f"{type(e).__name__}: {e}"
                if status == 200:
                    self.first[url] = time.perf_counter() - self.start
                    self.first_sent[url] = sent - self.start
                    return
                self.last_error[url] = f"HTTP {status}: {text}"
                time.sleep(interval)

    def wait(self, timeout: float) -> float:
        self._deadline = min(self._deadline, self.start + timeout)
        for t in self._threads:
            t.join(max(0.0, self._deadline - time.perf_counter()) + 65)
        if len(self.first) < len(self._threads):
            raise RuntimeError(f"not answering on every replica after {timeout:.0f} s: {self.last_error}")
        return max(self.first.values())


def _kmock_cluster(work: Path) -> tuple[Any, Any]:
    """kmock's API server over loopback with the resources of tests/k8s (kube fixture) and
    tests/operator (cluster fixture): (its KmockServer, the tests' Cluster)."""
    import kmock
    from tests.k8s.conftest import RESOURCES, Kube
    from tests.kit.kube import KmockServer
    from tests.operator.conftest import cluster as cluster_fixture

    server = KmockServer({p: kmock.ResourceInfo(kind=k, namespaced=ns) for p, (k, ns) in RESOURCES.items()})
    kubeconfig = work / "kubeconfig"
    kubeconfig.write_text(server.kubeconfig("bench", namespace="kubetune"))
    os.environ["KUBECONFIG"] = str(kubeconfig)
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    kube = Kube(server.emulator, server.url, kubeconfig)
    kube.script_namespace("kubetune")
    return server, cluster_fixture.__wrapped__(kube)


def latency_operator(args: argparse.Namespace, ctx: dict[str, Any], replicas: list[Server], root: Path) -> list[dict]:
    from tests.operator.conftest import INTERVAL, running_operator, wait_for
    from tests.operator.test_modelserver_operator import MS, PYTORCHJOB, _model_server, _pods

    kmock_server, cluster = _kmock_cluster(ctx["work"])
    reps = []
    try:
        _model_server(cluster, ctx["model_dir"], str(root))
        _pods(cluster, replicas)  # type: ignore[arg-type]  # a Server has the .port it reads
        recipe = {"model": {"name_or_path": ctx["model_dir"]}, "train": {"max_steps": 2}, "k8s": {"amx_label": None}}
        with running_operator(cluster):
            wait_for(lambda: (cluster.client.get(*MS, "shared", "kubetune") or {}).get("status"), 30, "ModelServer")
            for i in range(args.reps):
                name = f"op{i + 1:02d}"
                run_dir = ctx["variants"][i % len(ctx["variants"])]
                cluster.apply_finetune(name, {"recipe": recipe, "profile": "cpu", "serve": {"server": "shared"}})
                wait_for(lambda n=name: cluster.get(*PYTORCHJOB, n), 60, "the PyTorchJob")
                cluster.set_status(*PYTORCHJOB, name, {"conditions": [{"type": "Succeeded", "status": "True"}]})
                job_name = f"{name}-adapter-export"
                job = wait_for(lambda j=job_name: cluster.get("batch/v1", "Job", j), 60, "the export Job")
                command = job["spec"]["template"]["spec"]["containers"][0]["command"]
                install_s = run_command(
                    [sys.executable, "-m", "kubetune.export.adapter_install", str(run_dir), *command[4:]]
                )
                served = f"{name}@v1"
                watch = AnswerWatch([r.base_url for r in replicas], served)
                cluster.set_status("batch/v1", "Job", job_name, {"succeeded": 1})

                def loaded(n: str = name) -> bool:
                    c = cluster.condition(n, "AdapterLoaded")
                    return bool(c and c["status"] == "True")

                wait_for(loaded, args.latency_timeout, f"{name} AdapterLoaded")
                loaded_s = time.perf_counter() - watch.start
                answered_s = watch.wait(args.latency_timeout)
                rep = {
                    "name": served,
                    "install_s": install_s,
                    "answered_all_s": answered_s,
                    "answered_per_replica_s": sorted(watch.first.values()),
                    "answer_sent_per_replica_s": sorted(watch.first_sent.values()),
                    "adapter_loaded_s": loaded_s,
                    "total_s": install_s + answered_s,
                    "command": command,
                }
                reps.append(rep)
                print(
                    f"[latency operator] {served}: export {install_s:.2f} s; Job succeeded -> answering on "
                    f"every replica {answered_s:.2f} s, -> AdapterLoaded=True {loaded_s:.2f} s",
                    flush=True,
                )
        rec_interval = INTERVAL
    finally:
        kmock_server.stop()
    for rep in reps:
        rep["operator_interval_s"] = rec_interval
    return reps


def latency_direct(args: argparse.Namespace, ctx: dict[str, Any], replicas: list[Server], root: Path) -> list[dict]:
    import httpx

    reps = []
    for i in range(args.reps):
        name = f"dl{i + 1:02d}"
        run_dir = ctx["variants"][(i + args.reps) % len(ctx["variants"])]
        install_s = install(run_dir, name, ctx["model_dir"], root)
        served, path = f"{name}@v1", str(root / name / "v1")
        load_s: dict[str, float] = {}
        watch = AnswerWatch([], served)  # its clock: the load and the answers from one start

        def load(url: str, s: str = served, p: str = path, w: AnswerWatch = watch, ls: dict = load_s) -> None:
            try:
                body = {"lora_name": s, "lora_path": p}
                r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120, trust_env=False)
                if r.status_code != 200:
                    raise RuntimeError(f"load: HTTP {r.status_code}: {r.text[:200]}")
                ls[url] = time.perf_counter() - w.start
                status, text = answer(url, s)
                if status != 200:
                    raise RuntimeError(f"loaded but not answering: HTTP {status}: {text[:200]}")
                w.first[url] = time.perf_counter() - w.start
            except Exception as e:
                w.last_error[url] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=load, args=(r.base_url,)) for r in replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.latency_timeout)
        if len(watch.first) < len(replicas):
            raise RuntimeError(f"{served}: not answering on every replica: {watch.last_error}")
        answered_s = max(watch.first.values())
        reps.append(
            {
                "name": served,
                "install_s": install_s,
                "load_s": max(load_s.values()),
                "answered_all_s": answered_s,
                "answered_per_replica_s": sorted(watch.first.values()),
                "total_s": install_s + answered_s,
            }
        )
        print(
            f"[latency direct] {served}: export {install_s:.2f} s; load on every replica {max(load_s.values()):.2f} s, "
            f"answering on every replica {answered_s:.2f} s",
            flush=True,
        )
    return reps


def part_latency(args: argparse.Namespace, ctx: dict[str, Any]) -> dict:
    root = ctx["work"] / "latency-adapters"
    root.mkdir(parents=True, exist_ok=True)
    modes = ["operator", "direct"] if args.latency_mode == "both" else [args.latency_mode]
    max_loras = max(args.max_loras or 8, args.reps * len(modes))
    extra = ["--allow-runtime-adapters", "--adapter-registry", str(root / "registry.json")]
    extra += ["--max-loras", str(max_loras)]
    out: dict[str, Any] = {"replicas": 2, "max_loras": max_loras, "reps": args.reps, "modes": {}}
    out["load_average_at_start"] = os.getloadavg()
    replicas: list[Server] = []
    try:
        argvs = {f"replica-{i}": serve_argv(ctx["model_dir"], free_port(), args, *extra) for i in range(2)}
        replicas = start_all(argvs, ctx["log_dir"], args)
        out["argv"] = replicas[0].argv
        for mode in modes:
            fn = latency_operator if mode == "operator" else latency_direct
            reps = fn(args, ctx, replicas, root)
            keys = [k for k in ("install_s", "load_s", "answered_all_s", "adapter_loaded_s", "total_s") if k in reps[0]]
            out["modes"][mode] = {"reps": reps, "median": {k: statistics.median(r[k] for r in reps) for k in keys}}
    finally:
        for server in replicas:
            server.stop()
    return out


# --- the report -------------------------------------------------------------------------------


def _gib(b: int | float | None) -> str:
    return "-" if not b else f"{b / 2**30:.2f} GiB"


def _r(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def report(result: dict) -> str:
    m, cfg = result["machine"], result["config"]
    flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items())
    lines = [
        f"machine: {m['cpu_model']}, {m.get('cpus_usable', m['cpus'])} CPUs usable, {m.get('memory_gib')} GiB; {flags}",
        f"model {cfg['model']}; dtype {cfg['dtype']} ({cfg['dtype_reason']}); adapters from {cfg['run']}",
    ]
    mem = result.get("memory")
    if mem:
        sh, mg, n = mem["shared"], mem["merged"], mem["deployments"]
        lines += [
            "",
            (
                f"memory: one server with {mem['adapters']} adapters (--max-loras {mem['max_loras']}), "
                "each answered once, vs one server of the merged model (same requests)"
            ),
            f"  shared server       steady {_gib(sh['steady_rss_bytes']):>10}  peak {_gib(sh['peak_rss_bytes']):>10}",
            f"  merged, 1 server    steady {_gib(mg['steady_rss_bytes']):>10}  peak {_gib(mg['peak_rss_bytes']):>10}",
            (
                f"  merged, {n} Deployments (taken as {n} x the one measured)"
                f"  steady {_gib(n * mg['steady_rss_bytes'])}  peak {_gib(n * mg['peak_rss_bytes'])}"
            ),
            (
                f"  ratio one / ({n} x merged): steady {_r(mem['ratio_steady'])}, peak {_r(mem['ratio_peak'])}"
                "  (target <= 0.1)"
            ),
        ]
    mix = result.get("mix")
    if mix:
        lines += [
            "",
            (
                f"mix: C={mix['concurrency']}, A = the base alone, B = round-robin over {mix['adapters']} adapters"
                f" (--max-loras {mix['max_loras']}); generated tokens/s per round"
            ),
        ]
        for label in ("A", "B"):
            tps = mix["tokens_per_s"][label]
            lines.append(
                f"  {label}  "
                + " ".join(f"{t:7.1f}" for t in tps)
                + f"   median {mix['median_tokens_per_s'][label]:7.1f}"
            )
        per = " ".join(_r(q) for q in mix["ratio_per_round"])
        lines.append(
            f"  B/A per round {per}; on the medians {_r(mix['ratio_b_over_a'])} (target >= 0.8);"
            f" {mix['errors']} failed requests"
        )
    lat = result.get("latency")
    if lat:
        lines += ["", f"latency: 2 replicas, {lat['reps']} repetitions, medians in s"]
        for mode, rec in lat["modes"].items():
            md = rec["median"]
            if mode == "operator":
                lines.append(
                    f"  operator (timers every {rec['reps'][0]['operator_interval_s']} s): (a) export command "
                    f"{md['install_s']:.2f}; (b) Job succeeded -> answering on every replica {md['answered_all_s']:.2f}"
                    f" (AdapterLoaded=True at {md['adapter_loaded_s']:.2f}); total (a)+(b) {md['total_s']:.2f}"
                )
            else:
                lines.append(
                    f"  direct: (a) export command {md['install_s']:.2f}; (b) POST /v1/load_lora_adapter on every "
                    f"replica {md['load_s']:.2f}, answering on every replica {md['answered_all_s']:.2f};"
                    f" total (a)+(b) {md['total_s']:.2f}"
                )
        lines.append(
            "  (kubetune operator's timers run every --interval s, 15 by default: in a cluster add up to 2"
            " periods to the answer and 3 to AdapterLoaded, and the Job pod's start)"
        )
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: %(default)s")
    ap.add_argument("--run", help="a finished kubetune LoRA run (default: train a tiny one first)")
    ap.add_argument("--model", help="the base's HF model directory (default: the embedded SmolLM2-135M)")
    ap.add_argument("--memory-adapters", type=int, default=20, help="adapters on the shared server (default: 20)")
    ap.add_argument("--memory-max-loras", type=int, help="its --max-loras (default: all of them resident)")
    ap.add_argument("--deployments", type=int, help="merged Deployments compared (default: --memory-adapters)")
    ap.add_argument("--settle", type=float, default=5.0, help="idle seconds after the last answer for the steady RSS")
    ap.add_argument("--mix-adapters", type=int, default=8)
    ap.add_argument("--max-loras", type=int, help="the mix server's --max-loras (default: --mix-adapters)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds of the mix, each arm once per round (>= 2)")
    ap.add_argument("--requests-per-client", type=int, help="default: enough for >= 32 requests per level, >= 2 each")
    ap.add_argument("--duration", type=float, help="seconds per mix level instead of a request count")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--latency-mode", choices=["operator", "direct", "both"], default="operator")
    ap.add_argument("--reps", type=int, default=5, help="latency repetitions per mode (medians reported)")
    ap.add_argument("--latency-timeout", type=float, default=300.0)
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="passed to every server")
    ap.add_argument("--kv-cache-gib", type=float, help="passed to every server (default: each server's own)")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--work-dir", help="adapters, registries, the merged model, logs (default: a new temporary dir)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3/2 adapters, C=4, 16 tokens, 2 rounds, 1 rep")
    args = ap.parse_args(argv)
    if args.quick:
        args.memory_adapters, args.mix_adapters, args.concurrency = 3, 2, 4
        args.max_tokens, args.rounds, args.reps, args.settle = 16, 2, 1, 1.0
        args.requests_per_client = args.requests_per_client or 2
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in args.parts if p not in PARTS]:
        ap.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    if args.rounds < 2 and not args.quick:
        ap.error("--rounds: at least 2 (A/B/A/B)")
    if args.run and not (adapter_path(Path(args.run)) / "adapter_config.json").is_file():
        ap.error(f"--run {args.run}: no adapter/adapter_config.json (a finished kubetune LoRA run is needed)")
    args.deployments = args.deployments or args.memory_adapters
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model_dir = model_or_default(args.model)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="modelserver-bench-")).resolve()
    log_dir = work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    run = Path(args.run).resolve() if args.run else train_tiny_run(work / "tiny-run", log_dir / "train.log")
    mach, dtype, why = the_machine(args.dtype)
    print(f"model {model_dir}; run {run}; work in {work}", flush=True)
    n = max(
        args.memory_adapters if "memory" in args.parts else 0,
        args.mix_adapters if "mix" in args.parts else 0,
        2 * args.reps if "latency" in args.parts else 0,
        1,
    )
    ctx = {
        "model_dir": model_dir,
        "run": run,
        "work": work,
        "log_dir": log_dir,
        "prompts": load_prompts(Path(args.prompts)),
    }
    ctx["variants"] = make_variants(run, work, n)
    result: dict[str, Any] = {
        "bench": "modelserver",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": mach,
        "config": {
            "model": model_dir,
            "run": str(run),
            "dtype": dtype,
            "dtype_reason": why,
            "parts": args.parts,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "prompt_file": args.prompts,
            "work_dir": str(work),
            "argv": sys.argv[1:] if argv is None else argv,
        },
    }
    for part in args.parts:
        fn = {"memory": part_memory, "mix": part_mix, "latency": part_latency}[part]
        try:
            result[part] = fn(args, ctx)
        except Exception as e:
            result[f"{part}_failed"] = f"{type(e).__name__}: {e}"
            print(f"[{part}] failed: {result[f'{part}_failed']}", flush=True)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print()
    print(report(result))
    for part in args.parts:
        if f"{part}_failed" in result:
            print(f"{part}: failed: {result[f'{part}_failed']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
