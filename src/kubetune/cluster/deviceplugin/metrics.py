"""Prometheus metrics of the device plugin (one registry per plugin, so tests stay isolated)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class PluginMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.devices = Gauge(
            "kubetune_deviceplugin_devices",
            "Cards advertised to the kubelet, by health.",
            ["resource", "health"],
            registry=self.registry,
        )
        self.allocations = Counter(
            "kubetune_deviceplugin_allocations",
            "Containers given cards by Allocate.",
            ["resource"],
            registry=self.registry,
        )
        self.allocated_devices = Counter(
            "kubetune_deviceplugin_allocated_devices",
            "Cards handed out by Allocate.",
            ["resource"],
            registry=self.registry,
        )
        self.allocate_errors = Counter(
            "kubetune_deviceplugin_allocate_errors",
            "Allocate calls refused (unknown or unhealthy ids).",
            ["resource"],
            registry=self.registry,
        )
        self.driver_present = Gauge(
            "kubetune_deviceplugin_driver_present",
            "1 when the node's driver answers; 0 while the plugin waits for it, advertising 0 cards.",
            ["resource"],
            registry=self.registry,
        )
        self.registrations = Counter(
            "kubetune_deviceplugin_registrations",
            "Successful Register calls to the kubelet.",
            ["resource"],
            registry=self.registry,
        )

    def set_health(self, resource: str, health: dict[str, str]) -> None:
        from kubetune.cluster.deviceplugin.discovery import HEALTHY, UNHEALTHY

        for state in (HEALTHY, UNHEALTHY):
            self.devices.labels(resource, state).set(sum(1 for h in health.values() if h == state))
