{{/*
The operator's RBAC: exactly what it asks for. tests/charts/test_operator_rbac.py runs the operator's handlers
through whole lifecycles, records every request, and fails on a rule missing or a rule never used.
*/}}

{{/* Across the cluster (a ClusterRoleBinding whatever operator.watchNamespaces says). */}}
{{- define "kubetune.operatorClusterRules" }}
# kopf watches CRDs to notice resources appearing (without: a warning, and the FineTune CRD only at a restart)
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
# the doctor's diagnosis (a restarted or failed job) checks that the claim's StorageClass exists
- apiGroups: [storage.k8s.io]
  resources: [storageclasses]
  verbs: [get]
{{- if .Values.operator.rbac.createPriorityClasses }}
# a recipe's k8s.priority_class + k8s.priority_value: the operator creates that PriorityClass
- apiGroups: [scheduling.k8s.io]
  resources: [priorityclasses]
  verbs: [create]
{{- end }}
{{- end }}

{{/* In the namespaces it watches (bound there, or everywhere with a ClusterRoleBinding). */}}
{{- define "kubetune.operatorRules" }}
# kopf: the watch (list + watch), its finalizer and bookkeeping annotations (patch), status (a subresource)
- apiGroups: [kubetune.io]
  resources: [finetunes]
  verbs: [list, watch, patch]
- apiGroups: [kubetune.io]
  resources: [finetunes/status]
  verbs: [patch]
# ModelServers: kopf's watch and bookkeeping as for FineTunes; a FineTune reads its spec.serve.server (get)
- apiGroups: [kubetune.io]
  resources: [modelservers]
  verbs: [get, list, watch, patch]
- apiGroups: [kubetune.io]
  resources: [modelservers/status]
  verbs: [patch]
# owned objects carry blockOwnerDeletion: the OwnerReferencesPermissionEnforcement admission plugin then
# requires update on the owner's finalizers
- apiGroups: [kubetune.io]
  resources: [finetunes/finalizers, modelservers/finalizers]
  verbs: [update]
# kopf posts an Event per handler outcome; the doctor reads the namespace's events (FailedScheduling, ...)
- apiGroups: [""]
  resources: [events]
  verbs: [create, list]
# the job's recipe (created, read back, patched by a resumable recipe edit); spec.recipeRef's ConfigMap;
# the serving objects' prometheus-adapter rule
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
# spec.hfTokenSecretRef is read, and copied into the job's own token Secret (what `kubetune k8s render` makes)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# the run's volume claim (created; read by the doctor)
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create]
# the data-access pod (created); the training pods (listed: ranks, restarts, progress); rank 0's log; the data
# pod's metrics.jsonl when rank 0 has no log (exec is authorised as create)
- apiGroups: [""]
  resources: [pods]
  verbs: [list, create]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
- apiGroups: [""]
  resources: [pods/exec]
  verbs: [create]
# k8s.quota's own quota (created); every quota of the namespace (the doctor: does the job fit)
- apiGroups: [""]
  resources: [resourcequotas]
  verbs: [list, create]
# the training job: created, followed, deleted to suspend (its pods go with it; the claim stays)
- apiGroups: [kubeflow.org]
  resources: [pytorchjobs]
  verbs: [get, create, delete]
- apiGroups: [trainer.kubeflow.org]
  resources: [trainjobs]
  verbs: [get, create, delete]
# k8s.gang: the PodGroup of scheduler-plugins' coscheduling or of Volcano
- apiGroups: [scheduling.x-k8s.io, scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [create]
# the merged export after training
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, create]
# serving: the objects of `kubetune k8s render-serve` (the Deployment is also how the operator sees it serving)
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create]
- apiGroups: [""]
  resources: [services]
  verbs: [create]
- apiGroups: [networking.k8s.io]
  resources: [ingresses, networkpolicies]
  verbs: [create]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [create]
# monitoring: the training pods' PodMonitor, the server's ServiceMonitor (kube-prometheus-stack)
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors, servicemonitors]
  verbs: [create]
# a ModelServer's gateway routing: the InferencePool over its pods, an InferenceObjective per adapter (deleted
# when its adapter is no longer registered)
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [create]
- apiGroups: [inference.networking.x-k8s.io]
  resources: [inferenceobjectives]
  verbs: [list, create, delete]
# k8s.devices=dra: the ResourceClaimTemplate the job's and the server's pods claim their cards from
- apiGroups: [resource.k8s.io]
  resources: [resourceclaimtemplates]
  verbs: [create]
{{- end }}
