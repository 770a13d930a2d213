#!/usr/bin/env python3
"""Cross-validation of kvq's quality figures through a second engine.

kvq's own engine (`kvq ppl`) and Hugging Face transformers (SmolLM2 loaded from the same GGUF file,
attention through kvq.hf's "kvq" attention function) run kvq's evaluation protocol on the same
tokens: windows of --ctx tokens, the first ctx - decode in prefill chunks of --chunk, the rest one
at a time, every position scored against the fp16 cache of the same engine. Two independent
engines agreeing on every method's KL divergence and top-1 agreement is the evidence that the
quality figures measure the caches, not an engine's quirks.

    .venv/bin/python scripts/hf_crossval.py [--ctx 2048] [--windows 2] [--method SPEC ...]
        [--out results/raw/crossval.json]

Needs the Python package with torch, transformers and gguf (KVQ_HF=1 scripts/python_env.sh
install; pip install gguf) and a built kvq (build/kvq).
"""
import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import torch

repo = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_METHODS = [
    "kivi:k_bits=2,v_bits=2", "kivi:k_bits=4,v_bits=4", "zipcache", "cachegen:bits=3", "xquant",
    "q4_0", "q8_0", "turboquant:bits=3", "kvq", "kvq:k_bits=3,v_bits=3",
]


def kvq_json(kvq, args):
    out = subprocess.run([kvq] + args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


class Stats:
    """kvq's definitions (src/model/eval.h): nll, KL(p_ref || p), argmax agreement; all
    positions and the decode phase (positions fed one at a time)."""

    def __init__(self):
        self.nll = self.nll_d = 0.0
        self.kld, self.kld_d = [], []
        self.agree = self.agree_d = 0
        self.n = self.n_d = 0

    def add(self, ref_logits, logits, targets, decode_mask):
        lp_ref = torch.log_softmax(ref_logits.double(), -1)
        lp = torch.log_softmax(logits.double(), -1)
        kld = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0)
        nll = -lp.gather(1, targets[:, None])[:, 0]
        agree = ref_logits.argmax(-1) == logits.argmax(-1)
        self.nll += nll.sum().item()
        self.kld += kld.tolist()
        self.agree += int(agree.sum())
        self.n += len(targets)
        if decode_mask.any():
            self.nll_d += nll[decode_mask].sum().item()
            self.kld_d += kld[decode_mask].tolist()
            self.agree_d += int(agree[decode_mask].sum())
            self.n_d += int(decode_mask.sum())

    def row(self):
        mean = lambda v: sum(v) / len(v) if v else 0.0
        return {"ppl": math.exp(self.nll / self.n), "kld_mean": mean(self.kld),
                "top1_agree": self.agree / self.n,
                "ppl_decode": math.exp(self.nll_d / self.n_d) if self.n_d else 0.0,
                "kld_mean_decode": mean(self.kld_d),
                "top1_agree_decode": self.agree_d / self.n_d if self.n_d else 0.0}


def feed_window(model, cache, window, chunk, decode):
    """Logits [ctx - 1, V] of positions 0..ctx-2 of a window fed to `model` over `cache`: the
    first ctx - decode tokens in prefill chunks of `chunk`, the rest one at a time."""
    ctx = len(window)
    prefill = ctx - decode
    out, pos = [], 0
    with torch.no_grad():
        while pos < ctx:
            n = min(chunk, prefill - pos) if pos < prefill else 1
            ids = torch.tensor([window[pos:pos + n]])
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0]
            out.append(logits[: min(n, ctx - 1 - pos)].float())
            pos += n
    return torch.cat(out)


def run_window(model, spec, window, chunk, decode):
    """feed_window through a kvq cache of `spec`, and the cache's bits per element once it holds
    the whole window (where `kvq ppl` measures it: the last token is fed too, though its logits
    predict nothing)."""
    import kvq.hf
    cache = kvq.hf.KvqCache(spec, model.config)
    logits = feed_window(model, cache, window, chunk, decode)
    return logits, cache.bytes().bits_per_element


def add_protocol_args(ap, ctx):
    """The model, text and kvq protocol options every script on this protocol takes."""
    ap.add_argument("--model", default=str(repo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--text", default=str(repo.parent / "shared" / "data" / "wikitext-2" / "test.txt"))
    ap.add_argument("--ctx", type=int, default=ctx)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--kvq", default=str(repo / "build" / "kvq"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_protocol_args(ap, ctx=2048)
    ap.add_argument("--method", action="append")
    ap.add_argument("--out", default=str(repo / "results" / "raw" / "crossval.json"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    methods = a.method or DEFAULT_METHODS
    torch.set_num_threads(a.threads)

    model_path = pathlib.Path(a.model).resolve()
    ids = kvq_json(a.kvq, ["tokenize", "--model", str(model_path), "--text", a.text, "--json"])
    print(f"crossval: {len(ids)} tokens; {a.windows} window(s) of {a.ctx}", file=sys.stderr)

    # Engine 1: kvq's own.
    t0 = time.time()
    args = ["ppl", "--model", str(model_path), "--text", a.text, "--ctx", str(a.ctx), "--windows",
            str(a.windows), "--chunk", str(a.chunk), "--decode", str(a.decode), "--json", "--quiet"]
    for m in methods:
        args += ["--method", m]
    kvq_rows = {r["method"]: r for r in kvq_json(a.kvq, args)}
    kvq_s = time.time() - t0
    print(f"crossval: kvq ppl in {kvq_s:.0f} s", file=sys.stderr)

    # Engine 2: transformers, from the same GGUF, kvq's caches under its attention.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import kvq.hf  # registers attn_implementation="kvq"
    tok = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                 torch_dtype=torch.float32,
                                                 attn_implementation="kvq")
    model.eval()
    hf_ids = tok(open(a.text).read(), add_special_tokens=False)["input_ids"]
    same_tokens = hf_ids[: a.ctx * a.windows] == ids[: a.ctx * a.windows]
    print(f"crossval: transformers' tokenizer {'agrees' if same_tokens else 'DIFFERS'} on the "
          f"scored tokens (both engines are fed kvq's ids)", file=sys.stderr)

    canon = {m: kvq.parse_model_spec(m)[0].to_string() for m in methods}
    stats = {m: Stats() for m in ["fp16"] + methods}
    bits = {m: 0.0 for m in methods}
    t0 = time.time()
    for w in range(a.windows):
        window = ids[w * a.ctx:(w + 1) * a.ctx]
        targets = torch.tensor(window[1:])
        decode_mask = torch.arange(a.ctx - 1) >= a.ctx - a.decode
        ref, _ = run_window(model, "fp16", window, a.chunk, a.decode)
        stats["fp16"].add(ref, ref, targets, decode_mask)
        for m in methods:
            logits, b = run_window(model, m, window, a.chunk, a.decode)
            stats[m].add(ref, logits, targets, decode_mask)
            bits[m] += b / a.windows
        print(f"crossval: window {w + 1}/{a.windows} in {time.time() - t0:.0f} s", file=sys.stderr)
    hf_s = time.time() - t0

    rows = []
    for m in ["fp16"] + methods:
        k = kvq_rows["fp16" if m == "fp16" else canon[m]]
        h = stats[m].row()
        rows.append({"method": "fp16" if m == "fp16" else canon[m], "kvq": k, "hf": h,
                     "hf_bits_per_element": 16.0 if m == "fp16" else bits[m]})
    result = {"ctx": a.ctx, "windows": a.windows, "chunk": a.chunk, "decode": a.decode,
              "text": os.path.basename(a.text), "same_tokenizer": same_tokens,
              "kvq_seconds": kvq_s, "hf_seconds": hf_s, "rows": rows}
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump(result, open(a.out, "w"), indent=1)

    def rel(x, y):
        return abs(x - y) / max(abs(y), 1e-12)
    print(f"{'method':48s} {'bits kvq/hf':>12} {'kld kvq':>9} {'kld hf':>9} {'rel':>6} "
          f"{'top1 kvq':>8} {'top1 hf':>8} {'ppl kvq':>8} {'ppl hf':>8}")
    for r in rows:
        k, h = r["kvq"], r["hf"]
        print(f"{r['method'][:48]:48s} {k['bits_per_element']:5.2f}/{r['hf_bits_per_element']:5.2f} "
              f"{k['kld_mean']:9.4f} {h['kld_mean']:9.4f} {rel(h['kld_mean'], k['kld_mean']) if k['kld_mean'] else 0:6.1%} "
              f"{k['top1_agree']:8.4f} {h['top1_agree']:8.4f} {k['ppl']:8.3f} {h['ppl']:8.3f}")


if __name__ == "__main__":
    main()
