"""kvq under a Hugging Face transformers model: a ``Cache`` and an attention function.

    import kvq.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvq")
    cache = kvq.hf.KvqCache("kivi:k_bits=2,v_bits=2", model.config)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    print(cache.bytes().bits_per_element, cache.resident_bytes())

What the model sees
-------------------
kvq's contract (include/kvq/cache.h) is *per query*: a query at position p sees exactly what
token-by-token appending would hold at offset p + 1 -- the blocks sealed by then, dequantized as
stored, and every newer token exact. How much of that a model gets depends on its attention:

* ``attn_implementation="kvq"`` (registered by importing this module): attention runs inside kvq
  (``LayerCache.attend``), dequantizing within the dot products, with the per-query semantics
  exactly, for prefill chunks and decode steps alike; the dequantized cache is never
  materialised. ``update()`` then returns placeholders (NaN-filled zero-stride tensors of the
  right shape, so that any other consumer fails loudly instead of silently reading garbage) and
  defers the append to the attention call, which appends the keys and values together with
  their queries: methods that rank tokens by attention (``zipcache:saliency=attn``, its
  default) get them, as in kvq's own engine.
  With a mask that is not plain causal over the held tokens (padding, sliding windows), kvq's
  attention is computed by :func:`per_query_attention`: the same semantics, through read() and
  read_exact() and torch's sdpa, one call per seal boundary.
* The model's own attention (``"sdpa"``, ``"eager"``, ...): ``update()`` returns keys and values
  of every held token as the *first query of the update* sees them: tokens sealed before it
  dequantized (read()), every newer one exact (read_exact()). For a decode step (one token) that
  is exactly kvq's per-query view. In a prefill chunk, later queries also see exactly the blocks
  this chunk sealed, where kvq's own attention shows them dequantized -- the "prefill in full
  precision" convention of transformers' ``QuantizedCache``. The dequantized copy is built on
  every call (as ``QuantizedCache`` does), so memory is only saved between forward passes.

Layers
------
Full-attention layers hold a kvq cache; together they form one ``kvq.ModelCache``
(:attr:`KvqCache.model_cache`), whose layer i is the model's i-th full-attention layer (spec
overrides ``@L`` count those layers; :attr:`KvqCache.kvq_layers` maps them back). Sliding-window
and chunked layers keep transformers' own ``DynamicSlidingWindowLayer`` by default
(``sliding="window"``): their window is bounded and short next to the full layers' history, and a
kvq cache never evicts old tokens. ``sliding="kvq"`` puts them in kvq too (the whole history
compressed; attention then masks to the window through the per-query path). Other layer types
(linear attention, shared-KV "dummy" layers) keep their transformers classes.

GQA and MQA (query heads in contiguous groups per KV head, as transformers' ``repeat_kv``),
head_dim 1-4096, attention biases and query pre-scalars (``scaling``) need nothing special.
Soft-capping, attention sinks and dropout are refused by the kvq attention function.

Speculative decoding: :meth:`KvqCache.crop` trims every kvq layer (all or nothing). Beam search
and batch editing (``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``)
are refused on a non-empty cache: kvq's cache contract has no operation on batch rows (the
stored block layouts are the methods' own), so there is nothing exact to call.

Prefix reuse through a store
----------------------------
A long shared prompt (a system prompt, a document) can be computed once and its compressed cache
reused by any process, through kvq's prefix store (docs/store.md)::

    store = kvq.hf.ModelStore("redis://10.0.0.5:6379", model, tokenizer)   # or dir:PATH
    cache = kvq.hf.KvqCache("kivi", model.config, store=store)
    reused = cache.prefill(model, input_ids)       # the stored prefix imported, the rest computed
    out = model.generate(input_ids, cache=cache, max_new_tokens=64)  # feeds the last token
    print(cache.store_report())

:meth:`KvqCache.prefill` imports the longest stored prefix of whole chunks of ``input_ids``,
computes the rest but the last token in pieces that end at chunk boundaries, and stores each
chunk it completes (in the background); ``generate`` then feeds the model only the last token.
Imported bytes are exactly what computing them stores, and the pieces after them are the same
forward calls, so the logits are bit-identical to a run that computed the prefix (with
:meth:`~KvqCache.prefill`, store or not). A store that is down, slow or damaged is a shorter
reuse or a recompute, reported by :meth:`~KvqCache.store_report`, never an error or a wrong
cache. The namespace is :func:`model_fingerprint` (weights, config, tokenizer), the cache's
canonical spec, the batch size, the chunk size and :func:`producer` (transformers, torch,
device, dtype, attention: what rounds the keys and values).
"""

from __future__ import annotations

import copy
import inspect
import json
import weakref
from typing import Any, Mapping

import torch
import transformers
from transformers import AttentionInterface, PreTrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    get_layer_types_and_kwargs,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import kvq

ATTENTION = "kvq"
"""The name registered in ``AttentionInterface`` (use ``attn_implementation="kvq"``)."""

_SLIDING_TYPES = ("sliding_attention", "chunked_attention")


def _rope_shape(config: PreTrainedConfig) -> kvq.RopeShape:
    """The RoPE transformers applies (rotate_half pairs), when kvq can redo it exactly: full
    rotary dims, default or linear scaling. Anything else gives mode none, and methods that
    quantize keys before RoPE then refuse the model with a clear error."""
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params, Mapping):
        params = {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if theta is None or partial not in (None, 1, 1.0) or kind not in ("default", "linear"):
        return kvq.RopeShape()
    scale = 1.0 / float(params.get("factor", 1.0)) if kind == "linear" else 1.0
    return kvq.RopeShape(kvq.RopeMode.half, float(theta), scale)


def _model_shape(config: PreTrainedConfig, n_layers: int) -> kvq.ModelShape:
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_q
    return kvq.ModelShape(n_layers, n_kv, head_dim, n_q, _rope_shape(config))


class KvqLayer(CacheLayerMixin):
    """One layer held by kvq: a view of layer ``kvq_index`` of the owner's ``kvq.ModelCache``."""

    is_compileable = False
    is_croppable = True

    def __init__(self, owner: KvqCache, kvq_index: int, sliding: bool = False):
        super().__init__()
        self._owner = weakref.ref(owner)  # the cache owns its layers, not the reverse
        self.kvq_index = kvq_index
        self.is_sliding = sliding
        self.cache: kvq.LayerCache = owner.model_cache[kvq_index]
        # Keys and values update() received in fused mode, appended by attention() with their
        # queries (or by flush() before anything else looks at the cache).
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"KvqLayer({self.kvq_index}, {self.cache.offset} tokens)"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _copy_for(self, owner: KvqCache) -> KvqLayer:
        """This layer as a layer of `owner`, a copy of its cache (see KvqCache.__deepcopy__)."""
        new = copy.copy(self)
        new._owner = weakref.ref(owner)
        new.cache = owner.model_cache[self.kvq_index]
        new._pending = None
        return new

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new tokens' keys and values ([B, H_kv, S, D], after RoPE, read in place)
        and returns what the model's attention reads (see the module's docstring)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.flush()
        owner = self._owner()
        if owner is not None and owner.fused:
            self._pending = (key_states, value_states)
            return self._placeholders(key_states)
        self.cache.append(key_states, value_states)
        first = self.cache.offset - key_states.shape[-2]
        return self.view(self.cache.sealed_tokens_for_query(first), key_states.dtype)

    def flush(self, query: torch.Tensor | None = None) -> None:
        """Appends keys and values whose append update() deferred, with their queries if given."""
        if self._pending is not None:
            k, v = self._pending
            self._pending = None
            self.cache.append(k, v, query)

    def view(
        self, boundary: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held token's keys and values as a query with seal boundary ``boundary`` sees
        them (see boundary_view)."""
        return boundary_view(self.cache, boundary, dtype, self.device)

    def _placeholders(self, key_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        B, H, S, D = key_states.shape
        shape = (B, H, c.offset + S, D)
        nan = torch.full((1, 1, 1, 1), float("nan"), dtype=key_states.dtype, device=self.device)
        k, v = nan.expand(shape), nan.expand(shape)
        k._kvq_layer = weakref.ref(self)  # how kvq_attention finds the cache behind `key`
        return k, v

    def attention(
        self, query: torch.Tensor, attention_mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """Attention of the newest tokens' queries [B, H_q, S, D] against this layer under kvq's
        per-query semantics; returns [B, S, H_q, D] in the query's dtype. A mask that is plain
        causal over the held tokens (or None) runs kvq's fused attend(); any other runs
        per_query_attention()."""
        self.flush(query)
        c = self.cache
        B, Hq, S, D = query.shape
        if attention_mask is None or _is_causal(attention_mask, S, c.offset):
            out = torch.empty((B, S, Hq, D), dtype=torch.float32, device=query.device)
            c.attend(query, scale, out.transpose(1, 2))
            return out.to(query.dtype)
        return per_query_attention(c, query, attention_mask, scale).transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        self.flush()
        return self.cache.offset

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._pending = None
        self.cache.reset()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the newest ``-tokens_to_remove`` tokens (transformers' convention: a
        negative count; positive values are refused as by ``DynamicLayer``)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove"
            )
        self.flush()
        if tokens_to_remove:
            self.cache.trim(-tokens_to_remove)

    def offload(self) -> None:  # kvq caches live where kvq put them
        pass

    def prefetch(self) -> None:
        pass

    def _refuse_batch_edit(self, what: str) -> None:
        if self.get_seq_length():
            raise NotImplementedError(
                f"{what}: kvq caches cannot reorder or select batch rows (the cache contract has "
                "no batch-row operation); use num_beams=1 and no batch editing with a KvqCache"
            )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if torch.equal(beam_idx.cpu(), torch.arange(len(beam_idx))):
            return
        self._refuse_batch_edit("reorder_cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse_batch_edit("batch_select_indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._refuse_batch_edit("batch_repeat_interleave")


class KvqCache(Cache):
    """A transformers ``Cache`` whose full-attention layers are held compressed by kvq.

    Args:
        spec: a kvq model spec, e.g. ``"kivi:k_bits=2,v_bits=2"`` (``kvq.methods()`` lists every
            method and parameter; per-layer overrides ``@L:k=v`` count full-attention layers).
        config: the model's config (its text config is used): layer types, heads, head_dim.
        sliding: ``"window"`` (default) keeps sliding/chunked layers in transformers' fp16
            window layer; ``"kvq"`` holds them in kvq too.
        threads: threads kvq may use inside a call (1: the calling thread; 0: all).
        device: where kvq keeps the cache ("cpu"; kvq has no CUDA backend yet).
        store: a :class:`ModelStore` to reuse prompt prefixes from and store new ones in (see
            :meth:`prefill`); or a store URL / ``kvq.Store``, with ``model`` (and ``tokenizer``)
            given, for which a ModelStore is made (fingerprinting the model: make one
            ModelStore and pass it to every cache instead).
        model, tokenizer: the model (and tokenizer) a store URL is bound to.

    With ``attn_implementation="kvq"`` the model attends through kvq (see the module docstring
    for what the model sees with either attention).
    """

    def __init__(
        self,
        spec: str,
        config: PreTrainedConfig,
        *,
        sliding: str = "window",
        threads: int = 1,
        device: str = "cpu",
        overrides: Mapping[int, str] | None = None,
        store: ModelStore | kvq.Store | str | None = None,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
    ):
        if store is not None and not isinstance(store, ModelStore):
            if not isinstance(store, (str, kvq.Store)):
                raise TypeError(
                    "store must be a kvq.hf.ModelStore, a kvq.Store or a store URL, got "
                    f"{type(store).__name__}"
                )
            if model is None:
                raise TypeError(
                    "store=URL or kvq.Store needs model= (its weights name the stored bytes); "
                    "or pass a kvq.hf.ModelStore"
                )
            store = ModelStore(store, model, tokenizer)
        if sliding not in ("window", "kvq"):
            raise ValueError(f"sliding must be 'window' or 'kvq', got {sliding!r}")
        # The layer types DynamicCache would infer (explicit layer_types, else sliding_window).
        self.config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(self.config)
        in_kvq = [
            t == "full_attention" or (sliding == "kvq" and t in _SLIDING_TYPES)
            for t in layer_types
        ]
        #: Model layer index of each kvq layer.
        self.kvq_layers: list[int] = [i for i, held in enumerate(in_kvq) if held]
        if not self.kvq_layers:
            raise ValueError(
                "no layer of this model would be held by kvq (every layer is "
                f"{sorted(set(layer_types))}); sliding='kvq' holds sliding layers too"
            )
        self.model_cache = kvq.ModelCache(
            spec,
            _model_shape(self.config, len(self.kvq_layers)),
            dict(overrides or {}),
            device=device,
            threads=threads,
        )
        layers: list[Any] = []
        for i, (t, kw) in enumerate(zip(layer_types, layer_kwargs)):
            if in_kvq[i]:
                layers.append(KvqLayer(self, self.kvq_layers.index(i), t in _SLIDING_TYPES))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[t](**kw))
        if store is not None and len(self.kvq_layers) != len(layer_types):
            # A reuse imports kvq's layers only: transformers' own would be left empty.
            raise ValueError(
                "a store needs every layer held by kvq; layers "
                f"{[i for i, held in enumerate(in_kvq) if not held]} are "
                f"{sorted({layer_types[i] for i, held in enumerate(in_kvq) if not held})} "
                "(sliding='kvq' holds sliding layers too)"
            )
        super().__init__(layers=layers)
        #: The ModelStore prefill() reuses prefixes from (None: no store).
        self.store: ModelStore | None = store
        self._session: kvq.PrefixSession | None = None

    def __deepcopy__(self, memo: dict) -> KvqCache:
        """A deep copy (e.g. a prompt's cache reused for several continuations, as transformers'
        docs do with copy.deepcopy): kvq's layers are copied by ModelCache.clone()."""
        self.flush()
        new = copy.copy(self)
        memo[id(self)] = new
        new.model_cache = self.model_cache.clone()
        new._session = None  # the session belongs to the original's prefill
        new.layers = [
            layer._copy_for(new) if isinstance(layer, KvqLayer) else copy.deepcopy(layer, memo)
            for layer in self.layers
        ]
        return new

    @property
    def fused(self) -> bool:
        """Whether the model attends through kvq (``attn_implementation="kvq"``)."""
        return getattr(self.config, "_attn_implementation", None) == ATTENTION

    def crop(self, tokens_to_remove: int) -> None:
        """Speculative decoding's rollback: removes the newest ``-tokens_to_remove`` tokens from
        every layer; kvq's layers are trimmed together (validated before any changes)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove"
            )
        self.flush()
        if tokens_to_remove:
            self.model_cache.trim(-tokens_to_remove)
        for layer in self.layers:
            if not isinstance(layer, KvqLayer):
                layer.crop(tokens_to_remove)

    def prefill(
        self, model: torch.nn.Module, input_ids: torch.Tensor, *, max_piece: int | None = None
    ) -> int:
        """Fills this (empty) cache with every token of ``input_ids`` [B, n] but the last, and
        returns how many of them came from the store.

        With a store: the longest prefix of whole chunks the store holds (at most n - 1 tokens)
        is imported, the rest is computed in pieces that end at chunk boundaries (at most
        ``max_piece`` tokens each; default the chunk size), and every chunk completed is stored
        in the background. Without a store the pieces end at multiples of ``max_piece``
        (default 256), so a store of that chunk size gives the same pieces. Then
        ``model.generate(input_ids, cache=cache, ...)`` feeds the model the last token
        only; its logits are bit-identical whether the prefix was fetched or computed. Every row
        is a real prompt: padding (an attention mask) is not supported here.
        """
        if self.get_seq_length() != 0:
            raise ValueError("prefill() starts a prompt: the cache must be empty (reset() it)")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise TypeError("input_ids must be a [batch, n] tensor of token ids")
        dt = input_ids.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        if max_piece is not None and max_piece < 1:
            raise ValueError(f"max_piece must be >= 1, got {max_piece}")
        n = input_ids.shape[1]
        if n < 1:
            raise ValueError("input_ids holds no token")
        chunk = max_piece or kvq.DEFAULT_STORE_CHUNK_TOKENS  # piece boundaries without a store
        session = None
        if self.store is not None:
            self.store.check_model(model)
            prefix = self.store.prefix_store(self, batch=input_ids.shape[0])
            session = kvq.PrefixSession(
                [(self.model_cache, prefix)], input_ids.cpu(), self.store.writer
            )
            chunk = session.chunk_tokens
        self._session = session
        p = session.reuse(n - 1) if session is not None else 0
        piece = max_piece or chunk
        forward = _forward_kwargs(model)
        with torch.no_grad():
            while p < n - 1:
                e = min(p + piece, n - 1, (p // chunk + 1) * chunk)
                model(input_ids[:, p:e], use_cache=True, **forward(self))
                self.flush()
                p = e
                if session is not None:
                    session.reached(p)
        return session.reused_tokens if session is not None else 0

    def store_report(self) -> dict[str, Any]:
        """What the last :meth:`prefill` did with the store (waiting for the background writes
        first): tokens reused and fetched bytes, chunks stored, and every reason a reuse was
        shorter or a write failed (``notes``, ``writer["errors"]``)."""
        if self.store is None or self._session is None:
            raise ValueError("no prefill() through a store yet")
        s, fetch = self._session, self._session.fetches[0]
        writer = self.store.writer.flush() if self.store.writer is not None else None
        return {
            "reused_tokens": s.reused_tokens,
            "fetched_bytes": fetch.bytes,
            "lookup_s": fetch.lookup_s,
            "fetch_s": fetch.fetch_s,
            "import_s": fetch.import_s,
            "exported_chunks": s.exported_chunks,
            "exported_bytes": s.exported_bytes,
            "notes": s.notes,
            "writer": writer,
        }

    def flush(self) -> None:
        """Appends what update() deferred in every kvq layer (see KvqLayer.flush)."""
        for layer in self.layers:
            if isinstance(layer, KvqLayer):
                layer.flush()

    def bytes(self) -> kvq.CacheBytes:
        """kvq's accounting of its layers (by kind; sliding window layers not included)."""
        self.flush()
        return self.model_cache.bytes()

    def resident_bytes(self) -> int:
        """Bytes kvq's layers hold, measured (== bytes().total)."""
        self.flush()
        return self.model_cache.resident_bytes()

    def window_bytes(self) -> int:
        """Bytes of the layers transformers holds (sliding windows), as torch tensors."""
        total = 0
        for layer in self.layers:
            if not isinstance(layer, KvqLayer):
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        total += t.numel() * t.element_size()
        return total


def _forward_kwargs(model: torch.nn.Module):
    """How to hand a cache to ``model``'s forward (``cache=``, or ``past_key_values=`` in older
    transformers 5 releases), asking for the last position's logits only where it can."""
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return lambda cache: {name: cache, **extra}


def model_fingerprint(model: torch.nn.Module, tokenizer: Any = None) -> str:
    """A 128-bit fingerprint (32 hex digits) of what maps token ids to keys and values under
    transformers: XXH3-128 of a text listing the model's config (``to_dict()`` without
    ``transformers_version`` and ``_name_or_path``, as sorted JSON), then every tensor of its
    ``state_dict()`` sorted by name -- name, dtype, shape and the XXH3-128 of its bytes --, then,
    when given, the tokenizer's class, vocabulary (token -> id) and special tokens. Two models
    share it only if their configs and every weight byte agree (up to a 128-bit collision);
    the tokenizer is included so that deployments with different tokenizers never share a
    namespace. It is not kvq's engine fingerprint (docs/store.md §2.1: over GGUF files), so the
    two never share stored bytes -- nor could they: the engines round differently."""
    config = model.config.to_dict()
    for key in ("transformers_version", "_name_or_path"):
        config.pop(key, None)
    lines = ["kvq-hf-fingerprint 1", "config " + json.dumps(config, sort_keys=True, default=str)]
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            lines.append(f"tensor {name} {t.dtype} {tuple(t.shape)} {kvq.hash128(raw)}")
    if tokenizer is not None:
        vocab = sorted(tokenizer.get_vocab().items())
        special = getattr(tokenizer, "special_tokens_map", {})
        lines.append(f"tokenizer {type(tokenizer).__name__} " + json.dumps(vocab))
        lines.append("special " + json.dumps(special, sort_keys=True, default=str))
    return kvq.hash128("\n".join(lines).encode())


def producer(model: torch.nn.Module) -> str:
    """What computes the keys and values a store holds for ``model`` (docs/store.md §2.2):
    kvq.hf's version, transformers', torch's, the device, the dtype and the attention
    implementation -- each changes how they round, so caches of two of them never mix."""
    p = next(model.parameters(), None)
    device = p.device.type if p is not None else "cpu"
    dtype = str(p.dtype).removeprefix("torch.") if p is not None else "none"
    attn = getattr(model.config, "_attn_implementation", None) or "default"
    text = (
        f"kvq-hf/1 transformers/{transformers.__version__} torch/{torch.__version__} "
        f"{device} {dtype} attn={attn}"
    )
    return "".join(c if 33 <= ord(c) < 127 or c == " " else "?" for c in text)


class ModelStore:
    """A prefix store bound to one transformers model: the store, a background writer, the
    model's :func:`model_fingerprint` (computed once, here: make a new ModelStore if the weights
    change) and :func:`producer`. Pass it to any number of :class:`KvqCache` s
    (``store=``).

    Args:
        store: a store URL (``dir:PATH``, ``redis://HOST:PORT``, ``redis-cluster://...``) or a
            ``kvq.Store``.
        model: the model whose caches are stored.
        tokenizer: its tokenizer (optional; part of the fingerprint when given).
        chunk_tokens: tokens per stored chunk (a multiple of every layer's block length).
        write: whether prefill() stores the chunks it computes (False: reuse only).
    """

    def __init__(
        self,
        store: kvq.Store | str,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        chunk_tokens: int = kvq.DEFAULT_STORE_CHUNK_TOKENS,
        write: bool = True,
    ):
        if isinstance(store, str):
            store = kvq.Store(store)
        elif not isinstance(store, kvq.Store):
            raise TypeError(f"store must be a kvq.Store or a URL, got {type(store).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch module, got {type(model).__name__}")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
            raise TypeError(f"chunk_tokens must be an int, got {type(chunk_tokens).__name__}")
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.fingerprint = model_fingerprint(model, tokenizer)
        self.producer = producer(model)
        self._model = weakref.ref(model)
        #: The background writer (None with write=False).
        self.writer: kvq.StoreWriter | None = store.writer() if write else None

    def __repr__(self) -> str:
        return f"ModelStore({self.store.url!r}, model {self.fingerprint})"

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuses a model other than the one fingerprinted, or one whose attention changed
        since (its caches would land in another model's namespace)."""
        if model is not self._model():
            raise ValueError("this ModelStore was made for another model (its fingerprint names it)")
        if producer(model) != self.producer:
            raise ValueError(
                f"the model now computes as '{producer(model)}', the ModelStore was made for "
                f"'{self.producer}': make a new ModelStore"
            )

    def namespace(self, cache: KvqCache, batch: int = 1) -> kvq.StoreNamespace:
        """The namespace of ``cache``'s kvq layers for prompts of ``batch`` rows."""
        return kvq.StoreNamespace(
            cache.model_cache,
            self.fingerprint,
            self.chunk_tokens,
            producer=self.producer,
            batch=batch,
        )

    def prefix_store(self, cache: KvqCache, batch: int = 1) -> kvq.PrefixStore:
        return kvq.PrefixStore(self.store, self.namespace(cache, batch))


def boundary_view(
    cache: kvq.LayerCache,
    boundary: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every token ``cache`` holds, [B, H_kv, offset, D]: tokens below
    ``boundary`` dequantized (read()), the rest exact (read_exact()) -- what a query whose seal
    boundary is ``boundary`` (``sealed_tokens_for_query``) sees."""
    shape = (cache.batch, cache.shape.n_kv_heads, cache.offset, cache.shape.head_dim)
    k = torch.empty(shape, dtype=dtype, device=device)
    v = torch.empty_like(k)
    if boundary > 0:
        cache.read(0, boundary, k[:, :, :boundary], v[:, :, :boundary])
    if boundary < cache.offset:
        n = cache.offset - boundary
        cache.read_exact(boundary, n, k[:, :, boundary:], v[:, :, boundary:])
    return k, v


def _is_causal(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """Whether a [B, 1|H, S, L] mask (bool: True attends; float: 0 attends) lets the newest
    q_len queries see exactly the keys at or before their positions, of kv_len held tokens."""
    if mask.dim() != 4 or mask.shape[-2] != q_len or mask.shape[-1] != kv_len:
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    pos = torch.arange(kv_len - q_len, kv_len, device=mask.device)
    causal = torch.arange(kv_len, device=mask.device)[None, :] <= pos[:, None]
    return bool((allowed == causal).all())


def per_query_attention(
    cache: kvq.LayerCache,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """kvq's per-query attention semantics built from read()/read_exact(), for any mask.

    ``query``: the newest S tokens' queries [B, H_q, S, D] (query t at position offset - S + t);
    ``attention_mask``: None (causal) or [B, 1|H_q, S, offset] (bool: True attends; float: added
    to the scores). Queries are grouped by their seal boundary (it moves by one block every
    ``block_tokens`` tokens), and each group attends, through torch's sdpa in float32, to every
    held token as it sees them. Returns float32 [B, H_q, S, D].

    This is the reference of what ``LayerCache.attend`` computes (fused, without materialising
    the dequantized cache), and the path for masks attend() does not take.
    """
    offset, S = cache.offset, query.shape[2]
    first = offset - S
    boundaries = [cache.sealed_tokens_for_query(p) for p in range(first, offset)]
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    i = 0
    while i < S:
        j = i
        while j < S and boundaries[j] == boundaries[i]:
            j += 1
        k, v = boundary_view(cache, boundaries[i], torch.float32, query.device)
        if attention_mask is None:
            pos = torch.arange(first + i, first + j, device=query.device)
            mask = torch.arange(offset, device=query.device)[None, :] <= pos[:, None]
        else:
            mask = attention_mask[:, :, i:j, :]
            mask = mask if mask.dtype == torch.bool else mask.float()
        out[:, :, i:j] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, i:j].float(),
            k,
            v,
            attn_mask=mask,
            scale=scale,
            enable_gqa=query.shape[1] != k.shape[1],
        )
        i = j
    return out


def kvq_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"kvq"``: layers held by kvq attend inside kvq
    (see KvqLayer.attention); any other layer (a sliding window kept by transformers, a model
    run without a KvqCache) goes to transformers' sdpa attention with the same arguments."""
    ref = getattr(key, "_kvq_layer", None)
    layer = ref() if ref is not None else None
    if layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout and module.training:
        raise NotImplementedError("kvq attention: dropout is not supported (inference only)")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"kvq attention: {name} is not supported")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return layer.attention(query, attention_mask, float(scale)), None


AttentionInterface.register(ATTENTION, kvq_attention)
# Masks as for sdpa: None when plain causal, else a boolean [B, 1, S, L].
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
