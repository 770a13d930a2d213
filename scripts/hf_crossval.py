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

The halves can run apart (the transformers half is the slow one: run it where there are cores):
    scripts/hf_crossval.py --part kvq --out kvq.json        # kvq ppl, and the token ids
    scripts/hf_crossval.py --part hf --ids kvq.json --method M --out hf_M.json   # any split of methods
    scripts/hf_crossval.py --part combine --parts kvq.json hf_*.json

Needs the Python package with torch, transformers and gguf (KVQ_HF=1 scripts/python_env.sh
install; pip install gguf) and a built kvq (build/kvq).
"""
import argparse
import inspect
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
    "q8_0", "q4_0", "q4_1", "q5_0", "iq4_nl", "turboquant:bits=3", "turboquant:bits=4", "kvq",
    "kvq:k_bits=2,v_bits=2",
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


def forward(model, ids, cache):
    """model(ids) over `cache`. transformers renamed forward's `past_key_values` to `cache` during
    5.x, and an unknown keyword is swallowed by **kwargs (the model then runs without the cache),
    so the name is taken from the model's signature."""
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    return model(input_ids=ids, use_cache=True, **{name: cache})


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
            logits = forward(model, ids, cache).logits[0]
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
    if cache.get_seq_length() != len(window):
        raise RuntimeError(f"the model did not feed the cache ({cache.get_seq_length()} of "
                           f"{len(window)} tokens held)")
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


def engine_half(a, methods, model_path):
    """kvq's own engine: `kvq ppl` over the protocol; rows by canonical method name."""
    args = ["ppl", "--model", str(model_path), "--text", a.text, "--ctx", str(a.ctx), "--windows",
            str(a.windows), "--chunk", str(a.chunk), "--decode", str(a.decode), "--json", "--quiet"]
    for m in methods:
        args += ["--method", m]
    t0 = time.time()
    rows = {r["method"]: r for r in kvq_json(a.kvq, args)}
    print(f"crossval: kvq ppl in {time.time() - t0:.0f} s", file=sys.stderr)
    return {"rows": rows, "seconds": time.time() - t0}


def hf_half(a, methods, model_path, ids):
    """transformers from the same GGUF, kvq's caches under its attention; fed kvq's token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import kvq.hf  # registers attn_implementation="kvq"
    tok = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                 dtype=torch.float32, attn_implementation="kvq")
    model.eval()
    n = a.ctx * a.windows
    hf_ids = tok(open(a.text).read()[: 40 * n], add_special_tokens=False)["input_ids"]
    same_tokens = hf_ids[:n] == ids[:n]
    print(f"crossval: transformers' tokenizer {'agrees' if same_tokens else 'DIFFERS'} on the "
          f"scored tokens (both engines are fed kvq's ids)", file=sys.stderr)
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
    canon = {m: kvq.parse_model_spec(m)[0].to_string() for m in methods}
    rows = {"fp16": dict(stats["fp16"].row(), bits_per_element=16.0)}
    for m in methods:
        rows[canon[m]] = dict(stats[m].row(), bits_per_element=bits[m])
    return {"rows": rows, "seconds": time.time() - t0, "same_tokenizer": same_tokens}


def combine(a, engine, hfs):
    """One table from the engine's rows and any number of transformers parts."""
    hf_rows, hf_s, same = {}, 0.0, True
    for h in hfs:
        hf_rows.update(h["rows"])
        hf_s = max(hf_s, h["seconds"])
        same = same and h["same_tokenizer"]
    rows = []
    for name, h in hf_rows.items():
        k = engine["rows"][name]
        rows.append({"method": name, "kvq": k, "hf": h,
                     "hf_bits_per_element": h["bits_per_element"]})
    rows.sort(key=lambda r: (r["method"] != "fp16", r["method"]))
    return {"ctx": a.ctx, "windows": a.windows, "chunk": a.chunk, "decode": a.decode,
            "text": os.path.basename(a.text), "same_tokenizer": same,
            "kvq_seconds": engine["seconds"], "hf_seconds": hf_s, "rows": rows}


def print_table(result):
    def rel(x, y):
        return abs(x - y) / max(abs(y), 1e-12)
    print(f"{'method':48s} {'bits kvq/hf':>12} {'kld kvq':>9} {'kld hf':>9} {'rel':>6} "
          f"{'top1 kvq':>8} {'top1 hf':>8} {'ppl kvq':>8} {'ppl hf':>8}")
    for r in result["rows"]:
        k, h = r["kvq"], r["hf"]
        print(f"{r['method'][:48]:48s} {k['bits_per_element']:5.2f}/{r['hf_bits_per_element']:5.2f} "
              f"{k['kld_mean']:9.4f} {h['kld_mean']:9.4f} {rel(h['kld_mean'], k['kld_mean']) if k['kld_mean'] else 0:6.1%} "
              f"{k['top1_agree']:8.4f} {h['top1_agree']:8.4f} {k['ppl']:8.3f} {h['ppl']:8.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_protocol_args(ap, ctx=2048)
    ap.add_argument("--method", action="append")
    ap.add_argument("--out", default=str(repo / "results" / "raw" / "crossval.json"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--part", choices=["both", "kvq", "hf", "combine"], default="both",
                    help="both engines (default); or one half written to --out as JSON, to run\n"
                         "the halves on different machines: 'kvq' (also writes the token ids),\n"
                         "'hf' (reads them: --ids), 'combine' (--parts KVQ.json HF.json ...)")
    ap.add_argument("--ids", help="token ids (JSON list) for --part hf; default: kvq tokenize")
    ap.add_argument("--parts", nargs="+", help="for --part combine: the kvq half, then hf halves")
    a = ap.parse_args()
    methods = a.method or DEFAULT_METHODS
    torch.set_num_threads(a.threads)
    model_path = pathlib.Path(a.model).resolve()

    def write(obj):
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        json.dump(obj, open(a.out, "w"), indent=1)

    if a.part == "combine":
        parts = [json.load(open(f)) for f in a.parts]
        result = combine(a, parts[0], parts[1:])
        write(result)
        print_table(result)
        return
    if a.ids:
        ids = json.load(open(a.ids))
        ids = ids["ids"] if isinstance(ids, dict) else ids  # a kvq half holds its ids
    else:
        ids = kvq_json(a.kvq, ["tokenize", "--model", str(model_path), "--text", a.text, "--json"])
    print(f"crossval: {len(ids)} tokens; {a.windows} window(s) of {a.ctx}", file=sys.stderr)
    if a.part == "kvq":
        engine = engine_half(a, methods, model_path)
        engine["ids"] = ids[: a.ctx * a.windows]
        write(engine)
        return
    hf = hf_half(a, methods, model_path, ids)
    if a.part == "hf":
        write(hf)
        return
    result = combine(a, engine_half(a, methods, model_path), [hf])
    write(result)
    print_table(result)


if __name__ == "__main__":
    main()
