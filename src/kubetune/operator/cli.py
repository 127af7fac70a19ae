"""`kubetune operator`: run the FineTune controller, or print its CRD (`kubetune operator crd`)."""

from __future__ import annotations

import typer

from kubetune.errors import UserError


def register(app: typer.Typer) -> None:
    operator_app = typer.Typer(help="The FineTune operator (kopf): kubectl apply a FineTune, get a served model.")

    @operator_app.callback(invoke_without_command=True)
    def run(
        ctx: typer.Context,
        namespace: list[str] = typer.Option(None, "--namespace", "-n", help="Watch this namespace (repeatable)."),
        all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", help="Watch every namespace."),
        interval: float = typer.Option(
            15.0, "--interval", help="Seconds between two looks at each FineTune's job (status.progress's throttle)."
        ),
        liveness: str | None = typer.Option(
            None,
            "--liveness",
            help="Serve kopf's health probe at this URL, e.g. http://0.0.0.0:8080/healthz (the pod's livenessProbe).",
        ),
    ) -> None:
        """Run the operator until interrupted (kubeconfig or in-cluster credentials)."""
        if ctx.invoked_subcommand:
            return
        if bool(namespace) == all_namespaces:
            raise UserError("kubetune operator: give --namespace NS (repeatable) or --all-namespaces")
        from kubetune.operator.main import run_operator

        if interval <= 0:
            raise UserError(f"--interval {interval}: seconds, more than 0")
        if liveness is not None and not liveness.startswith("http://"):
            raise UserError(f"--liveness {liveness}: an http:// URL, e.g. http://0.0.0.0:8080/healthz")
        run_operator(namespaces=list(namespace or []), interval=interval, liveness=liveness)

    @operator_app.command("crd")
    def crd_cmd() -> None:
        """Print the FineTune CustomResourceDefinition (kubectl apply -f -)."""
        from kubetune.operator.crd import crd_yaml

        typer.echo(crd_yaml(), nl=False)

    app.add_typer(operator_app, name="operator")
