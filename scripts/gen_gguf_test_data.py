#!/usr/bin/env python3
"""Writes tests/data/gguf_types.gguf: one small tensor of every GGUF tensor type kvq dequantizes,
each followed by the fp32 values that gguf-py (the reference Python package of the GGUF format)
dequantizes it to, plus metadata of every value type. tests/gguf_test.cc checks kvq's reader and
dequantizers against it bit for bit.

Run with a Python that has numpy and gguf (e.g. /opt/kvqref/bin/python):
    python scripts/gen_gguf_test_data.py [out_path]
"""
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

ROWS, COLS = 2, 512  # 1024 elements: four 256-blocks or thirty-two 32-blocks

# Byte offsets of the fp16 scale fields inside one block, overwritten with sane values so that
# random bytes never encode NaN or Inf scales.
F16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "tests/data/gguf_types.gguf"
    rng = np.random.default_rng(1234)
    w = gguf.GGUFWriter(str(out), arch="kvqtest")
    # Metadata of every scalar type, and arrays.
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 0.125)
    w.add_uint64("test.u64", 1 << 40)
    w.add_int64("test.i64", -(1 << 40))
    w.add_float64("test.f64", 1e-300)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo wörld")
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.5])
    w.add_array("test.strings", ["a", "", "ccc"])

    for qt in [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]:
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        n_blocks = ROWS * COLS // block
        if qt == Q.F32:
            raw = rng.standard_normal(ROWS * COLS).astype(np.float32).view(np.uint8)
        elif qt == Q.F16:
            raw = rng.standard_normal(ROWS * COLS).astype(np.float16).view(np.uint8)
        elif qt == Q.BF16:
            f = rng.standard_normal(ROWS * COLS).astype(np.float32)
            raw = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
            for off in F16_FIELDS[qt]:
                scale = (rng.uniform(0.001, 0.1, size=n_blocks) * rng.choice([-1, 1], size=n_blocks))
                raw[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
            raw = raw.reshape(-1)
        raw = raw.reshape(ROWS, -1)
        ref = dequantize(raw, qt).astype(np.float32).reshape(ROWS, COLS)
        assert np.all(np.isfinite(ref)), qt.name
        w.add_tensor(f"t.{qt.name}", raw, raw_dtype=qt)
        w.add_tensor(f"t.{qt.name}.ref", ref)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
