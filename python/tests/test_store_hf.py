"""Prefix reuse through kvq.hf: a transformers generation whose long prompt starts with a
stored prefix imports it and computes only the rest, with logits bit-identical to a run that
computed it, for every kind of method, through a directory and a real redis-server; a server
killed in the middle of a fetch (at an exact byte of a reply) or before a request gives a
recompute, never a wrong cache. Tiny random-initialised Llama models (hf_models.py), CPU."""

from __future__ import annotations

import os

import pytest

# Skipped without torch and transformers, unless KVQ_HF=1 says they were installed (CI).
if os.environ.get("KVQ_HF") == "1":
    import torch
    import transformers  # noqa: F401
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

from hf_models import VOCAB, build  # noqa: E402
from redis_util import CuttingProxy  # noqa: E402

import kvq  # noqa: E402
import kvq.hf  # noqa: E402

HF_CHUNK = 32
HF_PROMPT = 3 * HF_CHUNK + 9  # three whole chunks to reuse, and a rest
STEPS = 6


def hf_prompt(seed=3, length=HF_PROMPT):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, length), generator=g)


def hf_spec(method):
    spec = kvq.find_method(method).test_spec()
    return str(spec)


def run(model, store, method, ids, **cache_kwargs):
    """prefill() then greedy generate: (reused tokens, sequences, logits, report)."""
    cache = kvq.hf.KvqCache(hf_spec(method), model.config, store=store, **cache_kwargs)
    reused = cache.prefill(model, ids)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=STEPS,
                             min_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    report = cache.store_report() if store is not None else None
    return reused, out.sequences, torch.stack(out.logits, 1), report


@pytest.mark.parametrize("method", ["fp16", "kivi", "zipcache", "cachegen", "xquant", "kvq"])
def test_hf_reuse_is_bit_identical(method, tmp_path):
    model = build("llama", "kvq")
    store = kvq.hf.ModelStore(f"dir:{tmp_path}", model, chunk_tokens=HF_CHUNK)
    ids = hf_prompt()
    r1, tokens1, logits1, rep1 = run(model, store, method, ids)
    assert r1 == 0 and rep1["exported_chunks"] == 3 and rep1["writer"]["failed"] == 0
    fed = []  # tokens the model embeds: only the rest after the fetched prefix
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: fed.append(args[0].numel())
    )
    try:
        r2, tokens2, logits2, rep2 = run(model, store, method, ids)
    finally:
        hook.remove()
    assert r2 == 3 * HF_CHUNK and rep2["fetched_bytes"] > 0 and rep2["notes"] == []
    assert sum(fed) == HF_PROMPT - 3 * HF_CHUNK + STEPS - 1
    assert torch.equal(tokens1, tokens2) and torch.equal(logits1, logits2)
    # The same pieces without a store give the same logits: storing changes nothing.
    cache = kvq.hf.KvqCache(hf_spec(method), model.config)
    assert cache.prefill(model, ids, max_piece=HF_CHUNK) == 0
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=STEPS,
                             min_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(torch.stack(out.logits, 1), logits1)


@pytest.mark.parametrize("method,attn", [("kivi", "sdpa"), ("kvq", "kvq")])
def test_hf_reuse_through_redis_shares_a_prefix(method, attn, redis_server):
    model = build("llama", attn)
    store = kvq.hf.ModelStore(redis_server.url, model, chunk_tokens=HF_CHUNK)
    ids = hf_prompt()
    _, tokens1, logits1, _ = run(model, store, method, ids)
    # Another prompt with the same first two chunks reuses them; its logits are those of a
    # run that computed it.
    other = torch.cat([ids[:, : 2 * HF_CHUNK], hf_prompt(seed=9, length=40)], 1)
    fresh = kvq.hf.ModelStore(f"dir:{redis_server.dir}/empty", model, chunk_tokens=HF_CHUNK)
    r0, t0, l0, _ = run(model, fresh, method, other)
    r1, t1, l1, rep = run(model, store, method, other)
    assert (r0, r1) == (0, 2 * HF_CHUNK)
    assert torch.equal(t0, t1) and torch.equal(l0, l1)
    # A cache given the URL and the model makes its own ModelStore (at the default chunk size:
    # another namespace, so nothing to reuse for this short prompt).
    cache = kvq.hf.KvqCache(hf_spec(method), model.config, store=redis_server.url, model=model)
    assert cache.store.fingerprint == store.fingerprint
    assert cache.store.chunk_tokens == kvq.DEFAULT_STORE_CHUNK_TOKENS
    assert cache.prefill(model, ids) == 0


def test_hf_server_killed_gives_a_recompute(redis_server):
    model = build("llama", "kvq")
    store = kvq.hf.ModelStore(redis_server.url, model, chunk_tokens=HF_CHUNK)
    ids = hf_prompt()
    _, tokens1, logits1, _ = run(model, store, "kivi", ids)
    fetched = run(model, store, "kivi", ids)[3]["fetched_bytes"]
    # Killed in the middle of the fetch (at an exact byte of a reply) ...
    proxy = CuttingProxy(redis_server.port, fetched // 2, redis_server.kill)
    via = kvq.hf.ModelStore(proxy.url + "?timeout_ms=2000", model, chunk_tokens=HF_CHUNK)
    reused, tokens2, logits2, rep = run(model, via, "kivi", ids)
    assert proxy.cut.is_set() and reused < 3 * HF_CHUNK and rep["notes"]
    assert torch.equal(tokens1, tokens2) and torch.equal(logits1, logits2)
    # ... and gone before the next request: a recompute, the writes counted as failed.
    reused, tokens3, logits3, rep = run(model, store, "kivi", ids)
    assert reused == 0 and rep["writer"]["failed"] > 0
    assert torch.equal(tokens1, tokens3) and torch.equal(logits1, logits3)


def test_hf_fingerprint_names_weights_config_and_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    a, b = build("llama", seed=0), build("llama", seed=1)
    fa = kvq.hf.model_fingerprint(a)
    assert len(fa) == 32 and fa == kvq.hf.model_fingerprint(build("llama", seed=0))
    assert fa != kvq.hf.model_fingerprint(b)
    with torch.no_grad():
        a.model.norm.weight[0] += 2**-20  # one weight, one ulp-ish
    assert kvq.hf.model_fingerprint(a) != fa
    c = build("llama", seed=0)
    c.config.rope_parameters = {**c.config.rope_parameters, "rope_theta": 500000.0}
    assert kvq.hf.model_fingerprint(c) != fa
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "[UNK]")))
    swapped = vocab | {"t0": 1, "t1": 0}
    tok2 = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(swapped, "[UNK]")))
    d = build("llama", seed=0)
    fd = kvq.hf.model_fingerprint(d, tok)
    assert fd not in (fa, kvq.hf.model_fingerprint(d, tok2))
    # The producer names what rounds the keys and values.
    assert "attn=sdpa" in kvq.hf.producer(d) and "float32" in kvq.hf.producer(d)
    assert kvq.hf.producer(build("llama", "kvq")) != kvq.hf.producer(d)


def test_hf_store_errors(tmp_path):
    model = build("llama", "kvq")
    url = f"dir:{tmp_path}"
    with pytest.raises(TypeError, match="model="):
        kvq.hf.KvqCache("kivi", model.config, store=url)
    with pytest.raises(TypeError, match="ModelStore"):
        kvq.hf.KvqCache("kivi", model.config, store=42)
    with pytest.raises(TypeError):
        kvq.hf.ModelStore(url, "not a model")
    with pytest.raises(ValueError, match="dir:PATH"):
        kvq.hf.ModelStore("nope:x", model)
    store = kvq.hf.ModelStore(url, model, chunk_tokens=HF_CHUNK)
    sliding = build("gemma3", "kvq")
    with pytest.raises(ValueError, match="every layer held by kvq"):
        kvq.hf.KvqCache("kivi", sliding.config, store=kvq.hf.ModelStore(url, sliding))
    kvq.hf.KvqCache("kivi", sliding.config, sliding="kvq", store=kvq.hf.ModelStore(url, sliding))
    cache = kvq.hf.KvqCache(hf_spec("kivi"), model.config, store=store)
    with pytest.raises(ValueError, match="another model"):
        cache.prefill(build("llama", "kvq"), hf_prompt())
    with pytest.raises(TypeError):
        cache.prefill(model, hf_prompt()[0])
    with pytest.raises(TypeError):
        cache.prefill(model, hf_prompt().float())
    with pytest.raises(ValueError, match="no token"):
        cache.prefill(model, hf_prompt()[:, :0])
    with pytest.raises(ValueError, match="store_report|prefill"):
        cache.store_report()
    odd = kvq.hf.ModelStore(url, model, chunk_tokens=HF_CHUNK + 1)
    with pytest.raises(ValueError, match="multiple"):
        kvq.hf.KvqCache(hf_spec("kivi"), model.config, store=odd).prefill(model, hf_prompt())
    cache.prefill(model, hf_prompt())
    with pytest.raises(ValueError, match="empty"):
        cache.prefill(model, hf_prompt())
    model.set_attn_implementation("sdpa")
    cache.reset()
    with pytest.raises(ValueError, match="new ModelStore"):
        cache.prefill(model, hf_prompt())
