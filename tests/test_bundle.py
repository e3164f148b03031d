"""Single-file bundles and atomic file writes (tqstore.exchange.bundle)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tqstore.exchange import bundle
from tqstore.exchange.bundle import parse_bundle, read_bundle, write_bundle
from tqstore.durable import write_file_atomic
from tqstore.errors import (BadMagic, ChecksumMismatch, DiskFull, FormatVersionTooNew, MalformedHeader,
                            TqstoreError, TruncatedData)

MANIFEST = json.dumps({"name": "project-x", "tokens": [1, 2, 3]}).encode()
OBJECTS = {hashlib.sha256(bytes([i])).digest(): os.urandom(100 * i) for i in range(5)}


def test_round_trip(tmp_path):
    path = tmp_path / "entry.tqb"
    write_bundle(path, MANIFEST, OBJECTS)
    manifest, objects = read_bundle(path)
    assert manifest == MANIFEST and objects == OBJECTS
    assert os.listdir(tmp_path) == ["entry.tqb"]  # no temporary file left behind
    write_bundle(path, b"", {})
    assert read_bundle(path) == (b"", {})


def test_the_layout_is_as_documented(tmp_path):
    path = tmp_path / "entry.tqb"
    write_bundle(path, MANIFEST, OBJECTS)
    data = path.read_bytes()
    magic, version, reserved, toc_len, body_len, digest = struct.unpack_from("<8sIIQQ32s", data)
    assert (magic, version, reserved) == (b"\x89TQB\r\n\x1a\n", 1, 0)
    assert body_len == len(data) - 64 and digest == hashlib.sha256(data[64:]).digest()
    toc = json.loads(data[64:64 + toc_len])
    blob = data[64 + toc_len:]
    m = toc["manifest"]
    assert blob[m["offset"]:m["offset"] + m["length"]] == MANIFEST
    assert [bytes.fromhex(o["key"]) for o in toc["objects"]] == sorted(OBJECTS)
    for o in toc["objects"]:
        piece = blob[o["offset"]:o["offset"] + o["length"]]
        assert piece == OBJECTS[bytes.fromhex(o["key"])] and hashlib.sha256(piece).hexdigest() == o["sha256"]


def test_errors(tmp_path):
    path = tmp_path / "entry.tqb"
    write_bundle(path, MANIFEST, OBJECTS)
    data = path.read_bytes()
    with pytest.raises(BadMagic):
        parse_bundle(b"\0" * 100)
    with pytest.raises(TruncatedData):
        parse_bundle(data[:-1])
    with pytest.raises(TruncatedData):
        parse_bundle(data[:30])
    with pytest.raises(ChecksumMismatch):
        parse_bundle(data[:-1] + bytes([data[-1] ^ 1]))
    newer = bytearray(data)
    newer[8] = 2
    with pytest.raises(FormatVersionTooNew, match="upgrade tqstore"):
        parse_bundle(bytes(newer))
    # A writer bug behind a valid frame: a piece whose digest does not match its TOC entry.
    toc_len = struct.unpack_from("<Q", data, 16)[0]
    body = bytearray(data[64:])
    body[toc_len + len(MANIFEST) + 5] ^= 1
    with pytest.raises(ChecksumMismatch, match="corrupt"):
        parse_bundle(_reframe(data, bytes(body)))
    with pytest.raises(MalformedHeader):
        parse_bundle(_reframe(data, b"[]" + bytes(body[2:]), toc_len))
    with pytest.raises(ValueError):
        write_bundle(path, MANIFEST, {b"": b"x"})


def _reframe(data: bytes, body: bytes, toc_len: int | None = None) -> bytes:
    magic, version, reserved, old_toc, _, _ = struct.unpack_from("<8sIIQQ32s", data)
    return struct.pack("<8sIIQQ32s", magic, version, reserved, old_toc if toc_len is None else toc_len, len(body),
                       hashlib.sha256(body).digest()) + body


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "file"
    write_file_atomic(path, b"old")

    def failing():
        yield b"new"
        raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        write_file_atomic(path, failing())
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["file"]


def test_an_error_names_the_path_asked_for_not_the_temporary_file(tmp_path):
    # `export a /nonexist/dir/x.tqb` said "no such file or folder: /nonexist/dir/.x.tqb.3fa9...tmp".
    target = tmp_path / "missing" / "x.tqb"
    with pytest.raises(FileNotFoundError) as caught:
        write_file_atomic(target, b"data")
    assert caught.value.filename == str(target)


def test_a_full_disk_is_reported(tmp_path, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bundle.os, "fsync", full)
    with pytest.raises(DiskFull, match="no space left"):
        write_file_atomic(tmp_path / "file", b"data")
    assert os.listdir(tmp_path) == []


@functools.lru_cache(maxsize=None)
def valid_bundle() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        write_bundle(Path(d) / "entry.tqb", MANIFEST, OBJECTS)
        return (Path(d) / "entry.tqb").read_bytes()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_damaged_bundles_raise_tqstore_errors(data):
    blob = valid_bundle()
    choice = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
    if choice == "flip":
        mutated = bytearray(blob)
        mutated[data.draw(st.integers(0, len(blob) - 1))] ^= data.draw(st.integers(1, 255))
        mutated = bytes(mutated)
    elif choice == "truncate":
        mutated = blob[:data.draw(st.integers(0, len(blob) - 1))]
    else:
        at = data.draw(st.integers(0, len(blob)))
        mutated = blob[:at] + data.draw(st.binary(min_size=1, max_size=8)) + blob[at:]
    try:
        result = parse_bundle(mutated)
    except TqstoreError:
        return
    assert result == (MANIFEST, OBJECTS)
