"""A real Prometheus (Debian's 2.42, `scripts/bootstrap.sh --dev`) on loopback, and a replay
exporter that serves recorded-format samples of the third-party exporters: the fixtures of
tests/monitor/conftest.py are built from these, and the end-to-end test reuses them.

`running_prometheus(tmp, jobs, rule_files)` starts `/usr/bin/prometheus` on a free loopback
port with a generated config (scrape and evaluation interval 1 s, TSDB in `tmp`), waits until
it is ready and stops it on exit. `scrape_job(name, url)` builds one static scrape job; use
`honor_labels=True` for kubetune's training processes scraped directly, whose own `job` label
must win over the scrape job's name (a PodMonitor gets the same result by relabelling).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from kubetune.netutil import free_port, wait_ready

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
SKIP_ENV = "KUBETUNE_SKIP_PROMETHEUS"
SCRAPE_INTERVAL_S = 1


def require(binary: str) -> str:
    """The binary's path; a missing one fails the test (CI must have it) unless KUBETUNE_SKIP_PROMETHEUS=1."""
    found = binary if Path(binary).is_file() else shutil.which(Path(binary).name)
    if found:
        return found
    message = f"{binary} is missing: run `scripts/bootstrap.sh --dev` as root (installs Debian's prometheus)"
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{message}; skipped because {SKIP_ENV}=1")
    pytest.fail(f"{message}, or set {SKIP_ENV}=1 to skip the Prometheus tests")


def scrape_job(name: str, url: str, honor_labels: bool = False, labels: dict[str, str] | None = None) -> dict:
    """A static scrape job for the exporter at `url` (http://host:port/path)."""
    parts = urlsplit(url)
    job: dict = {
        "job_name": name,
        "metrics_path": parts.path or "/metrics",
        "static_configs": [{"targets": [parts.netloc], "labels": dict(labels or {})}],
    }
    if honor_labels:
        job["honor_labels"] = True
    return job


class PrometheusProcess:
    def __init__(self, url: str, process: subprocess.Popen, log: Path) -> None:
        self.url, self.process, self.log = url, process, log
        self.http = httpx.Client(base_url=url, timeout=10)

    def query(self, expr: str) -> list[dict]:
        body = self.http.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets(self) -> list[dict]:
        return self.http.get("/api/v1/targets").json()["data"]["activeTargets"]

    def expressions_without_data(self, variables: dict[str, str] | None = None) -> list[str]:
        """Every dashboard panel query and alert signal (kubetune.monitor.expressions) that returns
        no finite value here: [] is the end-to-end claim "every panel and alert has data". An alert's
        rule itself returns data only while it fires; promtool tests those (test_rules.py)."""
        from kubetune.monitor.expressions import all_expressions

        empty = []
        for e in all_expressions():
            if e.kind == "alert":
                continue
            values = [float(s["value"][1]) for s in self.query(e.expanded(variables))]
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{e.kind} {e.where}: {e.expanded(variables)} -> {values} (reads {', '.join(e.metrics)})")
        return empty

    def wait_for_scrapes(self, samples: int = 3, down: tuple[str, ...] = (), timeout: float = 30) -> None:
        """Until every target is up (but those of the scrape jobs `down`, which must be down) and
        has been scraped `samples` times (rate() needs two)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            targets = self.targets()
            counts = self.query(f"sum_over_time(up[{samples * 2}s])")
            scraped = {(c["metric"].get("job"), c["metric"].get("instance")): float(c["value"][1]) for c in counts}
            healthy = all((t["health"] == "down") == (t["scrapePool"] in down) for t in targets)
            keys = [
                (t["labels"].get("job"), t["labels"].get("instance")) for t in targets if t["scrapePool"] not in down
            ]
            if targets and healthy and all(scraped.get(key, 0) >= samples for key in keys):
                return
            time.sleep(0.25)
        raise AssertionError(f"targets not scraped {samples} times in {timeout}s: {self.targets()}")


@contextlib.contextmanager
def running_prometheus(tmp: Path, jobs: list[dict], rule_files: tuple[Path, ...] = ()) -> Iterator[PrometheusProcess]:
    binary = require(PROMETHEUS)
    tmp.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": jobs,
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    log = tmp / "prometheus.log"
    argv = [
        binary,
        f"--config.file={tmp / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
    ]
    with open(log, "wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/-/ready", 30, process=process, log=log)
        prom = PrometheusProcess(url, process, log)
        yield prom
        prom.http.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---------------------------------------------------------------------------------- replay exporter


class ReplayExporter:
    """Serves `path -> text` (a function of the scrape count, so counters grow) on loopback."""

    def __init__(self, routes: dict[str, Callable[[int], str]]) -> None:
        self.routes = routes
        self.scrapes: dict[str, int] = {}
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = exporter.routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                n = exporter.scrapes[self.path] = exporter.scrapes.get(self.path, 0) + 1
                body = route(n).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # quiet: pytest shows failures, not scrapes
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
