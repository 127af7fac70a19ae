"""`kubetune monitor render|check`. Thin: parse, call objects / check, print.

Registered by kubetune.cli through `register(app)`; the kubernetes client, httpx and rich are
imported inside the commands. Problems are `UserError`s (one line each, exit 2); `check`
exits 1 when it finds a target down or a monitor Prometheus ignores.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kubetune.contracts.kube import KubeObject
from kubetune.errors import UserError

monitor_app = typer.Typer(
    help="Prometheus monitors, alert rules and Grafana dashboards; check that they work.", no_args_is_help=True
)
RECIPE_HELP = "A recipe (file or builtin name): also render its job's PodMonitor and its server's ServiceMonitor."
RELEASE_HELP = "The `release` label kube-prometheus-stack's Prometheus selects on (default: the recipe's)."


def _note(text: str) -> None:
    typer.echo(f"kubetune: {text}", err=True)


def _adapter_rule(namespace: str, release: str) -> KubeObject:
    from kubetune.contracts.monitors import MONITORING_COMPONENT, monitor_meta
    from kubetune.contracts.prometheus_adapter import adapter_rule_data

    labels = {"app.kubernetes.io/name": "kubetune", "app.kubernetes.io/component": MONITORING_COMPONENT}
    meta = monitor_meta("kubetune-prometheus-adapter-rule", namespace, labels, release)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": adapter_rule_data()}


def _recipe_monitors(recipe_name: str, overrides: list[str], release: str | None) -> tuple[list[KubeObject], str]:
    """The job's PodMonitor and its server's ServiceMonitor, as `k8s render` / `render-serve` make them."""
    from kubetune.k8s.names import SERVE_SUFFIX, SERVER_COMPONENT, Names
    from kubetune.k8s.render import cluster_recipe, job_name
    from kubetune.k8s.scrape import server_service_monitor, training_pod_monitor
    from kubetune.recipe.loader import load_recipe

    recipe = load_recipe(recipe_name, overrides).recipe
    if release:
        recipe = recipe.model_copy(update={"monitor": recipe.monitor.model_copy(update={"release": release})})
    names = Names.for_job(job_name(recipe), recipe.k8s.namespace, recipe.k8s.storage.existing_claim)
    server = Names.for_job(f"{names.job}{SERVE_SUFFIX}", recipe.k8s.namespace)
    monitors = [
        training_pod_monitor(cluster_recipe(recipe, names), names),
        server_service_monitor(server, recipe.monitor.release, SERVER_COMPONENT),
    ]
    return monitors, recipe.monitor.release


def render_cmd(
    output: Path = typer.Option(..., "-o", "--output", help="Write one file per object + kustomization.yaml here."),
    recipe: str | None = typer.Option(None, "--recipe", help=RECIPE_HELP),
    overrides: list[str] = typer.Argument(None, help="key=value overrides of --recipe (e.g. k8s.namespace=team-a)."),
    release: str | None = typer.Option(None, "--release", help=RELEASE_HELP),
    namespace: str = typer.Option(
        "monitoring", "-n", "--namespace", help="Namespace of the rules and dashboards (Grafana's, usually)."
    ),
) -> None:
    """Render the alert rules (PrometheusRule), the dashboards (ConfigMaps for Grafana's sidecar),
    the prometheus-adapter rule and, with --recipe, the job's and server's monitors."""
    from kubetune.contracts.metrics import DEFAULT_RELEASE
    from kubetune.k8s.render import write_dir
    from kubetune.k8s.validate import validate_objects
    from kubetune.monitor.objects import dashboard_config_maps, prometheus_rule

    if overrides and not recipe:
        raise UserError(f"{overrides[0]}: overrides need --recipe RECIPE")
    monitors, recipe_release = _recipe_monitors(recipe, overrides or [], release) if recipe else ([], None)
    label = release or recipe_release or DEFAULT_RELEASE
    objects = [prometheus_rule(namespace, label), *dashboard_config_maps(namespace, label), *monitors]
    objects.append(_adapter_rule(namespace, label))
    problems = validate_objects(objects)
    if problems:  # a bug in kubetune, not the user's input: keep the traceback
        raise AssertionError("\n".join(problems))
    written = write_dir(objects, output, prometheus_operator=True)  # rules and monitors: all the Operator's
    _note(f"wrote {len(written)} files to {output}/ (release={label}); apply with `kubectl apply -k {output}`")
    _note(
        "the prometheus-adapter rule is for the adapter's configuration (`helm upgrade ... -f` its helm-values.yaml); "
        "applying the ConfigMap alone configures nothing"
    )


def _read_objects(directory: Path) -> list[KubeObject]:
    import yaml

    if not directory.is_dir():
        raise UserError(f"--objects {directory}: not a directory (give the -o DIR of a render command)")
    docs: list[KubeObject] = []
    for path in sorted(directory.glob("*.y*ml")):
        try:
            docs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if isinstance(d, dict)]
        except yaml.YAMLError as e:
            raise UserError(f"--objects: {path} is not YAML: {e}") from None
    return docs


def _cluster_monitors(namespace: str | None) -> tuple[list[KubeObject] | None, str, str | None]:
    """(monitors, note, the release the cluster's Prometheus selects) through the kube API."""
    from kubetune.kubeapi import ClusterError, connect

    api = "monitoring.coreos.com/v1"
    try:
        client = connect()
        monitors = [m for kind in ("PodMonitor", "ServiceMonitor") for m in client.list(api, kind, namespace)]
        prometheuses = client.list(api, "Prometheus")
    except ClusterError as e:
        return None, f"monitors not checked: {e}; give --objects DIR to check rendered ones", None
    selectors = [(p.get("spec") or {}).get("podMonitorSelector") or {} for p in prometheuses]
    releases = [s.get("matchLabels", {}).get("release") for s in selectors]
    return monitors, "", next((r for r in releases if r), None)


def check_cmd(
    prometheus: str = typer.Option(..., "--prometheus", help="Prometheus's URL, e.g. http://127.0.0.1:9090."),
    job: str | None = typer.Option(None, "--job", help="Only this training job's targets and panels."),
    objects: Path | None = typer.Option(
        None, "--objects", help="Check the monitors rendered in this directory instead of the cluster's."
    ),
    release: str | None = typer.Option(None, "--release", help="The `release` label Prometheus selects on."),
    namespace: str | None = typer.Option(
        None, "-n", "--namespace", help="Check the monitors of this namespace only (default: every namespace)."
    ),
) -> None:
    """Are the targets up, which monitors does Prometheus ignore (and why), which panels are empty (and why)."""
    from kubetune.contracts.findings import has_errors
    from kubetune.contracts.metrics import DEFAULT_RELEASE
    from kubetune.monitor.check import collect, diagnose, report
    from kubetune.monitor.prometheus import Prometheus

    monitors: list[KubeObject] | None
    if objects is not None:
        monitors, note, selected = _read_objects(objects), "", None
    else:
        monitors, note, selected = _cluster_monitors(namespace)
    if monitors is not None and namespace:
        monitors = [m for m in monitors if (m.get("metadata") or {}).get("namespace") == namespace]
    with Prometheus(prometheus) as prom:
        collected = collect(prom, release or selected or DEFAULT_RELEASE, monitors, note, job)
    findings = diagnose(collected)
    typer.echo(report(collected, findings), nl=False)
    if has_errors(findings):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    monitor_app.command("render")(render_cmd)
    monitor_app.command("check")(check_cmd)
    app.add_typer(monitor_app, name="monitor")
