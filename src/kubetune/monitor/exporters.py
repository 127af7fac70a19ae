"""Where each metric a dashboard or alert names comes from.

kubetune's own names come from `kubetune.contracts.metrics`; the others are the third-party
exporters a kube-prometheus-stack cluster (plus the accelerator vendors' exporters) runs.
A panel that names a metric in neither is a bug the tests catch: it would stay empty forever.
`kubetune monitor check` uses `source_of` to say which exporter to look at when a panel has no
data.
"""

from __future__ import annotations

from kubetune.contracts.metrics import COMPONENT_METRICS, SERVE_METRICS, TRAIN_METRICS, Metric, exposed_names

NODE_EXPORTER = "node-exporter (kube-prometheus-stack's prometheus-node-exporter)"
CADVISOR = "cAdvisor (the kubelet's /metrics/cadvisor, scraped by kube-prometheus-stack)"
DCGM = "NVIDIA's DCGM exporter (GPU Operator or the dcgm-exporter chart)"
GAUDI = "Intel's Gaudi metric exporter (habana metric-exporter DaemonSet)"

# The third-party series the dashboards read, with the exporter that serves each.
THIRD_PARTY: dict[str, str] = {
    **dict.fromkeys(
        (
            "node_cpu_seconds_total",
            "node_memory_MemAvailable_bytes",
            "node_memory_MemTotal_bytes",
            "node_network_receive_bytes_total",
            "node_network_transmit_bytes_total",
        ),
        NODE_EXPORTER,
    ),
    **dict.fromkeys(("container_cpu_usage_seconds_total", "container_memory_working_set_bytes"), CADVISOR),
    **dict.fromkeys(
        (
            "DCGM_FI_DEV_GPU_UTIL",
            "DCGM_FI_DEV_FB_USED",
            "DCGM_FI_DEV_FB_FREE",
            "DCGM_FI_DEV_POWER_USAGE",
            "DCGM_FI_DEV_GPU_TEMP",
        ),
        DCGM,
    ),
    **dict.fromkeys(
        (
            "habanalabs_utilization",
            "habanalabs_memory_used_bytes",
            "habanalabs_memory_total_bytes",
            "habanalabs_power_mW",
            "habanalabs_temperature_onchip",
        ),
        GAUDI,
    ),
}

_KUBETUNE_SOURCES: tuple[tuple[tuple[Metric, ...], str], ...] = (
    (TRAIN_METRICS, "kubetune's training pods (their PodMonitor <job>-metrics, port `metrics`)"),
    (SERVE_METRICS, "the servers (kubetune serve or vLLM; ServiceMonitor <name>, port `http`)"),
    (COMPONENT_METRICS, "kubetune's device plugin or scheduler extender (kubetune k8s render-components)"),
)


def kubetune_names() -> dict[str, str]:
    """Every series name kubetune's processes expose -> who exposes it."""
    return {name: source for metrics, source in _KUBETUNE_SOURCES for m in metrics for name in exposed_names(m)}


def known_metrics() -> dict[str, str]:
    """Every series name a panel or alert may name -> who exposes it."""
    return {**THIRD_PARTY, **kubetune_names()}


def source_of(name: str) -> str | None:
    return known_metrics().get(name)
