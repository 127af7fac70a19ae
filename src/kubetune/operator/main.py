"""`kubetune operator`: run kopf with the FineTune handlers until interrupted."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kubetune.operator")


class _UsersLines(logging.Filter):
    """What `kubectl logs deploy/kubetune-operator` shows: kubetune's own lines (one per thing the
    operator decides or does to a FineTune) and anyone's warnings and errors (kopf's retries and
    refusals). kopf's INFO lines ("Handler '_follow' succeeded." on every timer tick) stay out of
    the log; kopf still posts them as the FineTune's Events, which this filter does not touch."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.startswith("kubetune")


def configure_logging() -> None:
    """kopf's own set-up (what its CLI does before `kopf run`): one line per record on stderr,
    `[time] logger [LEVEL] [namespace/name] message`, kopf's object lines prefixed as kubetune's are."""
    import kopf

    kopf.configure(log_format=kopf.LogFormat.FULL, log_prefix=True)
    for handler in logging.getLogger().handlers:  # kopf's stream handler, the only one kopf.configure leaves
        handler.addFilter(_UsersLines())


def run_operator(namespaces: list[str], interval: float = 15.0, liveness: str | None = None) -> None:
    """Watch `namespaces` (empty = every namespace). Standalone: one replica, no kopf peering
    objects to install (the Helm chart runs one replica with the Recreate strategy). `liveness`:
    the URL kopf serves its health probe at (kopf's --liveness), which the chart's pod probes."""
    import kopf

    from kubetune.operator.handlers import register

    configure_logging()
    scope = "namespaces " + ", ".join(namespaces) if namespaces else "every namespace"
    log.info("watching FineTunes in %s; looking at each job every %gs", scope, interval)
    registry = kopf.OperatorRegistry()
    register(registry, interval=interval)
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=True,
            namespaces=namespaces,
            clusterwide=not namespaces,
            liveness_endpoint=liveness,
        )
    )
