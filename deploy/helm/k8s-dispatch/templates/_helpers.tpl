{{/* The release's name prefix: the release name when it already says k8s-dispatch. */}}
{{- define "kd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "worker"). */}}
{{- define "kd.selectorLabels" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every object's labels. No app.kubernetes.io/managed-by=k8s-dispatch: that marks dispatch Jobs. */}}
{{- define "kd.labels" -}}
{{ include "kd.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version }}
{{- end -}}

{{- define "kd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default (.Chart.AppVersion | replace "+" "_") }}
{{- end -}}

{{/* The capability file's text: capabilities.inline (text, or a mapping as YAML), else the chart's default. */}}
{{- define "kd.capabilitiesText" -}}
{{- $inline := .Values.capabilities.inline -}}
{{- if not $inline -}}
{{- .Files.Get "files/capabilities.yaml" -}}
{{- else if kindIs "string" $inline -}}
{{- $inline -}}
{{- else -}}
{{- toYaml $inline -}}
{{- end -}}
{{- end -}}

{{- define "kd.capabilitiesConfigMap" -}}
{{- .Values.capabilities.existingConfigMap | default (printf "%s-capabilities" (include "kd.fullname" .)) -}}
{{- end -}}

{{/* The pod template's metadata: (dict "ctx" $ "component" "worker" "annotations" map). */}}
{{- define "kd.podMetadata" -}}
labels:
  {{- include "kd.selectorLabels" . | nindent 2 }}
  {{- with .ctx.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- $annotations := merge (dict) (.annotations | default dict) (.ctx.Values.podAnnotations | default dict) }}
{{- if not .ctx.Values.capabilities.existingConfigMap }}
{{- $_ := set $annotations "checksum/capabilities" (include "kd.capabilitiesText" .ctx | sha256sum) }}
{{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* nodeSelector, tolerations, affinity and the pod's securityContext (the restricted profile). */}}
{{- define "kd.podSpecCommon" -}}
{{- with .Values.hostAliases }}
hostAliases:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: {{ .Values.runAsUser }}
  runAsGroup: {{ .Values.runAsGroup }}
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "kd.containerSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* The environment every k8s-dispatch process shares. */}}
{{- define "kd.env" -}}
- name: K8S_DISPATCH_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secret.name }}
      key: {{ .Values.secret.databaseUrlKey }}
- name: K8S_DISPATCH_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secret.name }}
      key: {{ .Values.secret.redisUrlKey }}
# Jobs go to the release's namespace (where the Role applies) unless a capability names another.
- name: K8S_DISPATCH_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: K8S_DISPATCH_CAPABILITIES
  value: /etc/k8s-dispatch/{{ .Values.capabilities.key }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kd.mounts" -}}
volumeMounts:
  - name: capabilities
    mountPath: /etc/k8s-dispatch
    readOnly: true
  # The only writable path: Python, Celery and beat's heartbeat use the temp dir.
  - name: tmp
    mountPath: /tmp
{{- end -}}

{{- define "kd.volumes" -}}
volumes:
  - name: capabilities
    configMap:
      name: {{ include "kd.capabilitiesConfigMap" . }}
  - name: tmp
    emptyDir: {}
{{- end -}}
