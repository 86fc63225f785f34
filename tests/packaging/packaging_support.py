"""Paths, versions and small pure helpers shared by the packaging tests (fixtures: conftest.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "pagoda"
KUSTOMIZE_DIR = ROOT / "kustomize"
CRD_DIR = ROOT / "crds"
EXAMPLES_DIR = ROOT / "examples"
IMAGES = ROOT / "images"

# A recent release whose schemas kubernetes-validate ships.
KUBERNETES_VERSION = "1.34.0"
INFERENCESERVICE_CRD = "inferenceservices.pagoda.dev"

# Kinds from other projects' CRDs: their schemas are not available offline, so they get a
# structural check only (apiVersion, kind, metadata.name, spec).
THIRD_PARTY_GROUPS = {"monitoring.coreos.com", "leaderworkerset.x-k8s.io", "keda.sh"}


def load_yaml_stream(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def group_of(api_version: str) -> str:
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def rules_of(objects: Iterable[dict], kinds=("Role", "ClusterRole")) -> list[dict]:
    return [rule for obj in objects if obj["kind"] in kinds for rule in obj.get("rules", [])]


@dataclass
class Instruction:
    keyword: str
    args: str


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions in order, with `${VAR}`/`$VAR` replaced by the ARG defaults declared before."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name}: file ends inside a continued line"

    args: dict[str, str] = {}
    instructions = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), rest.strip())
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        instructions.append(Instruction(keyword, rest))
    return instructions
