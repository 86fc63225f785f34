"""LoRA adapters' shared vocabulary: `LoRARequest` (vLLM's), `--lora-modules` parsing, and the
checks of an adapter's `adapter_config.json` that need no weights.

A base module (no torch, no layer of the engine): the API process, the core, the ranks and the
offline `LLM` all name adapters with these. The weights themselves are read on each rank
(`worker/model/lora.py`), which checks their shapes against the base model's layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The projections an adapter may target (PEFT's module names in Llama-family checkpoints).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter and the reason."""


@dataclass(frozen=True)
class LoRARequest:
    """One adapter a request runs under (vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`).
    The name is what `model` selects in the API and what the prefix cache keys pages with; the
    id is the caller's number for it (vLLM's `lora_int_id`, at least 1)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer of at least 1, "
                             f"got {self.lora_int_id!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON `{"name", "path", "base_model_name"}`."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """One `--lora-modules` word, as vLLM's `LoRAParserAction` reads it. Raises ValueError."""
    text = value.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {value!r}: not valid JSON ({e})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"--lora-modules {value!r}: a JSON entry must be an object")
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules {value!r}: unknown keys {sorted(unknown)} "
                             "(known: name, path, base_model_name)")
        name, path, base = spec.get("name"), spec.get("path"), spec.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {value!r}: \"name\" and \"path\" must be non-empty strings")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {value!r}: \"base_model_name\" must be a string")
        return LoRAModulePath(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object "
                         '{"name": ..., "path": ..., "base_model_name": ...}')
    return LoRAModulePath(name, path)


def parse_lora_modules(values) -> list[LoRAModulePath]:
    """Every `--lora-modules` entry; the same name twice is refused."""
    modules = [parse_lora_module(v) for v in values or ()]
    seen: set[str] = set()
    for m in modules:
        if m.name in seen:
            raise ValueError(f"--lora-modules: adapter name {m.name!r} is given twice")
        seen.add(m.name)
    return modules


@dataclass(frozen=True)
class AdapterConfig:
    """What `adapter_config.json` says that the engine uses: the rank, the scale each adapter's
    output is multiplied by (alpha / r, or alpha / sqrt(r) under rsLoRA), and the projections it targets."""

    rank: int
    scaling: float
    target_modules: tuple[str, ...]


def read_adapter_config(name: str, path: str, max_lora_rank: int) -> AdapterConfig:
    """The adapter's PEFT config, checked against what the engine serves. Raises LoRAAdapterError
    naming the adapter and the reason."""
    def refuse(reason: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {reason}")

    if not path or not os.path.isdir(path):
        raise refuse(f"{path!r} is not a directory")
    for fname in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(path, fname)):
            raise refuse(f"{fname} is missing in {path!r}")
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise refuse(f"{ADAPTER_CONFIG} cannot be read ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = cfg.get("r")
    if type(rank) is not int or rank < 1:
        raise refuse(f"rank r={rank!r} is not a positive integer")
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} exceeds --max-lora-rank {max_lora_rank}")
    if cfg.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        raise refuse(f"bias={cfg.get('bias')!r} is not supported (only \"none\")")
    if cfg.get("modules_to_save"):
        raise refuse(f"modules_to_save {cfg['modules_to_save']} is not supported (only LoRA on "
                     f"{', '.join(TARGET_MODULES)})")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise refuse("per-module rank_pattern / alpha_pattern is not supported")
    if cfg.get("layers_to_transform") is not None:
        raise refuse("layers_to_transform is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        if targets == "all-linear":
            targets = list(TARGET_MODULES)
        else:
            raise refuse(f"target_modules as a pattern ({targets!r}) is not supported; list the modules")
    if not targets:
        raise refuse("target_modules is empty")
    other = sorted(set(targets) - set(TARGET_MODULES))
    if other:
        raise refuse(f"target modules {other} are not served (LoRA applies to {', '.join(TARGET_MODULES)})")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha={alpha!r} is not a number")
    scaling = alpha / rank ** 0.5 if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling), tuple(t for t in TARGET_MODULES if t in targets))
