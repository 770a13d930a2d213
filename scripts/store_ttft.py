#!/usr/bin/env python3
"""Time to first token with a stored prefix (docs/store.md, "Time to first token").

A long prompt (~8.3k SmolLM2 tokens of wikitext-2) whose first ~7.2k tokens (28 chunks of 256)
are a stored prefix, generated with kvq generate -n 1, for fp16 and several kvq methods:

  recompute   the whole prompt prefilled, every chunk stored (this fills the store)
  fetch       the prefix fetched from Redis and imported, the rest (~1.1k tokens) prefilled

over three links between kvq and redis-server:

  loopback    kvq and the server in the same network namespace, 127.0.0.1
  10gbit      two namespaces joined by a veth pair, tc tbf at 10 Gbit/s on both ends
  1gbit       the same at 1 Gbit/s

The script makes the namespace pair itself (ip netns + veth + tc tbf; addresses 10.77.0.1/2
inside them only), starts redis-server in one and runs kvq in the other, and removes
everything at exit. Needs root, iproute2, redis-server and a built kvq (build/kvq).

  sudo scripts/store_ttft.py                      # every method, every link, ~8.3k tokens
  sudo scripts/store_ttft.py --methods fp16 kivi --links loopback 1gbit --scales 0.25 0.5 1
  sudo scripts/store_ttft.py ... --json results/raw/store_ttft.json --markdown results/raw/store_ttft.md
  scripts/store_ttft.py --table results/raw/store_ttft.json   # the tables of a saved run

--scales runs several prompt lengths (fractions of the ~8.3k-token prompt, prefix and rest
alike), each from an empty store. Times are kvq generate's own (prefill to the first token,
store lookup, fetch and import included; loading the model and fingerprinting its files, which a
server does once, are not).

After every fetch run the chunks it stored (the suffix's) are removed again, so each run
starts from the same store: the 28 chunks of the prefix.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS_SRV, NS_CLI = "kvqsrv", "kvqcli"
VETH_SRV, VETH_CLI = "kvq-veth-s", "kvq-veth-c"
ADDR_SRV, ADDR_CLI = "10.77.0.1", "10.77.0.2"
PORT = 6390
# tbf needs a bucket of at least rate / HZ; these leave room at either rate.
LINKS = {"loopback": None, "10gbit": ("10gbit", "8mb"), "1gbit": ("1gbit", "1mb")}
DEFAULT_METHODS = [
    "fp16",
    "kivi",
    "kivi:k_bits=4,v_bits=4",
    "cachegen",
    "cachegen:bits=2",
    "zipcache",
    "xquant",
]


def sh(*cmd, check=True, capture=False, ns=None):
    if ns:
        cmd = ("ip", "netns", "exec", ns) + cmd
    r = subprocess.run(cmd, check=False, text=True,
                       stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                       stderr=subprocess.PIPE if capture else subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr if capture else r.returncode}")
    return r


def teardown():
    for ns in (NS_SRV, NS_CLI):
        pids = sh("ip", "netns", "pids", ns, check=False, capture=True).stdout.split()
        for p in pids:
            sh("kill", "-9", p, check=False)
        sh("ip", "netns", "del", ns, check=False)


def setup_namespaces():
    teardown()
    sh("ip", "netns", "add", NS_SRV)
    sh("ip", "netns", "add", NS_CLI)
    sh("ip", "link", "add", VETH_SRV, "netns", NS_SRV, "type", "veth", "peer", "name", VETH_CLI,
       "netns", NS_CLI)
    for ns, dev, addr in ((NS_SRV, VETH_SRV, ADDR_SRV), (NS_CLI, VETH_CLI, ADDR_CLI)):
        sh("ip", "addr", "add", addr + "/24", "dev", dev, ns=ns)
        sh("ip", "link", "set", dev, "up", ns=ns)
        sh("ip", "link", "set", "lo", "up", ns=ns)


def set_link(link):
    for ns, dev in ((NS_SRV, VETH_SRV), (NS_CLI, VETH_CLI)):
        sh("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)
        if LINKS[link]:
            rate, burst = LINKS[link]
            sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
               "latency", "50ms", ns=ns)


def rx_bytes(ns, dev):
    return int(sh("cat", f"/sys/class/net/{dev}/statistics/rx_bytes", ns=ns, capture=True)
               .stdout)


def start_redis(tmp):
    log = open(os.path.join(tmp, "redis.log"), "w")
    p = subprocess.Popen(["ip", "netns", "exec", NS_SRV, "redis-server", "--port", str(PORT),
                          "--bind", f"{ADDR_SRV} 127.0.0.1", "--save", "", "--appendonly", "no",
                          "--protected-mode", "no", "--dir", tmp], stdout=log, stderr=log)
    for _ in range(200):
        r = sh("redis-cli", "-h", "127.0.0.1", "-p", str(PORT), "PING", ns=NS_SRV, check=False,
               capture=True)
        if r.stdout.strip() == "PONG":
            return p
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def build_prompts(tmp, words, scale):
    """Two prompts sharing a prefix: ~7.25k SmolLM2 tokens (28 whole chunks of 256) of
    wikitext-2 at scale 1, followed by two other passages of ~1.1k tokens; both lengths scale."""
    text = open(words, encoding="utf-8").read()
    prefix = text[:int(30000 * scale)]
    paths = {}
    # The recompute run and the fetch runs share the prefix and differ after it, so a fetch
    # reuses exactly the prefix's chunks.
    for name, at in (("fill", 300000), ("ask", 600000)):
        path = os.path.join(tmp, f"{name}-{scale}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(prefix + text[at:at + int(4400 * scale)])
        paths[name] = path
    return paths


STAT = re.compile(r"kvq generate: (\S+); prompt (\d+) tokens in ([0-9.]+) s")
STORE = re.compile(
    r"reused (\d+) of (\d+) tokens \((\d+) chunks of \d+; fetched ([0-9.]+) MB: lookup ([0-9.]+) s, "
    r"fetch ([0-9.]+) s, import ([0-9.]+) s\); stored (\d+) chunks \(([0-9.]+) MB, export "
    r"([0-9.]+) s")
BITS = re.compile(r"([0-9.]+) bits/element")


def generate(kvq, ns, prompt, method, url, model):
    cmd = [kvq, "generate", "--prompt-file", prompt, "--method", method, "-n", "1"]
    if model:
        cmd += ["--model", model]
    if url:
        cmd += ["--store", url]
    if ns:
        cmd = ["ip", "netns", "exec", ns] + cmd
    r = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr}")
    m = STAT.search(r.stderr)
    out = {"spec": m.group(1), "tokens": int(m.group(2)), "ttft_s": float(m.group(3)),
           "bits": float(BITS.search(r.stderr).group(1)), "stderr": r.stderr}
    s = STORE.search(r.stderr)
    if s:
        out.update(reused=int(s.group(1)), chunks=int(s.group(3)), fetched_mb=float(s.group(4)),
                   lookup_s=float(s.group(5)), fetch_s=float(s.group(6)),
                   import_s=float(s.group(7)), stored=int(s.group(8)),
                   stored_mb=float(s.group(9)), export_s=float(s.group(10)))
    return out


def store_keys(kvq, url):
    r = subprocess.run(["ip", "netns", "exec", NS_SRV, kvq, "store", "ls", "--store", url,
                        "--json"], text=True, stdout=subprocess.PIPE, check=True)
    return {row["key"] for row in json.loads(r.stdout)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    ap.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    ap.add_argument("--scales", nargs="+", type=float, default=[1.0],
                    help="prompt lengths as fractions of the ~8.3k-token prompt (e.g. 0.25 0.5 1)")
    ap.add_argument("--kvq", default=os.path.join(REPO, "build", "kvq"))
    ap.add_argument("--model", default="", help="default: kvq's (models/SmolLM2-135M-Instruct.Q4_1.gguf)")
    ap.add_argument("--text", default=os.path.join(REPO, "..", "shared", "data", "wikitext-2",
                                                   "test.txt"))
    ap.add_argument("--no-plain", action="store_true",
                    help="skip the fp16 recompute without a store (the write path's overhead)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--markdown", default="", help="also write the tables here, with the command")
    ap.add_argument("--table", default="", metavar="JSON",
                    help="only print the tables of results written by --json")
    a = ap.parse_args()
    if a.table:
        with open(a.table) as f:
            res = json.load(f)
        text = render(res)
        print(text)
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write(text)
        return
    if os.geteuid() != 0:
        sys.exit("store_ttft: needs root (ip netns, tc)")
    for tool in ("ip", "tc", "redis-server", "redis-cli"):
        if not shutil.which(tool):
            sys.exit(f"store_ttft: {tool} not found (apt-get install iproute2 redis-server)")
    tmp = tempfile.mkdtemp(prefix="kvq-ttft-")
    results = {"links": a.links, "runs": [],
               "command": "sudo scripts/store_ttft.py " + " ".join(sys.argv[1:]),
               "load_before": os.getloadavg()}
    t_start = time.time()
    try:
        setup_namespaces()
        redis = start_redis(tmp)
        url_net = f"redis://{ADDR_SRV}:{PORT}?timeout_ms=60000"
        url_lo = f"redis://127.0.0.1:{PORT}?timeout_ms=60000"
        for scale in a.scales:
            # Each length starts from an empty store: the shorter prefixes are prefixes of the
            # longer ones, and a recompute must not reuse them.
            sh("redis-cli", "-h", "127.0.0.1", "-p", str(PORT), "FLUSHALL", ns=NS_SRV)
            prompts = build_prompts(tmp, a.text, scale)
            run = {"scale": scale, "methods": {}}
            results["runs"].append(run)
            set_link("loopback")
            if not a.no_plain:
                r = generate(a.kvq, NS_CLI, prompts["ask"], "fp16", "", a.model)
                run["plain_fp16"] = r
                print(f"[{scale}] recompute fp16, no store: {r['tokens']} tokens, TTFT "
                      f"{r['ttft_s']:.2f} s", flush=True)
            for m in a.methods:
                r = generate(a.kvq, NS_CLI, prompts["fill"], m, url_net, a.model)
                run["methods"][m] = {"recompute": r, "fetch": {}}
                print(f"[{scale}] {m}: recompute {r['tokens']} tokens, TTFT {r['ttft_s']:.2f} s, "
                      f"stored {r['stored']} chunks, {r['stored_mb']:.1f} MB", flush=True)
            for link in a.links:
                set_link(link)
                for m in a.methods:
                    before = store_keys(a.kvq, url_lo)
                    ns, dev = (NS_SRV, None) if link == "loopback" else (NS_CLI, VETH_CLI)
                    rx0 = rx_bytes(ns, dev) if dev else 0
                    r = generate(a.kvq, ns, prompts["ask"], m,
                                 url_lo if link == "loopback" else url_net, a.model)
                    r["wire_mb"] = (rx_bytes(ns, dev) - rx0) / 1e6 if dev else None
                    for k in store_keys(a.kvq, url_lo) - before:  # back to the prefix alone
                        sh(a.kvq, "store", "rm", "--store", url_lo, k, ns=NS_SRV)
                    run["methods"][m]["fetch"][link] = r
                    wire = f", {r['wire_mb']:.1f} MB on the wire" if dev else ""
                    print(f"[{scale}] {m} over {link}: reused {r['reused']} of {r['tokens']}, TTFT "
                          f"{r['ttft_s']:.2f} s (fetch {r['fetch_s']:.3f} s of "
                          f"{r['fetched_mb']:.1f} MB{wire}, import {r['import_s']:.3f} s)",
                          flush=True)
        redis.kill()
    finally:
        teardown()
        shutil.rmtree(tmp, ignore_errors=True)
    results["seconds"] = round(time.time() - t_start, 1)
    results["load_after"] = os.getloadavg()
    results["cores"] = os.cpu_count()
    for run in results["runs"]:
        for m in run["methods"].values():
            for r in [m["recompute"]] + list(m["fetch"].values()):
                r.pop("stderr", None)
        run.get("plain_fp16", {}).pop("stderr", None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    text = render(results)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)


def render(res):
    """The tables of docs/store.md and docs/results.md ("Prefix store"), as Markdown."""
    links = res["links"]
    nets = [l for l in links if l != "loopback"]
    out = []

    def store_s(r):
        return r["lookup_s"] + r["fetch_s"] + r["import_s"]

    def imp(m):  # import does not depend on the link: the mean over the runs
        return sum(r["import_s"] for r in m["fetch"].values()) / len(m["fetch"])

    def suffix_s(m):  # the fetch runs' own compute: TTFT less the store's share, on loopback
        f = m["fetch"].get("loopback") or next(iter(m["fetch"].values()))
        return f["ttft_s"] - store_s(f)

    def break_even_mbit(m):  # link speed above which fetching the prefix beats recomputing it
        f = next(iter(m["fetch"].values()))
        budget = m["recompute"]["ttft_s"] - suffix_s(m) - f["lookup_s"] - imp(m)
        return f["fetched_mb"] * 8 / budget if budget > 0 else None

    out.append("Time to first token (s). `recompute`: the whole prompt prefilled (the store "
               "written on the way); `fetch, <link>`: the other prompt of the pair (the same "
               "prefix, another rest of about the same length) with the prefix fetched from "
               "redis-server over that link and imported, only the rest prefilled. Speed-up: "
               "recompute / fetch. Fetching beats recomputing above the last column's link speed "
               "(the prefix's bytes / the prefill time they save, from the loopback run).\n")
    out.append("| prompt tokens, recompute / fetch | reused | method | bits/elem | recompute | " +
               " | ".join(f"fetch, {l}" for l in links) + " | speed-up, " +
               " / ".join(links) + " | fetch pays above (Mbit/s) |")
    out.append("|---:|---:|---|---:|---:|" + "---:|" * len(links) + "---:|---:|")
    for run in res["runs"]:
        for name, m in run["methods"].items():
            f = m["fetch"]
            any_f = next(iter(f.values()))
            rc = m["recompute"]["ttft_s"]
            be = break_even_mbit(m)
            out.append(f"| {m['recompute']['tokens']} / {any_f['tokens']} | {any_f['reused']} | "
                       f"`{name}` | {m['recompute']['bits']:.2f} | {rc:.2f} | " +
                       " | ".join(f"{f[l]['ttft_s']:.2f}" for l in links) + " | " +
                       " / ".join(f"{rc / f[l]['ttft_s']:.1f}x" for l in links) + " | " +
                       (f"{be:.0f}" if be else "—") + " |")
    plain = [(r["plain_fp16"]["tokens"], r["plain_fp16"]["ttft_s"]) for r in res["runs"]
             if "plain_fp16" in r]
    if plain:
        out.append("\nfp16 recompute without a store (no export, no writes): " +
                   ", ".join(f"{t} tokens {s:.2f} s" for t, s in plain) + ".")

    out.append("\nBytes moved and the store's share of the fetch runs: the prefix's objects "
               "(blocks of every reused chunk, the tail of the last), per reused token; bytes "
               "received on the client's link (payload plus TCP/IP and RESP framing); lookup + "
               "fetch + import (s); the fetch's rate; and the link speed below which the method's "
               "fetch beats fetching fp16 (its bytes saved / its extra import time).\n")
    out.append("| prompt tokens | method | fetched MB | bytes/token | " +
               " | ".join(f"on the wire, {l} (MB)" for l in nets) + " | " +
               " | ".join(f"store, {l}" for l in links) + " | import | " +
               " | ".join(f"fetch rate, {l} (MB/s)" for l in links) + " | pays over fp16 below |")
    out.append("|---:|---|---:|---:|" + "---:|" * len(nets) + "---:|" * len(links) + "---:|" +
               "---:|" * len(links) + "---:|")
    for run in res["runs"]:
        base = run["methods"].get("fp16")
        for name, m in run["methods"].items():
            f = m["fetch"]
            any_f = next(iter(f.values()))
            mb = any_f["fetched_mb"]
            per_tok = mb * 1e6 / any_f["reused"] if any_f["reused"] else 0
            wires = [f"{f[l]['wire_mb']:.1f}" if f[l].get("wire_mb") is not None else "—"
                     for l in nets]
            cells = [f"{store_s(f[l]):.3f}" for l in links]
            rates = [f"{f[l]['fetched_mb'] / f[l]['fetch_s']:.0f}" if f[l]["fetch_s"] > 0 else "—"
                     for l in links]
            pays = "—"
            if base and name != "fp16":
                saved = next(iter(base["fetch"].values()))["fetched_mb"] - mb
                extra = imp(m) - imp(base)
                if saved <= 0:
                    pays = "never"
                elif extra <= 0:
                    pays = "any link"
                else:
                    pays = f"{saved / extra * 8 / 1000:.1f} Gbit/s"
            out.append(f"| {any_f['tokens']} | `{name}` | {mb:.1f} | {per_tok:.0f} | " +
                       " | ".join(wires + cells) + f" | {imp(m):.3f} | " + " | ".join(rates) +
                       f" | {pays} |")
    specs = {}
    for run in res["runs"]:
        for name, m in run["methods"].items():
            if m["recompute"].get("spec", name) != name:
                specs[name] = m["recompute"]["spec"]
    if specs:
        out.append("\nCanonical specs: " + "; ".join(f"`{n}` = `{sp}`" for n, sp in specs.items()) +
                   ".")
    meta = []
    if "seconds" in res:
        meta.append(f"{res['seconds']:.0f} s in all")
    if "cores" in res:
        meta.append(f"{res['cores']} cores")
    if "load_before" in res:
        meta.append("load average before " + " ".join(f"{x:.2f}" for x in res["load_before"]) +
                    ", after " + " ".join(f"{x:.2f}" for x in res["load_after"]))
    if "command" in res:
        out.append(f"\nMade by `{res['command']}`" + (f" ({'; '.join(meta)})" if meta else "") +
                   ".")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
