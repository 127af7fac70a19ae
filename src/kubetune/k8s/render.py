"""Render (pure): recipe -> Kubernetes manifests, as plain dicts in apply order.

Objects: Namespace, [PriorityClass], [ResourceQuota], PVC, [Secret], ConfigMap (the
resolved recipe), [PodGroup], [ClusterTrainingRuntime], [PodMonitor, with monitor.in_cluster:
the pods serve metrics on monitor.port, 9450 unless set], the data-access Pod, [with --kueue:
Kueue's Topology, ResourceFlavor, ClusterQueue, LocalQueue], and the job
(PyTorchJob kubeflow.org/v1 or TrainJob trainer.kubeflow.org/v1alpha1). Every namespaced
object lives in `k8s.namespace`. Each training container runs

    kubetune train /etc/kubetune/recipe.yaml

with the PVC at /data (output_dir, the tokenized-data and model caches), so a restarted pod
resumes from its last checkpoint (train.resume=auto). Nothing here talks to a cluster.

The Namespace is for `submit` (which creates it only when missing); the printed and written
output (`to_yaml`, `write_dir`) leaves it out unless asked for, since a namespace may hold far
more than this job and `kubectl delete` of the output would delete it with all of that. The
PodMonitor is in the output (and its kustomization.yaml) only where the cluster has the
Prometheus Operator's CRDs (`prometheus_operator`): kubectl refuses the whole `apply -k` without
them. A job that could never fit in a ResourceQuota rendered with it is refused (`quota_problems`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml

from kubetune.contracts.kube import KubeObject
from kubetune.errors import RecipeError, UserError
from kubetune.k8s import claims, jobs, kueue, objects, profiles, quota
from kubetune.k8s.names import DATA_DIR, NAMESPACE_QUOTA, TOKEN_KEY, Names
from kubetune.k8s.scrape import metrics_port, training_pod_monitor
from kubetune.recipe.chat_template import chat_template_problem, template_note
from kubetune.recipe.comm import comm_warnings
from kubetune.recipe.footprint import memory_problem
from kubetune.recipe.gated import needs_token
from kubetune.recipe.k8s import K8sSection, resource_problems
from kubetune.recipe.layout import check_hosts, check_model, check_recipe, global_batch, layout_for, model_shape
from kubetune.recipe.schema import Recipe

TOKEN_REDACTED_NOTE = (
    "# Secret {name}: not printed (it holds the Hugging Face token); use -o DIR or `kubetune k8s submit`"
)
# The Prometheus Operator's kinds (PodMonitor, ServiceMonitor, PrometheusRule): kubectl refuses a
# whole `apply -k` ("no matches for kind") on a cluster without their CRDs, and Intel's Xeon guide
# (Kubeflow and its huggingface-llm Helm chart) installs kube-prometheus-stack last. So the output
# holds them only where the user says the cluster has them (`--monitoring prometheus-operator`);
# `submit` asks the cluster instead.
MONITORING_API = "monitoring.coreos.com/v1"
MONITORING_FLAG = "--monitoring prometheus-operator"
MONITOR_LEFT_OUT_NOTE = (
    "# {kind} {name}: not printed (it needs the Prometheus Operator's CRDs, without which kubectl refuses it); "
    f"add {MONITORING_FLAG} where the cluster has them"
)
MONITOR_FILE_HEADER = (
    "# Not in kustomization.yaml: a {kind} needs the Prometheus Operator's CRDs (kube-prometheus-stack),\n"
    "# without which `kubectl apply -k` fails as a whole. Apply this file with `kubectl apply -f` once they\n"
    f"# are installed, or render with {MONITORING_FLAG} to have it in the kustomization.\n"
)


@dataclass
class Rendered:
    objects: list[KubeObject]
    names: Names
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the job will do, where the recipe leaves it implicit

    @property
    def job(self) -> KubeObject:
        return self.objects[-1]


def job_name(recipe: Recipe) -> str:
    """k8s.name, or output_dir's last part made a DNS-1123 label (short: pods add suffixes)."""
    if recipe.k8s.name:
        return recipe.k8s.name
    base = PurePosixPath(recipe.output_dir.rstrip("/")).name or "kubetune"
    slug = re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-")[:40].strip("-")
    return slug or "kubetune"


def cluster_recipe(recipe: Recipe, names: Names) -> Recipe:
    """The recipe as the pods see it: output_dir on the PVC (checkpoints survive restarts), and
    with monitor.in_cluster the metrics port set, so that every pod serves what the PodMonitor scrapes."""
    out = recipe.output_dir
    if not (out == DATA_DIR or out.startswith(DATA_DIR + "/")):
        out = f"{DATA_DIR}/runs/{names.job}"
    update: dict[str, object] = {"output_dir": out}
    if recipe.monitor.in_cluster:
        update["monitor"] = recipe.monitor.model_copy(update={"port": metrics_port(recipe)})
    return recipe.model_copy(update=update)


# ---------------------------------------------------------------------------------- render


def _portability_warnings(recipe: Recipe, with_runtime: bool) -> list[str]:
    k8s, warnings = recipe.k8s, []
    for key, value in (
        ("data.train", recipe.data.train),
        ("data.eval", recipe.data.eval),
        ("model.name_or_path", recipe.model.name_or_path),
    ):
        if isinstance(value, str) and not value.startswith(DATA_DIR + "/") and Path(value).exists():
            warnings.append(
                f"{key}={value} is a local path the pods cannot see: copy it to the PVC "
                f"(kubetune k8s download's data pod, /data/...) and point {key} there"
            )
    if k8s.quota:
        warnings.append(
            f"k8s.quota=true sizes ResourceQuota {job_name(recipe)}-quota to this job alone, but a quota caps every "
            f"pod of namespace {k8s.namespace}: another job there will not fit (nor this one beside it); for a team "
            "budget set k8s.namespace_quota.cpu/memory/accelerators/pods instead"
        )
    if k8s.namespace_quota.accelerators is not None and k8s.profile == "cpu":
        warnings.append(
            "k8s.namespace_quota.accelerators is not rendered on the cpu profile (no accelerator resource); "
            "the namespace quota caps cpu, memory and pods only"
        )
    if recipe.train.resume != "auto":
        warnings.append(f"train.resume={recipe.train.resume}: a restarted pod will not resume from its last checkpoint")
    if with_runtime and k8s.api != "trainjob":
        warnings.append("--with-runtime only applies to --api trainjob; ignored for a PyTorchJob")
    if k8s.api == "trainjob" and not with_runtime:
        missing = [
            what
            for what, needed in (
                ("hostIPC (gaudi)", k8s.profile == "gaudi"),
                ("k8s.priority_class", bool(k8s.priority_class)),
                (f"k8s.gang={k8s.gang}", k8s.gang != "none"),
                ("the pods' resourceClaims (k8s.devices=dra)", k8s.devices == "dra"),
                ("the trackers' envFrom (monitor.tracking_env_from)", objects.tracking_env_from(recipe) is not None),
            )
            if needed
        ]
        if missing:
            warnings.append(
                f"a TrainJob cannot set {', '.join(missing)} itself: add --with-runtime "
                f"or use a ClusterTrainingRuntime `{k8s.runtime}` that has them"
            )
    return warnings


def layout_problems(recipe: Recipe) -> list[str]:
    """What training checks at start-up, checked here before any pod starts: the `parallel`
    degrees against the job's process count (every size an elastic job may take), against
    the model's shape when it is known without loading it, and against the recipe."""
    k8s = recipe.k8s
    lo, hi = k8s.elastic_range()
    shape = model_shape(recipe.model.name_or_path)
    for replicas in sorted({lo, hi}):
        world = replicas * k8s.processes_per_pod()
        try:
            layout = layout_for(recipe.parallel, world)
            check_hosts(layout, k8s.processes_per_pod())
        except UserError as e:
            return [f"{e} (k8s.replicas={replicas} x k8s.nproc_per_node={k8s.processes_per_pod()} = {world} processes)"]
        try:
            if shape is not None:
                check_model(layout, shape, recipe)  # check_recipe too
            else:
                check_recipe(layout, recipe)
        except UserError as e:
            return [str(e)]
    return []


def batch_notes(recipe: Recipe) -> list[str]:
    """The rows and tokens of one optimizer step, at every size the job may take (layout_problems
    has checked that each is valid)."""
    k8s, train, notes = recipe.k8s, recipe.train, []
    row_tokens = recipe.data.max_seq_len * (2 if recipe.finetune.on_pairs else 1)  # a pair's two sequences
    lo, hi = k8s.elastic_range()
    for replicas in sorted({lo, hi}):
        dp = layout_for(recipe.parallel, replicas * k8s.processes_per_pod()).data_parallel_size
        rows = global_batch(train, dp)
        at = f" at k8s.replicas={replicas}" if lo != hi else ""
        notes.append(
            f"global batch{at}: {rows:,} rows per optimizer step (train.micro_batch_size={train.micro_batch_size} x "
            f"{rows // (train.micro_batch_size * dp)} micro-batches x {dp} data-parallel replica(s)"
            + (f", train.global_batch_size={train.global_batch_size}" if train.global_batch_size else "")
            + f"), up to {rows * row_tokens:,} tokens per step (rows of up to {row_tokens} tokens)"
        )
    return notes


def default_notes(recipe: Recipe) -> list[str]:
    """What the job takes from kubetune's defaults where Intel's huggingface-llm chart says otherwise: the workers."""
    if "replicas" in recipe.k8s.model_fields_set:
        return []
    default = f"{recipe.k8s.replicas} worker pods (kubetune's default; Intel's huggingface-llm chart runs 4)"
    return [f"k8s.replicas is not set: {default}"]


def layout_warnings(recipe: Recipe) -> list[str]:
    """A split model whose shape render cannot know: its degrees are checked only in the pods."""
    parallel, name = recipe.parallel, recipe.model.name_or_path
    if (parallel.tp > 1 or parallel.pp > 1) and model_shape(name) is None:
        warning = (
            f"model.name_or_path={name}: its shape (attention and key/value heads, MLP width, layers) is unknown "
            f"without downloading it, so parallel.tp={parallel.tp} and parallel.pp={parallel.pp} are checked "
            "against it only when the pods start"
        )
        return [warning]
    return []


def _quota_keys(k8s: K8sSection, resource: str) -> tuple[str, str] | None:
    """(the k8s.namespace_quota key, what sizes the job's share) of a resource the namespace quota caps."""
    if resource in ("cpu", "memory"):
        return f"k8s.namespace_quota.{resource}", f"k8s.replicas or {k8s.resource_key(resource)}"
    if resource == profiles.PROFILES[k8s.profile].accelerator_resource:
        return "k8s.namespace_quota.accelerators", f"k8s.replicas or {k8s.resource_key('accelerators')}"
    if resource == "pods":
        return "k8s.namespace_quota.pods", "k8s.replicas"
    return None


def quota_problems(rendered: list[KubeObject], k8s: K8sSection) -> list[str]:
    """A job beyond a ResourceQuota rendered with it could never start (`submit`'s check, in an
    empty namespace): one line per resource, naming the quota's key, the job's and the fix."""
    need, problems = quota.rendered_usage(rendered), []
    workers = k8s.elastic_range()[1] if k8s.elastic.enabled else k8s.replicas
    per_pod = profiles.resource_list(k8s)
    for budget in (obj for obj in rendered if obj["kind"] == "ResourceQuota"):
        name = budget["metadata"]["name"]
        for counted, needed, hard in quota.beyond(budget, need):
            resource = counted.removeprefix("requests.").removeprefix("limits.")
            each = f" of {per_pod[resource]}" if resource in per_pod else ""
            demand = f"{quota.fmt(counted, needed)} {resource} ({workers} training pods{each} and the data-access pod)"
            keys = _quota_keys(k8s, resource) if name == NAMESPACE_QUOTA else None
            if keys is None:
                problems.append(f"ResourceQuota {name} caps {counted} at {quota.fmt(counted, hard)}, below {demand}")
                continue
            budget_key, share_keys = keys
            problems.append(
                f"{budget_key}={quota.fmt(counted, hard)} is less than what this job requests, {demand}: it "
                f"could never start; raise {budget_key} to at least {quota.fmt(counted, needed)}, or lower {share_keys}"
            )
    return problems


def with_rollout_server(recipe: Recipe) -> tuple[Recipe, bool]:
    """(the recipe, whether render adds GRPO's rollout server): rollout=server without a server_url
    (or with its own Service's) gets the rollout Service's address, as the job will see it."""
    from kubetune.k8s.serve import rollout  # its builders import this module

    if not rollout.renders_server(recipe):
        return recipe, False
    return rollout.with_server_url(recipe), True


def recipe_problems(recipe: Recipe) -> list[str]:
    """What can be told from the recipe alone never to run (resources, layout, chat template):
    `render` and the operator refuse the same, one line each."""
    recipe, _ = with_rollout_server(recipe)
    problems = resource_problems(recipe.k8s) + layout_problems(recipe) + kueue.problems(recipe.k8s)
    if template_problem := chat_template_problem(recipe):
        problems.append(template_problem)
    if not problems and (too_little := memory_problem(recipe)):  # the memory of processes the layout allows
        problems.append(too_little)
    return problems


def render(
    recipe: Recipe, hf_token: str | None = None, with_runtime: bool = False, with_kueue: bool = False
) -> Rendered:
    """All manifests for `recipe` (k8s.profile / k8s.api already applied), in apply order;
    `with_kueue`: also the Kueue queue, quota and topology of k8s.queue (`kueue.team_objects`)."""
    from kubetune.k8s.serve import rollout

    recipe, rollout_server = with_rollout_server(recipe)  # the job finds a server rendered here at its Service
    k8s = recipe.k8s
    problems = recipe_problems(recipe) + (kueue.team_problems(k8s) if with_kueue else [])
    if problems:
        raise RecipeError("; ".join(problems))
    names = Names.for_job(job_name(recipe), k8s.namespace, k8s.storage.existing_claim)
    resolved = cluster_recipe(recipe, names)
    out = [objects.namespace(names)]
    if k8s.priority_value is not None:
        out.append(objects.priority_class(k8s, names))
    if k8s.namespace_quota.is_set():
        out.append(objects.namespace_quota(k8s, names))
    if k8s.quota:
        out.append(objects.resource_quota(k8s, names))
    if names.owns_pvc:
        out.append(objects.pvc(k8s, names))
    if hf_token:
        out.append(objects.secret(names, hf_token))
    out.append(objects.config_map(resolved, names))
    if k8s.gang != "none" and k8s.api == "pytorchjob":
        out.append(objects.pod_group(k8s, names))  # TrainJob: the Trainer makes it from podGroupPolicy
    runtime_name = k8s.runtime
    if k8s.api == "trainjob" and with_runtime:
        out.append(jobs.cluster_runtime(resolved, names))
        runtime_name = names.runtime
    if recipe.monitor.in_cluster:
        out.append(training_pod_monitor(resolved, names))
    out.append(objects.data_pod(k8s, names))
    if k8s.devices == "dra":  # before the job: its pods claim their cards from it
        out.append(claims.claim_template(k8s, names, "trainer"))
    rollout_objects, rollout_warnings = rollout.rollout_objects(resolved) if rollout_server else ([], [])
    out += rollout_objects  # before the job: the server loads its model while the job's pods start
    job = jobs.pytorchjob(resolved, names) if k8s.api == "pytorchjob" else jobs.trainjob(resolved, names, runtime_name)
    job = kueue.through_queue(job, k8s)  # k8s.queue: suspended until Kueue admits it whole
    if with_kueue:
        out += kueue.team_objects(k8s, names, job)
    out.append(job)
    beyond = quota_problems(out, k8s)
    if beyond:
        raise RecipeError("; ".join(beyond))
    if hf_token:
        _refuse_token_leak(out, hf_token)
    warnings = (
        layout_warnings(recipe) + comm_warnings(recipe.comm, k8s.profile) + _portability_warnings(recipe, with_runtime)
    )
    warnings += recipe.train.loss_scale_warnings() + profiles.scale_out_warnings(recipe)
    warnings += kueue.team_warnings(k8s) if with_kueue else []
    warnings += claims.device_warnings(k8s) + rollout_warnings
    warnings += [] if hf_token else token_warnings(recipe, names)
    notes = batch_notes(recipe) + [note for note in [template_note(recipe)] if note] + default_notes(recipe)
    return Rendered(objects=out, names=names, warnings=warnings, notes=notes)


def token_warnings(recipe: Recipe, names: Names) -> list[str]:
    """A gated model rendered without a token: its pods wait for a Secret that is not in the output."""
    if not needs_token(recipe):
        return []
    secret, ns = names.secret, names.namespace
    warning = (
        f"model.name_or_path={recipe.model.name_or_path} is gated: its pods wait for Secret {secret} (not rendered "
        f"without a token); render with --hf-token-file FILE -o DIR, or `kubectl create secret generic {secret} "
        f"-n {ns} --from-file={TOKEN_KEY}=FILE`"
    )
    return [warning]


def _refuse_token_leak(objects: list[KubeObject], token: str) -> None:
    """The token may only live in the Secret (e.g. not in comm.extra_env or a recipe value)."""
    if len(token) < 8:  # too short to search for without false alarms (real tokens are ~37 chars)
        return
    for obj in objects:
        if obj["kind"] != "Secret" and token in yaml.safe_dump(obj):
            raise RecipeError(
                f"the Hugging Face token appears in {obj['kind']} {obj['metadata']['name']}; "
                "pass it only with --hf-token-file or HF_TOKEN, never in the recipe"
            )


# ---------------------------------------------------------------------------------- output


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the recipe in the ConfigMap) as readable `|` blocks; no `&anchors`."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def _dump(obj: KubeObject) -> str:
    # allow_unicode: a recipe's CJK template is written as its characters (the files are UTF-8)
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120, allow_unicode=True)


def _owned(objects: list[KubeObject], create_namespace: bool) -> list[KubeObject]:
    """What the output holds: the Namespace only when asked for (it may hold more than this job,
    e.g. the Training Operator in `kubeflow`; whatever applies it, deletes it)."""
    return [obj for obj in objects if create_namespace or obj["kind"] != "Namespace"]


def needs_prometheus_operator(obj: KubeObject) -> bool:
    return bool(obj["apiVersion"] == MONITORING_API)


def to_yaml(
    objects: list[KubeObject],
    redact_secrets: bool = True,
    create_namespace: bool = False,
    prometheus_operator: bool = False,
) -> str:
    """Multi-document YAML. Secrets are replaced by a comment unless `redact_secrets=False`; the
    Namespace is left out unless `create_namespace`; the Prometheus Operator's objects are
    replaced by a comment unless `prometheus_operator` (the cluster has its CRDs)."""
    docs = []
    for obj in _owned(objects, create_namespace):
        meta = obj["metadata"]
        if obj["kind"] == "Secret" and redact_secrets:
            docs.append(TOKEN_REDACTED_NOTE.format(name=meta["name"]) + "\n")
        elif needs_prometheus_operator(obj) and not prometheus_operator:
            docs.append(MONITOR_LEFT_OUT_NOTE.format(kind=obj["kind"], name=meta["name"]) + "\n")
        else:
            docs.append(_dump(obj))
    return "---\n" + "---\n".join(docs)


def file_name(obj: KubeObject) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def _write(obj: KubeObject, path: Path, header: str = "") -> None:
    import os

    if obj["kind"] != "Secret":
        path.write_text(header + _dump(obj), encoding="utf-8")
        return
    # Created with 0600 from the start: the token is never world-readable, even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(_dump(obj))
    os.chmod(path, 0o600)


def shared(obj: KubeObject) -> bool:
    """What is not this job's alone: the Namespace, the team's quota, a PriorityClass, Kueue's queues
    (other jobs may use them). `submit` never deletes them; in a directory they stay out of kustomization.yaml, so that
    `kubectl delete -k` never deletes them and `kubectl apply -k` of one job never rewrites them."""
    budget = obj["kind"] == "ResourceQuota" and obj["metadata"]["name"] == NAMESPACE_QUOTA
    return budget or obj["kind"] in ("Namespace", "PriorityClass") or kueue.is_team_object(obj)


def write_dir(
    objects: list[KubeObject], out_dir: Path, create_namespace: bool = False, prometheus_operator: bool = False
) -> list[Path]:
    """One file per object plus kustomization.yaml (`kubectl apply -k DIR`). Secrets are 0600.
    The `shared` objects are written beside the kustomization, not in it; the Namespace itself only
    with `create_namespace`. The Prometheus Operator's objects are in it only with
    `prometheus_operator`; otherwise beside it, each with a comment saying why."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written, resources = [], []
    for obj in _owned(objects, create_namespace):
        path = out_dir / file_name(obj)
        monitor_beside = needs_prometheus_operator(obj) and not prometheus_operator
        _write(obj, path, MONITOR_FILE_HEADER.format(kind=obj["kind"]) if monitor_beside else "")
        written.append(path)
        if not (shared(obj) or monitor_beside):
            resources.append(path.name)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": resources,
    }
    (out_dir / "kustomization.yaml").write_text(_dump(kustomization), encoding="utf-8")
    return written + [out_dir / "kustomization.yaml"]


def written_note(written: list[Path], out_dir: Path, namespace: str) -> str:
    """What `render -o DIR` tells: how to apply it, and how the shared objects come to exist."""
    kustomization = out_dir / "kustomization.yaml"
    listed = set(yaml.safe_load(kustomization.read_text(encoding="utf-8"))["resources"]) | {kustomization.name}
    unlisted = [p for p in written if p.name not in listed]
    monitors = [p for p in unlisted if needs_prometheus_operator(yaml.safe_load(p.read_text(encoding="utf-8")))]
    beside = [p for p in unlisted if p not in monitors]
    note = f"wrote {len(written)} files to {out_dir}/; apply with `kubectl apply -k {out_dir}`"
    if beside:
        note += (
            f" after `kubectl create {' '.join(f'-f {p}' for p in beside)}` (not in kustomization.yaml: they are "
            "not this job's alone, so `kubectl delete -k` leaves them, and create, like submit, never changes "
            "one that exists)"
        )
    if not any(p.name == f"namespace-{namespace}.yaml" for p in beside):
        note += f"; namespace {namespace} must exist (`kubectl create namespace {namespace}`, or --create-namespace)"
    if monitors:
        note += (
            f"; {', '.join(p.name for p in monitors)} is not in kustomization.yaml: it needs the Prometheus "
            f"Operator's CRDs (`kubectl apply -f {' -f '.join(str(p) for p in monitors)}` once kube-prometheus-stack "
            f"is installed; where it is, render with {MONITORING_FLAG})"
        )
    return note
