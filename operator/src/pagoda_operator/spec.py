"""The InferenceService resource (pagoda.dev/v1alpha1), defined once.

Every field of `spec` and `status` is declared here with its type, bounds and description. The
operator parses specs with these classes (`parse_spec`), and `crd.py` generates the CRD's schema
from them, so the two cannot drift. Defaults that depend on other fields (GPUs per pod from the
topology, the image from CPU or GPU) are resolved where they are used, in `render.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from pagoda_operator.schema import Duration, FreeForm, Quantity, parse, preserve_unknown_fields, prop

GROUP = "pagoda.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["pis"]  # KServe owns `isvc`
CATEGORIES = ["pagoda"]

MODEL_URI_PATTERN = (r"^(hf://[^/@\s]+/[^@\s]+(@[^\s]+)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?|file:///[^\s]*"
                     r"|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?)$")
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


@dataclass
class SecretKeyRef:
    """A key of a Secret in the InferenceService's namespace."""

    name: str = prop(doc="Secret name.", pattern=DNS_SUBDOMAIN_PATTERN)
    key: str = prop("token", doc="Key in the Secret (default token).")


@dataclass
class SecretRef:
    """A Secret in the InferenceService's namespace, all of its keys."""

    name: str = prop(doc="Secret name.", pattern=DNS_SUBDOMAIN_PATTERN)


@dataclass
class ModelArchitecture:
    """What the model is, for validation arithmetic when its config cannot be read (the
    operator never downloads a model). Known model names (Llama 3.x, Mixtral, Qwen) are
    recognised from the URI; fields given here override that."""

    num_attention_heads: int | None = prop(None, doc="Query attention heads.", minimum=1)
    num_key_value_heads: int | None = prop(None, doc="Key/value heads (GQA).", minimum=1)
    num_layers: int | None = prop(None, doc="Transformer layers.", minimum=1)
    head_dim: int | None = prop(None, doc="Dimension of one attention head.", minimum=1)
    params_billion: float | None = prop(None, doc="Parameters, in billions (all experts included).", minimum=0, exclusive_minimum=True)
    moe: bool | None = prop(None, doc="Mixture-of-experts model.")
    num_experts: int | None = prop(None, doc="Experts per MoE layer.", minimum=1)


@dataclass
class ModelDownload:
    """How an hf:// or s3:// model is fetched by the engine pod's init container."""

    timeout_seconds: int = prop(3600, doc="Time limit of one download attempt (default 3600).", minimum=60)
    retries: int = prop(3, doc="Attempts after the first one fails (default 3).", minimum=0, maximum=20)
    token_secret_ref: SecretKeyRef | None = prop(None, doc="hf:// only: Hugging Face token (gated models), passed as HF_TOKEN.")
    s3_secret_ref: SecretRef | None = prop(None, doc="s3:// only: Secret with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY and, optionally, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL (any S3-compatible store: MinIO, Ceph, R2, ...) and AWS_REGION. Omitted: the pod's service account (the namespace's default one), e.g. its IAM role through EKS IRSA or Pod Identity.")
    cache_claim_name: str | None = prop(None, doc="PersistentVolumeClaim that caches the download across restarts; default: an emptyDir.", pattern=DNS_LABEL_PATTERN)
    cache_size_limit: Quantity | None = prop(None, doc="Size limit of the emptyDir cache.")


@dataclass
class Model:
    """The model to serve."""

    uri: str | None = prop(None, doc="hf://org/name[@revision], s3://bucket/prefix (every object below the prefix; see download.s3SecretRef), pvc://claim/path or file:///path (a path in the image or on the node). Omitted: only with builtinTiny: true.", pattern=MODEL_URI_PATTERN)
    builtin_tiny: bool = prop(False, doc="Serve the engine's built-in tiny random-weight model (tests, demos) instead of a uri.")
    name: str | None = prop(None, doc="Name clients use in the OpenAI API (default: the InferenceService name).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = prop("auto", doc="Weight and activation dtype (auto: the model config's).")
    max_model_len: int | None = prop(None, doc="Longest sequence (prompt + output) in tokens; default: the model's.", minimum=16)
    load_format: Literal["auto", "safetensors", "dummy"] = prop("auto", doc="dummy: random weights from the config (benchmarks).")
    quantization: Literal["fp8"] | None = prop(None, doc="fp8: the dense projections and MoE experts in FP8 e4m3, quantized as the weights load (`--quantization fp8`); a checkpoint already in FP8 (compressed-tensors float-quantized, vLLM's fp8) is served in FP8 without it. The fit check counts one byte per parameter.")
    architecture: ModelArchitecture | None = prop(None, doc="Model shape hints for validation.")
    download: ModelDownload = prop(doc="hf:// and s3:// download settings.", factory=ModelDownload)


@dataclass
class ClaimRef:
    """An existing PersistentVolumeClaim."""

    claim_name: str = prop(doc="PersistentVolumeClaim name.", pattern=DNS_SUBDOMAIN_PATTERN)


@dataclass
class CompileCache:
    """Where GPU engines keep the kernels Triton compiles at start-up. Default: an emptyDir per pod,
    which an engine container that restarts in its pod finds again."""

    persistent_volume_claim: ClaimRef | None = prop(None, doc="An existing ReadWriteMany claim shared by every engine pod of the service (every node mounts it): Triton's kernels, compiled once, are loaded by each later pod and replica instead of compiled again (about 3.6 s of a Llama-3.1-8B start on an H100). Triton keys its kernels by GPU architecture and its own version, so GPUs of several kinds may share one claim. FlashInfer's own JIT builds stay on the pod's emptyDir.")


@dataclass
class Speculative:
    """Speculative decoding (the engine's `--speculative-config`, vLLM's keys): greedy output is
    unchanged, sampled output keeps its distribution. Method ngram (prompt lookup) drafts from
    each request's own earlier tokens: no draft model, so no memory to add. draft_model and eagle3
    draft with a model of their own (`model`), on one GPU: its weights and KV pages count in the
    memory check where its shape is known."""

    method: Literal["ngram", "draft_model", "eagle3"] = prop(doc="ngram: prompt lookup; draft_model: a small model of the served model's tokenizer; eagle3: an EAGLE-3 head trained for the served model (the format vLLM loads).")
    num_speculative_tokens: int = prop(doc="Tokens drafted per step for each speculating request (k).", minimum=1, maximum=16)
    model: str | None = prop(None, doc="draft_model and eagle3: the drafting model, named as model.uri is (hf://, s3://, pvc://claim/path, file:///path); downloaded with model.download's settings.", pattern=MODEL_URI_PATTERN)
    prompt_lookup_max: int | None = prop(None, doc="Longest n-gram looked up (engine default: prompt_lookup_min, else 5).", minimum=1)
    prompt_lookup_min: int | None = prop(None, doc="Shortest n-gram looked up (engine default: prompt_lookup_max, else 5).", minimum=1)
    disable_by_batch_size: int | None = prop(None, doc="No speculation in steps with more running requests than this.", minimum=2)

    def config(self, model_path: str | None = None) -> dict:
        """The engine's --speculative-config object; `model_path`: where the engine finds the
        drafting model (default: its URI, for checking)."""
        return {k: v for k, v in (("method", self.method), ("num_speculative_tokens", self.num_speculative_tokens),
                                  ("model", model_path or self.model),
                                  ("prompt_lookup_max", self.prompt_lookup_max),
                                  ("prompt_lookup_min", self.prompt_lookup_min),
                                  ("disable_by_batch_size", self.disable_by_batch_size)) if v is not None}


@dataclass
class Engine:
    """The engine pods (`pagoda serve`)."""

    image: str | None = prop(None, doc="Engine image; default: the operator's engine image (engine-cpu when no GPUs).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = prop(None, doc="Image pull policy.")
    max_num_seqs: int | None = prop(None, doc="Most sequences in one batch (engine default, as vLLM's: 1024 on GPUs of 70 GiB or more other than the A100, else 256).", minimum=1)
    max_num_batched_tokens: int | None = prop(None, doc="Token budget of one step (engine default 8192).", minimum=1)
    gpu_memory_utilization: float | None = prop(None, doc="Fraction of GPU memory the engine may use (engine default 0.9).", minimum=0, exclusive_minimum=True, maximum=1)
    prefix_caching: bool = prop(True, doc="Reuse KV pages of shared prompt prefixes.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = prop("auto", doc="The KV pages' dtype (`--kv-cache-dtype`): auto, the model's; fp8 / fp8_e4m3, one byte a value (e4m3 pages: twice the tokens of bf16, scaled by the checkpoint's k_scale / v_scale where it has them).")
    seed: int | None = prop(None, doc="Sampling seed.", minimum=0)
    api_server_count: int = prop(1, doc="API server processes in each engine pod (`--api-server-count`), sharing its port and every engine core: tokenization, detokenization and streaming spread over this many CPU cores. Give the pod at least as many CPUs (resources.cpu).", minimum=1, maximum=64)
    extra_args: list[str] = prop(doc="More `pagoda serve` flags, appended as given; checked against its flags "
                                     "(unknown flags, missing values, wrong types or choices and values out of range "
                                     "are refused).",
                                 factory=list)
    env: list[FreeForm] = prop(doc="Extra environment variables (Kubernetes EnvVar objects).", factory=list)
    startup_timeout_seconds: int | None = prop(None, doc="Time a pod may take to load the model before it is restarted; default sized from the model (30 min or more for 70B).", minimum=60)
    rollout: Literal["surge", "in-place"] = prop("surge", doc="How a rollout (a new image, a spec change) replaces the engine pods: surge, a new pod first and an old one only once the new one is ready (maxSurge 1, maxUnavailable 0: the serving capacity never drops, so time to first token holds under load; needs room for one more pod, on GPUs one more pod's GPUs); in-place, an old pod first (maxSurge 0, maxUnavailable 1: no extra GPUs, but one replica fewer serves the load until its successor is ready; needs 2 replicas or more).")
    termination_grace_period_seconds: int = prop(60, doc="Time a leaving engine pod gets: a preStop sleep (10 s, a quarter of this at most) while the router and endpoints drop it, then the engine's drain (`--drain-timeout`, the rest less 5 s to exit; the router continues on another replica what the drain deadline ends).", minimum=10)
    compile_cache: CompileCache | None = prop(None, doc="GPU engines: where the kernels compiled at start-up are kept (default an emptyDir per pod).")
    speculative: Speculative | None = prop(None, doc="Speculative decoding (`--speculative-config`).")
    max_loras: int | None = prop(None, doc="spec.loras: adapters resident on the device at once (`--max-loras`, engine default 1).", minimum=1)
    max_lora_rank: int | None = prop(None, doc="spec.loras: the largest adapter rank served (`--max-lora-rank`, engine default 16).", minimum=1, maximum=512)


@dataclass
class LoraAdapter:
    """A LoRA adapter of the served model (PEFT's format), served under its own model name."""

    name: str = prop(doc="The model name clients select it by.", pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
    uri: str = prop(doc="Where it is, named as model.uri is: hf:// and s3:// downloaded by an init container with model.download's settings, pvc://claim/path mounted, file:///path as is.", pattern=MODEL_URI_PATTERN)


@dataclass
class Resources:
    """What one engine pod asks for."""

    gpus_per_pod: int | None = prop(None, doc="GPUs per pod; default tensor × pipeline × data / nodes. 0: run on CPU.", minimum=0)
    gpu_resource: str = prop("nvidia.com/gpu", doc="Extended resource name of a GPU.")
    gpu_memory_gi_b: float = prop(80.0, name="gpuMemoryGiB", doc="Memory of one GPU in GiB, for the fit check (80: H100/A100-80G; 141: H200; 24: L4).", minimum=1)
    cpu: Quantity | None = prop(None, doc="CPU request.")
    memory: Quantity | None = prop(None, doc="Memory request and limit of the engine itself; a cpu KV tier's size is added on top. Default 16Gi per GPU (4Gi on CPU).")
    shm_size: Quantity | None = prop(None, doc="Size of the /dev/shm memory volume.")
    node_memory: Quantity | None = prop(None, doc="Allocatable memory of one node the engine pods run on (kubectl describe node: Allocatable), for the check that the pods sharing a node, cpu KV tier included, fit in it.")
    gpus_per_node: int | None = prop(None, doc="GPUs of one node, for how many engine pods may share a node in that check (gpusPerNode / gpusPerPod); default one pod per node.", minimum=1)
    node_selector: dict[str, str] = prop(doc="Node selector of engine pods.", factory=dict)
    tolerations: list[FreeForm] = prop(doc="Tolerations of engine pods.", factory=list)


@dataclass
class Topology:
    """How one replica is split across GPUs and nodes."""

    tensor: int = prop(1, doc="Tensor-parallel size.", minimum=1)
    pipeline: int = prop(1, doc="Pipeline-parallel size.", minimum=1)
    data: int = prop(1, doc="Data-parallel engine cores inside one replica (MoE expert parallelism spans tensor × data).", minimum=1)
    expert: bool = prop(False, doc="Shard MoE experts across tensor × data ranks (needs a MoE model).")
    nodes: int = prop(1, doc="Nodes per replica; > 1 runs a LeaderWorkerSet.", minimum=1)


@dataclass
class KVEphemeralClaim:
    """A generic ephemeral volume: one PersistentVolumeClaim per pod, created and deleted with it,
    sized from the tier."""

    storage_class_name: str | None = prop(None, doc="StorageClass of the claims (default: the cluster's default class).")
    access_modes: list[Literal["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany"]] = prop(doc="Access modes of the claims (default ReadWriteOnce).", factory=lambda: ["ReadWriteOnce"])


@dataclass
class KVDiskVolume:
    """Where a disk tier's files live: at most one of persistentVolumeClaim or ephemeral;
    neither: an emptyDir of the tier's size on the node's disk."""

    persistent_volume_claim: ClaimRef | None = prop(None, doc="An existing claim: survives the pod, but is one volume for all pods, so only for a service of a single pod.")
    ephemeral: KVEphemeralClaim | None = prop(None, doc="A claim per pod from a volumeClaimTemplate (e.g. local NVMe through a StorageClass).")


@dataclass
class KVTier:
    """One KV-cache tier below GPU memory."""

    type: Literal["cpu", "disk", "remote"] = prop(doc="cpu: pinned host memory; disk: local files; remote: Redis shared by all replicas.")
    size: Quantity | None = prop(None, doc="Capacity per engine pod (cpu and disk tiers). A cpu tier is added to the pod's memory request and limit.")
    volume: KVDiskVolume | None = prop(None, doc="disk tier: the volume of its files; default an emptyDir of the tier's size.")
    url: str | None = prop(None, doc="remote tier: redis://host[:port][/db], rediss://... or unix:///path (each may end in ?db=N); several comma-separated "
                                     "URLs spread the pages over that many Redis servers, read in parallel "
                                     "(keep their order: it places the pages)")
    secret_ref: SecretKeyRef | None = prop(None, doc="remote tier: Secret key holding the Redis password (given to the engine as PAGODA_KV_REMOTE_PASSWORD).")


@dataclass
class KVCache:
    """Paged KV cache."""

    page_size: int = prop(16, doc="Tokens per KV page (a power of two).", minimum=1, maximum=1024)
    tiers: list[KVTier] = prop(doc="Tiers below GPU memory, fastest first.", factory=list)


@dataclass
class Autoscaling:
    """Scale replicas from Prometheus metrics. Exclusive with the replicas beside it: with
    autoscaling, spec.replicas belongs to the scaler (written through the scale subresource), and
    spec.prefill.replicas to the built-in autoscaler (spec.prefill.autoscaling)."""

    max_replicas: int = prop(doc="Most replicas.", minimum=1)
    min_replicas: int = prop(1, doc="Fewest replicas; 0 allows scale to zero (the router holds requests).", minimum=0)
    driver: Literal["builtin", "keda", "hpa"] = prop("builtin", doc="builtin: the operator's autoscaler; keda or hpa: a ScaledObject or HorizontalPodAutoscaler the operator renders, on the scale subresource (spec.prefill.autoscaling: on the prefill Deployment).")
    prometheus_url: str | None = prop(None, name="prometheusURL", doc="Prometheus HTTP API base URL.", pattern=r"^https?://")
    policy: Literal["queue", "kvUtilization", "ttft", "itl"] = prop("queue", doc="queue: waiting requests per replica; kvUtilization: mean KV usage; ttft: p90 time to first token; itl: p90 inter-token latency (spec.prefill.autoscaling: queue or ttft).")
    target: float | None = prop(None, doc="Target value of the policy's metric per replica.", minimum=0, exclusive_minimum=True)
    scale_up_delay: Duration | None = prop(None, doc="How long the metric must ask for more before scaling up.")
    scale_down_delay: Duration | None = prop(None, doc="How long the metric must ask for fewer before scaling down.")
    interval_seconds: int | None = prop(None, doc="Seconds between decisions (builtin; keda: the ScaledObject's pollingInterval; refused with hpa, which the controller manager paces).", minimum=1)


@dataclass
class IngressTLS:
    """TLS of the Ingress."""

    secret_name: str = prop(doc="Secret holding the certificate for the host.", pattern=DNS_LABEL_PATTERN)


@dataclass
class Ingress:
    """An Ingress in front of the router Service."""

    host: str | None = prop(None, doc="Host name; omitted: any host.")
    class_name: str | None = prop(None, doc="IngressClass name.")
    tls: IngressTLS | None = prop(None, doc="Serve HTTPS with this certificate.")
    annotations: dict[str, str] = prop(doc="Annotations (e.g. proxy timeouts for streaming).", factory=dict)


@dataclass
class SecretRef:
    """A Secret in the InferenceService's namespace, as a whole."""

    name: str = prop(doc="Secret name.", pattern=DNS_SUBDOMAIN_PATTERN)


@dataclass
class GatewayParentRef:
    """A Gateway (Gateway API) the HTTPRoute attaches to."""

    name: str = prop(doc="Gateway name.", pattern=DNS_SUBDOMAIN_PATTERN)
    namespace: str | None = prop(None, doc="Gateway namespace (default: the InferenceService's).", pattern=DNS_LABEL_PATTERN)
    section_name: str | None = prop(None, doc="Listener of the Gateway to attach to (default: every listener that admits the route).", pattern=DNS_SUBDOMAIN_PATTERN)


@dataclass
class RouterGateway:
    """The cluster's gateway in front of the engines (router.mode: gateway)."""

    parent_refs: list[GatewayParentRef] = prop(doc="Gateways to attach an HTTPRoute to, whose backend is the InferencePool. Omitted: no HTTPRoute (write your own, its backendRef the InferencePool named like the InferenceService).", factory=list)
    flow_control_queue: int = prop(0, doc="Requests the Endpoint Picker holds while every engine pod is saturated, released by the priority of the InferenceObjective (llm-d.ai/v1alpha2) each names, whose poolRef is this service's InferencePool (the operator hands the objectives' priorities to the picker); past it the lowest priority is shed with 429. 0: no flow control, a saturated pool still gets every request, and objectives order nothing.", minimum=0)


@dataclass
class Router:
    """The OpenAI endpoint in front of the replicas (`pagoda route`)."""

    mode: Literal["builtin", "gateway"] = prop("builtin", doc="builtin: the router alone. gateway: also an InferencePool (Gateway API inference extension, inference.networking.k8s.io/v1) over the engine pods and its Endpoint Picker (`pagoda epp`: Deployment, Service, RBAC), so the cluster's gateway routes to the engines with precise prefix routing from their KV events; the router stays the in-cluster endpoint.")
    gateway: RouterGateway | None = prop(None, doc="With mode gateway: the Gateways to attach to.")

    policy: Literal["prefix-aware", "least-load", "round-robin"] = prop("prefix-aware", doc="How a request picks a replica.")
    replicas: int = prop(1, doc="Router pods.", minimum=1)
    image: str | None = prop(None, doc="Router image; default: the operator's engine-cpu image.")
    ingress: Ingress | None = prop(None, doc="Expose the router through an Ingress.")
    api_key_secret_ref: SecretRef | None = prop(None, doc="Clients' API keys: every key of this Secret is a file of keys, one per line; requests to /v1/* need `Authorization: Bearer <key>` with one of them (401 otherwise). Mounted into the router, so keys rotate without a restart. Omitted: the router takes requests without a key.")


@dataclass
class Monitoring:
    """Prometheus scraping."""

    service_monitor: bool = prop(True, doc="Create a ServiceMonitor (Prometheus operator) for engine and router metrics.")
    interval: Duration = prop(Duration("15s"), doc="Scrape interval.")


# The label that tells a disaggregated service's prefill pods from its decode pods (llm-d's), on
# the pods, their Deployments and Services.
ROLE_LABEL = "llm-d.ai/role"
ROLES = ("prefill", "decode")


@dataclass
class PrefillEngine:
    """The prefill pods' engine settings that differ from spec.engine's: each field given replaces
    spec.engine's for them. What decides the KV pages' layout (the model, its dtype and
    quantization, the page size, the KV dtype) is shared, so the decode pods can use the pages."""

    image: str | None = prop(None, doc="Engine image of the prefill pods.")
    max_num_seqs: int | None = prop(None, doc="Most sequences in one batch.", minimum=1)
    max_num_batched_tokens: int | None = prop(None, doc="Token budget of one step (prefill pods: the chunk a long prompt is cut into).", minimum=1)
    gpu_memory_utilization: float | None = prop(None, doc="Fraction of GPU memory the engine may use.", minimum=0, exclusive_minimum=True, maximum=1)
    prefix_caching: bool | None = prop(None, doc="Must stay true: the pages a prefill holds for the decode pods are its prefix cache's.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] | None = prop(None, doc="Must equal engine.kvCacheDtype (the pages move as they are).")
    api_server_count: int | None = prop(None, doc="API server processes in each prefill pod.", minimum=1, maximum=64)
    extra_args: list[str] | None = prop(None, doc="Replaces engine.extraArgs for the prefill pods (flags that change the pages' layout are refused).")
    env: list[FreeForm] | None = prop(None, doc="Replaces engine.env for the prefill pods.")


@dataclass
class Prefill:
    """Disaggregated prefill and decode (KServe LLMInferenceService's spec.prefill): the prompts run
    on prefill pods (`--kv-transfer-config` kv_producer), which hold their KV pages until a decode
    pod (kv_consumer) pulls them; spec.replicas, spec.autoscaling, spec.resources and spec.engine are then the decode
    pods'. Needs topology.tensor and topology.pipeline 1, one node per replica and the prefix cache."""

    replicas: int | None = prop(None, doc="Prefill replicas (default 1; 0: every request decodes its own prompt); exclusive with prefill.autoscaling.", minimum=0)
    resources: Resources | None = prop(None, doc="What one prefill pod asks for (default: spec.resources).")
    engine: PrefillEngine | None = prop(None, doc="Engine settings of the prefill pods that differ from spec.engine's.")
    autoscaling: Autoscaling | None = prop(None, doc="The prefill pods' own autoscaling, on their waiting requests (policy queue) or their p90 time to first token (ttft). Driver builtin writes prefill.replicas, its decisions in status.prefillAutoscaling and the PrefillScalingReady condition; keda or hpa scale the prefill Deployment itself (a ScaledObject or HorizontalPodAutoscaler <name>-prefill), whose replicas the operator then leaves to them. prometheusURL defaults to spec.autoscaling's.")


@dataclass
class InferenceServiceSpec:
    """The desired state of an InferenceService."""

    model: Model = prop(doc="The model to serve.", factory=Model)
    engine: Engine = prop(doc="Engine pods.", factory=Engine)
    resources: Resources = prop(doc="Per-pod resources.", factory=Resources)
    topology: Topology = prop(doc="Parallelism of one replica.", factory=Topology)
    kv_cache: KVCache = prop(doc="KV cache.", factory=KVCache)
    replicas: int | None = prop(None, doc="Engine replicas (default 1); exclusive with autoscaling.", minimum=0)
    autoscaling: Autoscaling | None = prop(None, doc="Prometheus-driven autoscaling.")
    router: Router = prop(doc="The router.", factory=Router)
    monitoring: Monitoring = prop(doc="Prometheus scraping.", factory=Monitoring)
    loras: list[LoraAdapter] = prop(doc="LoRA adapters served beside the model (`--enable-lora --lora-modules`), each a model name.", factory=list, list_map_keys=["name"])
    prefill: Prefill | None = prop(None, doc="Disaggregated prefill and decode: prefill pods beside the decode pods (present: disaggregated).")
    network_policy: bool = prop(True, doc="Create NetworkPolicies: engine pods accept traffic only from this service's router (and endpoint picker) pods, each other, the operator and Prometheus (both set where the operator is installed); the router from anywhere in the cluster. false: none (the cluster's own policies apply).")


# --- status (written by the operator; declared here for the CRD schema) -----------------------


@dataclass
class Condition:
    """A condition, as Kubernetes conventions define it."""

    type: str = prop(doc="Ready, Progressing, Degraded, Validated, ScalingReady or PrefillScalingReady.")
    status: Literal["True", "False", "Unknown"] = prop(doc="True, False or Unknown.")
    observed_generation: int | None = prop(None, doc="metadata.generation this condition was computed from.", minimum=0)
    reason: str | None = prop(None, doc="CamelCase reason.")
    message: str | None = prop(None, doc="Human-readable detail.")
    last_transition_time: str | None = prop(None, doc="When status last changed (RFC 3339).")


@preserve_unknown_fields
@dataclass
class ScalingDecision:
    """One autoscaling decision."""

    time: str | None = prop(None, doc="When it was made (RFC 3339).")
    inputs: FreeForm | None = prop(None, doc="Metric values it was made from.")
    result: int | None = prop(None, doc="Replicas decided.")
    recommendation: int | None = prop(None, doc="Replicas the policy asked for, before the scale-up/down delays.")
    reason: str | None = prop(None, doc="Why.")


@preserve_unknown_fields
@dataclass
class AutoscalingStatus:
    """What the autoscaler last decided."""

    desired_replicas: int | None = prop(None, doc="Replicas the autoscaler wants.")
    last_decision: ScalingDecision | None = prop(None, doc="The latest decision.")


@preserve_unknown_fields
@dataclass
class KVTierStatus:
    """One KV tier: its configured size and what the engines report about it (summed over the
    engine pods; absent until Prometheus has the engines' series)."""

    type: str = prop(doc="Tier type (cpu, disk, remote).")
    size: str | None = prop(None, doc="Configured size per engine pod.")
    capacity: str | None = prop(None, doc="Capacity the engines report (pagoda:kv_offload_capacity_bytes), all pods together.")
    usage: str | None = prop(None, doc="Bytes in use the engines report (pagoda:kv_offload_usage_bytes), all pods together.")
    hit_rate: float | None = prop(None, doc="Hit tokens / (hit + miss tokens) of prefix lookups in this tier over the last window.")


@preserve_unknown_fields
@dataclass
class KVCacheStatus:
    """KV tiers of the service, read from the engines' metrics through Prometheus."""

    tiers: list[KVTierStatus] | None = prop(None, doc="One entry per configured tier.", list_map_keys=["type"])
    time: str | None = prop(None, doc="When the metrics were read (RFC 3339).")
    message: str | None = prop(None, doc="Why the engines' figures are missing, when they are.")


@dataclass
class PoolParentStatus:
    """A parent of the service's InferencePool (a Gateway) and what its controller says of the pool."""

    name: str = prop(doc="The parent's name.")
    namespace: str | None = prop(None, doc="The parent's namespace (omitted: the pool's).")
    kind: str | None = prop(None, doc="The parent's kind (Gateway, unless the gateway's controller says otherwise).")
    conditions: list[Condition] | None = prop(None, doc="The pool's conditions as this parent reports them: Accepted, ResolvedRefs.", list_map_keys=["type"])


@preserve_unknown_fields
@dataclass
class InferencePoolStatus:
    """router.mode: gateway: the InferencePool's status, copied from the pool."""

    parents: list[PoolParentStatus] | None = prop(None, doc="One entry per Gateway that references the pool (none yet: no gateway has taken it up).")


@dataclass
class LoraStatus:
    """One adapter of spec.loras on the engine pods (written by the operator's LoRA sync)."""

    name: str = prop(doc="The adapter's name.")
    uri: str | None = prop(None, doc="Its uri, as the spec gave it when the pods were synced.")
    ready_replicas: int | None = prop(None, doc="Ready engine pods that serve it.")
    message: str | None = prop(None, doc="Why a ready pod does not serve it (the engine's answer), when one does not.")


@dataclass
class RoleStatus:
    """A disaggregated service's prefill or decode pods."""

    name: Literal["prefill", "decode"] = prop(doc="prefill or decode.")
    replicas: int | None = prop(None, doc="Replicas that exist.")
    ready_replicas: int | None = prop(None, doc="Replicas that are ready.")


@dataclass
class InferenceServiceStatus:
    """The observed state of an InferenceService."""

    observed_generation: int | None = prop(None, doc="metadata.generation last reconciled.")
    conditions: list[Condition] | None = prop(None, doc="Ready, Progressing, Degraded, Validated, ScalingReady, PrefillScalingReady.", list_map_keys=["type"])
    replicas: int | None = prop(None, doc="Engine replicas that exist (scale subresource).")
    ready_replicas: int | None = prop(None, doc="Engine replicas that are ready.")
    selector: str | None = prop(None, doc="Label selector of engine pods (scale subresource).")
    url: str | None = prop(None, doc="OpenAI endpoint of the service.")
    autoscaling: AutoscalingStatus | None = prop(None, doc="Autoscaler state (spec.prefill: the decode pods').")
    prefill_autoscaling: AutoscalingStatus | None = prop(None, doc="spec.prefill.autoscaling: the prefill pods' autoscaler state.")
    kv_cache: KVCacheStatus | None = prop(None, doc="KV tier state.")
    inference_pool: InferencePoolStatus | None = prop(None, doc="router.mode: gateway: the InferencePool's Accepted and ResolvedRefs from each parent Gateway.")
    loras: list[LoraStatus] | None = prop(None, doc="spec.loras: each adapter's ready engine pods.", list_map_keys=["name"])
    roles: list[RoleStatus] | None = prop(None, doc="spec.prefill: each role's replicas (replicas and readyReplicas above are the decode pods').", list_map_keys=["name"])


def parse_spec(spec: Any) -> InferenceServiceSpec:
    """Parse a spec dict; raises schema.SpecProblems with every problem found."""
    return parse(InferenceServiceSpec, {} if spec is None else spec, "spec")


def desired_replicas(spec: InferenceServiceSpec) -> int:
    """Engine replicas the workload should run now: spec.replicas (set by the user, or by the
    scaler through the scale subresource), else the autoscaling floor, else 1."""
    if spec.replicas is not None:
        return spec.replicas
    if spec.autoscaling is not None:
        return spec.autoscaling.min_replicas
    return 1


def role_spec(spec: InferenceServiceSpec, role: str) -> InferenceServiceSpec:
    """The spec one role's pods are rendered and checked from: the decode pods' is the spec itself;
    the prefill pods' takes spec.prefill's replicas, resources and engine fields over spec's."""
    if role == "decode" or spec.prefill is None:
        return spec
    p = spec.prefill
    overrides = {} if p.engine is None else {
        k: v for k, v in vars(p.engine).items() if v is not None}
    return replace(spec, engine=replace(spec.engine, **overrides), resources=p.resources or spec.resources,
                   replicas=p.replicas, autoscaling=p.autoscaling, prefill=None)


__all__ = [name for name in dir() if not name.startswith("_") and name != "Any"]


def shared_compile_cache_claim(spec: InferenceServiceSpec) -> str | None:
    """The claim every engine pod of the service keeps Triton's kernels on
    (engine.compileCache.persistentVolumeClaim), or None: each pod's own emptyDir."""
    cache = spec.engine.compile_cache
    return cache.persistent_volume_claim.claim_name if cache and cache.persistent_volume_claim else None
