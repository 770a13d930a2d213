"""kvq's prefix store from Python: stores by URL (a directory, a real redis-server), their
inspection verbs, prefix reuse into ModelCaches, and through kvq.hf bit-identical logits with a
fetched prefix; servers killed before and in the middle of a fetch.

The Redis tests start a real ``redis-server`` on a free loopback port (no persistence, its own
temporary directory, killed with the test process if that dies first) and are skipped, saying
why, where redis-server is not installed (``scripts/setup.sh`` installs it) or the module was
built without hiredis.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import kv, small_cache
from redis_util import CuttingProxy, free_port

import kvq

MODEL = "0123456789abcdef0123456789abcdef"  # a model fingerprint for caches without a model
PRODUCER = "kvq-python-tests/1"


# ---- stores and their verbs ----


def test_bad_urls_and_arguments(tmp_path):
    for url in ["nope:x", "redis:/x", "http://127.0.0.1:6379", "dir:"]:
        with pytest.raises(ValueError, match="dir:PATH"):
            kvq.Store(url)
    for url, message in [
        ("redis://127.0.0.1:99999", "port"),
        ("redis://:6379", "no host"),
        ("redis://127.0.0.1:6379?bogus=1", "unknown store URL option"),
        ("redis://127.0.0.1:6379?timeout_ms=0", "timeout_ms"),
        ("redis://a:1,b:2", "redis-cluster://"),
        ("redis-cluster://a:1/3", "no databases"),
    ]:
        with pytest.raises(ValueError, match=message):
            kvq.Store(url)
    with pytest.raises(ValueError, match="timeout_ms"):
        kvq.Store(f"dir:{tmp_path}", timeout_ms=-1)
    with pytest.raises(TypeError):
        kvq.Store(42)
    with pytest.raises(ValueError, match="dir:PATH"):
        kvq.StoreWriter("nope:x")  # checked when made, not in the background
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(OSError):
        kvq.Store(f"dir:{tmp_path / 'file'}")


def test_unreachable_server_raises_oserror():
    if not kvq.store_has_redis():
        pytest.skip("this kvq module was built without hiredis (no Redis backend)")
    port = free_port()  # nothing listens there
    store = kvq.Store(f"redis://127.0.0.1:{port}?connect_timeout_ms=200")  # connects lazily
    with pytest.raises(OSError) as e:
        store.get("kvq1:x")
    assert isinstance(e.value, kvq.IoError) and str(port) in str(e.value)
    with pytest.raises(kvq.IoError):
        store.put("kvq1:x", b"data")
    with pytest.raises(kvq.IoError):
        store.ls()


def test_put_get_ls_rm_round_trip(store_url):
    store = kvq.Store(store_url)
    assert store.url.split(":")[0] == store_url.split(":")[0]
    payload = bytes(range(256)) * 40
    store.put("kvq1:plain", payload)
    store.put("other:thing", bytearray(b"abc"))
    store.put("kvq1:view", memoryview(payload)[:100])
    assert store.get("kvq1:plain") == payload
    assert store.get("kvq1:plain", max_bytes=10) == payload[:10]
    assert store.get("kvq1:view") == payload[:100]
    assert store.exists("kvq1:plain") and not store.exists("kvq1:absent")
    with pytest.raises(kvq.NotFoundError):
        store.get("kvq1:absent")
    assert store.list() == [("kvq1:plain", len(payload)), ("kvq1:view", 100)]
    assert [e[0] for e in store.list("")] == ["kvq1:plain", "kvq1:view", "other:thing"]
    rows = store.ls()
    assert [r["key"] for r in rows] == ["kvq1:plain", "kvq1:view"]
    assert all("error" in r and "kind" not in r for r in rows)  # not kvq objects
    s = store.stats()
    assert (s["objects"], s["bytes"], s["other_objects"], s["namespaces"]) == (2, 10340, 2, 0)
    store.rm("kvq1:view")
    store.rm("kvq1:view")  # absent: not an error
    assert store.rm("kvq1:", prefix=True) == 1
    assert store.list("") == [("other:thing", 3)]
    with pytest.raises(ValueError, match="non-empty prefix"):
        store.rm("", prefix=True)
    with pytest.raises(TypeError):
        store.put("kvq1:x", "text is not bytes")


def test_dir_store_refuses_keys_it_cannot_name(tmp_path):
    store = kvq.Store(f"dir:{tmp_path}")
    with pytest.raises(ValueError):
        store.put("../escape", b"x")
    assert list(tmp_path.parent.glob("escape")) == []


# ---- namespaces, keys and prefix reuse into ModelCaches ----

C = 32  # chunk tokens: a multiple of every method's test-settings block length


def filled(method, n, rng_seed=7):
    """A cache of `method` (test settings) fed n random tokens in pieces ending at chunk
    boundaries, and the K/V it was fed."""
    rng = np.random.default_rng(rng_seed)
    cache = small_cache(method)
    k = [kv(rng, 1, 2, n, 16) for _ in range(cache.n_layers)]
    v = [kv(rng, 1, 2, n, 16) for _ in range(cache.n_layers)]
    return cache, k, v


def feed(cache, k, v, p, e):
    for i, layer in enumerate(cache):
        layer.append(k[i][:, :, p:e], v[i][:, :, p:e])


def namespace(cache, **kwargs):
    args = dict(chunk_tokens=C, producer=PRODUCER)
    args.update(kwargs)
    return kvq.StoreNamespace(cache, MODEL, **args)


def test_namespace_and_keys_match_the_normative_text():
    cache = small_cache("kivi")
    ns = namespace(cache)
    assert ns.descriptor == (
        f"kvq-store 1\nmodel {MODEL}\nspec {cache.model_spec}\nbatch 1\nchunk {C}\n"
        f"producer {PRODUCER}\n"
    )
    assert ns.id == kvq.hash128(ns.descriptor.encode())
    tokens = list(range(100))
    keys = kvq.chunk_keys(ns, tokens)
    assert len(keys) == 3
    prev = bytes.fromhex(ns.id)  # docs/store.md §2.3, by hand
    for i, key in enumerate(keys):
        ids = np.array(tokens[i * C : (i + 1) * C], dtype="<u4").tobytes()
        assert key == kvq.hash128(prev + ids)
        prev = bytes.fromhex(key)
    # Any integer array or tensor-like gives the same keys; a batch of 2 rows others.
    assert kvq.chunk_keys(ns, np.arange(100, dtype=np.int32)) == keys
    assert kvq.chunk_keys(ns, np.arange(200)[::2] // 2) == keys  # strided
    two = namespace(cache, batch=2)
    assert kvq.chunk_keys(two, [tokens, tokens]) != keys
    assert kvq.store_object_key(ns, keys[0], "blocks") == f"kvq1:{ns.id}:{keys[0]}:b"
    assert kvq.store_key_prefix(ns) == f"kvq1:{ns.id}:" and kvq.store_key_prefix() == "kvq1:"


def test_namespace_and_token_errors():
    cache = small_cache("kivi")
    for model in ["xyz", "00", MODEL + "0"]:
        with pytest.raises(ValueError):
            kvq.StoreNamespace(cache, model, C, producer=PRODUCER)
    with pytest.raises(ValueError, match="multiple"):
        namespace(cache, chunk_tokens=C + 1)
    with pytest.raises(ValueError):
        namespace(cache, producer="two\nlines")
    with pytest.raises(ValueError):
        namespace(cache, batch=0)
    with pytest.raises(TypeError):
        kvq.StoreNamespace(cache, MODEL, C, PRODUCER)  # producer is keyword-only
    with pytest.raises(TypeError):
        kvq.StoreNamespace("not a cache", MODEL, C, producer=PRODUCER)
    ns = namespace(cache)
    with pytest.raises(TypeError, match="integer"):
        kvq.chunk_keys(ns, np.zeros(10, dtype=np.float32))
    with pytest.raises(TypeError):
        kvq.chunk_keys(ns, "abc")
    with pytest.raises(ValueError, match="rows"):
        kvq.chunk_keys(ns, np.zeros((2, 64), dtype=np.int64))
    with pytest.raises(ValueError, match="int32"):
        kvq.chunk_keys(ns, [2**40])
    with pytest.raises(ValueError, match="1-D"):
        kvq.chunk_keys(ns, np.zeros((1, 1, 4), dtype=np.int64))
    with pytest.raises(ValueError):
        kvq.store_object_key(ns, "00" * 16, "neither")


@pytest.mark.parametrize("method", ["fp16", "kivi", "zipcache", "cachegen", "xquant", "kvq"])
def test_session_stores_and_reuses_byte_identical_caches(method, store_url):
    n = 3 * C + 5
    cache, k, v = filled(method, n)
    tokens = np.arange(1000, 1000 + n)
    store = kvq.Store(store_url)
    writer = store.writer()
    prefix = kvq.PrefixStore(store, namespace(cache))
    session = kvq.PrefixSession([(cache, prefix)], tokens, writer)
    assert session.reuse(n - 1) == 0  # an empty store
    expected = {}
    p = 0
    while p < n:
        e = session.piece_end(p, 1000, n)
        feed(cache, k, v, p, e)
        p = e
        session.reached(p)
        if p % C == 0:
            expected[p] = kvq.serialize_cache(cache)
    assert session.exported_chunks == 3
    assert [note.split(":")[-1] for note in session.notes] == [" the reuse stops there"]
    report = writer.flush()
    assert (report["objects"], report["failed"]) == (6, 0)

    rows = store.ls(verify=True)
    assert [(r["kind"], r["chunk"]) for r in rows] == [
        (kind, i) for i in range(3) for kind in ("blocks", "tail")
    ]
    assert all(r["checksum_ok"] and r["spec"] == cache.model_spec for r in rows)
    assert rows[2]["token_begin"] == C and rows[2]["token_end"] == 2 * C
    keys = store.keys(prefix.namespace, tokens)
    assert [c["blocks_key"] for c in keys["chunks"]] == [r["key"] for r in rows[::2]]
    assert store.stats()["namespaces"] == 1

    # Another cache of the same spec reuses every whole chunk before the last token ...
    again, _, _ = filled(method, n)
    s2 = kvq.PrefixSession([(again, kvq.PrefixStore(store, namespace(again)))], tokens, writer)
    assert prefix.lookup(tokens, again) == 3
    assert s2.reuse(n - 1) == 3 * C and s2.fetches[0].chunks == 3
    assert kvq.serialize_cache(again) == expected[3 * C]
    # ... or as much as asked, and a prompt sharing one chunk reuses that one.
    assert s2.reuse(2 * C + 3) == 2 * C
    assert kvq.serialize_cache(again) == expected[2 * C]
    other = np.concatenate([tokens[:C], tokens[C:] + 1])
    s3 = kvq.PrefixSession([(again, kvq.PrefixStore(store, namespace(again)))], other)
    assert s3.reuse(n - 1) == C
    assert kvq.serialize_cache(again) == expected[C]
    # The low-level fetch does the same.
    got = prefix.fetch(tokens, 2, again)
    assert (got.chunks, got.tokens) == (2, 2 * C) and got.bytes > 0
    assert kvq.serialize_cache(again) == expected[2 * C]


def test_damaged_object_is_a_shorter_reuse(tmp_path):
    n = 3 * C + 1
    cache, k, v = filled("kivi", n)
    tokens = np.arange(n)
    store = kvq.Store(f"dir:{tmp_path}")
    prefix = kvq.PrefixStore(store, namespace(cache))
    expected = {}
    for i in range(3):
        feed(cache, k, v, i * C, (i + 1) * C)
        o = prefix.export_chunk(cache, tokens, i)
        store.put(o["blocks_key"], o["blocks"])
        store.put(o["tail_key"], o["tail"])
        expected[i + 1] = kvq.serialize_cache(cache)
    with pytest.raises(ValueError, match="offset"):
        prefix.export_chunk(cache, tokens, 1)  # the cache is past chunk 1
    blocks_1 = kvq.store_object_key(prefix.namespace, kvq.chunk_keys(prefix.namespace, tokens)[1],
                                    "blocks")  # fmt: skip
    bad = bytearray(store.get(blocks_1))
    bad[len(bad) // 2] ^= 0x10
    store.put(blocks_1, bad)
    assert kvq.inspect_store_object(bytes(bad))["checksum_ok"] is False
    assert kvq.inspect_store_object(store.get(blocks_1, max_bytes=1024))["chunk"] == 1
    with pytest.raises(kvq.FormatError):
        kvq.inspect_store_object(b"not an object at all, no magic")
    again = small_cache("kivi")
    got = prefix.fetch(tokens, 3, again)
    assert got.chunks == 1 and any("chunk 1" in note for note in got.notes)
    assert kvq.serialize_cache(again) == expected[1]
    assert [r.get("error") for r in store.ls(verify=True)].count("checksum mismatch") == 1


def test_session_argument_errors(tmp_path):
    cache = small_cache("kivi")
    store = kvq.Store(f"dir:{tmp_path}")
    prefix = kvq.PrefixStore(store, namespace(cache))
    tokens = np.arange(70)
    with pytest.raises(TypeError):
        kvq.PrefixSession(cache, tokens)
    with pytest.raises(TypeError):
        kvq.PrefixSession([(cache,)], tokens)
    with pytest.raises(TypeError):
        kvq.PrefixSession([(prefix, cache)], tokens)
    with pytest.raises(ValueError, match="at least one"):
        kvq.PrefixSession([], tokens)
    with pytest.raises(ValueError, match="twice"):
        kvq.PrefixSession([(cache, prefix), (cache, prefix)], tokens)
    other = small_cache("kivi")
    p64 = kvq.PrefixStore(store, namespace(other, chunk_tokens=64))
    with pytest.raises(ValueError, match="chunk_tokens"):
        kvq.PrefixSession([(cache, prefix), (other, p64)], tokens)
    with pytest.raises(TypeError, match="StoreWriter"):
        kvq.PrefixSession([(cache, prefix)], tokens, writer="dir:x")
    writer = store.writer()
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        kvq.PrefixSession([(cache, prefix)], tokens, writer)
    with pytest.raises(ValueError, match="closed"):
        writer.put("kvq1:x", b"")
    with pytest.raises(ValueError, match="chunks"):
        prefix.fetch(tokens, 3, cache)  # 70 tokens have 2 whole chunks
    # A fetch into a cache of another spec is refused, and the cache is left as it was.
    zip_cache = small_cache("zipcache")
    feed(zip_cache, *filled("zipcache", 10)[1:], 0, 10)
    before = kvq.serialize_cache(zip_cache)
    with pytest.raises(ValueError, match="namespace"):
        prefix.fetch(tokens, 1, zip_cache)
    assert kvq.serialize_cache(zip_cache) == before


def test_server_killed_before_a_reuse_and_mid_fetch(redis_server, tmp_path):
    n = 3 * C + 2
    cache, k, v = filled("kivi", n)
    tokens = np.arange(n)
    store = kvq.Store(redis_server.url)
    prefix = kvq.PrefixStore(store, namespace(cache))
    writer = store.writer()
    s = kvq.PrefixSession([(cache, prefix)], tokens, writer)
    p = s.reuse(n - 1)
    while p < n:
        e = s.piece_end(p, 1000, n)
        feed(cache, k, v, p, e)
        s.reached(p := e)
    assert writer.flush()["objects"] == 6
    fetched = prefix.fetch(tokens, 3, small_cache("kivi")).bytes
    assert fetched > 0

    # Mid-fetch: the server is killed after half the fetch's bytes have come back.
    proxy = CuttingProxy(redis_server.port, fetched // 2, redis_server.kill)
    via = kvq.Store(proxy.url + "?connect_timeout_ms=300&timeout_ms=2000")
    victim, _, _ = filled("kivi", n)
    feed(victim, k, v, 0, 5)
    s2 = kvq.PrefixSession([(victim, kvq.PrefixStore(via, namespace(victim)))], tokens)
    reused = s2.reuse(n - 1)
    assert proxy.cut.is_set() and reused < 3 * C
    assert s2.notes, "a shorter reuse is always explained"
    # What was reused is exactly the computed cache at that length (here: usually none).
    ref, _, _ = filled("kivi", n)
    for p in range(0, reused, C):
        feed(ref, k, v, p, p + C)
    assert kvq.serialize_cache(victim) == kvq.serialize_cache(ref)

    # Before a reuse: the server is gone; the lookup fails, a recompute, noted; calls raise.
    s3 = kvq.PrefixSession([(victim, prefix)], tokens, writer)
    assert s3.reuse(n - 1) == 0 and victim.offset == 0
    assert any("lookup" in note for note in s3.notes)
    with pytest.raises(kvq.IoError):
        prefix.lookup(tokens, victim)
    got = prefix.fetch(tokens, 3, victim)
    assert got.chunks == 0 and victim.offset == 0 and got.notes
    # Writes to a dead server fail, counted, never raised.
    feed(victim, k, v, 0, C)
    s3.reached(C)
    assert writer.flush()["failed"] >= 1


def test_cluster_store_and_reuse(redis_cluster):
    """redis-cluster://: the chunks of one prompt spread over every master; a reuse reads them
    back byte-identical, and ls/stats see every master."""
    n = 4 * C + 3
    cache, k, v = filled("kivi", n)
    tokens = np.arange(n)
    store = kvq.Store(redis_cluster.url)
    writer = store.writer()
    s = kvq.PrefixSession([(cache, kvq.PrefixStore(store, namespace(cache)))], tokens, writer)
    p = s.reuse(n - 1)
    while p < n:
        e = s.piece_end(p, 1000, n)
        feed(cache, k, v, p, e)
        s.reached(p := e)
        if p == 4 * C:
            expected = kvq.serialize_cache(cache)
    assert writer.flush()["objects"] == 8
    assert len(store.ls()) == 8 and store.stats()["objects"] == 8
    details = store.stats()["details"]  # one line per master: "node HOST:PORT: ... keys=N"
    assert sorted(d.split()[1].rstrip(":") for d in details) == sorted(
        node.address for node in redis_cluster.nodes
    )
    per_master = [int(d.rsplit("keys=", 1)[1]) for d in details]
    assert sum(per_master) == 8 and sum(n > 0 for n in per_master) >= 2  # spread
    again = small_cache("kivi")
    s2 = kvq.PrefixSession([(again, kvq.PrefixStore(store, namespace(again)))], tokens)
    assert s2.reuse(n - 1) == 4 * C
    assert kvq.serialize_cache(again) == expected


def test_calls_release_the_gil(redis_server):
    """A store call waiting on a server that does not answer lets other Python threads run."""
    store = kvq.Store(redis_server.url + "?timeout_ms=1500")
    store.put("kvq1:x", b"v")
    redis_server.pause()
    try:
        result = []
        t = threading.Thread(target=lambda: result.append(_get_or_error(store)))
        t.start()
        ticks, deadline = 0, time.monotonic() + 0.5
        while time.monotonic() < deadline:
            ticks += 1  # runs only while the call waits without the GIL
        t.join(10)
    finally:
        redis_server.resume()
    assert ticks > 1000 and len(result) == 1 and isinstance(result[0], kvq.IoError)
    assert store.get("kvq1:x") == b"v"  # reconnected once the server answers again


def _get_or_error(store):
    try:
        return store.get("kvq1:x")
    except kvq.Error as e:
        return e


def test_redis_urls_without_the_redis_backend():
    """A module built without hiredis has dir: alone and says why it refuses a Redis URL (after
    checking its syntax); one with it opens them lazily, without connecting."""
    if kvq.store_has_redis():
        kvq.Store(f"redis://127.0.0.1:{free_port()}")
        kvq.Store(f"redis-cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}")
        return
    for url in ["redis://127.0.0.1:6379", "redis-cluster://127.0.0.1:7000,127.0.0.1:7001"]:
        with pytest.raises(kvq.UnsupportedError, match="no Redis backend.*libhiredis-dev"):
            kvq.Store(url)
    with pytest.raises(kvq.InvalidArgumentError, match="port"):
        kvq.Store("redis://127.0.0.1:99999")
