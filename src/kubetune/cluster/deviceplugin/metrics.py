"""Prometheus metrics of the device plugin (one registry per plugin, so tests stay isolated).

Names, kinds, help texts and labels are `kubetune.contracts.metrics.COMPONENT_METRICS`'s (the
dashboards read them there).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from kubetune.contracts.metrics import component_metric, instrument


class PluginMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.devices = self._make("kubetune_deviceplugin_devices")
        self.allocations = self._make("kubetune_deviceplugin_allocations")
        self.allocated_devices = self._make("kubetune_deviceplugin_allocated_devices")
        self.allocate_errors = self._make("kubetune_deviceplugin_allocate_errors")
        self.driver_present = self._make("kubetune_deviceplugin_driver_present")
        self.registrations = self._make("kubetune_deviceplugin_registrations")

    def _make(self, name: str) -> Any:
        return instrument(component_metric(name), self.registry)

    def set_health(self, resource: str, health: dict[str, str]) -> None:
        from kubetune.cluster.devices.discovery import HEALTHY, UNHEALTHY

        for state in (HEALTHY, UNHEALTHY):
            self.devices.labels(resource, state).set(sum(1 for h in health.values() if h == state))
