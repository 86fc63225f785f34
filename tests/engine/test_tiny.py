"""The built-in tiny model: complete, loadable by transformers, deterministic, safe to build in parallel."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pagoda_engine import tiny
from pagoda_engine.tiny import DEFAULT_MODEL_NAME, STAMP_FILE, build_tiny_model, default_model_dir

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def file_hashes(model_dir) -> dict[str, str]:
    return {
        name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
        for name in sorted(os.listdir(model_dir))
    }


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def test_directory_holds_a_complete_hf_model(llama_dir):
    names = set(os.listdir(llama_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    config = AutoConfig.from_pretrained(llama_dir)
    assert config.model_type == "llama"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 2048
    assert config.vocab_size == len(tokenizer)
    assert 400 <= len(tokenizer) <= 512
    assert config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("</s>")
    assert config.bos_token_id == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<s>")
    for token in ("<|im_start|>", "<|im_end|>", "<pad>"):
        assert token in tokenizer.all_special_tokens
    generation = json.loads((llama_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    # Other readers find the chat template in tokenizer_config.json.
    assert "<|im_start|>" in json.loads((llama_dir / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_loads_in_transformers_and_runs(tmp_path, arch):
    model_dir = build_tiny_model(tmp_path / arch, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == arch
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tokenizer.encode("The quick brown fox")])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_overrides_seed_and_dtype_are_applied(tmp_path, llama_dir):
    model_dir = build_tiny_model(
        tmp_path / "m", seed=1, dtype="bfloat16", config_overrides={"num_hidden_layers": 3, "rope_theta": 500000.0}
    )
    config = AutoConfig.from_pretrained(model_dir)
    assert config.num_hidden_layers == 3
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        keys = list(f.keys())
        assert any("layers.2." in k for k in keys)
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
        other_seed = f.get_tensor("model.embed_tokens.weight").float()
    with safe_open(llama_dir / "model.safetensors", "pt") as f:
        seed0 = f.get_tensor("model.embed_tokens.weight")
    assert not torch.allclose(other_seed, seed0.to(torch.bfloat16).float())


def test_rebuild_with_same_arguments_reuses_the_directory(llama_dir):
    before = {name: (llama_dir / name).stat().st_mtime_ns for name in os.listdir(llama_dir)}
    assert build_tiny_model(llama_dir) == llama_dir
    assert {name: (llama_dir / name).stat().st_mtime_ns for name in os.listdir(llama_dir)} == before


def test_refuses_a_foreign_or_differently_built_directory(tmp_path, llama_dir):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_model(foreign)
    with pytest.raises(FileExistsError):
        build_tiny_model(llama_dir, seed=7)
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="dtype"):
        build_tiny_model(tmp_path / "x", dtype="int8")


def test_default_model_is_identical_on_every_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "a"))
    first = default_model_dir()
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "b"))
    second = default_model_dir()
    assert first != second and first.name == second.name
    assert first.parent == tmp_path / "a"
    hashes = file_hashes(first)
    assert "model.safetensors" in hashes and "tokenizer.json" in hashes
    assert hashes == file_hashes(second)
    assert default_model_dir() == second  # cached: no rebuild
    assert file_hashes(second) == hashes


_BUILD_SCRIPT = textwrap.dedent(
    """
    import sys
    from pagoda_engine.tiny import build_tiny_model, default_model_dir
    path = default_model_dir() if sys.argv[1] == "default" else build_tiny_model(sys.argv[1])
    print(path)
    """
)


def test_two_processes_building_one_directory_do_not_corrupt_it(tmp_path, llama_dir):
    # One goes through default_model_dir (file lock), the other builds the same path directly
    # (no lock), so both may build at once and race on the final rename.
    env = dict(os.environ, PAGODA_CACHE_DIR=str(tmp_path))
    target = tmp_path / DEFAULT_MODEL_NAME
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILD_SCRIPT, arg], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for arg in ("default", str(target))
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for proc, (stdout, stderr) in zip(procs, results):
        assert proc.returncode == 0, stderr
        assert stdout.strip().splitlines()[-1] == str(target)
    assert file_hashes(target) == file_hashes(llama_dir)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # no temp build left


def test_a_builder_that_loses_the_rename_race_uses_the_winners_build(tmp_path, monkeypatch, llama_dir):
    target = tmp_path / "shared"
    real_build_into = tiny._build_into

    def build_while_another_process_finishes_first(out, *args):
        real_build_into(out, *args)
        monkeypatch.setattr(tiny, "_build_into", real_build_into)
        build_tiny_model(target)  # the other builder wins

    monkeypatch.setattr(tiny, "_build_into", build_while_another_process_finishes_first)
    assert build_tiny_model(target) == target
    assert file_hashes(target) == file_hashes(llama_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]


def test_stale_default_model_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    stale = tmp_path / DEFAULT_MODEL_NAME
    stale.mkdir()
    (stale / STAMP_FILE).write_text(json.dumps({"format": 0}))
    (stale / "config.json").write_text("{}")
    path = default_model_dir()
    assert file_hashes(path) == file_hashes(build_tiny_model(tmp_path / "fresh"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["fresh", path.name]
