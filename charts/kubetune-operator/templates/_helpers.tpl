{{/*
Labels of a cluster component: the same set, in the same order, as kubetune.kube.common_labels(name,
component, part_of="kubetune"), so that what this chart renders equals `kubetune k8s render-components`
(tests/charts/test_operator_chart.py compares them object by object).
*/}}
{{- define "kubetune.labels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: kubetune
{{- end }}

{{/*
metadata of a namespaced object: (dict "name" "component" "namespace").
*/}}
{{- define "kubetune.meta" -}}
name: {{ .name }}
labels:
  {{- include "kubetune.labels" . | nindent 2 }}
namespace: {{ .namespace }}
{{- end }}

{{/*
ServiceAccount + ClusterRole + ClusterRoleBinding of one component, as manifests._rbac renders them:
(dict "name" "component" "namespace" "rules" <a list of PolicyRules>).
*/}}
{{- define "kubetune.clusterRBAC" -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  {{- include "kubetune.meta" . | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {{ .name }}
  labels:
    {{- include "kubetune.labels" . | nindent 4 }}
rules:
  {{- toYaml .rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {{ .name }}
  labels:
    {{- include "kubetune.labels" . | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ .name }}
subjects:
- kind: ServiceAccount
  name: {{ .name }}
  namespace: {{ .namespace }}
{{- end }}

{{/*
The image of the cluster components: components.image, else the chart's image.
*/}}
{{- define "kubetune.componentImage" -}}
{{ .Values.components.image | default .Values.image }}
{{- end }}

{{/*
Pod spec fields that keep the device plugin and the prober on accelerator nodes (manifests.plugin_placement):
nothing with allNodes; the user's nodeSelector; else a required node affinity on Node Feature Discovery's PCI
labels of the vendor's cards, any one of `<class>_<vendor>` and `<vendor>` (NFD's two label forms; terms are ORed).
The (vendor, classes) table is manifests.NFD_PCI: Gaudi is PCI class 1200, NVIDIA data-centre GPUs 0302, others 0300.
*/}}
{{- define "kubetune.placement" -}}
{{- $c := .Values.components -}}
{{- if $c.allNodes -}}
{{- else if $c.nodeSelector -}}
nodeSelector:
  {{- toYaml $c.nodeSelector | nindent 2 }}
{{- else -}}
{{- $pci := dict "sysfs" (list "1da3" (list "1200")) "nvml" (list "10de" (list "0302" "0300")) -}}
{{- $entry := get $pci $c.discovery -}}
{{- $vendor := index $entry 0 -}}
{{- $labels := list -}}
{{- range index $entry 1 }}{{ $labels = append $labels (printf "%s_%s" . $vendor) }}{{ end -}}
{{- $labels = append $labels $vendor -}}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
      {{- range $labels }}
      - matchExpressions:
        - key: feature.node.kubernetes.io/pci-{{ . }}.present
          operator: In
          values:
          - "true"
      {{- end }}
{{- end -}}
{{- end }}

{{/*
Labels of the rules and dashboards (kubetune.monitor.objects._meta): kubetune's, and `release`, which
kube-prometheus-stack's Prometheus selects rules by.
*/}}
{{- define "kubetune.monitoringLabels" -}}
app.kubernetes.io/name: kubetune
app.kubernetes.io/component: monitoring
app.kubernetes.io/managed-by: kubetune
release: {{ .Values.monitoring.release | quote }}
{{- end }}
