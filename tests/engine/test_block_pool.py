"""Block pool and KV manager: LRU free order, chained hashes, reference counts, allocation."""

import pytest

from pagoda_engine.core.request import Request
from pagoda_engine.core.kv.block_pool import NULL_PAGE_ID, BlockPool, hash_page
from pagoda_engine.core.kv.manager import KVCacheManager
from pagoda_engine.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(**params))


def test_null_page_is_never_handed_out():
    pool = BlockPool(5)
    pages = pool.get_new_pages(4)
    assert NULL_PAGE_ID not in [p.page_id for p in pages]
    assert pool.num_free_pages == 0
    with pytest.raises(RuntimeError):
        pool.get_new_pages(1)


def test_free_queue_hands_out_least_recently_freed_first():
    pool = BlockPool(5)
    a, b, c, d = pool.get_new_pages(4)
    pool.free_pages([c, a])
    pool.free_pages([d])
    assert [p.page_id for p in pool.get_new_pages(3)] == [c.page_id, a.page_id, d.page_id]


def test_ref_counts_keep_shared_pages_out_of_the_free_queue():
    pool = BlockPool(4)
    (page,) = pool.get_new_pages(1)
    pool.touch([page])
    assert page.ref_cnt == 2
    pool.free_pages([page])
    assert pool.num_free_pages == 2
    pool.free_pages([page])
    assert pool.num_free_pages == 3 and page.ref_cnt == 0
    with pytest.raises(AssertionError):
        pool.free_pages([page])


def test_hash_chain_depends_on_every_earlier_page():
    h1 = hash_page(None, [1, 2, 3, 4])
    assert hash_page(h1, [5, 6, 7, 8]) != hash_page(hash_page(None, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert hash_page(h1, [5, 6, 7, 8]) == hash_page(hash_page(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_page(None, [1, 2, 3, 4], b"salt") != h1


def test_freed_page_stays_a_cache_hit_until_reused():
    pool = BlockPool(3)
    (page,) = pool.get_new_pages(1)
    pool.cache_page(page, b"h" * 16)
    pool.free_pages([page])
    assert pool.get_cached_page(b"h" * 16) is page
    pool.get_new_pages(2)  # the other free page first, then this one: evicted
    assert pool.get_cached_page(b"h" * 16) is None and page.page_hash is None


def test_manager_prefix_lookup_reuses_full_pages_and_leaves_last_token():
    kv = KVCacheManager(num_pages=16, page_size=4)
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.free(a)
    b = _req("b", list(range(12)))  # identical prompt: 2 full pages hit, the last page is recomputed
    pages, num_cached = kv.get_computed_pages(b)
    assert num_cached == 8 and [p.page_id for p in pages] == kv_page_ids_of(kv, pages)
    c = _req("c", list(range(8)) + [99, 98, 97, 96, 95])
    _, cached_c = kv.get_computed_pages(c)
    assert cached_c == 8
    d = _req("d", [1] + list(range(1, 12)))
    assert kv.get_computed_pages(d)[1] == 0


def kv_page_ids_of(kv, pages):
    return [p.page_id for p in pages]


def test_allocate_slots_fails_cleanly_when_pool_is_short():
    kv = KVCacheManager(num_pages=4, page_size=4)  # 3 usable pages
    a = _req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    b = _req("b", list(range(50, 60)))
    free_before = kv.num_free_pages
    assert not kv.allocate_slots(b, 10)
    assert kv.num_free_pages == free_before and "b" not in kv.req_pages
    kv.free(a)
    assert kv.num_free_pages == 3 and kv.usage() == 0.0


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_pages=8, page_size=4, enable_caching=False)
    a = _req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.get_computed_pages(_req("b", list(range(9))))[1] == 0


def test_tier_stores_are_reported_as_one_event_per_chained_run():
    from pagoda_engine.core.kv.block_pool import PageTokens
    from pagoda_engine.kv_event_wire import block_hash_int
    from pagoda_engine.lora import LoRARequest

    pool = BlockPool(4)
    pool.record_events()
    a = [hash_page(None, [1, 2])]
    a.append(hash_page(a[0], [3, 4]))
    b = hash_page(None, [5, 6])
    lora = LoRARequest("ada", 1, "/nowhere")
    c = hash_page(a[1], [7, 8], b"ada")
    pool.record_pages_stored([a[0], a[1], b, c], [PageTokens(None, (1, 2)), PageTokens(a[0], (3, 4)),
                                                  PageTokens(None, (5, 6)), PageTokens(a[1], (7, 8), lora)], "CPU")
    pool.record_removed([b, c], "CPU")
    first, second, third, removed = pool.take_events()
    # a's two pages chain: one event; b starts another chain; c chains to a but under an adapter.
    assert first.block_hashes == [block_hash_int(h) for h in a] and first.parent_block_hash is None
    assert first.token_ids == [1, 2, 3, 4] and first.block_size == 2 and first.medium == "CPU"
    assert second.block_hashes == [block_hash_int(b)] and second.token_ids == [5, 6]
    assert third.parent_block_hash == block_hash_int(a[1]) and third.lora_name == "ada"
    assert third.extra_keys == [("ada",)]
    assert removed.block_hashes == [block_hash_int(b), block_hash_int(c)] and removed.medium == "CPU"
    assert pool.take_events() == []
