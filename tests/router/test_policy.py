"""The routing policies as pure functions: who gets the next request."""

import collections

import pytest

from pagoda_engine.router.backends import BackendConfigError, parse_backend_list, parse_engine_metrics
from pagoda_engine.router.discovery import parse_k8s_service, slice_urls
from pagoda_engine.router.policy import BackendView, PrefixAware, make_policy, prefix_key

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


def test_round_robin_visits_every_replica_in_turn():
    rr = make_policy("round-robin")
    views = [BackendView(A), BackendView(B), BackendView(C)]
    picks = [rr.choose(views, None) for _ in range(6)]
    assert picks == [A, B, C, A, B, C]


def test_least_load_prefers_fewest_waiting_plus_running_then_kv_usage():
    ll = make_policy("least-load")
    assert ll.choose([BackendView(A, running=3, waiting=2), BackendView(B, running=4)], None) == B
    assert ll.choose([BackendView(A, running=2, kv_usage=0.9), BackendView(B, running=2, kv_usage=0.1)], None) == B
    # the router's own in-flight count is fresher than a scrape
    assert ll.choose([BackendView(A, in_flight=5), BackendView(B, running=1)], None) == B


def test_prefix_key_chains_pages_so_a_shared_prefix_shares_leading_hashes():
    shared = "x" * 640
    k1, k2 = prefix_key(shared + "alpha" * 20, 64), prefix_key(shared + "omega" * 20, 64)
    assert k1.page_hashes[:10] == k2.page_hashes[:10]
    assert k1.page_hashes[10] != k2.page_hashes[10]
    assert prefix_key("hi").page_hashes == prefix_key("hi").page_hashes
    assert prefix_key("hi").page_hashes != prefix_key("ho").page_hashes


def test_prefix_aware_sends_a_remembered_prefix_back_to_its_replica():
    pa = PrefixAware(load_factor=1.25)
    views = [BackendView(A), BackendView(B), BackendView(C)]
    doc = "You are a helpful assistant. " * 40
    first = pa.choose(views, prefix_key(doc + "question one"))
    pa.remember(prefix_key(doc + "question one"), first)
    for q in ("question two", "another question entirely", "3"):
        assert pa.choose(views, prefix_key(doc + q)) == first


def test_prefix_aware_spreads_distinct_prefixes_over_the_ring():
    pa = PrefixAware()
    views = [BackendView(A), BackendView(B), BackendView(C)]
    counts = collections.Counter(pa.choose(views, prefix_key(f"document number {i} " * 10)) for i in range(300))
    assert set(counts) == {A, B, C}
    assert min(counts.values()) > 50  # 100 each expected; vnodes keep the ring even


def test_prefix_aware_bounds_load_so_a_hot_prefix_spills_over():
    pa = PrefixAware(load_factor=1.25)
    key = prefix_key("hot prefix " * 50)
    home = pa.choose([BackendView(A), BackendView(B)], key)
    other = B if home == A else A
    # the home replica at 4 requests, the other idle: bound = ceil(1.25 * 5 / 2) = 4 -> 4 + 1 > 4
    views = [BackendView(home, in_flight=4), BackendView(other, in_flight=0)]
    pa.remember(key, home)
    assert pa.choose(views, key) == other
    # under the bound it stays home
    views = [BackendView(home, in_flight=2), BackendView(other, in_flight=1)]
    assert pa.choose(views, key) == home


def test_prefix_aware_forgets_a_replica_that_left():
    pa = PrefixAware()
    key = prefix_key("z" * 300)
    pa.remember(key, A)
    pa.forget(A)
    assert pa.choose([BackendView(B), BackendView(C)], key) in (B, C)


def test_unknown_policy_and_bad_load_factor_are_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="load factor"):
        PrefixAware(load_factor=0.5)


@pytest.mark.parametrize("value, message", [
    ("", "empty"), (" , ", "empty"), ("ftp://host:21", "unsupported scheme 'ftp'"),
    ("10.0.0.1:8000", "unsupported scheme"), ("http://", "no host"), ("http://h:1/?a=b", "query"),
])
def test_bad_backend_lists_are_refused_with_the_reason(value, message):
    with pytest.raises(BackendConfigError, match=message):
        parse_backend_list(value)


def test_backend_list_is_normalized_and_deduplicated():
    assert parse_backend_list("http://a:1/, https://b:2,http://a:1") == ["http://a:1", "https://b:2"]


def test_k8s_service_must_be_namespace_slash_name():
    assert parse_k8s_service("prod/llama-engine") == ("prod", "llama-engine")
    for bad in ("llama", "/x", "x/", "a/b/c"):
        with pytest.raises(BackendConfigError, match="NAMESPACE/NAME"):
            parse_k8s_service(bad)


def test_engine_gauges_are_parsed_and_summed_over_label_sets_kv_usage_averaged():
    text = ("# HELP pagoda:num_requests_running x\n# TYPE pagoda:num_requests_running gauge\n"
            'pagoda:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'pagoda:num_requests_running{engine="1",model_name="m"} 2.0\n'
            "pagoda:num_requests_waiting 7\n"
            'pagoda:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'pagoda:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
            'pagoda:num_requests_waiting_total{x="y"} 100\n'
            'pagoda:time_to_first_token_seconds_bucket{le="0.1"} 4\n')
    assert parse_engine_metrics(text) == {"running": 5.0, "waiting": 7.0, "kv_usage": 0.5}


def test_slice_urls_take_ready_endpoints_on_the_named_port():
    s = {"ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                       {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                       {"addresses": ["10.0.0.3"]},
                       {"addresses": ["fd00::4"], "conditions": {"ready": True}}]}
    assert slice_urls(s) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://[fd00::4]:8000"]
    assert slice_urls({"ports": [{"port": 81}], "endpoints": [{"addresses": ["h"]}]}, "http") == ["http://h:81"]
    assert slice_urls({"endpoints": [{"addresses": ["h"]}]}) == []
