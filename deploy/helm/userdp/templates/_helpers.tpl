{{/*
Names, labels, the in-pod paths, and the userdp TOML config the chart mounts.

The in-pod paths below are a contract with `userdp deploy render` (userdp/kubernetes/chart.py,
DEPLOY_PATHS); tests/deploy checks that the two agree and that the rendered container args parse
with the userdp CLI.
*/}}

{{- define "userdp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "userdp.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "userdp.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "userdp.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "userdp.coordinatorName" -}}{{ include "userdp.fullname" . }}-coordinator{{- end -}}
{{- define "userdp.workerName" -}}{{ include "userdp.fullname" . }}-worker{{- end -}}

{{- define "userdp.labels" -}}
app.kubernetes.io/name: {{ include "userdp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "userdp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "userdp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "userdp.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* In-pod paths (keep in sync with userdp/kubernetes/chart.py DEPLOY_PATHS). */}}
{{- define "userdp.path.configDir" -}}/etc/userdp/config{{- end -}}
{{- define "userdp.path.configFile" -}}/etc/userdp/config/userdp.toml{{- end -}}
{{- define "userdp.path.tlsDir" -}}/etc/userdp/tls{{- end -}}
{{- define "userdp.path.tokenDir" -}}/etc/userdp/token{{- end -}}
{{- define "userdp.path.tokenFile" -}}/etc/userdp/token/token{{- end -}}
{{- define "userdp.path.dataDir" -}}/data{{- end -}}
{{- define "userdp.path.shards" -}}/data/shards{{- end -}}
{{- define "userdp.path.stateDir" -}}/var/lib/userdp{{- end -}}
{{- define "userdp.path.outputDir" -}}/var/lib/userdp/run{{- end -}}
{{- define "userdp.path.inputDir" -}}/input{{- end -}}

{{/* The worker ids the coordinator accepts: the StatefulSet's pod names. */}}
{{- define "userdp.workerIds" -}}
{{- $ids := list -}}
{{- range $index := until (int .Values.workers.replicas) -}}
{{- $ids = append $ids (printf "%s-%d" (include "userdp.workerName" $) $index) -}}
{{- end -}}
{{- join "," $ids -}}
{{- end -}}

{{/*
Exactly one way to authenticate workers: the coordinator uses mTLS when it has certificates and the
shared token otherwise, and a worker takes --tls-dir or --token-file, not both.
*/}}
{{- define "userdp.checkAuth" -}}
{{- if and .Values.tls.enabled .Values.authToken.enabled -}}
{{- fail "tls.enabled and authToken.enabled: choose one (the coordinator uses mTLS when it has certificates; set tls.enabled=false to use the token)" -}}
{{- end -}}
{{- if not (or .Values.tls.enabled .Values.authToken.enabled) -}}
{{- fail "workers must authenticate: keep tls.enabled=true (mTLS, recommended) or set tls.enabled=false and authToken.enabled=true" -}}
{{- end -}}
{{- end -}}

{{/*
Where the shards come from. The values must name one source; there is no default:
  existing - data.persistence.existingClaim already holds `userdp shard` output in shards/ (the
             shard Job, when enabled, only verifies it);
  input    - the shard Job runs `userdp shard` on the user's dataset (shardJob.input);
  demo     - the shard Job writes the synthetic demo corpus (shardJob.demo=true, explicitly).
Returns the source's name; fails with the values to set when none or a contradictory one is given.
*/}}
{{- define "userdp.dataSource" -}}
{{- $job := .Values.shardJob -}}
{{- $input := or $job.input.existingClaim $job.input.path -}}
{{- if and $job.demo $input -}}
{{- fail "shardJob.demo=true and shardJob.input are both set: train on the demo corpus or on your dataset, not both (unset shardJob.input.* or set shardJob.demo=false)" -}}
{{- end -}}
{{- if $input -}}
{{- $missing := list -}}
{{- if not $job.input.existingClaim -}}{{- $missing = append $missing "shardJob.input.existingClaim" -}}{{- end -}}
{{- if not $job.input.path -}}{{- $missing = append $missing "shardJob.input.path" -}}{{- end -}}
{{- if not $job.userColumn -}}{{- $missing = append $missing "shardJob.userColumn" -}}{{- end -}}
{{- if not $job.textColumn -}}{{- $missing = append $missing "shardJob.textColumn" -}}{{- end -}}
{{- if $missing -}}
{{- fail (printf "shardJob.input: also set %s (the shard Job runs `userdp shard` on your dataset)" (join ", " $missing)) -}}
{{- end -}}
{{- end -}}
{{- if and (not $job.enabled) (or $job.demo $input) -}}
{{- fail "shardJob.enabled=false, but only the shard Job writes the shards of shardJob.demo or shardJob.input: keep shardJob.enabled=true, or give data.persistence.existingClaim (a volume already holding the shards) alone" -}}
{{- end -}}
{{- if $job.demo -}}
demo
{{- else if $input -}}
input
{{- else if .Values.data.persistence.existingClaim -}}
existing
{{- else -}}
{{- fail "no training data: set data.persistence.existingClaim (a volume holding `userdp shard` output in shards/), or shardJob.input.existingClaim, shardJob.input.path, shardJob.userColumn and shardJob.textColumn (your dataset, sharded by the shard Job), or shardJob.demo=true (the synthetic demo corpus)" -}}
{{- end -}}
{{- end -}}

{{/*
How the run moves model-size tensors: config.coordinator.data_plane, "grpc" (the default) or
"collective" (the workers reduce and broadcast in a gloo group that rendezvouses in the
coordinator's store on coordinator.groupPort). Fails on another value, and on a group port that is
the gRPC port.
*/}}
{{- define "userdp.dataPlane" -}}
{{- $coordinator := get (default dict .Values.config) "coordinator" -}}
{{- $plane := "grpc" -}}
{{- if kindIs "map" $coordinator -}}
{{- $plane = default "grpc" (get $coordinator "data_plane") -}}
{{- end -}}
{{- if not (has $plane (list "grpc" "collective")) -}}
{{- fail (printf "config.coordinator.data_plane must be grpc or collective, got %v" $plane) -}}
{{- end -}}
{{- if and (eq $plane "collective") (eq (int .Values.coordinator.groupPort) (int .Values.coordinator.port)) -}}
{{- fail (printf "coordinator.groupPort = %d is coordinator.port too: the rendezvous store of the collective data plane needs a port of its own; set another coordinator.groupPort" (int .Values.coordinator.groupPort)) -}}
{{- end -}}
{{- $plane -}}
{{- end -}}

{{- define "userdp.coordinatorAddress" -}}
{{- printf "%s:%d" (include "userdp.coordinatorName" .) (int .Values.coordinator.port) -}}
{{- end -}}

{{- define "userdp.tlsCoordinatorSecret" -}}
{{- default (printf "%s-tls-coordinator" (include "userdp.fullname" .)) .Values.tls.coordinatorSecret -}}
{{- end -}}
{{- define "userdp.tlsWorkersSecret" -}}
{{- default (printf "%s-tls-workers" (include "userdp.fullname" .)) .Values.tls.workersSecret -}}
{{- end -}}
{{- define "userdp.tokenSecret" -}}
{{- default (printf "%s-token" (include "userdp.fullname" .)) .Values.authToken.existingSecret -}}
{{- end -}}
{{- define "userdp.dataClaim" -}}
{{- default (printf "%s-data" (include "userdp.fullname" .)) .Values.data.persistence.existingClaim -}}
{{- end -}}
{{- define "userdp.stateClaim" -}}
{{- default (printf "%s-state" (include "userdp.fullname" .)) .Values.coordinator.persistence.existingClaim -}}
{{- end -}}

{{/*
The effective userdp config: .Values.config with the keys the deployment decides overwritten
(where shards, certificates, token and outputs are mounted; the ports; the worker count and device).
*/}}
{{- define "userdp.effectiveConfig" -}}
{{- $config := deepCopy (default dict .Values.config) -}}
{{- range $section, $keys := $config -}}
{{- if not (kindIs "map" $keys) -}}
{{- fail (printf "config.%s must be a map of keys (a TOML [%s] section), got %v" $section $section $keys) -}}
{{- end -}}
{{- end -}}
{{- $data := default dict (get $config "data") -}}
{{- $_ := set $data "shards" (include "userdp.path.shards" .) -}}
{{- $_ := set $config "data" $data -}}
{{- $coordinator := default dict (get $config "coordinator") -}}
{{- $_ := set $coordinator "host" "0.0.0.0" -}}
{{- $_ := set $coordinator "port" (int .Values.coordinator.port) -}}
{{- if eq (include "userdp.dataPlane" .) "collective" -}}
{{- $_ := set $coordinator "group_port" (int .Values.coordinator.groupPort) -}}
{{- else -}}
{{- $_ := unset $coordinator "group_port" -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- $_ := set $coordinator "tls_dir" (include "userdp.path.tlsDir" .) -}}
{{- else -}}
{{- $_ := unset $coordinator "tls_dir" -}}
{{- end -}}
{{- if and .Values.authToken.enabled (not .Values.tls.enabled) -}}
{{- $_ := set $coordinator "auth_token_file" (include "userdp.path.tokenFile" .) -}}
{{- else -}}
{{- $_ := unset $coordinator "auth_token_file" -}}
{{- end -}}
{{- $_ := set $config "coordinator" $coordinator -}}
{{- $workers := default dict (get $config "workers") -}}
{{- $_ := set $workers "count" (int .Values.workers.replicas) -}}
{{- $_ := set $workers "device" (ternary "cuda" "cpu" (gt (int .Values.workers.gpus) 0)) -}}
{{- $_ := set $config "workers" $workers -}}
{{- $output := default dict (get $config "output") -}}
{{- $_ := set $output "dir" (include "userdp.path.outputDir" .) -}}
{{- $_ := set $config "output" $output -}}
{{- $strategy := default dict (get $config "strategy") -}}
{{- if .Values.plugin.files -}}
{{- $_ := set $strategy "plugin_path" (include "userdp.path.configDir" .) -}}
{{- else -}}
{{- $_ := unset $strategy "plugin_path" -}}
{{- end -}}
{{- $_ := set $config "strategy" $strategy -}}
{{- toYaml $config -}}
{{- end -}}

{{/* One TOML scalar. YAML numbers arrive as float64; integral ones are written as integers. */}}
{{- define "userdp.tomlValue" -}}
{{- $v := . -}}
{{- if kindIs "string" $v -}}
{{- toJson $v -}}
{{- else if kindIs "bool" $v -}}
{{- ternary "true" "false" $v -}}
{{- else if kindIs "float64" $v -}}
{{- if eq $v (float64 (int64 $v)) -}}{{- int64 $v -}}{{- else -}}{{- $v -}}{{- end -}}
{{- else if or (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- $v -}}
{{- else if kindIs "slice" $v -}}
[{{- range $i, $item := $v -}}{{- if $i -}}, {{ end -}}{{- include "userdp.tomlValue" $item -}}{{- end -}}]
{{- else -}}
{{- fail (printf "config: a TOML value must be a string, number, boolean or a list of those, got %v" $v) -}}
{{- end -}}
{{- end -}}

{{/* The effective config as TOML: one [section] per map, keys sorted; null keys are left out; a
map-valued key (strategy.params) is the sub-table [section.key] after its section's keys. */}}
{{- define "userdp.configToml" -}}
{{- $config := fromYaml (include "userdp.effectiveConfig" .) -}}
{{- $ports := ternary "port/group_port" "port" (eq (include "userdp.dataPlane" .) "collective") -}}
# userdp config rendered by the Helm chart {{ .Chart.Name }}-{{ .Chart.Version }} (release {{ .Release.Name }}).
# Keys under [data] shards, [coordinator] host/{{ $ports }}/tls_dir/auth_token_file, [workers] count/device
# and [output] dir are set by the chart; edit the chart values, not this file.
{{- range $section, $keys := $config }}

[{{ $section }}]
{{- range $key, $value := $keys }}
{{- if not (or (kindIs "invalid" $value) (kindIs "map" $value)) }}
{{ $key }} = {{ include "userdp.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $key, $table := $keys }}
{{- if and (kindIs "map" $table) $table }}

[{{ $section }}.{{ $key }}]
{{- range $name, $value := $table }}
{{- if not (kindIs "invalid" $value) }}
{{ $name }} = {{ include "userdp.tomlValue" $value }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{ end -}}

{{- define "userdp.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "userdp.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end -}}
