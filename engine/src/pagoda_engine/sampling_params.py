"""`SamplingParams`: how to pick tokens for one request. Shared by every process (the API process
checks it, the wire carries it, the core and the sampler read it)."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass

from pagoda_engine.errors import InvalidRequestError


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's `StructuredOutputsParams`): exactly one of `json`
    (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the output is one of these
    strings), `grammar` (a Lark grammar, llguidance's dialect; GBNF is accepted too) or
    `json_object` (any JSON object). The grammar engine compiles it (`structured_outputs`); a spec it
    cannot compile is refused before the request is queued."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without free whitespace between tokens, so a weak model cannot pad forever.
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got "
                + (", ".join(kinds) or "none"), param="structured_outputs")
        if isinstance(self.json, str):
            try:
                jsonlib.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}",
                                          param="structured_outputs.json") from None
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object)",
                                      param="structured_outputs.json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string",
                                          param=f"structured_outputs.{name}")
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of strings",
                                      param="structured_outputs.choice")

    @property
    def kind(self) -> str:
        """Which constraint is set: json | regex | choice | grammar | json_object."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) is not None)

    @property
    def spec(self) -> str:
        """The constraint as one canonical string: with `kind`, the compile cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = jsonlib.loads(value) if isinstance(value, str) else value
            value = jsonlib.dumps(value, sort_keys=True, separators=(",", ":"))
        elif self.kind == "choice":
            value = jsonlib.dumps(value)
        elif self.kind == "json_object":
            value = ""
        return f"{value}\x00ws={int(not self.disable_any_whitespace)}"


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Field names and meanings follow vLLM's SamplingParams."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-N logprobs per generated token (0 = only the sampled token's)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # Disaggregated prefill/decode (vLLM passes it in `extra_args`): checked by the API server
    # against the engine's role (`kv_transfer.check_request_params`).
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items() if v} or None
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param=param)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        check(is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        check(is_num(self.temperature) and self.temperature >= 0, "temperature",
              f"temperature must be >= 0, got {self.temperature!r}")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k",
              f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}")
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        check(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        check(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        check(is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be non-empty strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "stop_token_ids must be non-negative integers")
        check(self.seed is None or is_int(self.seed), "seed", f"seed must be an integer, got {self.seed!r}")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
              f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
              "prompt_logprobs", f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        check(self.logit_bias is None or all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items()),
              "logit_bias", "logit_bias maps token ids (>= 0) to biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
