"""Disaggregated prefill and decode: `--kv-transfer-config` and the `kv_transfer_params` a request
and a response carry, in vLLM's names (`vllm/config/kv_transfer.py`, the NIXL connector's
`kv_transfer_params`), checked where they enter.

    pagoda serve --kv-transfer-config '{"kv_role": "kv_producer"}'   # a prefill engine
    pagoda serve --kv-transfer-config '{"kv_role": "kv_consumer"}'   # a decode engine

A producer given `kv_transfer_params: {"do_remote_decode": true}` runs the prompt, keeps its full
pages for at most `hold_timeout_s` and answers with where and which they are
(`do_remote_prefill`, `remote_engine_id`, `remote_request_id`, `remote_block_ids`, `remote_host`,
`remote_port`, plus `remote_block_size`, `remote_num_tokens` and `remote_fingerprint`); a consumer
given those params pulls the pages it misses before the request's first step, and computes the
prompt itself if the pull fails or takes longer than `transfer_timeout_s`.

A base module: no torch, no layer of the engine (the CLI and the operator check a config before
anything starts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagoda_engine.errors import PagodaError


class InvalidKVTransferConfigError(PagodaError, ValueError):
    """A KV transfer config with an unknown key or a value Pagoda cannot honour."""


ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The connector that runs everywhere: torch.distributed point-to-point over a pairwise gloo group.
TORCH_CONNECTOR = "PagodaTorchConnector"
# NIXL (vLLM's name): READs of the producer's registered pages, where the nixl wheel is installed.
# Left out, kv_connector is NIXL where it starts, else the torch connector.
NIXL_CONNECTOR = "NixlConnector"
# vLLM's connectors this engine cannot run: refused by name, never accepted and ignored.
_NOT_BUILT = {
    "LMCacheConnectorV1": "LMCache",
    "MooncakeConnector": "Mooncake",
    "P2pNcclConnector": "vLLM's P2P NCCL connector",
    "SharedStorageConnector": "vLLM's shared-storage connector",
    "MultiConnector": "vLLM's multi-connector",
    "OffloadingConnector": "vLLM's offloading connector (Pagoda's KV tiers are --kv-offload-*)",
}
# vLLM's default side-channel port (`kv_port`); data-parallel core r listens on kv_port + r.
DEFAULT_KV_PORT = 14579
_EXTRA_KEYS = ("hold_timeout_s", "transfer_timeout_s")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str | None = None  # None: the best transfer that works on the device
    kv_role: str | None = None  # None: no disaggregation
    engine_id: str | None = None  # None: a random id at start-up
    kv_ip: str = "127.0.0.1"  # the address the transfer endpoint listens on and advertises
    kv_port: int = DEFAULT_KV_PORT  # 0: any free port
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.kv_role is not None

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def hold_timeout_s(self) -> float:
        """How long a producer keeps a finished prompt's pages for a consumer that never pulls them."""
        return float(self.kv_connector_extra_config.get("hold_timeout_s", 120.0))

    @property
    def transfer_timeout_s(self) -> float:
        """How long a consumer waits for a pull (handshake and pages) before it computes the prompt."""
        return float(self.kv_connector_extra_config.get("transfer_timeout_s", 10.0))


_KEYS = ("kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port", "kv_connector_extra_config")
# vLLM's keys that do not apply to Pagoda's connector: refused by name.
_VLLM_KEYS_NOT_HONOURED = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size",
                           "kv_connector_module_path", "enable_permute_local_kv", "kv_load_failure_policy")


def parse_kv_transfer_config(value: Any) -> KVTransferConfig:
    """A checked KVTransferConfig from JSON text, a dict or a KVTransferConfig (None: off). Raises
    InvalidKVTransferConfigError (a ValueError) naming what is wrong."""
    if value is None:
        return KVTransferConfig()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidKVTransferConfigError(f"--kv-transfer-config is not valid JSON: {e}") from None
    if isinstance(value, dict):
        refused = sorted(set(value) & set(_VLLM_KEYS_NOT_HONOURED))
        if refused:
            raise InvalidKVTransferConfigError(f"--kv-transfer-config: {', '.join(refused)} not supported by "
                                               f"Pagoda's connector")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise InvalidKVTransferConfigError(f"--kv-transfer-config: unknown key(s) {', '.join(unknown)}; "
                                               f"known: {', '.join(_KEYS)}")
        value = KVTransferConfig(**value)
    if not isinstance(value, KVTransferConfig):
        raise InvalidKVTransferConfigError(f"--kv-transfer-config must be a JSON object, got {type(value).__name__}")
    return _checked(value)


def _checked(c: KVTransferConfig) -> KVTransferConfig:
    def fault(name: str, what: str) -> InvalidKVTransferConfigError:
        return InvalidKVTransferConfigError(f"--kv-transfer-config: {name} must be {what}, got {getattr(c, name)!r}")

    if c.kv_connector is not None:
        if c.kv_connector in _NOT_BUILT:
            raise InvalidKVTransferConfigError(f"--kv-transfer-config: kv_connector {c.kv_connector!r} is not "
                                               f"supported: {_NOT_BUILT[c.kv_connector]}")
        if c.kv_connector not in (TORCH_CONNECTOR, NIXL_CONNECTOR):
            raise fault("kv_connector", f"{NIXL_CONNECTOR!r} or {TORCH_CONNECTOR!r} (or left out: NIXL where it is "
                                        f"installed)")
    if c.kv_role is None:
        if c != KVTransferConfig(kv_connector=c.kv_connector):
            raise InvalidKVTransferConfigError("--kv-transfer-config: kv_role is required (kv_producer, kv_consumer "
                                               "or kv_both)")
    elif c.kv_role not in ROLES:
        raise fault("kv_role", " | ".join(ROLES))
    if c.engine_id is not None and (not isinstance(c.engine_id, str) or not c.engine_id):
        raise fault("engine_id", "a non-empty string")
    if not isinstance(c.kv_ip, str) or not c.kv_ip:
        raise fault("kv_ip", "a host name or address")
    if not isinstance(c.kv_port, int) or isinstance(c.kv_port, bool) or not 0 <= c.kv_port <= 65535:
        raise fault("kv_port", "a port number (0: any free port)")
    extra = c.kv_connector_extra_config
    if not isinstance(extra, dict):
        raise fault("kv_connector_extra_config", "an object")
    unknown = sorted(set(extra) - set(_EXTRA_KEYS))
    if unknown:
        raise InvalidKVTransferConfigError(f"--kv-transfer-config: unknown kv_connector_extra_config key(s) "
                                           f"{', '.join(unknown)}; known: {', '.join(_EXTRA_KEYS)}")
    for key in _EXTRA_KEYS:
        v = extra.get(key, 1.0)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 3600:
            raise InvalidKVTransferConfigError(f"--kv-transfer-config: kv_connector_extra_config.{key} must be "
                                               f"seconds in (0, 3600], got {v!r}")
    return c


# --- a request's kv_transfer_params --------------------------------------------------------------

@dataclass(frozen=True)
class RemotePrefill:
    """Where a consumer pulls a request's prompt pages from: the producer's answer, as sent back."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    host: str
    port: int
    block_size: int
    fingerprint: str


def check_request_params(params: Any, config: KVTransferConfig, n: int = 1) -> str | None:
    """Why a request's `kv_transfer_params` cannot be honoured by this engine, or None. The fields
    are the NIXL connector's; `do_remote_decode` asks a producer to hold the prompt's pages,
    `do_remote_prefill` asks a consumer to pull them."""
    if params is None:
        return None
    if not isinstance(params, dict):
        return "kv_transfer_params must be an object"
    if not config.enabled:
        return "kv_transfer_params needs an engine started with --kv-transfer-config"
    decode, prefill = params.get("do_remote_decode", False), params.get("do_remote_prefill", False)
    if not isinstance(decode, bool) or not isinstance(prefill, bool):
        return "kv_transfer_params: do_remote_decode and do_remote_prefill must be true or false"
    if decode and prefill:
        return "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other"
    if decode:
        if not config.is_producer:
            return f"kv_transfer_params.do_remote_decode needs a kv_producer or kv_both engine (this is {config.kv_role})"
        if n != 1:
            return "kv_transfer_params.do_remote_decode holds one sequence's pages: n must be 1"
    if prefill:
        if not config.is_consumer:
            return f"kv_transfer_params.do_remote_prefill needs a kv_consumer or kv_both engine (this is {config.kv_role})"
        try:
            remote_prefill(params)
        except ValueError as e:
            return str(e)
    return None


def remote_prefill(params: dict) -> RemotePrefill | None:
    """The pull a request's params ask for (None without `do_remote_prefill`); ValueError naming a
    missing or malformed field."""
    if not params.get("do_remote_prefill"):
        return None

    def get(name: str, kind: type, what: str):
        v = params.get(name)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ValueError(f"kv_transfer_params.{name} must be {what}, got {v!r}")
        return v

    block_ids = get("remote_block_ids", list, "a list of page ids")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_ids):
        raise ValueError("kv_transfer_params.remote_block_ids must be positive page ids")
    port = get("remote_port", int, "a port number")
    if not 0 < port <= 65535:
        raise ValueError(f"kv_transfer_params.remote_port must be a port number, got {port}")
    return RemotePrefill(engine_id=get("remote_engine_id", str, "a string"),
                         request_id=get("remote_request_id", str, "a string"), block_ids=block_ids,
                         host=get("remote_host", str, "a host"), port=port,
                         block_size=get("remote_block_size", int, "the producer's page size"),
                         fingerprint=get("remote_fingerprint", str, "the producer's KV fingerprint"))
