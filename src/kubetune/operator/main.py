"""`kubetune operator`: run kopf with the FineTune handlers until interrupted."""

from __future__ import annotations

import asyncio


def run_operator(namespaces: list[str], interval: float = 15.0, liveness: str | None = None) -> None:
    """Watch `namespaces` (empty = every namespace). Standalone: one replica, no kopf peering
    objects to install (the Helm chart runs one replica with the Recreate strategy). `liveness`:
    the URL kopf serves its health probe at (kopf's --liveness), which the chart's pod probes."""
    import kopf

    from kubetune.operator.handlers import register

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
