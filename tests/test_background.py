"""The background writer of `tqstore serve`: saves run off the caller's thread, in order; a
prompt waits only for the saves of its own prefixes; closing gives queued saves a deadline."""

import threading

import pytest

from tqstore.engine.background import BackgroundWriter


@pytest.fixture
def writer():
    w = BackgroundWriter()
    yield w
    w.close(5)


def test_a_prompt_waits_only_for_saves_of_its_own_prefixes(writer):
    gate, ran = threading.Event(), []
    future = writer.submit([1, 2, 3], lambda: gate.wait(5) and ran.append("first"))
    assert writer.pending() == 1
    assert writer.wait_for([7, 8, 9, 10], timeout=0)  # another prefix: no wait at all
    assert writer.wait_for([1, 2], timeout=0)  # shorter than the pending prefix: lookup cannot use it
    assert not writer.wait_for([1, 2, 3, 4], timeout=0.05)  # extends it: waits for it
    gate.set()
    assert writer.wait_for([1, 2, 3, 4], timeout=5) and future.result() is None and ran == ["first"]
    assert writer.pending() == 0


def test_saves_run_in_order_and_errors_stay_with_their_future(writer):
    order = []

    def fail():
        raise OSError("disk gone")

    futures = [writer.submit([i], lambda i=i: order.append(i)) for i in range(3)]
    bad = writer.submit([9], fail)
    after = writer.submit([10], lambda: order.append(10))
    assert after.result(5) is None and [f.result() for f in futures] == [None] * 3
    assert order == [0, 1, 2, 10] and isinstance(bad.exception(), OSError)


def test_close_waits_for_queued_saves_up_to_its_timeout():
    writer, gate = BackgroundWriter(), threading.Event()
    writer.submit([1], lambda: gate.wait(5))
    assert writer.close(timeout=0.05) is False  # still writing: the caller is told
    with pytest.raises(RuntimeError):
        writer.submit([2], lambda: None)
    gate.set()
    assert writer.close(timeout=5) is True
