{{- define "kiln.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kiln.labels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kiln.selectorLabels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kiln.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kiln.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kiln.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The rules the operator needs in every namespace it manages: nothing else. */}}
{{- define "kiln.namespacedRules" -}}
# LLMEngines: kopf watches them and keeps its bookkeeping in annotations (patch); status is ours.
- apiGroups: [serving.kiln.dev]
  resources: [llmengines]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.kiln.dev]
  resources: [llmengines/status]
  verbs: [get, patch]
# LLMEnginePools (docs/pools.md), the same way: kopf watches them, the status is ours.
- apiGroups: [serving.kiln.dev]
  resources: [llmenginepools]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.kiln.dev]
  resources: [llmenginepools/status]
  verbs: [get, patch]
# Children carry ownerReferences with blockOwnerDeletion, which needs this (a pool's ConfigMap, Deployment and
# Service are its children as an engine's are).
- apiGroups: [serving.kiln.dev]
  resources: [llmengines/finalizers, llmenginepools/finalizers]
  verbs: [update]
# A new version's pods, read while it rolls out (pods the scheduler cannot place).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list]
# An engine's Deployment and a pool's <pool>-pool (no delete: an engine that joins a pool is scaled to 0).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch]
# Engines whose replica spans nodes (LeaderWorkerSet, installed separately: docs/multi-node-cluster.md).
# delete: when an engine's replica fits one pod again, its Deployment takes over and the LWS goes (or when it
# joins a pool).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# The public key's copy (serving pods verify with it) and each multi-node engine's group token: created,
# the copy read and patched by name. No private key is ever here: a copy an older operator wrote is deleted
# by name. Never list.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [""]
  resources: [secrets]
  resourceNames: [kiln-verify-key]
  verbs: [get, patch]
{{- if or .Values.watchNamespaces .Values.build.copyCredentials }}
# get any Secret here: the credentials Secret a spec names (model, adapter), copied next to the build Job that
# fetches with it, and a multi-node engine's group token, read back by name. The operator could mount any of
# them in a pod it creates anyway; still, cluster-wide (no watchNamespaces) this reaches every namespace's
# Secrets, so there it is granted only with build.copyCredentials (docs/operator-trust.md).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
- apiGroups: [""]
  resources: [secrets]
  resourceNames: [kiln-build-signing-key]
  verbs: [delete]
# Each engine's NetworkPolicy; delete: when networkPolicy.enabled is turned off.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
# Each LoRA engine's <engine>-adapters ConfigMap (docs/lora.md); delete: when spec.lora is removed. Each pool's
# <pool>-pool-engines ConfigMap, the engine list its pods follow (docs/pools.md).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch, delete]
# Scale out (docs/scale-out.md): the autoscaler objects of the chosen engine, and InferencePools; delete
# because an engine that drops autoscaling or routing loses them.
{{- if eq .Values.autoscaling.engine "hpa" }}
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
{{- else }}
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
- apiGroups: [http.keda.sh]
  resources: [httpscaledobjects]
  verbs: [get, create, patch, delete]
{{- end }}
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
{{- if .Values.ha.enabled }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}

{{- define "kiln.args" -}}
- operator
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- if .Values.metrics.enabled }}
- --metrics-port={{ .Values.metrics.port }}
{{- end }}
{{- if .Values.ha.enabled }}
- --ha
{{- end }}
{{- if .Values.operator.logVerbose }}
- --verbose
{{- end }}
{{- end -}}


{{/* Where build Jobs run: build.namespace, else the release namespace. */}}
{{- define "kiln.jobsNamespace" -}}
{{- default .Release.Namespace .Values.build.namespace -}}
{{- end -}}
