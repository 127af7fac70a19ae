"""Every PromQL expression kubetune ships (each dashboard panel's targets, each alert's signal and
rule), with the metric names it reads.

Tests use this to hold that a panel or alert names only metrics someone exports
(`kubetune.monitor.exporters`), and to run every panel and alert signal against a real
Prometheus; `kubetune monitor check` runs the panels against the user's. Grafana's template
variables are filled in by `expand` (All = `.*`, which also matches series without the label).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kubetune.monitor.dashboards import dashboards
from kubetune.monitor.rules import RuleSettings, alerts

Kind = Literal["panel", "alert signal", "alert"]

# What `expand` puts in for Grafana's variables: every job / namespace / model, and rate windows
# long enough for a 30 s scrape interval.
DEFAULT_VARIABLES: dict[str, str] = {
    "namespace": ".*",
    "job": ".*",
    "model": ".*",
    "__rate_interval": "2m",
    "__interval": "30s",
    "datasource": "prometheus",
}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
_KEYWORDS |= {"offset", "Inf", "NaN", "inf", "nan", "atan2"}
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")


@dataclass(frozen=True)
class Expression:
    kind: Kind  # a panel's target and an alert's signal return data once their metrics are scraped;
    where: str  # an alert's rule only while it fires
    expr: str  # as shipped: Grafana variables ($job, $__rate_interval) unexpanded
    metrics: tuple[str, ...]

    def expanded(self, variables: Mapping[str, str] | None = None) -> str:
        return expand(self.expr, variables)


def metric_names(expr: str) -> tuple[str, ...]:
    """The metric names `expr` selects, in order of first use (functions, keywords, label names
    in matchers and groupings, strings and durations are not names)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    found = [m for m in _NAME.findall(text) if m not in _KEYWORDS and not m.startswith("$")]
    return tuple(dict.fromkeys(found))


def expand(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """`expr` with Grafana's `$name` / `${name}` replaced (DEFAULT_VARIABLES, updated by `variables`)."""
    values = {**DEFAULT_VARIABLES, **(variables or {})}

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, m.group(0))

    return _VARIABLE.sub(value, expr)


def panel_expressions() -> list[Expression]:
    out = []
    for dashboard in dashboards():
        for row, panel in dashboard.panels():
            for i, target in enumerate(panel.targets):
                where = f"{dashboard.title} / {row.title} / {panel.title} [{chr(ord('A') + i)}]"
                out.append(Expression("panel", where, target.expr, metric_names(target.expr)))
    return out


def alert_expressions(settings: RuleSettings | None = None) -> list[Expression]:
    out = []
    for alert in alerts(settings):
        out.append(Expression("alert signal", alert.name, alert.signal, metric_names(alert.signal)))
        out.append(Expression("alert", alert.name, alert.expr, metric_names(alert.expr)))
    return out


def all_expressions(settings: RuleSettings | None = None) -> list[Expression]:
    """Every panel target, then every alert's signal and rule."""
    return panel_expressions() + alert_expressions(settings)
