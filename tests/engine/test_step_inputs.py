"""The runner's step inputs: one host-to-device copy laid out so that every per-token tensor a
kernel reads starts 16 bytes aligned, whatever the step's token count."""

import itertools

import pytest

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.tiny import build_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("llama") / "model", arch="llama", seed=5)
    return LLM(str(model_dir), dtype="float32", num_kv_pages=64, block_size=4)


_FRESH = itertools.count(100, 100)


@pytest.mark.parametrize("prompt_lens", [[7], [6, 9], [1], [4, 4]])
def test_every_segment_starts_16_bytes_aligned(llm, prompt_lens):
    # Triton specialises kernels on pointer alignment: positions 8 bytes off after an odd token
    # count compiled a second rotary kernel on a live step.
    core = llm.core
    fresh = next(_FRESH)  # no prefix-cache hits from an earlier case
    prompts = [[fresh + 20 * i + j for j in range(n)] for i, n in enumerate(prompt_lens)]
    for i, ids in enumerate(prompts):
        core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=ids,
                                           sampling_params=SamplingParams(max_tokens=2)))
    try:
        sched = core.scheduler.schedule()
        assert sched.num_tokens == sum(prompt_lens)
        inputs = core.runner.prepare(sched)
        segments = {"input_ids": inputs.input_ids, "positions": inputs.positions,
                    "slot_mapping": inputs.attn_batch.slot_mapping, "sample_rows": inputs.sample_rows}
        assert {name: t.data_ptr() % 16 for name, t in segments.items()} == dict.fromkeys(segments, 0)
        order = [s.request.request_id for s in inputs.order]
        by_id = dict(zip((f"r{i}" for i in range(len(prompts))), prompts))
        assert inputs.input_ids.tolist() == [t for rid in order for t in by_id[rid]]
        assert inputs.positions.tolist() == [p for rid in order for p in range(len(by_id[rid]))]
        ends = [sum(len(by_id[rid]) for rid in order[:k + 1]) - 1 for k in range(len(order))]
        assert inputs.sample_rows.tolist() == ends
        assert len(inputs.attn_batch.slot_mapping) == sum(prompt_lens)
    finally:
        core.abort_requests([f"r{i}" for i in range(len(prompts))])
    assert not core.has_unfinished_requests()
