{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "mdgan.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Base name of every object. A release named "mdgan" (or containing it) gives mdgan-server and
mdgan-worker; another release name R gives R-mdgan-server and R-mdgan-worker.
*/}}
{{- define "mdgan.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "mdgan.server.fullname" -}}{{ include "mdgan.fullname" . }}-server{{- end }}
{{- define "mdgan.worker.fullname" -}}{{ include "mdgan.fullname" . }}-worker{{- end }}

{{- define "mdgan.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels; pass (dict "ctx" $ "component" "server"|"worker"). */}}
{{- define "mdgan.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mdgan.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Common labels; pass (dict "ctx" $ "component" "server"|"worker"|...). */}}
{{- define "mdgan.labels" -}}
helm.sh/chart: {{ include "mdgan.chart" .ctx }}
{{ include "mdgan.selectorLabels" . }}
app.kubernetes.io/part-of: mdgan
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* Image reference; pass (dict "ctx" $ "image" .Values.server.image). */}}
{{- define "mdgan.image" -}}
{{- $registry := .image.registry | default .ctx.Values.global.imageRegistry -}}
{{- $tag := .image.tag | default .ctx.Chart.AppVersion -}}
{{- if $registry }}{{ printf "%s/%s:%s" $registry .image.repository $tag }}{{ else }}{{ printf "%s:%s" .image.repository $tag }}{{ end }}
{{- end }}

{{/* Settings the chart derives itself; refuse them in a settings block. */}}
{{- define "mdgan.checkSettings" -}}
{{- range $key, $value := .settings }}
{{- if has $key $.reserved }}
{{- fail (printf "%s.settings.%s is set by the chart (%s); change %s instead" $.block $key $.why $.instead) }}
{{- end }}
{{- if not (hasPrefix "MDGAN_" $key) }}
{{- fail (printf "%s.settings.%s: only MDGAN_* variables belong here" $.block $key) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The emptyDir volumes a read-only root filesystem needs. */}}
{{- define "mdgan.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.global.tmpSizeLimit }}
{{- end }}

{{/* Names of the TLS Secrets. */}}
{{- define "mdgan.server.tlsSecret" -}}
{{- .Values.tls.serverSecret | default (printf "%s-tls" (include "mdgan.server.fullname" .)) }}
{{- end }}
{{- define "mdgan.worker.tlsSecret" -}}
{{- .Values.tls.workersSecret | default (printf "%s-tls" (include "mdgan.worker.fullname" .)) }}
{{- end }}

{{/* Where the credentials are mounted. */}}
{{- define "mdgan.tlsDir" -}}/etc/mdgan/tls{{- end }}

{{/*
A probe: the native gRPC probe in plaintext; under mTLS (which the kubelet's gRPC probe cannot speak)
mdgan-healthcheck with the container's own credentials. Pass (dict "ctx" $ "port" N "service" NAME
"settings" PROBE-SETTINGS).
*/}}
{{- define "mdgan.probe" -}}
{{- if .ctx.Values.tls.enabled }}
exec:
  command:
    - mdgan-healthcheck
    - {{ printf "localhost:%d" (int .port) | quote }}
    {{- if .service }}
    - --service
    - {{ .service }}
    {{- end }}
{{- else }}
grpc:
  port: {{ .port }}
  {{- if .service }}
  service: {{ .service }}
  {{- end }}
{{- end }}
{{ toYaml .settings }}
{{- end }}

{{/* What the workers dial: this release's server Service, or (server.enabled=false) server.address. */}}
{{- define "mdgan.serverAddress" -}}
{{- if .Values.server.enabled -}}
{{- printf "%s:%d" (include "mdgan.server.fullname" .) (int .Values.server.grpcPort) -}}
{{- else -}}
{{- if not (regexMatch "^.+:[0-9]+$" .Values.server.address) -}}
{{- fail (printf "server.enabled=false (a worker-only release) needs server.address: the HOST:PORT of the consortium's server, got %q" .Values.server.address) -}}
{{- end -}}
{{- .Values.server.address -}}
{{- end -}}
{{- end }}

{{/* The workers the run waits for: server.workers, else this release's workers.replicas. */}}
{{- define "mdgan.runWorkers" -}}
{{- if kindIs "invalid" .Values.server.workers -}}{{ .Values.workers.replicas | int }}{{- else -}}{{ .Values.server.workers | int }}{{- end -}}
{{- end }}
