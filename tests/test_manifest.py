"""Entry manifests (tqstore.format.manifest): round trips and strict parsing."""

from __future__ import annotations

import hashlib
import json

import pytest

from tqstore.format.blocks import block_keys
from tqstore.errors import FormatError, FormatVersionTooNew, MalformedHeader, UnsupportedFormatVersion
from tqstore.models.identity import ModelIdentity, describe_difference
from tqstore.canonical import canonical_json
from tqstore.format.manifest import Manifest, ObjectRef, seal, window_key

MODEL = ModelIdentity("w" * 64, {"num_hidden_layers": 2, "rope_scaling": {"type": "linear", "factor": 2.0},
                                 "layer_types": ["full", "sliding"]}, "t" * 64, None, None, "float16", "tiny")
CODEC = hashlib.sha256(b"codec").digest()
CAL = hashlib.sha256(b"calibration").digest()


def sha(i) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def make_manifest(n_tokens: int = 600, calibration: bytes | None = CAL, **changes) -> Manifest:
    tokens = tuple(range(7, 7 + n_tokens))
    keys = block_keys(tokens, MODEL.digest, CODEC, calibration)
    blocks = tuple(ObjectRef(k.raw, sha(i), 1000 + i) for i, k in enumerate(keys))
    window = ObjectRef(window_key(keys[-1] if keys else None, MODEL.digest, CODEC), sha("w"), 10)
    fields = dict(name="project-x", model_identity=MODEL, model_digest=MODEL.digest, codec_digest=CODEC,
                  scheme="turbo4", tokens=tokens, block_size=256, blocks=blocks,
                  shared=ObjectRef(bytes(range(32)), sha("s"), 20), window=window, calibration=calibration,
                  sliding=False, created=1.5e9, prefill_seconds=2.25, model_ref="./Qwen3", adapter_path="./lora",
                  pinned=True, expires=2e9, metadata={"file": "contract.txt"}, remote_etag='"e1"')
    return Manifest(**(fields | changes))


@pytest.mark.parametrize("n_tokens", [0, 1, 256, 600])
@pytest.mark.parametrize("calibration", [None, CAL])
def test_round_trip(n_tokens, calibration):
    m = make_manifest(n_tokens, calibration)
    data = m.to_bytes()
    back = Manifest.from_bytes(data)
    assert back == m and back.to_bytes() == data
    assert back.model_identity.digest == MODEL.digest and describe_difference(back.model_identity, MODEL) == []
    assert back.model_identity.source == "tiny" and back.adapter_path == "./lora"
    assert len(back.objects) == len(back.blocks) + 2 and back.nbytes == sum(r.size for r in back.objects)


def test_content_ignores_local_bookkeeping():
    m = make_manifest()
    other = m.replace(pinned=False, remote_etag=None, created=5.0, metadata={}, prefill_seconds=9.0)
    assert m.same_content(other) and not m.same_content(make_manifest(599))
    moved = m.with_digests({m.blocks[0].key: (sha("other"), 5)})
    assert moved.blocks[0] == ObjectRef(m.blocks[0].key, sha("other"), 5) and moved.blocks[1:] == m.blocks[1:]
    assert m.same_content(moved)


def test_expiry():
    m = make_manifest(expires=100.0, pinned=False)
    assert m.expired(100.0) and not m.expired(99.0) and not make_manifest(expires=None).expired(1e12)
    assert not m.replace(pinned=True).expired(1e12)  # pinned entries never expire
    assert m.full_blocks() == 2 and make_manifest(512).full_blocks() == 2


def _edit(fn) -> bytes:
    """The manifest edited by `fn`, its digest recomputed (so that each check is reached)."""
    doc = json.loads(make_manifest().to_bytes())
    fn(doc)
    return seal(doc)


BAD_EDITS = {
    "missing member": lambda d: d.pop("window"),
    "extra member": lambda d: d.update(extra=1),
    "bad name": lambda d: d.update(name="../x"),
    "tokens not u32": lambda d: d["tokens"].__setitem__(0, -1),
    "token bool": lambda d: d["tokens"].__setitem__(0, True),
    "token too big": lambda d: d["tokens"].__setitem__(599, 2**32),
    "token float": lambda d: d["tokens"].__setitem__(5, 7.0),
    "token string": lambda d: d["tokens"].__setitem__(5, "7"),
    "tokens not a list": lambda d: d.update(tokens="7"),
    "block size": lambda d: d.update(block_size=0),
    "short key": lambda d: d["blocks"][0].update(key="ab"),
    "upper-case hex": lambda d: d["shared"].update(sha256=d["shared"]["sha256"].upper()),
    "negative size": lambda d: d["blocks"][1].update(size=-1),
    "keys do not chain": lambda d: d["tokens"].__setitem__(300, 1),
    "block missing": lambda d: d["blocks"].pop(),
    "window key": lambda d: d["window"].update(key=sha("x")),
    "model digest": lambda d: d["model"].update(digest=sha("m")),
    "model field edited": lambda d: d["model"]["identity"].update(kv_dtype="bfloat16"),
    "model field missing": lambda d: d["model"]["identity"].pop("adapter"),
    "calibration": lambda d: d.update(calibration=sha("c")),
    "pinned not bool": lambda d: d.update(pinned=1),
    "metadata value": lambda d: d["metadata"].update(n=1),
    "negative time": lambda d: d.update(created=-1.0),
    "etag type": lambda d: d.update(remote_etag=5),
    "adapter path type": lambda d: d.update(adapter_path=7),
    "scheme empty": lambda d: d["codec"].update(scheme=""),
    "not a manifest": lambda d: d.update(format="something"),
    "version type": lambda d: d.update(version="1"),
}


@pytest.mark.parametrize("edit", sorted(BAD_EDITS))
def test_malformed_manifests_are_refused(edit):
    with pytest.raises(MalformedHeader):
        Manifest.from_bytes(_edit(BAD_EDITS[edit]))


@pytest.mark.parametrize("data", [b"", b"\xff\xfe", b"[]", b"{", b'{"a": NaN}', b'{"a": 1, "a": 2}', b"null"])
def test_non_json_is_refused(data):
    with pytest.raises(MalformedHeader):
        Manifest.from_bytes(data)


@pytest.mark.parametrize("edit", ["scheme", "pinned", "metadata", "digest"])
def test_a_manifest_edited_without_its_digest_is_refused(edit):
    """Before (version 1, no digest): "scheme": "turbo4" -> "turbo2" parsed, so verify passed and
    ask prefilled cold under the lossier scheme."""
    doc = json.loads(make_manifest().to_bytes())
    {"scheme": lambda: doc["codec"].update(scheme="turbo2"), "pinned": lambda: doc.update(pinned=not doc["pinned"]),
     "metadata": lambda: doc["metadata"].update(x="y"), "digest": lambda: doc.update(digest=sha("d"))}[edit]()
    with pytest.raises(MalformedHeader, match="digest does not match"):
        Manifest.from_bytes(canonical_json(doc))


def test_the_same_manifest_in_other_bytes_parses_the_same():
    """The digest is read off the bytes `seal` wrote (their hash without the digest member);
    bytes in any other form are re-encoded and checked as before."""
    m = make_manifest()
    doc = json.loads(m.to_bytes())
    digest = doc.pop("digest")
    forms = {"indented": json.dumps({**doc, "digest": digest}, indent=1).encode(),
             "digest first": json.dumps({"digest": digest, **doc}, separators=(",", ":")).encode(),
             "keys reversed": json.dumps(dict(reversed(list({**doc, "digest": digest}.items())))).encode()}
    for form, data in forms.items():
        assert data != m.to_bytes() and Manifest.from_bytes(data) == m, form
    edited = json.dumps({**doc, "digest": digest, "pinned": not doc["pinned"]}, indent=1).encode()
    with pytest.raises(MalformedHeader, match="digest does not match"):
        Manifest.from_bytes(edited)


def test_version_1_manifests_without_a_digest_stay_readable():
    m = make_manifest()
    doc = json.loads(m.to_bytes())
    assert doc["version"] == 2 and len(doc.pop("digest")) == 64
    old = Manifest.from_bytes(canonical_json({**doc, "version": 1}))
    assert old == m and Manifest.from_bytes(old.to_bytes()) == m


def test_versions():
    with pytest.raises(FormatVersionTooNew, match="upgrade tqstore"):
        Manifest.from_bytes(_edit(lambda d: d.update(version=3)))
    with pytest.raises(UnsupportedFormatVersion, match="save the entry again"):
        Manifest.from_bytes(_edit(lambda d: d.update(version=0)))


def test_truncations_and_byte_flips_never_rebind_tokens_and_blocks():
    data = make_manifest(300).to_bytes()
    for cut in range(0, len(data), 97):
        with pytest.raises(FormatError):
            Manifest.from_bytes(data[:cut])
    original = Manifest.from_bytes(data)
    for pos in range(len(data)):
        flipped = data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:]
        try:
            parsed = Manifest.from_bytes(flipped)
        except FormatError:
            continue
        # Tokens, block keys and window are cross-checked: a flip there never parses.
        assert (parsed.tokens, parsed.keys, parsed.window.key) == (original.tokens, original.keys, original.window.key)
