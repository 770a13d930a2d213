#!/usr/bin/env python3
"""kvq's caches against Hugging Face's own, in one run, on the same model and tokens.

SmolLM2-135M-Instruct in transformers (loaded from the GGUF kvq's engine reads), wikitext-2 test,
kvq's protocol (windows of --ctx tokens, the first ctx - decode in prefill chunks of --chunk, the
rest one token at a time). The reference is transformers' DynamicCache under sdpa attention. The
peers: QuantizedCache with its quanto and HQQ backends at 2 and 4 bits (their defaults: group 64,
residual 128, keys and values grouped along axis 0 as transformers sets them), each under sdpa;
kvq's methods through kvq.hf (attention through kvq, per-query semantics).

Bits are all-in for every cache, from what it holds at the end of each window: a QuantizedCache
holds nbits per quantized element plus a scale and a zero point per group of 64 (billed at 16 bits
each: their dtype in an fp16 model; on this CPU run they are fp32) and its fp16 residual tokens;
kvq's figures are its own accounting (every byte).

Speed: ms per decode step (one token, the whole model) at --speed-ctx contexts, each cache filled
directly with the same real K/V (one DynamicCache prefill per context), median of --steps steps
(after one untimed step), fed in order on the same cache.

    .venv/bin/python scripts/hf_peers.py [--ctx 1024] [--windows 2] [--speed-ctx 2048 8192]
        [--out results/raw/hf_peers.json]

Needs KVQ_HF=1 scripts/python_env.sh install, then .venv/bin/pip install optimum-quanto hqq
gguf.
"""
import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import hf_crossval as cv  # noqa: E402  (Stats, kvq_json: one definition of the figures)

repo = pathlib.Path(__file__).resolve().parent.parent
PEERS = [("quanto", 2), ("quanto", 4), ("hqq", 2), ("hqq", 4)]
KVQ_METHODS = ["kivi:k_bits=2,v_bits=2", "kivi:k_bits=4,v_bits=4", "kvq:k_bits=2,v_bits=2", "kvq",
               "kvq:k_bits=4,v_bits=4", "q4_0"]


def quantized_cache(model, backend, nbits):
    from transformers import QuantizedCache
    return QuantizedCache(backend=backend, config=model.config, nbits=nbits)


def quantized_bits(cache, group=64, residual_bits=16):
    """All-in bits per K/V element of a QuantizedCache: codes, fp16 scale + zero per group, the
    fp16 residual tokens. Token counts are read off the cache's layers."""
    held = quant = 0
    for layer in cache.layers:
        total = layer.cumulative_length
        res = layer.keys.shape[-2] if layer.keys is not None and layer.keys.dim() == 4 else 0
        held += total
        quant += total - res
    nbits = cache.layers[0].nbits
    bits = quant * (nbits + 2 * 16 / group) + (held - quant) * residual_bits
    return bits / held


def decode_ms(model, cache, next_ids):
    """Median wall ms of single-token forward passes over `cache`, one per id of `next_ids`, fed
    in order as generation would (each appends its token: the context grows by one per step).
    No copy of the cache per step: quanto's tensors cannot be deep-copied. The first step warms
    up (allocations, first-call paths) and is not timed."""
    times = []
    with torch.no_grad():
        cv.forward(model, torch.tensor([[next_ids[0]]]), cache)
        for t in next_ids[1:]:
            t0 = time.perf_counter()
            cv.forward(model, torch.tensor([[t]]), cache)
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    cv.add_protocol_args(ap, ctx=1024)
    ap.add_argument("--speed-ctx", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(repo / "results" / "raw" / "hf_peers.json"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ids", help="token ids (JSON list, or hf_crossval's kvq half); default: kvq tokenize")
    ap.add_argument("--only", action="append",
                    help="run DynamicCache (the reference) and the caches whose name contains this")
    ap.add_argument("--what", choices=["both", "quality", "speed"], default="both")
    ap.add_argument("--combine", nargs="+", metavar="JSON",
                    help="merge parts (quality rows, then speed figures) into --out")
    a = ap.parse_args()
    if a.combine:
        return combine(a)
    torch.set_num_threads(a.threads)

    from transformers import AutoModelForCausalLM, DynamicCache
    import kvq
    import kvq.hf  # registers attn_implementation="kvq"

    path = pathlib.Path(a.model).resolve()
    if a.ids:
        ids = json.load(open(a.ids))
        ids = ids["ids"] if isinstance(ids, dict) else ids
    else:
        ids = cv.kvq_json(a.kvq, ["tokenize", "--model", str(path), "--text", a.text, "--json"])
    load = lambda attn: AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation=attn).eval()
    sdpa, fused = load("sdpa"), load("kvq")

    caches = {"DynamicCache": (sdpa, lambda: DynamicCache(config=sdpa.config))}
    for backend, nbits in PEERS:
        caches[f"QuantizedCache {backend} {nbits}-bit"] = (
            sdpa, lambda b=backend, n=nbits: quantized_cache(sdpa, b, n))
    for m in KVQ_METHODS:
        caches[f"kvq.hf {kvq.parse_model_spec(m)[0].to_string()}"] = (
            fused, lambda m=m: kvq.hf.KvqCache(m, fused.config))

    if a.only:
        caches = {n: c for n, c in caches.items()
                  if n == "DynamicCache" or any(o in n for o in a.only)}
    stats = {name: cv.Stats() for name in caches}
    bits = {name: 0.0 for name in caches}
    t0 = time.time()
    for w in range(a.windows if a.what != "speed" else 0):
        window = ids[w * a.ctx:(w + 1) * a.ctx]
        targets = torch.tensor(window[1:])
        decode_mask = torch.arange(a.ctx - 1) >= a.ctx - a.decode
        ref = None
        for name, (model, make) in caches.items():
            cache = make()
            logits = cv.feed_window(model, cache, window, a.chunk, a.decode)
            if ref is None:
                ref = logits
            stats[name].add(ref, logits, targets, decode_mask)
            if isinstance(cache, kvq.hf.KvqCache):
                b = cache.bytes().bits_per_element
            elif name.startswith("QuantizedCache"):
                b = quantized_bits(cache)
            else:
                b = 16.0
            bits[name] += b / a.windows
            print(f"hf_peers: window {w + 1}/{a.windows} {name}: {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)

    # Decode-step speed: one DynamicCache prefill per context gives the real K/V every cache is
    # filled with (quantized caches through their own update(), kvq's through append()).
    speed = {name: {} for name in caches}
    for sctx in a.speed_ctx if a.what != "quality" else []:
        prompt = torch.tensor([ids[:sctx]])
        with torch.no_grad():
            dyn = DynamicCache(config=sdpa.config)
            for p in range(0, sctx, 512):
                cv.forward(sdpa, prompt[:, p:p + 512], dyn)
        kv = [(layer.keys, layer.values) for layer in dyn.layers]
        for name, (model, make) in caches.items():
            cache = make()
            if isinstance(cache, kvq.hf.KvqCache):
                for i, (k, v) in enumerate(kv):
                    cache.model_cache.layer(i).append(k.contiguous(), v.contiguous())
                    cache.layers[i].lazy_initialization(k, v)
            else:
                for i, (k, v) in enumerate(kv):
                    cache.update(k.contiguous(), v.contiguous(), i)
            speed[name][str(sctx)] = decode_ms(model, cache, ids[sctx:sctx + 1 + a.steps])
            print(f"hf_peers: ctx {sctx} {name}: {speed[name][str(sctx)]:.1f} ms/step",
                  file=sys.stderr, flush=True)

    rows = []
    for name in caches:
        r = stats[name].row() if a.what != "speed" else {}
        r.update({"cache": name, "bits_per_element": bits[name], "ms_per_step": speed[name]})
        rows.append(r)
    ref = rows[0]
    result = {"ctx": a.ctx, "windows": a.windows, "chunk": a.chunk, "decode": a.decode,
              "threads": a.threads, "what": a.what, "speed_ctx": a.speed_ctx, "text": os.path.basename(a.text), "seconds": round(time.time() - t0),
              "command": "scripts/hf_peers.py " + " ".join(sys.argv[1:]), "rows": rows}
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump(result, open(a.out, "w"), indent=1)
    if a.what == "both":
        print_table(result)


def combine(a):
    """One result from parts run apart (quality parts in any split of caches, a speed part)."""
    parts = [json.load(open(f)) for f in a.combine]
    quality = [p for p in parts if p["what"] != "speed"]
    rows = {}
    for p in quality:
        for r in p["rows"]:
            rows.setdefault(r["cache"], r)  # DynamicCache is in every part: the same figures
    for p in parts:
        if p["what"] != "quality":
            for r in p["rows"]:
                rows[r["cache"]]["ms_per_step"] = r["ms_per_step"]
    order = lambda name: (name != "DynamicCache", name.startswith("kvq.hf"), name)
    rows = {n: rows[n] for n in sorted(rows, key=order)}
    q = quality[0]
    result = {k: q[k] for k in ("ctx", "windows", "chunk", "decode", "text")}
    result.update({"threads": {p["what"]: p["threads"] for p in parts},
                   "speed_ctx": next(p["speed_ctx"] for p in parts if p["what"] != "quality"),
                   "seconds": max(p["seconds"] for p in parts),
                   "command": " ; ".join(p["command"] for p in parts), "rows": list(rows.values())})
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump(result, open(a.out, "w"), indent=1)
    print_table(result)


def print_table(result):
    rows, speed_ctx = result["rows"], result["speed_ctx"]
    ref = rows[0]
    print(f"{'cache':64s} {'bits':>6} {'kld_dec':>8} {'top1_dec':>8} {'dppl_dec':>8} "
          + " ".join(f"{'ms@' + str(c):>8}" for c in speed_ctx))
    for r in rows:
        print(f"{r['cache'][:64]:64s} {r['bits_per_element']:6.2f} {r['kld_mean_decode']:8.4f} "
              f"{r['top1_agree_decode']:8.3f} {r['ppl_decode'] - ref['ppl_decode']:+8.3f} "
              + " ".join(f"{r['ms_per_step'].get(str(c), float('nan')):8.1f}" for c in speed_ctx))


if __name__ == "__main__":
    main()
