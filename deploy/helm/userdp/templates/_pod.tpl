{{/* Pieces shared by the coordinator, worker and shard-job pods. */}}

{{/* An init container that waits until manifest.json is there: written last (an atomic rename) by
the shard Job, or already on data.persistence.existingClaim. */}}
{{- define "userdp.waitForShards" -}}
{{- $where := "the shard Job writes it" -}}
{{- if eq (include "userdp.dataSource" .) "existing" -}}
{{- $where = printf "the claim %s must hold it in shards/" .Values.data.persistence.existingClaim -}}
{{- end -}}
- name: wait-for-shards
  image: {{ include "userdp.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - /bin/sh
    - -c
    - >-
      until [ -f {{ include "userdp.path.shards" . }}/manifest.json ]; do
      echo "waiting for {{ include "userdp.path.shards" . }}/manifest.json ({{ $where }})";
      sleep 10; done
  securityContext:
    {{- include "userdp.containerSecurityContext" . | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 32Mi}
    limits: {memory: 64Mi}
  volumeMounts:
    - name: data
      mountPath: {{ include "userdp.path.dataDir" . }}
      readOnly: true
{{- end -}}

{{- define "userdp.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: HOME
  value: /home/userdp
{{- end -}}

{{/*
The coordinator's health check. It serves grpc.health.v1 on its gRPC port; with mTLS that port
only accepts TLS clients holding a certificate of the run's CA, which the kubelet's native gRPC
probe cannot present, so the probe is `userdp deploy probe` run inside the pod with the
coordinator's own certificate. Without TLS the kubelet probes the port directly.
*/}}
{{- define "userdp.coordinatorProbe" -}}
{{- if .Values.tls.enabled -}}
exec:
  command:
    - userdp
    - deploy
    - probe
    - --address
    - {{ printf "127.0.0.1:%d" (int .Values.coordinator.port) }}
    - --service
    - userdp.v1.Coordinator
    - --tls-dir
    - {{ include "userdp.path.tlsDir" . }}
    - --cert-name
    - coordinator
{{- else -}}
grpc:
  port: {{ int .Values.coordinator.port }}
  service: userdp.v1.Coordinator
{{- end -}}
{{- end -}}
