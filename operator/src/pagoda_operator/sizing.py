"""Numbers derived from a spec that validation and rendering must agree on: GPUs per pod, bytes
of weights and of a minimal KV pool per GPU, and the startup budget of an engine pod."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda_operator.models import architecture_of, catalogue_entry
from pagoda_operator.quantity import GIB, format_gib, gib
from pagoda_operator.spec import InferenceServiceSpec

DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
# model.quantization: bytes per weight. The embedding and LM head stay in the model's dtype (a few
# percent of the parameters of an 8B-70B model); the count here takes every parameter at one byte.
QUANTIZED_WEIGHT_BYTES = {"fp8": 1}
# engine.kvCacheDtype: bytes per K or V value ("auto": the model's dtype).
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1}
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # the engine's default (pagoda_engine.config.CacheConfig)
# Activations, CUDA graphs and the allocator's slack: what the engine cannot give to weights or KV.
ACTIVATION_RESERVE_GIB = 2.0
DEFAULT_MIN_KV_TOKENS = 4096  # a minimal useful pool when the model's length is unknown


def ranks(spec: InferenceServiceSpec) -> int:
    """Engine ranks (one GPU each) in one replica."""
    t = spec.topology
    return t.tensor * t.pipeline * t.data


def gpus_per_pod(spec: InferenceServiceSpec) -> int:
    """spec.resources.gpusPerPod, or the ranks of a replica spread evenly over its nodes."""
    if spec.resources.gpus_per_pod is not None:
        return spec.resources.gpus_per_pod
    return max(1, ranks(spec) // spec.topology.nodes)


@dataclass
class MemoryPlan:
    """Per-GPU memory arithmetic of one replica (all in GiB)."""

    params_billion: float
    dtype_bytes: int  # of one weight (the quantized size under model.quantization)
    model_shards: int  # tensor × pipeline: the weights are split this many ways
    weights_gib: float
    kv_tokens: int
    kv_bytes_per_token: int | None
    kv_gib: float
    reserve_gib: float
    usable_gib: float
    gpu_gib: float
    utilization: float
    # Speculative decoding's drafting model (engine.speculative.model) where its shape is known:
    # its weights and its KV for the same tokens (its pages share the target's page ids).
    draft_params_billion: float = 0.0
    draft_gib: float = 0.0

    @property
    def needed_gib(self) -> float:
        return self.weights_gib + self.kv_gib + self.draft_gib + self.reserve_gib

    def explain(self) -> str:
        kv = (
            f"KV for {self.kv_tokens} tokens {self.kv_gib:.1f} GiB"
            if self.kv_bytes_per_token is not None
            else "KV (model shape unknown) 0 GiB"
        )
        draft = (f"the drafting model's {self.draft_params_billion:g}B params and KV {self.draft_gib:.1f} GiB + "
                 if self.draft_gib else "")
        return (
            f"weights {self.params_billion:g}B params × {self.dtype_bytes} bytes / "
            f"(tensor × pipeline = {self.model_shards}) = {self.weights_gib:.1f} GiB per GPU, "
            f"+ {kv} + {draft}{self.reserve_gib:.1f} GiB activations = {self.needed_gib:.1f} GiB, "
            f"but a GPU offers {self.gpu_gib:g} GiB × gpuMemoryUtilization {self.utilization:g} = "
            f"{self.usable_gib:.1f} GiB"
        )


def memory_plan(spec: InferenceServiceSpec) -> MemoryPlan | None:
    """The per-GPU memory need of one replica, or None when the parameter count is unknown."""
    arch = architecture_of(spec.model)
    if arch.params_billion is None:
        return None
    dtype_bytes = QUANTIZED_WEIGHT_BYTES.get(spec.model.quantization, DTYPE_BYTES[spec.model.dtype])
    kv_value_bytes = KV_DTYPE_BYTES.get(spec.engine.kv_cache_dtype, DTYPE_BYTES[spec.model.dtype])
    shards = spec.topology.tensor * spec.topology.pipeline
    weights_gib = arch.params_billion * 1e9 * dtype_bytes / shards / GIB
    kv_tokens = spec.model.max_model_len or DEFAULT_MIN_KV_TOKENS
    per_token = None
    kv_gib = 0.0
    if arch.num_layers and arch.num_key_value_heads and arch.head_dim:
        # K and V, every layer, the KV heads this GPU holds (at least one), one token.
        kv_heads_per_gpu = max(1, arch.num_key_value_heads // spec.topology.tensor)
        layers_per_gpu = -(-arch.num_layers // spec.topology.pipeline)
        per_token = 2 * layers_per_gpu * kv_heads_per_gpu * arch.head_dim * kv_value_bytes
        kv_gib = per_token * kv_tokens / GIB
    utilization = spec.engine.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    gpu_gib = spec.resources.gpu_memory_gi_b
    draft = catalogue_entry(spec.engine.speculative.model) if (
        spec.engine.speculative is not None and spec.engine.speculative.model is not None) else None
    draft_params = draft.params_billion if draft is not None and draft.params_billion else 0.0
    draft_gib = draft_params * 1e9 * DTYPE_BYTES[spec.model.dtype] / GIB  # one GPU holds it whole
    if draft is not None and draft.num_layers and draft.num_key_value_heads and draft.head_dim:
        draft_gib += 2 * draft.num_layers * draft.num_key_value_heads * draft.head_dim * kv_value_bytes * kv_tokens / GIB
    return MemoryPlan(
        params_billion=arch.params_billion,
        dtype_bytes=dtype_bytes,
        model_shards=shards,
        weights_gib=weights_gib,
        kv_tokens=kv_tokens,
        kv_bytes_per_token=per_token,
        kv_gib=kv_gib,
        reserve_gib=ACTIVATION_RESERVE_GIB,
        usable_gib=gpu_gib * utilization,
        gpu_gib=gpu_gib,
        utilization=utilization,
        draft_params_billion=draft_params,
        draft_gib=draft_gib,
    )


def startup_budget_seconds(spec: InferenceServiceSpec) -> int:
    """How long an engine pod may take to become healthy: loading weights, building the KV pool
    and (on GPU) capturing CUDA graphs. 10 minutes plus 25 seconds per billion parameters, so a
    70B model gets about 40 minutes; 30 minutes when the size is unknown."""
    if spec.engine.startup_timeout_seconds is not None:
        return spec.engine.startup_timeout_seconds
    params = architecture_of(spec.model).params_billion
    if params is None:
        return 1800
    return int(600 + 25 * params)


# Pod requests when the spec does not give them: enough host memory to stage weights per GPU.
# A cpu KV tier lives in the pod's memory: its size is added on top, given or default.
CPU_PER_GPU = 4
MEMORY_GIB_PER_GPU = 16
CPU_MODE_CPU = "2"
CPU_MODE_MEMORY_GIB = 4
# A disk tier's volume is larger than the tier: the engine caps its files at the tier's size, and
# file-system blocks and the tier's index come on top; an emptyDir over its sizeLimit gets the
# pod evicted.
DISK_TIER_HEADROOM = 0.05
DISK_TIER_HEADROOM_MIN_GIB = 1.0


def cpu_tier_gib(spec: InferenceServiceSpec) -> float:
    return sum(gib(t.size) for t in spec.kv_cache.tiers if t.type == "cpu" and t.size is not None)


def pod_cpu(spec: InferenceServiceSpec) -> str:
    if spec.resources.cpu is not None:
        return str(spec.resources.cpu)
    gpus = gpus_per_pod(spec)
    return str(CPU_PER_GPU * gpus) if gpus else CPU_MODE_CPU


def engine_memory_gib(spec: InferenceServiceSpec) -> float:
    """The engine's own memory, without a cpu KV tier: resources.memory or the default."""
    if spec.resources.memory is not None:
        return gib(spec.resources.memory)
    gpus = gpus_per_pod(spec)
    return MEMORY_GIB_PER_GPU * gpus if gpus else CPU_MODE_MEMORY_GIB


def pod_memory(spec: InferenceServiceSpec) -> str:
    """The engine pod's memory request and limit: the engine's own plus a cpu KV tier."""
    if spec.resources.memory is not None and not cpu_tier_gib(spec):
        return str(spec.resources.memory)
    return format_gib(engine_memory_gib(spec) + cpu_tier_gib(spec))


def disk_tier_volume_size(size: str) -> str:
    """The volume (emptyDir sizeLimit, or ephemeral claim) for a disk tier of `size`."""
    tier = gib(size)
    return format_gib(tier + max(tier * DISK_TIER_HEADROOM, DISK_TIER_HEADROOM_MIN_GIB))


def pods_per_node(spec: InferenceServiceSpec, replicas: int) -> tuple[int, str]:
    """How many engine pods of this service may share one node, and why: gpusPerNode / gpusPerPod
    (at most the service's pods), else one."""
    gpus, per_node = gpus_per_pod(spec), spec.resources.gpus_per_node
    total = replicas * spec.topology.nodes
    if not gpus or per_node is None:
        return 1, "1 engine pod per node"
    fit = min(per_node // gpus, total)
    return max(fit, 1), f"{max(fit, 1)} engine pods per node (gpusPerNode {per_node} / gpusPerPod {gpus}, {total} pods in all)"


def shm_size(spec: InferenceServiceSpec) -> str:
    """/dev/shm: NCCL and the engine's worker processes exchange tensors through it."""
    if spec.resources.shm_size is not None:
        return str(spec.resources.shm_size)
    return "16Gi" if gpus_per_pod(spec) else "1Gi"


PRESTOP_SLEEP_SECONDS = 10  # endpoints and the router notice the pod is leaving before SIGTERM
SHUTDOWN_MARGIN_SECONDS = 5  # after the drain: the engine stops its cores and exits before SIGKILL


def engine_shutdown(spec: InferenceServiceSpec) -> tuple[int, int]:
    """(preStop sleep, the engine's --drain-timeout) within the pod's terminationGracePeriodSeconds,
    which Kubernetes counts from the preStop hook on: the sleep lets the endpoints and the router
    drop the pod before SIGTERM, the drain lets its streams finish (the router continues those
    still running at its end on another replica), the margin lets it exit before SIGKILL."""
    grace = spec.engine.termination_grace_period_seconds
    prestop = min(PRESTOP_SLEEP_SECONDS, grace // 4)
    return prestop, grace - prestop - SHUTDOWN_MARGIN_SECONDS
