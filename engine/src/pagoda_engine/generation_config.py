"""The model creator's sampling defaults, as vLLM applies them (`--generation-config`,
`--override-generation-config`).

A model directory's `generation_config.json` may recommend sampling settings (Llama 3.1 Instruct:
temperature 0.6, top_p 0.9; Qwen3: temperature 0.6, top_p 0.95, top_k 20). With
`--generation-config auto` (the default, as in vLLM) those of `repetition_penalty`, `temperature`,
`top_k`, `top_p`, `min_p` and `max_new_tokens` that the file sets become the defaults of every
request that leaves them unset; a request's own value always wins, and `max_new_tokens` (vLLM's
`max_tokens`) caps every request's `max_tokens`, as in vLLM. `vllm` keeps the neutral defaults
(temperature 1, no top-p/top-k/min-p, no penalty); a directory path reads that directory's
`generation_config.json` instead of the model's. `--override-generation-config '{"temperature":
0.5}'` sets or replaces some of them either way. A model without the file (the default model, a
GGUF file) keeps the neutral defaults.

Only the keys above are read, so an override naming any other key is refused rather than ignored,
and the defaults are checked as `SamplingParams` when the server starts: a bad value is a start-up
error naming its source, never a 400 on every request.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pagoda_engine.json_config import json_object
from pagoda_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's keys that set request defaults → SamplingParams' names.
SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                 "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
FILE_NAME = "generation_config.json"


def check_generation_config_option(value: str) -> None:
    """`--generation-config`: auto, vllm, or a directory holding generation_config.json."""
    if value in ("auto", "vllm"):
        return
    if not (Path(value) / FILE_NAME).is_file():
        raise ValueError(f"--generation-config {value!r}: expected auto, vllm, or a directory holding {FILE_NAME}")


def parse_override(value: str | dict | None) -> dict[str, Any]:
    """`--override-generation-config`: a JSON object of generation_config.json's sampling keys."""
    if value is None:
        return {}
    value = json_object(value, ValueError, flag="--override-generation-config", name="--override-generation-config")
    unknown = sorted(set(value) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(map(repr, unknown))} not supported "
                         f"(supported: {', '.join(SAMPLING_KEYS)})")
    _as_sampling(value, "--override-generation-config")
    return dict(value)


def default_sampling_params(model_path: str | Path, generation_config: str = "auto",
                            override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request defaults (SamplingParams keyword arguments) for this model and these options."""
    settings: dict[str, Any] = {}
    source = None
    if generation_config != "vllm":
        directory = Path(model_path) if generation_config == "auto" else Path(generation_config)
        source = directory / FILE_NAME
        if source.is_file():
            try:
                data = json.loads(source.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read {source}: {e}; --generation-config vllm ignores the file") from None
            if not isinstance(data, dict):
                raise ValueError(f"{source} is not a JSON object; --generation-config vllm ignores the file")
            settings = {k: v for k, v in data.items() if k in SAMPLING_KEYS and v is not None}
    defaults = _as_sampling(settings, str(source), "; --generation-config vllm ignores the file")
    defaults.update(_as_sampling(override or {}, "--override-generation-config"))
    if defaults:
        logger.warning("Default sampling parameters have been overridden by the model's generation config "
                       "(%s). If this is not intended, relaunch with --generation-config vllm.",
                       ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    return defaults


def _as_sampling(settings: dict[str, Any], source: str, hint: str = "") -> dict[str, Any]:
    """generation_config keys → SamplingParams keywords, checked as SamplingParams checks them."""
    out = {SAMPLING_KEYS[k]: v for k, v in settings.items()}
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}{hint}") from None
    return out
