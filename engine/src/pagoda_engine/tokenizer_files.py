"""Loading a model's tokenizer from its directory or GGUF file (transformers' AutoTokenizer): for
the API process and the offline `LLM` (`api.tokenizer`), and for the engine core's grammar engine,
which needs the vocabulary (structured outputs)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pagoda_engine.errors import ModelLoadError
from pagoda_engine.model_path import gguf_file_of

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_dir) -> bool:
    """Whether the directory holds one of the files a tokenizer loads from (a GGUF file does)."""
    path = Path(model_dir).expanduser()
    return gguf_file_of(path) is not None or any((path / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(model_dir):
    """Load the tokenizer of a local model directory or GGUF file (transformers' AutoTokenizer)."""
    path = Path(model_dir).expanduser()
    gguf_file = gguf_file_of(path)
    if gguf_file is not None:
        return _load_gguf_tokenizer(gguf_file)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist or is not a directory")
    if not has_tokenizer(path):
        raise ModelLoadError(
            f"model directory {str(path)!r} has no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types; the user needs one clear message
        raise ModelLoadError(f"cannot load the tokenizer from {str(path)!r}: {e}") from e


def _load_gguf_tokenizer(gguf_file: Path):
    """The tokenizer transformers builds from a GGUF file's metadata. Building it parses the whole
    vocabulary out of the file (seconds), so the result is saved, once per file version, under the
    cache directory and loaded from there afterwards, when loading the saved copy gives the same
    tokenizer: some classes rebuild their pre-tokenizer from their own defaults rather than the
    saved one (Qwen2's splits digits one by one where the GGUF's vocabulary merges them), and
    those are converted from the file every time."""
    from transformers import AutoTokenizer

    from pagoda_engine.tiny import cache_dir

    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "gguf-tokenizers-v2" / f"{gguf_file.stem}-{key}"  # v2: copies that reload the same
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as e:  # the gguf reader and transformers' converters raise many types
        raise ModelLoadError(f"cannot load the tokenizer of {str(gguf_file)!r}: {e}") from e
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
    except OSError as e:  # a read-only home: serve without the cache
        logger.debug("not caching the tokenizer of %s: %s", gguf_file, e)
        return tokenizer
    try:
        tokenizer.save_pretrained(str(tmp))
        if AutoTokenizer.from_pretrained(str(tmp)).backend_tokenizer.to_str() != tokenizer.backend_tokenizer.to_str():
            logger.debug("not caching the tokenizer of %s: its saved copy loads as another tokenizer", gguf_file)
            return tokenizer
        os.rename(tmp, cached)  # atomic; fails when another process saved it first, which is as good
    except OSError as e:
        logger.debug("not caching the tokenizer of %s: %s", gguf_file, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
