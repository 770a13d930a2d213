#!/usr/bin/env python3
"""Would re-ranking sealed blocks later change ZipCache's choice of salient tokens?

zipcache ranks a block once, when it seals (once `residual` newer tokens exist), with the probe
queries seen so far. The paper re-ranks every 100 generated tokens. This study measures, on real
queries and keys from `kvq dump-kv` (post-RoPE, with queries), how much the salient set of each
block would change if it were ranked again at the end of the context with every later probe:
the overlap of the two top-k sets. A small change means re-quantizing sealed blocks would buy
little; a large one means the seal-time ranking is a poor guess.

The scores follow src/methods/zipcache.cc: probes are the positions whose splitmix64 hash falls
below `probe`; token j's score is the mean over probes i >= j (that exist at ranking time) of
the attention q_i gives j, summed over the query heads sharing j's KV head. Differences from the
cache: keys here are the dump's fp16 keys (the cache scores dequantized keys), and the softmax
normalizer is computed over fp16 keys too.

    scripts/zipcache_rerank_study.py kv.safetensors [--frac 0.4] [--group 64] [--residual 128]
"""
import argparse
import json
import struct

import numpy as np

M64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def is_probe(pos, probe):
    return (splitmix64(pos) >> 11) * 2.0 ** -53 < probe


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = {"F16": np.float16, "F32": np.float32}[info["dtype"]]
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=dt).reshape(info["shape"]).astype(np.float32)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump")
    ap.add_argument("--frac", type=float, default=0.4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--probe", type=float, default=0.1)
    args = ap.parse_args()
    t = read_safetensors(args.dump)
    layers = sorted({int(k.split(".")[1]) for k in t if k.endswith(".q")})
    T, R = args.group, args.residual
    k_sal = int(round(args.frac * T))
    print(f"{args.dump}: layers {layers}; group {T}, residual {R}, frac {args.frac} ({k_sal} salient "
          f"per block), probe {args.probe}")
    print("| layer | blocks | overlap of salient sets (mean) | min | tokens that would gain hi bits |")
    print("|---|---:|---:|---:|---:|")
    total = []
    for L in layers:
        q = t[f"layers.{L}.q"][0]  # [Hq, N, D]
        k = t[f"layers.{L}.k"][0]  # [H, N, D]
        Hq, N, D = q.shape
        H = k.shape[0]
        g = Hq // H
        probes = np.array([p for p in range(N) if is_probe(p, args.probe)])
        # attention of every probe over every key: [Hq, P, N], causal
        s = np.einsum("hpd,hnd->hpn", q[:, probes, :], np.repeat(k, g, axis=0)) / np.sqrt(D)
        mask = np.arange(N)[None, :] > probes[:, None]
        s = np.where(mask[None], -np.inf, s)
        s -= s.max(axis=2, keepdims=True)
        a = np.exp(s)
        a /= a.sum(axis=2, keepdims=True)
        a = a.reshape(H, g, len(probes), N).sum(axis=1)  # [H, P, N], summed over the shared heads
        overlaps = []
        for b in range(N // T):
            t0, seal = b * T, b * T + T + R  # the block seals once R newer tokens exist
            if seal >= N:
                break
            for h in range(H):
                def salient(limit):
                    sel = (probes >= t0) & (probes < limit)
                    blk = a[h][sel][:, t0:t0 + T]  # [P', T]
                    seen = (probes[sel][:, None] >= np.arange(t0, t0 + T)[None, :]).sum(axis=0)
                    score = np.where(seen > 0, blk.sum(axis=0) / np.maximum(seen, 1), -np.inf)
                    return set(np.argsort(-score, kind="stable")[:k_sal].tolist())
                early, late = salient(seal), salient(N)
                overlaps.append(len(early & late) / k_sal)
        overlaps = np.array(overlaps)
        total.extend(overlaps.tolist())
        print(f"| {L} | {len(overlaps)} | {overlaps.mean():.3f} | {overlaps.min():.3f} | "
              f"{100 * (1 - overlaps.mean()):.1f} % of the salient set |")
    total = np.array(total)
    print(f"| all | {len(total)} | {total.mean():.3f} | {total.min():.3f} | {100 * (1 - total.mean()):.1f} % |")


if __name__ == "__main__":
    main()
