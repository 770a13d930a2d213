"""kvq: KV-cache compression you can measure.

Bindings to kvq's C++ library (include/kvq): the method table, spec strings, ``ModelCache`` and
its ``LayerCache`` s under the per-query attention contract, and the ``.kvq`` container. Tensors
(numpy arrays, torch tensors, any DLPack producer) are logical ``[B, H, S, D]`` of float32,
float16 or bfloat16 with any strides, and are read in place.

``kvq.hf`` (needs torch and transformers) puts a kvq cache under a Hugging Face model.
"""

from __future__ import annotations

import os
from typing import BinaryIO, Mapping, Union

from . import _kvq
from ._kvq import (
    BitStep,
    CacheBytes,
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
    ShapeMismatchError,
    Spec,
    UnsupportedError,
    __version__,
    find_method,
    hardware_threads,
    methods,
    parse_cache,
    parse_model_spec,
    parse_spec,
    serialize_cache,
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
