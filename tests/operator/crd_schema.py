"""Validate a rendered object against a real CRD (`crds/`, copied from upstream): the served
version's structural schema with its defaults applied first, as the API server does, then JSON
Schema (jsonschema) and every `x-kubernetes-validations` CEL rule that does not compare with the
old object (cel-python). A rule using a Kubernetes CEL library function cel-python lacks is
reported as not evaluated, so a test can insist that the rules it cares about ran. A field the
schema does not declare is an error, as kubectl's default (Strict) field validation makes it: the
API server would otherwise prune it, a field accepted and ignored."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

CRDS = Path(__file__).parent / "crds"


@dataclass
class Result:
    errors: list[str] = field(default_factory=list)
    rules_passed: list[str] = field(default_factory=list)
    rules_skipped: list[str] = field(default_factory=list)


@functools.lru_cache(maxsize=None)
def _crd(crd_file: str) -> dict:
    return yaml.load((CRDS / crd_file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def schema_of(crd_file: str, api_version: str, kind: str) -> dict:
    crd = copy.deepcopy(_crd(crd_file))
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind, (crd_file, api_version, kind)
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version and v.get("served")]
    return served["schema"]["openAPIV3Schema"]


def _defaulted(schema: dict, value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = _defaulted(sub, out[name])
        return out
    if isinstance(value, list) and "items" in schema:
        return [_defaulted(schema["items"], v) for v in value]
    return value


def _rules(schema: dict, value: Any, path: str, env: celpy.Environment, result: Result) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        text = rule["rule"]
        if "oldSelf" in text:
            continue
        try:
            ok = env.program(env.compile(text)).evaluate({"self": celpy.json_to_cel(value)})
        except Exception as e:  # a Kubernetes CEL library function cel-python lacks
            result.rules_skipped.append(f"{path}: {text} ({type(e).__name__})")
            continue
        if isinstance(ok, celpy.celtypes.BoolType) or isinstance(ok, bool):
            (result.rules_passed if ok else result.errors).append(
                f"{path}: {text}" if ok else f"{path}: {rule.get('message', text)}")
        else:
            result.rules_skipped.append(f"{path}: {text} (evaluated to {ok!r})")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                _rules(sub, value[name], f"{path}.{name}", env, result)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _rules(schema["items"], item, f"{path}[{i}]", env, result)


def _unknown_fields(schema: dict, value: Any, path: str, errors: list[str]) -> None:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for name, sub in value.items():
            if props is not None and name in props:
                _unknown_fields(props[name], sub, f"{path}.{name}", errors)
            elif isinstance(extra, dict):
                _unknown_fields(extra, sub, f"{path}.{name}", errors)
            elif props is not None or extra is False:
                errors.append(f"{path}.{name}: unknown field")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _unknown_fields(schema["items"], item, f"{path}[{i}]", errors)


def validate(obj: dict, crd_file: str) -> Result:
    schema = schema_of(crd_file, obj["apiVersion"], obj["kind"])
    # metadata is the API server's (ObjectMeta), not the CRD's to describe.
    body = _defaulted(schema, {k: v for k, v in obj.items() if k != "metadata"})
    result = Result()
    plain = {**schema, "properties": {k: v for k, v in schema["properties"].items() if k != "metadata"}}
    for error in jsonschema.Draft7Validator(plain).iter_errors(body):
        result.errors.append(f"{'/'.join(map(str, error.absolute_path))}: {error.message}")
    _unknown_fields(plain, body, "", result.errors)
    _rules(schema, body, "", celpy.Environment(), result)
    return result
