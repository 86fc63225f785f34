"""The remote KV tier's Redis URLs: one rule (pagoda_engine.kv_tiers.remote_url_problems), which
the engine applies to --kv-offload-remote-url and the operator to a spec's remote tier url, judged
on one table of URLs and on random strings made of URL pieces. A URL it accepts is one the
engine's store connects to as written: its redis-py client is built (no server needed) and aims
at the address and database the URL names; one it refuses stops `pagoda serve` before anything
loads and gives the spec Validated=False, with the same sentence.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda_engine.kv_tiers import remote_url_problems, split_remote_urls
from pagoda_operator.validation import check
from tests.operator.support import load_example, with_spec

kv_stores = pytest.importorskip("pagoda_engine.worker.kv_stores")

FINGERPRINT = b"f" * 16

# A URL the engine takes, with where each server's connections go ((host, port) or socket path, db).
ACCEPTED = [
    ("redis://kv", [(("kv", 6379), 0)]),
    ("redis://kv:6380/2", [(("kv", 6380), 2)]),
    ("redis://kv/", [(("kv", 6379), 0)]),
    ("redis://kv:6379?db=3", [(("kv", 6379), 3)]),
    ("rediss://kv.cache.svc.cluster.local:6380/1", [(("kv.cache.svc.cluster.local", 6380), 1)]),
    ("redis://user:secret@kv:6379", [(("kv", 6379), 0)]),
    ("redis://:secret@10.0.0.7:65535/0", [(("10.0.0.7", 65535), 0)]),
    ("redis://[fd00::7]:6379", [(("fd00::7", 6379), 0)]),
    ("unix:///run/redis/redis.sock", [("/run/redis/redis.sock", 0)]),
    ("unix:///run/redis.sock?db=2", [("/run/redis.sock", 2)]),
    ("unix://:secret@/run/redis.sock?db=1", [("/run/redis.sock", 1)]),
    (" redis://a:1 , rediss://b:2/3 ,unix:///r.sock ", [(("a", 1), 0), (("b", 2), 3), ("/r.sock", 0)]),
]

# A value the engine refuses, and what its (first) sentence says is wrong.
REFUSED = [
    ("", "'' is not redis://host[:port][/db], rediss://... or unix:///path: an empty entry"),
    ("redis://a:1,,redis://b:1", "'' is not redis://host[:port][/db], rediss://... or unix:///path: an empty entry"),
    ("redis://a:1,", "an empty entry"),
    ("http://kv:80", "'http://kv:80' is not redis://host[:port][/db], rediss://... or unix:///path: the scheme must be"),
    ("kv:6379", "the scheme must be redis://, rediss:// or unix://"),
    ("REDIS://kv", "the scheme must be redis://, rediss:// or unix:// (lower case)"),
    ("redis:/kv", "the scheme must be"),
    ("memcached://kv:11211", "the scheme must be"),
    ("redis://", "it names no host"),
    ("redis://:6379", "it names no host"),
    ("redis://user:pw@/2", "it names no host"),
    ("redis://kv:abc", "the port 'abc' is not a number from 1 to 65535"),
    ("redis://kv:0", "the port '0' is not a number from 1 to 65535"),
    ("redis://kv:65536", "the port '65536' is not"),
    ("redis://kv:", "the port '' is not"),
    ("redis://kv:1:2", "the port '1:2' is not"),
    ("redis://kv/x", "the path '/x' is not /db (a database number)"),
    ("redis://kv/1/2", "the path '/1/2' is not /db"),
    ("rediss://kv?ssl_cert_reqs=none", "the query ?ssl_cert_reqs=none is not ?db=N"),
    ("redis://kv?db=x", "the query ?db=x is not ?db=N"),
    ("unix:///r.sock?db=1&db=2", "the query ?db=1&db=2 is not ?db=N"),
    ("redis://kv#0", "it has a fragment #0"),
    ("redis://k v:6379", "it contains whitespace"),
    ("redis://kv\t:6379", "it contains whitespace"),
    ("redis://[zz]:6379", "its host is not a name or address"),
    ("unix://", "it names no socket path"),
    ("unix:///", "it names no socket path"),
    ("unix://run/redis.sock", "'run' stands where a unix:// URL names no host: the socket's path follows three slashes"),
    ("unix://:pw@kv:6379/r.sock", "'kv:6379' stands where a unix:// URL names no host"),
    ("redis://a:1,redis://a:1", "names a server twice: 'redis://a:1'"),
    (" redis://a:1,redis://a:1 ", "names a server twice: 'redis://a:1'"),
]


def _targets(store) -> list:
    """Where the store's redis-py connections go: ((host, port) or socket path, db) per server."""
    targets = []
    for shard in getattr(store, "shards", [store]):
        connection = shard.client.connection_pool.make_connection()  # not connected
        where = connection.path if hasattr(connection, "path") else (connection.host, connection.port)
        assert where == shard._address and connection.db == shard._db  # the store's own reads go there too
        targets.append((where, connection.db))
    return targets


def _operator_url_problems(value: str) -> list[str]:
    """What the operator says of a spec whose remote tier has this url, about the url."""
    body = with_spec(load_example("tiny-cpu.yaml"), kvCache__tiers=[{"type": "remote", "url": value}])
    where = "kvCache.tiers[0] (remote): url "
    return [p.removeprefix(where) for p in check(body).problems if p.startswith(where)]


@pytest.mark.parametrize("value, targets", ACCEPTED)
def test_a_url_the_rule_accepts_is_the_server_the_engine_connects_to(value, targets):
    assert remote_url_problems(value) == _operator_url_problems(value) == []
    assert _targets(kv_stores.remote_store(value, FINGERPRINT)) == targets


@pytest.mark.parametrize("value, fault", REFUSED)
def test_a_url_the_rule_refuses_stops_the_engine_and_the_spec_with_a_sentence_that_says_what_is_wrong(value, fault):
    problems = remote_url_problems(value)
    assert problems and fault in problems[0], problems
    assert _operator_url_problems(value) == problems
    with pytest.raises(ValueError, match="--kv-offload-remote-url: "):
        split_remote_urls(value)


def test_every_fault_of_a_list_is_named():
    value = "redis://kv:x,unix://h/s,redis://kv:x"
    forms = "is not redis://host[:port][/db], rediss://... or unix:///path"
    assert remote_url_problems(value) == _operator_url_problems(value) == [
        f"'redis://kv:x' {forms}: the port 'x' is not a number from 1 to 65535",
        f"'unix://h/s' {forms}: 'h' stands where a unix:// URL names no host: the socket's path follows three slashes",
        f"'redis://kv:x' {forms}: the port 'x' is not a number from 1 to 65535",
        "names a server twice: 'redis://kv:x'"]


URL_PIECES = st.sampled_from(["redis", "rediss", "unix", "REDIS", "http", "://", ":/", "/", "//", ":", "@", "user",
                              ":pw@", "kv", "[::1]", "[zz]", "6379", "0", "99999", "x", "?db=", "?", "&", "=", "#",
                              "2", ",", " ", "\t", ".", "-", "%20"])


@settings(max_examples=400, deadline=None)
@given(st.lists(URL_PIECES, max_size=12).map("".join))
def test_any_string_of_url_pieces_the_rule_accepts_the_engine_s_store_takes(value):
    if not remote_url_problems(value):
        kv_stores.remote_store(value, FINGERPRINT)
    else:
        with pytest.raises(ValueError, match="--kv-offload-remote-url: "):
            kv_stores.remote_store(value, FINGERPRINT)
