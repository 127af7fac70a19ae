"""A small typed builder for Grafana dashboards: Dashboard -> Row -> Panel -> Target, plus
template Variables, turned into Grafana's JSON model (schemaVersion 39).

Only what kubetune's dashboards use: timeseries, stat and gauge panels over one Prometheus
data source chosen by the `$datasource` variable, laid out left to right in rows of 24 grid
columns. The JSON is generated, never edited: `kubetune.monitor.dashboards` defines the
dashboards, and a test checks the files shipped in `monitor/dashboards/` equal what it builds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

SCHEMA_VERSION = 39
GRID_COLUMNS = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PanelKind = Literal["timeseries", "stat", "gauge"]
Json = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel; `legend` is Grafana's legendFormat (`{{rank}}`)."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    kind: PanelKind = "timeseries"
    unit: str = "short"  # a Grafana unit id: s, bytes, percentunit, watt, ...
    description: str = ""
    width: int = 8
    height: int = 8
    min: float | None = None
    max: float | None = None
    stack: bool = False  # timeseries: stack the series (parts of a whole, e.g. step-time phases)
    red_above: float | None = None  # stat/gauge: the value from which it turns red


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    """`kind="datasource"`: the Prometheus to query; `kind="query"`: label values, All = `.*`
    (so that series without the label, e.g. outside a cluster, still match)."""

    name: str
    label: str
    query: str = ""
    kind: Literal["query", "datasource"] = "query"


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = ("kubetune",)

    def panels(self) -> Iterator[tuple[Row, Panel]]:
        for row in self.rows:
            for panel in row.panels:
                yield row, panel

    def to_json(self) -> Json:
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "editable": True,
            "graphTooltip": 1,  # shared crosshair: a spike in one panel lines up with the others
            "timezone": "browser",
            "time": {"from": "now-6h", "to": "now"},
            "refresh": "30s",
            "annotations": {"list": []},
            "links": [],
            "templating": {"list": [_variable_json(v) for v in self.variables]},
            "panels": _layout(self.rows),
        }


def _variable_json(v: Variable) -> Json:
    common: Json = {"name": v.name, "label": v.label, "hide": 0, "current": {}, "options": [], "regex": ""}
    if v.kind == "datasource":
        return {**common, "type": "datasource", "query": "prometheus", "refresh": 1}
    return {
        **common,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": v.query,
        "query": {"query": v.query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
        "refresh": 2,  # on time range change: jobs come and go
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "sort": 1,
    }


def _layout(rows: tuple[Row, ...]) -> list[Json]:
    """Rows stacked top to bottom; a row's panels left to right, wrapping at 24 columns."""
    out: list[Json] = []
    y = 0
    for row in rows:
        out.append(_row_json(row, len(out) + 1, y))
        y += 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_COLUMNS:
                x, y, line_height = 0, y + line_height, 0
            out.append(_panel_json(panel, len(out) + 1, {"h": panel.height, "w": panel.width, "x": x, "y": y}))
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return out


def _row_json(row: Row, panel_id: int, y: int) -> Json:
    grid = {"h": 1, "w": GRID_COLUMNS, "x": 0, "y": y}
    return {"type": "row", "id": panel_id, "title": row.title, "collapsed": False, "gridPos": grid, "panels": []}


def _panel_json(panel: Panel, panel_id: int, grid: Json) -> Json:
    targets = [
        {
            "refId": chr(ord("A") + i),
            "datasource": DATASOURCE,
            "expr": t.expr,
            "legendFormat": t.legend or "__auto",
            "range": panel.kind == "timeseries",
            "instant": panel.kind != "timeseries",
        }
        for i, t in enumerate(panel.targets)
    ]
    return {
        "type": panel.kind,
        "id": panel_id,
        "title": panel.title,
        "description": panel.description,
        "gridPos": grid,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": _field_defaults(panel), "overrides": []},
        "options": _options(panel),
    }


def _field_defaults(panel: Panel) -> Json:
    steps: list[Json] = [{"color": "green", "value": None}]
    if panel.red_above is not None:
        steps.append({"color": "red", "value": panel.red_above})
    # stat and gauge panels colour by threshold, time series by series
    color = {"mode": "palette-classic" if panel.kind == "timeseries" else "thresholds"}
    out: Json = {"unit": panel.unit, "thresholds": {"mode": "absolute", "steps": steps}, "color": color}
    if panel.min is not None:
        out["min"] = panel.min
    if panel.max is not None:
        out["max"] = panel.max
    if panel.kind == "timeseries":
        stacking = {"mode": "normal" if panel.stack else "none", "group": "A"}
        fill = 30 if panel.stack else 10
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": fill, "showPoints": "never", "spanNulls": True}
        out["custom"] = {**custom, "stacking": stacking}
    return out


def _options(panel: Panel) -> Json:
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if panel.kind == "timeseries":
        return {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    if panel.kind == "stat":
        return {"reduceOptions": reduce, "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    return {"reduceOptions": reduce, "showThresholdLabels": False, "showThresholdMarkers": True}
