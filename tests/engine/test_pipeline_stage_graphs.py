"""What CUDA graphs per pipeline stage decide and compute on the host, checked without a GPU: a
stage's piecewise segments over fixed buffers (the first stage's from the token ids, a later one's
from the (x, residual) received into its fixed input) chain into the whole model's forward; the
engine keeps graphs on under pipeline parallelism; PAGODA_DIST_BACKEND picks the process groups'
backend; a group that stages CUDA tensors through host memory uses CPU tensors as they are.
The graphs themselves, and PP=2 with them on one GPU, are tests/gpu/test_pp_graphs_gpu.py."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from pagoda_engine.config import EngineConfig, graphs_unavailable
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.tiny import build_tiny_model
from pagoda_engine.worker.attention import AttentionBatch
from pagoda_engine.worker.attention.torch_ref import TorchRefBackend
from pagoda_engine.worker.cuda_graphs import SegmentBuffers, stage_forward
from pagoda_engine.worker.model.layers import TPGroup
from pagoda_engine.worker.model.loader import load_hf_config, load_model
from pagoda_engine.worker.parallel_state import DIST_BACKEND_ENV, dist_backend

CPU = torch.device("cpu")
PAGE = 4
SIZE = 32  # the fixed buffers' rows: every step pads to them


@pytest.fixture(scope="module")
def whole_and_stages(tmp_path_factory):
    """A three-layer model whole and split 2 + 1 as PP=2 splits it, each with its own KV pages."""
    model_dir = str(build_tiny_model(tmp_path_factory.mktemp("pp-graphs") / "model", seed=4,
                                     config_overrides={"num_hidden_layers": 3}))
    config = load_hf_config(model_dir)

    def with_pages(layers):
        model = load_model(model_dir, config, torch.float32, CPU, layers=layers)
        return model, TorchRefBackend(model.kv_cache_spec(PAGE, torch.float32), 32, CPU)

    return with_pages(None), [with_pages((0, 2)), with_pages((2, 3))]


def _step(chunks: list[tuple[list[int], int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
    """(token ids, positions, attention batch) of a step: each chunk is (new tokens, tokens before
    them, the request's pages); decodes first."""
    ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
    for tokens, start, pages in chunks:
        ids += tokens
        positions += range(start, start + len(tokens))
        slots += [pages[p // PAGE] * PAGE + p % PAGE for p in range(start, start + len(tokens))]
        query_lens.append(len(tokens))
        seq_lens.append(start + len(tokens))
        tables.append(pages)
    num_decodes = sum(1 for n, s in zip(query_lens, seq_lens) if n == 1 and s > 1)
    batch = AttentionBatch(query_lens, seq_lens, tables, torch.tensor(slots), num_decodes)
    return torch.tensor(ids), torch.tensor(positions), batch


def _segments(buffers: SegmentBuffers, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The piecewise graphs' way through one stage, run eagerly over its fixed buffers."""
    n = ids.shape[0]
    buffers.load(ids, positions, SIZE)
    for i in range(buffers.num_segments - 1):
        buffers.segment(i, SIZE)
        buffers.attend(i, n)
    return buffers.segment(buffers.num_segments - 1, SIZE)


def test_stage_segments_chain_through_the_fixed_input_into_the_whole_forward(whole_and_stages):
    (whole, whole_attn), stages = whole_and_stages
    buffers = [SegmentBuffers(model, attn, CPU, max_tokens=SIZE) for model, attn in stages]
    # Only the later stage reads a received (x, residual); each stage runs its own layers.
    assert buffers[0].received is None and buffers[1].received.view(SIZE).shape == (2, SIZE, whole.config.hidden_size)
    assert [b.num_segments for b in buffers] == [3, 2]
    a, b, c = [5 + i for i in range(11)], [40 + i for i in range(9)], [90 + i for i in range(6)]
    steps = [[(a, 0, [1, 2, 3]), (b, 0, [4, 5, 6])],  # two prompts (20 tokens, padded to 32)
             [([7], 11, [1, 2, 3]), ([8], 9, [4, 5, 6]), (c, 0, [7, 8])]]  # two decodes and a new prompt
    with torch.no_grad():
        for chunks in steps:
            ids, positions, batch = _step(chunks)
            n = ids.shape[0]
            for attn in (whole_attn, *(attn for _, attn in stages)):
                attn.plan(batch)
            expected = whole(ids, positions, whole_attn)
            sent = _segments(buffers[0], ids, positions)
            assert sent.shape == (2, SIZE, whole.config.hidden_size)  # the padded rows go along
            buffers[1].received.view(SIZE).copy_(sent)  # what the stage-to-stage receive does
            hidden = _segments(buffers[1], ids, positions)
            torch.testing.assert_close(hidden[:n], expected, atol=1e-5, rtol=1e-5)
            # The eager forward every stage runs for longer steps: the same chain, unpadded.
            first = stage_forward(stages[0][0], ids, positions, stages[0][1], None)
            assert first.shape == (2, n, whole.config.hidden_size)
            torch.testing.assert_close(stage_forward(stages[1][0], ids, positions, stages[1][1], first), expected,
                                       atol=1e-5, rtol=1e-5)


def test_a_stages_layers_are_its_own_made_once_and_not_registered_again(whole_and_stages):
    """The piecewise graphs ask for a layer 32 times a step: `layers` must not rebuild a
    ModuleList each time, nor add the layers to the model a second time (state dict, `.to()`)."""
    (whole, _), [(first, _), (second, _)] = whole_and_stages
    assert whole.layers is whole.layers and len(whole.layers) == 3
    assert first.layers == tuple(first.model.layers[0:2]) and second.layers == (second.model.layers[2],)
    assert first.layers is first.layers
    assert not any(name.startswith("layers.") for name in first.state_dict())  # only under model.layers


def test_pipeline_parallelism_keeps_cuda_graphs_and_only_what_cannot_capture_runs_eagerly():
    pp = EngineConfig.from_kwargs(pipeline_parallel_size=2, tensor_parallel_size=2)
    assert graphs_unavailable(pp, "nccl") is None
    assert graphs_unavailable(EngineConfig.from_kwargs(pipeline_parallel_size=2), "gloo") is None
    # Tensor parallelism over gloo: the all-reduces inside the graphs would pass through the host.
    assert "all-reduces pass through host memory" in graphs_unavailable(pp, "gloo")
    across = EngineConfig.from_kwargs(enable_expert_parallel=True, data_parallel_size=2)
    assert "unless --cudagraph-mode FULL_DECODE_ONLY" in graphs_unavailable(across, "nccl")  # opt-in
    asked = EngineConfig.from_kwargs(enable_expert_parallel=True, data_parallel_size=2,
                                     cudagraph_mode="FULL_DECODE_ONLY")
    assert graphs_unavailable(asked, "nccl") is None  # decode steps padded alike on every core
    staged = EngineConfig.from_kwargs(enable_expert_parallel=True, data_parallel_size=2, pipeline_parallel_size=2,
                                      cudagraph_mode="FULL_DECODE_ONLY")
    assert "expert parallelism across data-parallel engine cores" in graphs_unavailable(staged, "nccl")


def test_dist_backend_is_nccl_on_cuda_unless_gloo_is_asked_for(monkeypatch):
    monkeypatch.delenv(DIST_BACKEND_ENV, raising=False)
    assert (dist_backend("cuda"), dist_backend("cpu")) == ("nccl", "gloo")
    monkeypatch.setenv(DIST_BACKEND_ENV, "Gloo")
    assert (dist_backend("cuda"), dist_backend("cpu")) == ("gloo", "gloo")
    monkeypatch.setenv(DIST_BACKEND_ENV, "nccl")
    # Host-side groups (the cores' token counts) stay on gloo whatever is asked for the devices.
    assert (dist_backend("cuda"), dist_backend("cpu")) == ("nccl", "gloo")
    monkeypatch.setenv(DIST_BACKEND_ENV, "mpi")
    with pytest.raises(ModelLoadError, match="must be one of nccl, gloo"):
        dist_backend("cuda")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA GPU")])])
def test_a_group_that_stages_cuda_tensors_on_the_host_gives_every_result_on_the_callers_device(device):
    """Two members of a real gloo group, in threads (on one GPU for cuda): every operation gives
    its result in place (in the caller's tensor) or on the caller's device. A CPU tensor is used
    as it is (a receive's work is the backend's own); a CUDA one goes through a host copy, which
    gloo's send and recv need (they hand the tensor's pointer to the TCP transport)."""
    device = torch.device(device)
    store = dist.HashStore()
    results, errors = {}, []

    def member(rank: int) -> None:
        try:
            backend = dist.ProcessGroupGloo(dist.PrefixStore("staged", store), rank, 2, datetime.timedelta(seconds=30))
            group = TPGroup(backend, rank, 2, stages_on_host=True)
            summed = torch.full((3,), float(rank + 1), device=device)
            assert group.all_reduce(summed) is summed
            shared = torch.full((2,), float(rank), dtype=torch.bfloat16, device=device)
            assert group.broadcast(shared, src=1) is shared
            gathered = group.all_gather(torch.full((2,), float(rank), device=device))
            scattered = group.reduce_scatter(torch.arange(4.0, device=device) * (rank + 1))
            received = None
            if rank == 0:
                group.send(torch.arange(4.0, device=device), 1)
            else:
                received = torch.empty(4, device=device)
                work = group.recv_async(received, 0)
                assert isinstance(work, dist.Work) == (device.type == "cpu")
                work.wait()
            results[rank] = (summed, shared, gathered, scattered, received)
        except Exception as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for rank in (0, 1):
        summed, shared, gathered, scattered, _ = results[rank]
        assert {t.device.type for t in (summed, shared, *gathered, scattered)} == {device.type}
        assert summed.tolist() == [3.0] * 3 and shared.tolist() == [1.0, 1.0]
        assert [g.tolist() for g in gathered] == [[0.0, 0.0], [1.0, 1.0]]
        assert scattered.tolist() == ([0.0, 3.0] if rank == 0 else [6.0, 9.0])  # rows of 3 × arange(4)
    assert results[1][4].device.type == device.type and results[1][4].tolist() == [0.0, 1.0, 2.0, 3.0]
