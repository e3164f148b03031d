"""The bridge from the model worker's thread to the event loop (tqstore/serve/streams.py), on a
real asyncio loop: one wakeup of the loop for the events handed over before it runs, texts that
wait joined into one event, and a stream's texts paced to one event per interval."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tqstore.serve.jobs import Finished, Job, Text
from tqstore.serve.options import parse_args
from tqstore.serve.streams import ClientGone, JobEvents, Mailbox, TextPacer


def _never_disconnects():
    forever = asyncio.Event()

    async def receive():
        await forever.wait()

    return receive


def _disconnects():
    async def receive():
        return {"type": "http.disconnect"}

    return receive


def _counting_wakeups(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Counts the loop's call_soon_threadsafe calls (the real method still runs)."""
    calls = [0]
    real = loop.call_soon_threadsafe

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    loop.call_soon_threadsafe = counted
    return calls


def _from_worker(post) -> None:
    """Run `post` on another thread and wait for it, without letting the loop run meanwhile."""
    thread = threading.Thread(target=post)
    thread.start()
    thread.join()


def test_events_handed_over_before_the_loop_runs_wake_it_once():
    async def main():
        mailbox = Mailbox()
        jobs = [JobEvents(_never_disconnects(), mailbox, texts=True) for _ in range(8)]
        wakeups = _counting_wakeups(asyncio.get_running_loop())

        def step():  # one decode step's token for each of 8 streams, then one more step
            for _ in range(2):
                for i, job in enumerate(jobs):
                    job.sink(Text(f"t{i}"))

        _from_worker(step)
        got = [await job.next_event() for job in jobs]
        assert wakeups[0] == 1
        assert [e.text for e in got] == [f"t{i}t{i}" for i in range(8)]
        _from_worker(lambda: jobs[0].sink(Finished("done")))
        assert await jobs[0].next_event() == Finished("done")
        assert wakeups[0] == 2  # a delivery after the loop emptied the mailbox wakes it again

    asyncio.run(main())


def test_waiting_texts_join_into_one_event_and_the_end_comes_after_them():
    async def main():
        job = JobEvents(_never_disconnects(), Mailbox(), texts=True)
        _from_worker(lambda: [job.sink(e) for e in (Text("a"), Text("b"), Text("c"), Finished(1), Text("late"))])
        assert await job.next_event() == Text("abc")
        assert await job.next_event() == Finished(1)

    asyncio.run(main())


def test_a_whole_response_drops_texts_on_the_worker_side():
    async def main():
        job = JobEvents(_never_disconnects(), Mailbox(), texts=False)
        _from_worker(lambda: [job.sink(e) for e in (Text("a"), Text("b"), Finished("whole"))])
        assert await job.result() == "whole"

    asyncio.run(main())


def test_a_paced_text_waits_for_the_texts_after_it_until_the_interval_ends():
    async def main():
        loop = asyncio.get_running_loop()
        job = JobEvents(_never_disconnects(), Mailbox(), texts=True)
        pacer = TextPacer(0.2)
        assert pacer.hold_until() is None  # the first text goes at once
        _from_worker(lambda: job.sink(Text("first")))
        assert await job.next_event(pacer.hold_until()) == Text("first")
        pacer.sent()
        sent = loop.time()

        def trickle():  # a token every 20 ms from the worker
            for i in range(5):
                job.sink(Text(str(i)))
                threading.Event().wait(0.02)

        worker = threading.Thread(target=trickle)
        worker.start()
        event = await job.next_event(pacer.hold_until())
        waited = loop.time() - sent
        worker.join()
        assert event == Text("01234") and waited >= 0.2
        pacer.sent()
        _from_worker(lambda: [job.sink(Text("x")), job.sink(Finished("end"))])
        t0 = loop.time()
        assert await job.next_event(pacer.hold_until()) == Text("x")  # the job's end ends the hold
        assert loop.time() - t0 < 0.1
        assert await job.next_event(pacer.hold_until()) == Finished("end")

    asyncio.run(main())


def test_an_interval_of_zero_sends_every_text_as_it_comes():
    pacer = TextPacer(0.0)

    async def main():
        pacer.sent()
        assert pacer.hold_until() is None

    asyncio.run(main())


def test_a_client_that_leaves_cancels_the_job():
    async def main():
        events = JobEvents(_disconnects(), Mailbox(), texts=True)
        events.job = Job("generate", lambda job: iter(()), events.sink)
        with pytest.raises(ClientGone):
            await events.next_event()
        assert events.job.cancelled.is_set()

    asyncio.run(main())


def test_stream_interval_flag():
    base = ["--home", "h", "--model", "m"]
    assert parse_args(base).stream_interval == 0.01
    assert parse_args(base + ["--stream-interval", "0"]).stream_interval == 0.0
    assert parse_args(base + ["--stream-interval", "0.05"]).stream_interval == 0.05
    with pytest.raises(SystemExit) as exit_:
        parse_args(base + ["--stream-interval", "soon"])
    assert exit_.value.code == 2
