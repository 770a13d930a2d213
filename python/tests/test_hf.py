"""kvq.hf under tiny random Llama, Qwen2, Mistral and Gemma 3 models (CPU, no downloads).

Tolerance: with a float32 model, kvq's fp16 method stores keys and values rounded to fp16
(relative error <= 2^-11), which DynamicCache keeps in float32; logits (of magnitude ~0.6 here)
then differ by up to ~2e-4, and these tests allow 1e-3. With a bfloat16 model the window holds
bfloat16 exactly, so under the model's own sdpa attention the logits are bit-identical.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings

import pytest

# Skipped without torch and transformers, unless KVQ_HF=1 says they were installed (CI): then a
# missing one is an error, not a silent skip.
if os.environ.get("KVQ_HF") == "1":
    import torch
    import transformers  # noqa: F401
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

from hf_models import build, prompt  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvq  # noqa: E402
import kvq.hf  # noqa: E402

STEPS = 64
ATOL = 1e-3
FAMILIES = ["llama", "qwen2", "mistral", "gemma3"]


def generate(model, cache, ids, steps=STEPS, **kwargs):
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            cache=cache,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    return out.sequences, torch.stack(out.logits, 1)


@functools.lru_cache(maxsize=None)
def reference(family, dtype=torch.float32):
    """Greedy tokens and logits of the model with transformers' DynamicCache and sdpa."""
    model = build(family, "sdpa", dtype)
    return generate(model, DynamicCache(config=model.config), prompt())


@pytest.mark.parametrize("attn", ["sdpa", "eager", "kvq"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_generate_matches_dynamic_cache(family, attn):
    model = build(family, attn)
    cache = kvq.hf.KvqCache("fp16", model.config)
    tokens, logits = generate(model, cache, prompt())
    ref_tokens, ref_logits = reference(family)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert cache.get_seq_length() == prompt().shape[1] + STEPS - 1
    assert cache.model_cache.offset == cache.get_seq_length()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bf16_model_own_attention_is_bit_identical(family):
    model = build(family, "sdpa", torch.bfloat16)
    cache = kvq.hf.KvqCache("fp16", model.config)
    tokens, logits = generate(model, cache, prompt())
    ref_tokens, ref_logits = reference(family, torch.bfloat16)
    assert cache.model_cache[0].window_dtype == "bf16"
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)


def teacher_forced(model, cache, tokens, n_prompt):
    """A hand-written loop: prefill the prompt, then feed `tokens` one at a time; the logits of
    each step's last position."""
    out = []
    with torch.no_grad():
        logits = model(tokens[:, :n_prompt], cache=cache, use_cache=True).logits
        out.append(logits[:, -1])
        for t in range(n_prompt, tokens.shape[1] - 1):
            out.append(model(tokens[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


def test_bf16_model_kvq_attention_is_close():
    """kvq attends in float32 where sdpa rounds to bfloat16: close, not identical (so greedy
    tokens may part at near ties; the reference's tokens are fed instead)."""
    ref_tokens, ref_logits = reference("llama", torch.bfloat16)
    model = build("llama", "kvq", torch.bfloat16)
    logits = teacher_forced(model, kvq.hf.KvqCache("fp16", model.config), ref_tokens, 10)
    torch.testing.assert_close(logits.float(), ref_logits.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("method", ["kivi", "zipcache", "cachegen", "xquant"])
def test_fused_attention_equals_the_models_own_on_per_query_views(method):
    """Fed token by token, every query is a decode query, for which update() returns exactly
    kvq's per-query view: the model's sdpa over it and kvq's fused attend agree, for compressed
    methods whose blocks seal along the way. (ZipCache ranks by key norms here: only the fused
    path gives it queries, see the next test.)"""
    spec = kvq.find_method(method).test_spec()
    if method == "zipcache":
        spec = spec.apply("saliency=norm")
    spec = str(spec)
    tokens = reference("llama")[0][:, :40]
    caches, logits = [], []
    for attn in ("sdpa", "kvq"):
        model = build("llama", attn)
        caches.append(kvq.hf.KvqCache(spec, model.config))
        logits.append(teacher_forced(model, caches[-1], tokens, 1))
    assert caches[1].model_cache[0].sealed_tokens > 0
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)
    assert caches[0].bytes().as_dict() == caches[1].bytes().as_dict()


def test_models_own_attention_sees_the_first_querys_view():
    """With the model's own attention, update() returns every held token as the chunk's first
    query sees it: blocks sealed before the chunk dequantized, the chunk's tokens exact (fp16)
    even where the chunk sealed their blocks."""
    model = build("llama", "sdpa")
    cache = kvq.hf.KvqCache("kivi:residual=8,group=4", model.config)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(5)
    k1, v1 = torch.randn(1, 2, 20, 64, generator=g), torch.randn(1, 2, 20, 64, generator=g)
    layer.update(k1, v1)
    sealed = layer.cache.sealed_tokens
    k2, v2 = torch.randn(1, 2, 30, 64, generator=g), torch.randn(1, 2, 30, 64, generator=g)
    keys, values = layer.update(k2, v2)
    assert sealed > 0 and layer.cache.sealed_tokens > 20  # the chunk sealed blocks of its own
    stored_k, _ = layer.cache.read(0, sealed)
    torch.testing.assert_close(keys[:, :, :sealed], torch.from_numpy(stored_k), atol=0, rtol=0)
    assert not torch.allclose(keys[:, :, :sealed], k1[:, :, :sealed], atol=1e-2)  # dequantized
    exact = torch.cat([k1[:, :, sealed:], k2], dim=2).half().float()
    torch.testing.assert_close(keys[:, :, sealed:], exact, atol=0, rtol=0)
    torch.testing.assert_close(values[:, :, 20:], v2.half().float(), atol=0, rtol=0)


def test_fused_attention_gives_zipcache_its_queries():
    """With kvq's attention, appends carry the queries, and ZipCache ranks tokens by attention;
    with the model's own attention it falls back to its documented proxy."""
    spec = str(kvq.find_method("zipcache").test_spec().apply("saliency=attn"))
    stats = {}
    for attn in ("kvq", "sdpa"):
        model = build("llama", attn)
        cache = kvq.hf.KvqCache(spec, model.config)
        generate(model, cache, prompt(length=30), 8)
        stats[attn] = dict(line.split("=") for line in cache.model_cache[0].stats().split())
    assert int(stats["kvq"]["blocks_ranked_by_attention"]) > 0
    assert int(stats["sdpa"]["blocks_ranked_by_attention"]) == 0


@pytest.mark.parametrize("method", ["kivi", "zipcache"])
def test_fused_prefill_chunk_equals_per_query_attention(method):
    """A prefill chunk whose queries see different seal boundaries: attend() equals the
    per-query semantics rebuilt from read()/read_exact() (per_query_attention)."""
    model = build("llama", "kvq")
    cache = kvq.hf.KvqCache(str(kvq.find_method(method).test_spec()), model.config)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(3)
    for n in (5, 30):
        k, v = torch.randn(2, 2, n, 64, generator=g), torch.randn(2, 2, n, 64, generator=g)
        q = torch.randn(2, n, 4, 64, generator=g).transpose(1, 2)  # torch's strided layout
        layer.update(k, v)
        layer.flush(q)  # what attention() does first
        offset = layer.cache.offset
        bounds = {layer.cache.sealed_tokens_for_query(p) for p in range(offset - n, offset)}
        fused = layer.attention(q, None, 0.125)
        ref = kvq.hf.per_query_attention(layer.cache, q, None, 0.125).transpose(1, 2)
        torch.testing.assert_close(fused, ref, atol=1e-5, rtol=0)
    assert len(bounds) > 1  # the boundary moved within the last chunk


@pytest.mark.parametrize("attn", ["sdpa", "kvq"])
def test_left_padded_batch(attn):
    """Two prompts of different lengths, left-padded: the padding mask takes kvq's masked
    per-query path (kvq attention) or the model's own; greedy tokens as with DynamicCache."""
    ids = prompt(batch=2, length=12)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ref_model = build("llama", "sdpa")
    ref = generate(ref_model, DynamicCache(config=ref_model.config), ids, 24, attention_mask=mask)
    model = build("llama", attn)
    out = generate(model, kvq.hf.KvqCache("fp16", model.config), ids, 24, attention_mask=mask)
    assert torch.equal(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "mistral_sliding"])
def test_sliding_layers_in_kvq(family):
    """sliding='kvq': sliding layers held by kvq too, attended through the window mask."""
    model = build(family, "kvq")
    cache = kvq.hf.KvqCache("fp16", model.config, sliding="kvq")
    tokens, logits = generate(model, cache, prompt(), 32)
    ref_model = build(family, "sdpa")
    ref = generate(ref_model, DynamicCache(config=ref_model.config), prompt(), 32)
    assert torch.equal(tokens, ref[0])
    torch.testing.assert_close(logits, ref[1], atol=ATOL, rtol=0)
    assert len(cache.kvq_layers) == len(cache.layers)


def test_layer_assignment():
    gemma = build("gemma3")
    cache = kvq.hf.KvqCache("kivi", gemma.config)
    assert cache.kvq_layers == [1] and cache.model_cache.n_layers == 1
    assert [type(layer).__name__ for layer in cache.layers] == [
        "DynamicSlidingWindowLayer",
        "KvqLayer",
        "DynamicSlidingWindowLayer",
    ]
    assert cache.is_sliding == [True, False, True]
    with pytest.raises(ValueError, match="sliding='kvq'"):
        kvq.hf.KvqCache("kivi", build("mistral_sliding").config)
    with pytest.raises(kvq.InvalidArgumentError, match="did you mean"):
        kvq.hf.KvqCache("kivi:k_bit=2", gemma.config)
    with pytest.raises(ValueError, match="sliding"):
        kvq.hf.KvqCache("kivi", gemma.config, sliding="fp16")


def test_generate_with_past_key_values_and_accounting():
    """The documented call (past_key_values=, deprecated alias of cache=) with a compressed
    method: blocks seal, the accounting is measured, and it is below fp16's."""
    model = build("qwen2", "kvq")
    cache = kvq.hf.KvqCache("kivi:k_bits=2,v_bits=2,residual=32", model.config)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(prompt(), max_new_tokens=80, do_sample=False, past_key_values=cache)
    assert out.shape[1] == 90 and cache.get_seq_length() == 89
    b = cache.bytes()
    assert b.total == cache.resident_bytes() and b.key_codes > 0
    assert b.bits_per_element < 16 and b.elements == 2 * 2 * 1 * 89 * 128


def test_attention_without_a_kvq_cache_is_sdpa():
    model = build("mistral", "kvq")
    tokens, logits = generate(model, DynamicCache(config=model.config), prompt(), 16)
    ref_tokens, ref_logits = reference("mistral")
    assert torch.equal(tokens, ref_tokens[:, : tokens.shape[1]])
    torch.testing.assert_close(logits, ref_logits[:, :16], atol=1e-6, rtol=0)


@pytest.mark.parametrize("spec", ["fp16", "kivi"])
def test_crop_rolls_back(spec):
    """crop(-n) (speculative decoding's rollback) removes the newest n tokens: re-feeding then
    gives the logits of a cache that never saw them (bit for bit while no block sealed)."""
    model = build("llama", "kvq")
    tokens = reference("llama")[0]
    cache = kvq.hf.KvqCache(spec, model.config)
    with torch.no_grad():
        model(tokens[:, :20], cache=cache)
        before = model(tokens[:, 20:21], cache=cache).logits
        model(tokens[:, 21:25], cache=cache)
        cache.crop(-5)
        assert cache.get_seq_length() == 20
        after = model(tokens[:, 20:21], cache=cache).logits
    assert torch.equal(before, after)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)
    with pytest.raises(kvq.OutOfRangeError):
        cache.crop(-100)
    assert cache.get_seq_length() == 21


def test_deepcopy_reuses_a_prompt_cache():
    """A prompt's cache deep-copied for two continuations: each gives what a fresh cache gives,
    and the copies are independent."""
    model = build("gemma3", "kvq")
    tokens = reference("gemma3")[0]
    spec = "kivi:residual=8,group=4"
    prompt_cache = kvq.hf.KvqCache(spec, model.config)
    with torch.no_grad():
        model(tokens[:, :20], cache=prompt_cache)
        results = []
        for cont in (tokens[:, 20:26], tokens[:, 30:36]):
            cache = copy.deepcopy(prompt_cache)
            fresh = kvq.hf.KvqCache(spec, model.config)
            model(tokens[:, :20], cache=fresh)
            a, b = model(cont, cache=cache).logits, model(cont, cache=fresh).logits
            assert torch.equal(a, b) and cache.get_seq_length() == 26
            results.append(a)
    assert prompt_cache.get_seq_length() == 20 and not torch.equal(results[0], results[1])


def test_assisted_decoding():
    """Greedy assisted generation (a draft model proposes, the cache is cropped back on
    rejection) gives the tokens of plain greedy decoding."""
    model = build("llama", "kvq")
    assistant = build("llama", "sdpa", seed=7)
    cache = kvq.hf.KvqCache("fp16", model.config)
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))
    tokens, _ = generate(model, cache, prompt(), 24, assistant_model=assistant)
    assert torch.equal(tokens, reference("llama")[0][:, :34])
    assert any(n < 0 for n in crops)  # drafts were rejected and rolled back


def test_beam_search_is_refused():
    model = build("llama", "kvq")
    with pytest.raises(NotImplementedError, match="batch rows"), torch.no_grad():
        model.generate(prompt(), max_new_tokens=4, num_beams=2, do_sample=False,
                       cache=kvq.hf.KvqCache("kivi", model.config))


def test_placeholders_fail_loudly_outside_kvq_attention():
    """In fused mode update() returns NaN placeholders of the right shape, never stale data."""
    model = build("llama", "kvq")
    cache = kvq.hf.KvqCache("fp16", model.config)
    k = torch.randn(1, 2, 3, 64)
    keys, values = cache.update(k, k, 0)
    assert keys.shape == (1, 2, 3, 64) and torch.isnan(keys).all() and torch.isnan(values).all()
    assert keys.untyped_storage().nbytes() == keys.element_size()  # one element, expanded


def test_rope_shape_follows_the_config():
    """Half-pair RoPE with the config's theta for standard rotary configs; mode none (pre-RoPE
    methods then refuse) for scalings kvq cannot redo exactly."""
    model = build("llama", "sdpa")
    rope = kvq.hf._rope_shape(model.config)
    assert rope.mode == kvq.RopeMode.half
    assert rope.theta == model.config.rope_parameters["rope_theta"]
    yarn = copy.deepcopy(model.config)
    yarn.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    assert kvq.hf._rope_shape(yarn).mode == kvq.RopeMode.none
    with pytest.raises(ValueError):
        kvq.hf.KvqCache("kvq", yarn)
    kvq.hf.KvqCache("kivi", yarn)  # post-RoPE methods do not need it


def test_pre_rope_keys_are_unrotated_with_the_models_rope():
    """One token repeated: layer 0's pre-RoPE keys are the same at every position, so kvq's
    rope=pre codec (which quantizes keys per channel over a group of tokens, after undoing RoPE)
    finds each channel constant and stores it exactly. Its keys then match the model's post-RoPE
    keys to fp16 precision; undoing RoPE with the wrong pairing or theta would leave the channels
    varying and 2-bit codes far off."""
    model = build("llama", "sdpa")
    n = 64
    ids = torch.full((1, n), 7)
    spec = "kvq:k_bits=2,v_bits=2,group=32,residual=0,sinks=0"
    cache = kvq.hf.KvqCache(spec, model.config)
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        model(ids, cache=ref, use_cache=True)
    layer = cache.model_cache[0]
    assert layer.sealed_tokens == n
    keys, _ = layer.read(0, n)
    want = ref.layers[0].keys.float().numpy()
    err = abs(keys - want).max()
    assert err < 2e-2 * abs(want).max(), err
