"""The speculative-decoding settings of an engine (vLLM's `--speculative-config`), checked where
they enter.

    pagoda serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    pagoda serve --speculative-config '{"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 4}'
    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})

The keys and their meaning are vLLM's. A key vLLM does not have is refused naming it; so is a key
that does not apply to the method (`model` for ngram, `prompt_lookup_*` for a draft model), and
a method or key vLLM has that this engine cannot honour yet: never accepted and ignored.

With `draft_model` or `eagle3` a model on the ranks drafts (`model`: its directory, as --model
names the target's); see `core/draft_proposer.py`.

A base module: no torch, no layer of the engine, so that the CLI and the operator can check a
config before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda_engine.errors import PagodaError
from pagoda_engine.json_config import json_object


class InvalidSpeculativeConfigError(PagodaError, ValueError):
    """A speculative config with an unknown key or method, a key that does not apply, or a bad value."""


# vLLM's methods: prompt lookup, a draft model of the target's tokenizer, EAGLE-3 heads. The others
# are refused by name at start-up.
METHODS = ("ngram", "draft_model", "eagle3")
# The methods whose drafts a model on the ranks writes (`model` names it).
MODEL_METHODS = ("draft_model", "eagle3")
NOT_YET = {
    "eagle": "EAGLE-1/2 heads",
    "medusa": "Medusa heads",
    "mlp_speculator": "MLP speculators",
    "mtp": "multi-token-prediction layers",
    "suffix": "suffix decoding",
}
# vLLM's keys this engine cannot honour yet (each changes what is drafted or how): refused by name.
_UNSUPPORTED_KEYS = ("quantization", "revision", "code_revision", "draft_tensor_parallel_size", "max_model_len",
                     "speculative_token_tree", "disable_padded_drafter_batch", "parallel_drafting",
                     "disable_log_stats", "enforce_eager", "prompt_lookup_tokens", "suffix_decoding_max_tree_depth",
                     "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
                     "suffix_decoding_min_token_prob", "target_model_config", "draft_model_config")
# Which keys apply to which method ("method" and "num_speculative_tokens" apply to all).
_METHOD_KEYS = {
    "ngram": ("prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"),
    "draft_model": ("model", "disable_by_batch_size"),
    "eagle3": ("model", "disable_by_batch_size"),
}
_COMMON_KEYS = ("method", "num_speculative_tokens")
_ALL_KEYS = sorted({*_COMMON_KEYS, "model", *(k for keys in _METHOD_KEYS.values() for k in keys)})
# The longest draft one step verifies: each drafted token is one more row of logits to sample.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # None: no speculation
    num_speculative_tokens: int = 0  # k: tokens drafted per step for each speculating request
    # ngram (prompt lookup): the longest and shortest n-gram of the request's last tokens looked
    # up in its earlier tokens; the tokens that followed the latest match are the draft.
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    # Speculation is off for a step with more running requests than this (None: never off).
    disable_by_batch_size: int | None = None
    # draft_model and eagle3: the drafting model, named as --model names the target (a local
    # directory; vLLM's key).
    model: str | None = None

    @property
    def enabled(self) -> bool:
        return self.method is not None


def parse_speculative_config(value) -> SpeculativeConfig:
    """A checked SpeculativeConfig from JSON text, a dict or a SpeculativeConfig (None: off).
    Raises InvalidSpeculativeConfigError naming what is wrong."""
    if value is None:
        return SpeculativeConfig()
    if isinstance(value, SpeculativeConfig):
        value = {k: v for k, v in value.__dict__.items() if v is not None}
        if value.get("method") is None:
            return SpeculativeConfig()
    value = json_object(value, InvalidSpeculativeConfigError, flag="--speculative-config", name="speculative config")
    return _checked(dict(value))


def _fail(message: str):
    raise InvalidSpeculativeConfigError(f"speculative config: {message}")


def _positive_int(value, key: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(f"{key} must be a whole number >= {minimum}, got {value!r}")
    return value


def _checked(given: dict) -> SpeculativeConfig:
    for key in given:
        if key in _UNSUPPORTED_KEYS:
            _fail(f"{key} is not supported by this engine yet")
        if key not in _ALL_KEYS:
            _fail(f"unknown key {key!r}; known: {', '.join(_ALL_KEYS)}")
    method = given.get("method")
    if method is None:
        # vLLM infers ngram from the "[ngram]" model name and a draft model from any other; only the
        # explicit method is taken here, so that what runs is what was asked for.
        _fail('"method" must be given (one of: ' + ", ".join(METHODS + tuple(NOT_YET)) + ")")
    if method in NOT_YET:
        _fail(f"method {method!r} ({NOT_YET[method]}) is not implemented in this engine yet; "
              f"implemented: {', '.join(METHODS)}")
    if method not in METHODS:
        _fail(f"unknown method {method!r}; known: {', '.join(METHODS + tuple(NOT_YET))}")
    applies = set(_COMMON_KEYS) | set(_METHOD_KEYS[method])
    for key in given:
        if key not in applies:
            _fail(f"{key} does not apply to method {method!r} (its keys: {', '.join(sorted(applies))})")
    k = _checked_k(given)
    disable = given.get("disable_by_batch_size")
    if disable is not None:
        # vLLM refuses a threshold below 2 too.
        _positive_int(disable, "disable_by_batch_size", minimum=2)
    if method in MODEL_METHODS:
        model = given.get("model")
        if not isinstance(model, str) or not model:
            _fail(f'method {method!r} needs "model": the drafting model\'s directory')
        return SpeculativeConfig(method=method, num_speculative_tokens=k, disable_by_batch_size=disable, model=model)
    lookup_max = given.get("prompt_lookup_max")
    lookup_min = given.get("prompt_lookup_min")
    # vLLM's defaults: either one given stands for both; neither: min 5, max 5.
    if lookup_max is None and lookup_min is None:
        lookup_max = lookup_min = 5
    elif lookup_max is None:
        lookup_max = _positive_int(lookup_min, "prompt_lookup_min")
    elif lookup_min is None:
        lookup_min = _positive_int(lookup_max, "prompt_lookup_max")
    _positive_int(lookup_min, "prompt_lookup_min")
    _positive_int(lookup_max, "prompt_lookup_max")
    if lookup_min > lookup_max:
        _fail(f"prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max ({lookup_max})")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_max=lookup_max,
                             prompt_lookup_min=lookup_min, disable_by_batch_size=disable)


def _checked_k(given: dict) -> int:
    if "num_speculative_tokens" not in given:
        _fail("num_speculative_tokens must be given")
    k = _positive_int(given["num_speculative_tokens"], "num_speculative_tokens")
    if k > MAX_SPECULATIVE_TOKENS:
        _fail(f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got {k}")
    return k
