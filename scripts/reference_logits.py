#!/usr/bin/env python3
"""Regenerates the engine's golden test data in tests/data/ from independent references.

References (none of them shares code with kvq):
  * SmolLM2 tokenizer: llama.cpp's (through llama-cpp-python), plain text, no BOS.
  * llama2.c tokenizer: a Python re-implementation of llama2.c's encode() (the textbook
    quadratic merge loop), below.
  * Logits: a float64 numpy implementation of the Llama forward pass below, on weights
    dequantized by gguf-py (SmolLM2) or read from the llama2.c checkpoint (stories260K); keys and
    values are rounded to fp16 as they enter the cache, like kvq's fp16 cache.
  * SmolLM2 logits from llama.cpp itself (llama-cpp-python, logits_all=True). llama.cpp does not
    compute in plain fp32: its Q4_1 / Q8_0 matrix products quantize the activations to 8 bits
    (Q8_1 / Q8_0 blocks of 32) before the integer dot products, so it differs from any exact
    implementation by more than kvq's engine does from the numpy reference. The script prints
    both comparisons; the test holds kvq to the numpy reference tightly and to llama.cpp loosely.

Outputs (tests/data/):
  tokenizer_text.txt            a few thousand words: wikitext-2, a State of the Union address,
                                and a hand-written stress section (Unicode, digits, whitespace)
  smollm2_tokenizer_ids.txt     llama.cpp's token ids of that text
  stories260k_tokenizer_ids.txt llama2.c-encoder ids of that text (no BOS)
  smollm2_golden.json           numpy-reference logits at some positions of the text's first 256
                                tokens, and llama.cpp's argmax/margin at every position
  stories260k_golden.json       numpy-reference logits for a short story, and the greedy
                                continuation of "Once upon a time"

Usage (a Python with numpy, gguf and llama-cpp-python, e.g. /opt/kvqref/bin/python):
    python scripts/reference_logits.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--shared ../shared] [--out tests/data] [--skip-smollm2]
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

STRESS = (
    "Stress section. Numbers: 3.14159, 1,000,000, 2024-11-29, 0x1F, 10^9, 42nd, 1990s, ²³, ½, "
    "Ⅻ, ٣٤٥, १२३.\n"
    "Contractions: don't, I'M, they're, we've, it'll, she'd, o'clock, 'quoted', rock 'n' roll.\n"
    "Whitespace:  two  spaces,   three,\ttab,\t\ttwo tabs, trailing   \n\n\nthree newlines, "
    "\r\nCRLF, no-break\u00a0space, ideographic\u3000space, thin\u2009space.\n"
    "Scripts: naïve café résumé Ærøskøbing Straße İstanbul; Ελληνικά; русский язык; "
    "日本語のテキスト; 中文文本; 한국어; العربية; עברית; हिन्दी; ไทย.\n"
    "Symbols: — – … « » “ ” ‘ ’ € £ ¥ © ® ™ ° ± × ÷ → ⇒ ∞ ≠ ≤ ≥ √ ∑ ∫ ♥ ★ 🙂 👍🏽 🇫🇷 "
    "e\u0301 ﬁ ǅ ʰ.\n"
    "Code: for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; }  # comment\n"
    "    def f(a, b=None): return a if b is None else a + b\n"
    "Markup: <|endoftext|> <|im_start|>user <s> </s> [INST] == Heading == @-@ @,@ <unk>\n"
)


# ----------------------------------------------------------------------------------------------
# Text

def make_text(shared: Path) -> str:
    wiki = (shared / "data/wikitext-2/test.txt").read_text(encoding="utf-8")
    words = 0
    out = []
    for line in wiki.splitlines(keepends=True):
        out.append(line)
        words += len(line.split())
        if words >= 2200:
            break
    sotu = (shared / "data/sotu/1962_john_f_kennedy_d.txt").read_text(encoding="utf-8")
    sw = sotu.split(" ")
    return "".join(out) + "\n" + " ".join(sw[:1200]) + "\n\n" + STRESS


# ----------------------------------------------------------------------------------------------
# llama2.c tokenizer (Python re-implementation of run.c's encode)

def read_llama2c_tokenizer(path: Path):
    b = path.read_bytes()
    (max_len,) = struct.unpack_from("<i", b, 0)
    p, toks, scores = 4, [], []
    while p < len(b):
        s, n = struct.unpack_from("<fi", b, p)
        p += 8
        toks.append(b[p:p + n])
        scores.append(s)
        p += n
    return toks, scores


def llama2c_encode(text: str, toks, scores):
    index = {}
    for i, t in enumerate(toks):
        index.setdefault(t, i)
    data = text.encode("utf-8")
    if not data:
        return []
    ids = [index[b" "]]  # dummy prefix
    i = 0
    while i < len(data):
        n = 1
        while i + n < len(data) and n < 4 and (data[i + n] & 0xC0) == 0x80:
            n += 1
        cp = data[i:i + n]
        if cp in index:
            ids.append(index[cp])
        else:
            ids.extend(b + 3 for b in cp)
        i += n

    # The quadratic merge loop, run per chunk: no vocabulary entry has a space after its first
    # byte (asserted), so no merge can join a symbol to a following symbol that starts with a
    # space, and chunks split before such symbols merge independently.
    assert not any(b" " in t[1:] for t in toks)

    def merge(chunk):
        while True:
            best, best_id, best_i = -1e10, -1, -1
            for k in range(len(chunk) - 1):
                j = index.get(toks[chunk[k]] + toks[chunk[k + 1]])
                if j is not None and scores[j] > best:
                    best, best_id, best_i = scores[j], j, k
            if best_i < 0:
                return chunk
            chunk[best_i:best_i + 2] = [best_id]

    out, cur = [], []
    for t in ids:
        if cur and toks[t].startswith(b" "):
            out += merge(cur)
            cur = []
        cur.append(t)
    out += merge(cur)
    return out


# ----------------------------------------------------------------------------------------------
# numpy Llama forward (float64; K/V rounded to fp16 as they enter the cache)

def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    # x [T, H, D]; adjacent pairs (x[2i], x[2i+1]) rotate by pos * theta^(-2i/D).
    D = x.shape[-1]
    inv = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def forward(W, cfg, tokens):
    """Logits [T, vocab] of a whole sequence (causal attention)."""
    T = len(tokens)
    D, Hq, Hkv = cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"]
    hd = D // Hq
    x = W["emb"][tokens].astype(np.float64)
    pos = np.arange(T, dtype=np.float64)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for L in W["layers"]:
        h = rmsnorm(x, L["attn_norm"], cfg["eps"])
        q = (h @ L["wq"].T).reshape(T, Hq, hd)
        k = (h @ L["wk"].T).reshape(T, Hkv, hd)
        v = (h @ L["wv"].T).reshape(T, Hkv, hd)
        q, k = rope(q, pos, cfg["theta"]), rope(k, pos, cfg["theta"])
        k = k.astype(np.float16).astype(np.float64)
        v = v.astype(np.float16).astype(np.float64)
        out = np.empty((T, Hq, hd))
        rep = Hq // Hkv
        for hh in range(Hq):
            g = hh // rep
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            out[:, hh, :] = s @ v[:, g, :]
        x = x + out.reshape(T, D) @ L["wo"].T
        h = rmsnorm(x, L["ffn_norm"], cfg["eps"])
        gate, up = h @ L["w1"].T, h @ L["w3"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ L["w2"].T
    x = rmsnorm(x, W["final_norm"], cfg["eps"])
    return x @ W["cls"].T


def load_gguf_weights(path: Path):
    import gguf
    from gguf.quants import dequantize
    r = gguf.GGUFReader(str(path))

    def field(k):
        f = r.fields[k]
        return f.parts[f.data[0]][0]

    cfg = dict(dim=int(field("llama.embedding_length")), n_heads=int(field("llama.attention.head_count")),
               n_kv_heads=int(field("llama.attention.head_count_kv")),
               n_layers=int(field("llama.block_count")),
               eps=float(field("llama.attention.layer_norm_rms_epsilon")),
               theta=float(field("llama.rope.freq_base")))
    t = {x.name: x for x in r.tensors}

    def get(name):
        x = t[name]
        return dequantize(x.data, x.tensor_type).astype(np.float64).reshape([int(d) for d in reversed(x.shape)])

    layers = []
    for i in range(cfg["n_layers"]):
        p = f"blk.{i}."
        layers.append(dict(attn_norm=get(p + "attn_norm.weight"), wq=get(p + "attn_q.weight"),
                           wk=get(p + "attn_k.weight"), wv=get(p + "attn_v.weight"),
                           wo=get(p + "attn_output.weight"), ffn_norm=get(p + "ffn_norm.weight"),
                           w1=get(p + "ffn_gate.weight"), w3=get(p + "ffn_up.weight"),
                           w2=get(p + "ffn_down.weight")))
    emb = get("token_embd.weight")
    cls = get("output.weight") if "output.weight" in t else emb
    return dict(emb=emb, cls=cls, final_norm=get("output_norm.weight"), layers=layers), cfg


def load_llama2c_weights(path: Path):
    b = path.read_bytes()
    dim, hidden, L, Hq, Hkv, vocab, seq_len = struct.unpack_from("<7i", b, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    hd = dim // Hq
    kv = hd * Hkv
    a = np.frombuffer(b, dtype="<f4", offset=28).astype(np.float64)
    p = 0

    def take(*shape):
        nonlocal p
        n = int(np.prod(shape))
        out = a[p:p + n].reshape(shape)
        p += n
        return out

    emb = take(vocab, dim)
    rms_att, wq, wk, wv, wo = take(L, dim), take(L, dim, dim), take(L, kv, dim), take(L, kv, dim), take(L, dim, dim)
    rms_ffn, w1, w2, w3 = take(L, dim), take(L, hidden, dim), take(L, dim, hidden), take(L, hidden, dim)
    final = take(dim)
    take(seq_len, hd // 2)
    take(seq_len, hd // 2)
    cls = emb if shared else take(vocab, dim)
    assert p == a.size
    layers = [dict(attn_norm=rms_att[i], wq=wq[i], wk=wk[i], wv=wv[i], wo=wo[i], ffn_norm=rms_ffn[i],
                   w1=w1[i], w2=w2[i], w3=w3[i]) for i in range(L)]
    cfg = dict(dim=dim, n_heads=Hq, n_kv_heads=Hkv, n_layers=L, eps=1e-5, theta=10000.0)
    return dict(emb=emb, cls=cls, final_norm=final, layers=layers), cfg


def write_f32_gguf(src: Path, dst: Path):
    """Copies a GGUF file with every tensor dequantized to F32 (metadata unchanged)."""
    import gguf
    from gguf.quants import dequantize
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch="llama")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            st = f.types[1]
            if st == gguf.GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i][0].item() for i in f.data]
            w.add_key_value(k, vals, t, sub_type=st)
        elif t == gguf.GGUFValueType.STRING:
            w.add_key_value(k, bytes(f.parts[f.data[0]]).decode(), t)
        else:
            w.add_key_value(k, f.parts[f.data[0]][0].item(), t)
    for x in r.tensors:
        a = dequantize(x.data, x.tensor_type).astype(np.float32)
        w.add_tensor(x.name, a.reshape([int(d) for d in reversed(x.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def compare(ref, other):
    d = np.abs(ref - other)
    lp, lq = log_softmax(ref), log_softmax(other)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return dict(max_abs=float(d.max()), mean_abs=float(d.mean()),
                argmax_agree=float(np.mean(np.argmax(ref, -1) == np.argmax(other, -1))),
                kl_mean=float(kl.mean()), kl_max=float(kl.max()))


def log_softmax(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def golden_positions(logits, positions, probe_ids, k=8):
    out = []
    for p in positions:
        row = logits[p]
        top = np.argsort(-row)[:k]
        out.append(dict(position=int(p), top_ids=[int(i) for i in top],
                        top_logits=[float(row[i]) for i in top],
                        probe_logits=[float(row[i]) for i in probe_ids]))
    return out


def mean_nll(logits, tokens):
    lp = log_softmax(logits[:-1])
    return float(-np.mean(lp[np.arange(len(tokens) - 1), tokens[1:]]))


# ----------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--out", default=str(REPO / "tests/data"))
    ap.add_argument("--n-logit-tokens", type=int, default=256)
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--llamacpp-f32", action="store_true",
                    help="also run llama.cpp on an fp32 copy of the model (written to a temporary "
                         "file, ~540 MB) to show that its deviation from the numpy reference comes "
                         "from its quantized dot products, not from the model definition")
    args = ap.parse_args()
    shared, out = Path(args.shared), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    text = make_text(shared)
    (out / "tokenizer_text.txt").write_text(text, encoding="utf-8", newline="")
    print(f"tokenizer_text.txt: {len(text.split())} words, {len(text.encode())} bytes")

    # stories260K
    sdir = shared / "models/stories260K"
    toks, scores = read_llama2c_tokenizer(sdir / "tok512.bin")
    ids = llama2c_encode(text, toks, scores)
    (out / "stories260k_tokenizer_ids.txt").write_text(" ".join(map(str, ids)) + "\n")
    print(f"stories260k_tokenizer_ids.txt: {len(ids)} ids")

    W, cfg = load_llama2c_weights(sdir / "stories260K.bin")
    story = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
             "park. One day, she saw a big red ball under a tree. She ran to the ball and")
    s_ids = [1] + llama2c_encode(story, toks, scores)
    logits = forward(W, cfg, np.array(s_ids))
    gen = [1] + llama2c_encode("Once upon a time", toks, scores)
    prompt_len = len(gen)
    for _ in range(40):  # greedy, recomputing the whole prefix each step (simple and exact)
        gen.append(int(np.argmax(forward(W, cfg, np.array(gen))[-1])))
    probe = [0, 1, 2, 100, 300, 511]
    golden = dict(model="stories260K.bin", tokens=s_ids, mean_nll=mean_nll(logits, np.array(s_ids)),
                  positions=golden_positions(logits, [0, 1, 5, 17, len(s_ids) - 1], probe),
                  probe_ids=probe, greedy_prompt=gen[:prompt_len], greedy_continuation=gen[prompt_len:])
    (out / "stories260k_golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"stories260k_golden.json: {len(s_ids)} tokens, mean NLL {golden['mean_nll']:.4f}, "
          f"greedy: {bytes(b''.join(toks[i] for i in gen[prompt_len:]))!r}")

    if args.skip_smollm2:
        return
    from llama_cpp import Llama
    model = Path(args.model)
    llm = Llama(model_path=str(model), n_ctx=1024, n_batch=512, n_threads=2, logits_all=True,
                verbose=False)
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    (out / "smollm2_tokenizer_ids.txt").write_text(" ".join(map(str, ids)) + "\n")
    print(f"smollm2_tokenizer_ids.txt: {len(ids)} ids")

    tokens = np.array(ids[:args.n_logit_tokens])
    llm.reset()
    llm.eval(tokens.tolist())
    ref_cpp = np.array(llm.scores[:len(tokens)], dtype=np.float64)

    W, cfg = load_gguf_weights(model)
    ref = forward(W, cfg, tokens)

    vs = compare(ref, ref_cpp)
    print(f"numpy reference vs llama.cpp over {len(tokens)} positions: " +
          ", ".join(f"{k} {v:.3g}" for k, v in vs.items()) +
          f"; mean NLL {mean_nll(ref, tokens):.5f} vs {mean_nll(ref_cpp, tokens):.5f}")
    vs_f32 = None
    if args.llamacpp_f32:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            f32 = Path(tmp) / "model-f32.gguf"
            write_f32_gguf(model, f32)
            llm32 = Llama(model_path=str(f32), n_ctx=1024, n_batch=512, n_threads=2,
                          logits_all=True, verbose=False)
            llm32.eval(tokens.tolist())
            vs_f32 = compare(ref, np.array(llm32.scores[:len(tokens)], dtype=np.float64))
            del llm32
        print("numpy reference vs llama.cpp on the fp32 copy: " +
              ", ".join(f"{k} {v:.3g}" for k, v in vs_f32.items()))

    srt = np.sort(ref_cpp, axis=-1)
    probe = [0, 1, 2, 13, 198, 216, 1000, 30000, 49151]
    golden = dict(model=model.name, tokens=[int(t) for t in tokens],
                  mean_nll=mean_nll(ref, tokens),
                  positions=golden_positions(ref, [0, 1, 2, 7, 31, 64, 127, 200, len(tokens) - 1], probe),
                  probe_ids=probe,
                  llamacpp=dict(mean_nll=mean_nll(ref_cpp, tokens),
                                argmax=[int(i) for i in np.argmax(ref_cpp, -1)],
                                margin=[round(float(m), 4) for m in srt[:, -1] - srt[:, -2]],
                                vs_numpy=vs, f32_vs_numpy=vs_f32))
    (out / "smollm2_golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print("smollm2_golden.json written")


if __name__ == "__main__":
    sys.exit(main())
