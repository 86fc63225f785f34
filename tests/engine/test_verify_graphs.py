"""What speculative decoding's verification graphs (`worker/verify_graphs.py`) decide and compute on
the host, checked without a GPU: which steps they take, at which batch sizes they are captured, and
the padded layout's forward (each request's new tokens in a block of k + 1 rows, padding rows
through every GEMM and norm, their K/V into the null page) giving the packed forward's hidden
states. The attention here is the reference backend over the real rows (the verification kernel's
own test is tests/engine/test_verify_triton_kernel.py); the graphs themselves and greedy output
through them are tests/gpu/test_spec_decode_gpu.py."""

from __future__ import annotations

import pytest
import torch

from pagoda_engine.tiny import build_tiny_model
from pagoda_engine.worker.attention import AttentionBatch
from pagoda_engine.worker.attention.torch_ref import TorchRefBackend
from pagoda_engine.worker.attention.verify_triton import padded_rows
from pagoda_engine.worker.cuda_graphs import graph_batch_sizes, stage_forward
from pagoda_engine.worker.model.loader import load_hf_config, load_model
from pagoda_engine.worker.verify_graphs import (MAX_VERIFY_BATCH, fits_verify, load_verify_rows, verify_batch_sizes,
                                                verify_dummy)

CPU = torch.device("cpu")
PAGE = 4
Q = 5  # k = 4


class PaddedReference(TorchRefBackend):
    """The reference backend behind the padded layout, as `FlashInferBackend.plan_graph_verify`
    plans it: padding rows write their K/V to the null page's first slot; the real rows attend as
    in the packed step. Planned with `plan`, a packed step as the reference runs it."""

    rows = None

    def plan(self, batch: AttentionBatch) -> None:
        super().plan(batch)
        self.rows = None

    def plan_graph_verify(self, batch: AttentionBatch, padded_size: int) -> torch.Tensor:
        self.plan(batch)
        self.rows = torch.from_numpy(padded_rows(batch.query_lens, Q))
        self.size = padded_size * Q
        return self.rows

    def forward(self, layer_id, q, k, v, out=None, positions=None, rotary=None, q_norm=None, k_norm=None):
        if self.rows is None:
            return super().forward(layer_id, q, k, v, out, positions, rotary, q_norm, k_norm)
        assert q.shape[0] == self.size
        padding = torch.ones(self.size, dtype=torch.bool)
        padding[self.rows] = False
        self.write_kv(layer_id, k[padding], v[padding], torch.zeros(int(padding.sum()), dtype=torch.int64))
        r = self.rows
        o = super().forward(layer_id, q[r], k[r], v[r], positions=positions[r], rotary=rotary, q_norm=q_norm,
                            k_norm=k_norm)
        out = torch.zeros_like(q) if out is None else out
        out[r] = o
        return out


@pytest.fixture(scope="module")
def model_and_pages(tmp_path_factory):
    model_dir = str(build_tiny_model(tmp_path_factory.mktemp("verify-graphs") / "model", seed=6))
    model = load_model(model_dir, load_hf_config(model_dir), torch.float32, CPU)
    spec = model.kv_cache_spec(PAGE, torch.float32)
    return model, TorchRefBackend(spec, 40, CPU), PaddedReference(spec, 40, CPU)


def _step(chunks):
    """(ids, positions, batch) of a step of (new tokens, tokens before them, pages) chunks."""
    ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
    for tokens, start, pages in chunks:
        ids += tokens
        positions += range(start, start + len(tokens))
        slots += [pages[p // PAGE] * PAGE + p % PAGE for p in range(start, start + len(tokens))]
        query_lens.append(len(tokens))
        seq_lens.append(start + len(tokens))
        tables.append(pages)
    num_decodes = sum(1 for n, s in zip(query_lens, seq_lens) if n == 1 and s > 1)
    return torch.tensor(ids), torch.tensor(positions), AttentionBatch(query_lens, seq_lens, tables,
                                                                       torch.tensor(slots), num_decodes)


def test_the_padded_layout_gives_the_packed_forwards_hidden_states(model_and_pages):
    """Prompts first (written into both pools alike), then a verification step of three requests
    with 5, 1 (no draft) and 3 new tokens, padded to a graph of 4 requests."""
    model, packed_attn, padded_attn = model_and_pages
    a, b, c = [3 + i for i in range(10)], [20 + i for i in range(7)], [50 + i for i in range(12)]
    prompts = [(a, 0, [1, 2, 3, 4]), (b, 0, [5, 6, 7]), (c, 0, [8, 9, 10, 11])]
    verify = [([61, 62, 63, 64, 65], 10, [1, 2, 3, 4]), ([70], 7, [5, 6, 7]), ([80, 81, 82], 12, [8, 9, 10, 11, 12])]
    with torch.no_grad():
        ids, positions, batch = _step(prompts)
        for attn in (packed_attn, padded_attn):
            attn.plan(batch)
            model(ids, positions, attn)
        ids, positions, batch = _step(verify)
        assert fits_verify(batch, Q, 4)
        packed_attn.plan(batch)
        expected = model(ids, positions, packed_attn)
        padded = 4
        id_buf, pos_buf = torch.full((32,), 7), torch.full((32,), 9)  # stale rows from an earlier step
        rows = padded_attn.plan_graph_verify(batch, padded)
        load_verify_rows(id_buf, pos_buf, ids, positions, rows, padded * Q)
        assert id_buf[:padded * Q].tolist() == [61, 62, 63, 64, 65, 70, 0, 0, 0, 0, 80, 81, 82] + [0] * 7
        assert pos_buf[:padded * Q].tolist() == [10, 11, 12, 13, 14, 7, 0, 0, 0, 0, 12, 13, 14] + [0] * 7
        hidden = stage_forward(model, id_buf[:padded * Q], pos_buf[:padded * Q], padded_attn, None)
        assert hidden.shape[0] == padded * Q
        torch.testing.assert_close(hidden.index_select(0, rows), expected, atol=1e-5, rtol=1e-5)
        # The real pages hold the same K/V after either way through.
        for layer in range(len(model.layers)):
            torch.testing.assert_close(padded_attn.kv_caches[layer][1:], packed_attn.kv_caches[layer][1:])


def test_steps_a_verification_graph_takes():
    def batch(query_lens, seq_lens=None):
        seq_lens = seq_lens or [q + 10 for q in query_lens]
        return AttentionBatch(query_lens, seq_lens, [[1, 2, 3, 4]] * len(query_lens),
                              torch.zeros(sum(query_lens), dtype=torch.int64))

    assert fits_verify(batch([5, 5]), Q, 4)
    assert fits_verify(batch([1, 3]), Q, 4)  # fewer drafts, or none, pad their block
    assert fits_verify(batch([4], [4]), Q, 4)  # a short prompt's whole sequence: the same causal rows
    assert not fits_verify(batch([1, 1]), Q, 4)  # all decodes: the decode graphs
    assert not fits_verify(batch([6]), Q, 4)  # more than k + 1 new tokens
    assert not fits_verify(batch([2] * 5), Q, 4)  # more requests than the largest graph


def test_verification_graphs_are_captured_at_small_decode_sizes_up_to_the_speculation_limit():
    sizes = graph_batch_sizes(512)
    assert verify_batch_sizes(sizes, None) == [s for s in sizes if s <= MAX_VERIFY_BATCH]
    assert verify_batch_sizes(sizes, 3) == [1, 2, 4]  # 4 holds a step of 3 running requests
    assert verify_batch_sizes(sizes, 1000) == verify_batch_sizes(sizes, None)
    dummy = verify_dummy(2, Q, PAGE, CPU)
    assert dummy.query_lens == [Q, Q] and dummy.seq_lens == [Q, Q] and dummy.page_tables == [[0, 0], [0, 0]]
    assert dummy.slot_mapping.tolist() == [0] * 2 * Q
