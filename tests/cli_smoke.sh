#!/usr/bin/env bash
# End-to-end checks of the CLI's contract: clear one-line errors and non-zero exits on bad
# input, and well-formed output on good input.
set -u
KVQ="$1"
fail=0
expect() {  # expect <exit code> <stderr substring> -- command...
  local want_rc="$1" want_msg="$2"; shift 3
  local err rc
  err=$("$@" 2>&1 >/dev/null); rc=$?
  if [ "$rc" != "$want_rc" ] || [[ "$err" != *"$want_msg"* ]]; then
    echo "FAIL: $* -> rc=$rc (want $want_rc), stderr: $err (want: $want_msg)"; fail=1
  fi
}
"$KVQ" --version | grep -q '^kvq [0-9]' || { echo "FAIL: --version"; fail=1; }
"$KVQ" list | grep -q '^kivi' || { echo "FAIL: list"; fail=1; }
"$KVQ" list --json | python3 -c 'import json,sys; d=json.load(sys.stdin); assert any(m["name"]=="kivi" for m in d)' || { echo "FAIL: list --json"; fail=1; }
expect 2 "unknown command" -- "$KVQ" frobnicate
expect 1 "did you mean 'kivi'" -- "$KVQ" bench --method kiwi
expect 1 "did you mean 'k_bits'" -- "$KVQ" bench --method kivi:kbits=2
expect 1 "out of range [1, 8]" -- "$KVQ" bench --method kivi:k_bits=9
expect 1 "did you mean --method" -- "$KVQ" bench --metod kivi
expect 1 "cannot open" -- "$KVQ" bench --input /nonexistent.safetensors
printf 'garbage' > "${TMPDIR:-/tmp}/kvq_smoke_bad.safetensors"
expect 1 "safetensors" -- "$KVQ" bench --input "${TMPDIR:-/tmp}/kvq_smoke_bad.safetensors"
out=$("$KVQ" bench --method kivi:k_bits=2,v_bits=2 --tokens 2048 --heads 3 --dim 64 --layers 1 --min-time 0 --json) || { echo "FAIL: bench"; fail=1; }
echo "$out" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["method"]=="kivi:k_bits=2,v_bits=2,group=32,residual=128", r; assert abs(r["bits_per_element"] - 3.8125) < 1e-12, r  # docs/methods/kivi.md formula' || { echo "FAIL: bench json: $out"; fail=1; }
# xquant-pairs: errors, and the calibration pass over the committed real dump (layers 0, 10, 20, 29)
expect 1 "--input is required" -- "$KVQ" xquant-pairs
expect 1 "must be an xquant spec" -- "$KVQ" xquant-pairs --input x.safetensors --method kivi
expect 1 "cannot open" -- "$KVQ" xquant-pairs --input /nonexistent.safetensors
out=$("$KVQ" xquant-pairs --input "$(dirname "$0")/data/smollm2_kv_small.safetensors" --method xquant:res_bits=0 --reuse 1 --json) || { echo "FAIL: xquant-pairs"; fail=1; }
echo "$out" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["layers"]==[0,10,20,29], r["layers"]; assert len(r["pairs"])==1 and r["spec"].count("@")==1, r["spec"]; assert abs(r["bits_per_element"] - 2.5) < 1e-12, r["bits_per_element"]  # 3 anchors at 3 bits, 1 reuse layer at 1 (docs/methods/xquant.md)' || { echo "FAIL: xquant-pairs json"; fail=1; }
exit $fail
