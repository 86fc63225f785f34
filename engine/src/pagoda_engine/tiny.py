"""The built-in tiny model: a complete Hugging Face model directory built locally, no download.

Owns `build_tiny_model` (tests, CI) and `default_model_dir` (the cached copy that `--model
pagoda-tiny` serves). The model is random-weighted but real in every other
respect: a byte-level BPE tokenizer trained on the bundled corpus (multi-byte UTF-8 included),
a ChatML chat template, a transformers config for one of the served architectures, safetensors
weights and a generation config. Every build with the same arguments gives the same bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from pagoda_engine import envs

# The stamp's recipe hash catches changes to the corpus, special tokens, template and sizes;
# bump this when the build code changes what it writes, so cached builds are not reused.
TINY_FORMAT_VERSION = 1
DEFAULT_MODEL_NAME = f"tiny-llama-v{TINY_FORMAT_VERSION}"
STAMP_FILE = "pagoda_tiny.json"
VOCAB_SIZE = 512

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
# transformers loads a qwen2 directory with Qwen2Tokenizer whatever tokenizer_config.json says,
# and that class adds <|endoftext|> unless the vocabulary has it: without it the tokenizer
# would be one token larger than the model's embedding.
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END, ENDOFTEXT]  # ids 0..5, in this order

CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Small enough to run a forward pass in milliseconds on one CPU core, big enough to have
# grouped-query attention (4 query heads over 2 KV heads) and more than one layer.
_BASE_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# The MoE architectures' expert settings at the tiny model's scale (transformers' defaults are
# full-size: Qwen2-MoE would have 60 experts of 1,408).
_MOE_CONFIG = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
}

_DTYPES = ("float32", "float16", "bfloat16")


def _config_class(arch: str):
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    return classes[arch]


def corpus_text() -> str:
    """The bundled training text of the tiny tokenizer (also handy as test prompts)."""
    return resources.files("pagoda_engine").joinpath("data/tiny_corpus.txt").read_text(encoding="utf-8")


def _train_tokenizer():
    """Byte-level BPE, so every string (any script, emoji) encodes and multi-byte characters
    are split across tokens: the case incremental detokenization must get right."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama-style: plain encoding of a prompt starts with <s>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _save_tokenizer(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END, ENDOFTEXT],
        clean_up_tokenization_spaces=False,
        model_max_length=_BASE_CONFIG["max_position_embeddings"],
    )
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(str(out))
    # Recent transformers keeps the template in chat_template.jinja and names its own backend
    # class; other readers (older transformers, other engines) look in tokenizer_config.json
    # and know the class as PreTrainedTokenizerFast, which every version maps to tokenizer.json.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHATML_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _build_into(out: Path, arch: str, seed: int, dtype: str, config_overrides: dict) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig

    tok = _train_tokenizer()
    _save_tokenizer(tok, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}

    config_cls, model_cls = _config_class(arch)
    fields = dict(_BASE_CONFIG)
    fields.update(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    fields.update(_MOE_CONFIG.get(arch, {}))
    fields.update(config_overrides)
    config = config_cls(**fields)

    torch_dtype = getattr(torch, dtype)
    # Initialise on a private generator state so the weights depend on `seed` only, not on
    # whatever the caller's process did with the global RNG before.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(torch_dtype).eval()
    # A chat model ends its turn with <|im_end|>; plain completion ends with </s>.
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[PAD]
    )
    with _no_progress_bars():
        model.save_pretrained(str(out), safe_serialization=True)


@contextlib.contextmanager
def _no_progress_bars():
    """A one-shard save needs no progress bar on the first `pagoda serve`'s console."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _recipe_hash() -> str:
    """Changes whenever the inputs of a build change, so stale builds are never reused."""
    recipe = json.dumps([corpus_text(), SPECIAL_TOKENS, CHATML_TEMPLATE, _BASE_CONFIG, VOCAB_SIZE])
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def _stamp(arch: str, seed: int, dtype: str, config_overrides: dict) -> dict:
    return {
        "format": TINY_FORMAT_VERSION,
        "recipe": _recipe_hash(),
        "arch": arch,
        "seed": seed,
        "dtype": dtype,
        "config_overrides": json.loads(json.dumps(config_overrides, sort_keys=True, default=str)),
    }


def _read_stamp(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def build_tiny_model(
    out_dir,
    arch: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    config_overrides: dict | None = None,
) -> Path:
    """Write the tiny model into `out_dir` (absent or empty) and return its path.

    Safe to call concurrently for the same directory from several processes: each builds in a
    private temp dir beside it and renames it into place; the first rename wins and the others
    use its result. Calling again with the same arguments returns the existing build.
    """
    out_dir = Path(out_dir).expanduser().absolute()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    _config_class(arch)  # validates arch before any work
    overrides = dict(config_overrides or {})
    stamp = _stamp(arch, seed, dtype, overrides)

    def existing() -> Path | None:
        if out_dir.is_dir() and any(out_dir.iterdir()):
            found = _read_stamp(out_dir)
            if found != stamp:
                raise FileExistsError(
                    f"{out_dir} is not empty and does not hold a tiny model built with {stamp} "
                    f"(found {found}); pass an empty or new directory"
                )
            return out_dir
        return None

    if existing():
        return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _build_into(tmp, arch, seed, dtype, overrides)
        # The stamp goes in last: a directory with a stamp is complete.
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, sort_keys=True, indent=2) + "\n")
        # mkdtemp and some writers create owner-only modes; a shared cache must be readable.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            # rename(2) onto an absent or empty directory is atomic; onto a non-empty one it
            # fails, which means another builder got there first.
            os.rename(tmp, out_dir)
        except OSError:
            if not existing():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def cache_dir() -> Path:
    """Where Pagoda keeps built artefacts: $PAGODA_CACHE_DIR, else ~/.cache/pagoda."""
    return envs.cache_dir()


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_model_dir() -> Path:
    """The tiny Llama model `--model pagoda-tiny` serves; built on first use.

    The lock makes concurrent first uses wait for one build instead of all building."""
    path = cache_dir() / DEFAULT_MODEL_NAME
    expected = _stamp("llama", 0, "float32", {})
    if _read_stamp(path) == expected:
        return path
    with _file_lock(path.parent / f"{DEFAULT_MODEL_NAME}.lock"):
        if path.exists() and _read_stamp(path) != expected:
            # Built by an older Pagoda (or half-written by hand): move it aside in one rename so
            # no reader sees a half-deleted model, then delete it.
            stale = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale-", dir=path.parent))
            os.rename(path, stale / path.name)
            shutil.rmtree(stale, ignore_errors=True)
        return build_tiny_model(path)
