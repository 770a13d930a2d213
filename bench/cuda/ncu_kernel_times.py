"""Kernel time by kernel name from `ncu --metrics gpu__time_duration.sum --csv` output.

    python3 bench/cuda/ncu_kernel_times.py NCU_CSV
"""
import csv, sys, collections, re
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
hdr = rows[0]; ki = hdr.index("Kernel Name"); vi = hdr.index("Metric Value"); ui = hdr.index("Metric Unit")
scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1, "msecond": 1}
seq = []
for r in rows[1:]:
    if r[hdr.index("Metric Name")] != "gpu__time_duration.sum": continue
    name = r[ki]
    for junk in ("(anonymous namespace)::", "<unnamed>::", "unnamed>::", "kvq::", "cuda::", "void "):
        name = name.replace(junk, "")
    name = name.split("(")[0][:70]
    seq.append((name, float(r[vi].replace(",", "")) * scale[r[ui]]))
agg = collections.defaultdict(lambda: [0, 0.0])
for n, v in seq: agg[n][0] += 1; agg[n][1] += v
print(f"{len(seq)} kernels, {sum(v for _, v in seq):.3f} ms")
for n, (c, v) in sorted(agg.items(), key=lambda x: -x[1][1])[:16]: print(f"  {v:8.3f} ms  x{c:4d}  {n}")
