"""Token blocks, chained keys, split/join (tqstore.format.blocks).

`make_snapshot` (used by the format tests too) builds a Snapshot for any layouts with random
arrays of the right shapes and dtypes, including values that only a bit-exact path keeps
(NaN payloads, -0.0, infinities, 70000 in bfloat16).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tqstore.format.blocks import (BLOCK_SIZE, BlockKey, block_keys, block_spans, calibration_digest, join_blocks,
                            split_snapshot)
from tqstore.canonical import tensor_bytes
from tqstore.format import objects as F
from turboquant.codec.turbo import TurboCodec
from turboquant.codec.plan import codec_record, codec_name
from turboquant.records import (LayerRecord, Layout, Snapshot, check_record_arrays, join_children, leaf_records,
                                split_children, state_at)

B, H, D = 1, 2, 64
WINDOW = 64
CODECS = {"k": (64, 4, 0), "v": (64, 3, 1), "m": (80, 2, 0)}  # d=80 has a hadamard_m matrix
HETEROGENEOUS = [Layout.AFFINE, Layout.CALIBRATED, Layout.TURBO, Layout.ROTATING, Layout.RAWK_TURBO,
                 Layout.AFFINEK_TURBO, Layout.RAW, Layout.RAW, Layout.CALIBRATED, Layout.AFFINE]
TOKEN_COUNTS = (0, 1, 255, 256, 257, 1000)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _codecs():
    out = {}
    for d, bits, seed in CODECS.values():
        codec = TurboCodec(d, bits, seed)
        out[codec_name(codec, seed)] = codec_record(codec)
    return out


def _floats(rng, shape, dtype, special=False):
    x = rng.standard_normal(shape).astype(np.float32)
    if x.size and len(shape) == 4 and shape[-1] > 3:
        x[..., 3] += 40.0  # an outlier channel, as real keys have
    a = mx.array(x).astype(dtype)
    if special and x.size >= 4:
        bits = {mx.float16: np.uint16, mx.bfloat16: np.uint16, mx.float32: np.uint32}[dtype]
        raw = np.array(tensor_bytes(a)).view(bits).copy().reshape(-1)
        nan_payload = {np.uint16: 0x7E01, np.uint32: 0x7FC00001}[bits]
        neg_zero = {np.uint16: 0x8000, np.uint32: 0x80000000}[bits]
        inf = {np.uint16: 0x7C00 if dtype == mx.float16 else 0x7F80, np.uint32: 0x7F800000}[bits]
        raw[:3] = [nan_payload, neg_zero, inf]
        a = mx.array(raw.reshape(shape)).view(dtype)
        if dtype == mx.bfloat16:
            a[..., -1] = 70000.0
    return a


def _words(rng, shape):
    return mx.array(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))


def _side(rng, side, fmt, T, dtype):
    if fmt == "native":
        return {side: _floats(rng, (B, H, T, D), dtype, special=True)}
    if fmt == "affine":
        return {f"{side}_w": _words(rng, (B, H, T, D // 4)), f"{side}_scales": _floats(rng, (B, H, T, 1), dtype),
                f"{side}_biases": _floats(rng, (B, H, T, 1), dtype)}
    return {f"{side}_packed": _words(rng, (B, H, T, 8)), f"{side}_norms": _floats(rng, (B, H, T), mx.float32)}


_FORMATS = {Layout.RAW: ("native", "native"), Layout.RAWK_TURBO: ("native", "turbo"),
            Layout.AFFINEK_TURBO: ("affine", "turbo"), Layout.TURBO: ("turbo", "turbo"),
            Layout.CALIBRATED: ("turbo", "turbo"), Layout.AFFINE: ("affine", "affine")}


def _turbo_config(kf: str, vf: str, dtype) -> dict:
    return {"class": "TurboQuantKVCache", "scheme": "turbo4", "seed": 0, "n_kv_heads": H, "head_dim_k": D,
            "head_dim_v": D, "dtype": str(dtype).split(".")[-1], "protected": kf == vf == "affine",
            "key_format": kf, "key_bits": {"native": 0, "affine": 8, "turbo": 4}[kf],
            "key_codec": "turbo-d64-b4-s0-raw" if kf == "turbo" else None,
            "key_group_size": 64 if kf == "affine" else None, "value_format": vf, "value_bits": 3,
            "value_codec": "turbo-d64-b3-s1-raw" if vf == "turbo" else None, "ratio": 0.25}


def make_layer(layout: Layout, T: int, dtype=mx.float16, seed: int = 0, empty: bool = False) -> LayerRecord:
    """A layer record of `layout` holding T tokens, shaped as turboquant's caches record them.

    Odd seeds make a RAW layer an uncompressed TurboQuant layer (with its observed query power)
    instead of an mlx-lm KVCache; for compressed layouts, every third seed leaves the tokens
    after the last full 256-token block in the raw tail, and centred layouts carry per-block key
    means. `empty` gives 0-token RAW layers no arrays at all.
    """
    rng = np.random.default_rng(seed)
    if layout in _NATIVE_MAKERS:
        return _NATIVE_MAKERS[layout](rng, T, dtype, seed)
    if layout is Layout.ROTATING:
        S = min(T, WINDOW)
        arrays = {} if T == 0 else {"keys": _floats(rng, (B, H, S, D), dtype, True),
                                    "values": _floats(rng, (B, H, S, D), dtype)}
        return LayerRecord(layout, T, arrays, {"class": "RotatingKVCache", "max_size": WINDOW, "keep": 4},
                           {"idx": S if T < WINDOW else 4 + (T - 4) % (WINDOW - 4)})
    if layout is Layout.RAW:
        arrays = {} if empty and T == 0 else {"keys": _floats(rng, (B, H, T, D), dtype, special=True),
                                              "values": _floats(rng, (B, H, T, D), dtype)}
        if seed % 2 == 0:
            return LayerRecord(layout, T, arrays, {"class": "KVCache"})
        calibration = {"query_power": _floats(rng, (H, D), mx.float32)} if T else {}
        state = {"stored": 0, **({"query_rows": min(T, 256)} if T else {})}
        return LayerRecord(layout, T, arrays, _turbo_config("turbo", "turbo", dtype), state, calibration)
    kf, vf = _FORMATS[layout]
    stored = T if seed % 3 else T // 256 * 256
    arrays = {**_side(rng, "keys", kf, stored, dtype), **_side(rng, "values", vf, stored, dtype)} if stored else {}
    if T > stored:
        arrays.update({"tail_keys": _floats(rng, (B, H, T - stored, D), dtype, special=True),
                       "tail_values": _floats(rng, (B, H, T - stored, D), dtype)})
    calibration = {}
    if layout is Layout.CALIBRATED or (layout is Layout.AFFINEK_TURBO and seed % 2):
        calibration = {"scale": _floats(rng, (H, D), mx.float32), "rotated_scale": _floats(rng, (H, D), mx.float32)}
        if stored:
            arrays["keys_shift"] = _floats(rng, (1, H, -(-stored // 256), D), mx.float32)
    record = LayerRecord(layout, T, arrays, _turbo_config(kf, vf, dtype), {"stored": stored}, calibration)
    check_record_arrays(record)
    return record


def _quantized(rng, T, dtype, seed):
    arrays = {**_side(rng, "keys", "affine", T, dtype), **_side(rng, "values", "affine", T, dtype)} if T else {}
    return LayerRecord(Layout.QUANTIZED, T, arrays, {"class": "QuantizedKVCache", "group_size": 64, "bits": 8})


def _chunked(rng, T, dtype, seed):
    S = min(T, WINDOW)
    arrays = {} if T == 0 else {"keys": _floats(rng, (B, H, S, D), dtype, True), "values": _floats(rng, (B, H, S, D), dtype)}
    return LayerRecord(Layout.CHUNKED, T, arrays, {"class": "ChunkedKVCache", "chunk_size": WINDOW},
                       {"start_position": T - S})


def _state(rng, T, dtype, seed, boundaries=True):
    """A conv state [B, 3, C] and a recurrent state [B, H, D, D], with checkpoints at every block
    end when `boundaries` (even seeds), so that the layer goes in the blocks."""
    ends = [t for t in range(BLOCK_SIZE, T, BLOCK_SIZE)] if boundaries and seed % 2 == 0 else []
    arrays = {}
    for suffix in [f"@{t}" for t in ends] + [""] if T else []:
        arrays.update({f"state0{suffix}": _floats(rng, (B, 3, 2 * D), dtype, True),
                       f"state1{suffix}": _floats(rng, (B, H, D, D), mx.float32)})
    return LayerRecord(Layout.STATE, T, arrays, {"class": "ArraysCache", "size": 2})


def _list(rng, T, dtype, seed):
    """A CacheList of a KVCache and a nested CacheList (a recurrent state and a ring buffer)."""
    inner = join_children([_state(rng, T, dtype, seed, boundaries=False), make_layer(Layout.ROTATING, T, dtype, seed)],
                          {"class": "CacheList"})
    return join_children([make_layer(Layout.RAW, T, dtype, 0), inner], {"class": "CacheList"})


def _fields(rng, T, dtype, seed):
    arrays = {} if T == 0 else {"window": _floats(rng, (B, min(T, WINDOW), D), dtype, True),
                                "compress_kv": _floats(rng, (B, T // 4, D), dtype)}
    return LayerRecord(Layout.FIELDS, T, arrays, {"class": "mlx_lm.models.deepseek_v41:LayerCache"},
                       {"window_size": WINDOW, "offset": T, "index_k": None})


_NATIVE_MAKERS = {Layout.QUANTIZED: _quantized, Layout.CHUNKED: _chunked, Layout.STATE: _state, Layout.LIST: _list,
                  Layout.FIELDS: _fields}


def make_snapshot(T: int, dtype=mx.float16, layouts=HETEROGENEOUS, seed: int = 0, empty: bool = False) -> Snapshot:
    """A snapshot with one layer per entry of `layouts`, T tokens, random arrays."""
    layers = [make_layer(layout, T, dtype, seed + i, empty) for i, layout in enumerate(layouts)]
    return Snapshot(layers=layers, codecs=_codecs())


def assert_same_array(a: mx.array, b: mx.array, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    assert np.array_equal(tensor_bytes(a), tensor_bytes(b)), f"{what}: bytes differ"


def assert_same_snapshot(a: Snapshot, b: Snapshot) -> None:
    """Every tensor byte-identical (NaN payloads included) and every metadata field equal."""
    assert len(a.layers) == len(b.layers)
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        assert (x.layout, x.offset, dict(x.config), dict(x.state)) == (y.layout, y.offset, dict(y.config),
                                                                        dict(y.state)), f"layer {i}"
        assert set(x.arrays) == set(y.arrays) and set(x.calibration) == set(y.calibration), f"layer {i}"
        for n in x.arrays:
            assert_same_array(x.arrays[n], y.arrays[n], f"layer {i} {n}")
        for n in x.calibration:
            assert_same_array(x.calibration[n], y.calibration[n], f"layer {i} calibration {n}")
    assert set(a.codecs) == set(b.codecs)
    for name, c in a.codecs.items():
        d = b.codecs[name]
        assert (c.rotation_kind, c.norm_mode, set(c.arrays)) == (d.rotation_kind, d.norm_mode, set(d.arrays))
        for n in c.arrays:
            assert_same_array(c.arrays[n], d.arrays[n], f"codec {name} {n}")


# -- keys ------------------------------------------------------------------------------------

M, C, K = bytes(range(32)), bytes(range(32, 64)), bytes(range(64, 96))


def _reference_keys(tokens, model, codec, calibration, size):
    """The key rule spelled out with hashlib and struct, independently of tqstore."""
    keys, parent = [], bytes(32)
    for start in range(0, len(tokens), size):
        chunk = tokens[start:start + size]
        extra = calibration if start and calibration else b""
        body = parent + model + codec + extra + struct.pack(f"<{len(chunk)}I", *chunk) + struct.pack("<I", len(chunk))
        parent = hashlib.sha256(body).digest()
        keys.append(parent.hex())
    return keys


def test_keys_follow_the_documented_byte_layout():
    tokens = list(range(600))
    assert [k.hex for k in block_keys(tokens, M, C, K)] == _reference_keys(tokens, M, C, K, 256)
    assert [k.hex for k in block_keys(tokens, M, C)] == _reference_keys(tokens, M, C, None, 256)
    assert [k.hex for k in block_keys(tokens, M, C, K, block_size=100)] == _reference_keys(tokens, M, C, K, 100)
    assert block_keys([], M, C) == []
    # The first block never hashes calibration, later ones do.
    assert block_keys(tokens, M, C, K)[0] == block_keys(tokens, M, C)[0]
    assert block_keys(tokens, M, C, K)[1] != block_keys(tokens, M, C)[1]


def test_keys_take_any_integer_sequence_alike():
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, 2**32, 700)]
    here = block_keys(tokens, M, C, K)
    assert block_keys(tuple(tokens), M, C, K) == here
    assert block_keys(np.array(tokens, dtype=np.uint32), M, C, K) == here
    assert block_keys([np.int64(t) for t in tokens], M, C, K) == here


def test_keys_are_identical_in_another_process():
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 2**32, 700)]
    here = [k.hex for k in block_keys(tokens, M, C, K)]
    code = ("import sys; from tqstore.format.blocks import block_keys; "
            f"print(' '.join(k.hex for k in block_keys({tokens!r}, {M!r}, {C!r}, {K!r})))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert out.stdout.split() == here


def test_keys_change_with_every_input():
    tokens = list(range(700))
    base = block_keys(tokens, M, C, K)
    flip = lambda d: bytes([d[0] ^ 1]) + d[1:]  # noqa: E731
    for keys in (block_keys(tokens, flip(M), C, K), block_keys(tokens, M, flip(C), K)):
        assert not set(keys) & set(base)
    changed_cal = block_keys(tokens, M, C, flip(K))
    assert changed_cal[0] == base[0] and not set(changed_cal[1:]) & set(base)
    for pos in (0, 255, 256, 699):
        other = list(tokens)
        other[pos] += 1
        keys = block_keys(other, M, C, K)
        b = pos // BLOCK_SIZE
        assert keys[:b] == base[:b] and all(x != y for x, y in zip(keys[b:], base[b:]))
    shorter = block_keys(tokens[:-1], M, C, K)
    assert shorter[:-1] == base[:-1] and shorter[-1] != base[-1]
    assert block_keys(tokens + [0], M, C, K)[-1] not in base


def test_key_inputs_are_validated():
    with pytest.raises(ValueError, match="u32"):
        block_keys([2**32], M, C)
    with pytest.raises(ValueError, match="u32"):
        block_keys([-1], M, C)
    with pytest.raises(ValueError, match="token id 1180591620717411303424 does not fit in u32"):
        block_keys([5, 2**70], M, C)
    with pytest.raises(ValueError, match="token id 4294967301 does not fit"):
        block_keys(np.array([1, 2**32 + 5, -3]), M, C)
    with pytest.raises(ValueError, match="32 raw bytes"):
        block_keys([1], M.hex().encode(), C)
    with pytest.raises(ValueError):
        BlockKey(b"short")
    assert BlockKey.from_hex(block_keys([1], M, C)[0].hex) == block_keys([1], M, C)[0]


def test_spans():
    assert block_spans(0) == []
    assert block_spans(1) == [(0, 1)]
    assert block_spans(256) == [(0, 256)]
    assert block_spans(257) == [(0, 256), (256, 257)]
    assert block_spans(1000)[-1] == (768, 1000)


def test_calibration_digest_covers_only_calibration():
    snap = make_snapshot(40)
    digest = calibration_digest(snap)
    assert digest is not None and len(digest) == 32
    assert calibration_digest(make_snapshot(40, layouts=[Layout.RAW, Layout.TURBO])) is None
    other = make_snapshot(40, seed=0)
    assert calibration_digest(other) == digest  # same seed, same arrays
    layers = list(snap.layers)
    cal = dict(layers[1].calibration)
    cal["scale"] = cal["scale"] + 1
    layers[1] = LayerRecord(layers[1].layout, layers[1].offset, layers[1].arrays, layers[1].config, {}, cal)
    assert calibration_digest(Snapshot(layers, snap.codecs)) != digest


# -- split / join ----------------------------------------------------------------------------


@pytest.mark.parametrize("T", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_split_join_heterogeneous(T, dtype):
    snap = make_snapshot(T, dtype)
    split = split_snapshot(snap)
    assert len(split.blocks) == len(block_spans(T))
    assert all(blk.n_tokens == min(256, T - blk.start) for blk in split.blocks)
    assert all(not r.calibration for blk in split.blocks[1:] for r in blk.layers.values())
    assert 3 not in (split.blocks[0].layers if split.blocks else {})  # the rotating layer lives in the window
    assert_same_snapshot(join_blocks(split), snap)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("T", TOKEN_COUNTS)
def test_split_join_every_layout(layout, T):
    snap = make_snapshot(T, mx.bfloat16, layouts=[layout, layout])
    assert_same_snapshot(join_blocks(split_snapshot(snap)), snap)


def test_empty_layers_without_arrays_round_trip():
    snap = make_snapshot(0, empty=True)
    assert all(not r.arrays for r in snap.layers)
    assert_same_snapshot(join_blocks(split_snapshot(snap)), snap)


def _first_tokens(r: LayerRecord, n: int) -> dict:
    """The arrays holding tokens [0, n) of a layer, written out per array kind."""
    if "stored" not in r.state or r.layout is Layout.RAW:
        return {name: a[:, :, :n] for name, a in r.arrays.items()}
    stored = min(int(r.state["stored"]), n)
    out = {}
    for name, a in r.arrays.items():
        if name == "keys_shift":
            out[name] = a[:, :, :-(-stored // 256)]
        elif name.startswith("tail_"):
            if n > r.state["stored"]:
                out[name] = a[:, :, :n - r.state["stored"]]
        elif stored:
            out[name] = a[:, :, :stored]
    return out


def test_prefix_join_equals_the_first_tokens():
    snap = make_snapshot(600, layouts=[Layout.CALIBRATED, Layout.RAW, Layout.AFFINEK_TURBO, Layout.CALIBRATED,
                                       Layout.TURBO, Layout.RAW])
    assert {r.state.get("stored") for r in snap.layers} >= {512, 600}  # a layer with a raw tail
    split = split_snapshot(snap)
    for k in (0, 1, 2, 3):
        prefix = join_blocks(split, k)
        n = min(600, 256 * k)
        assert prefix.offset == n
        for r, p in zip(snap.layers, prefix.layers):
            assert p.offset == n
            want = _first_tokens(r, n)
            assert set(p.arrays) == set(want) or n == 0
            for name, a in want.items():
                if n:
                    assert_same_array(a, p.arrays[name], name)
            if "stored" in r.state and r.layout is not Layout.RAW:
                assert p.state["stored"] == min(r.state["stored"], n)
            assert set(p.calibration) == (set(r.calibration) if k else set())


def test_per_block_rows_need_whole_storage_blocks():
    snap = make_snapshot(600, layouts=[Layout.CALIBRATED])
    with pytest.raises(ValueError, match="multiple of 256"):
        split_snapshot(snap, block_size=100)
    split = split_snapshot(snap, block_size=512)
    assert [blk.layers[0].arrays["keys_shift"].shape[2] for blk in split.blocks] == [2, 0]  # the last 88 tokens are raw
    assert_same_snapshot(join_blocks(split), snap)
    assert_same_snapshot(join_blocks(split_snapshot(make_snapshot(600, layouts=[Layout.TURBO]), block_size=100)),
                         make_snapshot(600, layouts=[Layout.TURBO]))


def test_prefix_of_a_rotating_entry_is_refused():
    split = split_snapshot(make_snapshot(600))
    with pytest.raises(ValueError, match="cannot be cut"):
        join_blocks(split, 1)
    assert join_blocks(split).offset == 600


def test_split_refuses_layers_with_different_token_counts():
    snap = make_snapshot(10, layouts=[Layout.RAW])
    snap = Snapshot(snap.layers + [make_layer(Layout.TURBO, 9)], snap.codecs)
    with pytest.raises(ValueError, match="layer 1 holds 9 tokens"):
        split_snapshot(snap)


def test_join_refuses_blocks_of_different_saves():
    a = split_snapshot(make_snapshot(300, layouts=[Layout.TURBO]))
    b = split_snapshot(make_snapshot(300, layouts=[Layout.RAW]))
    mixed = type(a)([a.blocks[0], b.blocks[1]], a.window, a.shared)
    with pytest.raises(ValueError, match="another config"):
        join_blocks(mixed)
    with pytest.raises(ValueError, match="out of order"):
        join_blocks(type(a)([a.blocks[1], a.blocks[0]], a.window, a.shared))


def test_prefix_of_checkpointed_recurrent_states():
    snap = make_snapshot(600, layouts=[Layout.STATE, Layout.RAW])
    split = split_snapshot(snap)
    assert split.reusable_as_prefix and 0 in split.blocks[1].layers
    prefix = join_blocks(split, 2)
    state = prefix.layers[0]
    assert state.offset == 512 and sorted(state.arrays) == ["state0", "state0@256", "state1", "state1@256"]
    for j in (0, 1):
        assert_same_array(state.arrays[f"state{j}"], snap.layers[0].arrays[f"state{j}@512"])
        assert_same_array(state.arrays[f"state{j}@256"], snap.layers[0].arrays[f"state{j}@256"])


def test_recurrent_states_without_checkpoints_stay_whole():
    snap = make_snapshot(600, layouts=[Layout.RAW, Layout.STATE], seed=0)  # the state layer gets seed 1
    split = split_snapshot(snap)
    assert not split.reusable_as_prefix and 1 not in split.blocks[0].layers
    assert_same_snapshot(join_blocks(split), snap)
    with pytest.raises(ValueError, match="cannot be cut"):
        join_blocks(split, 1)


@pytest.mark.parametrize("layout", [Layout.TURBO, Layout.AFFINEK_TURBO])
def test_a_layer_that_claims_fewer_tokens_than_it_holds_compressed_is_refused(layout):
    """A record whose offset is below its compressed row count (`stored`) describes no cache: the
    header checks (format 2 and 3 alike, through check_record_arrays) must refuse it."""
    record = make_layer(layout, 512, seed=0)
    assert int(record.state["stored"]) == 512 and record.offset == 512
    check_record_arrays(record)
    for offset in (0, 100, 511):
        with pytest.raises(ValueError, match="compressed"):
            check_record_arrays(dataclasses.replace(record, offset=offset))
    with pytest.raises(ValueError, match="compressed"):
        check_record_arrays(dataclasses.replace(record, state={**record.state, "stored": -1}))


def through_format(split, tokens: list[int]):
    """The split as a restore reads it back: every block and the window written and read."""
    keys = block_keys(tokens, M, C)
    stored = [F.loads(F.dumps(blk, F.Provenance(M, C, None, tuple(tokens[blk.start:blk.start + blk.n_tokens]),
                                                parent=keys[blk.index - 1] if blk.index else None)),
                      expect=F.Expect("block", M, C, tokens[blk.start:blk.start + blk.n_tokens], keys[blk.index]))
              for blk in split.blocks]
    window = F.loads(F.dumps(split.window, F.Provenance(M, C, key=keys[-1])), expect=F.Expect("window", M, C, key=keys[-1]))
    return type(split)(stored, window, split.shared)


def _member_list(T: int, *, marked: bool = True, checkpoints: bool = True, rows: bool = True) -> LayerRecord:
    """A CacheList as the engine records it by token (`marked`): a KVCache's rows next to a
    nested list of a recurrent state (with a checkpoint at every block end when `checkpoints`)
    and a sliding window (every token's row when `rows`, else its ring buffer)."""
    rng = np.random.default_rng(7)
    config = {"class": "CacheList", **({"rows": "token"} if marked else {})}
    window = LayerRecord(Layout.RAW, T, {"keys": _floats(rng, (B, H, T, D), mx.float16, True),
                                         "values": _floats(rng, (B, H, T, D), mx.float16)},
                         {"class": "RotatingKVCache", "max_size": WINDOW, "keep": 0, "rows": "token"}) if rows \
        else make_layer(Layout.ROTATING, T, mx.float16, 3)
    inner = join_children([_state(rng, T, mx.float16, 0, boundaries=checkpoints), window], config)
    return join_children([make_layer(Layout.RAW, T, mx.float16, 0), inner], config)


def test_a_list_kept_by_member_restores_any_prefix():
    """A CacheList marked `rows` "token" goes into the blocks member by member (issue 29): rows by
    their tokens, recurrent states at each block's end; a prefix of k blocks joins (in memory and
    through the format) into the list holding the first k x 256 tokens."""
    snap = Snapshot([_member_list(600), make_layer(Layout.TURBO, 600, seed=4)], _codecs())
    split = split_snapshot(snap)
    assert split.reusable_as_prefix and all(0 in blk.layers for blk in split.blocks)
    read = through_format(split, list(range(600)))
    assert_same_snapshot(join_blocks(read), snap)
    for k in (1, 2):
        n = 256 * k
        for joined in (join_blocks(split, k), join_blocks(read, k)):
            assert joined.offset == n
            for (path, got), (_, full) in zip(leaf_records(joined.layers[:1]), leaf_records(snap.layers[:1])):
                assert got.offset == n, path
                want = {**state_at(full, n), **{f"{name}@256": a for name, a in state_at(full, 256).items() if k == 2}} \
                    if full.layout is Layout.STATE else {name: a[:, :, :n] for name, a in full.arrays.items()}
                assert set(got.arrays) == set(want), path
                for name, a in want.items():
                    assert_same_array(a, got.arrays[name], f"{path} {name}")
        assert [c.layout for c in split_children(joined.layers[0])] == [Layout.RAW, Layout.LIST]


@pytest.mark.parametrize("why", ["unmarked", "ring buffer", "no checkpoints"])
def test_a_list_with_a_member_that_cannot_be_cut_stays_whole(why):
    """An unmarked list (entries saved before lists were cut, and windows="whole"), a ring buffer
    member, or a recurrent member without its block-end states keeps the list whole in the window."""
    record = _member_list(600, marked=why != "unmarked", rows=why != "ring buffer", checkpoints=why != "no checkpoints")
    snap = Snapshot([record, make_layer(Layout.RAW, 600)], _codecs())
    split = split_snapshot(snap)
    assert not split.reusable_as_prefix and all(0 not in blk.layers for blk in split.blocks)
    assert_same_snapshot(join_blocks(split), snap)
    with pytest.raises(ValueError, match="cannot be cut"):
        join_blocks(split, 1)


def test_a_block_refuses_a_list_member_that_is_not_cut_to_its_tokens():
    """The block header checks each member of a list: a member with another token count, or a
    recurrent state with earlier checkpoints, is not a block's part."""
    split = split_snapshot(Snapshot([_member_list(300)], _codecs()))
    part = split.blocks[0].layers[0]
    kv, inner = split_children(part)
    state, window = split_children(inner)
    bad_state = dataclasses.replace(state, arrays={**state.arrays, **{f"{n}@100": a for n, a in state.arrays.items()}})
    for members in ([make_layer(Layout.RAW, 255), inner], [kv, join_children([bad_state, window], {"class": "CacheList",
                                                                                                  "rows": "token"})]):
        layer = join_children(members, {"class": "CacheList", "rows": "token"})
        block = dataclasses.replace(split.blocks[0], layers={0: dataclasses.replace(layer, offset=256)})
        # The writer reads its header back, so the header's check refuses it as it is written.
        with pytest.raises(ValueError, match="layer 0 is list with 256 tokens; a block holds per-token layers"):
            F.dumps(block, F.Provenance(M, C, None, tuple(range(256))))


def _block_fields(T: int, *, checkpoints: bool = True) -> LayerRecord:
    """deepseek_v41's LayerCache as the engine records it by block: compressed groups of 3 tokens
    (grown: a prefix at every block end), no index keys, the window and the open group's rows at
    the end and (with `checkpoints`) at every earlier block end."""
    rng = np.random.default_rng(11)
    arrays = {"compress_kv": _floats(rng, (B, T // 3, D), mx.float16, True)}
    state: dict = {"window_size": WINDOW, "offset": T, "index_k": None}
    for t in [*(range(BLOCK_SIZE, T, BLOCK_SIZE) if checkpoints else ()), T]:
        suffix = "" if t == T else f"@{t}"
        arrays.update({f"window{suffix}": _floats(rng, (B, min(t, WINDOW), D), mx.float16),
                       f"pending_kv{suffix}": _floats(rng, (B, t % 3, D), mx.float32),
                       f"pending_gate{suffix}": _floats(rng, (B, t % 3, D), mx.float32)})
        if suffix:
            state.update({f"compress_kv{suffix}": t // 3, f"index_k{suffix}": 0})
    return LayerRecord(Layout.FIELDS, T, arrays, {"class": "mlx_lm.models.deepseek_v41:LayerCache", "rows": "token"},
                       state)


def test_a_model_cache_class_kept_by_block_restores_any_prefix():
    """A FIELD_PLANS class (deepseek_v41's LayerCache) marked `rows` "token" goes into the blocks:
    each block the rows its grown fields added, its other fields as at its end; a prefix of k
    blocks joins (in memory and through the format) into the record at k x 256 tokens."""
    snap = Snapshot([_block_fields(600), make_layer(Layout.RAW, 600)], _codecs())
    split = split_snapshot(snap)
    assert split.reusable_as_prefix and all(0 in blk.layers for blk in split.blocks)
    read = through_format(split, list(range(600)))
    assert_same_snapshot(join_blocks(read), snap)
    full = snap.layers[0]
    for k in (1, 2):
        n = 256 * k
        for joined in (join_blocks(split, k), join_blocks(read, k)):
            got = joined.layers[0]
            assert got.offset == n and got.state["offset"] == n and got.state["index_k"] is None
            assert_same_array(full.arrays["compress_kv"][:, :n // 3], got.arrays["compress_kv"], "compress_kv")
            for name in ("window", "pending_kv", "pending_gate"):
                assert_same_array(full.arrays[f"{name}@{n}"], got.arrays[name], name)
            assert got.state.get("compress_kv@256") == (85 if k == 2 else None)


def test_a_model_cache_class_without_its_block_ends_stays_whole():
    """Without its fields at every block end (or unmarked: entries saved before, and
    windows="whole") a model's own cache class stays whole in the window."""
    for record in (_block_fields(600, checkpoints=False),
                   dataclasses.replace(_block_fields(600), config={"class": "mlx_lm.models.deepseek_v41:LayerCache"})):
        split = split_snapshot(Snapshot([record, make_layer(Layout.RAW, 600)], _codecs()))
        assert not split.reusable_as_prefix and all(0 not in blk.layers for blk in split.blocks)
        with pytest.raises(ValueError, match="cannot be cut"):
            join_blocks(split, 1)
