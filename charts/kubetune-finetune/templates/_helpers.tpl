{{/* The FineTune's name: .Values.name, else the release name. */}}
{{- define "kubetune-finetune.name" -}}
{{- .Values.name | default .Release.Name -}}
{{- end }}

{{/* Helm's recommended labels; instance is the release. */}}
{{- define "kubetune-finetune.labels" -}}
app.kubernetes.io/name: kubetune-finetune
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}
