"""The model registry: Hugging Face `architectures` names → the module class that serves them.

Every class here is built as `cls(hf_config, architecture)`.
"""

from __future__ import annotations

from torch import nn

from pagoda_engine.errors import UnsupportedArchitectureError
from pagoda_engine.worker.model.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


# A config.json without `architectures` (e.g. written by `config.save_pretrained`) still has a model_type.
_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def resolve_architecture(architectures: list[str] | None, model_type: str | None = None) -> tuple[str, type[nn.Module]]:
    """The first of config.json's `architectures` that Pagoda serves, and its class; when the
    list is absent, the architecture that `model_type` implies."""
    if not architectures and model_type in _ARCHITECTURE_OF_MODEL_TYPE:
        architectures = [_ARCHITECTURE_OF_MODEL_TYPE[model_type]]
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return name, MODEL_REGISTRY[name]
    named = ", ".join(architectures) if architectures else f"no architecture (model_type {model_type!r})"
    raise UnsupportedArchitectureError(
        f"config.json names {named}; Pagoda serves {', '.join(supported_architectures())}"
    )
