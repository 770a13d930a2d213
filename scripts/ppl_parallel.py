#!/usr/bin/env python3
"""`kvq ppl` over many methods and windows, split into jobs that run in parallel (one thread each),
then merged into the rows one run would print.

Each job is one process: fp16 and a few methods over a few consecutive windows (`--first-window`).
Every window is computed the same way whichever job holds it (each window resets the caches), so
the merge is exact for every mean: KLD, top-1 and log-perplexity are token-weighted means of the
jobs' rows, bits and bytes are means over windows. The 99th percentiles cannot be merged from
rows and are left out (None) when a method's windows span more than one job.

  scripts/ppl_parallel.py --kvq build/kvq --text valid.txt --ctx 2048 --windows 8 \\
      --procs 16 --methods-per-job 2 --windows-per-job 2 --out rows.json --method kvq ...
  scripts/ppl_parallel.py --combine a.json b.json rows.json   # runs of other methods, same windows
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvq", required=True)
    p.add_argument("--model", help="--model for kvq ppl (default: kvq's own lookup)")
    p.add_argument("--text", required=True)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--windows", type=int, required=True)
    p.add_argument("--first-window", type=int, default=0)
    p.add_argument("--decode", type=int, help="--decode for kvq ppl")
    p.add_argument("--procs", type=int, default=os.cpu_count())
    p.add_argument("--methods-per-job", type=int, default=1)
    p.add_argument("--windows-per-job", type=int, default=1)
    p.add_argument("--method", action="append", default=[])
    p.add_argument("--methods-file", help="one spec per line (# comments)")
    p.add_argument("--out", required=True, help="merged rows (JSON); the jobs' logs go beside it")
    p.add_argument("--deadline", type=float, help="seconds: jobs not started by then are skipped")
    return p.parse_args()


def merge(job_rows):
    """job_rows: (rows, first window, window count) per job, rows fp16 first. -> one row per method,
    each window counted once (fp16 runs in every job: the same figures for the same windows)."""
    by, seen = {}, set()
    order = []
    for rows, first, windows in job_rows:
        for r in rows:
            m = r["method"]
            if (m, first) in seen:
                continue
            seen.add((m, first))
            if m not in by:
                by[m] = []
                order.append(m)
            by[m].append((r, windows))
    out = []
    for m in order:
        parts = by[m]
        n = sum(r["tokens"] for r, _ in parts)
        nd = sum(r.get("tokens_decode", 0) for r, _ in parts)
        nw = sum(w for _, w in parts)
        row = {"method": m, "tokens": n, "windows": nw}

        def wmean(key, weight):
            tot = sum(r[weight] for r, _ in parts)
            return sum(r[key] * r[weight] for r, _ in parts) / tot if tot else 0.0

        def wlog(key, weight):
            tot = sum(r[weight] for r, _ in parts)
            return math.exp(sum(math.log(r[key]) * r[weight] for r, _ in parts) / tot) if tot else 0.0

        row["ppl_fp16"] = wlog("ppl_fp16", "tokens")
        row["ppl"] = wlog("ppl", "tokens")
        row["kld_mean"] = wmean("kld_mean", "tokens")
        row["top1_agree"] = wmean("top1_agree", "tokens")
        row["tokens_decode"] = nd
        if nd:
            row["ppl_fp16_decode"] = wlog("ppl_fp16_decode", "tokens_decode")
            row["ppl_decode"] = wlog("ppl_decode", "tokens_decode")
            row["kld_mean_decode"] = wmean("kld_mean_decode", "tokens_decode")
            row["top1_agree_decode"] = wmean("top1_agree_decode", "tokens_decode")
        for key in ("bits_per_element", "resident_bytes", "fp16_bytes"):
            row[key] = sum(r[key] * w for r, w in parts) / nw
        row["tokens_per_s"] = sum(r["tokens_per_s"] * w for r, w in parts) / nw
        single = len(parts) == 1
        for key in ("kld_p99", "kld_p99_decode"):
            row[key] = parts[0][0].get(key) if single else None
        out.append(row)
    return out


def combine(paths, out):
    """Records of runs over the same windows with different methods -> one record (fp16 once)."""
    recs = [json.load(open(p)) for p in paths]
    rows, seen = [], set()
    for rec in recs:
        for r in rec["rows"]:
            if r["method"] not in seen:
                seen.add(r["method"])
                rows.append(r)
    if len({(r["windows"], r["tokens"]) for r in rows}) != 1:
        sys.exit("--combine: the runs do not cover the same windows")
    record = {"command": " ; ".join(r["command"] for r in recs), "wall_s": round(sum(r["wall_s"] for r in recs), 1),
              "jobs": sum(r["jobs"] for r in recs), "jobs_failed": sum(r["jobs_failed"] for r in recs),
              "job_seconds": [t for r in recs for t in r["job_seconds"]], "rows": rows}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--combine":
        if len(sys.argv) < 5:
            sys.exit("usage: ppl_parallel.py --combine A.json B.json ... OUT.json")
        combine(sys.argv[2:-1], sys.argv[-1])
        return
    a = parse()
    methods = list(a.method)
    if a.methods_file:
        for line in open(a.methods_file):
            line = line.split("#", 1)[0].strip()
            if line:
                methods.append(line)
    if not methods:
        sys.exit("no --method given")
    wins = list(range(a.first_window, a.first_window + a.windows))
    wchunks = [wins[i:i + a.windows_per_job] for i in range(0, len(wins), a.windows_per_job)]
    mchunks = [methods[i:i + a.methods_per_job] for i in range(0, len(methods), a.methods_per_job)]
    jobs = [(w, m) for m in mchunks for w in wchunks]
    logdir = os.path.splitext(a.out)[0] + "_jobs"
    os.makedirs(logdir, exist_ok=True)
    print(f"ppl_parallel: {len(methods)} methods x {len(wins)} windows of {a.ctx} -> {len(jobs)} jobs "
          f"on {a.procs} processes", file=sys.stderr, flush=True)

    t0 = time.time()

    def run(i):
        w, ms = jobs[i]
        if a.deadline is not None and time.time() - t0 > a.deadline:
            print(f"job {i} skipped: past the deadline", file=sys.stderr, flush=True)
            return None
        cmd = [a.kvq, "ppl", "--threads", "1", "--text", a.text, "--ctx", str(a.ctx),
               "--first-window", str(w[0]), "--windows", str(len(w)), "--json", "--quiet"]
        if a.model:
            cmd += ["--model", a.model]
        if a.decode is not None:
            cmd += ["--decode", str(a.decode)]
        for m in ms:
            cmd += ["--method", m]
        tj = time.time()
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        with open(os.path.join(logdir, f"job{i:03d}.err"), "w") as err:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        dt = time.time() - tj
        if p.returncode != 0:
            print(f"job {i} failed (rc {p.returncode}): {' '.join(cmd)}", file=sys.stderr, flush=True)
            return None
        with open(os.path.join(logdir, f"job{i:03d}.json"), "w") as f:
            f.write(p.stdout)
        print(f"[{time.strftime('%H:%M:%S')}] job {i + 1}/{len(jobs)} done in {dt:.0f} s", file=sys.stderr,
              flush=True)
        return json.loads(p.stdout), w[0], len(w), dt, cmd

    with ThreadPoolExecutor(a.procs) as ex:
        results = list(ex.map(run, range(len(jobs))))
    done = [r for r in results if r is not None]
    rows = merge([(r[0], r[1], r[2]) for r in done])
    record = {"command": " ".join(sys.argv), "wall_s": round(time.time() - t0, 1),
              "jobs": len(jobs), "jobs_failed": len(jobs) - len(done),
              "job_seconds": [round(r[3], 1) for r in done], "rows": rows}
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"ppl_parallel: {len(done)}/{len(jobs)} jobs in {record['wall_s']} s -> {a.out}", file=sys.stderr)
    sys.exit(0 if len(done) == len(jobs) else 1)


if __name__ == "__main__":
    main()
