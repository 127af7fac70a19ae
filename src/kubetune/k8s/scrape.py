"""How Prometheus scrapes a job's pods and a server's Service: the Prometheus Operator objects
named after them (pure: no API calls, no kubernetes import).

- `training_pod_monitor`: the training pods of a job (`kubetune k8s render` adds it when
  `monitor.in_cluster`). A PyTorchJob's container declares the port `metrics`; a TrainJob's
  cannot (a runtime patch takes no ports), so there the target address is rewritten to the
  pod's IP and the metrics port. Relabelled: `job` = the kubetune job name, `node` = the pod's
  node (what the node and accelerator panels join on); the process's own copies of those two
  labels (exported_job, exported_node after the rewrite) are dropped.
- `server_service_monitor`: a server's Service, port `http` (`kubetune k8s render-serve`).

They live here, beside `names`, because they select by a job's names and labels; the shapes
every monitor shares are `kubetune.contracts.monitors`, the rules and dashboards
`kubetune.monitor.objects`. Every object carries `release: <monitor.release>`:
kube-prometheus-stack's Prometheus selects monitors by that label and ignores the rest without a word.
"""

from __future__ import annotations

from kubetune.contracts import monitors
from kubetune.contracts.kube import KubeObject
from kubetune.contracts.metrics import DEFAULT_TRAIN_PORT, METRICS_PORT_NAME
from kubetune.contracts.serving import METRICS_PATH
from kubetune.k8s.names import CONTAINER, Names, server_selector, standard_labels, trainer_selector
from kubetune.recipe.schema import Recipe

TRAINJOB_CONTAINER = CONTAINER["trainjob"]
SERVER_PORT_NAME = "http"  # the serving Service's port (kubetune.k8s.serve.plan.PORT_NAME)


def metrics_port(recipe: Recipe) -> int:
    """The port a cluster job's pods serve metrics on."""
    return recipe.monitor.port or DEFAULT_TRAIN_PORT


def pod_monitor_name(job: str) -> str:
    return f"{job}-metrics"


def _training_relabelings(job: str) -> list[KubeObject]:
    return [
        {"targetLabel": "job", "replacement": job, "action": "replace"},
        monitors.node_relabeling(),
    ]


def _trainjob_endpoint(job: str, port: int) -> KubeObject:
    # No declared port to select: one target per container, kept for the trainer's container and
    # pointed at the pod IP and metrics port (the operator's documented way for undeclared ports).
    keep = {"sourceLabels": ["__meta_kubernetes_pod_container_name"], "regex": TRAINJOB_CONTAINER, "action": "keep"}
    address = {
        "sourceLabels": ["__meta_kubernetes_pod_ip"],
        "targetLabel": "__address__",
        "replacement": f"$1:{port}",
        "action": "replace",
    }
    return {"path": METRICS_PATH, "relabelings": [keep, address, *_training_relabelings(job)]}


def training_pod_monitor(recipe: Recipe, names: Names) -> KubeObject:
    """The job's training pods, scraped on their metrics port (`recipe` as the pods see it)."""
    labels = standard_labels(names, monitors.MONITORING_COMPONENT)
    meta = monitors.monitor_meta(pod_monitor_name(names.job), names.namespace, labels, recipe.monitor.release)
    if recipe.k8s.api == "trainjob":
        endpoint = _trainjob_endpoint(names.job, metrics_port(recipe))
    else:
        endpoint = monitors.endpoint(METRICS_PORT_NAME, _training_relabelings(names.job))
    endpoint["metricRelabelings"] = [{"regex": "exported_(job|node)", "action": "labeldrop"}]
    return monitors.pod_monitor(meta, trainer_selector(names.job), [endpoint])


def server_service_monitor(names: Names, release: str, component: str) -> KubeObject:
    """The Service of the serving instance `names.job` (its labels are `server_selector`'s)."""
    meta = monitors.monitor_meta(names.job, names.namespace, standard_labels(names, component), release)
    return monitors.service_monitor(meta, server_selector(names.job), [monitors.endpoint(SERVER_PORT_NAME)])
