"""Training progress pushed to the Kubeflow Trainer: TrainJob `status.trainerStatus`.

The contract is Kubeflow Trainer's KEP-2779 (TrainJob progress), as the Kubeflow SDK's
`update_trainjob_status` implements it: when the TrainJobStatus feature gate is on, the
Trainer injects into every training container
- KUBEFLOW_TRAINER_SERVER_URL: the HTTPS endpoint of this TrainJob's status;
- KUBEFLOW_TRAINER_SERVER_CA_CERT: a file with the CA that signs that endpoint;
- KUBEFLOW_TRAINER_SERVER_TOKEN: a file with a projected service-account token (it rotates:
  read it again for each request).
Rank 0 POSTs `{"trainerStatus": {"progressPercentage", "estimatedRemainingSeconds",
"metrics": [{"name", "value"}], "lastUpdatedTime"}}` with `Authorization: Bearer <token>`,
at most every 5 s. A push that fails never stops training: it is said once, then retried
quietly at the next interval.

Pushes run on a background thread that holds only the newest status, so a slow or hung
endpoint never delays a training step. The SDK itself is not a dependency: it pulls the
whole Kubeflow client for one POST, and its module-level throttle would drop the final 100%.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.request
from collections.abc import Mapping
from datetime import datetime, timezone

log = logging.getLogger("kubetune")

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_S = 5.0
TIMEOUT_S = 5.0


def status_body(percent: float, eta_s: float | None, metrics: Mapping[str, float | int | str]) -> dict:
    """The request body of the contract (values of `metrics` serialised as strings)."""
    status: dict = {
        "progressPercentage": max(0, min(100, int(percent))),
        "metrics": [{"name": k, "value": str(v)} for k, v in metrics.items()],
        "lastUpdatedTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if eta_s is not None:
        status["estimatedRemainingSeconds"] = max(0, int(eta_s))
    return {"trainerStatus": status}


class KubeflowProgress:
    """Rank 0's pusher; `from_env()` is None outside a TrainJob with the gate on."""

    def __init__(self, url: str, ca_file: str | None, token_file: str | None):
        self.url, self.ca_file, self.token_file = url, ca_file, token_file
        self._pending: dict | None = None
        self._last_sent = 0.0
        self._warned = False
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kubeflow-progress", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KubeflowProgress | None:
        env = os.environ if env is None else env
        url = env.get(URL_ENV)
        return cls(url, env.get(CA_ENV), env.get(TOKEN_ENV)) if url else None

    def update(self, percent: float, eta_s: float | None, metrics: Mapping[str, float | int | str]) -> None:
        """Queue the newest status (cheap: the thread sends it when the interval allows)."""
        with self._wake:
            self._pending = status_body(percent, eta_s, metrics)
            self._wake.notify()

    def close(self, timeout_s: float = TIMEOUT_S + 1) -> None:
        """Send what is pending now (the final 100%), then stop."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._pending is None:
                    return
                wait = self._last_sent + MIN_INTERVAL_S - time.monotonic()
                if wait > 0 and not self._closed:
                    self._wake.wait(wait)
                    continue
                body, self._pending = self._pending, None
            self._send(body)
            self._last_sent = time.monotonic()

    def _send(self, body: dict) -> None:
        try:
            request = urllib.request.Request(
                self.url,
                data=json.dumps(body).encode(),
                headers={"Authorization": f"Bearer {self._token()}", "Content-Type": "application/json"},
                method="POST",
            )
            context = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
                response.read()
        except Exception as e:  # never stop training for progress: say it once
            if not self._warned:
                self._warned = True
                log.warning("kubeflow progress: push to %s failed (%s); training goes on", self.url, e)

    def _token(self) -> str:
        if not self.token_file:
            return ""
        with open(self.token_file, encoding="utf-8") as f:
            return f.read().strip()
