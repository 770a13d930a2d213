#!/usr/bin/env python3
"""Interleaved rounds of kvq_bench's kernel benchmarks, medians per benchmark and binary.

    scripts/kernel_rounds.py --bin after=build/kvq_bench [--bin before=OLD/kvq_bench] \
        --filter '^Kernel/' --rounds 5 --min-time 0.2 --core 1 --kv kv.safetensors \
        --json results/raw/kernels.json > table.md

Each round runs every binary once, in turn (one `kvq_bench --benchmark_format=json` process per
binary and round, pinned with taskset), so a slow spell of the shared machine falls on all of
them. Rates are Google Benchmark's items_per_second, which come from the benchmark thread's CPU
time. The load average before each round is recorded. Prints a Markdown table: per benchmark the
median over rounds of each binary's rate and, with two binaries, their median per-round ratio.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_once(binary, flt, min_time, core, kv):
    env = dict(os.environ)
    if kv:
        env["KVQ_KV"] = kv
    cmd = ["taskset", "-c", str(core), binary, f"--benchmark_filter={flt}",
           f"--benchmark_min_time={min_time}", "--benchmark_format=json"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", action="append", required=True, help="NAME=PATH, in order")
    ap.add_argument("--filter", default="^Kernel/")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", default="0.2")
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--kv", default="")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    bins = [b.split("=", 1) for b in a.bin]
    rounds = []
    for r in range(a.rounds):
        for name, path in (bins if r % 2 == 0 else bins[::-1]):
            load = os.getloadavg()
            t0 = time.time()
            res = run_once(path, a.filter, a.min_time, a.core, a.kv)
            rounds.append({"round": r, "bin": name, "path": path, "load_before": load,
                           "started": time.strftime("%H:%M:%S", time.gmtime(t0)),
                           "context": res["context"],
                           "benchmarks": [{k: v for k, v in b.items()
                                           if k in ("name", "real_time", "cpu_time", "time_unit",
                                                    "items_per_second", "bytes_per_second",
                                                    "iterations")
                                           or isinstance(v, (int, float)) and k not in
                                           ("family_index", "per_family_instance_index",
                                            "repetitions", "repetition_index", "threads")}
                                          for b in res["benchmarks"]]})
            print(f"round {r} {name}: load {load[0]:.1f}", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "bins": dict(bins), "rounds": rounds}, f,
                      indent=1)
    names = []
    rate = {}  # (bench, bin) -> [rates per round]
    counters = {}
    for rr in rounds:
        for b in rr["benchmarks"]:
            if b["name"] not in names:
                names.append(b["name"])
            rate.setdefault((b["name"], rr["bin"]), []).append(b.get("items_per_second", 0))
            counters[b["name"]] = {k: v for k, v in b.items()
                                   if k not in ("name", "real_time", "cpu_time", "time_unit",
                                                "items_per_second", "bytes_per_second",
                                                "iterations")}
    hdr = "| benchmark | " + " | ".join(f"{n} G items/s" for n, _ in bins)
    if len(bins) == 2:
        hdr += f" | {bins[0][0]} / {bins[1][0]}"
    print(hdr + " | counters |")
    print("|---|" + "---:|" * (len(bins) + (len(bins) == 2)) + "---|")
    for n in names:
        cells = []
        for bn, _ in bins:
            v = rate.get((n, bn))
            cells.append(f"{statistics.median(v) / 1e9:.3f}" if v else "-")
        if len(bins) == 2:
            x, y = rate.get((n, bins[0][0])), rate.get((n, bins[1][0]))
            if x and y and len(x) == len(y):
                cells.append(f"{statistics.median([p / q for p, q in zip(x, y)]):.2f}x")
            else:
                cells.append("-")
        c = ", ".join(f"{k}={v:.4g}" for k, v in counters.get(n, {}).items())
        print(f"| `{n}` | " + " | ".join(cells) + f" | {c} |")
    loads = [rr["load_before"][0] for rr in rounds]
    print(f"\nload average (1 min) before the rounds: {min(loads):.1f} to {max(loads):.1f}, "
          f"median {statistics.median(loads):.1f}")


if __name__ == "__main__":
    main()
