{{/*
The release's name for this chart's objects (Helm's `helm create` convention): fullnameOverride, else the
release name when it already holds the chart's name (`helm install kubetune-operator ...`: kubetune-operator),
else RELEASE-kubetune-operator; 63 characters at most (a DNS label). Every object name starts with it, so two
releases never share a cluster-scoped name.
*/}}
{{- define "kubetune.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end }}

{{/*
A component's object name, FULLNAME-SUFFIX: (dict "root" $ "suffix" "device-plugin"). With
fullnameOverride=kubetune these are `kubetune k8s render-components`' names (kubetune-device-plugin, ...).
*/}}
{{- define "kubetune.componentName" -}}
{{- printf "%s-%s" (include "kubetune.fullname" .root) .suffix | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{/*
What selects a component's pods: its application name and the release. Selectors are immutable once
created, so nothing that changes at an upgrade (the version, the chart) is in them.
(dict "root" $ "name" "kubetune-device-plugin").
*/}}
{{- define "kubetune.selectorLabels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}

{{/*
Kubernetes' recommended labels and Helm's chart label, on every object and pod template:
(dict "root" $ "name" "kubetune-device-plugin" "component" "device-plugin"). name, component and part-of are
kubetune.contracts.kube.common_labels(name, component, part_of="kubetune"), what `render-components` writes; instance,
version, managed-by and helm.sh/chart are Helm's (tests/charts compare the rest with the Python renderers).
*/}}
{{- define "kubetune.labels" -}}
{{ include "kubetune.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: kubetune
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
metadata of a namespaced object: (dict "root" $ "name" "component" "suffix"), named FULLNAME-SUFFIX (FULLNAME
alone without a suffix) in the release's namespace.
*/}}
{{- define "kubetune.meta" -}}
name: {{ include "kubetune.objectName" . }}
labels:
  {{- include "kubetune.labels" . | nindent 2 }}
namespace: {{ .root.Release.Namespace }}
{{- end }}

{{/* FULLNAME-SUFFIX, or FULLNAME when the context has no suffix (the operator's own objects). */}}
{{- define "kubetune.objectName" -}}
{{- if .suffix }}{{ include "kubetune.componentName" . }}{{ else }}{{ include "kubetune.fullname" .root }}{{ end -}}
{{- end }}

{{/*
One image value, rendered: (dict "image" <{repository, tag, digest}> "root" $). REPOSITORY@DIGEST when a digest
is set (it pins the content: the tag is then only a reminder), else REPOSITORY:TAG, the tag defaulting to the
chart's appVersion (the operator, the CRD and the image come from one kubetune release).
*/}}
{{- define "kubetune.image" -}}
{{- $i := .image -}}
{{- if $i.digest -}}
{{ $i.repository }}@{{ $i.digest }}
{{- else -}}
{{ $i.repository }}:{{ $i.tag | default .root.Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/*
`image` and `imagePullPolicy` of a container from one image value: (dict "image" <value> "root" $). A pullPolicy
left empty leaves the field out: Kubernetes' default (IfNotPresent for a tag, Always for :latest or none).
*/}}
{{- define "kubetune.containerImage" -}}
image: {{ include "kubetune.image" . | quote }}
{{- with .image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{/*
The cluster components' image: components.image when it names a repository, else the repository, tag and digest
of `image`; its pullPolicy is components.image.pullPolicy either way (empty: left out, as render-components does).
*/}}
{{- define "kubetune.componentImage" -}}
{{- $c := .Values.components.image -}}
{{- $image := $c -}}
{{- if not $c.repository }}{{ $image = merge (pick $c "pullPolicy") (pick .Values.image "repository" "tag" "digest") }}{{ end -}}
{{- include "kubetune.containerImage" (dict "image" $image "root" .) }}
{{- end }}

{{/*
The values' old spellings (kubetune <= 0.1.0), refused with the new one: the schema lets them through so
that this message, and not "got string, want object", is what `helm install` prints.
*/}}
{{- define "kubetune.refuseOldSpellings" -}}
{{- if kindIs "string" .Values.image -}}
{{- fail (printf "image: %q is one string; write image.repository and image.tag (or image.digest), e.g. --set image.repository=%s --set image.tag=%s" .Values.image (regexReplaceAll ":[^:/]*$" .Values.image "") (regexFind "[^:/]*$" .Values.image)) -}}
{{- end -}}
{{- if hasKey .Values "imagePullPolicy" -}}
{{- fail "imagePullPolicy: it is image.pullPolicy now (--set image.pullPolicy=...)" -}}
{{- end -}}
{{- if kindIs "string" .Values.components.image -}}
{{- fail (printf "components.image: %q is one string; write components.image.repository and components.image.tag (or .digest)" .Values.components.image) -}}
{{- end -}}
{{- end }}

{{/*
ServiceAccount + ClusterRole + ClusterRoleBinding of one component, as manifests._rbac renders them:
(dict "root" $ "name" "component" "suffix" "rules" <a list of PolicyRules>), all named FULLNAME-SUFFIX.
*/}}
{{- define "kubetune.clusterRBAC" -}}
{{- $name := include "kubetune.objectName" . -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  {{- include "kubetune.meta" . | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {{ $name }}
  labels:
    {{- include "kubetune.labels" . | nindent 4 }}
rules:
  {{- toYaml .rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {{ $name }}
  labels:
    {{- include "kubetune.labels" . | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ $name }}
subjects:
- kind: ServiceAccount
  name: {{ $name }}
  namespace: {{ .root.Release.Namespace }}
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
Labels of the rules and dashboards: kubetune.monitor.objects._meta's name and component, Helm's labels (its
managed-by, Helm, in place of kubetune's), and `release`, which kube-prometheus-stack's Prometheus selects rules by.
*/}}
{{- define "kubetune.monitoringLabels" -}}
{{ include "kubetune.labels" (dict "root" . "name" "kubetune" "component" "monitoring") }}
release: {{ .Values.monitoring.release | quote }}
{{- end }}

{{/*
One check of the `helm test` pod (templates/tests/): kubectl ARGS, which exits non-zero when the check fails.
(dict "root" $ "name" "args" <list>). kubectl writes its discovery cache under $HOME: an emptyDir, the root
filesystem being read-only.
*/}}
{{- define "kubetune.testContainer" -}}
- name: {{ .name }}
  {{- include "kubetune.containerImage" (dict "image" .root.Values.tests.image "root" .root) | nindent 2 }}
  command:
  - kubectl
  args:
  {{- toYaml .args | nindent 2 }}
  env:
  - name: HOME
    value: /home/kubectl
  volumeMounts:
  - name: home
    mountPath: /home/kubectl
  resources:
    requests:
      cpu: 10m
      memory: 64Mi
    limits:
      memory: 128Mi
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop:
      - ALL
{{- end }}
