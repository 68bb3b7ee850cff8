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
{{- /* peer.host differs per pod: the vLLM container gets it as TIERCACHE_PEER__HOST. */ -}}
{{- if $t.peer.enabled -}}
{{- if not $redisUrl -}}
{{- fail "tiercache.peer.enabled needs Redis, where vLLM pods find each other's CPU tiers: set redis.enabled=true or externalRedis.url" -}}
{{- end -}}
{{- $_ := set $cfg "peer" (dict "enabled" true "port" (int $t.peer.port)) -}}
{{- end -}}
{{- $cfg = mergeOverwrite $cfg (deepCopy $t.extraConfig) -}}
{{- toJson $cfg -}}
{{- end -}}

{{/*
The service's config: the shared tiers only; the disk and peer tiers belong to vLLM
pods.
*/}}
{{- define "tiercache.serviceConfig" -}}
{{- $cfg := include "tiercache.connectorConfig" . | fromJson -}}
{{- $_ := unset $cfg "disk" -}}
{{- $_ := unset $cfg "peer" -}}
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

{{- define "tiercache.lookupSecretName" -}}
{{- default (printf "%s-lookup" (include "tiercache.fullname" .)) .Values.service.lookupToken.existingSecret -}}
{{- end -}}

{{- define "tiercache.integritySecretName" -}}
{{- default (printf "%s-integrity" (include "tiercache.fullname" .)) .Values.tiercache.integrityKey.existingSecret -}}
{{- end -}}

{{/*
"true" when the bundled MinIO is the S3 tier: its bucket Job then creates a
least-privilege user for vLLM and one for the service (the GC), and the pods get those
instead of the root credentials.
*/}}
{{- define "tiercache.minioUsers" -}}
{{- if and .Values.minio.enabled .Values.tiercache.s3.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* The Secret of a MinIO user: call with (dict "ctx" $ "user" "vllm"|"gc"). */}}
{{- define "tiercache.minioUserSecretName" -}}
{{- printf "%s-s3-%s" (include "tiercache.fullname" .ctx) .user -}}
{{- end -}}

{{/*
A Secret whose values are generated once and then kept: on upgrade each key present in
the live Secret keeps its value, and only missing keys get the new value given here.
Call with (dict "ctx" $ "name" <name> "component" <component> "data" <key: value>).
*/}}
{{- define "tiercache.keptSecret" -}}
{{- $live := lookup "v1" "Secret" .ctx.Release.Namespace .name }}
{{- $liveData := dict }}
{{- if and $live $live.data }}{{ $liveData = $live.data }}{{ end }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  labels:
    {{- include "tiercache.labels" (dict "ctx" .ctx "component" .component) | nindent 4 }}
type: Opaque
data:
  {{- range $key, $value := .data }}
  {{ $key }}: {{ (hasKey $liveData $key | ternary (index $liveData $key) ($value | b64enc)) | quote }}
  {{- end }}
{{- end -}}

{{/*
Environment shared by vLLM and the service: S3 credentials, the integrity key (vLLM's
only) and the Redis URL secret. Call with (dict "ctx" $ "user" "vllm"|"gc"): with the
bundled MinIO each gets its own least-privilege user.
*/}}
{{- define "tiercache.commonEnv" -}}
{{- $ctx := .ctx }}
{{- $s3Secret := "" }}
{{- $idKey := $ctx.Values.s3Credentials.accessKeyIdKey }}
{{- $secretKey := $ctx.Values.s3Credentials.secretAccessKeyKey }}
{{- if include "tiercache.minioUsers" $ctx }}
{{- $s3Secret = include "tiercache.minioUserSecretName" (dict "ctx" $ctx "user" .user) }}
{{- $idKey = "AWS_ACCESS_KEY_ID" }}
{{- $secretKey = "AWS_SECRET_ACCESS_KEY" }}
{{- else if and (not $ctx.Values.minio.enabled) (eq .user "gc") $ctx.Values.s3Credentials.gcExistingSecret }}
{{- $s3Secret = $ctx.Values.s3Credentials.gcExistingSecret }}
{{- else if and (not $ctx.Values.minio.enabled) (include "tiercache.s3CredentialsFromSecret" $ctx) }}
{{- $s3Secret = include "tiercache.s3SecretName" $ctx }}
{{- end }}
{{- if $s3Secret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $s3Secret }}
      key: {{ $idKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $s3Secret }}
      key: {{ $secretKey }}
# Static credentials: no reason for boto3 to probe the instance-metadata endpoint.
- name: AWS_EC2_METADATA_DISABLED
  value: "true"
{{- end }}
{{- if $ctx.Values.tiercache.s3.region }}
- name: AWS_DEFAULT_REGION
  value: {{ $ctx.Values.tiercache.s3.region | quote }}
{{- end }}
{{- /* Only vLLM reads and writes pages; the service and its GC need no key. */}}
{{- if and $ctx.Values.tiercache.integrityKey.enabled (eq .user "vllm") }}
- name: TIERCACHE_INTEGRITY_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tiercache.integritySecretName" $ctx }}
      key: {{ $ctx.Values.tiercache.integrityKey.key }}
{{- end }}
{{- if and (not $ctx.Values.redis.enabled) $ctx.Values.externalRedis.existingSecret }}
- name: TIERCACHE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $ctx.Values.externalRedis.existingSecret }}
      key: {{ $ctx.Values.externalRedis.existingSecretKey }}
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

{{/*
How many TCP ports from tiercache.peer.port each vLLM pod's NIXL agents listen in:
PEER_PORT_SPAN in tiercache/config.py (tests/test_deploy_chart_peer.py checks they agree).
*/}}
{{- define "tiercache.peerPortSpan" -}}
100
{{- end -}}
