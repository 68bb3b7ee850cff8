{{/*
Names. Component objects append suffixes such as "-minio-bucket" to the full name, so
it is cut at 45 characters to keep every name within Kubernetes' 63.
*/}}
{{- define "tiercache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 45 | trimSuffix "-" -}}
{{- end -}}

{{- define "tiercache.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tiercache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels: call with (dict "ctx" $ "component" "service"). */}}
{{- define "tiercache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tiercache.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tiercache.labels" -}}
helm.sh/chart: {{ include "tiercache.chart" .ctx }}
{{ include "tiercache.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: tiercache
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tiercache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tiercache.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference: call with (dict "image" <repository/tag map> "ctx" $). */}}
{{- define "tiercache.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/*
Endpoints. Short service names: every consumer runs in the release's namespace.
*/}}
{{- define "tiercache.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:%d/0" (include "tiercache.fullname" .) (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.externalRedis.url -}}
{{- end -}}
{{- end -}}

{{- define "tiercache.s3Endpoint" -}}
{{- if .Values.tiercache.s3.endpointUrl -}}
{{- .Values.tiercache.s3.endpointUrl -}}
{{- else if .Values.minio.enabled -}}
{{- printf "http://%s-minio:%d" (include "tiercache.fullname" .) (int .Values.minio.port) -}}
{{- end -}}
{{- end -}}

{{/*
The tiercache config as JSON: what vLLM gets as kv_connector_extra_config. Built key by
key so the values can use Helm's camelCase while the config keeps its own names.
*/}}
{{- define "tiercache.connectorConfig" -}}
{{- $t := .Values.tiercache -}}
{{- $cfg := dict "namespace" $t.namespace "cpu" (dict "capacity" $t.cpu.capacity) -}}
{{- $redisUrl := include "tiercache.redisUrl" . -}}
{{- if $redisUrl -}}
{{- $_ := set $cfg "redis_url" $redisUrl -}}
{{- end -}}
{{- if $t.disk.enabled -}}
{{- $_ := set $cfg "disk" (dict "path" $t.disk.path "capacity" $t.disk.capacity) -}}
{{- end -}}
{{- if $t.s3.enabled -}}
{{- if not $redisUrl -}}
{{- fail "tiercache.s3.enabled needs Redis, which indexes the shared S3 tier: set redis.enabled=true or externalRedis.url" -}}
{{- end -}}
{{- $s3 := dict "bucket" $t.s3.bucket "prefix" $t.s3.prefix -}}
{{- $endpoint := include "tiercache.s3Endpoint" . -}}
{{- if $endpoint -}}
{{- $_ := set $s3 "endpoint_url" $endpoint -}}
{{- end -}}
{{- if $t.s3.region -}}
{{- $_ := set $s3 "region" $t.s3.region -}}
{{- end -}}
{{- $_ := set $cfg "s3" $s3 -}}
{{- end -}}
{{- $cfg = mergeOverwrite $cfg (deepCopy $t.extraConfig) -}}
{{- toJson $cfg -}}
{{- end -}}

{{/* The service's config: the shared tiers only; the disk tier belongs to vLLM nodes. */}}
{{- define "tiercache.serviceConfig" -}}
{{- $cfg := include "tiercache.connectorConfig" . | fromJson -}}
{{- $_ := unset $cfg "disk" -}}
{{- toPrettyJson $cfg -}}
{{- end -}}

{{/* vLLM's --kv-transfer-config. */}}
{{- define "tiercache.kvTransferConfig" -}}
{{- $extra := include "tiercache.connectorConfig" . | fromJson -}}
{{- $kv := dict "kv_connector" "TierCacheConnector" "kv_connector_module_path" "tiercache.connector" "kv_role" "kv_both" "kv_load_failure_policy" .Values.vllm.kvLoadFailurePolicy "kv_connector_extra_config" $extra -}}
{{- toJson $kv -}}
{{- end -}}

{{/* Secrets. */}}
{{- define "tiercache.s3SecretName" -}}
{{- default (printf "%s-s3" (include "tiercache.fullname" .)) .Values.s3Credentials.existingSecret -}}
{{- end -}}

{{/* "true" when the pods get AWS_* variables from a Secret; empty for IRSA/instance roles. */}}
{{- define "tiercache.s3CredentialsFromSecret" -}}
{{- if or .Values.s3Credentials.existingSecret .Values.s3Credentials.accessKeyId .Values.minio.enabled -}}
true
{{- end -}}
{{- end -}}

{{- define "tiercache.adminSecretName" -}}
{{- default (printf "%s-admin" (include "tiercache.fullname" .)) .Values.service.adminToken.existingSecret -}}
{{- end -}}

{{/* Environment shared by vLLM and the service: S3 credentials and the Redis URL secret. */}}
{{- define "tiercache.commonEnv" -}}
{{- if include "tiercache.s3CredentialsFromSecret" . }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ include "tiercache.s3SecretName" . }}
      key: {{ .Values.s3Credentials.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tiercache.s3SecretName" . }}
      key: {{ .Values.s3Credentials.secretAccessKeyKey }}
# Static credentials: no reason for boto3 to probe the instance-metadata endpoint.
- name: AWS_EC2_METADATA_DISABLED
  value: "true"
{{- end }}
{{- if .Values.tiercache.s3.region }}
- name: AWS_DEFAULT_REGION
  value: {{ .Values.tiercache.s3.region | quote }}
{{- end }}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.existingSecret }}
- name: TIERCACHE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.externalRedis.existingSecret }}
      key: {{ .Values.externalRedis.existingSecretKey }}
{{- end }}
{{- end -}}

{{/* prometheus.io/* pod annotations: call with (dict "ctx" $ "port" 8080). */}}
{{- define "tiercache.scrapeAnnotations" -}}
{{- if .ctx.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | int | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}
