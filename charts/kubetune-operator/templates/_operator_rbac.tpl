{{/*
What kopf needs across the cluster: it watches the CustomResourceDefinitions to notice resources appearing
(kopf._core.reactor.observation.resource_observer; without it kopf warns and only sees them at restart).
*/}}
{{- define "kubetune.operatorClusterRules" }}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}

{{/*
What the operator does in the namespaces it watches: DRAFT until the operator's code settles; each rule names why.
*/}}
{{- define "kubetune.operatorRules" }}
- apiGroups: [kubetune.io]
  resources: [finetunes]
  verbs: [get, list, watch, patch]
- apiGroups: [kubetune.io]
  resources: [finetunes/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
