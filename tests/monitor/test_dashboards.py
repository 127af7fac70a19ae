"""The dashboards: every metric a panel or alert names is exported by someone, the shipped JSON
is what the code builds, the Grafana JSON is laid out and wired as Grafana expects."""

from __future__ import annotations

import json

import pytest

from kubetune.contracts.metrics import COMPONENT_METRICS, SERVE_METRICS, TRAIN_METRICS, exposed_names
from kubetune.monitor import dashboards as d
from kubetune.monitor.exporters import THIRD_PARTY, known_metrics
from kubetune.monitor.expressions import Expression, all_expressions, expand, metric_names
from kubetune.monitor.grafana import GRID_COLUMNS, Dashboard, Panel, Row, Target


def unknown_metrics(expressions) -> list[str]:
    known = known_metrics()
    return [f"{e.where}: {m}" for e in expressions for m in e.metrics if m not in known]


def test_every_panel_and_alert_names_only_exported_metrics():
    expressions = all_expressions()
    assert len({e.kind for e in expressions}) == 3 and all(e.metrics for e in expressions)
    assert unknown_metrics(expressions) == []


def test_a_panel_naming_an_unknown_metric_is_caught():
    typo = Expression(
        "panel", "x", "rate(kubetune_train_token_total[5m])", metric_names("rate(kubetune_train_token_total[5m])")
    )
    assert unknown_metrics([typo]) == ["x: kubetune_train_token_total"]


def test_every_exported_kubetune_metric_is_on_a_dashboard_or_alert():
    # the other direction: nothing kubetune exports is left out (one series of a histogram is enough)
    named = {m for e in all_expressions() for m in e.metrics}
    metrics = TRAIN_METRICS + SERVE_METRICS + COMPONENT_METRICS
    assert [m.name for m in metrics if not set(exposed_names(m)) & named] == []


@pytest.mark.parametrize(
    "expr,names",
    [
        (
            'sum by (job, le) (rate(vllm:time_to_first_token_seconds_bucket{a="b"}[5m]))',
            ("vllm:time_to_first_token_seconds_bucket",),
        ),
        ("time() - max by (job) (x_seconds offset 5m)", ("x_seconds",)),
        (
            '1 - avg by (instance) (rate(node_cpu_seconds_total{mode="idle"}[$__rate_interval]))',
            ("node_cpu_seconds_total",),
        ),
        ("a / on (job, op) group_left b > 5 unless on (job) c", ("a", "b", "c")),
        ("count by (r) (loss != loss or abs(loss) == Inf)", ("loss",)),
        ('label_replace(up, "dst", "$1", "src", "(.*)")', ("up",)),
    ],
)
def test_metric_names(expr, names):
    assert metric_names(expr) == names


def test_expand_fills_grafanas_variables():
    expr = 'rate(x{job=~"$job", namespace=~"${namespace}"}[$__rate_interval])'
    assert expand(expr) == 'rate(x{job=~".*", namespace=~".*"}[2m])'
    assert expand(expr, {"job": "demo", "__rate_interval": "15s"}) == 'rate(x{job=~"demo", namespace=~".*"}[15s])'


def test_the_shipped_json_is_what_the_code_builds(tmp_path):
    d.write_json(tmp_path)
    shipped = sorted(p.name for p in d.JSON_DIR.glob("*.json"))
    assert (
        shipped
        == sorted(p.name for p in tmp_path.glob("*.json"))
        == [f"{b.uid}.json" for b in sorted(d.dashboards(), key=lambda b: b.uid)]
    )
    for name in shipped:
        assert (d.JSON_DIR / name).read_text() == (tmp_path / name).read_text(), (
            f"{name} drifted from kubetune.monitor.dashboards: regenerate with "
            "`python -c 'from kubetune.monitor.dashboards import write_json; write_json()'`"
        )


@pytest.mark.parametrize("dashboard", d.dashboards(), ids=lambda b: b.uid)
def test_grafana_json_is_laid_out_and_wired(dashboard):
    model = json.loads(d.to_text(dashboard))
    assert model["schemaVersion"] == 39 and model["uid"] == dashboard.uid
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "namespace" in variables
    assert {"job", "model"} & set(variables) or dashboard.uid == "kubetune-nodes"
    panels = model["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= GRID_COLUMNS
        area = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
        if p["type"] != "row":
            assert p["type"] in ("timeseries", "stat", "gauge")
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])


def test_the_builder_wraps_rows_at_24_columns():
    wide = Panel("w", (Target("up"),), width=16)
    model = Dashboard("u", "t", "", (), (Row("r", (wide, wide)),)).to_json()
    grids = [p["gridPos"] for p in model["panels"][1:]]
    assert grids == [{"h": 8, "w": 16, "x": 0, "y": 1}, {"h": 8, "w": 16, "x": 0, "y": 9}]


def test_the_accelerator_rows_read_the_vendors_exporters():
    names = {m for e in all_expressions() if "Nodes and accelerators" in e.where for m in e.metrics}
    assert {"habanalabs_utilization", "habanalabs_memory_used_bytes", "habanalabs_power_mW"} <= names
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE"} <= names
    assert {m for m in names if m in THIRD_PARTY} == set(THIRD_PARTY)  # the table lists nothing unused
