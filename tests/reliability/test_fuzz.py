"""The format reader (tqstore.format.objects.loads / inspect) and the manifest parser (Manifest.from_bytes)
under hypothesis, for a fixed budget of examples.

Inputs: random bytes; valid objects and manifests with random byte edits (for objects also
re-framed, so that the edits reach the parser behind the frame's digest); and valid headers
and manifests edited as JSON (a member replaced by any JSON value, removed, or added), then
written back validly, so that every semantic check is reached. The contract: a whole object
(or manifest), or one of tqstore's error types; never another exception. A parsed manifest
also writes back to the same bytes' meaning (round trip).

Short version: derandomized (the same examples in every CI run). Long version: random, with
--trials x 10 examples per target (default 2000).
"""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_blocks import make_snapshot
from tqstore.format import objects as F
from tqstore.format.blocks import split_snapshot
from tqstore.errors import FormatError, IdentityMismatch, TokenMismatch
from tqstore.models.identity import CodecIdentity, ModelIdentity
from tqstore.format.manifest import Manifest, ObjectRef, seal
from turboquant.records import Layout

EXPECTED = (FormatError, IdentityMismatch, TokenMismatch)
MODEL = ModelIdentity("weights-a", {"num_hidden_layers": 2}, None, None, None, "float16", "synthetic")
CODEC = CodecIdentity("turbo4", (), {})


def _objects(version: int) -> list[bytes]:
    snap = make_snapshot(300, layouts=[Layout.RAW, Layout.CALIBRATED, Layout.ROTATING, Layout.AFFINE])
    split = split_snapshot(snap)
    tokens = list(range(300))
    md, cd = MODEL.digest, CODEC.digest
    from tqstore.format.blocks import block_keys, calibration_digest

    cal = calibration_digest(snap)
    keys = block_keys(tokens, md, cd, cal)
    out = [F.dumps(snap, version=version), F.dumps(split.shared, version=version),
           F.dumps(split.window, F.Provenance(md, cd, cal, key=keys[-1]), version=version)]
    for b in split.blocks:
        prov = F.Provenance(md, cd, cal, tuple(tokens[b.start:b.start + b.n_tokens]), None,
                            keys[b.index - 1] if b.index else None)
        out.append(F.dumps(b, prov, version=version))
    return out


OBJECTS_V2 = _objects(2)  # format 2 (JSON headers), still read
OBJECTS = _objects(F.OBJECT_VERSION) + OBJECTS_V2
MANIFEST = Manifest(
    name="fuzz", model_identity=MODEL, model_digest=MODEL.digest, codec_digest=CODEC.digest, scheme="turbo4",
    tokens=tuple(range(300)), block_size=256,
    blocks=tuple(ObjectRef(k.raw, "ab" * 32, 10) for k in __import__("tqstore.format.blocks", fromlist=["x"]).block_keys(
        list(range(300)), MODEL.digest, CODEC.digest)),
    shared=ObjectRef(bytes(32), "cd" * 32, 5), window=ObjectRef(b"\0" * 32, "ef" * 32, 7), calibration=None,
    sliding=False, created=1.0, prefill_seconds=0.5, model_ref="m")
MANIFEST = MANIFEST.replace(window=ObjectRef(__import__("tqstore.format.manifest", fromlist=["x"]).window_key(
    MANIFEST.keys[-1], MODEL.digest, CODEC.digest), "ef" * 32, 7))
MANIFEST_BYTES = MANIFEST.to_bytes()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12) | st.sampled_from(["ab" * 32, "raw", "zstd", "float16", "uint32", "block", "window"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
edits = st.lists(st.tuples(st.sampled_from(["flip", "zero", "cut", "insert", "delete"]), st.integers(0, 1 << 30),
                           st.binary(min_size=1, max_size=8)), min_size=1, max_size=4)


def edit(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op, where, extra in ops:
        if not b:
            break
        i = where % len(b)
        if op == "flip":
            b[i] ^= extra[0] or 1
        elif op == "zero":
            b[i:i + len(extra)] = bytes(len(b[i:i + len(extra)]))
        elif op == "cut":
            del b[i:]
        elif op == "insert":
            b[i:i] = extra
        else:
            del b[i:i + len(extra)]
    return bytes(b)


def reframe(data: bytes) -> bytes:
    """The frame's payload length and digest recomputed (format 3: the digest of the header;
    formats 1 and 2: of the payload), so that edits reach the checks behind the frame."""
    if len(data) < F.FRAME_SIZE:
        return data
    body = data[F.FRAME_SIZE:]
    version, n = struct.unpack_from("<I", data, 8)[0], struct.unpack_from("<Q", data, 16)[0]
    covered = body[:n] if version == 3 else body
    return data[:24] + struct.pack("<Q", len(body)) + hashlib.sha256(covered).digest() + body


def rewrite_header(data: bytes, change) -> bytes:
    """`data` with its tqstore JSON header changed by `change(doc)`, written back validly: the
    safetensors header and the frame describe the new header and the same tensors."""
    (n,) = struct.unpack_from("<Q", data, F.FRAME_SIZE)
    st_header = json.loads(data[F.FRAME_SIZE + 8:F.FRAME_SIZE + 8 + n])
    doc = json.loads(st_header["__metadata__"]["tqstore"])
    st_header["__metadata__"]["tqstore"] = json.dumps(change(doc))
    raw = json.dumps(st_header).encode()
    raw += b" " * (-len(raw) % 8)
    payload = struct.pack("<Q", len(raw)) + raw + data[F.FRAME_SIZE + 8 + n:]
    version = struct.unpack_from("<I", data, 8)[0]  # the object's own format version
    return F.MAGIC + struct.pack("<IIQQ", version, 0, len(raw), len(payload)) + hashlib.sha256(payload).digest() + payload


def json_edit(doc, path: list[int], value, mode: str):
    """Replace, remove or add a member somewhere in `doc`, the place chosen by `path`."""
    node = doc
    for step in path:
        kids = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) if isinstance(node, list) else []
        if not kids or step % 3 == 0:
            break
        key, child = kids[step % len(kids)]
        if not isinstance(child, (dict, list)) or not child:
            break
        node = child
    if isinstance(node, dict) and node:
        key = list(node)[path[-1] % len(node)] if path else next(iter(node))
        if mode == "remove":
            del node[key]
        elif mode == "add":
            node[f"x{len(node)}"] = value
        else:
            node[key] = value
    elif isinstance(node, list) and node:
        index = path[-1] % len(node) if path else 0
        if mode == "remove":
            del node[index]
        else:
            node[index] = value
    return doc


def check_reader(data: bytes) -> str:
    try:
        F.inspect(data)
    except EXPECTED as exc:
        outcome = type(exc).__name__
    else:
        outcome = "header read"
    try:
        F.loads(data, expect=F.Expect())
    except EXPECTED as exc:
        return type(exc).__name__
    return "loaded" if outcome == "header read" else f"loaded after inspect said {outcome}"


def resealed(doc) -> bytes:
    """An edited manifest document with its digest recomputed, so edits reach every other check."""
    return seal(doc) if isinstance(doc, dict) else json.dumps(doc).encode()


def check_manifest(data: bytes) -> str:
    try:
        m = Manifest.from_bytes(data)
    except FormatError as exc:
        return type(exc).__name__
    again = Manifest.from_bytes(m.to_bytes())
    assert again == m, "a parsed manifest does not round-trip"
    return "parsed"


def run(target, strategy, examples: int, derandomize: bool, ledger, label: str) -> None:
    outcomes: dict[str, int] = {}

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def fuzz(data):
        outcome = target(data)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    fuzz()
    assert not any(k.startswith("loaded after") for k in outcomes), outcomes
    for outcome, n in outcomes.items():
        ledger.count(label, outcome, n)


def targets():
    obj = st.sampled_from(OBJECTS)
    return {
        "format: random bytes": (check_reader, st.binary(max_size=300) | st.binary(max_size=200).map(
            lambda b: F.MAGIC + b)),
        "format: byte edits": (check_reader, st.tuples(obj, edits).map(lambda t: edit(*t))),
        "format: byte edits, re-framed": (check_reader, st.tuples(obj, edits).map(lambda t: reframe(edit(*t)))),
        "format: header JSON edits": (check_reader, st.tuples(
            st.sampled_from(OBJECTS_V2), st.lists(st.integers(0, 50), min_size=1, max_size=6), json_values,
            st.sampled_from(["replace", "remove", "add"])).map(
            lambda t: rewrite_header(t[0], lambda doc: json_edit(doc, t[1], t[2], t[3])))),
        "manifest: random bytes": (check_manifest, st.binary(max_size=400) | st.text(max_size=200).map(str.encode)),
        "manifest: byte edits": (check_manifest, edits.map(lambda ops: edit(MANIFEST_BYTES, ops))),
        "manifest: JSON edits": (check_manifest, st.tuples(
            st.lists(st.integers(0, 50), min_size=1, max_size=6), json_values,
            st.sampled_from(["replace", "remove", "add"])).map(
            lambda t: resealed(json_edit(json.loads(MANIFEST_BYTES), *t)))),
    }


@pytest.mark.parametrize("name", list(targets()))
def test_fuzz_short(name, ledger):
    target, strategy = targets()[name]
    run(target, strategy, 400, True, ledger, f"fuzz (short) {name}")


@pytest.mark.reliability_long
@pytest.mark.parametrize("name", list(targets()))
def test_fuzz_long(name, ledger, trials):
    target, strategy = targets()[name]
    run(target, strategy, 10 * (trials or 200), False, ledger, f"fuzz (long) {name}")


def test_the_unedited_inputs_are_valid():
    """The seeds the edits start from load, so edits measure the parser, not broken seeds."""
    assert all(check_reader(o) == "loaded" for o in OBJECTS)
    assert check_manifest(MANIFEST_BYTES) == "parsed"
    assert check_reader(rewrite_header(OBJECTS_V2[0], lambda doc: doc)) == "loaded"
    assert check_reader(reframe(OBJECTS[0])) == "loaded"
