{{/* The chart's name. */}}
{{- define "kinference.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object name. */}}
{{- define "kinference.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A name of at most 63 characters: cut, with a hash of the whole, when longer. */}}
{{- define "kinference.cut" -}}
{{- if gt (len .) 63 -}}
{{- printf "%s-%s" (trunc 54 . | trimSuffix "-") (sha256sum . | trunc 8) -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* Labels every object carries. Argument: dict "root" $ "component" NAME. */}}
{{- define "kinference.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kinference.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kinference
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels that select a component's pods. Argument: as kinference.labels. */}}
{{- define "kinference.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kinference.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* An image reference. Argument: dict "root" $ "image" (a component's image settings). */}}
{{- define "kinference.image" -}}
{{- $registry := .root.Values.image.registry | trimSuffix "/" -}}
{{- $repo := .image.repository -}}
{{- if $registry -}}{{- $repo = printf "%s/%s" $registry $repo -}}{{- end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repo .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (.image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/*
A pod's annotations: Prometheus's, for an admin port PORT, and EXTRA.
Argument: dict "root" $ "port" PORT "extra" EXTRA. Read with fromYaml.
*/}}
{{- define "kinference.podAnnotations" -}}
{{- $a := dict -}}
{{- if .root.Values.metrics.podAnnotations -}}
{{- $_ := set $a "prometheus.io/scrape" "true" -}}
{{- $_ := set $a "prometheus.io/port" (toString .port) -}}
{{- $_ := set $a "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- toYaml (merge (deepCopy (.extra | default dict)) $a) -}}
{{- end -}}

{{/* The controller's object names. */}}
{{- define "kinference.controller.name" -}}
{{- printf "%s-controller" (include "kinference.fullname" .) -}}
{{- end -}}

{{/*
The routers, each with the shared `router` settings merged under its own,
its namespace and its object name, as a YAML list (read with fromYamlArray).
*/}}
{{- define "kinference.routers" -}}
{{- $out := list -}}
{{- $seen := dict -}}
{{- range $i, $r := .Values.routers -}}
{{- if not $r.pool -}}
{{- fail (printf "routers[%d]: pool is required (the InferencePool's name)" $i) -}}
{{- end -}}
{{- $merged := mergeOverwrite (deepCopy $.Values.router) (deepCopy $r) -}}
{{- $ns := $r.namespace | default $.Release.Namespace -}}
{{- $key := printf "%s/%s" $ns $r.pool -}}
{{- if hasKey $seen $key -}}
{{- fail (printf "routers: the pool %s is listed twice" $key) -}}
{{- end -}}
{{- $_ := set $seen $key true -}}
{{- $_ := set $merged "namespace" $ns -}}
{{- $_ := set $merged "name" (include "kinference.cut" (printf "%s-router-%s" (include "kinference.fullname" $) $r.pool)) -}}
{{- $_ := set $merged "poolLabel" (include "kinference.cut" $r.pool) -}}
{{- $out = append $out $merged -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
Topology spread constraints: each one without a labelSelector selects the
component's own pods (SELECTOR, YAML) and, unless it says otherwise, adds
matchLabelKeys [pod-template-hash] so that the pods of one rollout are
spread among themselves. Argument: dict "constraints" LIST "selector" YAML.
Read with fromYamlArray.
*/}}
{{- define "kinference.topologySpread" -}}
{{- $out := list -}}
{{- range .constraints -}}
{{- $c := deepCopy . -}}
{{- if not (hasKey $c "labelSelector") -}}
{{- $_ := set $c "labelSelector" (dict "matchLabels" ($.selector | fromYaml)) -}}
{{- if not (hasKey $c "matchLabelKeys") -}}
{{- $_ := set $c "matchLabelKeys" (list "pod-template-hash") -}}
{{- end -}}
{{- end -}}
{{- $out = append $out $c -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}
