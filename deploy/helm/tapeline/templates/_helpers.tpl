{{/* Name of the release's objects: <release>-tapeline, or the release name when it already says tapeline. */}}
{{- define "tapeline.fullname" -}}
{{- if contains "tapeline" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-tapeline" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tapeline.labels" -}}
app.kubernetes.io/name: tapeline
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector of one role's pods; call with (dict "root" $ "role" "transcode"). */}}
{{- define "tapeline.selectorLabels" -}}
app.kubernetes.io/name: tapeline
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "tapeline.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tapeline.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tapeline.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Settings that hold a credential: never a plain value, only from a Secret (secretKeyRef). Listed
here once; `settings` naming one fails the render.
*/}}
{{- define "tapeline.secretSettings" -}}
database_url s3_access_key s3_secret_key admin_token intake_tokens kafka_sasl_password kafka_ssl_key_password kafka_extra_config
{{- end -}}

{{/*
Settings the chart sets from its own values (or per pod): `settings` naming one fails the render.
*/}}
{{- define "tapeline.chartSettings" -}}
app_name topic_prefix instance_id home kafka_bootstrap kafka_security_protocol kafka_sasl_mechanism kafka_sasl_username kafka_ssl_ca_location topic_replication_factor topic_min_insync_replicas db_schema reader_role s3_endpoint s3_bucket s3_region health_host health_port serve_host serve_port serve_allowed_hosts worker_name
{{- end -}}

{{/*
The environment of every Tapeline container: settings as TAPELINE_* (tapeline/settings.py), each
credential from its Secret. Call with (dict "root" $ "role" "transcode" "kafkaUser" $user).
*/}}
{{- define "tapeline.env" -}}
{{- $v := .root.Values -}}
{{- $secret := splitList " " (include "tapeline.secretSettings" .root) -}}
{{- $managed := splitList " " (include "tapeline.chartSettings" .root) -}}
- name: TAPELINE_APP_NAME
  value: {{ $v.appName | quote }}
- name: TAPELINE_TOPIC_PREFIX
  value: {{ $v.topicPrefix | quote }}
- name: TAPELINE_INSTANCE_ID
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: TAPELINE_HOME
  value: /var/lib/tapeline
- name: TAPELINE_LOG_FORMAT
  value: json
- name: TAPELINE_KAFKA_BOOTSTRAP
  value: {{ required "kafka.bootstrap is required" $v.kafka.bootstrap | quote }}
- name: TAPELINE_KAFKA_SECURITY_PROTOCOL
  value: {{ $v.kafka.securityProtocol | quote }}
{{- if hasPrefix "SASL" $v.kafka.securityProtocol }}
- name: TAPELINE_KAFKA_SASL_MECHANISM
  value: {{ $v.kafka.saslMechanism | quote }}
- name: TAPELINE_KAFKA_SASL_USERNAME
  value: {{ required "kafka.user.username is required with SASL" .kafkaUser.username | quote }}
- name: TAPELINE_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ required "kafka.user.passwordSecret.name is required with SASL" .kafkaUser.passwordSecret.name | quote }}
      key: {{ .kafkaUser.passwordSecret.key | quote }}
{{- end }}
{{- if $v.kafka.caSecret.name }}
- name: TAPELINE_KAFKA_SSL_CA_LOCATION
  value: /etc/tapeline/kafka-ca/{{ $v.kafka.caSecret.key }}
{{- end }}
{{- with $v.kafka.topicReplicationFactor }}
- name: TAPELINE_TOPIC_REPLICATION_FACTOR
  value: {{ . | quote }}
{{- end }}
{{- with $v.kafka.topicMinInsyncReplicas }}
- name: TAPELINE_TOPIC_MIN_INSYNC_REPLICAS
  value: {{ . | quote }}
{{- end }}
- name: TAPELINE_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "database.urlSecret.name is required" $v.database.urlSecret.name | quote }}
      key: {{ $v.database.urlSecret.key | quote }}
- name: PGSSLMODE
  value: {{ $v.database.sslMode | quote }}
{{- if $v.database.caSecret.name }}
- name: PGSSLROOTCERT
  value: /etc/tapeline/pg-ca/{{ $v.database.caSecret.key }}
{{- end }}
- name: TAPELINE_DB_SCHEMA
  value: {{ $v.database.schema | quote }}
- name: TAPELINE_READER_ROLE
  value: {{ $v.database.readerRole | quote }}
- name: TAPELINE_S3_ENDPOINT
  value: {{ $v.s3.endpoint | quote }}
- name: TAPELINE_S3_BUCKET
  value: {{ $v.s3.bucket | quote }}
- name: TAPELINE_S3_REGION
  value: {{ $v.s3.region | quote }}
{{- if $v.s3.credentialsSecret.name }}
- name: TAPELINE_S3_ACCESS_KEY
  valueFrom:
    secretKeyRef: {name: {{ $v.s3.credentialsSecret.name | quote }}, key: {{ $v.s3.credentialsSecret.accessKeyKey | quote }}}
- name: TAPELINE_S3_SECRET_KEY
  valueFrom:
    secretKeyRef: {name: {{ $v.s3.credentialsSecret.name | quote }}, key: {{ $v.s3.credentialsSecret.secretKeyKey | quote }}}
{{- else }}
- name: TAPELINE_S3_ACCESS_KEY
  value: ""
- name: TAPELINE_S3_SECRET_KEY
  value: ""
{{- end }}
{{- range $name, $value := $v.settings }}
{{- if has (lower $name) $secret }}
{{- fail (printf "settings.%s is a credential: give it through a Secret (see values.yaml), never as a value" $name) }}
{{- end }}
{{- if has (lower $name) $managed }}
{{- fail (printf "settings.%s is set by the chart from its own value (see values.yaml), not in settings" $name) }}
{{- end }}
- name: TAPELINE_{{ upper $name }}
  value: {{ if kindIs "string" $value }}{{ $value | quote }}{{ else }}{{ toJson $value | quote }}{{ end }}
{{- end }}
{{- end -}}

{{/* Volumes of the CA files named by kafka.caSecret and database.caSecret. */}}
{{- define "tapeline.caVolumes" -}}
{{- $v := .Values -}}
{{- if $v.kafka.caSecret.name }}
- name: kafka-ca
  secret: {secretName: {{ $v.kafka.caSecret.name | quote }}}
{{- end }}
{{- if $v.database.caSecret.name }}
- name: pg-ca
  secret: {secretName: {{ $v.database.caSecret.name | quote }}}
{{- end }}
{{- end -}}

{{- define "tapeline.caMounts" -}}
{{- $v := .Values -}}
{{- if $v.kafka.caSecret.name }}
- {name: kafka-ca, mountPath: /etc/tapeline/kafka-ca, readOnly: true}
{{- end }}
{{- if $v.database.caSecret.name }}
- {name: pg-ca, mountPath: /etc/tapeline/pg-ca, readOnly: true}
{{- end }}
{{- end -}}
