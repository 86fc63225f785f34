"""The model's generation_config.json as request defaults (vLLM's `--generation-config`,
`--override-generation-config`): a real `pagoda serve` and the official `openai` client for the
server, the offline `LLM` for the modes, and the refusals of bad options and bad files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from conftest import launch
from pagoda_engine import LLM, SamplingParams
from pagoda_engine.config import EngineConfig
from pagoda_engine.model_path import TINY_MODEL_NAME, resolve_model_path

PROMPT = [5, 6, 7, 8, 9]
MAX_NEW_TOKENS = 6


def model_with_generation_config(directory: Path, **settings) -> Path:
    """The built-in tiny model, copied, its generation_config.json given these settings."""
    shutil.copytree(resolve_model_path(TINY_MODEL_NAME), directory)
    path = directory / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return directory


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory) -> Path:
    """A model whose creator recommends greedy decoding and at most MAX_NEW_TOKENS tokens."""
    return model_with_generation_config(tmp_path_factory.mktemp("gen") / "model", temperature=0.0,
                                        max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def server(greedy_model, tmp_path_factory):
    srv = launch(tmp_path_factory.mktemp("serve"), "--model", str(greedy_model), "--num-kv-pages", "256",
                 "--max-model-len", "256")
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused")


def _tokens(client, **fields) -> list[str]:
    out = client.completions.create(model=None, prompt=PROMPT, logprobs=0, extra_body={"ignore_eos": True}, **fields)
    return out.choices[0].logprobs.tokens


def test_a_request_without_sampling_fields_takes_the_model_s_recommendation(client):
    """Unset temperature: the file's 0 (greedy, whatever the seed); set: the request's."""
    greedy = _tokens(client, temperature=0, max_tokens=MAX_NEW_TOKENS)
    assert _tokens(client, seed=1, max_tokens=MAX_NEW_TOKENS) == greedy
    assert _tokens(client, seed=2, max_tokens=MAX_NEW_TOKENS) == greedy
    sampled = [_tokens(client, temperature=1.5, seed=seed, max_tokens=MAX_NEW_TOKENS) for seed in range(4)]
    assert any(tokens != greedy for tokens in sampled)  # the request's own temperature is used


def test_max_new_tokens_caps_every_request(client):
    """As vLLM: the model's max_new_tokens bounds a request's max_tokens, and a chat request without
    one stops there instead of at the end of the context window."""
    out = client.completions.create(model=None, prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MAX_NEW_TOKENS
    chat = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == MAX_NEW_TOKENS and chat.choices[0].finish_reason == "length"


def test_the_offline_llm_takes_the_same_defaults_and_the_modes(greedy_model):
    auto = LLM(str(greedy_model), num_kv_pages=64)
    try:
        params = auto.get_default_sampling_params()
        assert (params.temperature, params.max_tokens) == (0.0, MAX_NEW_TOKENS)
        want = auto.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
        got = auto.generate([PROMPT])
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    finally:
        auto.close()
    neutral = LLM(str(greedy_model), num_kv_pages=64, generation_config="vllm")
    try:
        assert neutral.get_default_sampling_params() == SamplingParams()
    finally:
        neutral.close()
    overridden = LLM(str(greedy_model), num_kv_pages=64, override_generation_config={"temperature": 0.7, "top_k": 20})
    try:
        params = overridden.get_default_sampling_params()
        assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 20, MAX_NEW_TOKENS)
    finally:
        overridden.close()


def test_another_directory_s_generation_config(greedy_model, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "repetition_penalty": 1.1}))
    llm = LLM(str(greedy_model), num_kv_pages=64, generation_config=str(other))
    try:
        params = llm.get_default_sampling_params()
        assert (params.top_p, params.repetition_penalty, params.temperature, params.max_tokens) == (0.5, 1.1, 1.0, 16)
    finally:
        llm.close()


@pytest.mark.parametrize("options,reason", [
    (dict(override_generation_config='{"temperature": -1}'), "temperature must be >= 0"),
    (dict(override_generation_config='{"do_sample": true}'), "'do_sample' not supported"),
    (dict(override_generation_config="temperature=0.5"), "is not valid JSON"),
    (dict(override_generation_config="[0.5]"), "must be a JSON object"),
    (dict(generation_config="/nonexistent"), "expected auto, vllm, or a directory holding generation_config.json"),
], ids=["bad-value", "unknown-key", "not-json", "not-an-object", "no-such-directory"])
def test_bad_generation_config_options_are_refused(options, reason):
    with pytest.raises(ValueError, match=reason):
        EngineConfig.from_kwargs(model=TINY_MODEL_NAME, **options)


def test_pagoda_serve_refuses_a_bad_override_before_starting():
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", TINY_MODEL_NAME,
                          "--override-generation-config", '{"top_p": 2}'], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "top_p must be in (0, 1]" in out.stderr, out.stderr


def test_a_model_whose_generation_config_cannot_be_served_fails_to_load(tmp_path):
    """A bad recommendation is the model's fault, named at start-up, not a 400 on every request."""
    model = model_with_generation_config(tmp_path / "model", top_k="twenty")
    with pytest.raises(ValueError, match="generation_config.json.*top_k must be.*--generation-config vllm"):
        LLM(str(model), num_kv_pages=64)
    llm = LLM(str(model), num_kv_pages=64, generation_config="vllm")  # the way around it
    llm.close()


def test_pagoda_serve_with_a_bad_model_generation_config_exits_1_with_the_reason(tmp_path):
    model = model_with_generation_config(tmp_path / "model", temperature=-2)
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--host", "127.0.0.1", "--port", "9",
                          "--model", str(model), "--num-kv-pages", "64"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stderr
    assert "temperature must be >= 0" in out.stderr and "Traceback" not in out.stderr, out.stderr
