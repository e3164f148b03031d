"""tqstore.exchange.portable: an entry through one bundle file (export, verified import) and mlx-lm files."""

from __future__ import annotations

import mlx.core as mx
import pytest

from model_folder import write_model_folder
from tqstore import Store
from tqstore.exchange.bundle import read_bundle, write_bundle
from tqstore.config import load_config
from tqstore.engine.engine import Engine
from tqstore.errors import ChecksumMismatch, MalformedHeader, NotFound, TruncatedData, UnsupportedCache
from tqstore.format.manifest import Manifest
from tqstore.exchange.portable import export_bundle, export_mlx_lm, import_bundle, import_mlx_lm, is_bundle

DOC = ("The contract says the seller pays for delays. Clause seven covers delivery, payment and penalties. "
       "To abscond is to move in a mysterious way, commonly with the property of another.")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2"))


@pytest.fixture
def open_store(tmp_path):
    opened = []

    def open_(name: str) -> Store:
        store = Store.open(config=load_config(tmp_path / name))
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


@pytest.fixture
def saved(open_store, model_dir, tmp_path):
    """(source engine, bundle path) of entry `doc`, pinned, exported."""
    engine = Engine(open_store("a"))
    engine.save("doc", DOC, model=model_dir, pin=True)
    path = tmp_path / "doc.tqb"
    result = export_bundle(engine.store, "doc", path)
    assert result.format == "bundle" and result.bytes == path.stat().st_size and is_bundle(path)
    return engine, path


def _arrays_equal(a, b) -> bool:
    """Every layer's arrays, by name, equal (array_equal)."""
    return len(a.layers) == len(b.layers) and all(
        x.layout == y.layout and x.arrays.keys() == y.arrays.keys()
        and all(mx.array_equal(x.arrays[k], y.arrays[k]).item() for k in x.arrays)
        for x, y in zip(a.layers, b.layers))


def test_import_publishes_the_same_entry_under_any_name(saved, open_store):
    source, path = saved
    target = open_store("b")
    result = import_bundle(target, path, "copy")
    original = source.store.get("doc")
    copy = target.get("copy")
    assert result.name == "copy" and result.tokens == len(original.tokens) and result.new_blocks == result.blocks == 1
    assert copy.tokens == original.tokens and [r.key for r in copy.objects] == [r.key for r in original.objects]
    assert copy.pinned is False and copy.remote_etag is None  # local bookkeeping does not travel
    assert _arrays_equal(target.load("copy")[0], source.store.load("doc")[0])
    assert import_bundle(target, path).name == "doc"  # its own name by default; objects shared
    assert import_bundle(target, path, "copy").new_blocks == 0


def test_import_keeps_a_local_pin(saved, open_store):
    _, path = saved
    target = open_store("b")
    import_bundle(target, path, "doc")
    target.pin("doc")
    import_bundle(target, path, "doc")
    assert target.get("doc").pinned


def _rewrite(path, change):
    """Write the bundle again after change(manifest, objects) -> (manifest, objects)."""
    manifest_bytes, objects = read_bundle(path)
    manifest, objects = change(Manifest.from_bytes(manifest_bytes), dict(objects))
    write_bundle(path, manifest.to_bytes(), objects)


def test_nothing_is_written_when_any_object_is_wrong(saved, open_store):
    _, path = saved
    target = open_store("b")
    block = Manifest.from_bytes(read_bundle(path)[0]).blocks[0]

    _rewrite(path, lambda m, o: (m, {k: v for k, v in o.items() if k != block.key}))
    with pytest.raises(TruncatedData, match="lacks the block"):
        import_bundle(target, path)

    def swap(m, o):  # the window's bytes under the block's key, with the digest to match
        import hashlib

        window = o[m.window.key]
        o[block.key] = window
        refs = (m.blocks[0].__class__(block.key, hashlib.sha256(window).hexdigest(), len(window)),)
        return m.replace(blocks=refs), o

    _rewrite(path, swap)
    with pytest.raises(MalformedHeader, match="this window is not a block"):
        import_bundle(target, path)
    stats = target.stats()
    assert stats.lmdb.object_count == 0 and stats.lmdb.manifest_count == 0


def test_damaged_bytes_are_refused(saved, open_store):
    _, path = saved
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch):
        import_bundle(open_store("b"), path)


def test_export_needs_every_object(saved, tmp_path):
    source, _ = saved
    source.store._tiers.lmdb.delete_objects([source.store.get("doc").blocks[0].key])
    with pytest.raises(NotFound, match="missing from the store"):
        export_bundle(source.store, "doc", tmp_path / "again.tqb")
    with pytest.raises(NotFound, match="no entry nope"):
        export_bundle(source.store, "nope", tmp_path / "nope.tqb")


def test_mlx_lm_files_round_trip_raw_and_refuse_turbo(open_store, model_dir, tmp_path):
    engine = Engine(open_store("a"))
    engine.save("turbo", DOC, model=model_dir)
    with pytest.raises(UnsupportedCache, match="re-save it with --scheme raw or --scheme affine8"):
        export_mlx_lm(engine.store, "turbo", tmp_path / "t.safetensors")
    engine.save("raw", DOC, model=model_dir, scheme="raw")
    file = tmp_path / "raw.safetensors"
    exported = export_mlx_lm(engine.store, "raw", file)
    assert exported.format == "mlx-lm" and not is_bundle(file)
    other = Engine(open_store("b"))
    result = import_mlx_lm(other, file, "raw", model=model_dir)
    assert result.scheme == "raw" and result.tokens == exported.tokens
    assert other.store.get("raw").tokens == engine.store.get("raw").tokens
    assert _arrays_equal(other.store.load("raw")[0], engine.store.load("raw")[0])


def test_a_quantized_mlx_lm_file_imported_with_a_scheme_is_refused_with_the_reason(open_store, model_dir, tmp_path):
    # It was an internal error (turboquant's NotNative escaped the import).
    engine = Engine(open_store("a"))
    engine.save("q", DOC, model=model_dir, scheme="affine8")
    file = tmp_path / "q.safetensors"
    export_mlx_lm(engine.store, "q", file)
    other = Engine(open_store("b"))
    with pytest.raises(UnsupportedCache, match="import it without --scheme"):
        import_mlx_lm(other, file, "q", model=model_dir, scheme="turbo4")
    assert other.store.ls() == []
    assert import_mlx_lm(other, file, "q", model=model_dir).scheme == "affine8"
