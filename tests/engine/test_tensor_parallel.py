"""Tensor parallelism on CPU (gloo, two processes): TP=2 gives the same greedy tokens as TP=1 and
as Hugging Face `generate`, logits within float32 rounding, under chunked prefill and prefix-cache
hits; worker processes end with the engine (close, or the engine's process dying); TP sizes the
model cannot be split by are refused up front."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import transformers

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.errors import EngineDeadError, ModelLoadError
from pagoda_engine.tiny import build_tiny_model
from pagoda_engine.worker.executor import check_tensor_parallel
from test_generate_vs_hf import hf_greedy

NEW_TOKENS = 10
SHARED = [(7 * i + 11) % 500 + 5 for i in range(40)]
PROMPTS = [
    [5, 6, 7],
    SHARED + [9, 10, 11, 12, 13],
    [(3 * i + 1) % 400 + 5 for i in range(70)],  # longer than the TP engine's token budget: chunked
    SHARED + [44, 45],
]
# The TP engine's budget per step: prompts above it are prefilled in chunks, beside decodes.
TP_BUDGET = 24


def _greedy(**kwargs) -> SamplingParams:
    # min_tokens = max_tokens masks EOS exactly as HF's min_new_tokens does.
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, **kwargs)


def _tp1_greedy(model_dir, prompts) -> list[list[int]]:
    llm = LLM(str(model_dir), num_kv_pages=64)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """4 query heads over 2 KV heads: one KV head per rank under TP=2."""
    return build_tiny_model(tmp_path_factory.mktemp("tp-gqa") / "model", seed=3)


@pytest.fixture(scope="module")
def tp_llm(gqa_dir):
    llm = LLM(str(gqa_dir), num_kv_pages=128, tensor_parallel_size=2, max_num_batched_tokens=TP_BUDGET)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def tp1_llm(gqa_dir):
    return LLM(str(gqa_dir), num_kv_pages=128)


def test_a_started_engine_has_its_worker_ranks_collect_again(tp_llm):
    """Worker ranks start with Python's collector paused; the engine turns it back on once it has
    started (the offline LLM does not freeze their heaps, so without that they would never collect)."""
    assert tp_llm.core.executor.collective_rpc("collector_enabled") == [True, True]


def test_tp2_greedy_equals_tp1_and_hf_generate_with_chunked_prefill(tp_llm, tp1_llm, gqa_dir):
    assert tp_llm.core.executor.tp_size == 2 and len(tp_llm.core.executor.worker_pids) == 1
    # Each rank holds half the heads: rank 0's shard has 2 query heads and 1 KV head per page.
    attn = tp_llm.core.executor.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert tp_llm.core.executor.attn.kv_caches[0].shape[3] == 1
    tp2 = [o.outputs[0].token_ids for o in tp_llm.generate(PROMPTS, _greedy())]
    tp1 = [o.outputs[0].token_ids for o in tp1_llm.generate(PROMPTS, _greedy())]
    assert tp2 == tp1
    assert tp2 == hf_greedy(gqa_dir, PROMPTS, NEW_TOKENS)
    assert tp_llm.core.kv.num_free_pages == tp_llm.core.kv.pool.num_pages - 1


def test_tp2_logprobs_match_tp1_within_float32_rounding(tp_llm, tp1_llm):
    params = _greedy(logprobs=5, prompt_logprobs=5)
    tp2 = tp_llm.generate(PROMPTS[:3], params)
    tp1 = tp1_llm.generate(PROMPTS[:3], params)
    compared = 0
    for a, b in zip(tp2, tp1):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos_a, pos_b in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:],
                                b.outputs[0].logprobs + b.prompt_logprobs[1:]):
            assert pos_a.keys() == pos_b.keys()
            for token, lp in pos_a.items():
                assert lp.logprob == pytest.approx(pos_b[token].logprob, abs=1e-4)
                compared += 1
    assert compared > 100


def test_prefix_cache_hit_under_tp2_gives_same_tokens(tp_llm):
    prompts = [SHARED + [60, 61, 62], SHARED + [70]]
    first = [o.outputs[0].token_ids for o in tp_llm.generate(prompts, _greedy())]
    hits_before = tp_llm.core.kv.prefix_hits
    again = tp_llm.generate(prompts, _greedy())
    assert tp_llm.core.kv.prefix_hits > hits_before
    assert all(o.num_cached_tokens >= 32 for o in again)  # the shared 40 tokens fill two 16-token pages
    assert [o.outputs[0].token_ids for o in again] == first


def test_close_ends_workers_and_a_four_kv_head_model_matches(tmp_path):
    """Qwen3 (per-head q/k norms) with 4 KV heads, tied embeddings: 2 KV heads per rank."""
    model_dir = build_tiny_model(tmp_path / "model", arch="qwen3", seed=5,
                                 config_overrides={"num_key_value_heads": 4, "tie_word_embeddings": True})
    prompts = PROMPTS[:2]
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert _tp1_greedy(model_dir, prompts) == expected
    with LLM(str(model_dir), num_kv_pages=64, tensor_parallel_size=2) as llm:
        assert llm.core.executor.model.model.layers[0].self_attn.num_kv_heads == 2
        pids = llm.core.executor.worker_pids
        assert not any(_gone(p) for p in pids)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())] == expected
    assert _wait_gone(pids, timeout_s=5), "worker processes outlived LLM.close()"
    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate(prompts, _greedy())
    llm.close()  # idempotent


def test_a_dead_worker_fails_the_next_step_with_a_clear_error(gqa_dir):
    with LLM(str(gqa_dir), num_kv_pages=64, tensor_parallel_size=2) as llm:
        assert llm.generate([[5, 6, 7]], _greedy())[0].outputs[0].token_ids
        (worker,) = llm.core.executor.worker_pids
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel worker 1 (died|is gone)"):
            llm.generate([[5, 6, 7, 8]], _greedy())
        assert time.monotonic() - started < 30  # a failure, not a wait for the collective timeout


_CHILD = """
import json, sys
from pagoda_engine import LLM, SamplingParams
llm = LLM(sys.argv[1], num_kv_pages=64, tensor_parallel_size=2)
params = SamplingParams(temperature=0, max_tokens={n}, min_tokens={n})
tokens = [o.outputs[0].token_ids for o in llm.generate(json.loads(sys.argv[2]), params)]
print(json.dumps({{"workers": llm.core.executor.worker_pids, "tokens": tokens}}), flush=True)
sys.stdin.read()  # serve until killed
"""


def test_workers_die_with_the_engine_process_and_replicated_kv_heads_match(tmp_path):
    """One KV head (multi-query attention): under TP=2 both ranks hold a copy of it. The engine
    runs in a child process that is SIGKILLed: its worker must not outlive it."""
    model_dir = build_tiny_model(tmp_path / "model", seed=7, config_overrides={"num_key_value_heads": 1})
    prompts = PROMPTS[:2]
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(n=NEW_TOKENS), str(model_dir), json.dumps(prompts)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
        assert _tp1_greedy(model_dir, prompts) == expected
        line = child.stdout.readline()
        assert line, f"the engine process exited with {child.wait()}"
        report = json.loads(line)
        assert report["tokens"] == expected
        assert len(report["workers"]) == 1 and not _gone(report["workers"][0])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert _wait_gone(report["workers"]), "a TP worker outlived its engine process"


def test_tp_that_does_not_divide_heads_is_refused_before_any_worker_starts(gqa_dir):
    children_before = _child_pids()
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size 3 must divide .*num_attention_heads \(4\)"):
        LLM(str(gqa_dir), num_kv_pages=64, tensor_parallel_size=3)
    assert _child_pids() == children_before


def test_a_worker_that_cannot_start_is_a_model_load_error(gqa_dir, monkeypatch):
    # The worker's interpreter exits at once, as a broken install would.
    monkeypatch.setattr(sys, "executable", "/bin/false")
    children_before = _child_pids()
    with pytest.raises(ModelLoadError, match=r"tensor-parallel worker 1 exited \(code 1\) while trying to start"):
        LLM(str(gqa_dir), num_kv_pages=64, tensor_parallel_size=2)
    assert _wait_gone(list(_child_pids() - children_before), timeout_s=5)


@pytest.mark.parametrize("fields, tp, message", [
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 2, r"num_key_value_heads \(3\)"),
    ({"num_attention_heads": 12, "num_key_value_heads": 4}, 6, r"num_key_value_heads \(4\)"),
    ({"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 100}, 8, r"intermediate_size \(100\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2}, 4, r"num_attention_heads \(6\); valid sizes: 1, 2, 3, 6"),
])
def test_shapes_tp_cannot_split_are_clear_errors(fields, tp, message):
    config = transformers.LlamaConfig(hidden_size=96, intermediate_size=fields.pop("intermediate_size", 128), **fields)
    with pytest.raises(ModelLoadError, match=message):
        check_tensor_parallel(config, tp)


def test_shapes_tp_can_split_are_accepted():
    for heads, kv_heads, tp in [(4, 2, 2), (4, 2, 4), (8, 1, 8), (8, 8, 4), (4, 4, 1)]:
        check_tensor_parallel(transformers.LlamaConfig(hidden_size=64, num_attention_heads=heads,
                                                       num_key_value_heads=kv_heads, intermediate_size=128), tp)


def _child_pids() -> set[int]:
    me = str(os.getpid())
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        pids.add(int(entry))
            except OSError:
                pass
    return pids
