{{/* Names. KubeRay derives the RayCluster's and the Services' names from the RayService's: keep it short. */}}
{{- define "serval.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "serval.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "serval.selectorLabels" -}}
app.kubernetes.io/name: {{ include "serval.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "serval.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "serval.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "serval.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
The Serve config as YAML: serveConfigFile (the file's text, from --set-file), else serveConfig (a map),
else the chart's copy of configs/serve/default.yaml. http_options comes from .Values.serve (a pod's
proxy must listen where the Serve Service reaches it); relative model sources move under the models mount.
*/}}
{{- define "serval.serveConfig" -}}
{{- $root := . }}
{{- $config := dict }}
{{- if .Values.serveConfigFile }}
{{- $config = fromYaml .Values.serveConfigFile }}
{{- if hasKey $config "Error" }}
{{- fail (printf "serveConfigFile is not a YAML map: %s" $config.Error) }}
{{- end }}
{{- else if .Values.serveConfig }}
{{- $config = deepCopy .Values.serveConfig }}
{{- else }}
{{- $config = fromYaml (.Files.Get "configs/default.yaml") }}
{{- end }}
{{- if not (kindIs "slice" $config.applications) }}
{{- fail "the Serve config (serveConfig or serveConfigFile) needs an applications list, as in configs/serve/*.yaml" }}
{{- end }}
{{- $http := merge (dict "host" .Values.serve.host "port" (int .Values.serve.port)) ($config.http_options | default dict) }}
{{- $_ := set $config "http_options" $http }}
{{- if .Values.models.rewriteRelativeSources }}
{{- range $app := $config.applications }}
{{- $args := $app.args | default dict }}
{{- $llmConfigs := list }}
{{- if kindIs "slice" $args.llm_configs }}{{ $llmConfigs = $args.llm_configs }}{{ end }}
{{- range $llm := concat $llmConfigs (list $args.prefill_config $args.decode_config) }}
{{- if and (kindIs "map" $llm) (kindIs "map" $llm.model_loading_config) }}
{{- include "serval.rewriteSource" (dict "loading" $llm.model_loading_config "mountPath" $root.Values.models.mountPath) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* model_source "models/x" or "x" (or no source: the model_id) -> "<mountPath>/x"; absolute paths stay. */}}
{{- define "serval.rewriteSource" -}}
{{- $source := .loading.model_source | default .loading.model_id | toString }}
{{- if not (or (hasPrefix "/" $source) (hasPrefix "~" $source)) }}
{{- $_ := set .loading "model_source" (printf "%s/%s" (trimSuffix "/" .mountPath) (trimPrefix "models/" $source)) }}
{{- end }}
{{- end }}

{{/* "true" when any worker group has GPUs, else "". */}}
{{- define "serval.usesGpus" -}}
{{- range .Values.workerGroups }}{{ if gt (int .gpus) 0 }}true{{ end }}{{ end }}
{{- end }}

{{/* "true" when the Ray autoscaler runs: forced by autoscaler.enabled, or "auto" and Serve autoscales. */}}
{{- define "serval.autoscaling" -}}
{{- if eq (toString .Values.autoscaler.enabled) "auto" }}
{{- $config := include "serval.serveConfig" . }}
{{- if or (contains "autoscaling_config:" $config) (regexMatch "num_replicas: (auto|\"auto\")" $config) }}true{{ end }}
{{- else if .Values.autoscaler.enabled }}true{{ end }}
{{- end }}

{{/* Container resources of a group: its requests and limits, plus its GPUs in both. */}}
{{- define "serval.resources" -}}
{{- $resources := deepCopy (.resources | default dict) }}
{{- $gpus := int (.gpus | default 0) }}
{{- if gt $gpus 0 }}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) ($resources.limits | default dict)) }}
{{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" $gpus) ($resources.requests | default dict)) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}
