"""The store side of the second independent attack (issue 27, finding 5): full disks and
damaged homes. One scenario per sub-finding, each of which failed before its fix:

- a fresh home on a disk full to the last byte (`ls`, `verify`, `save` died with SIGBUS);
- a small full disk after `rm` + `gc` (the default 1 GiB free-disk margin refused every save);
- a 0-byte data.mdb (verify said ok), a data.mdb cut by one byte and zeroed B-tree pages
  (repair set every entry aside or gave up): repair keeps every entry it can still read;
- `meta/schema` = "99", a `manifest_used` time of -inf, nan or 1e300, an orphan segment with a
  3-byte key;
- manifest edits with a recomputed digest (the scheme, the `shared` pointer): verify checks a
  manifest against the objects it names, and `ask` refuses them clearly.

The disks are real tmpfs mounts in a private mount namespace (`unshare -rm`, skipped where the
machine forbids it); the commands are the real `tqstore` in subprocesses.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT, TEST_SETTINGS, child_env, cli, open_store
from model_folder import write_model_folder
from test_attack_store import DOCUMENT, synthetic_home, write_record
from test_disk_full import unshare_works
from tqstore.config import load_config
from tqstore.engine.engine import Engine
from tqstore.errors import CorruptBlock, FormatVersionTooNew, StoreDamaged
from tqstore.store.repair import repair_home
from tqstore.store.tiers.lmdb_pages import PageReader
from turboquant.codec.schemes import SCHEMES
from workers import put, snapshot_digest

needs_tmpfs = pytest.mark.skipif(not unshare_works(), reason="no private mount namespace here (unshare -rm)")
# The console script's entry point: main() run as `tqstore` runs it (mlx-lm's package imported
# lazily, so a command that stops before a model load never imports transformers).
CLI = "from tqstore_cli.main import run; run()"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("attack-store2") / "model", kind="qwen2")


def on_tmpfs(tmp_path: Path, size: int, steps: list[tuple[str, str]]) -> dict[str, tuple[int, str]]:
    """Run shell `steps` (name, command) in a private mount namespace with a `size`-byte tmpfs at
    $DISK; `tq ARGS` is the real `tqstore` with --home $DISK/home. Returns each step's exit code
    and output."""
    disk = tmp_path / "disk"
    disk.mkdir()
    lines = [f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(disk))} || exit 99",
             f"DISK={shlex.quote(str(disk))}",
             f"tq() {{ {shlex.quote(sys.executable)} -c {shlex.quote(CLI)} \"$@\" --home \"$DISK/home\"; }}",
             "fill() { dd if=/dev/zero of=\"$DISK/$1\" bs=4096 2>/dev/null; "
             "dd if=/dev/zero of=\"$DISK/$1.tail\" bs=512 2>/dev/null; true; }"]
    for name, command in steps:
        lines.append(f"out=$( {command} 2>&1 ); echo \"@@{name} $? $(printf %s \"$out\" | base64 -w0)\"")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", "\n".join(lines)], capture_output=True, text=True,
                          timeout=300, env=child_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("@@"):
            name, code, text = line[2:].rsplit(" ", 2)
            results[name] = (int(code), base64.b64decode(text).decode(errors="replace"))
    return results


# -- a fresh home on a disk full to the last byte ----------------------------------------------


@needs_tmpfs
def test_a_fresh_home_on_a_full_disk_is_refused_never_sigbus(model, tmp_path, ledger):
    """Before: LMDB extended the new lock.mdb as a sparse file and wrote through its mapping:
    SIGBUS (exit 135, no message) for ls, verify and save, 3 of 3."""
    steps = [("fill", "fill ballast; df -k \"$DISK\" | tail -1"),
             ("ls", "tq ls"), ("verify", "tq verify"),
             ("save", f"tq save doc --model {shlex.quote(str(model))} --prompt 'The seller pays.'"),
             ("ls again", "tq ls")]
    out = on_tmpfs(tmp_path, 1 << 20, steps)
    assert out["fill"][1].split()[3] == "0", out["fill"]  # not one block free
    for step in ("ls", "verify", "save", "ls again"):
        code, text = out[step]
        assert code == 1, (step, code, text)  # SIGBUS is 135 (128 + 7)
        assert "disk is full" in text and "home/lmdb" in text and "Traceback" not in text, (step, text)
        ledger.count("fresh home, full disk (tmpfs 1 MiB)", f"{step}: DiskFull naming the folder (exit 1)")
    ledger.count("fresh home, full disk (tmpfs 1 MiB)", "SIGBUS (wrong)", 0)


# -- a small full disk after rm + gc, with the default free-disk margin --------------------------


GUARD_CHILD = """
import json, sys
from harness import open_store
from tqstore.config import Config
from tqstore.errors import DiskFull
from workers import _fill, put

home, out = sys.argv[1], {}
default = {"min_free_disk_bytes": Config.min_free_disk_bytes}  # the tests' settings turn the guard off
store = open_store(home, **default)
out["margin"] = store.tiers.lmdb._env.free_margin()
put(store, "big", 3000, 1, layers=2)
put(store, "keep", 600, 2, layers=2)
store.close()
_fill(home + "/../ballast", leave=256 << 10)  # under the margin; a disk full to the last byte: below
store = open_store(home, **default)
try:
    put(store, "more", 600, 3, layers=2)
    out["full"] = "stored"
except DiskFull as exc:
    out["full"] = str(exc)
store.rm("big")
store.gc()
put(store, "after", 600, 4, layers=2)
out["after"] = store.load("after")[1].tokens
out["entries"] = [e.name for e in store.ls()]
out["problems"] = [str(p) for p in store.verify()]
store.close()
print(json.dumps(out))
"""


@needs_tmpfs
def test_rm_and_gc_make_room_on_a_small_full_disk_with_the_default_margin(model, tmp_path, ledger):
    """Before: the default margin (1 GiB) exceeded the whole 16 MiB disk, so every write was
    refused, rm + gc changed nothing, and the refusal did not say which setting to lower."""
    child = tmp_path / "child.py"
    child.write_text(GUARD_CHILD)
    steps = [("child", f"{shlex.quote(sys.executable)} {shlex.quote(str(child))} \"$DISK/home\""),
             ("save", f"tq save doc --model {shlex.quote(str(model))} --prompt 'The buyer pays for delays.'")]
    out = on_tmpfs(tmp_path, 16 << 20, steps)
    assert out["child"][0] == 0, out["child"][1][-3000:]
    result = json.loads(out["child"][1].splitlines()[-1])
    assert result["margin"] == (16 << 20) // 20, result  # 5% of the disk, not 1 GiB
    assert "free" in result["full"] and "tqstore config set store.min_free_disk" in result["full"], result
    assert result["after"] == 1112 and result["entries"] == ["after", "keep"] and result["problems"] == [], result
    assert out["save"][0] == 0, out["save"]
    scenario = "small full disk, default margin (tmpfs 16 MiB)"
    ledger.count(scenario, "put on the full disk refused naming the setting to lower")
    ledger.count(scenario, "put after rm + gc stored and loaded; tqstore save after it worked")
    ledger.count(scenario, "wrong (store stuck after rm + gc)", 0)


# -- damaged records: a layout version of 99, last-used times no date has, short orphan keys ----


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("synthetic") / "home"
    synthetic_home(home)
    return home


def copy_home(source: Path, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    shutil.copytree(source, home)
    return home


def assert_clean(home: Path, names: list[str]) -> None:
    store = open_store(home)
    try:
        assert store.verify() == [] and [e.name for e in store.ls()] == names
        for name in names:
            assert store.load(name)[1].tokens == len(store.get(name).tokens)
    finally:
        store.close()


def test_a_layout_version_of_99_over_layout_1_records_is_set_back_by_repair(synthetic, tmp_path, ledger):
    """Before: every command, repair included, refused the store as written by a newer tqstore."""
    home = copy_home(synthetic, tmp_path)
    write_record(home, b"meta", b"schema", b"99")
    done = cli("ls", "--home", str(home))
    assert done.returncode == 1 and "layout version 99" in done.stderr and "tqstore repair" in done.stderr, done.stderr
    done = cli("repair", "--home", str(home))
    assert done.returncode == 0 and "set back to 1" in done.stderr, done.stderr
    assert_clean(home, ["e0", "e1", "e2"])
    ledger.count("layout version 99", "ls refused naming repair; repair set it back, every entry kept")


def test_a_layout_version_of_99_with_records_of_another_layout_is_left_alone(synthetic, tmp_path):
    home = copy_home(synthetic, tmp_path)
    write_record(home, b"meta", b"schema", b"99")
    write_record(home, b"chunks_v2", b"k", b"v")  # a database this tqstore does not know
    with pytest.raises(FormatVersionTooNew, match="chunks_v2"):
        repair_home(load_config(home, TEST_SETTINGS))
    with pytest.raises(FormatVersionTooNew):
        open_store(home)


@pytest.mark.parametrize("when", [float("-inf"), float("nan"), 1e300, -5.0])
def test_a_last_used_time_no_date_has_is_a_record_problem(synthetic, tmp_path, when, ledger):
    """Before: -inf made `ls` an internal error (and nan, 1e300 likewise), while verify said ok."""
    home = copy_home(synthetic, tmp_path)
    write_record(home, b"manifest_used", b"e1", struct.pack(">d", when))
    if when == float("-inf"):
        done = cli("ls", "--home", str(home))
        assert done.returncode == 0 and "e1" in done.stdout and "internal" not in done.stderr, done.stderr
    store = open_store(home)
    try:
        assert [e.name for e in store.ls()] == ["e0", "e1", "e2"]
        problems = store.verify()
        assert [(p.kind, p.key) for p in problems] == [("record", b"e1")], problems
    finally:
        store.close()
    result = repair_home(load_config(home, TEST_SETTINGS))
    assert result.remaining == (), result
    assert_clean(home, ["e0", "e1", "e2"])
    ledger.count("damaged last-used time", f"{when!r}: ls worked, verify listed it, repair fixed it")


@pytest.mark.parametrize("key", [b"abc", bytes(31), b"\xff" * 40])
def test_an_orphan_segment_with_a_key_of_any_length_is_removed_by_repair(synthetic, tmp_path, key, ledger):
    """Before: verify listed the 3-byte key's segment, and repair left it there for ever."""
    home = copy_home(synthetic, tmp_path)
    write_record(home, b"segments", key, b"junk")
    store = open_store(home)
    try:
        assert [p.kind for p in store.verify()] == ["orphan_segment"]
    finally:
        store.close()
    result = repair_home(load_config(home, TEST_SETTINGS))
    assert result.remaining == () and len(result.records) == 1, result
    assert_clean(home, ["e0", "e1", "e2"])
    ledger.count("orphan segment", f"key of {len(key)} bytes: removed by repair")


# -- a 0-byte data.mdb ----------------------------------------------------------------------------


def test_an_empty_data_mdb_is_a_lost_store_not_an_empty_one(synthetic, tmp_path, ledger):
    """Before: LMDB took the 0-byte file for a new store, and verify said ok, 0 entries."""
    home = copy_home(synthetic, tmp_path)
    os.truncate(home / "lmdb" / "data.mdb", 0)
    done = cli("verify", "--home", str(home))
    assert done.returncode == 1 and "empty (0 bytes)" in done.stderr and "tqstore repair" in done.stderr, done.stderr
    with pytest.raises(StoreDamaged, match="every entry it held is lost"):
        open_store(home)
    assert repair_home(load_config(home, TEST_SETTINGS)).moved_aside
    assert_clean(home, [])
    ledger.count("empty data.mdb", "verify: StoreDamaged naming repair; repair moved it aside")


# -- manifests edited with their digest recomputed -------------------------------------------------


@pytest.fixture(scope="module")
def two_schemes(model, tmp_path_factory) -> Path:
    """A home with entry a (turbo4) and entry b (turbo8v3) of the same document and model."""
    home = tmp_path_factory.mktemp("two-schemes") / "home"
    store = open_store(home)
    try:
        engine = Engine(store, prefill_chunk=64)
        engine.save("a", DOCUMENT, model=str(model), scheme="turbo4")
        engine.save("b", DOCUMENT, model=str(model), scheme="turbo8v3")
    finally:
        store.close()
    return home


def test_every_scheme_edit_with_a_recomputed_digest_is_listed_by_verify(two_schemes, tmp_path, ledger):
    """Before: "scheme" turbo4 -> any other scheme, resealed, passed verify (only ask refused it)."""
    home = copy_home(two_schemes, tmp_path)
    store = open_store(home)
    try:
        original = store.get("a")
        for scheme in (s for s in SCHEMES if s != "turbo4"):
            store.tiers.lmdb.put_manifest("a", original.replace(scheme=scheme).to_bytes())
            problems = store.verify()
            assert [(p.entry, p.kind) for p in problems] == [("a", "manifest")], (scheme, problems)
            assert "encoded with turbo4" in problems[0].detail, problems
            ledger.count("manifest edited, digest recomputed", f"scheme turbo4 -> {scheme}: listed by verify")
        store.tiers.lmdb.put_manifest("a", original.to_bytes())
        assert store.verify() == []
    finally:
        store.close()
    ledger.count("manifest edited, digest recomputed", "wrong (verify passed)", 0)


def test_a_shared_pointer_to_another_entrys_codecs_is_listed_and_refused(two_schemes, model, tmp_path, ledger):
    """Before: a's `shared` pointing at b's codec object (sha256 and size too, resealed) passed
    verify, and `ask a` failed as an internal error. Now verify lists it, and `ask a` restores
    nothing from it (CorruptBlock inside the restore) and answers from a cold prefill of a's own
    tokens with a note naming the damage, as for any entry with nothing restorable."""
    home = copy_home(two_schemes, tmp_path)
    store = open_store(home)
    try:
        a, b = store.get("a"), store.get("b")
        store.tiers.lmdb.put_manifest("a", a.replace(shared=b.shared).to_bytes())
        problems = store.verify()
        assert [(p.entry, p.kind) for p in problems] == [("a", "manifest")], problems
        with pytest.raises(CorruptBlock, match="another entry's"):
            store.restore(store.lookup(a.tokens, model=a.model_digest, codec=a.codec_digest))
        with pytest.warns(RuntimeWarning, match="another entry's"):
            assert Engine(store, prefill_chunk=64).ask("a", "Who pays?", max_tokens=2).cached_tokens == 0
        assert Engine(store, prefill_chunk=64).ask("b", "Who pays?", max_tokens=2).cached_tokens > 0
    finally:
        store.close()
    done = cli("ask", "a", "Who pays?", "--max-tokens", "2", "--home", str(home))
    assert done.returncode == 0 and "note:" in done.stderr and "another entry's" in done.stderr, done.stderr
    assert "internal" not in done.stderr
    ledger.count("manifest edited, digest recomputed", "shared -> another entry's codecs: verify listed it, the "
                                                       "restore refused it (ask answered cold, with a note), b "
                                                       "unaffected")


# -- a data.mdb cut by one byte, zeroed B-tree pages: repair keeps every entry it can read ---------


def tree_pages(data: Path) -> dict[str, int]:
    """Pages to zero: the roots of the named databases and the first leaf under the segments'
    root (a branch page in these homes)."""
    reader = PageReader(data)
    try:
        roots, size = reader.named_dbs(), reader.page_size
    finally:
        reader.close()
    with open(data, "rb") as f:
        f.seek(roots[b"segments"] * size)
        page = f.read(size)
    lo, hi, flags, _ = struct.unpack_from("=HHHH", page, struct.unpack_from("=H", page, 16)[0])
    assert struct.unpack_from("=H", page, 10)[0] & 1, "the segments' root is a branch page"
    pages = {f"{db.decode()} root": pgno for db, pgno in roots.items() if db != b"quarantine"}
    return {**pages, "first segments leaf": lo | hi << 16 | flags << 32}


@pytest.fixture(scope="module")
def salvage_source(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A closed synthetic home and the digest of each entry's loaded snapshot."""
    home = tmp_path_factory.mktemp("salvage") / "home"
    names = synthetic_home(home, 6)  # enough segment records that the segments tree has a branch root
    store = open_store(home)
    try:
        digests = {name: snapshot_digest(store.load(name)[0]) for name in names}
    finally:
        store.close()
    return home, digests


DAMAGE = ["cut by one byte", "meta root", "manifest_used root", "manifests root", "objects root", "segments root",
          "first segments leaf"]
# Entries that must come back: every entry whose records are all still readable.
KEPT_AT_LEAST = {"cut by one byte": 3, "meta root": 3, "manifest_used root": 3, "manifests root": 0,
                 "objects root": 0, "segments root": 0, "first segments leaf": 0}


@pytest.mark.parametrize("damage", DAMAGE)
def test_repair_keeps_every_entry_it_can_still_read(salvage_source, tmp_path, damage, ledger):
    """Before: a data.mdb one byte short was moved aside whole (every entry set aside), and on
    zeroed B-tree pages repair gave up with MDB_CORRUPTED."""
    source, digests = salvage_source
    home = copy_home(source, tmp_path)
    data = home / "lmdb" / "data.mdb"
    if damage == "cut by one byte":
        os.truncate(data, data.stat().st_size - 1)
    else:
        pgno, size = tree_pages(data)[damage], 4096
        with open(data, "r+b") as f:
            f.seek(pgno * size)
            f.write(bytes(size))
    result = repair_home(load_config(home, TEST_SETTINGS))
    assert result.moved_aside and result.remaining == (), result
    kept = list(result.salvaged)
    assert len(kept) >= KEPT_AT_LEAST[damage], result
    if damage == "manifests root":
        # Named by their last-used records (before: `lost` was empty, and the CLI said "ok: no
        # problems left" over a store that had lost every entry).
        assert kept == [] and result.unread_pages and any("damaged pages" in n for n in result.records), result
        assert result.lost == tuple(f"{name}: its manifest was in a page that could not be read"
                                    for name in sorted(digests)), result
    else:
        assert len(kept) + len(result.lost) == len(digests), result
    store = open_store(home)
    try:
        assert store.verify() == [] and [e.name for e in store.ls()] == kept
        for name in kept:
            assert snapshot_digest(store.load(name)[0]) == digests[name]  # bit for bit what was saved
        put(store, "again", 44, 1)  # the store works again
    finally:
        store.close()
    ledger.count("damaged data.mdb, repair salvages", f"{damage}: {len(kept)} of {len(digests)} entries kept identical, "
                                                      f"{len(result.lost)} lost")
    ledger.count("damaged data.mdb, repair salvages", "wrong (repair failed, an entry changed)", 0)


def test_zeroed_b_tree_pages_through_the_cli(salvage_source, tmp_path, ledger):
    """Before: `tqstore repair` failed with MDB_CORRUPTED and the store stayed unusable."""
    home = copy_home(salvage_source[0], tmp_path)
    data = home / "lmdb" / "data.mdb"
    with open(data, "r+b") as f:
        f.seek(tree_pages(data)["manifest_used root"] * 4096)
        f.write(bytes(4096))
    names = sorted(salvage_source[1])
    done = cli("repair", "--home", str(home))
    assert done.returncode == 0 and f"copied into it the {len(names)} entries" in done.stderr, done.stderr
    done = cli("ls", "--home", str(home))
    assert done.returncode == 0 and all(n in done.stdout for n in names), done.stdout + done.stderr
    ledger.count("damaged data.mdb, repair salvages",
                 f"zeroed page through the CLI: repair kept {len(names)} of {len(names)}, ls lists them")


def test_repair_of_a_truncated_file_does_not_call_lost_entries_no_problem(salvage_source, tmp_path, ledger):
    """Before: with the trees' pages cut off (LMDB writes them last), repair copied 0 entries and
    ended with "ok: no problems left"."""
    home = copy_home(salvage_source[0], tmp_path)
    data = home / "lmdb" / "data.mdb"
    os.truncate(data, 24 * 4096)
    done = cli("repair", "--home", str(home), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["unread_pages"] > 0, done.stdout + done.stderr
    home = copy_home(salvage_source[0], tmp_path / "again")
    os.truncate(home / "lmdb" / "data.mdb", 24 * 4096)
    done = cli("repair", "--home", str(home))
    assert done.returncode == 0 and "could not be read" in done.stderr, done.stderr
    assert "no problems left" not in done.stderr and "an entry whose manifest was in the unread pages is gone" \
        in done.stderr, done.stderr
    ledger.count("damaged data.mdb, repair salvages", "truncated, nothing readable: repair says entries may be gone")
