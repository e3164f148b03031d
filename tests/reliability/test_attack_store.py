"""The store side of an independent attack (issue 19, findings 1 to 6), one scenario each:
weights replaced in place, a document holding the prompt-split marker, a truncated data.mdb,
an edited manifest, damaged index records, and a full disk with reads and recovery.

Each scenario failed before its fix and counts its trials and outcomes in the ledger; the
outcome that must never happen (a wrong cache served, a silently cut document, a crash, a
bricked store) is counted as "wrong" and asserted to be 0.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from harness import HERE, ROOT, TEST_SETTINGS, child_env, cli, open_store
from model_folder import CHAT_TEMPLATE, write_model_folder
from tqstore.config import load_config
from tqstore.engine.engine import Engine
from tqstore.engine.prefill import Prefiller
from tqstore import durable
from tqstore.canonical import canonical_json
from tqstore.errors import DiskFull, IdentityMismatch, MalformedHeader, StoreDamaged
from tqstore.format.manifest import seal
from tqstore.models.prompting import SENTINEL, encode_prompt
from tqstore.store.repair import repair_home
from test_disk_full import unshare_works
from workers import put

DOCUMENT = "The contract says the seller pays for delays. Clause seven covers delivery and penalties. " * 4
SUFFIX = CHAT_TEMPLATE.split("{{ message['content'] }}")[1].split("{% endfor %}")[0] + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("attack-store")
    write_model_folder(root / "model", kind="qwen2")
    return root


# -- 1. weights replaced in place ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["cp -p over the file", "rsync -a (rename over)"])
def test_weights_replaced_in_place_with_the_old_size_and_mtime_are_refused(root, tmp_path, how, ledger):
    """Before: the digest cache trusted path, size and mtime, so `ask` restored the old cache
    into the new weights and answered (rc 0)."""
    model = tmp_path / "model"
    shutil.copytree(root / "model", model)
    store = open_store(tmp_path / "home")
    try:
        Engine(store, prefill_chunk=64).save("doc", DOCUMENT, model=str(model), scheme="turbo4")
        weights = model / "model.safetensors"
        old = os.stat(weights)
        other = write_model_folder(tmp_path / "other", kind="qwen2", seed=1) / "model.safetensors"
        assert other.stat().st_size == old.st_size
        if how.startswith("cp"):
            subprocess.run(["cp", "-p", str(other), str(weights)], check=True)
        else:
            os.replace(other, weights)
        os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))  # touch -r the old file
        with pytest.raises(IdentityMismatch, match="weights"):
            Engine(store, prefill_chunk=64).ask("doc", "Who pays?", max_tokens=2)  # a new process's engine
        ledger.count("weights replaced in place", f"{how}, touch -r: refused naming the weights")
        ledger.count("weights replaced in place", "wrong", 0)
    finally:
        store.close()


# -- 2. the prompt-split marker inside a document ----------------------------------------------


def expected_context(tokenizer, document: str) -> list[int]:
    """The tokens of the template rendered around `document`, up to where the document ends."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": document}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith(SUFFIX)
    return encode_prompt(tokenizer, text[: -len(SUFFIX)])


MARKED = [
    ("marker in the middle", "Clause one. " + SENTINEL + DOCUMENT),
    ("marker at the end", DOCUMENT + SENTINEL),
    ("marker twice", SENTINEL + DOCUMENT + SENTINEL + "tail"),
    ("marker prefix at the end", DOCUMENT + SENTINEL[:-1]),
]


@pytest.mark.parametrize("label,document", MARKED, ids=[m[0] for m in MARKED])
def test_a_document_holding_the_split_marker_is_stored_whole(root, tmp_path, label, document, ledger):
    """Before: the context was cut at the first marker, so "Clause one. " + marker + 212 tokens
    stored 5 tokens and reported success."""
    store = open_store(tmp_path / "home")
    try:
        engine = Engine(store, prefill_chunk=64)
        result = engine.save("doc", document, model=str(root / "model"), scheme="turbo4")
        loaded = engine.model(str(root / "model"))
        expected = expected_context(loaded.tokenizer, document)
        assert list(store.get("doc").tokens) == expected and result.tokens == len(expected)
        assert loaded.prompt.context_tokens(loaded.tokenizer, document) == expected
        ledger.count("prompt-split marker in user text", f"engine save, {label}: stored whole")
        ledger.count("prompt-split marker in user text", "wrong", 0)
    finally:
        store.close()


def test_a_document_holding_the_split_marker_is_stored_whole_through_http_put(root, tmp_path, ledger):
    from server_process import ServerProcess, request

    document = "Clause one. " + SENTINEL + DOCUMENT
    server = ServerProcess(tmp_path / "home", root / "model")
    try:
        status, _, entry = request(server, "PUT", "/v1/caches/doc", {"document": document})
    finally:
        server.stop()
    assert status == 200, entry
    store = open_store(tmp_path / "home")
    try:
        loaded = Engine(store).model(str(root / "model"))
        assert list(store.get("doc").tokens) == expected_context(loaded.tokenizer, document)
    finally:
        store.close()
    ledger.count("prompt-split marker in user text", "PUT /v1/caches/{name}: stored whole")


# -- 3. a truncated data.mdb -------------------------------------------------------------------


def synthetic_home(home: Path, n: int = 3) -> list[str]:
    """A home with `n` synthetic entries (shared prefix blocks), closed again; their names."""
    store = open_store(home)
    try:
        for i in range(n):
            put(store, f"e{i}", 300, i)
    finally:
        store.close()
    return [f"e{i}" for i in range(n)]


def truncations(size: int) -> dict[str, int]:
    page = 4096
    return {"to half": size // 2, "by one page": size - page, "to three pages": 3 * page,
            "inside the second meta page": page + 100, "inside the first meta page": 100}


@pytest.fixture(scope="module")
def truncated_source(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("truncated") / "home"
    synthetic_home(home)
    return home


def assert_refused(done: subprocess.CompletedProcess, what: str) -> None:
    assert done.returncode == 1, f"{what}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    text = done.stdout + done.stderr
    assert "StoreDamaged" in text or "is damaged" in text, f"{what}: {text[-2000:]}"
    assert "tqstore repair" in text and "Traceback" not in text, f"{what}: {text[-2000:]}"


@pytest.mark.parametrize("cut", list(truncations(1 << 20)))
def test_a_truncated_data_mdb_is_refused_by_every_command_never_sigbus(truncated_source, tmp_path, cut, ledger):
    """Before: LMDB mapped the short file and the first read past its end killed the process
    with SIGBUS (exit 135, no message), `verify` included."""
    home = tmp_path / "home"
    shutil.copytree(truncated_source, home)
    data = home / "lmdb" / "data.mdb"
    os.truncate(data, truncations(data.stat().st_size)[cut])
    with pytest.raises(StoreDamaged, match="tqstore repair"):
        open_store(home)
    commands = [["verify", "--json"]]
    if cut == "to half":
        commands += [["ls"], ["gc"], ["ask", "e0", "Who pays?"]]
    for argv in commands:
        assert_refused(cli(*argv, "--home", str(home)), f"tqstore {' '.join(argv)} ({cut})")
        ledger.count("truncated data.mdb", "command refused with StoreDamaged (exit 1, names repair)")
    ledger.count("truncated data.mdb", "SIGBUS (wrong)", 0)
    if cut == "to half":
        done = cli("repair", "--home", str(home))
        assert done.returncode == 0 and "moved the LMDB folder" in done.stderr, done.stderr
    else:
        assert repair_home(load_config(home, TEST_SETTINGS)).moved_aside
    assert len(list(home.glob("lmdb.damaged-*"))) == 1
    store = open_store(home)
    try:  # (repair keeps the entries it can still read whole: issue 27, test_attack_store2.py)
        assert {e.name for e in store.ls()} <= {"e0", "e1", "e2"} and store.verify() == []
        put(store, "again", 44, 1)
        assert store.load("again")[1].tokens == 556
    finally:
        store.close()
    ledger.count("truncated data.mdb", f"truncated {cut}: repair moved it aside, store works again")


def test_serve_on_a_truncated_data_mdb_exits_with_the_reason(root, truncated_source, tmp_path, ledger):
    home = tmp_path / "home"
    shutil.copytree(truncated_source, home)
    data = home / "lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    done = cli("serve", "--home", str(home), "--model", str(root / "model"), "--port", "0", timeout=120)
    assert_refused(done, "tqstore serve")
    ledger.count("truncated data.mdb", "serve refused to start with StoreDamaged (exit 1)")


# -- 5. damaged index records ----------------------------------------------------------------


def write_record(home: Path, db: bytes, key: bytes, value: bytes) -> None:
    """Write one raw record into the home's LMDB (the store is closed)."""
    env = lmdb.open(str(home / "lmdb"), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, value, db=env.open_db(db, txn=txn))
    finally:
        env.close()


def manifest_bytes(home: Path, name: str) -> bytes:
    store = open_store(home)
    try:
        return store.tiers.lmdb.get_manifest(name)
    finally:
        store.close()


# (label, db, key, value or a function of the home giving it, the name verify reports or None)
DAMAGES = [
    ("meta/schema not a number", b"meta", b"schema", b"x1", None),
    ("3-byte manifest_used record", b"manifest_used", b"e1", b"abc", None),
    ("manifest key with a 0xff byte", b"manifests", b"e2\xff", lambda home: manifest_bytes(home, "e2"), "e2\\xff"),
    ("manifest key with a space, garbage value", b"manifests", b"a b", b"{not json", "a b"),
    ("quarantine record not JSON", b"quarantine", bytes(32), b"\x00\x01", None),
    ("manifest garbage under a valid name", b"manifests", b"junk", b"\x89garbage", "junk"),
]


@pytest.fixture(scope="module")
def records_source(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("records") / "home"
    synthetic_home(home)
    return home


@pytest.mark.parametrize("label,db,key,value,shown", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_one_damaged_index_record_costs_only_itself(records_source, tmp_path, label, db, key, value, shown, ledger):
    """Before: each of these made ls, verify, the lookup of every ask and gc fail as "internal
    error" (ValueError, struct.error, UnicodeDecodeError), and rm could not remove a bad key."""
    home = tmp_path / "home"
    shutil.copytree(records_source, home)
    write_record(home, db, key, value(home) if callable(value) else value)
    store = open_store(home)
    try:
        assert [e.name for e in store.ls()] == ["e0", "e1", "e2"]
        problems = store.verify()
        assert len(problems) == 1 and problems[0].entry == shown, problems
    finally:
        store.close()
    store = open_store(home)
    try:  # (a load rewrites a damaged last-used time, gc drops the quarantine records)
        for name in ("e0", "e1", "e2"):
            assert store.load(name)[1].tokens == 812
        store.gc()
    finally:
        store.close()
    result = repair_home(load_config(home, TEST_SETTINGS))
    assert result.remaining == () and len(result.records) == (db in (b"meta", b"manifests")), result
    store = open_store(home)
    try:
        assert store.verify() == [] and store.tiers.lmdb.damaged_records() == []
        assert [e.name for e in store.ls()] == ["e0", "e1", "e2"]
    finally:
        store.close()
    ledger.count("damaged index records", f"{label}: ls, load, verify (listed), gc worked; repair fixed it")
    ledger.count("damaged index records", "wrong (other entries affected, internal error)", 0)


def test_a_store_with_every_damage_works_through_the_cli(root, tmp_path, ledger):
    home = tmp_path / "home"
    synthetic_home(home)
    store = open_store(home)
    try:
        Engine(store, prefill_chunk=64).save("doc", DOCUMENT, model=str(root / "model"), scheme="turbo4")
    finally:
        store.close()
    for _, db, key, value, _ in DAMAGES:
        write_record(home, db, key, value(home) if callable(value) else value)
    for argv, code in ((["ls"], 0), (["ask", "doc", "Who pays?", "--max-tokens", "2"], 0), (["verify"], 1),
                       (["gc"], 0), (["rm", "e2\\xff"], 0), (["repair"], 0)):
        done = cli(*argv, "--home", str(home))
        assert done.returncode == code and "internal error" not in done.stderr, (argv, done.stdout, done.stderr)
        ledger.count("damaged index records", f"all at once: tqstore {argv[0]} exit {code}")
    store = open_store(home)
    try:
        assert store.verify() == [] and [e.name for e in store.ls()] == ["doc", "e0", "e1", "e2"]
    finally:
        store.close()


# -- 4. an edited manifest ---------------------------------------------------------------------


def edit_manifest(home: Path, name: str, how: str) -> None:
    """Rewrite the stored manifest of `name` with scheme turbo2: as bytes (its digest left as
    it was), resealed (digest recomputed), or as a version 1 manifest (no digest)."""
    doc = json.loads(manifest_bytes(home, name))
    doc["codec"]["scheme"] = "turbo2"
    if how == "digest left":
        data = canonical_json(doc)
    elif how == "digest recomputed":
        data = seal(doc)
    else:
        doc.pop("digest", None)
        data = canonical_json({**doc, "version": 1})
    write_record(home, b"manifests", name.encode(), data)


@pytest.fixture(scope="module")
def saved_doc(root, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("edited") / "home"
    store = open_store(home)
    try:
        Engine(store, prefill_chunk=64).save("doc", DOCUMENT, model=str(root / "model"), scheme="turbo4")
    finally:
        store.close()
    return home


@pytest.mark.parametrize("how", ["digest left", "digest recomputed", "version 1 manifest"])
def test_an_edited_scheme_is_a_problem_never_a_silent_cold_prefill(saved_doc, tmp_path, how, ledger):
    """Before: "scheme": "turbo4" -> "turbo2" passed verify and info, and ask ignored the cache
    and prefilled cold under turbo2 (rc 0)."""
    home = tmp_path / "home"
    shutil.copytree(saved_doc, home)
    edit_manifest(home, "doc", how)
    store = open_store(home)
    try:
        engine = Engine(store, prefill_chunk=64)
        if how == "digest left":
            problems = store.verify()
            assert [(p.entry, p.kind) for p in problems] == [("doc", "manifest")], problems
            assert "digest does not match" in problems[0].detail
            with pytest.raises(MalformedHeader, match="digest does not match"):
                engine.ask("doc", "Who pays?", max_tokens=2)
            outcome = "verify lists it, ask refused (MalformedHeader)"
        else:
            with pytest.raises(IdentityMismatch, match="codec digest"):
                engine.ask("doc", "Who pays?", max_tokens=2)
            outcome = "ask refused (IdentityMismatch: scheme vs codec digest)"
    finally:
        store.close()
    if how == "digest left":
        done = cli("verify", "--home", str(home))
        assert done.returncode == 1 and "digest does not match" in done.stdout + done.stderr, done.stderr
    ledger.count("edited manifest", f"scheme turbo4 -> turbo2, {how}: {outcome}")
    ledger.count("edited manifest", "wrong (silent cold prefill, verify passed)", 0)


# -- 6. a full disk: reads, refusals before the prefill, recovery -------------------------------


@pytest.mark.skipif(not unshare_works(), reason="no private mount namespace here (unshare -rm)")
def test_a_full_disk_serves_reads_and_rm_gc_bring_it_back(root, tmp_path, ledger):
    """Before: every model load rewrote models.json (with fsync), so `ask` failed on a full disk;
    after LMDB's own ENOSPC, rm + gc left saves failing and `gc --compact` refused; a save was
    refused only after its prefill."""
    mount = tmp_path / "disk"
    mount.mkdir()
    settings = json.dumps({"home": str(mount / "home"), "model": str(root / "model"), "config": {}})
    python = shlex.quote(sys.executable)
    script = (f"mount -t tmpfs -o size={8 << 20} tmpfs {shlex.quote(str(mount))} && "
              f"{python} {shlex.quote(str(HERE / 'workers.py'))} full_disk {shlex.quote(settings)}")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=600,
                          env=child_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    print(json.dumps(out, indent=1))
    assert out["free_after_fill"] < 4096
    for read in ("ask", "ls", "verify"):  # ls and verify in-process (no model: the same store code)
        assert out[read][0] == 0, (read, out[read])
        ledger.count("full disk (tmpfs 8 MiB)", f"{read} on the full disk: works")
    assert not out["registry_rewritten"]
    ledger.count("full disk (tmpfs 8 MiB)", "models.json not written by reads")
    code, text = out["save_full"]
    assert code == 1 and "DiskFull" in text or "full" in text, out["save_full"]
    assert "before" in text, out["save_full"]  # refused before its prefill
    ledger.count("full disk (tmpfs 8 MiB)", "save refused before its prefill (DiskFull)")
    assert all(o == "stored" or o.startswith("DiskFull") for o in out["tight"]), out["tight"]
    assert "DiskFull (LMDB)" in out["tight"], out["tight"]
    for outcome in out["tight"]:
        ledger.count("full disk (tmpfs 8 MiB)", f"put with about its payload free: {outcome}")
    assert out["free_before_recovery"] < 4096
    assert "compaction skipped" in out["gc_compact"][1], out["gc_compact"]
    for step in ("rm", "gc", "save_after_gc", "ask_after_gc", "gc_compact", "verify_end"):
        assert out[step][0] == 0, (step, out[step])
        ledger.count("full disk (tmpfs 8 MiB)", f"after LMDB's ENOSPC, disk still full: {step} works")
    ledger.count("full disk (tmpfs 8 MiB)", "wrong (read failed, store stuck)", 0)


def test_reads_write_nothing_and_a_refused_save_costs_no_prefill(root, tmp_path, monkeypatch, ledger):
    """The full disk where no filesystem can be mounted: every file write fails with ENOSPC and
    the guard keeps more free than the disk has. Before: `ask` failed writing models.json, and a
    save ran its whole prefill before DiskFull."""
    home = tmp_path / "home"
    store = open_store(home)
    try:
        Engine(store, prefill_chunk=64).save("doc", DOCUMENT, model=str(root / "model"), scheme="turbo4")
    finally:
        store.close()

    def no_space(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(durable, "write_file_atomic", no_space)  # every cache file (durable.write_cache_file)
    store = open_store(home, min_free_disk_bytes=1 << 60)
    try:
        engine = Engine(store, prefill_chunk=64)
        assert engine.ask("doc", "Who pays?", max_tokens=2).cached_tokens == len(store.get("doc").tokens)
        prefilled = []

        def counted_prefill(self, *args, **kwargs):  # what save runs (Prefiller.prefill_steps), counted
            prefilled.append(1)
            return 0.0
            yield

        monkeypatch.setattr(Prefiller, "prefill_steps", counted_prefill)
        with pytest.raises(DiskFull, match="before the prefill"):
            engine.save("big", DOCUMENT + " More text.", model=str(root / "model"), scheme="turbo4")
        assert prefilled == []
    finally:
        store.close()
    ledger.count("full disk (every write ENOSPC, guard over the disk)", "ask worked, nothing written")
    ledger.count("full disk (every write ENOSPC, guard over the disk)", "save refused before its prefill")


def test_repair_stores_a_sound_manifest_under_a_bad_key_again_under_its_own_name(records_source, tmp_path, ledger):
    home = tmp_path / "home"
    shutil.copytree(records_source, home)
    data = manifest_bytes(home, "e2")
    env = lmdb.open(str(home / "lmdb"), max_dbs=16)
    with env.begin(write=True) as txn:
        manifests = env.open_db(b"manifests", txn=txn)
        txn.delete(b"e2", db=manifests)
        txn.put(b"e2\xff", data, db=manifests)
    env.close()
    result = repair_home(load_config(home, TEST_SETTINGS))
    assert result.rekeyed == ("e2",) and result.remaining == () and result.gc.orphans == 0, result
    store = open_store(home)
    try:
        assert [e.name for e in store.ls()] == ["e0", "e1", "e2"] and store.load("e2")[1].tokens == 812
    finally:
        store.close()
    ledger.count("damaged index records", "sound manifest under a bad key: repair stored it under its own name")
