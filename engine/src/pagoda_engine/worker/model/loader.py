"""From a Hugging Face model directory or a GGUF file to a ready model on its device.

Owns: reading and checking the model's config (`load_hf_config`: config.json, or a GGUF file's
metadata through `gguf.py`), choosing the compute dtype (`resolve_dtype`), and building the model
and filling its weights (`load_model`) from safetensors (one file or an index of shards), from a
GGUF file (dequantized tensor by tensor), or, for `load_format="dummy"`, from a seeded random
generator. Safetensors go straight from the files to the device; every tensor is converted to the
compute dtype on the way, and merged parameters (q/k/v, gate/up) are filled piece by piece through
each parameter's `weight_loader`.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pagoda_engine.errors import ModelLoadError
from pagoda_engine.model_path import gguf_file_of
from pagoda_engine.worker.model.fp8 import (
    KV_CACHE_SCALE_SUFFIXES,
    fp8_scheme,
    load_kv_cache_scale,
    quantize_linear_layers,
    scale_name,
)
from pagoda_engine.worker.model.fp8_math import FP8_DTYPE, quantize_rows
from pagoda_engine.worker.model.gguf import gguf_tensors, load_gguf_config
from pagoda_engine.worker.model.models import resolve_architecture
from pagoda_engine.worker.model.moe import expert_checkpoint_piece

logger = logging.getLogger(__name__)

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(model_dir: str) -> PretrainedConfig:
    """config.json of `model_dir` (or the metadata of its GGUF file), checked to name an
    architecture Pagoda serves."""
    path = Path(model_dir)
    if not path.exists():
        raise ModelLoadError(f"model directory {model_dir!r} does not exist")
    gguf_file = gguf_file_of(path)
    if gguf_file is not None:
        return load_gguf_config(gguf_file)
    if not path.is_dir():
        raise ModelLoadError(f"model path {model_dir!r} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model directory {model_dir!r} has no config.json (expected a Hugging Face model directory, or one holding a .gguf file)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {config_file}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} does not hold a JSON object")
    architectures = raw.get("architectures")
    if architectures is not None and not isinstance(architectures, list):
        raise ModelLoadError(f"{config_file}: 'architectures' must be a list of names, got {architectures!r}")
    resolve_architecture(architectures, raw.get("model_type"))  # raises UnsupportedArchitectureError, listing what we serve
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises ValueError, KeyError, OSError... for a bad config
        raise ModelLoadError(f"cannot parse {config_file}: {e}") from e


def _config_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return _DTYPES.get(value)
    return None


def resolve_dtype(dtype: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """The compute dtype for `--dtype`.

    "auto" on CUDA is config.json's dtype when it is bfloat16 or float16, else bfloat16 (a float32
    checkpoint is served in half precision, as vLLM does: GPU attention kernels are half-only);
    "auto" on CPU is float32 (CPU half-precision matmuls are slow and inexact). Explicit names are
    honoured everywhere.
    """
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        config_dtype = _config_dtype(hf_config)
        return config_dtype if config_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    return _DTYPES[dtype]


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model_dir: str, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0, tp_size: int = 1, tp_rank: int = 0,
               enable_expert_parallel: bool = False, layers: tuple[int, int] | None = None,
               data_parallel: tuple[int, int] = (1, 0), quantization: str | None = None) -> nn.Module:
    """Build the model for `hf_config` on `device` in `dtype` and fill its weights.

    With `tp_size` > 1 the model is tensor-parallel rank `tp_rank`'s shard: its layers keep their
    slice of heads, MLP columns and vocabulary, and each weight loader copies just that slice
    out of the checkpoint tensor.

    `load_format`: "auto" / "safetensors" read `model_dir`'s safetensors files (or its GGUF
    file, dequantized to `dtype`: any quantization the `gguf` package reads); "dummy" draws
    weights from N(0, 0.02) (norm weights 1) with a generator seeded by `seed`, so the same seed
    on the same device gives the same model, and needs nothing but config.json (dummy shards are
    drawn per rank, so dummy weights differ between TP sizes: fine for benchmarks, which is their use).

    `enable_expert_parallel`: the MoE layers' experts are split whole across the `tp_size` ranks
    instead of each expert's columns (refused for a dense model); with `data_parallel` = (cores,
    this core's rank), cores > 1, across the ranks of every data-parallel engine core.

    `layers`: [start, end), one pipeline stage's decoder layers (default: all); the stage builds
    and loads only those (and the embedding on the first stage, final norm and LM head on the last).

    `quantization`: "fp8" serves the dense projections in FP8, quantizing float weights as they
    load; a checkpoint whose config.json carries an FP8 `quantization_config` is served so with or
    without it (`fp8.fp8_scheme`, which refuses every other form).
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    architecture, model_cls = resolve_architecture(getattr(hf_config, "architectures", None),
                                                   getattr(hf_config, "model_type", None))
    scheme = fp8_scheme(quantization, hf_config)
    device = torch.device(device)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, architecture, tp_size, tp_rank, enable_expert_parallel=enable_expert_parallel,
                          layers=layers, data_parallel=data_parallel)
        if scheme is not None:
            turned = quantize_linear_layers(model, scheme)
            logger.info("FP8 (e4m3) weights in %d projections (%s)", turned,
                        "as the checkpoint holds them" if scheme.serialized else "quantized on load")
    gguf_file = gguf_file_of(model_dir)
    if load_format == "dummy":
        _init_dummy(model, seed, device)
    elif gguf_file is not None:
        _load_checkpoint(model, ((gguf_file.name, name, read) for name, read in gguf_tensors(gguf_file, hf_config)),
                         str(gguf_file))
    else:
        _load_checkpoint(model, _safetensors_tensors(Path(model_dir), device), model_dir)
    model.requires_grad_(False)
    return model.eval()


def _init_dummy(model: nn.Module, seed: int, device: torch.device) -> None:
    generator = torch.Generator(device=device).manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():  # a fixed order, so the seed fixes every value
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dtype == FP8_DTYPE:  # drawn in float32, quantized as a checkpoint's would be
                values, scale = quantize_rows(torch.empty(param.shape, device=device).normal_(
                    0.0, 0.02, generator=generator))
                param.copy_(values)
                params[scale_name(name)].copy_(scale)
            elif name.endswith(".input_scale"):
                param.fill_(1.0)
            elif not name.endswith("_scale"):  # FP8 weights' scales: set with them
                param.normal_(0.0, 0.02, generator=generator)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{INDEX_FILE} lists {f.name}, which is missing from {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} holds no *.safetensors weights (nor a .gguf file; other formats are not "
                             "supported; load_format='dummy' needs none)")
    return files


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return str(device)


def _checkpoint_name(model: nn.Module, param_name: str, shard_id) -> str:
    """The checkpoint name of one piece of a (possibly merged) parameter, for error messages."""
    if isinstance(shard_id, tuple):  # one expert of a stacked MoE parameter
        expert, half = shard_id
        return f"{param_name} (expert {expert}{'' if half is None else ', gate' if half == 0 else ', up'})"
    for merged, original, piece in model.stacked_params:
        if shard_id == piece and f".{merged}." in param_name:
            return param_name.replace(f".{merged}.", f".{original}.")
    return param_name


def _param_of(model: nn.Module, name: str) -> tuple[str, object]:
    """(parameter name, piece) that checkpoint tensor `name` fills: one expert of a stacked MoE
    parameter, one piece of a merged projection, or a whole parameter (piece None)."""
    for original, ours in getattr(model, "renamed_modules", ()):
        name = name.replace(f".{original}.", f".{ours}.")
    expert_piece = expert_checkpoint_piece(name)
    if expert_piece is not None:
        return expert_piece
    for merged, original, piece in model.stacked_params:
        if f".{original}." in name:
            return name.replace(f".{original}.", f".{merged}."), piece
    return name, None


def _safetensors_tensors(model_dir: Path,
                         device: torch.device) -> Iterator[tuple[str, str, Callable[[], torch.Tensor]]]:
    """(file name, checkpoint name, read) for every tensor of the directory's safetensors files."""
    for file in _weight_files(model_dir):
        try:
            handle = safe_open(str(file), framework="pt", device=_safetensors_device(device))
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise ModelLoadError(f"cannot open {file.name}: {e}") from e
        with handle:
            for name in handle.keys():
                yield file.name, name, partial(handle.get_tensor, name)


def _load_checkpoint(model: nn.Module, tensors: Iterable[tuple[str, str, Callable[[], torch.Tensor]]],
                     source: str) -> None:
    """Fill every parameter from `tensors`, (file name, checkpoint name, read) triples; a tensor
    is read only when this model (this rank, this pipeline stage) keeps it."""
    params = dict(model.named_parameters())  # tied weights appear once, under the embedding's name
    expected = {(name, shard) for name, p in params.items() for shard in p.shard_ids}
    loaded: set = set()
    unexpected: list[str] = []
    tied = getattr(model, "tie_word_embeddings", False)
    for file_name, name, read in tensors:
        if name.endswith(model.ignored_suffixes) or (tied and name == "lm_head.weight"):
            continue
        ours = model.checkpoint_weight_name(name)
        if ours is None:
            continue  # another pipeline stage's weight
        if name.endswith(KV_CACHE_SCALE_SUFFIXES):
            try:
                load_kv_cache_scale(model, ours, read)
            except ModelLoadError as e:
                raise ModelLoadError(f"{file_name}: {e}") from e
            continue
        param_name, shard_id = _param_of(model, ours)
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        try:
            tensor = read()
            if tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
                raise ModelLoadError("an FP8 tensor where the model holds no FP8 weight (not covered by the "
                                     "checkpoint's quantization_config)")
            with torch.no_grad():
                param.weight_loader(param, tensor, shard_id)
        except ModelLoadError as e:
            raise ModelLoadError(f"{file_name}: {name}: {e}") from e
        loaded.add((param_name, shard_id))
    # An FP8 layer's scales made while quantizing its float weights.
    loaded |= {(name, shard) for name, p in params.items() for shard in getattr(p, "filled_shards", ())}
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:10]) + (" ..." if len(unexpected) > 10 else "")
        raise ModelLoadError(f"checkpoint in {source} has {len(unexpected)} weights the model does not use: {shown}")
    missing = sorted(_checkpoint_name(model, name, shard) for name, shard in expected - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ModelLoadError(f"checkpoint in {source} lacks {len(missing)} weights: {shown}")
