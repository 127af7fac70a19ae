"""`kubetune operator crd` prints the FineTune CRD; `kubetune pod operator` (hidden: the operator's
Deployment runs it) runs the FineTune controller."""

from __future__ import annotations

import typer

from kubetune.errors import UserError

NAMESPACE_HELP = "Watch this namespace (repeatable)."
ALL_NAMESPACES_HELP = "Watch every namespace."
INTERVAL_HELP = "Seconds between two looks at each FineTune's job (status.progress's throttle)."
LIVENESS_HELP = "Serve kopf's health probe at this URL, e.g. http://0.0.0.0:8080/healthz (the pod's livenessProbe)."


def _refuse_bad_arguments(namespace: list[str] | None, all_namespaces: bool, interval: float, liveness: str | None):
    if bool(namespace) == all_namespaces:
        raise UserError("kubetune pod operator: give --namespace NS (repeatable) or --all-namespaces")
    if interval <= 0:
        raise UserError(f"--interval {interval}: seconds, more than 0")
    if liveness is not None and not liveness.startswith("http://"):
        raise UserError(f"--liveness {liveness}: an http:// URL, e.g. http://0.0.0.0:8080/healthz")


def run_cmd(
    # No -n: a list of namespaces to watch, not the one namespace a command acts in.
    namespace: list[str] = typer.Option(None, "--namespace", help=NAMESPACE_HELP),
    all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", help=ALL_NAMESPACES_HELP),
    interval: float = typer.Option(15.0, "--interval", help=INTERVAL_HELP),
    liveness: str | None = typer.Option(None, "--liveness", help=LIVENESS_HELP),
) -> None:
    """Run the FineTune operator until interrupted (kubeconfig or in-cluster credentials)."""
    _refuse_bad_arguments(namespace, all_namespaces, interval, liveness)
    from kubetune.operator.main import run_operator  # kopf: here, so that `kubetune --help` stays fast

    run_operator(namespaces=list(namespace or []), interval=interval, liveness=liveness)


def old_spelling(
    ctx: typer.Context,
    namespace: list[str] = typer.Option(None, "--namespace", hidden=True),
    all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", hidden=True),
    interval: float = typer.Option(15.0, "--interval", hidden=True),
    liveness: str | None = typer.Option(None, "--liveness", hidden=True),
) -> None:
    """The FineTune operator (kopf): kubectl apply a FineTune, get a served model (its Helm chart runs it)."""
    # `kubetune operator --namespace NS` is what operator Deployments applied before `kubetune pod
    # operator` run; their image tag (kubetune's version) stays when the image is rebuilt.
    if not ctx.invoked_subcommand:
        run_cmd(namespace, all_namespaces, interval, liveness)


def crd_cmd() -> None:
    """Print the FineTune and ModelServer CustomResourceDefinitions (kubectl apply -f -)."""
    from kubetune.operator import modelserver_crd
    from kubetune.operator.crd import crd_yaml

    typer.echo(crd_yaml() + "---\n" + modelserver_crd.crd_yaml(), nl=False)


def register(app: typer.Typer, pod_app: typer.Typer) -> None:
    operator_app = typer.Typer(no_args_is_help=True)
    operator_app.callback(invoke_without_command=True)(old_spelling)
    operator_app.command("crd")(crd_cmd)
    app.add_typer(operator_app, name="operator")
    pod_app.command("operator")(run_cmd)
