"""A small client of Prometheus's HTTP API (`/api/v1/...`): what `kubetune monitor check` and
`render_panels_png` ask it. Every failure is one UserError line naming the URL and the fix."""

from __future__ import annotations

from typing import Any

import httpx

from kubetune.errors import UserError

TIMEOUT_S = 10.0
PORT_FORWARD_HINT = (
    "is it reachable? e.g. `kubectl -n monitoring port-forward svc/kube-prometheus-stack-prometheus 9090` "
    "and --prometheus http://127.0.0.1:9090"
)


class Prometheus:
    def __init__(self, url: str, timeout: float = TIMEOUT_S) -> None:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--prometheus {url}: give a URL, e.g. http://127.0.0.1:9090")
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        try:
            response = self._http.get(path, params=params)
        except httpx.HTTPError as e:
            raise UserError(
                f"cannot reach Prometheus at {self.url} ({type(e).__name__}: {e}); {PORT_FORWARD_HINT}"
            ) from None
        try:
            body = response.json()
        except ValueError:
            raise UserError(
                f"{self.url}{path} answered {response.status_code} without JSON: is {self.url} a Prometheus server?"
            ) from None
        if body.get("status") != "success":
            raise UserError(f"Prometheus at {self.url}: {path} failed: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series (`metric` labels, `value` [time, text])."""
        data = self._get("/api/v1/query", {"query": expr})
        result: list[dict[str, Any]] = data["result"] if data.get("resultType") in ("vector", "matrix") else []
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query's series (`metric` labels, `values` [[time, text], ...])."""
        data = self._get("/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step})
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (`scrapePool`, `labels`, `health`, `lastError`, `scrapeUrl`)."""
        targets: list[dict[str, Any]] = self._get("/api/v1/targets", {"state": "active"})["activeTargets"]
        return targets

    def config(self) -> str:
        """The configuration Prometheus runs (YAML text): with the Prometheus Operator, every
        selected monitor appears as scrape jobs named `podMonitor/<ns>/<name>/<i>` etc."""
        config: str = self._get("/api/v1/status/config")["yaml"]
        return config

    def has_series(self, metric: str, matchers: str = "") -> bool:
        return bool(self.query(f"count({metric}{{{matchers}}})" if matchers else f"count({metric})"))
