"""Write the format-v1 golden files (run once; tests/test_format.py only reads them).

    .venv/bin/python tests/golden/make_golden.py [--force]

One tiny snapshot per layout (a few tokens, mixed dtypes, values only a bit-exact path keeps:
NaN payloads, -0.0, inf, 70000 in bfloat16), one object using every encoding, and one stored
entry (two blocks of block size 2, window, shared codecs, and the same as a bundle). Next to
them, expected.json records, independently of the files' own headers, every array's dtype,
shape, sha256 and first elements, each layer's metadata, and each file's sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tqstore.format import objects as F  # noqa: E402
from tqstore.format import header as H  # noqa: E402
from tqstore.format.blocks import block_keys, calibration_digest, split_snapshot  # noqa: E402
from tqstore.exchange.bundle import write_bundle  # noqa: E402
from tqstore.canonical import tensor_bytes  # noqa: E402
from tqstore.models.identity import codecs_digest  # noqa: E402
from turboquant.codec.turbo import TurboCodec  # noqa: E402
from turboquant.codec.plan import codec_name, codec_record  # noqa: E402
from turboquant.records import LayerRecord, Layout, Snapshot, check_record_arrays  # noqa: E402

OUT = Path(__file__).resolve().parent / "format-v1"
MODEL = hashlib.sha256(b"golden model").digest()
CODEC = hashlib.sha256(b"golden codec").digest()
TOKENS = [7, 70000, 4294967295]
D = 64


def floats(rng, shape, dtype, special=True):
    a = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    if not special:
        return a
    width = {mx.float16: np.uint16, mx.bfloat16: np.uint16, mx.float32: np.uint32}[dtype]
    raw = np.array(tensor_bytes(a)).view(width).copy().reshape(-1)
    raw[:3] = {np.uint16: [0x7E01, 0x8000, 0x7C00 if dtype == mx.float16 else 0x7F80],
               np.uint32: [0x7FC00001, 0x80000000, 0x7F800000]}[width]
    a = mx.array(raw.reshape(shape)).view(dtype)
    if dtype == mx.bfloat16:
        a[..., -1] = 70000.0
    return a


def words(rng, shape, high=2**32):
    return mx.array(rng.integers(0, high, shape, dtype=np.uint64).astype(np.uint32))


def codecs(*specs):
    out = {}
    for d, bits, seed in specs:
        codec = TurboCodec(d, bits, seed)
        out[codec_name(codec, seed)] = codec_record(codec)
    return out


def turbo_config(kf, kb, vf, vb, dtype):
    return {"class": "TurboQuantKVCache", "scheme": f"golden-{kf}{kb}-{vf}{vb}", "seed": 0, "n_kv_heads": 1,
            "head_dim_k": D, "head_dim_v": D, "dtype": dtype, "protected": False,
            "key_format": kf, "key_bits": kb, "key_codec": f"turbo-d64-b{kb}-s0-raw" if kf == "turbo" else None,
            "key_group_size": 64 if kf == "affine" else None, "value_format": vf, "value_bits": vb,
            "value_codec": f"turbo-d64-b{vb}-s1-raw" if vf == "turbo" else None,
            "value_group_size": 64 if vf == "affine" else None}


def layer(layout: Layout, T: int, seed: int, stored: int | None = None) -> tuple[LayerRecord, dict]:
    """A layer of `layout` with T tokens; compressed layouts hold `stored` of them compressed
    (default all) and the rest in the raw tail; calibrated and affine-K layers are centred
    (per-block key means)."""
    rng = np.random.default_rng(seed)
    shape = (1, 1, T, D)
    if layout is Layout.RAW:
        arrays = {"keys": floats(rng, shape, mx.float16), "values": floats(rng, shape, mx.float16)}
        if seed % 2 == 0:
            return LayerRecord(layout, T, arrays, {"class": "KVCache"}), {}
        # an uncompressed TurboQuant layer: raw rows and the query power seen in prefill
        return LayerRecord(layout, T, arrays, turbo_config("turbo", 2, "turbo", 2, "float16"),
                           {"stored": 0, "query_rows": T}, {"query_power": floats(rng, (1, D), mx.float32, False)}), \
            codecs((D, 2, 0), (D, 2, 1))
    if layout is Layout.ROTATING:
        ring = (1, 1, 4, D)
        ring_arrays = {"keys": floats(rng, ring, mx.bfloat16), "values": floats(rng, ring, mx.bfloat16)}
        return LayerRecord(layout, T, ring_arrays, {"class": "RotatingKVCache", "max_size": 4, "keep": 1},
                           {"idx": 2}), {}
    stored = T if stored is None else stored
    turbo = lambda side, bits: {f"{side}_packed": words(rng, (1, 1, stored, D * bits // 32)),  # noqa: E731
                                f"{side}_norms": floats(rng, (1, 1, stored), mx.float32, special=False)}
    affine = lambda side, dt: {f"{side}_w": words(rng, (1, 1, stored, D // 4)),  # noqa: E731
                               f"{side}_scales": floats(rng, (1, 1, stored, 1), dt, special=False),
                               f"{side}_biases": floats(rng, (1, 1, stored, 1), dt, special=False)}
    if layout is Layout.RAWK_TURBO:
        arrays, config, cod = ({"keys": floats(rng, (1, 1, stored, D), mx.float32), **turbo("values", 4)},
                               turbo_config("native", 0, "turbo", 4, "float32"), codecs((D, 4, 1)))
    elif layout is Layout.AFFINEK_TURBO:
        arrays, config, cod = ({**affine("keys", mx.bfloat16), **turbo("values", 3)},
                               turbo_config("affine", 8, "turbo", 3, "bfloat16"), codecs((D, 3, 1)))
    elif layout is Layout.AFFINE:
        arrays, config, cod = ({**affine("keys", mx.float16), **affine("values", mx.float16)},
                               turbo_config("affine", 8, "affine", 8, "float16"), {})
    else:
        arrays, config, cod = ({**turbo("keys", 2), **turbo("values", 2)},
                               turbo_config("turbo", 2, "turbo", 2, "float16"), codecs((D, 2, 0), (D, 2, 1)))
    if not stored:
        arrays = {}
    if T > stored:
        dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16}.get(config["dtype"], mx.float16)
        arrays.update({"tail_keys": floats(rng, (1, 1, T - stored, D), dtype),
                       "tail_values": floats(rng, (1, 1, T - stored, D), dtype, special=False)})
    calibration = {}
    if layout in (Layout.CALIBRATED, Layout.AFFINEK_TURBO):
        calibration = {"scale": floats(rng, (1, D), mx.float32, False)}
        if layout is Layout.CALIBRATED:
            calibration["rotated_scale"] = floats(rng, (1, D), mx.float32, False)
        if stored:
            arrays["keys_shift"] = floats(rng, (1, 1, -(-stored // 256), D), mx.float32, False)
    return LayerRecord(layout, T, arrays, config, {"stored": stored}, calibration), cod


def snapshot_of(layouts, T, seed=0, stored=None) -> Snapshot:
    layers, cod = [], {}
    for i, lay in enumerate(layouts):
        r, c = layer(lay, T, seed + i, stored)
        check_record_arrays(r)
        layers.append(r)
        cod.update(c)
    return Snapshot(layers, cod)


def encodings_object() -> Snapshot:
    """Arrays large and regular enough that every encoding is chosen once."""
    rng = np.random.default_rng(99)
    T = 12
    raw = LayerRecord(Layout.RAW, T, {"keys": floats(rng, (1, 1, T, D), mx.bfloat16),
                                      "values": mx.zeros((1, 1, T, D), mx.float16) + 1}, {"class": "KVCache"})
    packed = words(rng, (1, 1, T, 8), high=4)  # low entropy: plain zstd
    turbo = LayerRecord(Layout.RAWK_TURBO, T, {"keys": floats(rng, (1, 1, T, D), mx.float32),
                                               "values_packed": packed,
                                               "values_norms": floats(rng, (1, 1, T), mx.float32, False)},
                        turbo_config("native", 0, "turbo", 4, "float32"), {"stored": T})
    return Snapshot([raw, turbo], codecs((D, 4, 1)))


def describe(obj) -> dict:
    """What the test checks, computed from the arrays before they are written."""
    def arrays(d):
        return {n: {"dtype": str(a.dtype).split(".")[-1], "shape": list(a.shape),
                    "sha256": hashlib.sha256(tensor_bytes(a)).hexdigest(),
                    "head": tensor_bytes(a)[:16].tobytes().hex()} for n, a in sorted(d.items())}

    layers = obj.layers.items() if isinstance(getattr(obj, "layers", None), dict) else \
        enumerate(getattr(obj, "layers", []))
    return {"layers": [{"index": i, "layout": r.layout.value, "offset": r.offset, "config": r.config,
                        "state": r.state, "arrays": arrays(r.arrays), "calibration": arrays(r.calibration)}
                       for i, r in layers],
            "codecs": {name: {"rotation_kind": c.rotation_kind, "norm_mode": c.norm_mode, "arrays": arrays(c.arrays)}
                       for name, c in sorted(getattr(obj, "codecs", {}).items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="overwrite existing golden files")
    if OUT.exists() and not parser.parse_args().force:
        sys.exit(f"{OUT} exists: golden files are written once (use --force only for a new format version)")
    OUT.mkdir(parents=True, exist_ok=True)
    expected: dict[str, dict] = {}

    def write(name: str, data: bytes, obj, expect: dict) -> None:
        (OUT / name).write_bytes(data)
        expected[name] = {"file_sha256": hashlib.sha256(data).hexdigest(), "expect": expect, **describe(obj)}

    for layout in Layout:
        # the calibrated layer keeps its last token in the raw tail
        snap = snapshot_of([layout], 3, seed=len(expected), stored=2 if layout is Layout.CALIBRATED else None)
        write(f"{layout.value}.tqs", F.dumps(snap, F.Provenance(MODEL, CODEC, tokens=tuple(TOKENS))), snap,
              {"kind": "snapshot", "model": MODEL.hex(), "codec": CODEC.hex(), "tokens": TOKENS})
    snap = encodings_object()
    write("encodings.tqs", F.dumps(snap), snap, {"kind": "snapshot"})

    # per-block key means need 256-token blocks, so this 2-token-block entry has none: an
    # uncompressed TurboQuant layer (query power in block 0), a ring buffer, a layer with a tail
    entry = Snapshot([layer(Layout.RAW, 3, 51)[0], layer(Layout.ROTATING, 3, 52)[0],
                      layer(Layout.TURBO, 3, 53, stored=1)[0]], codecs((D, 2, 0), (D, 2, 1)))
    split = split_snapshot(entry, block_size=2)
    cal = calibration_digest(entry)
    keys = block_keys(TOKENS, MODEL, CODEC, cal, block_size=2)
    objects = {}
    for blk, key in zip(split.blocks, keys):
        toks = TOKENS[blk.start:blk.start + blk.n_tokens]
        parent = keys[blk.index - 1] if blk.index else None
        data = F.dumps(blk, F.Provenance(MODEL, CODEC, cal, tuple(toks), parent=parent))
        write(f"entry-block{blk.index}.tqs", data, blk,
              {"kind": "block", "model": MODEL.hex(), "codec": CODEC.hex(), "tokens": toks, "key": key.hex})
        objects[key.raw] = data
    data = F.dumps(split.window, F.Provenance(MODEL, CODEC, cal, key=keys[-1]))
    write("entry-window.tqs", data, split.window, {"kind": "window", "key": keys[-1].hex})
    objects[hashlib.sha256(b"window" + keys[-1].raw).digest()] = data
    data = F.dumps(split.shared, F.Provenance(codec=CODEC))
    write("entry-shared.tqs", data, split.shared, {"kind": "shared", "codec": CODEC.hex()})
    objects[codecs_digest(split.shared.codecs)] = data
    manifest = json.dumps({"name": "golden", "tokens": TOKENS, "blocks": [k.hex for k in keys]}).encode()
    write_bundle(OUT / "entry.tqb", manifest, objects)
    expected["entry.tqb"] = {"file_sha256": hashlib.sha256((OUT / "entry.tqb").read_bytes()).hexdigest(),
                             "manifest": manifest.decode(), "objects": sorted(k.hex() for k in objects)}
    expected["entry"] = {"block_size": 2, "calibration": cal.hex(), "keys": [k.hex for k in keys], **describe(entry)}

    encodings = {t.encoding for name in expected if name.endswith(".tqs")
                 for t in F.inspect((OUT / name).read_bytes()).tensors().values()}
    assert encodings == set(H.ENCODINGS), encodings
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(expected) - 1} golden files to {OUT}; pin sha256(expected.json) = "
          f"{hashlib.sha256((OUT / 'expected.json').read_bytes()).hexdigest()} in tests/test_format.py")


if __name__ == "__main__":
    main()
