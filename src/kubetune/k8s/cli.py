"""`kubetune k8s ...` commands. Thin: parse, call render / follow / doctor, print.

Registered by kubetune.cli through `register(k8s_app)`. Imports of kubernetes happen inside
the commands (via the modules they call), so `kubetune --help` stays fast. Problems are
`UserError`s: kubetune.cli.main prints them as one line each and exits 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer

from kubetune.errors import UserError
from kubetune.flags import with_options
from kubetune.k8s.serve.settings import FINETUNE_FLAGS, ServeSettings, flags_given, spec_given

NAMESPACE_HELP = "Namespace of the job (default: the kubeconfig context's, as for kubectl; else `default`)."
SUBMIT_NAMESPACE_HELP = (
    "Namespace to submit into (default: the recipe's k8s.namespace where it sets one, else the kubeconfig "
    "context's, as for kubectl)."
)
_namespace_opt = typer.Option(None, "-n", "--namespace", help=NAMESPACE_HELP)
RECIPE_ARGS_HELP = "RECIPE [key=value ...]: a recipe file or builtin name, then overrides (e.g. k8s.replicas=4)."


def _note(text: str) -> None:
    typer.echo(f"kubetune: {text}", err=True)


def _with_namespace(args: list[str], flag: str | None, serve: bool) -> list[str]:
    """The recipe arguments of `submit` with k8s.namespace set to the resolved namespace:
    `render` keeps the recipe's (default `kubetune`), a submit goes where kubectl would."""
    if not args or "=" in args[0]:
        return args  # the render that follows says what is missing
    from kubetune.k8s.serve.plan import load_source
    from kubetune.kubeapi import resolve_namespace

    recipe = load_source(args[0], args[1:])[0] if serve else _load(args, None, None)
    chosen = recipe.k8s.namespace if "namespace" in recipe.k8s.model_fields_set else None
    return [*args, f"k8s.namespace={resolve_namespace(flag, chosen)}"]


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


def _render(
    args: list[str],
    profile: str | None,
    api: str | None,
    token: str | None,
    with_runtime: bool,
    kueue: bool = False,
    need_token: bool = False,
):
    """`need_token`: a gated model without a token is refused (submit, --check), else a warning."""
    from kubetune.k8s.render import render

    recipe = _load(args, profile, api)
    if need_token and token is None:
        _refuse_without_token(recipe)
    rendered = render(recipe, hf_token=token, with_runtime=with_runtime, with_kueue=kueue)
    for warning in rendered.warnings:
        _note(f"warning: {warning}")
    for note in rendered.notes:
        _note(note)
    return rendered


def _refuse_without_token(recipe) -> None:
    """A gated model's pods would only fail with the Hub's 401: say so before anything is sent."""
    from kubetune.recipe.gated import missing_token_problem

    if problem := missing_token_problem(recipe):
        raise UserError(problem)


def _first_and_overrides(args: list[str], missing: str, what: str) -> tuple[str, list[str]]:
    """RECIPE|RUN [key=value ...] -> (the first, the overrides); `missing` when there is none."""
    if not args:
        raise UserError(missing)
    if "=" in args[0]:
        raise UserError(f"the first argument must be {what}, not the override `{args[0]}`")
    return args[0], list(args[1:])


def _load(args: list[str], profile: str | None, api: str | None):
    from kubetune.recipe.loader import load_recipe

    missing = (
        "give a recipe: `kubetune k8s render RECIPE [key=value ...]` (`kubetune recipe list` shows the builtin ones)"
    )
    recipe, overrides = _first_and_overrides(args, missing, "a recipe")
    # --profile / --api are recipe overrides, so a bad value gets the same one-line error as a bad key.
    overrides += [f"k8s.profile={profile}"] if profile else []
    overrides += [f"k8s.api={api}"] if api else []
    return load_recipe(recipe, overrides).recipe


def _check(objects: list[dict]) -> None:
    from kubetune.k8s.validate import KUBERNETES_VERSION, validate_objects

    problems = validate_objects(objects)
    if problems:
        raise UserError(*[f"invalid manifest: {p}" for p in problems])
    _note(
        f"checked {len(objects)} objects: all valid (core kinds: kubernetes-validate {KUBERNETES_VERSION} strict; "
        "custom resources: the vendored CRD schemas of Kubeflow, Kueue and the Prometheus Operator)"
    )


# ------------------------------------------------------------------ serving (render-serve, submit --serve)

SERVE_ARGS_HELP = (
    "RUN|RECIPE [key=value ...]: a run directory of `kubetune train` (served from the job's volume, or "
    "--model-image), or the recipe of a cluster job (its output_dir on the volume), then overrides."
)
SERVE_PANEL = "Serving (render-serve; submit --serve)"


# one option per ServeSettings field after the command's own, each None when not given (a switch:
# False) so that the settings' own default applies and `submit` can tell which were given; the
# command receives them as `serving` (field -> the value given, as `ServeSettings.from_flags` reads it)
with_serve_options = with_options(ServeSettings, "serving", defaults="given", panel=SERVE_PANEL)


def _render_serve(args: list[str], profile: str | None, settings, token: str | None):
    from kubetune.k8s.serve.plan import load_source
    from kubetune.k8s.serve.render import render_serve

    missing = (
        "give a run: `kubetune k8s render-serve RUN_DIR|RECIPE [key=value ...]` "
        "(a directory `kubetune train` wrote, or the recipe of a cluster job)"
    )
    source, overrides = _first_and_overrides(args, missing, "a run directory or a recipe")
    overrides += [f"k8s.profile={profile}"] if profile else []
    recipe, local_run = load_source(source, overrides)
    rendered = render_serve(recipe, settings, hf_token=token, local_run=local_run)
    for warning in rendered.warnings:
        _note(f"warning: {warning}")
    if settings.api_key_secret:
        _note(
            f"the pods read their API key from Secret {settings.api_key_secret} (they do not start without it): "
            f"kubectl create secret generic {settings.api_key_secret} -n {rendered.names.namespace} "
            "--from-literal=api-key=KEY (several keys: KEY1,KEY2; vLLM takes one)"
        )
    return rendered


_profile_opt = typer.Option(None, "--profile", help="cpu | gaudi | nvidia (default: the recipe's k8s.profile).")
_api_opt = typer.Option(None, "--api", help="pytorchjob | trainjob (default: the recipe's k8s.api).")
_devices_opt = typer.Option(
    None,
    "--devices",
    help="plugin | dra: the device plugin's extended resources, or a ResourceClaim per pod (Kubernetes 1.34+) "
    "(default: the recipe's k8s.devices).",
)
_kubernetes_version_opt = typer.Option(
    None,
    "--kubernetes-version",
    help="The cluster's Kubernetes version, e.g. 1.33: --devices dra is refused before 1.34 "
    "(default: the recipe's k8s.kubernetes_version).",
)
_token_opt = typer.Option(None, "--hf-token-file", help="File holding the Hugging Face token (default: $HF_TOKEN).")
MONITORING_CHOICES = ("none", "prometheus-operator")
_monitoring_opt = typer.Option(
    "none",
    "--monitoring",
    help="prometheus-operator: the cluster has the Prometheus Operator's CRDs (kube-prometheus-stack), so the "
    "output holds the PodMonitor / ServiceMonitor (with -o in kustomization.yaml); none (default): left out of "
    "stdout, and with -o written beside kustomization.yaml (kubectl refuses the whole `apply -k` without the CRDs). "
    "The pods serve /metrics either way; submit asks the cluster.",
)
_runtime_opt = typer.Option(
    False, "--with-runtime", help="trainjob: also render a ClusterTrainingRuntime for this job."
)
_create_namespace_opt = typer.Option(
    False,
    "--create-namespace",
    help="Also render the Namespace (left out by default: `kubectl delete` of the output would delete it and all in "
    "it); with -o as a file outside kustomization.yaml.",
)


def _prometheus_operator(monitoring: str) -> bool:
    """--monitoring: whether the cluster has the Prometheus Operator's CRDs."""
    if monitoring not in MONITORING_CHOICES:
        raise UserError(
            f"--monitoring {monitoring}: use prometheus-operator (the cluster runs kube-prometheus-stack or the "
            "Prometheus Operator) or none"
        )
    return monitoring == "prometheus-operator"


def _with_devices(args: list[str], devices: str | None, kubernetes_version: str | None) -> list[str]:
    """--devices / --kubernetes-version as the recipe overrides they stand for, after the given
    ones (a flag wins, as --profile does), so that a bad value gets the same one-line error as
    a bad key. The version is quoted: YAML would read 1.30 as the number 1.3."""
    if not args:
        return args  # the render that follows says what is missing
    extra = [f"k8s.devices={devices}"] if devices else []
    extra += [f"k8s.kubernetes_version='{kubernetes_version}'"] if kubernetes_version else []
    return [*args, *extra]


def render_cmd(
    args: list[str] = typer.Argument(None, help=RECIPE_ARGS_HELP),
    profile: str | None = _profile_opt,
    api: str | None = _api_opt,
    devices: str | None = _devices_opt,
    kubernetes_version: str | None = _kubernetes_version_opt,
    output: Path | None = typer.Option(
        None, "-o", "--output", help="Write one file per object + kustomization.yaml here."
    ),
    hf_token_file: Path | None = _token_opt,
    check: bool = typer.Option(False, "--check", help="Validate every object offline; fail if any cannot be checked."),
    with_runtime: bool = _runtime_opt,
    create_namespace: bool = _create_namespace_opt,
    kueue: bool = typer.Option(
        False,
        "--kueue",
        help="Also render Kueue's LocalQueue k8s.queue, its ClusterQueue (this job's requests as quota), "
        "ResourceFlavor and Topology; with -o as files outside kustomization.yaml (other jobs share them).",
    ),
    monitoring: str = _monitoring_opt,
):
    """Render the recipe as Kubernetes manifests (stdout, or files with -o for `kubectl apply -k`).

    On stdout the HF-token Secret is replaced by a comment: the token is only ever written
    to DIR/secret-*.yaml (mode 0600) with -o, or sent to the cluster by `submit`.
    """
    prometheus_operator = _prometheus_operator(monitoring)
    args = _with_devices(args or [], devices, kubernetes_version)
    rendered = _render(args, profile, api, _read_token(hf_token_file), with_runtime, kueue, need_token=check)
    _emit(rendered, output, check, create_namespace, prometheus_operator)


def render_serve_cmd(
    args: list[str] = typer.Argument(None, help=SERVE_ARGS_HELP),
    profile: str | None = _profile_opt,
    devices: str | None = _devices_opt,
    kubernetes_version: str | None = _kubernetes_version_opt,
    output: Path | None = typer.Option(
        None, "-o", "--output", help="Write one file per object + kustomization.yaml here."
    ),
    hf_token_file: Path | None = _token_opt,
    check: bool = typer.Option(False, "--check", help="Validate every object offline (kubernetes-validate, strict)."),
    create_namespace: bool = _create_namespace_opt,
    monitoring: str = _monitoring_opt,
    serving: dict[str, Any] | None = None,
):
    """Render the serving objects of a trained run: Deployment, Service, Ingress, NetworkPolicy,
    PodDisruptionBudget, HorizontalPodAutoscaler and the prometheus-adapter rule it reads (stdout, or files with -o).

    `kubetune k8s submit --serve RUN ...` applies the same objects; `status` and `delete` take
    their name (`<job>-serve`).
    """
    prometheus_operator = _prometheus_operator(monitoring)
    settings = ServeSettings.from_flags(serving or {})
    args = _with_devices(args or [], devices, kubernetes_version)
    rendered = _render_serve(args, profile, settings, _read_token(hf_token_file))
    _emit(rendered, output, check, create_namespace, prometheus_operator)


def _emit(rendered: Any, output: Path | None, check: bool, create_namespace: bool, prometheus_operator: bool) -> None:
    """`render` and `render-serve`'s output: validated with --check, then stdout (the token's
    Secret redacted, the Prometheus Operator's objects only with `prometheus_operator`) or one
    file per object in `output`."""
    from kubetune.k8s.render import MONITORING_FLAG, needs_prometheus_operator, to_yaml, write_dir, written_note

    if check:
        _check(rendered.objects)
        monitors = [f"{o['kind']} {o['metadata']['name']}" for o in rendered.objects if needs_prometheus_operator(o)]
        if monitors and not prometheus_operator:
            _note(
                f"{', '.join(monitors)}: valid, but left out of what `kubectl apply` takes (it needs the Prometheus "
                f"Operator's CRDs); add {MONITORING_FLAG} where the cluster has them"
            )
    if output is None:
        text = to_yaml(rendered.objects, create_namespace=create_namespace, prometheus_operator=prometheus_operator)
        sys.stdout.write(text)
        return
    written = write_dir(rendered.objects, output, create_namespace, prometheus_operator)
    _note(written_note(written, output, rendered.names.namespace))


def submit_cmd(
    args: list[str] = typer.Argument(None, help=RECIPE_ARGS_HELP + " With --serve: " + SERVE_ARGS_HELP),
    profile: str | None = _profile_opt,
    api: str | None = _api_opt,
    devices: str | None = _devices_opt,
    kubernetes_version: str | None = _kubernetes_version_opt,
    namespace: str | None = typer.Option(None, "-n", "--namespace", help=SUBMIT_NAMESPACE_HELP),
    hf_token_file: Path | None = _token_opt,
    with_runtime: bool = _runtime_opt,
    serve: bool = typer.Option(
        False, "--serve", help="Submit the serving objects of a run (what render-serve renders) instead of a job."
    ),
    via_operator: bool = typer.Option(
        False,
        "--via-operator",
        help="Create a FineTune instead: kubetune's operator runs the job, then (with --serve) exports and serves.",
    ),
    serving: dict[str, Any] | None = None,
):
    """Create or update every rendered object in the cluster (idempotent), after validating them."""
    from kubetune import kubeapi
    from kubetune.k8s import follow

    serving = serving or {}
    token = _read_token(hf_token_file)
    args = _with_namespace(_with_devices(args or [], devices, kubernetes_version), namespace, serve)
    if via_operator:
        _submit_finetune(args or [], profile, api, token, with_runtime, serve, serving)
        return
    if serve:
        if api or with_runtime:
            raise UserError("--api and --with-runtime are options of a training job, not of --serve")
        settings = ServeSettings.from_flags(serving)
        rendered = _render_serve(args or [], profile, settings, token)
    else:
        given = flags_given(serving)
        if given:
            raise UserError(f"{', '.join(given)}: serving options, for `kubetune k8s submit --serve RUN`")
        rendered = _render(args or [], profile, api, token, with_runtime, need_token=True)
    _check(rendered.objects)
    if token is None:
        _note("no Hugging Face token (--hf-token-file or HF_TOKEN): fine for public models, gated ones will fail")
    for line in follow.submit(kubeapi.connect(), rendered):
        typer.echo(line)
    typer.echo(f"follow it: kubetune k8s status {rendered.names.job} -n {rendered.names.namespace}")


def _submit_finetune(args, profile, api, token, with_runtime, serve: bool, serving: dict[str, Any]) -> None:
    """Validate the recipe here (one line per problem, as submit does), then create the FineTune."""
    from kubetune import kubeapi
    from kubetune.k8s import finetune
    from kubetune.k8s.render import job_name, render

    if with_runtime:
        raise UserError("--with-runtime: the operator references the recipe's k8s.runtime; submit the runtime first")
    unknown = [flag for flag in flags_given(serving) if flag not in FINETUNE_FLAGS or not serve]
    if unknown:
        raise UserError(
            f"{', '.join(unknown)}: not a FineTune option; with --via-operator, --serve takes "
            + ", ".join(FINETUNE_FLAGS)
        )
    recipe = _load(args, profile, api)
    if token is None:
        _refuse_without_token(recipe)
    _check(render(recipe, hf_token=token).objects)  # what the operator will create, validated now
    spec_serve = spec_given(serving) if serve else None
    ft = finetune.finetune_object(recipe, job_name(recipe), with_token=token is not None, serve=spec_serve)
    for line in finetune.submit(kubeapi.connect(), ft, token):
        typer.echo(line)
    typer.echo(f"follow it: kubectl get finetune {ft['metadata']['name']} -n {recipe.k8s.namespace} -w")


def status_cmd(
    name: str = typer.Argument(..., help="Job name, or the name of serving objects (<job>-serve)."),
    namespace: str | None = _namespace_opt,
):
    """Job conditions, each replica's pod, and training progress (step, loss, tokens/s, ETA); for
    serving objects the Deployment's ready replicas, its autoscaler, its pods and its endpoint."""
    from kubetune import kubeapi
    from kubetune.k8s import finetune, follow

    namespace = kubeapi.resolve_namespace(namespace)
    api = kubeapi.connect()
    ft = api.get(finetune.API_VERSION, finetune.KIND, name, namespace)
    if ft is not None:  # run by the operator: its status first, then the job's while there is one
        for line in finetune.status_lines(ft):
            typer.echo(line)
        if not any(api.get(av, kind, name, namespace) for av, kind, _ in follow.JOB_KINDS):
            return
    for line in follow.status(api, name, namespace).lines:
        typer.echo(line)


def logs_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str | None = _namespace_opt,
    follow_: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines."),
    rank: int = typer.Option(0, "--rank", help="Node rank (0 = master-0 / node 0)."),
    tail: int | None = typer.Option(None, "--tail", help="Only the last N lines."),
):
    """Print a replica's log (rank 0 by default)."""
    from kubetune import kubeapi
    from kubetune.k8s import follow

    namespace = kubeapi.resolve_namespace(namespace)
    for line in follow.logs(kubeapi.connect(), name, namespace, rank=rank, follow=follow_, tail_lines=tail):
        typer.echo(line)


def download_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str | None = _namespace_opt,
    output: Path = typer.Option(Path("."), "-o", "--output", help="Local directory to copy into."),
):
    """Copy the run's output directory (adapter, checkpoints, metrics) out of the data-access pod."""
    from kubetune import kubeapi
    from kubetune.k8s import follow

    namespace = kubeapi.resolve_namespace(namespace)
    typer.echo(str(follow.download(kubeapi.connect(), name, namespace, output)))


def delete_cmd(
    name: str = typer.Argument(..., help="Job name, or the name of serving objects (<job>-serve)."),
    namespace: str | None = _namespace_opt,
    purge: bool = typer.Option(False, "--purge", help="Also the PVC (data, checkpoints!), data pod and quota."),
):
    """Delete the job and its pods (the PVC only with --purge), and the serving objects of that name."""
    from kubetune import kubeapi
    from kubetune.k8s import follow

    namespace = kubeapi.resolve_namespace(namespace)
    for line in follow.delete(kubeapi.connect(), name, namespace, purge=purge):
        typer.echo(line)


def doctor_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str | None = _namespace_opt,
):
    """Explain why the job is Pending, crashing or hanging, with the fix for each finding."""
    from kubetune import kubeapi
    from kubetune.contracts.findings import has_errors
    from kubetune.k8s import doctor

    namespace = kubeapi.resolve_namespace(namespace)
    findings = doctor.diagnose(doctor.collect(kubeapi.connect(), name, namespace))
    for line in doctor.report(findings):
        typer.echo(line)
    if has_errors(findings):
        raise typer.Exit(1)


def register(k8s_app: typer.Typer) -> None:
    k8s_app.command("render")(render_cmd)
    k8s_app.command("render-serve")(with_serve_options(render_serve_cmd))
    k8s_app.command("submit")(with_serve_options(submit_cmd))
    k8s_app.command("status")(status_cmd)
    k8s_app.command("logs")(logs_cmd)
    k8s_app.command("download")(download_cmd)
    k8s_app.command("delete")(delete_cmd)
    k8s_app.command("doctor")(doctor_cmd)
