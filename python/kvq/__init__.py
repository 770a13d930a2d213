"""kvq: KV-cache compression you can measure.

Bindings to kvq's C++ library (include/kvq): the method table, spec strings, ``ModelCache`` and
its ``LayerCache`` s under the per-query attention contract, and the ``.kvq`` container. Tensors
(numpy arrays, torch tensors, any DLPack producer) are logical ``[B, H, S, D]`` of float32,
float16 or bfloat16 with any strides, and are read in place.

The prefix store (docs/store.md): ``Store`` opens one by URL (``dir:PATH``,
``redis://HOST:PORT``, ``redis-cluster://HOST:PORT,...``) with the verbs of ``kvq store`` (``ls``,
``stats``, ``get``, ``put``, ``rm``, ``keys``); ``StoreNamespace``, ``PrefixStore``,
``StoreWriter`` and ``PrefixSession`` look a prompt's longest stored prefix up, import it into a
``ModelCache`` and store new chunks.

``kvq.hf`` (needs torch and transformers) puts a kvq cache under a Hugging Face model, with
prefix reuse through a store (``kvq.hf.ModelStore``).
"""

from __future__ import annotations

import os
from typing import BinaryIO, Mapping, Union

from . import _kvq
from ._kvq import (
    BitStep,
    CacheBytes,
    DEFAULT_STORE_CHUNK_TOKENS,
    STORE_FORMAT_VERSION,
    CorruptError,
    Error,
    FormatError,
    InvalidArgumentError,
    IoError,
    LayerCache,
    LayerShape,
    LimitError,
    Method,
    ModelCache,
    ModelShape,
    NonFiniteError,
    RopeMode,
    RopeShape,
    NotFoundError,
    OutOfRangeError,
    Param,
    PrefixFetch,
    PrefixSession,
    PrefixStore,
    ShapeMismatchError,
    Spec,
    Store,
    StoreNamespace,
    StoreWriter,
    UnsupportedError,
    __version__,
    chunk_keys,
    find_method,
    fingerprint_files,
    hardware_threads,
    hash128,
    inspect_store_object,
    methods,
    parse_cache,
    parse_model_spec,
    parse_spec,
    serialize_cache,
    store_has_redis,
    store_key_prefix,
    store_object_key,
)

PathOrFile = Union[str, "os.PathLike[str]", BinaryIO]


def save_cache(
    cache: ModelCache, file: PathOrFile, attributes: Mapping[str, str] | None = None
) -> None:
    """Writes ``cache`` as a ``.kvq`` file: to a path (atomically: a failure never replaces an
    existing file) or to a binary file object (its ``write``)."""
    attributes = dict(attributes or {})
    if isinstance(file, (str, os.PathLike)):
        _kvq.save_cache(cache, file, attributes)
    elif hasattr(file, "write"):
        file.write(serialize_cache(cache, attributes))
    else:
        raise TypeError(f"save_cache: expected a path or a binary file, got {type(file).__name__}")


def load_cache(file: PathOrFile) -> ModelCache:
    """Reads a ``.kvq`` file from a path or a binary file object (every byte validated)."""
    if isinstance(file, (str, os.PathLike)):
        return _kvq.load_cache(file)
    if hasattr(file, "read"):
        return parse_cache(file.read())
    raise TypeError(f"load_cache: expected a path or a binary file, got {type(file).__name__}")


__all__ = [name for name in dir(_kvq) if not name.startswith("_")] + ["save_cache", "load_cache"]
