"""Multi-LoRA through the whole engine (scheduler, slots, KV pages, runner, the torch path of
`worker/model/lora.py`) against transformers + PEFT on the same tiny random Llama and Qwen2
(q/k/v bias) with adapters PEFT wrote: every adapter's greedy tokens equal PEFT's, in steps that
mix the base model and three adapters, with fewer device slots than adapters, over two pipeline
stages, with speculative decoding verifying drafts under each request's adapter, and with the
prefix cache keyed by adapter."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from lora_adapters import ADAPTERS, peft_greedy, write_adapter  # noqa: E402

from pagoda_engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagoda_engine.errors import InvalidRequestError  # noqa: E402
from pagoda_engine.tiny import build_tiny_model  # noqa: E402

NEW_TOKENS = 10
SHARED = [(7 * i + 11) % 500 + 5 for i in range(40)]
PROMPTS = [SHARED + [9, 10, 11], [5, 6, 7], [(3 * i + 1) % 400 + 5 for i in range(23)], SHARED + [44, 45]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    """(model dir, {adapter name: path}, {None or adapter name: PEFT's tokens for PROMPTS})."""
    root = tmp_path_factory.mktemp(request.param)
    model_dir = build_tiny_model(root / "model", arch=request.param, seed=3)
    paths = {name: write_adapter(model_dir, root / name, *spec, seed=i + 1)
             for i, (name, spec) in enumerate(ADAPTERS.items())}
    expected = {name: peft_greedy(model_dir, paths.get(name), PROMPTS, NEW_TOKENS) for name in [None, *paths]}
    # The adapters change the tokens (else a LoRA path that did nothing would pass).
    assert all(expected[name] != expected[None] for name in paths)
    return model_dir, paths, expected


def _greedy():
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def _requests(paths):
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}


def _llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("max_loras", 3)
    kwargs.setdefault("max_lora_rank", 16)
    return LLM(str(model_dir), dtype="float32", num_kv_pages=128, enable_lora=True, **kwargs)


def test_each_adapter_alone_equals_peft(setup):
    model_dir, paths, expected = setup
    llm = _llm(model_dir)
    for name, lora in _requests(paths).items():
        outs = llm.generate(PROMPTS, _greedy(), lora_request=lora)
        assert [o.outputs[0].token_ids for o in outs] == expected[name], name


def test_one_step_mixes_the_base_and_three_adapters(setup):
    """All of PROMPTS × (base, three adapters) at once: the first step holds rows of all four."""
    model_dir, paths, expected = setup
    llm = _llm(model_dir, max_num_batched_tokens=512)
    loras = _requests(paths)
    names = [None, *loras]
    prompts = [p for _ in names for p in PROMPTS]
    per_prompt = [loras.get(n) for n in names for _ in PROMPTS]
    seen = []
    original = llm.core.runner.prepare

    def record(sched, prev=None):
        inputs = original(sched, prev)
        seen.append(set(inputs.attn_batch.lora_slots or [-1]))
        return inputs

    llm.core.runner.prepare = record
    outs = llm.generate(prompts, _greedy(), lora_request=per_prompt)
    got = [o.outputs[0].token_ids for o in outs]
    for i, name in enumerate(names):
        assert got[i * len(PROMPTS):(i + 1) * len(PROMPTS)] == expected[name], name
    assert len(seen[0]) == 4, seen[0]  # base (-1) and three slots in one step


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_verifies_each_requests_drafts_under_its_adapter(setup, method):
    """The base and three adapters in one batch, speculating: prompt lookup, or the base model
    drafting (a drafting model runs without adapters: its drafts cost acceptance, never output)."""
    model_dir, paths, expected = setup
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if method == "ngram" else
            {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3})
    llm = _llm(model_dir, speculative_config=spec)
    loras = _requests(paths)
    names = [None, *loras]
    outs = llm.generate([p for _ in names for p in PROMPTS], _greedy(),
                        lora_request=[loras.get(n) for n in names for _ in PROMPTS])
    got = [o.outputs[0].token_ids for o in outs]
    for i, name in enumerate(names):
        assert got[i * len(PROMPTS):(i + 1) * len(PROMPTS)] == expected[name], name
    stats = llm.core.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens


def test_pipeline_parallel_stages_each_apply_their_own_layers_adapters(setup):
    """Two stages over gloo, real processes: each rank reads and checks its layers' part of an
    adapter, and every rank gets the step's slots; the base and three adapters in one batch."""
    model_dir, paths, expected = setup
    loras = _requests(paths)
    names = [None, *loras]
    with _llm(model_dir, pipeline_parallel_size=2) as llm:
        outs = llm.generate([p for _ in names for p in PROMPTS], _greedy(),
                            lora_request=[loras.get(n) for n in names for _ in PROMPTS])
    got = [o.outputs[0].token_ids for o in outs]
    for i, name in enumerate(names):
        assert got[i * len(PROMPTS):(i + 1) * len(PROMPTS)] == expected[name], name


def test_more_adapters_than_slots_still_serve(setup):
    """One device slot for three adapters (and a host cache of one): each step runs one adapter,
    the others wait; every request gets its own adapter's tokens."""
    model_dir, paths, expected = setup
    llm = _llm(model_dir, max_loras=1, max_cpu_loras=1)
    loras = _requests(paths)
    names = [*loras, None]
    per_prompt = [loras.get(n) for n in names for _ in PROMPTS]
    original = llm.core.runner.prepare
    distinct = []

    def record(sched, prev=None):
        inputs = original(sched, prev)
        distinct.append(len({s for s in inputs.attn_batch.lora_slots or [] if s >= 0}))
        return inputs

    llm.core.runner.prepare = record
    outs = llm.generate([p for _ in names for p in PROMPTS], _greedy(), lora_request=per_prompt)
    got = [o.outputs[0].token_ids for o in outs]
    for i, name in enumerate(names):
        assert got[i * len(PROMPTS):(i + 1) * len(PROMPTS)] == expected[name], name
    assert max(distinct) == 1


def test_prefix_cache_never_shares_pages_across_adapters(setup):
    """The same prompts under the base, then an adapter, then the base again: the adapter's run
    finds none of the base's pages (its tokens stay PEFT's), the base's second run finds its own."""
    model_dir, paths, expected = setup
    llm = _llm(model_dir)
    lora = _requests(paths)["all7"]
    llm.generate(PROMPTS, _greedy())
    hits = llm.core.kv.prefix_hits
    outs = llm.generate(PROMPTS, _greedy(), lora_request=lora)
    assert [o.outputs[0].token_ids for o in outs] == expected["all7"]
    # Only the adapter's own shared 40-token prefix (two full pages of 16) hits, between its prompts.
    assert llm.core.kv.prefix_hits - hits == 32
    hits = llm.core.kv.prefix_hits
    outs = llm.generate(PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == expected[None]
    assert llm.core.kv.prefix_hits > hits


def test_adapters_that_do_not_fit_are_refused_by_name(setup, tmp_path):
    import json
    import shutil

    model_dir, paths, _ = setup
    llm = _llm(model_dir, max_lora_rank=8)
    cases = {}
    cases["missing"] = (str(tmp_path / "nowhere"), "is not a directory")
    too_big = tmp_path / "too_big"
    shutil.copytree(paths["mlp"], too_big)  # rank 16 over --max-lora-rank 8
    cases["too_big"] = (str(too_big), "rank 16 exceeds --max-lora-rank 8")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(paths["qv"], no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    cases["no_weights"] = (str(no_weights), "adapter_model.safetensors is missing")
    lm_head = tmp_path / "lm_head"
    shutil.copytree(paths["qv"], lm_head)
    cfg = json.loads((lm_head / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "lm_head"]
    (lm_head / "adapter_config.json").write_text(json.dumps(cfg))
    cases["lm_head"] = (str(lm_head), "target modules ['lm_head'] are not served")
    other_base = tmp_path / "other_base"
    other_model = build_tiny_model(tmp_path / "wide", arch="llama", seed=1, config_overrides={"hidden_size": 96})
    write_adapter(other_model, other_base, 4, 8, False, ["q_proj"], seed=9)
    cases["other_base"] = (str(other_base), "an adapter of another base model")
    for i, (name, (path, reason)) in enumerate(cases.items()):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate([[5, 6, 7]], _greedy(), lora_request=LoRARequest(name, 10 + i, path))
        assert f"LoRA adapter {name!r}" in str(info.value) and reason in str(info.value), str(info.value)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        LLM(str(model_dir), dtype="float32", num_kv_pages=32).generate(
            [[5, 6]], _greedy(), lora_request=LoRARequest("all7", 1, paths["all7"]))


def test_tensor_parallel_shards_the_adapters_like_their_layers(setup):
    """Two ranks over gloo: q/k/v and gate/up keep B's rows of their shard, o and down A's columns
    (their partial products joining the layer's all-reduce); every adapter's tokens stay PEFT's."""
    model_dir, paths, expected = setup
    loras = _requests(paths)
    names = [None, *loras]
    with _llm(model_dir, tensor_parallel_size=2) as llm:
        # An adapter every rank refuses is refused, and the ranks serve on.
        with pytest.raises(InvalidRequestError, match="LoRA adapter 'gone': '/nowhere' is not a directory"):
            llm.generate([[5, 6]], _greedy(), lora_request=LoRARequest("gone", 9, "/nowhere"))
        outs = llm.generate([p for _ in names for p in PROMPTS], _greedy(),
                            lora_request=[loras.get(n) for n in names for _ in PROMPTS])
    got = [o.outputs[0].token_ids for o in outs]
    for i, name in enumerate(names):
        assert got[i * len(PROMPTS):(i + 1) * len(PROMPTS)] == expected[name], name


def test_kv_events_carry_the_adapter(setup):
    model_dir, paths, _ = setup
    llm = _llm(model_dir)
    llm.core.kv.pool.record_events()
    lora = _requests(paths)["qv"]
    llm.generate([PROMPTS[0]], _greedy(), lora_request=lora)
    llm.generate([PROMPTS[0]], _greedy())
    stored = [e for e in llm.core.kv.pool.take_events() if type(e).__name__ == "BlockStored"]
    adapter = [e for e in stored if e.lora_name is not None]
    base = [e for e in stored if e.lora_name is None]
    assert adapter and base and len(adapter) + len(base) == len(stored)
    for e in adapter:
        assert (e.lora_id, e.lora_name) == (lora.lora_int_id, "qv")
        assert e.extra_keys == [("qv",)] * len(e.block_hashes)
    for e in base:
        assert (e.lora_id, e.extra_keys) == (None, [None] * len(e.block_hashes))
    hashes = [{h for e in events for h in e.block_hashes} for events in (adapter, base)]
    assert not hashes[0] & hashes[1]  # the same tokens, other pages
