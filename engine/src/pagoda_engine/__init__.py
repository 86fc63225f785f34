"""Pagoda's inference engine: paged KV cache, continuous batching, OpenAI server, router."""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagoda_engine.api.llm",
    "SamplingParams": "pagoda_engine.sampling_params",
    "RequestOutput": "pagoda_engine.api.outputs",
    "CompletionOutput": "pagoda_engine.api.outputs",
    "LoRARequest": "pagoda_engine.lora",
}


def __getattr__(name: str):
    # Lazy so that `import pagoda_engine` (the API process, the router) does not pull in torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest", "__version__"]
