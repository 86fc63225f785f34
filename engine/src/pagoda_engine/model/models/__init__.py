"""The model registry: Hugging Face `architectures` names → the module class that serves them.

Every class here is built as `cls(hf_config, architecture)`.
"""

from __future__ import annotations

from torch import nn

from pagoda_engine.errors import UnsupportedArchitectureError
from pagoda_engine.model.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_architecture(architectures: list[str] | None) -> tuple[str, type[nn.Module]]:
    """The first of config.json's `architectures` that Pagoda serves, and its class."""
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return name, MODEL_REGISTRY[name]
    named = ", ".join(architectures) if architectures else "no architecture"
    raise UnsupportedArchitectureError(
        f"config.json names {named}; Pagoda serves {', '.join(supported_architectures())}"
    )
