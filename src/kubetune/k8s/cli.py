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
    from kubetune.k8s.client import resolve_namespace
    from kubetune.k8s.serve.plan import load_source

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


def _render(args: list[str], profile: str | None, api: str | None, token: str | None, with_runtime: bool):
    from kubetune.k8s.render import render

    rendered = render(_load(args, profile, api), hf_token=token, with_runtime=with_runtime)
    for warning in rendered.warnings:
        _note(f"warning: {warning}")
    return rendered


def _load(args: list[str], profile: str | None, api: str | None):
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
    return load_recipe(recipe, overrides).recipe


def _check(objects: list[dict]) -> None:
    from kubetune.k8s.validate import KUBERNETES_VERSION, validate_objects

    problems = validate_objects(objects)
    if problems:
        raise UserError(*[f"invalid manifest: {p}" for p in problems])
    _note(
        f"checked {len(objects)} objects: all valid (core kinds: kubernetes-validate {KUBERNETES_VERSION} strict; "
        "custom resources: the vendored CRD schemas of Kubeflow and the Prometheus Operator)"
    )


# ------------------------------------------------------------------ serving (render-serve, submit --serve)

SERVE_ARGS_HELP = (
    "RUN|RECIPE [key=value ...]: a run directory of `kubetune train` (served from the job's volume, or "
    "--model-image), or the recipe of a cluster job (its output_dir on the volume), then overrides."
)
SERVE_PANEL = "Serving (render-serve; submit --serve)"
_engine_opt = typer.Option(
    None, "--engine", help="native (kubetune serve; default) | vllm (vLLM's image).", rich_help_panel=SERVE_PANEL
)
_replicas_opt = typer.Option(
    None,
    "--replicas",
    help="Pods (default 1); with autoscaling the least the HPA keeps (--min-replicas).",
    rich_help_panel=SERVE_PANEL,
)
_min_opt = typer.Option(
    None, "--min-replicas", help="HPA minReplicas (default --replicas).", rich_help_panel=SERVE_PANEL
)
_max_opt = typer.Option(
    None, "--max-replicas", help="HPA maxReplicas (default max(4, min)).", rich_help_panel=SERVE_PANEL
)
_adapter_opt = typer.Option(
    None,
    "--adapter",
    help="NAME=RUN_DIR: also serve that run's LoRA adapter as model NAME (repeatable; a relative RUN_DIR is "
    "under the volume's root, e.g. runs/cardio = /data/runs/cardio).",
    rich_help_panel=SERVE_PANEL,
)
_image_opt = typer.Option(
    None,
    "--image",
    help="The server's image (default: kubetune's for the profile, or vLLM's with --engine vllm).",
    rich_help_panel=SERVE_PANEL,
)
_model_image_opt = typer.Option(
    None,
    "--model-image",
    help="Read the run directory from this image (at /model) instead of the training job's volume claim.",
    rich_help_panel=SERVE_PANEL,
)
_name_opt = typer.Option(
    None, "--name", help="Name of the serving objects (default <job>-serve).", rich_help_panel=SERVE_PANEL
)
_host_opt = typer.Option(
    None, "--ingress-host", help="The Ingress's host, e.g. llm.example.com.", rich_help_panel=SERVE_PANEL
)
_class_opt = typer.Option(
    None, "--ingress-class", help="ingressClassName (default nginx).", rich_help_panel=SERVE_PANEL
)
_autoscale_opt = typer.Option(
    None,
    "--autoscale",
    help="queue (waiting requests per pod through prometheus-adapter, CPU as fallback; default) | cpu | off.",
    rich_help_panel=SERVE_PANEL,
)
_queue_target_opt = typer.Option(
    None, "--queue-target", help="Waiting requests per pod the HPA aims at (default 2).", rich_help_panel=SERVE_PANEL
)
_cpu_target_opt = typer.Option(
    None,
    "--cpu-target",
    help="CPU utilisation (percent of the request) the HPA aims at (default 80).",
    rich_help_panel=SERVE_PANEL,
)

_api_key_secret_opt = typer.Option(
    None,
    "--api-key-secret",
    help="An existing Secret whose key `api-key` holds the server's API key (several: comma-separated; vLLM takes "
    "one); every route but the probes and /metrics then needs `Authorization: Bearer KEY`.",
    rich_help_panel=SERVE_PANEL,
)
_no_network_policy_opt = typer.Option(
    False, "--no-network-policy", help="Render no NetworkPolicy for the server.", rich_help_panel=SERVE_PANEL
)
_ingress_namespace_opt = typer.Option(
    None,
    "--ingress-namespace",
    help="The ingress controller's namespace, let in by the NetworkPolicy (default ingress-nginx).",
    rich_help_panel=SERVE_PANEL,
)
_monitoring_namespace_opt = typer.Option(
    None,
    "--monitoring-namespace",
    help="Prometheus's namespace, let in by the NetworkPolicy for /metrics (default monitoring).",
    rich_help_panel=SERVE_PANEL,
)
_tls_secret_opt = typer.Option(
    None,
    "--ingress-tls-secret",
    help="TLS on the Ingress from this kubernetes.io/tls Secret (needs --ingress-host).",
    rich_help_panel=SERVE_PANEL,
)
_issuer_opt = typer.Option(
    None,
    "--cert-manager-issuer",
    help="TLS on the Ingress from this cert-manager ClusterIssuer, into the Secret <name>-tls (needs --ingress-host).",
    rich_help_panel=SERVE_PANEL,
)
_require_cpu_opt = typer.Option(
    False,
    "--require-cpu-features",
    help="cpu: schedule only on nodes with k8s.amx_label (default: preferred, other nodes run fp32).",
    rich_help_panel=SERVE_PANEL,
)


def _access_settings(
    api_key_secret: str | None,
    no_network_policy: bool,
    ingress_namespace: str | None,
    monitoring_namespace: str | None,
    ingress_tls_secret: str | None,
    cert_manager_issuer: str | None,
    require_cpu_features: bool,
) -> dict[str, Any]:
    """The access and placement options as ServeSettings fields (None = not given)."""
    return {
        "api_key_secret": api_key_secret,
        "network_policy": False if no_network_policy else None,
        "ingress_namespace": ingress_namespace,
        "monitoring_namespace": monitoring_namespace,
        "ingress_tls_secret": ingress_tls_secret,
        "cert_manager_issuer": cert_manager_issuer,
        "require_cpu_features": True if require_cpu_features else None,
    }


def _serve_settings(
    engine: str | None,
    replicas: int | None,
    min_replicas: int | None,
    max_replicas: int | None,
    adapters: list[str] | None,
    image: str | None,
    model_image: str | None,
    name: str | None,
    ingress_host: str | None,
    ingress_class: str | None,
    autoscale: str | None,
    queue_target: int | None,
    cpu_target: int | None,
    access: dict[str, Any],
):
    """The serving options as given (None = not given) -> ServeSettings with the defaults."""
    from kubetune.k8s.serve import ServeSettings
    from kubetune.serve.contract import parse_adapter

    given: dict[str, Any] = {
        "engine": engine,
        "replicas": replicas,
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "adapters": tuple(parse_adapter(a) for a in adapters) if adapters else None,
        "image": image,
        "model_image": model_image,
        "name": name,
        "ingress_host": ingress_host,
        "ingress_class": ingress_class,
        "autoscale": autoscale,
        "queue_target": queue_target,
        "cpu_target": cpu_target,
        **access,
    }
    return ServeSettings(**{k: v for k, v in given.items() if v is not None})


def _render_serve(args: list[str], profile: str | None, settings, token: str | None):
    from kubetune.k8s.serve.plan import load_source
    from kubetune.k8s.serve.render import render_serve

    if not args:
        raise UserError(
            "give a run: `kubetune k8s render-serve RUN_DIR|RECIPE [key=value ...]` "
            "(a directory `kubetune train` wrote, or the recipe of a cluster job)"
        )
    source, overrides = args[0], list(args[1:])
    if "=" in source:
        raise UserError(f"the first argument must be a run directory or a recipe, not the override `{source}`")
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
_token_opt = typer.Option(None, "--hf-token-file", help="File holding the Hugging Face token (default: $HF_TOKEN).")
_runtime_opt = typer.Option(
    False, "--with-runtime", help="trainjob: also render a ClusterTrainingRuntime for this job."
)
_create_namespace_opt = typer.Option(
    False,
    "--create-namespace",
    help="Also render the Namespace (left out by default: `kubectl delete` of the output would delete it and all in "
    "it); with -o as a file outside kustomization.yaml.",
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
    create_namespace: bool = _create_namespace_opt,
):
    """Render the recipe as Kubernetes manifests (stdout, or files with -o for `kubectl apply -k`).

    On stdout the HF-token Secret is replaced by a comment: the token is only ever written
    to DIR/secret-*.yaml (mode 0600) with -o, or sent to the cluster by `submit`.
    """
    from kubetune.k8s.render import to_yaml, write_dir, written_note

    rendered = _render(args or [], profile, api, _read_token(hf_token_file), with_runtime)
    if check:
        _check(rendered.objects)
    if output is None:
        sys.stdout.write(to_yaml(rendered.objects, redact_secrets=True, create_namespace=create_namespace))
        return
    _note(written_note(write_dir(rendered.objects, output, create_namespace), output, rendered.names.namespace))


def render_serve_cmd(
    args: list[str] = typer.Argument(None, help=SERVE_ARGS_HELP),
    profile: str | None = _profile_opt,
    engine: str | None = _engine_opt,
    replicas: int | None = _replicas_opt,
    min_replicas: int | None = _min_opt,
    max_replicas: int | None = _max_opt,
    adapter: list[str] | None = _adapter_opt,
    image: str | None = _image_opt,
    model_image: str | None = _model_image_opt,
    name: str | None = _name_opt,
    ingress_host: str | None = _host_opt,
    ingress_class: str | None = _class_opt,
    autoscale: str | None = _autoscale_opt,
    queue_target: int | None = _queue_target_opt,
    cpu_target: int | None = _cpu_target_opt,
    api_key_secret: str | None = _api_key_secret_opt,
    no_network_policy: bool = _no_network_policy_opt,
    ingress_namespace: str | None = _ingress_namespace_opt,
    monitoring_namespace: str | None = _monitoring_namespace_opt,
    ingress_tls_secret: str | None = _tls_secret_opt,
    cert_manager_issuer: str | None = _issuer_opt,
    require_cpu_features: bool = _require_cpu_opt,
    output: Path | None = typer.Option(
        None, "-o", "--output", help="Write one file per object + kustomization.yaml here."
    ),
    hf_token_file: Path | None = _token_opt,
    check: bool = typer.Option(False, "--check", help="Validate every object offline (kubernetes-validate, strict)."),
    create_namespace: bool = _create_namespace_opt,
):
    """Render the serving objects of a trained run: Deployment, Service, Ingress, NetworkPolicy,
    PodDisruptionBudget, HorizontalPodAutoscaler and the prometheus-adapter rule it reads (stdout, or files with -o).

    `kubetune k8s submit --serve RUN ...` applies the same objects; `status` and `delete` take
    their name (`<job>-serve`).
    """
    from kubetune.k8s.render import to_yaml, write_dir, written_note

    settings = _serve_settings(
        engine,
        replicas,
        min_replicas,
        max_replicas,
        adapter,
        image,
        model_image,
        name,
        ingress_host,
        ingress_class,
        autoscale,
        queue_target,
        cpu_target,
        _access_settings(
            api_key_secret,
            no_network_policy,
            ingress_namespace,
            monitoring_namespace,
            ingress_tls_secret,
            cert_manager_issuer,
            require_cpu_features,
        ),
    )
    rendered = _render_serve(args or [], profile, settings, _read_token(hf_token_file))
    if check:
        _check(rendered.objects)
    if output is None:
        sys.stdout.write(to_yaml(rendered.objects, redact_secrets=True, create_namespace=create_namespace))
        return
    _note(written_note(write_dir(rendered.objects, output, create_namespace), output, rendered.names.namespace))


def submit_cmd(
    args: list[str] = typer.Argument(None, help=RECIPE_ARGS_HELP + " With --serve: " + SERVE_ARGS_HELP),
    profile: str | None = _profile_opt,
    api: str | None = _api_opt,
    namespace: str | None = typer.Option(None, "-n", "--namespace", help=SUBMIT_NAMESPACE_HELP),
    hf_token_file: Path | None = _token_opt,
    with_runtime: bool = _runtime_opt,
    serve: bool = typer.Option(
        False, "--serve", help="Submit the serving objects of a run (what render-serve renders) instead of a job."
    ),
    engine: str | None = _engine_opt,
    replicas: int | None = _replicas_opt,
    min_replicas: int | None = _min_opt,
    max_replicas: int | None = _max_opt,
    adapter: list[str] | None = _adapter_opt,
    image: str | None = _image_opt,
    model_image: str | None = _model_image_opt,
    name: str | None = _name_opt,
    ingress_host: str | None = _host_opt,
    ingress_class: str | None = _class_opt,
    autoscale: str | None = _autoscale_opt,
    queue_target: int | None = _queue_target_opt,
    cpu_target: int | None = _cpu_target_opt,
    api_key_secret: str | None = _api_key_secret_opt,
    no_network_policy: bool = _no_network_policy_opt,
    ingress_namespace: str | None = _ingress_namespace_opt,
    monitoring_namespace: str | None = _monitoring_namespace_opt,
    ingress_tls_secret: str | None = _tls_secret_opt,
    cert_manager_issuer: str | None = _issuer_opt,
    require_cpu_features: bool = _require_cpu_opt,
    via_operator: bool = typer.Option(
        False,
        "--via-operator",
        help="Create a FineTune instead: kubetune's operator runs the job, then (with --serve) exports and serves.",
    ),
):
    """Create or update every rendered object in the cluster (idempotent), after validating them."""
    from kubetune.k8s import client, follow

    serve_options = {
        "--engine": engine,
        "--replicas": replicas,
        "--min-replicas": min_replicas,
        "--max-replicas": max_replicas,
        "--adapter": adapter,
        "--image": image,
        "--model-image": model_image,
        "--name": name,
        "--ingress-host": ingress_host,
        "--ingress-class": ingress_class,
        "--autoscale": autoscale,
        "--queue-target": queue_target,
        "--cpu-target": cpu_target,
    }
    access = _access_settings(
        api_key_secret,
        no_network_policy,
        ingress_namespace,
        monitoring_namespace,
        ingress_tls_secret,
        cert_manager_issuer,
        require_cpu_features,
    )
    flags = {field: "--" + field.replace("_", "-") for field in access}
    flags["network_policy"] = "--no-network-policy"
    serve_options.update({flags[field]: value for field, value in access.items()})
    token = _read_token(hf_token_file)
    args = _with_namespace(args or [], namespace, serve)
    if via_operator:
        _submit_finetune(args or [], profile, api, token, with_runtime, serve, serve_options)
        return
    if serve:
        if api or with_runtime:
            raise UserError("--api and --with-runtime are options of a training job, not of --serve")
        settings = _serve_settings(
            engine,
            replicas,
            min_replicas,
            max_replicas,
            adapter,
            image,
            model_image,
            name,
            ingress_host,
            ingress_class,
            autoscale,
            queue_target,
            cpu_target,
            access,
        )
        rendered = _render_serve(args or [], profile, settings, token)
    else:
        given = [option for option, value in serve_options.items() if value is not None]
        if given:
            raise UserError(f"{', '.join(given)}: serving options, for `kubetune k8s submit --serve RUN`")
        rendered = _render(args or [], profile, api, token, with_runtime)
    _check(rendered.objects)
    if token is None:
        _note("no Hugging Face token (--hf-token-file or HF_TOKEN): fine for public models, gated ones will fail")
    for line in follow.submit(client.connect(), rendered):
        typer.echo(line)
    typer.echo(f"follow it: kubetune k8s status {rendered.names.job} -n {rendered.names.namespace}")


# what `submit --via-operator --serve` maps to a FineTune's spec.serve (the others are render-serve's only)
FINETUNE_SERVE_OPTIONS = {
    "--engine": "engine",
    "--replicas": "replicas",
    "--min-replicas": "minReplicas",
    "--max-replicas": "maxReplicas",
    "--image": "image",
    "--ingress-host": "ingressHost",
    "--autoscale": "autoscale",
}


def _submit_finetune(args, profile, api, token, with_runtime, serve: bool, options: dict[str, Any]) -> None:
    """Validate the recipe here (one line per problem, as submit does), then create the FineTune."""
    from kubetune.k8s import client, finetune
    from kubetune.k8s.render import job_name, render

    if with_runtime:
        raise UserError("--with-runtime: the operator references the recipe's k8s.runtime; submit the runtime first")
    given = [o for o, v in options.items() if v is not None]
    unknown = [o for o in given if o not in FINETUNE_SERVE_OPTIONS or not serve]
    if unknown:
        raise UserError(
            f"{', '.join(unknown)}: not a FineTune option; with --via-operator, --serve takes "
            + ", ".join(FINETUNE_SERVE_OPTIONS)
        )
    recipe = _load(args, profile, api)
    _check(render(recipe, hf_token=token).objects)  # what the operator will create, validated now
    spec_serve = {FINETUNE_SERVE_OPTIONS[o]: options[o] for o in given} if serve else None
    ft = finetune.finetune_object(recipe, job_name(recipe), with_token=token is not None, serve=spec_serve)
    for line in finetune.submit(client.connect(), ft, token):
        typer.echo(line)
    typer.echo(f"follow it: kubectl get finetune {ft['metadata']['name']} -n {recipe.k8s.namespace} -w")


def status_cmd(
    name: str = typer.Argument(..., help="Job name, or the name of serving objects (<job>-serve)."),
    namespace: str | None = _namespace_opt,
):
    """Job conditions, each replica's pod, and training progress (step, loss, tokens/s, ETA); for
    serving objects the Deployment's ready replicas, its autoscaler, its pods and its endpoint."""
    from kubetune.k8s import client, finetune, follow

    namespace = client.resolve_namespace(namespace)
    api = client.connect()
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
    from kubetune.k8s import client, follow

    namespace = client.resolve_namespace(namespace)
    for line in follow.logs(client.connect(), name, namespace, rank=rank, follow=follow_, tail_lines=tail):
        typer.echo(line)


def download_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str | None = _namespace_opt,
    output: Path = typer.Option(Path("."), "-o", "--output", help="Local directory to copy into."),
):
    """Copy the run's output directory (adapter, checkpoints, metrics) out of the data-access pod."""
    from kubetune.k8s import client, follow

    namespace = client.resolve_namespace(namespace)
    typer.echo(str(follow.download(client.connect(), name, namespace, output)))


def delete_cmd(
    name: str = typer.Argument(..., help="Job name, or the name of serving objects (<job>-serve)."),
    namespace: str | None = _namespace_opt,
    purge: bool = typer.Option(False, "--purge", help="Also the PVC (data, checkpoints!), data pod and quota."),
):
    """Delete the job and its pods (the PVC only with --purge), and the serving objects of that name."""
    from kubetune.k8s import client, follow

    namespace = client.resolve_namespace(namespace)
    for line in follow.delete(client.connect(), name, namespace, purge=purge):
        typer.echo(line)


def doctor_cmd(
    name: str = typer.Argument(..., help="Job name."),
    namespace: str | None = _namespace_opt,
):
    """Explain why the job is Pending, crashing or hanging, with the fix for each finding."""
    from kubetune.k8s import client, doctor

    namespace = client.resolve_namespace(namespace)
    findings = doctor.diagnose(doctor.collect(client.connect(), name, namespace))
    for line in doctor.report(findings):
        typer.echo(line)
    if any(f.severity == "error" for f in findings):
        raise typer.Exit(1)


def register(k8s_app: typer.Typer) -> None:
    k8s_app.command("render")(render_cmd)
    k8s_app.command("render-serve")(render_serve_cmd)
    k8s_app.command("submit")(submit_cmd)
    k8s_app.command("status")(status_cmd)
    k8s_app.command("logs")(logs_cmd)
    k8s_app.command("download")(download_cmd)
    k8s_app.command("delete")(delete_cmd)
    k8s_app.command("doctor")(doctor_cmd)
