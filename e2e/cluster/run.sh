#!/usr/bin/env bash
# End to end on a real cluster: install the CRD and the operator, apply the tiny CPU example,
# wait until its InferenceService is Ready, then send one OpenAI chat completion through its
# router and check the answer. Needs kubectl, curl and python3; KUBECONFIG names the cluster.
#
#   KUBECONFIG=~/.kube/config e2e/cluster/run.sh
#
# Settings (environment):
#   PAGODA_E2E_INSTALLER   kustomize (default: kubectl apply -k kustomize/overlays/cpu-dev) or helm
#   PAGODA_E2E_IMAGE_TAG   tag of the operator and engine images for helm (default dev, as
#                          `make images` builds; the cpu-dev overlay always uses dev)
#   PAGODA_E2E_TIMEOUT     how long the InferenceService may take to become Ready (default 15m)
#   PAGODA_E2E_KEEP=1      leave the InferenceService running afterwards
#   PAGODA_E2E_UNINSTALL=1 also remove the operator afterwards (never the CRD: deleting it would
#                          delete every InferenceService in the cluster)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
EXAMPLE="$ROOT/examples/tiny-cpu.yaml"
OVERLAY="$ROOT/kustomize/overlays/cpu-dev"
OPERATOR_NAMESPACE=pagoda-system
OPERATOR_DEPLOYMENT=pagoda-operator
INSTALLER=${PAGODA_E2E_INSTALLER:-kustomize}
TIMEOUT=${PAGODA_E2E_TIMEOUT:-15m}
IMAGE_TAG=${PAGODA_E2E_IMAGE_TAG:-dev}

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'e2e/cluster: %s\n' "$*" >&2; exit 1; }

: "${KUBECONFIG:?set KUBECONFIG to the kubeconfig of the cluster to test (e.g. the one kind wrote)}"
export KUBECONFIG
for tool in kubectl curl python3; do
  command -v "$tool" >/dev/null || die "$tool is required but not on PATH"
done
case "$INSTALLER" in
  kustomize) ;;
  helm) command -v helm >/dev/null || die "PAGODA_E2E_INSTALLER=helm but helm is not on PATH" ;;
  *) die "PAGODA_E2E_INSTALLER must be kustomize or helm, not '$INSTALLER'" ;;
esac
[ -f "$EXAMPLE" ] || die "missing $EXAMPLE"
[ -f "$ROOT/crds/kustomization.yaml" ] || die "missing crds/ (run: make crds)"
kubectl version --request-timeout=15s >/dev/null 2>&1 \
  || die "cannot reach the cluster of KUBECONFIG=$KUBECONFIG (kubectl version failed)"

NAME=""
NAMESPACE=default
WORKDIR=$(mktemp -d)
PORT_FORWARD_PID=""
cleanup() {
  local rc=$?
  [ -n "$PORT_FORWARD_PID" ] && kill "$PORT_FORWARD_PID" 2>/dev/null || true
  if [ "$rc" != 0 ] && [ -n "$NAME" ]; then
    log "failed (exit $rc); cluster state for diagnosis:"
    kubectl get pis,deploy,svc,pods -n "$NAMESPACE" -o wide >&2 || true
    kubectl get pis "$NAME" -n "$NAMESPACE" -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}' >&2 || true
    kubectl logs -n "$OPERATOR_NAMESPACE" "deploy/$OPERATOR_DEPLOYMENT" --tail=50 >&2 || true
  fi
  if [ "${PAGODA_E2E_KEEP:-0}" != 1 ] && [ -n "$NAME" ]; then
    log "deleting InferenceService $NAMESPACE/$NAME"
    kubectl delete -n "$NAMESPACE" -f "$EXAMPLE" --ignore-not-found --wait=true --timeout=5m >/dev/null || true
  fi
  if [ "${PAGODA_E2E_UNINSTALL:-0}" = 1 ]; then
    log "removing the operator"
    if [ "$INSTALLER" = helm ]; then
      helm uninstall pagoda -n "$OPERATOR_NAMESPACE" || true
    else
      kubectl delete -n "$OPERATOR_NAMESPACE" "deployment/$OPERATOR_DEPLOYMENT" --ignore-not-found || true
    fi
  fi
  rm -rf "$WORKDIR"
  exit "$rc"
}
trap cleanup EXIT

# 1. The CRD first, and wait until it is served: an InferenceService applied in the same call
#    as its CRD is refused ("no matches for kind").
log "installing the InferenceService CRD"
kubectl apply --server-side --force-conflicts -k "$ROOT/crds" >/dev/null
kubectl wait --for=condition=Established --timeout=60s crd/inferenceservices.pagoda.dev >/dev/null
# Read name and namespace the way kubectl does (needs the CRD served for the mapping).
NAME=$(kubectl create --dry-run=client -o jsonpath='{.metadata.name}' -f "$EXAMPLE")
NAMESPACE=$(kubectl create --dry-run=client -o jsonpath='{.metadata.namespace}' -f "$EXAMPLE")
NAMESPACE=${NAMESPACE:-default}

# 2. The operator and its RBAC (it creates each router's account beside its InferenceService).
if [ "$INSTALLER" = helm ]; then
  log "installing the operator with helm"
  helm upgrade --install pagoda "$ROOT/charts/pagoda" --namespace "$OPERATOR_NAMESPACE" --create-namespace \
    --set operator.image.tag="$IMAGE_TAG" --set engineImages.cpu.tag="$IMAGE_TAG" \
    --set engineImages.gpu.tag="$IMAGE_TAG" >/dev/null
else
  log "installing the operator with kustomize ($OVERLAY)"
  kubectl apply --server-side --force-conflicts -k "$OVERLAY" >/dev/null
fi
log "waiting for the operator"
kubectl rollout status -n "$OPERATOR_NAMESPACE" "deployment/$OPERATOR_DEPLOYMENT" --timeout=5m >&2

# 3. The example, then its Ready condition (the engine loads the model and passes /health).
log "applying $EXAMPLE"
kubectl apply --server-side -n "$NAMESPACE" -f "$EXAMPLE" >/dev/null
log "waiting up to $TIMEOUT for InferenceService $NAMESPACE/$NAME to be Ready"
kubectl wait --for=condition=Ready "inferenceservice.pagoda.dev/$NAME" -n "$NAMESPACE" --timeout="$TIMEOUT" >&2

# 4. One request through the router Service (named like the InferenceService).
SERVICE_PORT=$(kubectl get svc "$NAME" -n "$NAMESPACE" -o jsonpath='{.spec.ports[0].port}')
[ -n "$SERVICE_PORT" ] || die "router Service $NAMESPACE/$NAME has no port"
kubectl port-forward -n "$NAMESPACE" "svc/$NAME" ":$SERVICE_PORT" >"$WORKDIR/port-forward.log" 2>&1 &
PORT_FORWARD_PID=$!
LOCAL_PORT=""
for _ in $(seq 1 60); do
  LOCAL_PORT=$(sed -n 's/^Forwarding from 127\.0\.0\.1:\([0-9]*\) .*/\1/p' "$WORKDIR/port-forward.log" | head -n1)
  [ -n "$LOCAL_PORT" ] && break
  kill -0 "$PORT_FORWARD_PID" 2>/dev/null || die "kubectl port-forward exited: $(cat "$WORKDIR/port-forward.log")"
  sleep 0.5
done
[ -n "$LOCAL_PORT" ] || die "kubectl port-forward did not start: $(cat "$WORKDIR/port-forward.log")"
BASE_URL="http://127.0.0.1:$LOCAL_PORT/v1"

MODEL=$(curl -fsS --retry 5 --retry-connrefused --max-time 30 "$BASE_URL/models" \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
log "router at $BASE_URL serves model '$MODEL'; sending a chat completion"
curl -fsS --max-time 300 "$BASE_URL/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"Say hello.\"}], \"max_tokens\": 16, \"temperature\": 0}" \
  >"$WORKDIR/response.json"
python3 - "$WORKDIR/response.json" "$MODEL" <<'PY'
import json
import sys

path, model = sys.argv[1], sys.argv[2]
body = json.load(open(path))
choice = body["choices"][0]
problems = []
if body.get("object") != "chat.completion":
    problems.append(f"object is {body.get('object')!r}, not 'chat.completion'")
if body.get("model") != model:
    problems.append(f"model is {body.get('model')!r}, not {model!r}")
if choice["message"]["role"] != "assistant" or not isinstance(choice["message"]["content"], str):
    problems.append(f"unexpected message {choice['message']!r}")
if choice.get("finish_reason") not in ("stop", "length"):
    problems.append(f"finish_reason is {choice.get('finish_reason')!r}")
if not 1 <= body["usage"]["completion_tokens"] <= 16:
    problems.append(f"completion_tokens is {body['usage']['completion_tokens']}, expected 1..16")
if problems:
    sys.exit("bad chat completion: " + "; ".join(problems) + "\n" + json.dumps(body, indent=2))
print(f"answer ({body['usage']['completion_tokens']} tokens): {choice['message']['content']!r}")
PY
log "PASS: $NAMESPACE/$NAME answered through its router"
