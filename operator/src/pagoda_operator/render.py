"""Spec in, manifests out: everything one InferenceService becomes, as plain dicts.

Pure: no API calls, no clock, no randomness; the same resource always renders the same bytes, so
`pagoda-operator render`, the tests and the handler see exactly what will be applied. The
handler applies the list in order by server-side apply. Children, all named from the
InferenceService `<name>` and all in its namespace:

  ConfigMap <name>-engine           the engine configuration; its hash rolls the pods
  Service <name>-engine             headless; the router discovers replicas through it
  Deployment <name>-engine          engine pods (topology.nodes == 1), or
  LeaderWorkerSet <name>-engine     one leader + workers group per replica (nodes > 1)
  PodDisruptionBudget <name>-engine at most one replica down for voluntary disruptions
  Service, Deployment, PodDisruptionBudget <name>-prefill and <name>-decode
                                    instead of the three above with spec.prefill (disaggregated
                                    prefill and decode), the pods labelled llm-d.ai/role
  Service <name>, Deployment <name> the router: the OpenAI endpoint (`pagoda route`)
  ServiceAccount, Role, RoleBinding <name>-router
                                    the router's identity: read the EndpointSlices of this
                                    namespace, nothing else (its discovery of engine replicas)
  NetworkPolicy <name>-engine, <name>
                                    unless spec.networkPolicy is false: who may reach the engine
                                    pods (`render_network_policies`) and the router pods
  Ingress <name>                    when spec.router.ingress is set
  ServiceMonitor <name>             when spec.monitoring.serviceMonitor (Prometheus operator)
  ScaledObject / HorizontalPodAutoscaler <name>
                                    when spec.autoscaling.driver is keda / hpa (the autoscaler's)

Not rendered (it holds a random value, and rendering is pure): Secret <name>-internal-key, the
key the router presents to the engines, created once by the handler (`render_internal_key_secret`
builds it from the key it is given). Engines read it as PAGODA_API_KEY, the router as
PAGODA_BACKEND_API_KEY; spec.router.apiKeySecretRef's Secret, the clients' keys, is mounted into
the router at API_KEYS_DIR and passed as --api-key-file.

Every pod passes the Kubernetes "restricted" Pod Security Standard: it runs as the images' user
(RUN_AS_UID / RUN_AS_GID, also fsGroup), without privilege escalation, with every capability
dropped, under the runtime's default seccomp profile and on a read-only root filesystem
(`POD_SECURITY_CONTEXT`, `CONTAINER_SECURITY_CONTEXT`; `_restricted` applies the latter to every
container, init containers included). What the processes write goes to emptyDirs (WRITABLE_DIRS
lists them) and to the volumes of the spec's model and KV tiers.

The engine command-line contract used here (vLLM's flag names): --model --served-model-name
--dtype --max-model-len --load-format --quantization --kv-cache-dtype --tensor-parallel-size --pipeline-parallel-size
--data-parallel-size --enable-expert-parallel --max-num-seqs --max-num-batched-tokens
--gpu-memory-utilization --block-size --[no-]enable-prefix-caching --seed --api-server-count --device
--host --port --kv-transfer-config (spec.prefill) --enable-lora --lora-modules --max-loras
--max-lora-rank (spec.loras),
and for KV tiers (Pagoda's own) --kv-offload-cpu-gb (added to the pod's memory),
--kv-offload-disk-path (a volume mounted there) with --kv-offload-disk-gb, and
--kv-offload-remote-url (the password from a Secret in PAGODA_KV_REMOTE_PASSWORD).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from pagoda_operator import sizing
from pagoda_operator.autoscaler.scaledobjects import render_scaler, scaled_directly
from pagoda_operator.children import child_metadata, labels, selector_labels
from pagoda_operator.quantity import gib
from pagoda_operator.spec import (ROLE_LABEL, ROLES, InferenceServiceSpec, KVTier, desired_replicas, role_spec,
                                  shared_compile_cache_claim)

ENGINE_PORT = 8000
# spec.prefill: where a prefill pod's engine core r answers the decode pods' page pulls (the
# engine's default kv_port; core r on this + r). The pages themselves move over ports gloo or UCX
# pick at run time.
KV_TRANSFER_PORT = 14579
ENGINE_MASTER_PORT = 29501  # a LeaderWorkerSet leader's rendezvous port (vLLM's default --master-port)
ROUTER_PORT = 8000
# router.mode: gateway. The Endpoint Picker's gRPC port (ext_proc and health: GAIE's 9002) and
# where each engine publishes its KV events and answers replays (vLLM's 5557, and the next).
EPP_PORT = 9002
KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = 5558
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
# The picker's objective priorities: a ConfigMap of the pool's InferenceObjectives, mounted whole
# (kubelet swaps its files in place; `pagoda epp --objectives-file` re-reads them).
EPP_OBJECTIVES_DIR = "/etc/pagoda/objectives"
EPP_OBJECTIVES_KEY = "objectives.json"
HTTPROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
CONFIG_HASH_ANNOTATION = "pagoda.dev/config-hash"
MODELS_DIR = "/models"
DRAFTS_DIR = "/drafts"  # speculative decoding's drafting model (engine.speculative.model)
LORAS_DIR = "/loras"  # spec.loras: hf:// and s3:// adapters downloaded here, pvc:// claims mounted below
LORA_CLAIMS_DIR = "/lora-claims"  # spec.loras: each pvc:// adapter's claim, read-only, at /lora-claims/<claim>
LORA_RUNTIME_ENV = "PAGODA_ALLOW_RUNTIME_LORA_UPDATING"  # the engine's /v1/load_lora_adapter and unload
CONFIG_DIR = "/etc/pagoda"
KV_DISK_DIR = "/var/lib/pagoda/kv"  # --kv-offload-disk-path: the disk tier's volume is mounted here
KV_REMOTE_PASSWORD_ENV = "PAGODA_KV_REMOTE_PASSWORD"  # the remote tier's password, from spec's secretRef
# Engines run on a read-only root filesystem: the caches their libraries keep under $HOME by
# default go to an emptyDir at CACHE_DIR instead, named by these variables (one the spec's
# engine.env sets wins). The emptyDir outlives the container, so an engine that restarts in its pod
# (a crash, an OOM kill, a failed liveness probe) loads the kernels Triton and FlashInfer compiled
# at start-up (seconds of a cold start) instead of compiling them again.
CACHE_DIR = "/var/cache/pagoda"
CACHE_SIZE_LIMIT = "4Gi"
CACHE_ENV = (
    ("XDG_CACHE_HOME", CACHE_DIR),  # ~/.cache users: the Hugging Face hub (HF_HOME), torch hub
    ("PAGODA_CACHE_DIR", f"{CACHE_DIR}/pagoda"),  # the built-in tiny model, the GGUF tokenizers Pagoda builds
    ("TORCHINDUCTOR_CACHE_DIR", f"{CACHE_DIR}/torchinductor"),  # torch.compile's kernels
)
# With engine.compileCache.persistentVolumeClaim, Triton's cache moves to that claim, shared by every
# pod of the service; FlashInfer's JIT builds stay on the pod's emptyDir.
SHARED_COMPILE_CACHE_DIR = "/var/cache/pagoda-shared"
TMP_DIR = "/tmp"
ENGINE_TMP_SIZE_LIMIT = "1Gi"
ROUTER_TMP_SIZE_LIMIT = "64Mi"
# Every place a rendered container may write (the root filesystem is read-only), and who writes there.
WRITABLE_DIRS = {
    TMP_DIR: "emptyDir `tmp`, every container: Python's tempfile (the engine's core sockets and "
             "metrics files), nvcc's and Triton's scratch files, the download's temporary files",
    CACHE_DIR: "emptyDir `cache`, engine and endpoint-picker containers: XDG_CACHE_HOME (the Hugging Face hub), PAGODA_CACHE_DIR, "
               "TORCHINDUCTOR_CACHE_DIR; on GPUs also TRITON_CACHE_DIR, FLASHINFER_WORKSPACE_BASE, CUDA_CACHE_PATH",
    "/dev/shm": "memory emptyDir `shm`, engine containers: NCCL's and PyTorch's shared memory between processes",
    MODELS_DIR: "an hf:// model's `model-cache` (emptyDir, or the download's claim): written by the model-download "
                "init container, read-only to the engine (as a pvc:// model's `model`)",
    DRAFTS_DIR: "speculative decoding's drafting model: an hf:// or s3:// one's `draft-cache` emptyDir, written by the "
                "draft-download init container, read-only to the engine (a pvc:// one's `draft`)",
    LORAS_DIR: "spec.loras: hf:// and s3:// adapters' `lora-cache` emptyDir, written by the lora-download-<i> init "
               "containers, read-only to the engine (pvc:// adapters' claims: read-only at /lora-claims/<claim>)",
    KV_DISK_DIR: "the disk KV tier's volume `kv-disk`, when the spec has one",
    SHARED_COMPILE_CACHE_DIR: "engine.compileCache.persistentVolumeClaim's claim, when the spec names one",
}
# The images' user (images/*.Dockerfile: useradd --uid 10001); fsGroup makes the emptyDirs and
# claims writable by it.
RUN_AS_UID = 10001
RUN_AS_GID = 10001
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_UID,
    "runAsGroup": RUN_AS_GID,
    "fsGroup": RUN_AS_GID,
    # A model claim holds thousands of files: change their group only when the volume's root
    # is not the pods' already, not on every mount.
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# Keys (the contract with `pagoda serve` and `pagoda route`).
INTERNAL_KEY_SECRET_KEY = "api-key"
ENGINE_API_KEY_ENV = "PAGODA_API_KEY"
ROUTER_BACKEND_API_KEY_ENV = "PAGODA_BACKEND_API_KEY"
API_KEYS_DIR = "/etc/pagoda/api-keys"  # the router's client keys: spec.router.apiKeySecretRef's Secret
STARTUP_PROBE_PERIOD = 10
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_LABEL_PREFIX = "leaderworkerset.sigs.k8s.io"

RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"
# What `pagoda route --k8s-service` reads to discover the engine replicas: (apiGroup, resource,
# verbs). The operator grants it to each router's Role, so the operator's own RBAC must hold it
# too (the API server refuses to let anyone grant permissions they lack).
ROUTER_GRANT = ("discovery.k8s.io", "endpointslices", ("get", "list", "watch"))

# The kinds the renderer can emit (apiVersion, kind): RBAC and tests cover exactly these.
CHILD_KINDS = [
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    (RBAC_API_VERSION, "Role"),
    (RBAC_API_VERSION, "RoleBinding"),
    ("apps/v1", "Deployment"),
    (f"{LWS_GROUP}/v1", "LeaderWorkerSet"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "Ingress"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    # router.mode: gateway
    (INFERENCE_POOL_API_VERSION, "InferencePool"),
    (HTTPROUTE_API_VERSION, "HTTPRoute"),
    # spec.autoscaling.driver keda | hpa (rendered by pagoda_operator.autoscaler.scaledobjects)
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
]


@dataclass(frozen=True)
class Images:
    """Default images, set per installation (PAGODA_ENGINE_IMAGE, PAGODA_ENGINE_CPU_IMAGE)."""

    engine: str = "pagoda/engine:dev"
    engine_cpu: str = "pagoda/engine-cpu:dev"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Images":
        env = os.environ if env is None else env
        return cls(
            engine=env.get("PAGODA_ENGINE_IMAGE") or cls.engine,
            engine_cpu=env.get("PAGODA_ENGINE_CPU_IMAGE") or cls.engine_cpu,
        )


# Who may reach engine pods besides the service's own (`render_network_policies`). The operator's
# pods carry these labels in the Helm chart and kustomize (app.kubernetes.io/name is the chart's
# name); a future endpoint picker of the service is a pod of that component.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "pagoda", "app.kubernetes.io/component": "operator"}
ENDPOINT_PICKER_COMPONENT = "endpoint-picker"
# Kubernetes labels every namespace with its name (since 1.22).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
_LABEL_KEY = r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_LABEL_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"


def parse_label_selector(variable: str, text: str) -> dict[str, str]:
    """"k=v,k2=v2" → matchLabels; "" → {} (everything). Raises ValueError naming `variable`."""
    out: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = term.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not re.fullmatch(_LABEL_KEY, key) or not re.fullmatch(_LABEL_VALUE, value) or len(value) > 63:
            raise ValueError(f"{variable}: {term!r} is not a label equality such as app.kubernetes.io/name=prometheus "
                             f"(expected key=value[,key=value...])")
        out[key] = value
    return out


@dataclass(frozen=True)
class NetworkPeers:
    """Who, set per installation, may reach engine pods: the operator's namespace
    (PAGODA_OPERATOR_NAMESPACE, else POD_NAMESPACE, which the chart sets) and Prometheus's
    namespace and pods, as label selectors "k=v[,k=v]" (PAGODA_PROMETHEUS_NAMESPACE_SELECTOR,
    PAGODA_PROMETHEUS_POD_SELECTOR; empty: any). A cluster fact, not a service's: one setting for
    every InferenceService."""

    operator_namespace: str = "pagoda-system"
    prometheus_namespace_labels: tuple[tuple[str, str], ...] = ((NAMESPACE_NAME_LABEL, "monitoring"),)
    prometheus_pod_labels: tuple[tuple[str, str], ...] = (("app.kubernetes.io/name", "prometheus"),)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "NetworkPeers":
        """Raises ValueError naming the variable that holds no valid value."""
        env = os.environ if env is None else env
        namespace = env.get("PAGODA_OPERATOR_NAMESPACE") or env.get("POD_NAMESPACE") or cls.operator_namespace
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", namespace):
            raise ValueError(f"PAGODA_OPERATOR_NAMESPACE: {namespace!r} is not a namespace name")
        selectors = {}
        for variable, field in (("PAGODA_PROMETHEUS_NAMESPACE_SELECTOR", "prometheus_namespace_labels"),
                                ("PAGODA_PROMETHEUS_POD_SELECTOR", "prometheus_pod_labels")):
            if env.get(variable) is not None:
                selectors[field] = tuple(parse_label_selector(variable, env[variable]).items())
        return cls(operator_namespace=namespace, **selectors)


# --- names (labels and owner references: children.py) ---------------------------------------


def engine_name(name: str) -> str:
    return f"{name}-engine"


def router_account_name(name: str) -> str:
    """The router's ServiceAccount, and the Role and RoleBinding that give it its rights."""
    return f"{name}-router"


def epp_name(name: str) -> str:
    """The Endpoint Picker's Deployment, Service, account and objectives ConfigMap (router.mode: gateway)."""
    return f"{name}-epp"


def internal_key_secret_name(name: str) -> str:
    """The Secret holding the key the router presents to the engines (made by the handler)."""
    return f"{name}-internal-key"


def role_name(name: str, role: str) -> str:
    """spec.prefill: one role's Deployment, Service and PodDisruptionBudget."""
    return f"{name}-{role}"


def engine_selector_labels(name: str, role: str | None = None) -> dict[str, str]:
    """The engine pods, or with `role` (spec.prefill) that role's."""
    return {**selector_labels(name, "engine"), **({ROLE_LABEL: role} if role else {})}


def engine_selector(name: str, role: str | None = None) -> str:
    """status.selector: the engine pods (spec.prefill: the decode pods, which spec.replicas counts),
    as a label selector string (scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(engine_selector_labels(name, role).items()))


def service_url(name: str, namespace: str, spec: InferenceServiceSpec) -> str:
    ingress = spec.router.ingress
    if ingress is not None and ingress.host:
        return f"{'https' if ingress.tls else 'http'}://{ingress.host}"
    return f"http://{name}.{namespace}.svc:{ROUTER_PORT}"


# --- engine -----------------------------------------------------------------------------------


# The engine's `--model` name for its built-in tiny model (pagoda_engine.model_path.TINY_MODEL_NAME;
# the operator cannot import the engine). Without --model the engine would serve its default model.
BUILTIN_TINY_MODEL = "pagoda-tiny"


def model_path(spec: InferenceServiceSpec) -> str | None:
    """The engine's --model: where it finds the weights inside its container, or the built-in tiny
    model's name (None: neither, which validation refuses)."""
    uri = spec.model.uri
    if uri is None:
        return BUILTIN_TINY_MODEL if spec.model.builtin_tiny else None
    return _container_path(uri, MODELS_DIR)


def draft_model_uri(spec: InferenceServiceSpec) -> str | None:
    """Speculative decoding's drafting model (engine.speculative.model), or None."""
    return spec.engine.speculative.model if spec.engine.speculative is not None else None


def draft_model_path(spec: InferenceServiceSpec) -> str | None:
    """Where the engine finds speculative decoding's drafting model (None: there is none)."""
    uri = draft_model_uri(spec)
    return _container_path(uri, DRAFTS_DIR) if uri is not None else None


def lora_mount(uri: str) -> str:
    """Where the volume of a spec.loras adapter named by `uri` is mounted: the shared download
    cache for hf:// and s3://, its claim's own mount for pvc://."""
    if uri.startswith("pvc://"):
        return f"{LORA_CLAIMS_DIR}/{uri[len('pvc://'):].split('/', 1)[0]}"
    return LORAS_DIR


def lora_path(uri: str) -> str:
    """Where the engine finds a spec.loras adapter."""
    return _container_path(uri, lora_mount(uri))


def _lora_claims(spec: InferenceServiceSpec) -> list[str]:
    return sorted({a.uri[len("pvc://"):].split("/", 1)[0] for a in spec.loras if a.uri.startswith("pvc://")})


def _container_path(uri: str, mount: str) -> str:
    """Where a model named by `uri` lies in the engine container, its volume mounted at `mount`."""
    scheme, rest = uri.split("://", 1)
    if scheme == "hf":
        return f"{mount}/{rest.split('@', 1)[0]}"
    if scheme == "s3":
        return f"{mount}/{rest.strip('/')}"  # bucket/prefix, where the init container puts it
    if scheme == "pvc":
        _, _, path = rest.partition("/")
        return f"{mount}/{path}".rstrip("/") if path else mount
    return "/" + rest.lstrip("/")  # file:///path: a path in the image or on the node, as is


def _format_gb(num_gib: float) -> str:
    return f"{num_gib:g}"


def engine_args(name: str, spec: InferenceServiceSpec, *, headless: bool = False, pd_role: str | None = None) -> list[str]:
    """`pagoda serve` flags for this spec, in a fixed order; `headless`: a LeaderWorkerSet
    worker's, which serves no API; `pd_role`: a disaggregated service's prefill or decode pod's."""
    m, e, t = spec.model, spec.engine, spec.topology
    args = ["--host", "0.0.0.0", "--port", str(ENGINE_PORT)]
    path = model_path(spec)
    if path is not None:
        args += ["--model", path]
    args += ["--served-model-name", m.name or name]
    if m.dtype != "auto":
        args += ["--dtype", m.dtype]
    if m.max_model_len is not None:
        args += ["--max-model-len", str(m.max_model_len)]
    if m.load_format != "auto":
        args += ["--load-format", m.load_format]
    if m.quantization is not None:
        args += ["--quantization", m.quantization]
    if e.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", e.kv_cache_dtype]
    args += ["--tensor-parallel-size", str(t.tensor), "--pipeline-parallel-size", str(t.pipeline)]
    if t.data > 1:
        args += ["--data-parallel-size", str(t.data)]
    if t.expert:
        args += ["--enable-expert-parallel"]
    if e.max_num_seqs is not None:
        args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{e.gpu_memory_utilization:g}"]
    args += ["--block-size", str(spec.kv_cache.page_size)]
    args += ["--enable-prefix-caching" if e.prefix_caching else "--no-enable-prefix-caching"]
    if e.seed is not None:
        args += ["--seed", str(e.seed)]
    if e.api_server_count > 1 and not headless:  # --headless runs no API server and refuses a count above 1
        args += ["--api-server-count", str(e.api_server_count)]
    if e.speculative is not None:
        args += ["--speculative-config", json.dumps(e.speculative.config(draft_model_path(spec)), sort_keys=True)]
    if not headless:
        args += ["--drain-timeout", str(sizing.engine_shutdown(spec)[1])]
    if sizing.gpus_per_pod(spec) == 0:
        args += ["--device", "cpu"]
    for tier in spec.kv_cache.tiers:
        if tier.type == "cpu":
            args += ["--kv-offload-cpu-gb", _format_gb(gib(tier.size))]
        elif tier.type == "disk":
            args += ["--kv-offload-disk-path", KV_DISK_DIR, "--kv-offload-disk-gb", _format_gb(gib(tier.size))]
        elif tier.type == "remote":
            args += ["--kv-offload-remote-url", tier.url]
    if spec.loras:
        args += ["--enable-lora"]
        if e.max_loras is not None:
            args += ["--max-loras", str(e.max_loras)]
        if e.max_lora_rank is not None:
            args += ["--max-lora-rank", str(e.max_lora_rank)]
        # Downloaded adapters only: the pods fetch them at start, so they belong to the template. The
        # others (pvc://, file://) the operator loads into each ready pod at run time (`loras.py`),
        # so adding or removing one restarts nothing.
        started = [a for a in spec.loras if a.uri.startswith(DOWNLOADED_SCHEMES)]
        if started:
            args += ["--lora-modules", *(f"{a.name}={lora_path(a.uri)}" for a in started)]
    if publishes_kv_events(spec):
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
                  "replay_endpoint": f"tcp://*:{KV_EVENTS_REPLAY_PORT}"}
        args += ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
    if pd_role is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config(pd_role), separators=(",", ":"))]
    return args + list(e.extra_args)


def kv_transfer_config(pd_role: str) -> dict[str, Any]:
    """The engine's --kv-transfer-config of a prefill or decode pod. A prefill pod announces its own
    address (POD_IP, from the downward API, expanded by the kubelet) in the params the decode pod
    pulls from; a decode pod only pulls, so it needs no address of its own."""
    if pd_role == "prefill":
        return {"kv_role": "kv_producer", "kv_ip": "$(POD_IP)", "kv_port": KV_TRANSFER_PORT}
    return {"kv_role": "kv_consumer"}


def publishes_kv_events(spec: InferenceServiceSpec) -> bool:
    """router.mode: gateway's engines publish their prefix caches for the Endpoint Picker, where
    the events can say it all: the prefix cache on (with offload tiers too: their pages are
    reported under their own media, and those loaded back as the device's), one engine core per
    pod (a second core would publish on the next port, which the picker does not follow)."""
    return spec.router.mode == "gateway" and spec.engine.prefix_caching and spec.topology.data == 1


def epp_model(spec: InferenceServiceSpec) -> str | None:
    """The model whose tokenizer the Endpoint Picker loads to cut requests into pages, where its
    pod has it without the engine's download or volumes: the built-in tiny model. None otherwise
    (hf://, s3://, pvc://, and file://, whose path is in the engine's image, not the picker's):
    then it ranks by load alone, until it fetches the tokenizer files itself."""
    return BUILTIN_TINY_MODEL if spec.model.builtin_tiny else None


def engine_config(name: str, spec: InferenceServiceSpec, images: Images, pd_role: str | None = None) -> dict[str, str]:
    """ConfigMap data: the engine's resolved configuration, for review and as the rollout hash
    (spec.prefill: one key per role, each role's pods hashing their own)."""
    if pd_role is None and spec.prefill is not None:
        return {k: v for role in ROLES for k, v in engine_config(name, role_spec(spec, role), images, role).items()}
    config = {
        "args": engine_args(name, spec, pd_role=pd_role),
        "image": engine_image(spec, images),
        "gpusPerPod": sizing.gpus_per_pod(spec),
        "topology": {"tensor": spec.topology.tensor, "pipeline": spec.topology.pipeline,
                     "data": spec.topology.data, "expert": spec.topology.expert, "nodes": spec.topology.nodes},
        "kvTiers": [{"type": t.type, "size": t.size, "url": t.url} for t in spec.kv_cache.tiers],
    }
    return {f"{pd_role or 'engine'}.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}


def config_hash(data: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def engine_image(spec: InferenceServiceSpec, images: Images) -> str:
    if spec.engine.image:
        return spec.engine.image
    return images.engine if sizing.gpus_per_pod(spec) else images.engine_cpu


def _probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def engine_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": sizing.pod_cpu(spec), "memory": sizing.pod_memory(spec)}
    limits: dict[str, Any] = {"memory": sizing.pod_memory(spec)}
    gpus = sizing.gpus_per_pod(spec)
    if gpus:
        # Extended resources are requested through limits (requests must equal them).
        requests[spec.resources.gpu_resource] = str(gpus)
        limits[spec.resources.gpu_resource] = str(gpus)
    return {"requests": requests, "limits": limits}


def _engine_volumes(name: str, spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, the engine container's mounts)."""
    volumes = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": sizing.shm_size(spec)}},
        {"name": "config", "configMap": {"name": engine_name(name)}},
    ]
    mounts = [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    uri = spec.model.uri or ""
    if uri.startswith(DOWNLOADED_SCHEMES):
        dl = spec.model.download
        source = (
            {"persistentVolumeClaim": {"claimName": dl.cache_claim_name}}
            if dl.cache_claim_name
            else {"emptyDir": {"sizeLimit": str(dl.cache_size_limit)} if dl.cache_size_limit else {}}
        )
        volumes.append({"name": "model-cache", **source})
        mounts.append({"name": "model-cache", "mountPath": MODELS_DIR, "readOnly": True})
    elif uri.startswith("pvc://"):
        claim = uri[len("pvc://"):].split("/", 1)[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
    draft = draft_model_uri(spec)
    if draft is not None and draft.startswith(DOWNLOADED_SCHEMES):
        volumes.append({"name": "draft-cache", "emptyDir": {}})
        mounts.append({"name": "draft-cache", "mountPath": DRAFTS_DIR, "readOnly": True})
    elif draft is not None and draft.startswith("pvc://"):
        claim = draft[len("pvc://"):].split("/", 1)[0]
        volumes.append({"name": "draft", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "draft", "mountPath": DRAFTS_DIR, "readOnly": True})
    if any(a.uri.startswith(DOWNLOADED_SCHEMES) for a in spec.loras):
        volumes.append({"name": "lora-cache", "emptyDir": {}})
        mounts.append({"name": "lora-cache", "mountPath": LORAS_DIR, "readOnly": True})
    for claim in _lora_claims(spec):
        volumes.append({"name": f"lora-pvc-{claim}"[:63], "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"lora-pvc-{claim}"[:63], "mountPath": lora_mount(f"pvc://{claim}"), "readOnly": True})
    for tier in spec.kv_cache.tiers:
        if tier.type == "disk":
            volumes.append({"name": "kv-disk", **_kv_disk_source(tier)})
            mounts.append({"name": "kv-disk", "mountPath": KV_DISK_DIR})
    # The root filesystem is read-only: the caches (`_cache_env`) and temporary files go here.
    volumes += [{"name": "cache", "emptyDir": {"sizeLimit": CACHE_SIZE_LIMIT}}, _tmp_volume(ENGINE_TMP_SIZE_LIMIT)]
    mounts.append({"name": "cache", "mountPath": CACHE_DIR})
    claim = shared_compile_cache_claim(spec)
    if claim is not None and sizing.gpus_per_pod(spec):
        volumes.append({"name": "compile-cache-shared", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": "compile-cache-shared", "mountPath": SHARED_COMPILE_CACHE_DIR})
    return volumes, mounts


def _tmp_volume(size_limit: str) -> dict[str, Any]:
    """The emptyDir every container of the pod mounts at TMP_DIR (`_restricted`)."""
    return {"name": "tmp", "emptyDir": {"sizeLimit": size_limit}}


def _restricted(container: dict[str, Any]) -> dict[str, Any]:
    """Every container the renderer emits goes through here: the "restricted" Pod Security
    Standard's settings (with POD_SECURITY_CONTEXT on its pod), and the pod's `tmp` emptyDir at
    TMP_DIR, the one place a process may expect to write on a read-only root filesystem."""
    mounts = container.get("volumeMounts", [])
    if not any(m["mountPath"] == TMP_DIR for m in mounts):
        mounts = [*mounts, {"name": "tmp", "mountPath": TMP_DIR}]
    return {**container, "volumeMounts": mounts, "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT)}


def _kv_disk_source(tier: KVTier) -> dict[str, Any]:
    """The disk tier's volume source: an existing claim, a claim per pod (generic ephemeral
    volume), or by default an emptyDir; the latter two sized with headroom over the tier."""
    volume = tier.volume
    if volume is not None and volume.persistent_volume_claim is not None:
        return {"persistentVolumeClaim": {"claimName": volume.persistent_volume_claim.claim_name}}
    size = sizing.disk_tier_volume_size(tier.size)
    if volume is not None and volume.ephemeral is not None:
        claim_spec: dict[str, Any] = {"accessModes": list(volume.ephemeral.access_modes),
                                      "resources": {"requests": {"storage": size}}}
        if volume.ephemeral.storage_class_name:
            claim_spec["storageClassName"] = volume.ephemeral.storage_class_name
        return {"ephemeral": {"volumeClaimTemplate": {"spec": claim_spec}}}
    return {"emptyDir": {"sizeLimit": size}}


# Models an init container downloads into the model-cache volume (`_download_container`).
DOWNLOADED_SCHEMES = ("hf://", "s3://")

DOWNLOAD_SCRIPT = """\
attempt=0
until timeout "$DOWNLOAD_TIMEOUT_SECONDS" hf download "$MODEL_REPO" --revision "$MODEL_REVISION" --local-dir "$MODEL_DIR"; do
  attempt=$((attempt + 1))
  if [ "$attempt" -gt "$DOWNLOAD_RETRIES" ]; then
    echo "pagoda: downloading $MODEL_REPO failed $attempt times; giving up" >&2
    exit 1
  fi
  echo "pagoda: download attempt $attempt of $MODEL_REPO failed; retrying in $((attempt * 15))s" >&2
  sleep $((attempt * 15))
done
"""


# The keys of model.download.s3SecretRef, each the environment variable of that name: the two
# credentials are required, the rest optional (`pagoda_engine.s3_download` reads them through boto3).
S3_SECRET_KEYS = {"AWS_ACCESS_KEY_ID": False, "AWS_SECRET_ACCESS_KEY": False, "AWS_SESSION_TOKEN": True,
                  "AWS_ENDPOINT_URL": True, "AWS_REGION": True}


def _download_container(spec: InferenceServiceSpec, image: str, draft: bool = False,
                        lora: int | None = None) -> dict[str, Any]:
    """Init container fetching an hf:// or s3:// model (with `draft`, speculative decoding's
    drafting model; with `lora`, spec.loras[lora]) into its cache volume; files already there are
    kept, so a restart resumes instead of starting over."""
    if lora is not None:
        uri, mount, volume, name = spec.loras[lora].uri, LORAS_DIR, "lora-cache", f"lora-download-{lora}"
    elif draft:
        uri, mount, volume, name = spec.engine.speculative.model, DRAFTS_DIR, "draft-cache", "draft-download"
    else:
        uri, mount, volume, name = spec.model.uri, MODELS_DIR, "model-cache", "model-download"
    dl = spec.model.download
    container: dict[str, Any] = {"name": name, "image": image}
    if uri.startswith("s3://"):
        container["command"] = ["python", "-m", "pagoda_engine.s3_download", uri, _container_path(uri, mount),
                                "--retries", str(dl.retries), "--attempt-timeout", str(dl.timeout_seconds)]
        if dl.s3_secret_ref is not None:  # else boto3 finds the pod's service-account role
            container["env"] = [{"name": key, "valueFrom": {"secretKeyRef": {
                "name": dl.s3_secret_ref.name, "key": key, **({"optional": True} if optional else {})}}}
                for key, optional in S3_SECRET_KEYS.items()]
    else:
        repo, _, revision = uri[len("hf://"):].partition("@")
        env = [
            {"name": "MODEL_REPO", "value": repo},
            {"name": "MODEL_REVISION", "value": revision or "main"},
            {"name": "MODEL_DIR", "value": f"{mount}/{repo}"},
            {"name": "DOWNLOAD_TIMEOUT_SECONDS", "value": str(dl.timeout_seconds)},
            {"name": "DOWNLOAD_RETRIES", "value": str(dl.retries)},
            {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
            # The root filesystem is read-only: the hub's own files (its Xet chunk cache) go to /tmp.
            {"name": "HF_HOME", "value": f"{TMP_DIR}/huggingface"},
        ]
        if dl.token_secret_ref is not None:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": dl.token_secret_ref.name, "key": dl.token_secret_ref.key}}})
        container.update({"command": ["sh", "-c", DOWNLOAD_SCRIPT], "env": env})
    # The downloader's last line says why it failed (refused credentials, no such bucket or repo):
    # the pod's status shows it as the init container's termination message, and the operator
    # copies it into the Ready condition (conditions.model_download_failure).
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    container["resources"] = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
    container["volumeMounts"] = [{"name": volume, "mountPath": mount}]
    if spec.engine.image_pull_policy:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    return container


def _engine_env(name: str, namespace: str, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    if spec.topology.nodes > 1:
        # The LWS controller injects these too, only where absent; spelling them out makes the
        # pod's contract visible. $(VAR) expansion needs LWS_GROUP_INDEX defined first.
        lws = engine_name(name)
        env += [
            {"name": "LWS_GROUP_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LWS_LABEL_PREFIX}/group-index']"}}},
            {"name": "LWS_WORKER_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LWS_LABEL_PREFIX}/worker-index']"}}},
            {"name": "LWS_GROUP_SIZE", "value": str(spec.topology.nodes)},
            {"name": "LWS_LEADER_ADDRESS", "value": f"{lws}-$(LWS_GROUP_INDEX).{lws}.{namespace}"},
        ]
    for tier in spec.kv_cache.tiers:
        if tier.type == "remote" and tier.secret_ref is not None:
            env.append({"name": KV_REMOTE_PASSWORD_ENV, "valueFrom": {"secretKeyRef": {
                "name": tier.secret_ref.name, "key": tier.secret_ref.key}}})
    if spec.loras:
        # Adapters loaded and unloaded at run time (the engine's /v1/load_lora_adapter).
        env.append({"name": LORA_RUNTIME_ENV, "value": "1"})
    # The router's key to the engines (`pagoda serve` reads it when --api-key is not given).
    env.append({"name": ENGINE_API_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": internal_key_secret_name(name), "key": INTERNAL_KEY_SECRET_KEY}}})
    user = [dict(v) for v in spec.engine.env]
    # The cache volume (`_engine_volumes`), unless the user placed a cache elsewhere.
    env += [{"name": k, "value": v} for k, v in _cache_env(spec) if k not in {e.get("name") for e in user}]
    return env + user


def _cache_env(spec: InferenceServiceSpec) -> tuple[tuple[str, str], ...]:
    """Where the engine's libraries keep their caches, all on the volumes `_engine_volumes` mounts:
    CACHE_ENV, and on GPUs Triton's and FlashInfer's compiled kernels and the CUDA driver's JIT
    cache of PTX kernels."""
    if not sizing.gpus_per_pod(spec):
        return CACHE_ENV
    shared = shared_compile_cache_claim(spec) is not None
    return CACHE_ENV + (
        ("TRITON_CACHE_DIR", f"{SHARED_COMPILE_CACHE_DIR if shared else CACHE_DIR}/triton"),
        ("FLASHINFER_WORKSPACE_BASE", f"{CACHE_DIR}/flashinfer"),
        ("CUDA_CACHE_PATH", f"{CACHE_DIR}/nv"),
    )


def _tolerations(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    tolerations = [dict(t) for t in spec.resources.tolerations]
    gpu = spec.resources.gpu_resource
    if sizing.gpus_per_pod(spec) and not any(t.get("key") == gpu for t in tolerations):
        # GPU node pools are commonly tainted with the GPU resource name (GKE, AKS, EKS guides).
        tolerations.append({"key": gpu, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def _node_args(role: str) -> list[str]:
    """A LeaderWorkerSet pod's place in its group, as `pagoda serve` takes it (vLLM's flags): the
    same command on every pod, from the LWS environment (`_engine_env`); workers run headless."""
    if role not in ("leader", "worker"):
        return []
    args = ["--nnodes", "$(LWS_GROUP_SIZE)", "--node-rank", "$(LWS_WORKER_INDEX)",
            "--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", str(ENGINE_MASTER_PORT)]
    return args + ["--headless"] if role == "worker" else args


def engine_pod_template(body: dict[str, Any], spec: InferenceServiceSpec, images: Images, *, role: str = "engine",
                        pd_role: str | None = None) -> dict[str, Any]:
    """The engine pod; role "leader"/"worker" for LeaderWorkerSet groups (workers serve no HTTP,
    so they carry no probes); `pd_role`: a disaggregated service's prefill or decode pod, from
    that role's spec (`role_spec`)."""
    name = body["metadata"]["name"]
    namespace = body["metadata"].get("namespace") or "default"
    image = engine_image(spec, images)
    volumes, mounts = _engine_volumes(name, spec)
    container: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "command": ["pagoda", "serve"],
        "args": engine_args(name, spec, headless=role == "worker", pd_role=pd_role) + _node_args(role),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": engine_resources(spec),
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(sizing.engine_shutdown(spec)[0])]}}},
    }
    if spec.engine.image_pull_policy:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    env = _engine_env(name, namespace, spec)
    if pd_role == "prefill":
        # The handshake port of each engine core (kv_port + r), where the decode pods connect.
        container["ports"] += [{"name": f"kv-transfer-{r}" if r else "kv-transfer", "containerPort": KV_TRANSFER_PORT + r,
                                "protocol": "TCP"} for r in range(spec.topology.data)]
        env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}, *env]
    if env:
        container["env"] = env
    if role != "worker":
        budget = sizing.startup_budget_seconds(spec)
        container["startupProbe"] = _probe("/health", STARTUP_PROBE_PERIOD, math.ceil(budget / STARTUP_PROBE_PERIOD), 5)
        container["readinessProbe"] = _probe("/health", 5, 3, 5)
        container["livenessProbe"] = _probe("/health", 15, 4, 10)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "terminationGracePeriodSeconds": spec.engine.termination_grace_period_seconds,
        "containers": [container],
        "volumes": volumes,
    }
    if (spec.model.uri or "").startswith(DOWNLOADED_SCHEMES):
        pod_spec["initContainers"] = [_download_container(spec, image)]
    if (draft_model_uri(spec) or "").startswith(DOWNLOADED_SCHEMES):
        pod_spec.setdefault("initContainers", []).append(_download_container(spec, image, draft=True))
    for i, adapter in enumerate(spec.loras):
        if adapter.uri.startswith(DOWNLOADED_SCHEMES):
            pod_spec.setdefault("initContainers", []).append(_download_container(spec, image, lora=i))
    for key in ("initContainers", "containers"):
        if key in pod_spec:
            pod_spec[key] = [_restricted(c) for c in pod_spec[key]]
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    tolerations = _tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    pod_labels = labels(name, "engine")
    if role in ("leader", "worker"):
        pod_labels["pagoda.dev/role"] = role
    if pd_role is not None:
        pod_labels[ROLE_LABEL] = pd_role
    return {
        "metadata": {
            "labels": pod_labels,
            "annotations": {CONFIG_HASH_ANNOTATION: config_hash(engine_config(name, spec, images, pd_role))},
        },
        "spec": pod_spec,
    }


def render_engine_configmap(body: dict[str, Any], spec: InferenceServiceSpec, images: Images) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(body, engine_name(name), "engine"),
        "data": engine_config(name, spec, images),
    }


def render_engine_service(body: dict[str, Any], spec: InferenceServiceSpec, pd_role: str | None = None) -> dict[str, Any]:
    """Headless: the router discovers the replicas through its EndpointSlices (spec.prefill: one
    Service per role, `--prefill-k8s-service` and `--decode-k8s-service`)."""
    name = body["metadata"]["name"]
    selector = engine_selector_labels(name, pd_role)
    service_spec: dict[str, Any] = {
        "clusterIP": "None",
        "selector": selector,
        "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
    }
    if spec.topology.nodes > 1:
        # Leaders only (workers serve no HTTP). LWS uses this Service as its pods' subdomain, and
        # workers must resolve the leader's name before it is ready.
        selector[f"{LWS_LABEL_PREFIX}/worker-index"] = "0"
        service_spec["publishNotReadyAddresses"] = True
    service_name = role_name(name, pd_role) if pd_role else engine_name(name)
    return {"apiVersion": "v1", "kind": "Service", "metadata": child_metadata(body, service_name, "engine"), "spec": service_spec}


def _rollout_bounds(spec: InferenceServiceSpec) -> dict[str, int]:
    # No request is lost either way: a leaving pod drains, and the router continues on another
    # replica the streams its drain deadline ends. A surge keeps every replica serving until its
    # successor is ready, so the load's time to first token holds; in place (for clusters with no
    # room for one more GPU pod) the other replicas carry the whole load meanwhile.
    return {"maxSurge": 0, "maxUnavailable": 1} if spec.engine.rollout == "in-place" else {"maxSurge": 1, "maxUnavailable": 0}


def render_engine_deployment(body: dict[str, Any], spec: InferenceServiceSpec, images: Images,
                             pd_role: str | None = None) -> dict[str, Any]:
    """The engine pods (`pd_role`: one role's, from `role_spec`; the two Deployments' selectors
    differ in the role label, so neither adopts the other's pods)."""
    name = body["metadata"]["name"]
    metadata = child_metadata(body, role_name(name, pd_role) if pd_role else engine_name(name), "engine")
    if pd_role is not None:
        metadata["labels"][ROLE_LABEL] = pd_role
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": desired_replicas(spec),
            "selector": {"matchLabels": engine_selector_labels(name, pd_role)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": _rollout_bounds(spec)},
            # Loading a large model is slow; a rollout is not stuck until its pods had their budget.
            "progressDeadlineSeconds": sizing.startup_budget_seconds(spec) + 600,
            "template": engine_pod_template(body, spec, images, pd_role=pd_role),
        },
    }


def render_role_deployment(body: dict[str, Any], spec: InferenceServiceSpec, images: Images, role: str) -> dict[str, Any]:
    """spec.prefill: one role's Deployment. Its replicas are left out when a KEDA or HPA scaler
    sets them on the Deployment itself (`scaled_directly`), so the operator's apply never takes
    them back from it."""
    deployment = render_engine_deployment(body, role_spec(spec, role), images, role)
    if scaled_directly(spec, role):
        del deployment["spec"]["replicas"]
    return deployment


def render_engine_leaderworkerset(body: dict[str, Any], spec: InferenceServiceSpec, images: Images) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": f"{LWS_GROUP}/v1",
        "kind": "LeaderWorkerSet",
        "metadata": child_metadata(body, engine_name(name), "engine"),
        "spec": {
            "replicas": desired_replicas(spec),
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": _rollout_bounds(spec)},
            "leaderWorkerTemplate": {
                "size": spec.topology.nodes,
                # One lost pod breaks the replica's collectives: restart the whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": engine_pod_template(body, spec, images, role="leader"),
                "workerTemplate": engine_pod_template(body, spec, images, role="worker"),
            },
        },
    }


def render_engine_pdb(body: dict[str, Any], pd_role: str | None = None) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(body, role_name(name, pd_role) if pd_role else engine_name(name), "engine"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": engine_selector_labels(name, pd_role)}},
    }


# --- router -----------------------------------------------------------------------------------


def router_args(body: dict[str, Any], spec: InferenceServiceSpec) -> list[str]:
    meta = body["metadata"]
    namespace = meta.get("namespace") or "default"
    if spec.prefill is not None:
        engines = ["--prefill-k8s-service", f"{namespace}/{role_name(meta['name'], 'prefill')}",
                   "--decode-k8s-service", f"{namespace}/{role_name(meta['name'], 'decode')}"]
    else:
        engines = ["--k8s-service", f"{namespace}/{engine_name(meta['name'])}"]
    args = [*engines, "--policy", spec.router.policy, "--port", str(ROUTER_PORT)]
    if spec.router.api_key_secret_ref is not None:
        args += ["--api-key-file", API_KEYS_DIR]
    return args


def render_router_deployment(body: dict[str, Any], spec: InferenceServiceSpec, images: Images) -> dict[str, Any]:
    name = body["metadata"]["name"]
    volumes = [_tmp_volume(ROUTER_TMP_SIZE_LIMIT)]
    container = {
        "name": "router",
        "image": spec.router.image or images.engine_cpu,
        "command": ["pagoda", "route"],
        "args": router_args(body, spec),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        # The key it presents to the engines, on its polls and on every request it forwards.
        "env": [{"name": ROUTER_BACKEND_API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": internal_key_secret_name(name), "key": INTERNAL_KEY_SECRET_KEY}}}],
        "readinessProbe": _probe("/health", 5, 3, 5),
        "livenessProbe": _probe("/health", 15, 4, 10),
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
    }
    keys = spec.router.api_key_secret_ref
    if keys is not None:
        # Mounted whole, not through subPath: kubelet swaps the files of a rotated Secret in
        # place, and the router re-reads them without a restart.
        volumes.append({"name": "api-keys", "secret": {"secretName": keys.name}})
        container["volumeMounts"] = [{"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(body, name, "router"),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector_labels(name, "router")},
            "template": {
                "metadata": {"labels": labels(name, "router")},
                "spec": {
                    "serviceAccountName": router_account_name(name),
                    "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
                    "terminationGracePeriodSeconds": 30,
                    "containers": [_restricted(container)],
                    "volumes": volumes,
                },
            },
        },
    }


def render_router_rbac(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The router's own ServiceAccount, Role and RoleBinding, per InferenceService: least
    privilege (its namespace's EndpointSlices, read-only), and no install-time setup per namespace."""
    name = body["metadata"]["name"]
    account = router_account_name(name)
    group, resource, verbs = ROUTER_GRANT
    # Fresh metadata per object: shared dicts would come out as YAML anchors in `render`.
    role_binding_meta = child_metadata(body, account, "router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": child_metadata(body, account, "router")},
        {"apiVersion": RBAC_API_VERSION, "kind": "Role", "metadata": child_metadata(body, account, "router"),
         "rules": [{"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}]},
        {
            "apiVersion": RBAC_API_VERSION,
            "kind": "RoleBinding",
            "metadata": role_binding_meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": role_binding_meta["namespace"]}],
        },
    ]


def render_router_service(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(body, name, "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, "router"),
            "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_ingress(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = body["metadata"]["name"]
    ingress = spec.router.ingress
    meta = child_metadata(body, name, "router")
    if ingress.annotations:
        meta["annotations"] = dict(ingress.annotations)
    rule: dict[str, Any] = {"http": {"paths": [{
        "path": "/",
        "pathType": "Prefix",
        "backend": {"service": {"name": name, "port": {"name": "http"}}},
    }]}}
    if ingress.host:
        rule = {"host": ingress.host, **rule}
    ingress_spec: dict[str, Any] = {"rules": [rule]}
    if ingress.class_name:
        ingress_spec = {"ingressClassName": ingress.class_name, **ingress_spec}
    if ingress.tls is not None:
        ingress_spec["tls"] = [{"hosts": [ingress.host], "secretName": ingress.tls.secret_name}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": meta, "spec": ingress_spec}


# --- router.mode: gateway (the Gateway API inference extension) ------------------------------


def epp_args(body: dict[str, Any], spec: InferenceServiceSpec) -> list[str]:
    namespace = body["metadata"].get("namespace") or "default"
    args = ["--k8s-service", f"{namespace}/{engine_name(body['metadata']['name'])}", "--port", str(EPP_PORT)]
    model = epp_model(spec)
    if publishes_kv_events(spec) and model is not None:
        args += ["--model", model, "--kv-events-port", str(KV_EVENTS_PORT),
                 "--kv-events-replay-port", str(KV_EVENTS_REPLAY_PORT)]
    args += ["--objectives-file", f"{EPP_OBJECTIVES_DIR}/{EPP_OBJECTIVES_KEY}"]
    queue = spec.router.gateway.flow_control_queue if spec.router.gateway is not None else 0
    if queue:
        args += ["--flow-control-queue", str(queue)]
    return args


def render_epp_objectives(body: dict[str, Any], objectives: dict[str, int]) -> dict[str, Any]:
    """The priorities of the InferenceObjectives whose poolRef is this service's pool
    (`objectives.pool_objectives`), as the picker's --objectives-file reads them."""
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(body, epp_name(name), ENDPOINT_PICKER_COMPONENT),
        "data": {EPP_OBJECTIVES_KEY: json.dumps(dict(sorted(objectives.items())), separators=(",", ":"))},
    }


def render_epp_deployment(body: dict[str, Any], spec: InferenceServiceSpec, images: Images) -> dict[str, Any]:
    name = body["metadata"]["name"]
    epp = epp_name(name)
    probe = {"periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 3}
    container = {
        "name": "epp",
        "image": spec.router.image or images.engine_cpu,
        "command": ["pagoda", "epp"],
        "args": epp_args(body, spec),
        "ports": [{"name": "grpc", "containerPort": EPP_PORT, "protocol": "TCP"}],
        # The engines' key: on its polls, and set on every request it routes (the gateway has none).
        "env": [{"name": ROUTER_BACKEND_API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": internal_key_secret_name(name), "key": INTERNAL_KEY_SECRET_KEY}}},
                # Where the tokenizer files it loads are kept (the built-in tiny model is built there).
                *({"name": k, "value": v} for k, v in CACHE_ENV[:2])],
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR},
                         {"name": "objectives", "mountPath": EPP_OBJECTIVES_DIR, "readOnly": True}],
        "readinessProbe": {"grpc": {"port": EPP_PORT, "service": "readiness"}, **probe},
        "livenessProbe": {"grpc": {"port": EPP_PORT, "service": "liveness"}, **probe, "periodSeconds": 15},
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(body, epp, ENDPOINT_PICKER_COMPONENT),
        "spec": {
            # One: each picker counts the requests it sent until they end, and two would not see each other's.
            "replicas": 1,
            "selector": {"matchLabels": selector_labels(name, ENDPOINT_PICKER_COMPONENT)},
            "template": {
                "metadata": {"labels": labels(name, ENDPOINT_PICKER_COMPONENT)},
                "spec": {
                    "serviceAccountName": epp,
                    "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
                    "terminationGracePeriodSeconds": 30,
                    "containers": [_restricted(container)],
                    "volumes": [_tmp_volume(ROUTER_TMP_SIZE_LIMIT), {"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}},
                                {"name": "objectives", "configMap": {"name": epp}}],
                },
            },
        },
    }


def render_epp_service(body: dict[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(body, epp_name(name), ENDPOINT_PICKER_COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, ENDPOINT_PICKER_COMPONENT),
            "ports": [{"name": "grpc", "port": EPP_PORT, "targetPort": "grpc", "protocol": "TCP",
                       "appProtocol": "kubernetes.io/h2c"}],
        },
    }


def render_epp_rbac(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The picker's own account: the router's grant (its namespace's EndpointSlices, read-only)."""
    account = epp_name(body["metadata"]["name"])
    group, resource, verbs = ROUTER_GRANT
    binding_meta = child_metadata(body, account, ENDPOINT_PICKER_COMPONENT)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": child_metadata(body, account, ENDPOINT_PICKER_COMPONENT)},
        {"apiVersion": RBAC_API_VERSION, "kind": "Role", "metadata": child_metadata(body, account, ENDPOINT_PICKER_COMPONENT),
         "rules": [{"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}]},
        {"apiVersion": RBAC_API_VERSION, "kind": "RoleBinding", "metadata": binding_meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": binding_meta["namespace"]}]},
    ]


def render_inference_pool(body: dict[str, Any]) -> dict[str, Any]:
    """The InferencePool (v1) over the engine pods: the gateway sends each request to the pod the
    picker names, on the engines' HTTP port."""
    name = body["metadata"]["name"]
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": child_metadata(body, name, "engine"),
        "spec": {
            "selector": {"matchLabels": selector_labels(name, "engine")},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {"name": epp_name(name), "port": {"number": EPP_PORT}, "failureMode": "FailClose"},
        },
    }


def render_http_route(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = body["metadata"]["name"]
    parents = []
    for ref in spec.router.gateway.parent_refs:
        parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": ref.name}
        if ref.namespace:
            parent["namespace"] = ref.namespace
        if ref.section_name:
            parent["sectionName"] = ref.section_name
        parents.append(parent)
    return {
        "apiVersion": HTTPROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": child_metadata(body, name, "router"),
        "spec": {
            "parentRefs": parents,
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}],
            }],
        },
    }


def render_gateway(body: dict[str, Any], spec: InferenceServiceSpec, images: Images,
                   objectives: dict[str, int]) -> list[dict[str, Any]]:
    """router.mode: gateway's objects, in the order they are applied."""
    out = [render_epp_service(body), *render_epp_rbac(body), render_epp_objectives(body, objectives),
           render_epp_deployment(body, spec, images), render_inference_pool(body)]
    if spec.router.gateway is not None and spec.router.gateway.parent_refs:
        out.append(render_http_route(body, spec))
    return out


# --- network policies -------------------------------------------------------------------------


def render_network_policies(body: dict[str, Any], peers: NetworkPeers,
                            spec: InferenceServiceSpec | None = None) -> list[dict[str, Any]]:
    """Engine pods take traffic only from the service's router (and endpoint picker) pods, the
    operator and Prometheus, on the HTTP port, and from each other on any port: the multi-node
    rendezvous, NCCL and KV transfers (spec.prefill: decode pods pulling from prefill pods over
    gloo or UCX) pick their ports at run time. The router takes it from any
    pod of the cluster (clients, the ingress controller). Kubelet probes are not filtered: traffic
    from a pod's own node is always allowed. Policies add up: a source these leave out (an ingress
    controller on the host network, which arrives from node addresses) needs a policy of the
    cluster's own beside them. With router.mode: gateway the gateway's data plane, wherever it runs,
    reaches the engines' HTTP port and the picker's gRPC port, and the picker their KV events."""
    name = body["metadata"]["name"]
    gateway = spec is not None and spec.router.mode == "gateway"

    def http() -> list[dict[str, Any]]:  # fresh per rule: shared lists come out as YAML anchors
        return [{"protocol": "TCP", "port": ENGINE_PORT}]

    engine_ingress = [
        {"from": [{"podSelector": {"matchLabels": selector_labels(name, component)}}
                  for component in ("router", ENDPOINT_PICKER_COMPONENT)], "ports": http()},
        {"from": [
            {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: peers.operator_namespace}},
             "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}},
            {"namespaceSelector": {"matchLabels": dict(peers.prometheus_namespace_labels)},
             "podSelector": {"matchLabels": dict(peers.prometheus_pod_labels)}},
        ], "ports": http()},
        {"from": [{"podSelector": {"matchLabels": selector_labels(name, "engine")}}]},
    ]
    if gateway:
        engine_ingress.append({"from": [{"namespaceSelector": {}}], "ports": http()})
        engine_ingress.append({"from": [{"podSelector": {"matchLabels": selector_labels(name, ENDPOINT_PICKER_COMPONENT)}}],
                               "ports": [{"protocol": "TCP", "port": port} for port in (KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT)]})
    engine = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(body, engine_name(name), "engine"),
        "spec": {"podSelector": {"matchLabels": selector_labels(name, "engine")},
                 "policyTypes": ["Ingress"], "ingress": engine_ingress},
    }
    router = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(body, name, "router"),
        "spec": {"podSelector": {"matchLabels": selector_labels(name, "router")},
                 "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": ROUTER_PORT}]}]},
    }
    if not gateway:
        return [engine, router]
    epp = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(body, epp_name(name), ENDPOINT_PICKER_COMPONENT),
        "spec": {"podSelector": {"matchLabels": selector_labels(name, ENDPOINT_PICKER_COMPONENT)},
                 "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": EPP_PORT}]}]},
    }
    return [engine, router, epp]


# --- keys ---------------------------------------------------------------------------------------


def render_internal_key_secret(body: dict[str, Any], api_key: str) -> dict[str, Any]:
    """The Secret <name>-internal-key holding `api_key`, which the handler draws at random and
    creates once (not part of `render`, which stays pure); owned, so it goes with its service."""
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(body, internal_key_secret_name(name), "engine"),
        "type": "Opaque",
        "stringData": {INTERNAL_KEY_SECRET_KEY: api_key},
    }


def render_service_monitor(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": child_metadata(body, name, "monitoring"),
        "spec": {
            # Both Services (engine and router) carry these labels and a port named http.
            "selector": {"matchLabels": {"app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": name}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": str(spec.monitoring.interval)}],
        },
    }


def render(body: dict[str, Any], spec: InferenceServiceSpec, images: Images | None = None,
           peers: NetworkPeers | None = None, objectives: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Every child of a validated InferenceService, in the order they are applied. `objectives`:
    the priorities of the InferenceObjectives of its pool (router.mode: gateway)."""
    images = images or Images()
    peers = peers or NetworkPeers()
    if spec.prefill is not None:
        # Disaggregated (validation keeps it to one node per replica): per role a Service, a
        # Deployment and a budget, each role's pods from its own spec.
        engines = [obj for role in ROLES for obj in (
            render_engine_service(body, spec, role), render_role_deployment(body, spec, images, role),
            render_engine_pdb(body, role))]
    else:
        workload = (
            render_engine_leaderworkerset(body, spec, images) if spec.topology.nodes > 1
            else render_engine_deployment(body, spec, images)
        )
        engines = [render_engine_service(body, spec), workload, render_engine_pdb(body)]
    # The policies first: no engine pod runs before they protect it.
    out = render_network_policies(body, peers, spec) if spec.network_policy else []
    out += [
        render_engine_configmap(body, spec, images),
        *engines,
        render_router_service(body),
        # The account before the Deployment: its pods are refused until the account exists.
        *render_router_rbac(body),
        render_router_deployment(body, spec, images),
    ]
    if spec.router.ingress is not None:
        out.append(render_ingress(body, spec))
    if spec.router.mode == "gateway":
        out += render_gateway(body, spec, images, objectives or {})
    if spec.monitoring.service_monitor:
        out.append(render_service_monitor(body, spec))
    return out + render_scaler(body, spec)
