"""Typed dataclasses as the one description of a Kubernetes resource's fields.

Owns the two things a field description must drive so they can never disagree:
`parse(cls, data)` turns a JSON-like dict (camelCase keys) into dataclasses with defaults,
collecting every problem with its path (`spec.topology.tensor: expected an integer, got 'x'`),
and `openapi(cls)` emits the OpenAPI v3 structural schema a CRD carries. `spec.py` declares the
InferenceService with `prop(...)`; nothing else in the operator describes a field.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import MISSING
from typing import Any, Literal


class Quantity(str):
    """A Kubernetes resource quantity ("64Gi", "500m", 4): integer or string in the schema."""


class Duration(str):
    """A duration such as "30s", "5m", "1h"."""


# A free-form object (a Kubernetes volume source, a toleration): kept as given, not pruned.
FreeForm = dict[str, Any]

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DURATION_PATTERN = r"^[0-9]+(\.[0-9]+)?(ms|s|m|h)$"
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """"90s" → 90.0 seconds. Raises ValueError for anything else."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)", str(text))
    if not match:
        raise ValueError(f"not a duration: {text!r} (expected e.g. 30s, 5m, 1h)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def prop(
    default: Any = MISSING,
    *,
    doc: str,
    name: str | None = None,
    factory: Any = MISSING,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    pattern: str | None = None,
    list_map_keys: list[str] | None = None,
) -> Any:
    """A dataclass field with what the schema needs: description, JSON name, bounds."""
    meta = {
        "doc": doc,
        "name": name,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "pattern": pattern,
        "list_map_keys": list_map_keys,
    }
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def preserve_unknown_fields(cls: type) -> type:
    """Mark a dataclass whose object keeps fields it does not declare (written by other parts)."""
    cls.__preserve_unknown__ = True  # type: ignore[attr-defined]
    return cls


def json_name(field: dataclasses.Field) -> str:
    if field.metadata.get("name"):
        return field.metadata["name"]
    head, *rest = field.name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


# ---------------------------------------------------------------------------------------------
# Parsing


class SpecProblems(Exception):
    """Every problem found in a document, each prefixed by the path of the field it concerns."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def parse(cls: type, data: Any, path: str = "spec") -> Any:
    """Parse `data` into `cls`, or raise SpecProblems listing every problem found."""
    problems: list[str] = []
    result = _parse_value(cls, data, path, problems)
    if problems:
        raise SpecProblems(problems)
    return result


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parse_value(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if not optional:
            problems.append(f"{path}: must not be null")
        return None
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _parse_object(tp, value, path, problems)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            problems.append(f"{path}: must be one of {', '.join(map(str, allowed))}; got {_describe(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {_describe(value)}")
            return []
        (item_tp,) = typing.get_args(tp)
        return [_parse_value(item_tp, item, f"{path}[{i}]", problems) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected an object, got {_describe(value)}")
            return {}
        _, value_tp = typing.get_args(tp)
        if value_tp is Any:
            return value
        return {k: _parse_value(value_tp, v, f"{path}.{k}", problems) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}: expected a number, got {_describe(value)}")
            return value
        return float(value)
    if tp is Quantity:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not re.fullmatch(QUANTITY_PATTERN, str(value)):
            problems.append(f"{path}: expected a quantity such as 64Gi or 500m, got {_describe(value)}")
            return None
        return Quantity(str(value))
    if tp is Duration:
        if not isinstance(value, str) or not re.fullmatch(DURATION_PATTERN, value):
            problems.append(f"{path}: expected a duration such as 30s or 5m, got {_describe(value)}")
            return None
        return Duration(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {_describe(value)}")
        return value
    raise TypeError(f"schema: unsupported type {tp!r} at {path}")  # a bug in spec.py, not user input


def _check_bounds(field: dataclasses.Field, value: Any, path: str, problems: list[str]) -> None:
    meta = field.metadata
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = meta.get("minimum"), meta.get("maximum")
        if low is not None and (value <= low if meta.get("exclusive_minimum") else value < low):
            problems.append(f"{path}: must be {'>' if meta.get('exclusive_minimum') else '>='} {low:g}, got {value:g}")
        if high is not None and value > high:
            problems.append(f"{path}: must be <= {high:g}, got {value:g}")
    if isinstance(value, str) and meta.get("pattern") and not re.search(meta["pattern"], value):
        problems.append(f"{path}: {value!r} does not match {meta['pattern']}")


def _parse_object(cls: type, value: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(value, dict):
        problems.append(f"{path}: expected an object, got {_describe(value)}")
        return None
    hints = typing.get_type_hints(cls)
    known = {}
    kwargs = {}
    for field in dataclasses.fields(cls):
        key = json_name(field)
        known[key] = field
        field_path = f"{path}.{key}"
        if key not in value:
            if field.default is MISSING and field.default_factory is MISSING:
                problems.append(f"{field_path}: required")
            continue
        parsed = _parse_value(hints[field.name], value[key], field_path, problems)
        _check_bounds(field, parsed, field_path, problems)
        if parsed is not None or value[key] is None:
            kwargs[field.name] = parsed
    if not getattr(cls, "__preserve_unknown__", False):
        for key in value:
            if key not in known:
                problems.append(f"{path}.{key}: unknown field (known: {', '.join(known)})")
    try:
        return cls(**kwargs)
    except TypeError:  # a required field was missing: already reported above
        return None


def to_json(obj: Any) -> Any:
    """Dataclasses back to a JSON-like dict with camelCase keys; None fields left out."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if value is not None:
                out[json_name(field)] = to_json(value)
        return out
    if isinstance(obj, list):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (Quantity, Duration)):
        return str(obj)
    return obj


# ---------------------------------------------------------------------------------------------
# OpenAPI v3 structural schema


def _first_line(text: str | None) -> str:
    return " ".join((text or "").split())


def openapi(tp: Any, description: str | None = None) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a type (as apiextensions.k8s.io/v1 requires)."""
    tp, _ = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    schema: dict[str, Any]
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        props = {}
        required = []
        for field in dataclasses.fields(tp):
            sub = openapi(hints[field.name], field.metadata.get("doc"))
            meta = field.metadata
            if meta.get("minimum") is not None:
                sub["minimum"] = meta["minimum"]
                if meta.get("exclusive_minimum"):
                    sub["exclusiveMinimum"] = True
            if meta.get("maximum") is not None:
                sub["maximum"] = meta["maximum"]
            if meta.get("pattern"):
                sub["pattern"] = meta["pattern"]
            if meta.get("list_map_keys"):
                sub["x-kubernetes-list-type"] = "map"
                sub["x-kubernetes-list-map-keys"] = list(meta["list_map_keys"])
            props[json_name(field)] = sub
            if field.default is MISSING and field.default_factory is MISSING:
                required.append(json_name(field))
        schema = {"type": "object", "properties": props}
        if required:
            schema["required"] = required
        if getattr(tp, "__preserve_unknown__", False):
            schema["x-kubernetes-preserve-unknown-fields"] = True
        description = description or _first_line(tp.__doc__)
    elif origin is Literal:
        schema = {"type": "string", "enum": list(typing.get_args(tp))}
    elif origin is list:
        (item_tp,) = typing.get_args(tp)
        schema = {"type": "array", "items": openapi(item_tp)}
    elif origin is dict:
        _, value_tp = typing.get_args(tp)
        if value_tp is Any:
            schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        else:
            schema = {"type": "object", "additionalProperties": openapi(value_tp)}
    elif tp is bool:
        schema = {"type": "boolean"}
    elif tp is int:
        schema = {"type": "integer"}
    elif tp is float:
        schema = {"type": "number"}
    elif tp is Quantity:
        schema = {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    elif tp is Duration:
        schema = {"type": "string", "pattern": DURATION_PATTERN}
    elif tp is str:
        schema = {"type": "string"}
    else:
        raise TypeError(f"schema: unsupported type {tp!r}")
    if description:
        schema = {"description": _first_line(description), **schema}
    return schema
