"""The admission simulation (`python -m pagoda_engine.bench.admission_sim`) on a tiny pool: it
accounts for every computed token, and the growth reservation removes the recomputation."""

from pagoda_engine.bench.admission_sim import simulate


def test_reservation_removes_recomputation_under_kv_pressure():
    reqs = [([(7 * i + j) % 900 + 3 for j in range(64)], 32, None) for i in range(24)]
    off = simulate(reqs, num_pages=40, reserve=False, max_num_seqs=16, budget=512, max_model_len=256)
    on = simulate(reqs, num_pages=40, reserve=True, max_num_seqs=16, budget=512, max_model_len=256)
    assert off["preemptions"] > 0 and off["tokens_recomputed"] > 0
    assert on["preemptions"] == 0 and on["tokens_recomputed"] == 0
    # With a pool that holds everything, the reservation changes nothing.
    assert simulate(reqs, 4096, True, 16, 512, 256) == simulate(reqs, 4096, False, 16, 512, 256)
