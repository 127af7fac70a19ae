"""Render (pure): a trained run -> the Kubernetes objects that serve it (`kubetune k8s render-serve`).

Objects, in apply order, all in the recipe's `k8s.namespace` (the training job's, so that its
volume claim can be mounted), named `<job>-serve` unless `--name` says otherwise:

- Namespace, [Secret] (with a token: the training job's `<job>-hf-token`, which the pods read
  as the job's pods do; not a second copy),
- [NetworkPolicy] (default on): the server's port open to the namespace's own pods, the ingress
  controller's namespace and the monitoring namespace only,
- [ConfigMap `<name>-prometheus-adapter-rule`] (with `--autoscale queue`): the prometheus-adapter
  rule that exposes `vllm:num_requests_waiting` to the HorizontalPodAutoscaler, renamed
  `vllm_num_requests_waiting` (a Kubernetes metric name cannot hold ':'), as the adapter's
  config file (`rules.yaml`) and as values of its Helm chart (`helm-values.yaml`),
- Deployment: `kubetune serve RUN_DIR --engine native` or vLLM's OpenAI server (`--engine
  vllm`, vLLM's image for the profile); the run directory read from the training job's
  claim at `/data` (where the job wrote `output_dir`), or copied out of `--model-image` by an
  init container; probes from `kubetune.contracts.serving`, a startup probe sized to the model,
  Guaranteed QoS from the profile, a grace period that covers the server's drain,
- Service (port 8000, `http`), PodDisruptionBudget (maxUnavailable 1),
- [ServiceMonitor, with monitor.in_cluster]: Prometheus scrapes the Service's `http` port
  (`kubetune.k8s.scrape`, labelled with monitor.release),
- [HorizontalPodAutoscaler autoscaling/v2] on the waiting requests per pod, CPU as fallback,
- Ingress (nginx: no buffering of server-sent events, long timeouts, the server's body limit;
  TLS from a Secret or a cert-manager issuer).

The API key is never rendered: `--api-key-secret` names a Secret the pods read it from.

Plain dicts except where `profiles` already builds a part. No torch, no API calls. By concern:

- `settings`: `ServeSettings`, the command line's settings and their problems,
- `plan`: the source (`load_source`), the names and paths the objects share (`Plan`),
- `argv`: the server's command and environment (native, or vLLM through `kubetune.contracts.serving`),
- `deployment`: the Deployment and its PodDisruptionBudget; `network`: Service, NetworkPolicy, Ingress,
- `autoscale`: the HorizontalPodAutoscaler and the prometheus-adapter rule's ConfigMap,
- `render`: `render_serve`, the objects in apply order and the warnings.

This package exports only the settings, so that the CLI's options import without the
renderers (and the recipe schema): callers import `render_serve` from `render`.
"""

from kubetune.k8s.serve.settings import AUTOSCALE, ENGINES, ServeSettings

__all__ = ["AUTOSCALE", "ENGINES", "ServeSettings"]
