{{/* Names and labels shared by every template. */}}

{{- define "pagoda.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.operatorName" -}}
{{- printf "%s-operator" (include "pagoda.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagoda.serviceAccountName" -}}
{{- default (include "pagoda.operatorName" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* "repository:tag" of an engine image value; (list $ .Values.engineImages.gpu) */}}
{{- define "pagoda.engineImage" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- printf "%s:%s" $image.repository ($image.tag | default $root.Chart.AppVersion) -}}
{{- end -}}

{{- define "pagoda.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: pagoda
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pagoda.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* A label map as the selector string "k=v,k2=v2" (keys in order); {} gives "". */}}
{{- define "pagoda.labelSelector" -}}
{{- $terms := list -}}
{{- range $key, $value := . -}}
{{- $terms = append $terms (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $terms -}}
{{- end -}}
