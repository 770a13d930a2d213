"""Bad input at every entry point becomes a Python exception carrying kvq's message, and leaves
the cache as it was; nothing a caller passes crashes the process."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import DL_CUDA, DL_METAL, ForeignTensor, kv, small_cache

import kvq

B, H, HQ, D = 1, 2, 4, 16


@pytest.fixture
def cache(rng):
    c = small_cache("kivi")
    for layer in c:
        layer.append(kv(rng, B, H, 30, D), kv(rng, B, H, 30, D))
    return c


def state(c):
    return c.offset, c.bytes().as_dict(), [layer.read(0, layer.offset)[0].tobytes() for layer in c]


def unchanged(c, before):
    assert state(c) == before


GOOD = np.zeros((B, H, 3, D), np.float32)
GOOD_Q = np.zeros((B, HQ, 3, D), np.float32)


def bad_tensors():
    """(name, array, expected exception, message fragment) for append's k."""
    nan = GOOD.copy()
    nan[0, 1, 2, 3] = np.nan
    inf = GOOD.copy()
    inf[0, 0, 0, 0] = -np.inf
    big = GOOD.copy()
    big[0, 0, 1, 0] = 1e6
    raw = np.zeros(B * H * 3 * D * 4 + 1, np.uint8)
    misaligned = raw[1:].view(np.float32).reshape(B, H, 3, D)
    return [
        ("3-D", np.zeros((H, 3, D), np.float32), kvq.ShapeMismatchError, "4-D"),
        ("5-D", np.zeros((1, B, H, 3, D), np.float32), kvq.ShapeMismatchError, "4-D"),
        ("heads", np.zeros((B, H + 1, 3, D), np.float32), kvq.ShapeMismatchError, "match|disagree"),
        ("head_dim", np.zeros((B, H, 3, D * 2), np.float32), kvq.ShapeMismatchError, "disagree"),
        ("batch", np.zeros((B + 1, H, 3, D), np.float32), kvq.ShapeMismatchError, "disagree"),
        ("no tokens", np.zeros((B, H, 0, D), np.float32), kvq.ShapeMismatchError, "disagree"),
        ("float64", GOOD.astype(np.float64), TypeError, "float64"),
        ("int32", GOOD.astype(np.int32), TypeError, "int32"),
        ("bool", GOOD.astype(bool), TypeError, "bool"),
        ("complex", GOOD.astype(np.complex64), TypeError, "complex"),
        ("negative stride", GOOD[:, :, ::-1], kvq.ShapeMismatchError, "negative stride"),
        ("NaN", nan, kvq.NonFiniteError, r"NaN at \[0, 1, 2, 3\]"),
        ("Inf", inf, kvq.NonFiniteError, "Inf"),
        ("beyond fp16", big, kvq.OutOfRangeError, "fp16 range"),
        ("misaligned", misaligned, kvq.InvalidArgumentError, "aligned"),
        ("list", GOOD.tolist(), TypeError, None),
        ("str", "k", TypeError, None),
        ("None", None, TypeError, None),
        ("cuda", ForeignTensor((B, H, 3, D), DL_CUDA), kvq.InvalidArgumentError, "cuda:0"),
        ("metal", ForeignTensor((B, H, 3, D), DL_METAL), kvq.UnsupportedError, "device type 8"),
    ]


@pytest.mark.parametrize("name,bad,error,message", bad_tensors(), ids=[t[0] for t in bad_tensors()])
def test_append_refuses_bad_tensors(cache, name, bad, error, message):
    before = state(cache)
    for args in ((bad, GOOD), (GOOD, bad)):
        with pytest.raises(error, match=message):
            cache[0].append(*args)
    unchanged(cache, before)


def test_append_refuses_bad_queries(cache):
    before = state(cache)
    nan = GOOD_Q.copy()
    nan[0, 3, 0, 0] = np.nan
    for q, error, message in [
        (GOOD, kvq.ShapeMismatchError, "q .* does not match"),
        (GOOD_Q[:, :, :2], kvq.ShapeMismatchError, "does not match"),
        (GOOD_Q[0], kvq.ShapeMismatchError, "4-D"),
        (nan, kvq.NonFiniteError, "q has NaN"),
        (GOOD_Q.astype(np.float64), TypeError, "q must be"),
        (ForeignTensor(GOOD_Q.shape), kvq.InvalidArgumentError, "q is on cuda:0"),
        ("q", TypeError, None),
    ]:
        with pytest.raises(error, match=message):
            cache[0].append(GOOD, GOOD, q)
    unchanged(cache, before)


def test_error_classes():
    for cls, base in [
        (kvq.InvalidArgumentError, ValueError),
        (kvq.ShapeMismatchError, ValueError),
        (kvq.NonFiniteError, ValueError),
        (kvq.OutOfRangeError, ValueError),
        (kvq.FormatError, ValueError),
        (kvq.CorruptError, ValueError),
        (kvq.IoError, OSError),
    ]:
        assert issubclass(cls, kvq.Error) and issubclass(cls, base)
    assert kvq.ShapeMismatchError.code == "shape_mismatch"


def test_attend_refuses_bad_queries_and_outputs(cache, rng):
    q = kv(rng, B, HQ, 1, D)
    layer = cache[0]
    before = state(cache)
    cases = [
        (lambda: layer.attend(q[:, :2], 0.1), kvq.ShapeMismatchError, "must be"),
        (lambda: layer.attend(kv(rng, B, HQ, 31, D), 0.1), kvq.ShapeMismatchError, "offset"),
        (lambda: layer.attend(q.astype(np.float64), 0.1), TypeError, "float64"),
        (lambda: layer.attend(q, float("nan")), kvq.InvalidArgumentError, "scale"),
        (lambda: layer.attend(q, 0.1, np.zeros(q.shape, np.float16)), kvq.ShapeMismatchError,
         "f32"),
        (lambda: layer.attend(q, 0.1, np.zeros((B, HQ, 2, D), np.float32)),
         kvq.ShapeMismatchError, "shape"),
        (lambda: layer.attend(q, 0.1, np.zeros(q.shape, np.int64)), TypeError, "int64"),
        (lambda: layer.attend(q, 0.1, "out"), TypeError, "writable"),
        (lambda: layer.attend(q, 0.1, kv_head_begin=1, kv_head_end=5), kvq.OutOfRangeError,
         "KV head range"),
        (lambda: layer.attend(q, 0.1, kv_head_begin=-1), kvq.OutOfRangeError, "KV head range"),
        (lambda: layer.attend(q, 0.1, ForeignTensor(q.shape, DL_CUDA)), kvq.InvalidArgumentError,
         "cuda:0"),
        (lambda: layer.attend(ForeignTensor(q.shape, DL_CUDA, 3), 0.1), kvq.InvalidArgumentError,
         "cuda:3"),
        # A device tensor claiming an absurd shape: refused before any output is sized from it.
        (lambda: layer.attend(ForeignTensor((2**40,) * 4, DL_CUDA), 0.1),
         kvq.InvalidArgumentError, "out` omitted"),
        (lambda: layer.attend(q, "0.1"), TypeError, None),
        (lambda: layer.attend([[1.0]], 0.1), TypeError, None),
    ]
    read_only = np.zeros(q.shape, np.float32)
    read_only.flags.writeable = False
    cases.append((lambda: layer.attend(q, 0.1, read_only), TypeError, "writable"))
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    # Queries older than the last append's, whose view the cache no longer holds.
    layer.append(kv(rng, B, H, 1, D), kv(rng, B, H, 1, D))
    with pytest.raises(kvq.InvalidArgumentError, match="exact values"):
        layer.attend(kv(rng, B, HQ, 31, D), 0.1)
    cache[1].append(kv(rng, B, H, 1, D), kv(rng, B, H, 1, D))
    cache.trim(1)
    unchanged(cache, before)
    empty = small_cache()
    with pytest.raises(kvq.ShapeMismatchError):
        empty[0].attend(q, 0.1)


def test_reads_refuse_bad_ranges_and_outputs(cache):
    layer = cache[0]
    before = state(cache)
    ok = np.zeros((B, H, 4, D), np.float32)
    read_only = ok.copy()
    read_only.flags.writeable = False
    for read in (layer.read, layer.read_exact):
        for t0, n in [(-1, 2), (0, 31), (29, 2), (0, -1), (1, 2**62), (2**62, 2**62)]:
            with pytest.raises(kvq.OutOfRangeError, match="outside"):
                read(t0, n)
            with pytest.raises(kvq.OutOfRangeError, match="outside"):
                read(t0, n, ok, ok.copy())
        with pytest.raises((TypeError, OverflowError)):
            read(0, 2**70)
        with pytest.raises(kvq.ShapeMismatchError, match="outputs must be"):
            read(26, 4, np.zeros((B, H, 3, D), np.float32), ok)
        with pytest.raises(TypeError, match="both"):
            read(26, 4, ok)
        with pytest.raises(TypeError, match="writable"):
            read(26, 4, read_only, ok)
        with pytest.raises(TypeError, match="int16"):
            read(26, 4, ok.astype(np.int16), ok)
        with pytest.raises(kvq.InvalidArgumentError, match="cuda:0"):
            read(26, 4, ForeignTensor(ok.shape), ok)
    with pytest.raises(kvq.OutOfRangeError, match="exact values are held from exact_begin"):
        cache[0].append(np.zeros((B, H, 1, D), np.float32), np.zeros((B, H, 1, D), np.float32))
        layer.read_exact(0, 2)
    layer.trim(1)
    for p in (-1, 30, 2**40):
        with pytest.raises(kvq.OutOfRangeError, match="query position"):
            layer.sealed_tokens_for_query(p)
    unchanged(cache, before)


def test_trim_refuses_bad_counts(cache):
    before = state(cache)
    for n in (-1, 31, 2**40):
        with pytest.raises(kvq.OutOfRangeError, match="trim"):
            cache.trim(n)
        with pytest.raises(kvq.OutOfRangeError, match="trim"):
            cache[1].trim(n)
    with pytest.raises(TypeError):
        cache.trim("1")
    unchanged(cache, before)


def test_model_cache_refuses_bad_construction():
    shape = kvq.ModelShape(2, H, D, HQ)
    cases = [
        (lambda: kvq.ModelCache("kiwi", shape), kvq.InvalidArgumentError, "did you mean 'kivi'"),
        (lambda: kvq.ModelCache("kivi:k_bits=99", shape), kvq.Error, "k_bits"),
        (lambda: kvq.ModelCache("kivi", kvq.ModelShape(0, H, D)), kvq.InvalidArgumentError,
         "n_layers"),
        (lambda: kvq.ModelCache("kivi", kvq.ModelShape(2, 3, D, 4)), kvq.InvalidArgumentError,
         "multiple"),
        (lambda: kvq.ModelCache("kivi", kvq.ModelShape([kvq.LayerShape(2, 0)])),
         kvq.InvalidArgumentError, "head_dim"),
        (lambda: kvq.ModelCache("kivi", shape, {7: "k_bits=4"}), kvq.Error, "7"),
        (lambda: kvq.ModelCache("kivi@9:k_bits=4", shape), kvq.Error, "9"),
        (lambda: kvq.ModelCache("kivi", shape, {0: "nope=1"}), kvq.Error, "nope"),
        (lambda: kvq.ModelCache("kivi", shape, device="tpu"), kvq.InvalidArgumentError, "device"),
        (lambda: kvq.ModelCache("kivi", shape, device="cuda:x"), kvq.InvalidArgumentError,
         "device"),
        (lambda: kvq.ModelCache("kivi", shape, device="cuda:0"), kvq.UnsupportedError, "cuda:0"),
        (lambda: kvq.ModelCache("kivi", shape, threads=-1), kvq.InvalidArgumentError, "threads"),
        (lambda: kvq.ModelCache(5, shape), TypeError, None),
        (lambda: kvq.ModelCache("kivi", (2, 2, 16)), TypeError, None),
        (lambda: kvq.ModelCache("kivi", shape, {"a": "b"}), TypeError, None),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    c = kvq.ModelCache("kivi", shape)
    for i in (2, -3, 10**6):
        with pytest.raises(IndexError):
            c[i]
    assert c[-1].index == 1
    with pytest.raises(kvq.NotFoundError, match="no parameter 'x'"):
        kvq.parse_spec("kivi").get("x")
    with pytest.raises(kvq.InvalidArgumentError, match="L:k=v"):
        kvq.parse_model_spec("kivi@k_bits=2")
    with pytest.raises(kvq.Error):
        kvq.parse_spec("kivi").apply("k_bits=1000")


def test_container_refuses_bad_files(cache, tmp_path):
    with pytest.raises(kvq.IoError, match="missing.kvq.*No such file"):
        kvq.load_cache(tmp_path / "missing.kvq")
    with pytest.raises(OSError):
        kvq.save_cache(cache, tmp_path / "no" / "such" / "dir.kvq")
    with pytest.raises(OSError):
        kvq.load_cache(tmp_path)  # a directory
    good = kvq.serialize_cache(cache)
    with pytest.raises(kvq.FormatError):
        kvq.parse_cache(b"not a kvq file at all, not even close" * 4)
    with pytest.raises((kvq.CorruptError, kvq.FormatError)):
        kvq.parse_cache(good[: len(good) // 2])
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    with pytest.raises((kvq.CorruptError, kvq.FormatError)):
        kvq.parse_cache(bytes(flipped))
    with pytest.raises((kvq.CorruptError, kvq.FormatError)):
        kvq.parse_cache(b"")
    (tmp_path / "trunc.kvq").write_bytes(good[:100])
    with pytest.raises((kvq.CorruptError, kvq.FormatError)):
        kvq.load_cache(tmp_path / "trunc.kvq")
    closed = io.BytesIO()
    closed.close()
    with pytest.raises(ValueError):
        kvq.save_cache(cache, closed)
    with pytest.raises(ValueError):
        kvq.load_cache(closed)
    with open(tmp_path / "w.kvq", "wb") as f:
        with pytest.raises(OSError):
            kvq.load_cache(f)  # opened for writing
    for bad in (5, None, 1.5):
        with pytest.raises(TypeError):
            kvq.load_cache(bad)
        with pytest.raises(TypeError):
            kvq.save_cache(cache, bad)
        with pytest.raises(TypeError):
            kvq.parse_cache(bad)
    with pytest.raises(TypeError):
        kvq.parse_cache("a str is not bytes")
    with pytest.raises(TypeError):
        kvq.serialize_cache("cache")
    with pytest.raises(TypeError):
        kvq.save_cache(cache, tmp_path / "x.kvq", {"a": 1})
    assert not (tmp_path / "x.kvq").exists()
    assert kvq.parse_cache(good).offset == 30


def test_torch_tensors_that_cannot_be_viewed(cache):
    torch = pytest.importorskip("torch")
    before = state(cache)
    good = torch.zeros(B, H, 3, D)
    for bad, error in [
        (torch.zeros(B, H, 3, D, device="meta"), TypeError),  # no memory to view
        (torch.zeros(B, H, 3, D, dtype=torch.float64), TypeError),
        (torch.zeros(B, H, 3, D, dtype=torch.int8), TypeError),
        (torch.zeros(B, H, 3, D, dtype=torch.float8_e4m3fn), TypeError),
        (torch.full((B, H, 3, D), float("nan"), dtype=torch.bfloat16), kvq.NonFiniteError),
    ]:
        with pytest.raises(error):
            cache[0].append(bad, good)
    unchanged(cache, before)
    # A tensor that requires grad (a forward pass outside no_grad) is read like any other.
    cache[0].append(torch.ones(B, H, 3, D, requires_grad=True), good)
    assert cache[0].offset == 33


def test_object_misuse_is_refused(rng):
    """Re-running __init__, constructing what only kvq constructs, using an uninitialised
    instance: nanobind refuses each with a TypeError, and the cache is untouched."""
    shape = kvq.ModelShape(1, H, D)
    c = kvq.ModelCache("kivi", shape)
    c[0].append(kv(rng, B, H, 3, D), kv(rng, B, H, 3, D))
    with pytest.warns(RuntimeWarning), pytest.raises(TypeError):
        c.__init__("fp16", shape)
    with pytest.warns(RuntimeWarning), pytest.raises(TypeError):
        kvq.ModelCache.__new__(kvq.ModelCache).offset
    for cls in (kvq.LayerCache, kvq.CacheBytes, kvq.Method, kvq.Param):
        with pytest.raises(TypeError, match="no constructor"):
            cls()
    assert c.offset == 3 and c.model_spec.startswith("kivi:")
