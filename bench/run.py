"""The headline benchmarks in one run and one table: each side-by-side benchmark of
BENCHMARKS.md's headline table, run one after another as its own command (the one
bench/README.md lists), its figures read from what it prints, one row per figure:
benchmark, kubetune, baseline, kubetune/baseline, CPU.

    .venv/bin/python bench/run.py --headline                         # short settings: minutes
    .venv/bin/python bench/run.py --headline --full                  # the settings BENCHMARKS.md records
    .venv/bin/python bench/run.py --headline --only placement,extender
    .venv/bin/python bench/run.py --headline --only train --record   # keep its training ratio as this CPU class's
    .venv/bin/python bench/run.py                                    # lists the benchmarks and their commands

The training ratio (kubetune / HF Trainer fp32) is compared with the last one recorded for the
same CPU class (AMX, AVX-512-BF16, AVX-512, AVX2) and settings in
bench/results/training-ratio-record.json: a drop of more than 15% is flagged (a DROP line, exit 1).

The short settings answer "did anything move by a lot?" on a laptop; the figures of record
come from --full on an otherwise idle machine (the benchmarks share its cores with nothing
else). The serving row is against vLLM where scripts/vllm_venv.sh has made .venv-vllm, and
against the one-request-at-a-time HF server otherwise. Each command's output is kept in
--log-dir.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: bench.common from this checkout

from bench.common.serving import REPO, machine


@dataclass(frozen=True)
class Row:
    benchmark: str
    kubetune: str
    baseline: str
    ratio: float | None  # kubetune / baseline, in the benchmark's own figure


@dataclass(frozen=True)
class Headline:
    name: str
    question: str  # the BENCHMARKS.md section that records it
    script: str  # under bench/
    quick: tuple[str, ...]
    full: tuple[str, ...]
    read: Callable[[str, Path], list[Row]]  # (its stdout, its scratch directory) -> rows


def _last_json(stdout: str) -> dict:
    """The JSON line a script prints last (its results), wherever its output ends."""
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def _search(pattern: str, stdout: str) -> re.Match:
    """The last match of `pattern`: what a script prints last is its summary."""
    matches = list(re.finditer(pattern, stdout))
    if not matches:
        raise ValueError(f"no line matching {pattern!r} in its output")
    return matches[-1]


def read_train_vs_hf(stdout: str, _: Path) -> list[Row]:
    results = _last_json(stdout)["results"]
    kt, hf = results["kubetune"], results["hf-fp32"]
    speed, rss = kt["tokens_per_s"], kt["peak_rss_mb"]
    return [
        Row(
            "training tokens/s (LoRA, SmolLM2-135M)",
            f"{speed:.0f} ({kt['dtype']})",
            f"{hf['tokens_per_s']:.0f} (HF fp32)",
            speed / hf["tokens_per_s"],
        ),
        Row("training peak RSS, MB", f"{rss:.0f}", f"{hf['peak_rss_mb']:.0f} (HF fp32)", rss / hf["peak_rss_mb"]),
    ]


def read_serve_load(_: str, scratch: Path) -> list[Row]:
    arms = json.loads((scratch / "serve-load.json").read_text())["arms"]
    baseline = "vllm" if arms.get("vllm", {}).get("levels") else "naive"
    levels = {
        arm: {lv["concurrency"]: lv for lv in arms.get(arm, {}).get("levels", [])} for arm in ("kubetune", baseline)
    }
    both = sorted(set(levels["kubetune"]) & set(levels[baseline]))
    if not both:
        why = arms.get(baseline, {}).get("status") or "no level ran in both arms"
        return [Row("serving tokens/s", "-", f"{baseline}: {why}", None)]
    c = both[-1]
    kt, other = levels["kubetune"][c]["tokens_per_s"], levels[baseline][c]["tokens_per_s"]
    return [Row(f"serving tokens/s at {c} clients", f"{kt:.0f}", f"{other:.0f} ({baseline})", kt / other)]


def read_structured_cost(stdout: str, _: Path) -> list[Row]:
    grammar = float(_search(r"mask \+ advance per token: median ([\d.]+) ms", stdout)[1])
    step = float(_search(r"decode step, .*: median ([\d.]+) ms", stdout)[1])
    return [
        Row("structured output: grammar per token, ms", f"{grammar:.3f}", f"{step:.2f} (decode step)", grammar / step)
    ]


def read_placement(stdout: str, _: Path) -> list[Row]:
    load = _search(r"offered load ([\d.]+)", stdout)[1]
    pairs = _search(r"kubetune vs default: .*cross-leaf pairs (\d+) vs (\d+)", stdout)
    ours, default = int(pairs[1]), int(pairs[2])
    ratio = ours / default if default else None
    return [
        Row(f"placement: cross-leaf worker pairs at load {load}", str(ours), f"{default} (default scheduler)", ratio)
    ]


def read_extender(stdout: str, _: Path) -> list[Row]:
    worst = _search(r"worst p99 at (\d+) nodes: ([\d.]+) ms \(target < (\d+) ms", stdout)
    p99, target = float(worst[2]), float(worst[3])
    return [Row(f"extender p99 at {worst[1]} nodes, ms", f"{p99:.1f}", f"{target:.0f} (target)", p99 / target)]


def read_monitor(stdout: str, _: Path) -> list[Row]:
    m = _search(r"median tokens/s off ([\d.]+), on ([\d.]+)", stdout)
    off, on = float(m[1]), float(m[2])
    return [Row("training tokens/s with metrics on", f"{on:.1f}", f"{off:.1f} (metrics off)", on / off)]


RECORD = REPO / "bench" / "results" / "training-ratio-record.json"
DROP_FLAGGED = 0.15  # a training ratio this much below the record for the CPU class is flagged


def cpu_class(flags: dict[str, bool]) -> str:
    """The class of CPU a training figure belongs to: what its fastest matmul unit is."""
    if flags.get("amx_bf16"):
        return "amx"
    if flags.get("avx512_bf16"):
        return "avx512-bf16"
    if flags.get("avx512f"):
        return "avx512"
    return "avx2" if flags.get("avx2") else "other"


def training_guard(rows: list[Row], cpu: str, settings: str, record: dict) -> str | None:
    """The training ratio against the last one recorded for this CPU class and settings; the
    line starts with DROP when it fell by more than DROP_FLAGGED."""
    row = next((r for r in rows if r.benchmark.startswith("training tokens/s") and r.ratio), None)
    if row is None or row.ratio is None:
        return None
    last = record.get(cpu, {}).get(settings)
    if last is None:
        return f"training ratio {row.ratio:.2f} on {cpu} ({settings}): none recorded for this CPU class yet"
    change = row.ratio / last["ratio"] - 1
    verdict = "DROP" if change < -DROP_FLAGGED else "ok"
    return (
        f"{verdict}: training ratio {row.ratio:.2f} on {cpu} ({settings}) vs {last['ratio']:.2f} recorded "
        f"{last['date']} at {last['commit']}: {change:+.0%} (flagged below -{DROP_FLAGGED:.0%})"
    )


def record_training(rows: list[Row], cpu: str, settings: str, path: Path = RECORD) -> None:
    """--record: keep this run's training ratio as the one later runs on this CPU class compare with."""
    row = next((r for r in rows if r.benchmark.startswith("training tokens/s") and r.ratio), None)
    if row is None or row.ratio is None:
        return
    record = json.loads(path.read_text()) if path.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    record.setdefault(cpu, {})[settings] = {
        "ratio": round(row.ratio, 3),
        "kubetune": row.kubetune,
        "baseline": row.baseline,
        "commit": commit.stdout.strip(),
        "date": time.strftime("%Y-%m-%d"),
    }
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def vllm_ready() -> bool:
    return (REPO / ".venv-vllm" / "bin" / "python").is_file()


def serve_arms() -> str:
    return "kubetune,vllm" if vllm_ready() else "kubetune,naive"


def headlines() -> list[Headline]:
    serve = ("--arms", serve_arms())
    return [
        Headline(
            "train",
            "Training speed and memory vs HF Trainer",
            "train/train_vs_hf.py",
            ("--rows", "16", "--eval-rows", "8", "--arms", "kubetune,hf-fp32"),
            ("--arms", "kubetune,hf-fp32"),
            read_train_vs_hf,
        ),
        Headline(
            "serve",
            "Serving vs vLLM",
            "serve/serve_load.py",
            ("--quick", *serve),
            serve,
            read_serve_load,
        ),
        Headline(
            "structured",
            "What structured output costs",
            "serve/structured_cost.py",
            ("--rounds", "3", "--decode-step"),
            ("--decode-step",),
            read_structured_cost,
        ),
        Headline(
            "placement",
            "Cluster components",
            "cluster/cluster_placement_sim.py",
            ("--jobs", "200", "--loads", "0.9"),
            (),
            read_placement,
        ),
        Headline(
            "extender",
            "Cluster components",
            "cluster/extender_latency.py",
            ("--quick", "--sizes", "100,1000"),
            (),
            read_extender,
        ),
        Headline(
            "monitor",
            "What monitoring costs",
            "monitor/monitor_overhead.py",
            ("--rounds", "1", "--steps", "60"),
            ("--rounds", "3"),
            read_monitor,
        ),
    ]


def command(h: Headline, full: bool, scratch: Path, train_extra: str = "") -> list[str]:
    argv = [sys.executable, str(REPO / "bench" / h.script), *(h.full if full else h.quick)]
    if h.name == "serve":
        argv += ["--json", str(scratch / "serve-load.json")]
    if h.name == "train" and train_extra:
        argv += ["--kt-extra", train_extra]
    return argv


def shown(argv: list[str]) -> str:
    """The command as bench/README.md writes it: from the repository root."""
    return " ".join([".venv/bin/python", *argv[1:]]).replace(f"{REPO}/", "")


def run_one(h: Headline, args: argparse.Namespace, log_dir: Path) -> list[Row]:
    scratch = Path(tempfile.mkdtemp(prefix=f"{h.name}-", dir=log_dir))
    argv = command(h, args.full, scratch, args.train_extra)
    timeout = args.timeout
    print(f"== {h.name}: {shown(argv)}", flush=True)
    start = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [Row(h.name, "-", f"not finished in {timeout:.0f} s", None)]
    (log_dir / f"{h.name}.log").write_text(done.stdout + done.stderr)
    print(f"   {time.monotonic() - start:.0f} s, log {log_dir / f'{h.name}.log'}", flush=True)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return [Row(h.name, "-", f"failed (exit {done.returncode}): {last[0][:120]}", None)]
    try:
        return h.read(done.stdout, scratch)
    except (ValueError, KeyError, IndexError, OSError) as err:  # a script whose summary changed shape
        return [Row(h.name, "-", f"figures not found: {err}", None)]


def table(rows: list[Row], cpu: str) -> str:
    lines = ["| benchmark | kubetune | baseline | kubetune/baseline | CPU |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r.ratio:.3g}" if r.ratio is not None else "-"  # 3 digits: a grammar's share is ~0.001
        lines.append(f"| {r.benchmark} | {r.kubetune} | {r.baseline} | {ratio} | {cpu} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [h.name for h in headlines()]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--headline", action="store_true", help="run the headline benchmarks and print the table")
    ap.add_argument("--full", action="store_true", help="the settings BENCHMARKS.md records (an hour or more)")
    ap.add_argument("--only", help=f"comma-separated, of: {', '.join(names)}")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per benchmark (default: %(default)s)")
    ap.add_argument("--log-dir", help="where each command's output goes (default: a new temporary directory)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--record", action="store_true", help=f"keep the training ratio in {RECORD.name} (this CPU class)")
    # key=value overrides for kubetune's training arm: how the guard is shown to catch a slowdown
    ap.add_argument("--train-extra", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.only = args.only.split(",") if args.only else names
    unknown = sorted(set(args.only) - set(names))
    if unknown:
        ap.error(f"--only: unknown {', '.join(unknown)} (known: {', '.join(names)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [h for h in headlines() if h.name in args.only]
    if not args.headline:
        for h in chosen:
            print(f"{h.name:11s} {h.question}\n{'':11s} {shown(command(h, args.full, Path('SCRATCH')))}")
        return 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-headline-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    cpu, kind = info["cpu_model"], cpu_class(info["flags"])
    rows = [row for h in chosen for row in run_one(h, args, log_dir)]
    print()
    print(table(rows, cpu))
    settings = "full" if args.full else "quick"
    guard = training_guard(rows, kind, settings, json.loads(RECORD.read_text()) if RECORD.exists() else {})
    if guard:
        print(f"\n{guard}")
    if args.record:
        record_training(rows, kind, settings)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return 0 if all(r.ratio is not None for r in rows) and not (guard or "").startswith("DROP") else 1


if __name__ == "__main__":
    raise SystemExit(main())
