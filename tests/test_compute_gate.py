"""The Python lane's gate (server/transports/cuda_streams.py ComputeGate), which
holds a CUDA store until its worker's compute event has completed, without a
GPU: the event is a stand-in that completes when the test says, and counts how
often it is asked. (The native lane's gate: tests/test_native_cuda_fake.py.)"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from kvdepot.server.transports.cuda_streams import ComputeGate


class ComputeEvent:
    """What the gate asks of a worker's compute event: query(), True once done."""

    def __init__(self) -> None:
        self.done = False
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        return self.done


class Rig:
    """A gate on an event loop of its own, and what it opened and failed."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.opened, self.failed = [], []
        self.gate = ComputeGate(self.loop, self.opened.append, lambda job, why: self.failed.append(why))

    def run_until(self, done, timeout: float = 2.0) -> None:
        """Runs the loop (the gate's callbacks) until done() or the timeout."""
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            self.loop.run_until_complete(asyncio.sleep(0.001))


@pytest.fixture
def rig():
    rig = Rig()
    yield rig
    rig.gate.stop()
    rig.loop.close()


def store(name: str = "") -> SimpleNamespace:
    return SimpleNamespace(name=name, session=SimpleNamespace(ended=False))


def test_a_store_waiting_through_a_long_compute_is_asked_a_few_hundred_times_and_opens_once_done(rig):
    # A forward pass of half a second: asked every 40 us for the first half
    # millisecond, then every quarter of the wait (at most every 1 ms), about
    # 520 asks; asking every 20 us throughout made thousands.
    job, event = store(), ComputeEvent()
    rig.gate.hold(job, event)
    time.sleep(0.5)
    asked = event.asked
    assert not rig.opened and not rig.failed
    event.done = True
    released = time.monotonic()
    rig.run_until(lambda: rig.opened)
    assert rig.opened == [job] and not rig.failed
    assert time.monotonic() - released < 0.5
    assert 20 < asked < 1000


def test_a_store_whose_client_went_away_fails_at_the_gate_without_waiting_for_its_compute(rig):
    job, event = store(), ComputeEvent()
    rig.gate.hold(job, event)
    time.sleep(0.05)  # past the first half millisecond: asked rarely now
    job.session.ended = True
    rig.run_until(lambda: rig.failed)
    assert rig.failed == ["the client went away before its compute finished"] and not rig.opened


def test_stores_whose_computes_take_alike_are_not_asked_before_most_of_it_has_passed(rig):
    # Stores that each wait 30 ms for their compute, as a worker's stores wait
    # for its forward passes: once the gate has seen a few, a store is first
    # asked again at 3/4 of the shortest recent wait, about 10 asks each; on
    # the schedule alone (every 40 us, then every quarter of its wait, at most
    # every 1 ms) each would be asked several dozen times.
    asks = []
    for i in range(10):
        job, event = store(str(i)), ComputeEvent()
        rig.gate.hold(job, event)
        time.sleep(0.03)
        asks.append(event.asked)
        event.done = True
        rig.run_until(lambda n=i + 1: len(rig.opened) == n)
    assert len(rig.opened) == 10 and not rig.failed
    assert max(asks[-4:]) <= 22, asks
    # A store asked early, because another store came done, was done at some
    # time unknown: it teaches no wait, and the next store is still asked a
    # few times, not as if waits were short.
    early, early_event = store("early"), ComputeEvent()
    rig.gate.hold(early, early_event)
    time.sleep(0.01)
    early_event.done = True
    came_done, came_done_event = store("came done"), ComputeEvent()
    came_done_event.done = True
    rig.gate.hold(came_done, came_done_event)
    rig.run_until(lambda: len(rig.opened) == 12)
    assert [job.name for job in rig.opened[-2:]] == ["early", "came done"]
    job, event = store("alike"), ComputeEvent()
    rig.gate.hold(job, event)
    time.sleep(0.03)
    asked = event.asked
    event.done = True
    rig.run_until(lambda: len(rig.opened) == 13)
    assert asked <= 22, asked
    # Shorter computes after them: the first is seen late by at most 3/4 of
    # the shortest recent wait; it puts the next ones back on the schedule,
    # where they are seen a few ms late at most.
    late = []
    for i in range(3):
        job, event = store(f"short {i}"), ComputeEvent()
        rig.gate.hold(job, event)
        time.sleep(0.002)
        event.done = True
        released = time.monotonic()
        rig.run_until(lambda n=14 + i: len(rig.opened) == n)
        late.append(time.monotonic() - released)
        assert rig.opened[-1] is job
    assert late[0] < 0.2 and max(late[1:]) < 0.012, late


def test_a_workers_later_store_does_not_leave_the_gate_before_its_earlier_one(rig):
    # Stores 1 and 2 of a worker wait for their computes, asked every
    # millisecond by now. Store 3, another's, comes done: every waiting store
    # is asked. Both computes end between the asks of stores 1 and 2 (store
    # 2's event, asked after store 3's, ends both). Asked oldest first, store 2
    # would be seen done and store 1 not, and 2 would open first; asked newest
    # first, 1 is asked after 2 and is done too.
    first, second, third = store("1"), store("2"), store("3")
    first_event, third_event = ComputeEvent(), ComputeEvent()

    class EndsBoth(ComputeEvent):
        def query(self) -> bool:
            if third_event.asked:
                self.done = first_event.done = True
            return super().query()

    rig.gate.hold(first, first_event)
    rig.gate.hold(second, EndsBoth())
    time.sleep(0.05)
    third_event.done = True
    rig.gate.hold(third, third_event)
    rig.run_until(lambda: len(rig.opened) == 3)
    assert [job.name for job in rig.opened] == ["1", "2", "3"] and not rig.failed


def test_stores_leave_the_gate_in_the_order_they_came(rig):
    # The first store has waited long enough to be asked only every
    # millisecond; the second comes with its compute done. The first's compute
    # came first, so it is done too: both open at once, the first first.
    first, second = store("1"), store("2")
    first_event, second_event = ComputeEvent(), ComputeEvent()
    rig.gate.hold(first, first_event)
    time.sleep(0.05)
    asked = first_event.asked
    while first_event.asked == asked:  # just asked: its next ask is a millisecond away
        time.sleep(0.0001)
    first_event.done = second_event.done = True
    rig.gate.hold(second, second_event)
    rig.run_until(lambda: len(rig.opened) == 2)
    assert [job.name for job in rig.opened] == ["1", "2"] and not rig.failed
