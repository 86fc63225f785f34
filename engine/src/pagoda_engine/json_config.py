"""The one reader of a JSON-valued flag (`--profiler-config`, `--kv-events-config`,
`--speculative-config`, `--override-generation-config`, `pagoda epp --objectives-file`): JSON text
or an already parsed dict in, a dict out, each fault raised as the caller's own error type with
the caller's wording, so every flag names itself in its messages.

A base module: no torch, no layer of the engine (the CLI and the operator check these flags
before anything starts).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def json_object(value: Any, error: type[Exception], *, flag: str, name: str,
                known: Iterable[str] | None = None) -> dict:
    """`value` (JSON text or a dict) as a dict. Raises `error`: "`flag` is not valid JSON" for
    text that does not parse, "`name` must be a JSON object" for anything but an object, and, given
    `known`, "`name`: unknown field(s) ..." for keys outside it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise error(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{name} must be a JSON object, got {type(value).__name__}")
    if known is not None:
        known = list(known)
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise error(f"{name}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return value
