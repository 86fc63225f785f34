"""Shapes of well-known models, so validation can do its arithmetic without downloading configs.

`architecture_of(model)` combines what the URI names (a small catalogue of public model
families, matched on the repository name) with `spec.model.architecture`, which wins field by
field. Unknown models and unknown fields stay None, and the checks that need them are skipped.
"""

from __future__ import annotations

import dataclasses
import re

from pagoda_operator.spec import Model, ModelArchitecture

# (pattern over the lower-cased repository name, shape from the model's config.json)
_CATALOGUE: list[tuple[str, ModelArchitecture]] = [
    (r"llama-3\.2-1b", ModelArchitecture(32, 8, 16, 64, 1.24, False)),
    (r"llama-3\.2-3b", ModelArchitecture(24, 8, 28, 128, 3.21, False)),
    (r"llama-3(\.[0-9])?-8b", ModelArchitecture(32, 8, 32, 128, 8.03, False)),
    (r"llama-3(\.[0-9])?-70b", ModelArchitecture(64, 8, 80, 128, 70.6, False)),
    (r"llama-3(\.[0-9])?-405b", ModelArchitecture(128, 8, 126, 128, 405.9, False)),
    (r"mixtral-8x7b", ModelArchitecture(32, 8, 32, 128, 46.7, True, 8)),
    (r"mixtral-8x22b", ModelArchitecture(48, 8, 56, 128, 140.6, True, 8)),
    (r"mistral-7b", ModelArchitecture(32, 8, 32, 128, 7.24, False)),
    (r"qwen2\.5-7b", ModelArchitecture(28, 4, 28, 128, 7.62, False)),
    (r"qwen2\.5-72b", ModelArchitecture(64, 8, 80, 128, 72.7, False)),
    (r"qwen3-8b", ModelArchitecture(32, 8, 36, 128, 8.19, False)),
    (r"qwen3-30b-a3b", ModelArchitecture(32, 4, 48, 128, 30.5, True, 128)),
]

# The engine's built-in tiny model (pagoda_engine.tiny): a few million parameters, 4 query heads
# over 2 KV heads. Only its head counts matter to the checks.
BUILTIN_TINY = ModelArchitecture(num_attention_heads=4, num_key_value_heads=2, params_billion=0.001, moe=False)


def catalogue_entry(uri: str | None) -> ModelArchitecture | None:
    if uri is None:
        return BUILTIN_TINY
    repo = uri.split("://", 1)[-1].split("@", 1)[0].rstrip("/").rsplit("/", 1)[-1].lower()
    for pattern, arch in _CATALOGUE:
        if re.search(pattern, repo):
            return arch
    return None


def architecture_of(model: Model) -> ModelArchitecture:
    """The model's shape as far as it is known: catalogue, overridden by the spec's hints."""
    known = catalogue_entry(model.uri) or ModelArchitecture()
    hints = model.architecture or ModelArchitecture()
    merged = {
        f.name: getattr(hints, f.name) if getattr(hints, f.name) is not None else getattr(known, f.name)
        for f in dataclasses.fields(ModelArchitecture)
    }
    return ModelArchitecture(**merged)
