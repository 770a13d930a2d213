"""Shared helpers of kvq's Python tests."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from redis_util import RedisCluster, RedisServer, redis_missing

import kvq


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

DL_CPU, DL_CUDA, DL_METAL = 1, 2, 8


class ForeignTensor:
    """A DLPack producer that claims a tensor of `shape` (float32) on any device, at an address
    nothing may touch: kvq must refuse it from its metadata alone (a dereference would crash)."""

    def __init__(self, shape, device_type=DL_CUDA, device_id=0, address=0x10):
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.managed = _DLManagedTensor()
        t = self.managed.dl_tensor
        t.data, t.ndim, t.shape, t.strides = address, len(shape), self.shape, None
        t.device = _DLDevice(device_type, device_id)
        t.dtype = _DLDataType(2, 32, 1)  # float32
        self.device = (device_type, device_id)

    def __dlpack__(self, **kwargs):
        return _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack_device__(self):
        return self.device


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def kv(rng, b, h, s, d, dtype=np.float32):
    """Random keys or values [B, H, S, D]."""
    return rng.standard_normal((b, h, s, d)).astype(dtype)


ROPE = kvq.RopeShape(kvq.RopeMode.adjacent, 10000.0, 1.0)


def small_cache(method="kivi", n_layers=2, n_kv=2, head_dim=16, n_q=4, **kwargs):
    """A cache of `method` with its test settings (blocks seal within a few dozen tokens), at a
    shape every method takes: head_dim a multiple of ggml's 32-element block, RoPE declared (for
    methods that quantize keys before RoPE)."""
    spec = kvq.find_method(method).test_spec()
    shape = kvq.ModelShape(n_layers, n_kv, head_dim, n_q, ROPE)
    return kvq.ModelCache(str(spec), shape, **kwargs)


def _running(kind, directory):
    """A real Redis (RedisServer or RedisCluster) in `directory` for one test, killed after it;
    the test is skipped, saying why, without redis-server."""
    why = redis_missing()
    if why:
        pytest.skip(why)
    directory.mkdir()
    server = kind(str(directory))
    yield server
    server.kill()


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port for one test (skipped, saying why, without
    one)."""
    yield from _running(RedisServer, tmp_path / "redis")


@pytest.fixture(params=["dir", "redis"])
def store_url(request, tmp_path):
    """A store URL of each backend: a directory, then a real redis-server."""
    if request.param == "dir":
        return f"dir:{tmp_path / 'store'}"
    return request.getfixturevalue("redis_server").url


@pytest.fixture
def redis_cluster(tmp_path):
    """A real Redis Cluster of three masters on loopback (skipped, saying why, without
    redis-server)."""
    yield from _running(RedisCluster, tmp_path / "cluster")
