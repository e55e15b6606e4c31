"""The Python lane's gate (server/transports/cuda_streams.py ComputeGate), which
holds a CUDA store until its worker's compute event has completed, without a
GPU: the event is a stand-in that completes when the test says, and counts how
often it is asked. (The native lane's gate: tests/test_native_cuda_fake.py.)"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from kvdepot.server.transports.cuda_streams import ComputeGate


class ComputeEvent:
    """What the gate asks of a worker's compute event: query(), True once done."""

    def __init__(self) -> None:
        self.done = False
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        return self.done


def _opened(loop, opened: list, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not opened and time.monotonic() < deadline:
        loop.run_until_complete(asyncio.sleep(0.005))


def test_a_store_waiting_through_a_long_compute_is_asked_a_few_hundred_times_and_opens_once_done():
    # A forward pass of half a second: asked every 20 us for the first half
    # millisecond, then every quarter of the wait (at most every 1 ms), about
    # 540 asks; asking every 20 us throughout made thousands.
    loop = asyncio.new_event_loop()
    opened, failed = [], []
    gate = ComputeGate(loop, opened.append, lambda job, why: failed.append(why))
    try:
        job, event = SimpleNamespace(session=SimpleNamespace(ended=False)), ComputeEvent()
        gate.hold(job, event)
        time.sleep(0.5)
        asked = event.asked
        assert not opened and not failed
        event.done = True
        released = time.monotonic()
        _opened(loop, opened)
        assert opened == [job] and not failed
        assert time.monotonic() - released < 0.5
        assert 20 < asked < 1000
    finally:
        gate.stop()
        loop.close()


def test_a_store_whose_client_went_away_fails_at_the_gate_without_waiting_for_its_compute():
    loop = asyncio.new_event_loop()
    opened, failed = [], []
    gate = ComputeGate(loop, opened.append, lambda job, why: failed.append(why))
    try:
        job, event = SimpleNamespace(session=SimpleNamespace(ended=False)), ComputeEvent()
        gate.hold(job, event)
        time.sleep(0.05)  # past the first half millisecond: asked rarely now
        job.session.ended = True
        deadline = time.monotonic() + 2
        while not failed and time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.005))
        assert failed == ["the client went away before its compute finished"] and not opened
    finally:
        gate.stop()
        loop.close()


def test_stores_leave_the_gate_in_the_order_they_came():
    # The first store has waited long enough to be asked only every
    # millisecond; the second comes with its compute done. The first's compute
    # came first, so it is done too: both open at once, the first first.
    loop = asyncio.new_event_loop()
    opened, failed = [], []
    gate = ComputeGate(loop, opened.append, lambda job, why: failed.append(why))
    try:
        first, second = (SimpleNamespace(name=name, session=SimpleNamespace(ended=False)) for name in ("1", "2"))
        first_event, second_event = ComputeEvent(), ComputeEvent()
        gate.hold(first, first_event)
        time.sleep(0.05)
        asked = first_event.asked
        while first_event.asked == asked:  # just asked: its next ask is a millisecond away
            time.sleep(0.0001)
        first_event.done = second_event.done = True
        gate.hold(second, second_event)
        deadline = time.monotonic() + 2
        while len(opened) < 2 and time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.001))
        assert [job.name for job in opened] == ["1", "2"] and not failed
    finally:
        gate.stop()
        loop.close()
