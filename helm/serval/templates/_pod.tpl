{{/*
One Ray pod template (head or worker group). Arguments: root (the chart's context), group (head or a
worker group's values), ports (container ports: [{name, containerPort}]).
*/}}
{{- define "serval.podTemplate" -}}
{{- $root := .root }}
{{- $values := $root.Values -}}
metadata:
  labels:
    {{- include "serval.selectorLabels" $root | nindent 4 }}
    {{- with $values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  securityContext:
    {{- toYaml $values.podSecurityContext | nindent 4 }}
  {{- with $values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
  - name: ray
    image: {{ include "serval.image" $root }}
    imagePullPolicy: {{ $values.image.pullPolicy }}
    securityContext:
      {{- toYaml $values.securityContext | nindent 6 }}
    ports:
    {{- range .ports }}
    - name: {{ .name }}
      containerPort: {{ .containerPort }}
    {{- end }}
    env:
    - name: RAY_USAGE_STATS_ENABLED
      value: "0"
    {{- if $values.ray.throughputOptimized }}
    - name: RAY_SERVE_THROUGHPUT_OPTIMIZED
      value: "1"
    {{- end }}
    {{- if $values.ray.haproxy }}
    - name: RAY_SERVE_ENABLE_HA_PROXY
      value: "1"
    {{- end }}
    {{- with $values.ray.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    resources:
      {{- include "serval.resources" .group | nindent 6 }}
    volumeMounts:
    - name: ray-tmp
      mountPath: /tmp/ray
    - name: dshm
      mountPath: /dev/shm
    {{- if include "serval.modelsVolume" $root | trim }}
    - name: models
      mountPath: {{ $values.models.mountPath }}
      readOnly: true
    {{- end }}
  volumes:
  - name: ray-tmp
    emptyDir: {}
  - name: dshm   # Ray's object store lives in shared memory; a container's default /dev/shm is 64 MiB
    emptyDir: {medium: Memory}
  {{- with include "serval.modelsVolume" $root | trim }}
  - name: models
    {{- . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* The models volume's source (a PersistentVolumeClaim, else a hostPath), or "" when neither is set. */}}
{{- define "serval.modelsVolume" -}}
{{- $models := .Values.models }}
{{- if $models.persistentVolumeClaim.claimName }}
persistentVolumeClaim:
  claimName: {{ $models.persistentVolumeClaim.claimName }}
  readOnly: true
{{- else if $models.hostPath.path }}
hostPath:
  path: {{ $models.hostPath.path }}
  type: {{ $models.hostPath.type }}
{{- end }}
{{- end }}
