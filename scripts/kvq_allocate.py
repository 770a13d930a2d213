#!/usr/bin/env python3
"""Per-layer, per-K/V bit allocation for kvq's method from a sensitivity pass (KVTuner's idea:
layers and keys/values differ in how much their rounding costs, so the bits go where they pay).

1. The sensitivity pass: every layer's keys, then its values, at 2, 3 and 4 bits with every other
   layer at 8 bits (~lossless), one `kvq ppl` row each, on the tuning text (wikitext-2 *valid*):

     scripts/kvq_allocate.py methods --layers 30 > sens.txt
     scripts/ppl_parallel.py --kvq build/kvq --text valid.txt --ctx 2048 --windows 1 \\
         --methods-file sens.txt --methods-per-job 6 --out sens.json

2. The allocation for a budget of mean code bits per element (the same for keys and values: a
   layer's keys and values have as many elements): start with every stream at 2 bits and give
   one bit at a time to the stream whose KLD falls the most (its measured rise at b bits minus
   that at b + 1; 5 bits is extrapolated as a quarter of the 4-bit rise, uniform quantization's
   rate). The KLD rises are treated as additive over streams (checked: their sum is within 25 %
   of the measured all-2-bit, all-3-bit and all-4-bit rows). Prints a model spec:

     scripts/kvq_allocate.py spec --sens sens.json --bits 2.333 [--base kvq:window=q8]

The scale/zero parameters, sinks and window cost the same at every width, so the all-in bits are
the mean code bits plus the method's fixed overhead (printed by `kvq ppl`).
"""
import argparse
import json
import re
import sys

LEVELS = (2, 3, 4, 5)  # 1-bit values break the model (docs/methods/kvq.md); 5 is extrapolated
MEASURED = (2, 3, 4)
REST = 8


def methods(layers, base):
    sep = "," if ":" in base else ":"
    out = [f"{base}{sep}k_bits={b},v_bits={b}" for b in MEASURED] + [f"{base}{sep}k_bits={REST},v_bits={REST}"]
    for layer in range(layers):
        for s in "kv":
            out += [f"{base}{sep}k_bits={REST},v_bits={REST}@{layer}:{s}_bits={b}" for b in MEASURED]
    return out


def load_rises(path):
    """{(layer, 'k'|'v', bits): KLD rise over the all-8-bit row}, from ppl_parallel's JSON."""
    rows = json.load(open(path))["rows"]
    rest = [r for r in rows if "@" not in r["method"] and f"k_bits={REST},v_bits={REST}" in r["method"]]
    if len(rest) != 1:
        sys.exit(f"{path}: needs exactly one all-{REST}-bit row")
    base = rest[0]["kld_mean"]
    rise = {}
    for r in rows:
        m = re.search(r"@(\d+):([kv])_bits=(\d+)$", r["method"])
        if m:
            rise[(int(m[1]), m[2], int(m[3]))] = max(r["kld_mean"] - base, 0.0)
    layers = 1 + max(k[0] for k in rise)
    for layer in range(layers):
        for s in "kv":
            for b in MEASURED:
                if (layer, s, b) not in rise:
                    sys.exit(f"{path}: no row for layer {layer} {s}_bits={b}")
            # Monotone in the bits (the measured rises carry noise at the 1e-6 level).
            for b in MEASURED[1:]:
                rise[(layer, s, b)] = min(rise[(layer, s, b)], rise[(layer, s, b - 1)])
            rise[(layer, s, 5)] = rise[(layer, s, 4)] / 4
    return rise, layers


def allocate(rise, layers, mean_bits):
    cur = {(layer, s): LEVELS[0] for layer in range(layers) for s in "kv"}
    budget = round(mean_bits * len(cur))
    if budget < LEVELS[0] * len(cur) or budget > LEVELS[-1] * len(cur):
        sys.exit(f"--bits must be in [{LEVELS[0]}, {LEVELS[-1]}]")
    while sum(cur.values()) < budget:
        # The stream whose next bit lowers the predicted KLD the most (ties: the lower layer, keys).
        k = max((k for k, b in cur.items() if b < LEVELS[-1]),
                key=lambda k: (rise[(*k, cur[k])] - rise[(*k, cur[k] + 1)], -k[0], k[1] == "k"))
        cur[k] += 1
    predicted = sum(rise[(*k, b)] for k, b in cur.items())
    return cur, predicted


def spec_of(cur, layers, base):
    """The model spec: the commonest (k, v) pair as the method's bits, every other layer overridden."""
    pairs = [(cur[(layer, "k")], cur[(layer, "v")]) for layer in range(layers)]
    common = max(set(pairs), key=pairs.count)
    sep = "," if ":" in base else ":"
    out = f"{base}{sep}k_bits={common[0]},v_bits={common[1]}"
    for layer, (kb, vb) in enumerate(pairs):
        diff = ([f"k_bits={kb}"] if kb != common[0] else []) + ([f"v_bits={vb}"] if vb != common[1] else [])
        if diff:
            out += f"@{layer}:" + ",".join(diff)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("methods", help="the sensitivity pass's method specs, one per line")
    m.add_argument("--layers", type=int, required=True)
    m.add_argument("--base", default="kvq")
    s = sub.add_parser("spec", help="the model spec for a budget of mean code bits")
    s.add_argument("--sens", required=True)
    s.add_argument("--bits", type=float, required=True, action="append")
    s.add_argument("--base", default="kvq")
    s.add_argument("--explain", action="store_true", help="also the bits per layer and the predicted KLD rise")
    a = p.parse_args()
    if a.cmd == "methods":
        print("\n".join(methods(a.layers, a.base)))
        return
    rise, layers = load_rises(a.sens)
    for bits in a.bits:
        cur, predicted = allocate(rise, layers, bits)
        print(spec_of(cur, layers, a.base))
        if a.explain:
            print("  keys  : " + " ".join(str(cur[(i, "k")]) for i in range(layers)), file=sys.stderr)
            print("  values: " + " ".join(str(cur[(i, "v")]) for i in range(layers)), file=sys.stderr)
            print(f"  mean code bits {sum(cur.values()) / len(cur):.3f}, predicted KLD rise {predicted:.5f}",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
