"""`kubetune operator`: the FineTune controller's commands (`kubetune operator crd` prints its CRD)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    operator_app = typer.Typer(help="The FineTune operator (kopf): kubectl apply a FineTune, get a served model.")

    @operator_app.command("crd")
    def crd_cmd() -> None:
        """Print the FineTune CustomResourceDefinition (kubectl apply -f -)."""
        from kubetune.operator.crd import crd_yaml

        typer.echo(crd_yaml(), nl=False)

    app.add_typer(operator_app, name="operator")
