"""The contract's serving and component metrics are what those processes really export:
contracts/metrics.py names them for the dashboards and alerts, while serve/native/metrics.py, the device
plugin and the extender define them, so a rename on either side must fail here."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubetune.contracts.metrics import COMPONENT_METRICS, SERVE_METRICS, TRAIN_METRICS, Metric, bucket_bounds


def families(text: str) -> set[tuple[str, str]]:
    """(name, type) of each family; a counter's `_created` timestamps (which the text parser reads
    as gauges of their own when the name has a colon) are part of the counter, not a metric."""
    parsed = text_string_to_metric_families(text)
    return {(f.name.removesuffix("_total"), f.type) for f in parsed if not f.name.endswith("_created")}


def promised(metrics: tuple[Metric, ...]) -> set[tuple[str, str]]:
    return {(m.name.removesuffix("_total"), m.kind) for m in metrics}


def test_the_server_exports_the_contracts_serving_metrics():
    from kubetune.serve.native.metrics import ServeMetrics

    registry = ServeMetrics("base", max_lora=2, adapter_names=["a"]).registry
    assert families(generate_latest(registry).decode()) == promised(SERVE_METRICS)


def test_the_servers_help_labels_and_buckets_are_the_contracts():
    """Beyond names and types: each family's help text, label names and (histograms) bucket
    bounds are the contract's, which are vLLM's (a gateway filters on the labels)."""
    from kubetune.serve.native.metrics import ServeMetrics

    served = ServeMetrics("base", max_lora=2, adapter_names=["a"], max_model_len=1000)
    served.state(0, 0, 0.0, [], [])  # the adapters' info series exists from the first engine turn
    exported = {
        f.name.removesuffix("_total"): f
        for f in text_string_to_metric_families(generate_latest(served.registry).decode())
    }
    for m in SERVE_METRICS:
        family = exported[m.name.removesuffix("_total")]
        labels = {name for s in family.samples for name in s.labels} - {"le"}
        assert (family.documentation, labels) == (m.help, set(m.labels)), m.name
        if m.kind == "histogram":
            bounds = {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
            assert bounds == {*bucket_bounds(m, 1000), float("inf")}, m.name


def test_the_components_export_the_contracts_component_metrics():
    from fastapi.testclient import TestClient

    from kubetune.cluster.deviceplugin.metrics import PluginMetrics
    from kubetune.cluster.extender.app import create_app

    plugin = families(generate_latest(PluginMetrics().registry).decode())
    extender = families(TestClient(create_app()).get("/metrics").text)
    assert plugin | extender == promised(COMPONENT_METRICS)


def test_the_components_help_and_labels_are_the_contracts():
    from fastapi.testclient import TestClient

    from kubetune.cluster.deviceplugin.metrics import PluginMetrics
    from kubetune.cluster.extender.app import create_app

    plugin = PluginMetrics()
    plugin.set_health("habana.ai/gaudi", {"card0": "Healthy"})
    for counter in (plugin.allocations, plugin.allocated_devices, plugin.allocate_errors, plugin.registrations):
        counter.labels("habana.ai/gaudi").inc(0)
    plugin.driver_present.labels("habana.ai/gaudi").set(1)
    client = TestClient(create_app())
    client.post("/filter", content=b"{}")  # one observation, so the histogram's labels show
    text = generate_latest(plugin.registry).decode() + client.get("/metrics").text
    exported = {f.name.removesuffix("_total"): f for f in text_string_to_metric_families(text)}
    for m in COMPONENT_METRICS:
        family = exported[m.name.removesuffix("_total")]
        labels = {name for s in family.samples for name in s.labels} - {"le"}
        assert (family.documentation, labels) == (m.help, set(m.labels)), m.name


def test_every_histogram_names_a_bucket_family_and_nothing_else_does():
    """`instrument` draws a histogram's buckets from its row: a row without a family would fail
    only when its exporter starts."""
    for m in TRAIN_METRICS + SERVE_METRICS + COMPONENT_METRICS:
        assert (m.kind == "histogram") == bool(m.buckets), m.name
        if m.buckets:
            assert bucket_bounds(m, max_model_len=1000), m.name
