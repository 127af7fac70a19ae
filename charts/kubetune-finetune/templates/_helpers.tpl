{{/* The chart's name, for app.kubernetes.io/name. */}}
{{- define "kubetune-finetune.name" -}}
{{- .Chart.Name -}}
{{- end }}

{{/*
The FineTune's name and the prefix of every object of the release: .Values.name, else the release name
(Helm's usual fullname; the FineTune's job and objects take it too, which is why it stays short).
*/}}
{{- define "kubetune-finetune.fullname" -}}
{{- .Values.name | default .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end }}

{{/* Helm's recommended labels; instance is the release. */}}
{{- define "kubetune-finetune.labels" -}}
app.kubernetes.io/name: {{ include "kubetune-finetune.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 }}
{{- end }}

{{/* The Secret made from secret.encodedToken. */}}
{{- define "kubetune-finetune.tokenSecret" -}}
{{- .Values.secret.name | default (printf "%s-hf-token" (include "kubetune-finetune.fullname" .)) -}}
{{- end }}

{{/* {"v": the value at a dotted path of a map, "" where the path is absent} as JSON: (list MAP "a.b.c"). */}}
{{- define "kubetune-finetune.valueAt" -}}
{{- $node := index . 0 }}
{{- range $part := splitList "." (index . 1) }}
{{- if and (kindIs "map" $node) (hasKey $node $part) }}{{ $node = index $node $part }}{{ else }}{{ $node = "" }}{{ end }}
{{- end }}
{{- toJson (dict "v" $node) -}}
{{- end }}

{{/*
The values layout of Intel's huggingface-llm chart as recipe keys, as JSON:
{"recipe": the recipe (`recipe:` with the mapped keys), "mapped": [[key, recipe key]], "unused": [[key, why]],
"unset": [[key, recipe key, kubetune's default, Intel's chart's default]]: with the layout in use, the keys with a
`seed` default that the values leave unset, their recipe key too, so that kubetune's default applies}.
files/helm-values-aliases.json is the table of kubetune.recipe.helm_values, which `kubetune recipe
from-helm-values` walks the same way (its docstring explains the entries); a test holds the two equal.
*/}}
{{- define "kubetune-finetune.aliased" -}}
{{- $values := .Values }}
{{- $own := .Values.recipe | default dict }}
{{- $recipe := dict }}
{{- $setBy := dict }}
{{- $mapped := list }}
{{- $unused := list }}
{{- $table := .Files.Get "files/helm-values-aliases.json" | fromJsonArray }}
{{- range $entry := $table }}
{{- $value := (include "kubetune-finetune.valueAt" (list $values $entry.from) | fromJson).v }}
{{- if not (or (kindIs "invalid" $value) (eq (toString $value) "") (and (kindIs "map" $value) (eq (len $value) 0))) }}
{{- $choices := $entry.values | default dict }}
{{- $key := toString $value }}
{{- $out := "" }}
{{- $set := true }}
{{- if hasKey $choices $key }}
  {{- $out = index $choices $key }}
  {{- if eq (toString $out) "-" }}
    {{- $set = false }}
    {{- $unused = append $unused (list $entry.from ($entry.why | default (printf "kubetune's default for recipe.%s" (join "." $entry.to)))) }}
  {{- end }}
{{- else if $entry.only }}
  {{- fail (printf "%s: %s" $entry.from ($entry.refuse | default (printf "must be one of %s" (keys $choices | sortAlpha | join ", ")))) }}
{{- else if not $entry.to }}
  {{- $set = false }}
  {{- $unused = append $unused (list $entry.from $entry.why) }}
{{- else if eq ($entry.kind | default "copy") "words" }}
  {{- $out = regexSplit "\\s+" (trim (toString $value)) -1 }}
{{- else if eq ($entry.kind | default "copy") "percent" }}
  {{- $out = ternary $value (divf $value 100) (lt (float64 $value) 1.0) }}
{{- else if eq ($entry.kind | default "copy") "const" }}
  {{- $out = $entry.value }}
{{- else }}
  {{- $out = $value }}
{{- end }}
{{- if $set }}
  {{- $to := $entry.to }}
  {{- if $entry.key_from }}
    {{- $label := (include "kubetune-finetune.valueAt" (list $values $entry.key_from) | fromJson).v }}
    {{- if eq (toString $label) "" }}
      {{- fail (printf "%s: goes with %s (the node label it is the value of)" $entry.from $entry.key_from) }}
    {{- end }}
    {{- $to = append $to (toString $label) }}
  {{- end }}
  {{- $dotted := join "." $to }}
  {{- with index $setBy $dotted }}
    {{- if ne (toJson .value) (toJson $out) }}
      {{- fail (printf "%s and %s both set recipe.%s (%s and %s); give one value" .from $entry.from $dotted (toJson .value) (toJson $out)) }}
    {{- end }}
  {{- end }}
  {{- $ownNode := $own }}
  {{- $inOwn := true }}
  {{- range $part := $to }}
    {{- if and $inOwn (kindIs "map" $ownNode) (hasKey $ownNode $part) }}{{ $ownNode = index $ownNode $part }}{{ else }}{{ $inOwn = false }}{{ end }}
  {{- end }}
  {{- if $inOwn }}
    {{- fail (printf "%s and recipe.%s both set %s; keep one of them" $entry.from $dotted $dotted) }}
  {{- end }}
  {{- $_ := set $setBy $dotted (dict "from" $entry.from "value" $out) }}
  {{- $node := $recipe }}
  {{- range $part := initial $to }}
    {{- if not (hasKey $node $part) }}{{ $_ := set $node $part dict }}{{ end }}
    {{- $node = index $node $part }}
  {{- end }}
  {{- $_ := set $node (last $to) $out }}
  {{- $mapped = append $mapped (list $entry.from $dotted) }}
{{- end }}
{{- end }}
{{- end }}
{{- with index $setBy "k8s.profile" }}
{{- if and $values.profile (ne $values.profile .value) }}
{{- fail (printf "%s and profile both set the profile; keep profile" .from) }}
{{- end }}
{{- end }}
{{- $merged := mergeOverwrite (deepCopy $own) $recipe }}
{{- $unset := list }}
{{- if or $mapped $unused }}
{{- range $entry := $table }}
{{- if hasKey $entry "seed" }}
{{- $at := (include "kubetune-finetune.valueAt" (list $merged (join "." $entry.to)) | fromJson).v }}
{{- if and (kindIs "string" $at) (eq $at "") }}
{{- $unset = append $unset (list $entry.from (join "." $entry.to) $entry.default $entry.seed) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson (dict "recipe" $merged "mapped" $mapped "unused" $unused "unset" $unset) -}}
{{- end }}

{{/* An image reference from {repository, tag, digest}: repository[:tag][@digest]; "" without a repository. */}}
{{- define "kubetune-finetune.image" -}}
{{- with .repository }}{{ . }}{{ with $.tag }}:{{ . }}{{ end }}{{ with $.digest }}@{{ . }}{{ end }}{{ end -}}
{{- end }}

{{/*
The FineTune's hfTokenSecretRef as JSON {name, key}: hfTokenSecretRef, or the Secret this chart makes from
secret.encodedToken (Intel's chart's way); both at once is refused.
*/}}
{{- define "kubetune-finetune.tokenRef" -}}
{{- $secret := .Values.secret | default dict }}
{{- if $secret.encodedToken }}
{{- if .Values.hfTokenSecretRef.name }}
{{- fail "secret.encodedToken and hfTokenSecretRef.name both give the Hugging Face token; keep hfTokenSecretRef (the Secret stays out of Helm's release)" }}
{{- end }}
{{- if ne (b64enc (b64dec (toString $secret.encodedToken))) (toString $secret.encodedToken) }}
{{- fail "secret.encodedToken: not base64; encode the token with `base64 -w0 hf-token`" }}
{{- end }}
{{- toJson (dict "name" (include "kubetune-finetune.tokenSecret" .) "key" "HF_TOKEN") }}
{{- else if $secret.name }}
{{- fail "secret.name names the Secret made from secret.encodedToken, which is empty; for a Secret of your own set hfTokenSecretRef.name" }}
{{- else }}
{{- toJson .Values.hfTokenSecretRef }}
{{- end }}
{{- end }}

{{/*
A FineTune needs its CRD (the kubetune-operator chart): without it, `helm install` would stop at Helm's own
"no matches for kind FineTune ... ensure CRDs are installed first", which does not say how. Against a cluster
(lookup answers: the release's namespace can be listed, as Helm's own release Secrets are) the CRD must be
among the served APIs; an offline render (`helm template`: lookup answers nothing and Capabilities lists only
built-in APIs) cannot know and renders.
*/}}
{{- define "kubetune-finetune.needsCrd" -}}
{{- if not (.Capabilities.APIVersions.Has "kubetune.io/v1alpha1/FineTune") }}
{{- if lookup "v1" "Secret" .Release.Namespace "" }}
{{- fail "this cluster has no FineTune CRD (finetunes.kubetune.io): install kubetune's operator chart first: helm install kubetune-operator charts/kubetune-operator -n kubetune-system --create-namespace" }}
{{- end }}
{{- end }}
{{- end }}
