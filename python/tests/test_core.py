"""The bindings against kvq's contract: method table, specs, appends of any layout, the
per-query attention semantics, accounting, trim/clone/reset, the container, lifetimes, the GIL."""

from __future__ import annotations

import gc
import io
import threading
import time

import numpy as np
import pytest
from conftest import kv, small_cache

import kvq

METHODS = [m.name for m in kvq.methods()]
D = 32  # the method-wide tests' head_dim: every method takes it (ggml's formats need 32 | D)


def test_method_table():
    assert METHODS[:1] == ["fp16"] and {"kivi", "zipcache", "cachegen", "xquant"} <= set(METHODS)
    ids = [m.id for m in kvq.methods()]
    assert len(set(ids)) == len(ids)
    for m in kvq.methods():
        assert m.summary and kvq.find_method(m.name).id == m.id
        for p in m.params:
            assert p.doc and p.type in ("int", "float", "enum")
            if p.type == "enum":
                assert p.default in p.choices and p.min is None
            else:
                assert p.min <= p.default <= p.max
        assert "| " in m.params_markdown() or not m.params
    assert kvq.find_method("nope") is None
    kivi = kvq.find_method("kivi")
    assert [p.name for p in kivi.params][:2] == ["k_bits", "v_bits"]
    assert isinstance(kivi.params[0].default, int)


def test_spec_round_trip_and_messages():
    for m in kvq.methods():
        s = m.test_spec()
        assert kvq.parse_spec(str(s)) == s and kvq.Spec(str(s)) == s
        assert set(s.params) == {p.name for p in m.params}
    s = kvq.parse_spec("kivi:k_bits=3")
    assert s.get("k_bits") == 3 and s.params["v_bits"] == 2
    assert s.diff_from(kvq.parse_spec("kivi")) == "k_bits=3"
    assert s.apply("v_bits=4").get("v_bits") == 4 and s.get("v_bits") == 2
    with pytest.raises(kvq.InvalidArgumentError, match="did you mean 'k_bits'"):
        kvq.parse_spec("kivi:k_bit=2")
    with pytest.raises(ValueError, match="kiwi"):
        kvq.parse_spec("kiwi")
    spec, overrides = kvq.parse_model_spec("kivi@0-1:k_bits=4@1:v_bits=3")
    assert spec == kvq.parse_spec("kivi") and overrides == {0: "k_bits=4", 1: "k_bits=4,v_bits=3"}


def test_layouts_dtypes_and_strides_read_in_place(rng):
    """[B, H, S, D], a [B, S, H, D] buffer viewed transposed, float16 and broadcast inputs all
    store what the same values appended contiguously store."""
    k, v = kv(rng, 2, 2, 40, 16), kv(rng, 2, 2, 40, 16)
    ref = small_cache()
    ref[0].append(k, v)
    bshd_k = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    bshd_v = np.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not bshd_k.flags.c_contiguous
    other = small_cache()
    other[0].append(bshd_k, bshd_v)
    for a, b in zip(ref[0].read(0, 40), other[0].read(0, 40)):
        assert np.array_equal(a, b)
    # Strided outputs: a float16 [B, S, H, D] buffer read through its transposed view.
    k_out = np.zeros((2, 40, 2, 16), np.float16)
    v_out = np.zeros((2, 40, 2, 16), np.float16)
    ref[0].read(0, 40, k_out.transpose(0, 2, 1, 3), v_out.transpose(0, 2, 1, 3))
    assert np.array_equal(k_out.transpose(0, 2, 1, 3), ref[0].read(0, 40)[0].astype(np.float16))
    # fp16 inputs are stored exactly (the window is fp16).
    half = small_cache("fp16")
    half[0].append(k.astype(np.float16), v.astype(np.float16))
    assert np.array_equal(half[0].read(0, 40)[0], k.astype(np.float16).astype(np.float32))
    # A zero-stride (broadcast) tensor is a valid view.
    row = kv(rng, 1, 1, 1, 16)
    bcast = np.broadcast_to(row, (2, 2, 5, 16))
    b = small_cache("fp16")
    b[0].append(bcast, bcast)
    assert np.array_equal(b[0].read(0, 5)[0], np.broadcast_to(row.astype(np.float16), bcast.shape))


def test_torch_layouts_and_bfloat16():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 24, 2, 16, generator=g).transpose(1, 2)  # HF's [B, H, S, D] of a view
    v = torch.randn(1, 24, 2, 16, generator=g).transpose(1, 2)
    c = small_cache("fp16")
    c[0].append(k.to(torch.bfloat16), v.to(torch.bfloat16))
    assert c[0].window_dtype == "bf16"
    out_k = torch.empty(1, 2, 24, 16, dtype=torch.bfloat16)
    out_v = torch.empty_like(out_k)
    assert c[0].read(0, 24, out_k, out_v)[0] is out_k
    assert torch.equal(out_k, k.to(torch.bfloat16)) and torch.equal(out_v, v.to(torch.bfloat16))


def reference_attention(layer, q, scale):
    """kvq's per-query semantics from the contract's pieces, in float64: query t at position
    p = offset - T + t sees read() below sealed_tokens_for_query(p), read_exact() from it to p."""
    T, offset = q.shape[2], layer.offset
    out = np.zeros(q.shape)
    group = q.shape[1] // layer.shape.n_kv_heads
    for t in range(T):
        p = offset - T + t
        s = layer.sealed_tokens_for_query(p)
        k_s, v_s = layer.read(0, s)
        k_e, v_e = layer.read_exact(s, p + 1 - s)
        k = np.concatenate([k_s, k_e], axis=2).astype(np.float64)
        v = np.concatenate([v_s, v_e], axis=2).astype(np.float64)
        for h in range(q.shape[1]):
            scores = k[:, h // group] @ q[:, h, t].astype(np.float64)[..., None] * scale
            w = np.exp(scores - scores.max(axis=1, keepdims=True))
            w /= w.sum(axis=1, keepdims=True)
            out[:, h, t] = (w * v[:, h // group]).sum(axis=1)
    return out


@pytest.mark.parametrize("method", METHODS)
def test_attend_follows_the_per_query_contract(method, rng):
    """attend() of a prefill chunk that seals blocks, then of decode steps, equals attention
    over read()/read_exact() at each query's seal boundary."""
    c = small_cache(method, head_dim=D)
    seen_moving_boundary = False
    for n in (37, 1, 1, 9):
        for layer in c:  # in layer order: xquant's layers reuse their anchor's codes
            k, v, q = kv(rng, 2, 2, n, D), kv(rng, 2, 2, n, D), kv(rng, 2, 4, n, D)
            layer.append(k, v, q)
            offset = layer.offset
            bounds = {layer.sealed_tokens_for_query(p) for p in range(offset - n, offset)}
            seen_moving_boundary |= len(bounds) > 1
            out = layer.attend(q, 0.25)
            np.testing.assert_allclose(out, reference_attention(layer, q, 0.25), atol=2e-5)
    assert c.offset == 48
    if method != "fp16":
        assert c[1].sealed_tokens > 0 and seen_moving_boundary


@pytest.mark.parametrize("method", METHODS)
def test_chunk_invariance_from_python(method, rng):
    """Appending in one call or token by token gives the same stored values and the same
    attention outputs for the last token."""
    k, v, q = kv(rng, 1, 2, 30, D), kv(rng, 1, 2, 30, D), kv(rng, 1, 4, 30, D)
    whole, steps = small_cache(method, head_dim=D), small_cache(method, head_dim=D)
    for layer in range(2):
        whole[layer].append(k, v, q)
        for t in range(30):
            steps[layer].append(k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
    for layer in range(2):
        for a, b in zip(whole[layer].read(0, 30), steps[layer].read(0, 30)):
            assert np.array_equal(a, b)
        last = q[:, :, 29:]
        assert np.array_equal(whole[layer].attend(last, 0.3), steps[layer].attend(last, 0.3))
    assert whole.bytes().as_dict() == steps.bytes().as_dict()


@pytest.mark.parametrize("method", METHODS)
def test_accounting(method, rng):
    c = small_cache(method, head_dim=D)
    assert c.bytes().total == 0 and c.resident_bytes() == 0
    for layer in range(2):
        c[layer].append(kv(rng, 2, 2, 45, D), kv(rng, 2, 2, 45, D))
    b = c.bytes()
    assert b.elements == 2 * 2 * 2 * 45 * D * 2  # K and V, B, H, offset, D, both layers
    assert b.total == c.resident_bytes() == sum(c[i].resident_bytes() for i in range(2))
    assert b.total == b.key_codes + b.value_codes + b.params + b.residual + b.meta + b.tables
    assert b.stored == b.total - b.tables
    assert b.bits_per_element == pytest.approx(8 * b.stored / b.elements)
    if method != "fp16":
        assert b.key_codes > 0 and b.bits_per_element < 16


@pytest.mark.parametrize("method", METHODS)
def test_trim_clone_reset(method, rng):
    c = small_cache(method, head_dim=D)
    k, v = kv(rng, 1, 2, 50, D), kv(rng, 1, 2, 50, D)
    for layer in range(2):
        c[layer].append(k[:, :, :20], v[:, :, :20])
    before = [c[i].read(0, 20) for i in range(2)]
    snapshot = c.bytes().as_dict()
    copy = c.clone()
    # As many new tokens (up to 3) as seal no block: trimming them restores the cache exactly.
    # Methods whose one-token blocks seal on every append (no such tokens) trim 3 sealed tokens:
    # the tokens that were sealed before read back unchanged, the rest stay sealed.
    layer0 = c[0]
    next_seal = (layer0.n_blocks + 1) * layer0.block_tokens + layer0.residual
    m = min(3, next_seal - 1 - 20)
    seals = m < 1
    m = 3 if seals else m
    sealed_before = layer0.sealed_tokens
    for layer in range(2):
        c[layer].append(k[:, :, 20 : 20 + m], v[:, :, 20 : 20 + m])
    assert copy.offset == 20 and c.offset == 20 + m
    c.trim(m)
    assert c.offset == 20
    keep = sealed_before if seals else 20
    assert keep > 0
    if not seals:
        assert c.bytes().as_dict() == snapshot
    for i in range(2):
        for a, b in zip(before[i], c[i].read(0, 20)):
            assert np.array_equal(a[:, :, :keep], b[:, :, :keep])
        for a, b in zip(before[i], copy[i].read(0, 20)):
            assert np.array_equal(a, b)
    c.reset()
    assert c.offset == 0 and c.bytes().total == 0 and copy.offset == 20
    c[0].append(kv(rng, 3, 2, 4, D), kv(rng, 3, 2, 4, D))  # a new batch size after reset
    assert c[0].batch == 3


@pytest.mark.parametrize("method", METHODS)
def test_container_round_trip(method, rng, tmp_path):
    c = small_cache(method, head_dim=D)
    for layer in range(2):
        c[layer].append(kv(rng, 2, 2, 41, D), kv(rng, 2, 2, 41, D))
    path = tmp_path / "ctx.kvq"
    kvq.save_cache(c, path, {"kvq.source": "test"})
    buffer = io.BytesIO()
    kvq.save_cache(c, buffer)
    loaded = [kvq.load_cache(path), kvq.load_cache(str(path)), kvq.parse_cache(buffer.getvalue())]
    loaded.append(kvq.load_cache(io.BytesIO(kvq.serialize_cache(c))))
    loaded.append(kvq.parse_cache(memoryview(bytearray(path.read_bytes()))))
    for other in loaded:
        assert other.model_spec == c.model_spec and other.offset == 41
        assert other.bytes().as_dict() == c.bytes().as_dict()
        for i in range(2):
            for a, b in zip(c[i].read(0, 41), other[i].read(0, 41)):
                assert np.array_equal(a, b)


def test_layer_keeps_its_cache_alive(rng):
    layer = small_cache()[1]
    gc.collect()
    layer.append(kv(rng, 1, 2, 30, 16), kv(rng, 1, 2, 30, 16))
    assert layer.offset == 30 and layer.read(0, 30)[0].shape == (1, 2, 30, 16)


def test_threads_give_the_same_outputs(rng):
    k, v, q = kv(rng, 2, 4, 70, 32), kv(rng, 2, 4, 70, 32), kv(rng, 2, 8, 70, 32)
    outs = []
    for threads in (1, 2, 0):
        c = kvq.ModelCache("kivi:residual=16,group=8", kvq.ModelShape(1, 4, 32, 8), threads=threads)
        c[0].append(k, v, q)
        outs.append(c[0].attend(q, 0.2))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


def test_long_calls_release_the_gil(rng):
    """While one thread is inside one long read(), another thread runs Python code."""
    c = kvq.ModelCache("fp16", kvq.ModelShape(1, 8, 128))
    c[0].append(np.ones((1, 8, 32768, 128), np.float16), np.ones((1, 8, 32768, 128), np.float16))
    k_out = np.zeros((1, 8, 32768, 128), np.float32)
    v_out = np.zeros_like(k_out)
    span = {}

    def long_call():
        span["start"] = time.perf_counter()
        c[0].read(0, 32768, k_out, v_out)
        span["end"] = time.perf_counter()

    t = threading.Thread(target=long_call)
    ticks = []
    t.start()
    while t.is_alive():
        ticks.append(time.perf_counter())
    t.join()
    duration = span["end"] - span["start"]
    middle = [x for x in ticks if abs(x - (span["start"] + duration / 2)) < duration / 4]
    assert duration > 0.02 and len(middle) > 100


def test_concurrent_appends_and_reads_are_serialised(rng):
    """Python threads appending to and reading from one cache at once: every call sees a
    consistent cache, and the result is what the appends in sequence give."""
    c = small_cache("kivi", n_layers=1)
    k, v = kv(rng, 1, 2, 200, 16), kv(rng, 1, 2, 200, 16)
    errors = []

    def reader():
        for _ in range(200):
            n = c[0].offset
            if n:
                c[0].read(0, n)

    def writer():
        try:
            for t in range(200):
                c[0].append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and c.offset == 200
    ref = small_cache("kivi", n_layers=1)
    ref[0].append(k, v)
    assert np.array_equal(ref[0].read(0, 200)[0], c[0].read(0, 200)[0])
