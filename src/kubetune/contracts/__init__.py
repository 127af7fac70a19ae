"""What two sides of a process, a pod or an API read, so that neither can drift from the other.

- `kube`: Kubernetes conventions (quantities, the common labels, the kubeconfig loader) that the
  job renderers (`kubetune.k8s`) and the cluster components (`kubetune.cluster`) share.
- `dra`: the DRA names (drivers, DeviceClasses, device attributes) that the DRA driver
  (`kubetune.cluster.dra`) publishes and the jobs' claims select on.
- `progress_line`: the line the training engine prints and `kubetune k8s status` parses.
- `serving`: a server's port, probes and drain, and vLLM's command line, read by
  `kubetune serve` and `kubetune k8s render-serve`.
- `metrics`: the metric names every exporter exposes and the dashboards and alerts query;
  `monitors` (PodMonitor, ServiceMonitor) and `prometheus_adapter` (the autoscaler's rule)
  are the scrape and adapter objects built on them.
- `engine`: what an inference engine and its callers say to each other (requests, sampling,
  token events, limits): the HTTP side (`kubetune.serve.http`), GRPO's rollouts and the engine
  (`kubetune.engine`) read it.
- `adapters` (the registry file's schema, versions and aliases) and `adapter_volume` (where a
  shared server's adapters and registry live): what the operator's export Jobs write, the
  ModelServer's renderer mounts and `kubetune serve --adapter-registry` reads.
- `findings`: the `Finding` that `kubetune k8s doctor` and `kubetune monitor check` report,
  the order of severities and when a command exits 1.

A contract is small and light: the standard library, `kubetune.errors` and each other at module
level, nothing of torch or of the Hugging Face libraries, and no other kubetune package
(pyproject's import-linter contracts hold it under every other layer). A client library
(kubernetes, prometheus_client) is imported inside the function that needs it.
"""
