"""Push and pull through a faulty network: a proxy on loopback (s3_proxy.py) in front of the moto
server injects 500s, 503s, timeouts, late answers, slow answers, dropped connections, bodies
cut mid-way, 412/409 races and a server that is down.

Each push or pull either completes (the S3 tier's retries) or fails cleanly with a RemoteError
subclass (or ConflictError for a lost race); then, faults gone, the same command completes, and
the requests counted by the proxy show that no finished block was uploaded again (push) and
no object already stored locally was downloaded again (pull). The bucket then holds a good
entry: it pulls directly (no proxy) into an empty home and loads identically.
"""

from __future__ import annotations

import pytest

from harness import open_store, s3_settings
from s3_proxy import S3Proxy
from test_blocks import assert_same_snapshot
from tqstore.store import transfer
from tqstore.store.packs import PACK_TAIL, parse_trailer
from tqstore.errors import ConflictError, CorruptBlock, RemoteError, RemoteUnreachable, TqstoreError
from workers import put

# Short timeouts so that injected timeouts cost little; botocore's own retries (3 attempts)
# and the tier's body-read retries stay as configured for users.
SETTINGS = {"s3_max_attempts": 3, "s3_connect_timeout": 1, "s3_read_timeout": 1.0, "s3_concurrency": 2}
LATE = 1.6  # longer than the read timeout



def LONG(*scenario):  # noqa: N802 - reads as a marker in the table
    """A scenario that costs seconds of waiting (timeouts, backoff): the long run only."""
    return pytest.param(*scenario, marks=pytest.mark.reliability_long, id=f"{scenario[0]}: {scenario[1]}")


PUT_OBJ, GET_OBJ, PUT_MAN = {"method": "PUT", "kind": "object"}, {"method": "GET", "kind": "object"}, \
    {"method": "PUT", "kind": "manifest"}
SCENARIOS = [
    ("push", "500 InternalError twice", [dict(action="status", times=2, **PUT_OBJ)], None),
    LONG("push", "503 SlowDown twice", [dict(action="status", status=503, code="SlowDown", times=2, **PUT_OBJ)],
         None),
    ("push", "500 on every object PUT after the second", [dict(action="status", after=2, **PUT_OBJ)], RemoteError),
    ("push", "a timeout", [dict(action="timeout", delay=LATE, times=1, **PUT_OBJ)], None),
    LONG("push", "timeouts after the second object PUT", [dict(action="timeout", delay=LATE, after=2, **PUT_OBJ)],
         RemoteUnreachable),
    ("push", "an answer lost after the write (late)", [dict(action="late", delay=LATE, times=1, **PUT_OBJ)], None),
    LONG("push", "slow answers", [dict(action="slow", delay=0.3, **PUT_OBJ)], None),
    ("push", "a dropped connection", [dict(action="drop", times=1, **PUT_OBJ)], None),
    ("push", "connections dropped after the second object PUT", [dict(action="drop", after=2, **PUT_OBJ)],
     RemoteUnreachable),
    ("push", "a spurious 412 on an object PUT",
     [dict(action="status", status=412, code="PreconditionFailed", times=1, **PUT_OBJ)], None),
    ("push", "a 409 race on the manifest PUT",
     [dict(action="status", status=409, code="ConditionalRequestConflict", times=1, **PUT_MAN)], None),
    ("push", "a 412 race on the manifest PUT",
     [dict(action="status", status=412, code="PreconditionFailed", times=1, **PUT_MAN)], ConflictError),
    LONG("pull", "500 InternalError twice", [dict(action="status", times=2, **GET_OBJ)], None),
    ("pull", "a body cut mid-way", [dict(action="cut", times=1, **GET_OBJ)], None),
    ("pull", "bodies cut after the second object GET", [dict(action="cut", after=2, **GET_OBJ)], RemoteUnreachable),
    ("pull", "a timeout", [dict(action="timeout", delay=LATE, times=1, **GET_OBJ)], None),
    LONG("pull", "timeouts after the second object GET", [dict(action="timeout", delay=LATE, after=2, **GET_OBJ)],
         RemoteUnreachable),
    ("pull", "500 on every object GET after the second", [dict(action="status", after=2, **GET_OBJ)], RemoteError),
    LONG("pull", "slow answers", [dict(action="slow", delay=0.3, **GET_OBJ)], None),
]


@pytest.fixture
def proxy(s3):
    p = S3Proxy(s3.endpoint)
    yield p
    p.stop()


def entries(store) -> dict[str, object]:
    """Two entries sharing their first two blocks and their codecs."""
    return {name: put(store, name, n, seed).snapshot for name, n, seed in (("a", 600, 1), ("b", 300, 2))}


def check_bucket(s3, tmp_path, snaps: dict[str, object]) -> None:
    """The bucket's entries pull without the proxy into an empty home and load identically."""
    fresh = open_store(tmp_path / "fresh", **s3_settings(s3))
    try:
        for name, snap in snaps.items():
            fresh.pull(name)
            assert_same_snapshot(fresh.load(name)[0], snap)
        assert fresh.verify() == []
    finally:
        fresh.close()


def members(store, pack: str) -> set[bytes]:
    """The keys of pack `pack`'s members, from its index."""
    tier = store._tiers.s3
    return {key for key, *_ in parse_trailer(tier.get_tail(pack, PACK_TAIL), pack, lambda b: tier.open_index(pack, b))}


def attempt(fn, expect: type | None) -> str:
    """Run `fn`; it completes (expect None) or fails cleanly with `expect`. Returns the outcome."""
    try:
        fn()
    except TqstoreError as exc:
        assert expect is not None and isinstance(exc, expect), f"{type(exc).__name__}: {exc}"
        assert "\n" not in str(exc) and str(exc)
        return f"failed cleanly ({type(exc).__name__})"
    assert expect is None, f"completed although {expect.__name__} was expected"
    return "completed"


@pytest.mark.parametrize("op,label,faults,expect", SCENARIOS,
                         ids=[s.id if hasattr(s, "id") else f"{s[0]}: {s[1]}" for s in SCENARIOS])
def test_transfers_complete_or_fail_cleanly_and_resume(op, label, faults, expect, s3, proxy, tmp_path, ledger,
                                                       monkeypatch):
    scenario = "S3 faults"
    monkeypatch.setattr(transfer, "PACK_BYTES", 1)  # a pack per object: faults "after the second" hit mid-push
    via_proxy = s3_settings(s3, proxy.endpoint, **SETTINGS)
    if op == "push":
        store = open_store(tmp_path / "origin", **via_proxy)
        snaps = entries(store)
        for fault in faults:
            proxy.inject(**fault)
        outcome = attempt(lambda: [store.push(n) for n in snaps], expect)
        proxy.clear()
        for name in snaps:
            store.push(name)
        uploads = proxy.paths("PUT", "object")
        assert uploads and max(uploads.values()) == 1, f"an object was uploaded twice: {uploads}"
        objects = {r.key for name in snaps for r in store.get(name).objects}
        assert len(uploads) + proxy.count("PUT", "object", "late") == len(objects)
        store.close()
        resumed = "resumed: no finished block uploaded again"
    else:
        origin = open_store(tmp_path / "origin", **s3_settings(s3))
        snaps = entries(origin)
        for name in snaps:
            origin.push(name)
        origin.close()
        store = open_store(tmp_path / "reader", **{**via_proxy, "s3_concurrency": 1})
        for fault in faults:
            proxy.inject(**fault)
        outcome = attempt(lambda: [store.pull(n) for n in snaps], expect)
        proxy.clear()
        kept = set(store._tiers.lmdb.iter_object_keys())
        proxy.reset_counts()
        for name in snaps:
            store.pull(name)
            assert_same_snapshot(store.load(name)[0], snaps[name])
        ranged = proxy.paths("GET", "object", "relayed 206")  # ranged GETs of packs
        again = {key for p in ranged for key in members(store, p.rsplit("/", 1)[1])}
        assert not again & kept, "an object stored before the failure was downloaded again"
        assert store.verify() == []
        store.close()
        resumed = "resumed: nothing stored downloaded again"
    check_bucket(s3, tmp_path, snaps)
    ledger.count(scenario, f"{op}: {outcome}")
    if expect is not None:
        ledger.count(scenario, f"{op}: {resumed}")
    ledger.count(scenario, "faults injected", sum(f.applied for f in proxy.faults) or len(faults))


def test_server_down_then_back(s3, proxy, tmp_path, ledger):
    """The endpoint refuses connections: push, pull, a remote lookup and ls --remote fail cleanly
    (RemoteUnreachable, or a restore miss naming it); nothing is marked gone; once it is back,
    everything completes."""
    store = open_store(tmp_path / "origin", **s3_settings(s3, proxy.endpoint, **SETTINGS))
    snaps = entries(store)
    store.push("a")
    proxy.stop()
    with pytest.raises(RemoteUnreachable, match="cannot reach S3"):
        store.push("b")
    reader = open_store(tmp_path / "reader", **s3_settings(s3, proxy.endpoint, **SETTINGS))
    with pytest.raises(RemoteUnreachable):
        reader.pull("a")
    with pytest.raises(RemoteUnreachable):
        reader.ls(remote=True)
    proxy.start()
    match = reader.lookup(store.get("a").tokens + (1,), model=store.get("a").model_digest,
                          codec=store.get("a").codec_digest)
    assert match is not None and match.remote
    proxy.stop()
    with pytest.raises(CorruptBlock, match="cannot reach S3"):
        reader.restore(match)
    assert all(reader._tiers.remote.has(r.key) for r in match.manifest.objects), "an outage marked objects gone"
    proxy.start()
    snap, stats = reader.restore(match)
    assert stats.tier == "s3" and stats.tokens == len(store.get("a").tokens)
    store.push("b")
    reader.pull("b")
    assert_same_snapshot(reader.load("b")[0], snaps["b"])
    store.close()
    reader.close()
    check_bucket(s3, tmp_path, snaps)
    ledger.count("S3 faults", "server down: push, pull, ls --remote, restore failed cleanly", 4)
    ledger.count("S3 faults", "server back: push, pull, restore completed", 3)
