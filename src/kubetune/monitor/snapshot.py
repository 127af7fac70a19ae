"""Draw a dashboard's panels from a Prometheus as one PNG (matplotlib): what the dashboard shows,
for the docs, without a Grafana.

Each panel's queries run through `/api/v1/query_range` over [start, end]; a time series panel
draws one line per series, labelled by the panel's legend format, a stat or gauge panel its
last value in large type. Panels without data say so, so an empty panel is visible.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubetune.monitor.expressions import expand
from kubetune.monitor.grafana import Dashboard, Panel
from kubetune.monitor.prometheus import Prometheus

COLUMNS = 3
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")

Series = tuple[str, list[float], list[float]]  # legend, times (s from start), values


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """Grafana's legendFormat: `{{label}}` replaced by the series' label."""
    if not fmt or fmt == "__auto":
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt).strip()


def panel_series(
    prom: Prometheus, panel: Panel, start: float, end: float, step: float, variables: Mapping[str, str] | None = None
) -> list[Series]:
    out = []
    for target in panel.targets:
        for series in prom.query_range(expand(target.expr, variables), start, end, step):
            points = [(float(t) - start, float(v)) for t, v in series["values"]]
            finite = [(t, v) for t, v in points if math.isfinite(v)]
            if finite:
                times, values = zip(*finite)
                out.append((legend(target.legend, series["metric"]), list(times), list(values)))
    return out


def value_text(value: float, unit: str) -> str:
    """A stat's value in its panel's unit, roughly as Grafana shows it."""
    if unit == "percentunit":
        return f"{value:.1%}"
    if unit == "bytes":
        return f"{value / 2**30:.3g} GiB"
    symbol = {"s": "s", "percent": "%", "watt": "W", "celsius": "°C"}.get(unit)
    if symbol:
        return f"{value:.4g} {symbol}"
    return f"{value:.4g}"


def _draw(ax: Any, panel: Panel, series: list[Series]) -> None:
    ax.set_title(panel.title, fontsize=9)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    if panel.kind != "timeseries":
        ax.axis("off")
        text = "\n".join(f"{name}: {value_text(values[-1], panel.unit)}" for name, _, values in series[:4])
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=12)
        return
    if panel.stack and len({tuple(times) for _, times, _ in series}) == 1:  # parts of one whole
        ax.stackplot(series[0][1], *[values for _, _, values in series], labels=[name for name, _, _ in series])
    else:
        for name, times, values in series:
            ax.plot(times, values, label=name, linewidth=1)
    ax.set_xlabel("seconds", fontsize=7)
    ax.tick_params(labelsize=7)
    if panel.unit:
        ax.set_ylabel(panel.unit, fontsize=7)
    ax.legend(fontsize=6, loc="best")


def render_panels_png(
    prometheus_url: str,
    dashboard: Dashboard,
    out_dir: Path,
    start: float,
    end: float,
    variables: Mapping[str, str] | None = None,
    step: float | None = None,
) -> Path:
    """`out_dir/<dashboard uid>.png`: every panel of `dashboard` over [start, end] (unix seconds)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    panels = [panel for _, panel in dashboard.panels()]
    step = step or max(1.0, (end - start) / 200)
    rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(5 * COLUMNS, 3 * rows), squeeze=False)
    with Prometheus(prometheus_url) as prom:
        for ax, panel in zip(axes.flat, panels):
            _draw(ax, panel, panel_series(prom, panel, start, end, step, variables))
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(dashboard.title)
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # leave the title its own line
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{dashboard.uid}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
