"""The checks every stored object passes before it is used or kept: what an object must be
(`Want`), the complete check of a payload against it (`decode`), and what to do with a copy that
fails (`quarantine_lmdb`).

Both the write paths (put, pull, import: publish.py; push; verify) and the read path (restore)
check objects with these functions, so a copy is judged by one set of rules wherever it is
met. A copy that is not what its key promises (BAD_CONTENT) is damage; a good object of
another save (block 0 calibrated differently) is a ConflictError, never damage.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from tqstore.errors import ChecksumMismatch, ConflictError, FormatError, IdentityMismatch, TokenMismatch
from tqstore.format.blocks import BlockKey
from tqstore.format.header import Expect, Provenance
from tqstore.format.manifest import Manifest, ObjectRef
from tqstore.format.objects import Parsed, build as build_object, parse as parse_object
from tqstore.models.identity import CodecIdentity, codecs_digest
from tqstore.store.tiers.lmdb import LmdbTier
from tqstore.store.tiers.memory import HotObject, decoded_nbytes
from turboquant.records import Snapshot
from turboquant import SCHEMES, parse_scheme

BAD_CONTENT = (FormatError, IdentityMismatch, TokenMismatch)  # a copy that is not what its key promises
# (codec digest, scheme, window sha256, shared sha256) found to fit: a restore checks each once
_CODECS_FIT: set[tuple[bytes, str, str, str]] = set()


@dataclass(frozen=True)
class Want:
    """One object a restore needs and what it must be (identity, tokens, keys, calibration)."""

    key: bytes
    kind: str
    model: bytes
    codec: bytes
    tokens: tuple[int, ...] | None = None
    bound: BlockKey | None = None  # a block's own key; a window's entry's last block key
    calibration: bytes | None = None  # checked on block 0 and windows: later block keys hash it
    sha256: str | None = None  # the bucket copy's digest, from a remote manifest

    @property
    def expect(self) -> Expect:
        if self.kind == "shared":  # content-addressed and shared across identities: checked by digest
            return Expect(kind="shared")
        return Expect(self.kind, self.model, self.codec, self.tokens, self.bound)

    def problem(self, kind: str, prov: Provenance) -> str | None:
        """Why an object of `kind` with provenance `prov` is not this one, or None."""
        if kind != self.kind:
            return f"it is a {kind}, not a {self.kind}"
        if kind == "shared":
            return None
        if (prov.model, prov.codec) != (self.model, self.codec):
            return "it belongs to another model or codec identity"
        if self.tokens is not None and tuple(prov.tokens or ()) != self.tokens:
            return "it holds other tokens"
        if self.bound is not None and prov.key != self.bound:
            return "it belongs to another prefix chain"
        return None

    def other_save(self, kind: str, prov: Provenance) -> str | None:
        """Why a good object under this key belongs to another save than the one wanted, or None.

        Block 0's key does not hash calibration (it is fitted from block 0 itself), so two saves
        of the same first tokens calibrated differently share that key; their later blocks do
        not. Such an object is valid for the entries of its own save: a miss, not damage.
        """
        first = kind == "block" and prov.parent is None
        if (first or kind == "window") and prov.calibration != self.calibration:
            return ("it was calibrated differently from the entry's later blocks (another save of the same "
                    "first tokens)")
        return None


def wants_for(manifest: Manifest, n_blocks: int, remote: bool) -> list[Want]:
    """The objects of the first `n_blocks` blocks of `manifest`, its window and its shared codecs."""
    keys, bs, ids = manifest.keys, manifest.block_size, (manifest.model_digest, manifest.codec_digest)
    sha = (lambda ref: ref.sha256) if remote else (lambda ref: None)
    wants = [Want(keys[i].raw, "block", *ids, manifest.tokens[i * bs:(i + 1) * bs], keys[i], manifest.calibration,
                  sha(manifest.blocks[i])) for i in range(n_blocks)]
    last = keys[-1] if keys else None
    wants.append(Want(manifest.window.key, "window", *ids, None, last, manifest.calibration, sha(manifest.window)))
    wants.append(Want(manifest.shared.key, "shared", *ids, sha256=sha(manifest.shared)))
    return wants


def decode(payload: bytes, want: Want, sha256: str | None = None) -> HotObject:
    """Verify `payload` completely against `want` and decode it. FormatError, IdentityMismatch or
    TokenMismatch if it is not that object (damage); ConflictError if it is a good object of
    another save (`Want.other_save`). `sha256` is the payload's hex digest where the tier that
    returned it has just verified it against that digest (it is not hashed again)."""
    parsed = parse_object(payload, expect=want.expect, verified=sha256 is not None)
    return decode_parsed(parsed, want, sha256 or hashlib.sha256(payload).hexdigest())


def decode_parsed(parsed: Parsed, want: Want, sha256: str) -> HotObject:
    """`decode` after `parse_object` (which checks every byte and may run on another thread):
    the object built on this thread and checked against `want`; `sha256` is the digest the
    payload was recorded with."""
    header, obj = build_object(parsed)
    check_parsed(parsed, want, obj)
    return HotObject(obj, header.kind, header.provenance, sha256, decoded_nbytes(obj))


def check_parsed(parsed: Parsed, want: Want, obj: object | None = None) -> None:
    """`decode_parsed`'s checks of a parsed object against `want`, before it is built (`obj`,
    the built object, only for shared codecs: they are checked by their digest). Raises
    IdentityMismatch (damage) or ConflictError (a good object of another save)."""
    header = parsed.header
    problem = want.problem(header.kind, header.provenance)
    if problem is None and want.kind == "shared" and (obj is None or codecs_digest(obj.codecs) != want.key):
        problem = "its codecs do not hash to its key"
    if problem is not None:
        raise IdentityMismatch(f"{want.kind} {want.key.hex()[:12]} does not fit here: {problem}")
    other = want.other_save(header.kind, header.provenance)
    if other is not None:
        raise ConflictError(f"{want.kind} {want.key.hex()[:12]} does not fit here: {other}")


def codec_problem(manifest: Manifest, window: HotObject, shared: HotObject) -> str | None:
    """Why `manifest` does not describe its window and shared codecs, or None.

    A manifest edited with its digest recomputed passes every other check: another scheme, or a
    `shared` pointing at another entry's codecs. The objects say what they were encoded with:
    each compressed layer's config names its scheme and the codecs it uses, and the codec
    identity of the window's layers and the shared codecs under the manifest's scheme is its
    codec digest (when that digest is one of another scheme's, the scheme was edited; entries
    whose digest no scheme gives, such as synthetic ones, are judged by the first two checks).
    """
    known = (manifest.codec_digest, manifest.scheme, window.sha256, shared.sha256)
    if known in _CODECS_FIT:
        return None
    try:
        scheme = parse_scheme(manifest.scheme).name
        used = {parse_scheme(str(r.config["scheme"])).name for r in window.obj.layers if "scheme" in r.config}
    except ValueError as exc:
        return f"it names a scheme this tqstore does not know ({exc})"
    if used and used != {scheme}:
        return f"it says scheme {manifest.scheme!r}, but its objects were encoded with {', '.join(sorted(used))}"
    names = {str(r.config[f"{side}_codec"]) for r in window.obj.layers for side in ("key", "value")
             if r.config.get(f"{side}_format") == "turbo" and r.config.get(f"{side}_codec") is not None}
    lacking = sorted(names - set(shared.obj.codecs))
    if lacking:
        return (f"its shared codecs lack {', '.join(lacking)}, which its layers use: they are another entry's, or "
                "the manifest was edited")
    codec = CodecIdentity.from_snapshot(Snapshot(layers=window.obj.layers, codecs=shared.obj.codecs), scheme)
    if codec.digest != manifest.codec_digest:
        other = next((s for s in SCHEMES if dataclasses.replace(codec, scheme=s).digest == manifest.codec_digest), None)
        if other is not None:
            return f"it says scheme {manifest.scheme!r}, but its codec digest is that of {other}"
    if len(_CODECS_FIT) >= 4096:
        _CODECS_FIT.clear()
    _CODECS_FIT.add(known)
    return None


def check_digest(payload: bytes, ref: ObjectRef, what: str) -> None:
    """ChecksumMismatch unless `payload` hashes to the digest `ref` records; `what` names it."""
    if hashlib.sha256(payload).hexdigest() != ref.sha256:
        raise ChecksumMismatch(f"{what} is not the copy its manifest records (sha256 mismatch): run tqstore verify, "
                               "then save, pull or export the entry again")


def quarantine_lmdb(lmdb: LmdbTier, key: bytes, reason: str) -> None:
    """Quarantine an LMDB object whose bytes are intact but whose content is not what its key
    promises (LmdbTier quarantines checksum failures itself)."""
    lmdb.quarantine(key, reason)
