"""`kubetune k8s ...` commands. Thin: parse, call render / follow / doctor, print.

Registered by kubetune.cli through `register(k8s_app)`. Imports of kubernetes happen inside
the commands (via the modules they call), so `kubetune --help` stays fast. Problems are
`UserError`s: kubetune.cli.main prints them as one line each and exits 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from kubetune.errors import UserError

NAMESPACE_HELP = "Namespace of the job (the recipe's k8s.namespace)."
RECIPE_ARGS_HELP = "RECIPE [key=value ...]: a recipe file or builtin name, then overrides (e.g. k8s.replicas=4)."


def _note(text: str) -> None:
    typer.echo(f"kubetune: {text}", err=True)


def _read_token(hf_token_file: Path | None) -> str | None:
    """--hf-token-file, else $HF_TOKEN, else None. Never echoed anywhere."""
    if hf_token_file is not None:
        try:
            token = hf_token_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise UserError(f"cannot read --hf-token-file {hf_token_file}: {e.strerror}") from None
        if not token:
            raise UserError(f"--hf-token-file {hf_token_file} is empty")
        return token
    return os.environ.get("HF_TOKEN", "").strip() or None


def _render(args: list[str], profile: str | None, api: str | None, token: str | None, with_runtime: bool):
    from kubetune.k8s.render import render
    from kubetune.recipe.loader import load_recipe

    if not args:
        raise UserError(
            "give a recipe: `kubetune k8s render RECIPE [key=value ...]` "
            "(`kubetune recipe list` shows the builtin ones)"
        )
    recipe, overrides = args[0], list(args[1:])
    if "=" in recipe:
        raise UserError(f"the first argument must be a recipe, not the override `{recipe}`")
    # --profile / --api are recipe overrides, so a bad value gets the same one-line error as a bad key.
    overrides += [f"k8s.profile={profile}"] if profile else []
    overrides += [f"k8s.api={api}"] if api else []
    rendered = render(load_recipe(recipe, overrides).recipe, hf_token=token, with_runtime=with_runtime)
    for warning in rendered.warnings:
        _note(f"warning: {warning}")
    return rendered


def _check(objects: list[dict]) -> None:
    from kubetune.k8s.validate import KUBERNETES_VERSION, validate_objects

    problems = validate_objects(objects)
    if problems:
        raise UserError(*[f"invalid manifest: {p}" for p in problems])
    _note(
        f"checked {len(objects)} objects: all valid (core kinds: kubernetes-validate {KUBERNETES_VERSION} strict; "
        "Kubeflow kinds: vendored CRD schemas)"
    )


_profile_opt = typer.Option(None, "--profile", help="cpu | gaudi | nvidia (default: the recipe's k8s.profile).")
_api_opt = typer.Option(None, "--api", help="pytorchjob | trainjob (default: the recipe's k8s.api).")
_token_opt = typer.Option(None, "--hf-token-file", help="File holding the Hugging Face token (default: $HF_TOKEN).")
_runtime_opt = typer.Option(
    False, "--with-runtime", help="trainjob: also render a ClusterTrainingRuntime for this job."
)


def render_cmd(
    args: list[str] = typer.Argument(None, help=RECIPE_ARGS_HELP),
    profile: str | None = _profile_opt,
    api: str | None = _api_opt,
    output: Path | None = typer.Option(
        None, "-o", "--output", help="Write one file per object + kustomization.yaml here."
    ),
    hf_token_file: Path | None = _token_opt,
    check: bool = typer.Option(False, "--check", help="Validate every object offline; fail if any cannot be checked."),
    with_runtime: bool = _runtime_opt,
):
    """Render the recipe as Kubernetes manifests (stdout, or files with -o for `kubectl apply -k`).

    On stdout the HF-token Secret is replaced by a comment: the token is only ever written
    to DIR/secret-*.yaml (mode 0600) with -o, or sent to the cluster by `submit`.
    """
    from kubetune.k8s.render import to_yaml, write_dir

    rendered = _render(args or [], profile, api, _read_token(hf_token_file), with_runtime)
    if check:
        _check(rendered.objects)
    if output is None:
        sys.stdout.write(to_yaml(rendered.objects, redact_secrets=True))
        return
    written = write_dir(rendered.objects, output)
    _note(f"wrote {len(written)} files to {output}/; apply with `kubectl apply -k {output}`")


def submit_cmd(
    args: list[str] = typer.Argument(None, help=RECIPE_ARGS_HELP),
    profile: str | None = _profile_opt,
    api: str | None = _api_opt,
    hf_token_file: Path | None = _token_opt,
    with_runtime: bool = _runtime_opt,
):
    """Create or update every rendered object in the cluster (idempotent), after validating them."""
    from kubetune.k8s import client, follow

    token = _read_token(hf_token_file)
    rendered = _render(args or [], profile, api, token, with_runtime)
    _check(rendered.objects)
    if token is None:
        _note("no Hugging Face token (--hf-token-file or HF_TOKEN): fine for public models, gated ones will fail")
    for line in follow.submit(client.connect(), rendered):
        typer.echo(line)
    typer.echo(f"follow it: kubetune k8s status {rendered.names.job} -n {rendered.names.namespace}")


def status_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str = typer.Option("kubetune", "-n", "--namespace", help=NAMESPACE_HELP),
):
    """Job conditions, each replica's pod, and training progress (step, loss, tokens/s, ETA)."""
    from kubetune.k8s import client, follow

    for line in follow.status(client.connect(), name, namespace).lines:
        typer.echo(line)


def logs_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str = typer.Option("kubetune", "-n", "--namespace", help=NAMESPACE_HELP),
    follow_: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines."),
    rank: int = typer.Option(0, "--rank", help="Node rank (0 = master-0 / node 0)."),
    tail: int | None = typer.Option(None, "--tail", help="Only the last N lines."),
):
    """Print a replica's log (rank 0 by default)."""
    from kubetune.k8s import client, follow

    for line in follow.logs(client.connect(), name, namespace, rank=rank, follow=follow_, tail_lines=tail):
        typer.echo(line)


def download_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str = typer.Option("kubetune", "-n", "--namespace", help=NAMESPACE_HELP),
    output: Path = typer.Option(Path("."), "-o", "--output", help="Local directory to copy into."),
):
    """Copy the run's output directory (adapter, checkpoints, metrics) out of the data-access pod."""
    from kubetune.k8s import client, follow

    typer.echo(str(follow.download(client.connect(), name, namespace, output)))


def delete_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str = typer.Option("kubetune", "-n", "--namespace", help=NAMESPACE_HELP),
    purge: bool = typer.Option(False, "--purge", help="Also the PVC (data, checkpoints!), data pod and quota."),
):
    """Delete the job and its pods (the PVC only with --purge)."""
    from kubetune.k8s import client, follow

    for line in follow.delete(client.connect(), name, namespace, purge=purge):
        typer.echo(line)


def doctor_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str = typer.Option("kubetune", "-n", "--namespace", help=NAMESPACE_HELP),
):
    """Explain why the job is Pending, crashing or hanging, with the fix for each finding."""
    from kubetune.k8s import client, doctor

    findings = doctor.diagnose(doctor.collect(client.connect(), name, namespace))
    for line in doctor.report(findings):
        typer.echo(line)
    if any(f.severity == "error" for f in findings):
        raise typer.Exit(1)


def register(k8s_app: typer.Typer) -> None:
    k8s_app.command("render")(render_cmd)
    k8s_app.command("submit")(submit_cmd)
    k8s_app.command("status")(status_cmd)
    k8s_app.command("logs")(logs_cmd)
    k8s_app.command("download")(download_cmd)
    k8s_app.command("delete")(delete_cmd)
    k8s_app.command("doctor")(doctor_cmd)
