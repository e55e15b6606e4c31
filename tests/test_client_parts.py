"""The client's bookkeeping and key copies on their own, without a daemon."""

from __future__ import annotations

import threading

import pytest
from conftest import wait_until

from kvdepot.client.jobs import JobBook
from kvdepot.client.key_copy import MAX_EARLY_ENGINES, EngineCopies, EngineHandle
from kvdepot.proto import kvdepot_pb2 as pb


def test_a_job_id_in_flight_is_not_disturbed_by_a_second_submit_of_it():
    book = JobBook()
    assert book.begin(1)
    assert not book.begin(1)  # the daemon refuses the duplicate; job 1 stays tracked
    book.finish(1, True)
    assert [(r.job_id, r.ok) for r in book.take_finished()] == [(1, True)]
    assert book.begin(1)  # taken: the id may be used again


def test_results_are_handed_over_once_and_waits_keep_theirs():
    book = JobBook()
    for job_id in (1, 2, 3):
        book.begin(job_id)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(book.wait([2], timeout=5)))
    waiter.start()
    wait_until(lambda: 2 in book._awaited, what="the waiter blocked on job 2")
    book.finish(1, True)
    book.finish(2, False, "it broke")
    # take_finished leaves job 2 to the wait blocked on it.
    assert [r.job_id for r in book.take_finished()] == [1]
    waiter.join(5)
    assert not got[2].ok and got[2].error == "it broke"
    assert book.take_finished() == []
    with pytest.raises(KeyError, match="no job 2"):
        book.wait([2], timeout=0)
    with pytest.raises(TimeoutError, match="1 job\\(s\\) still in flight"):
        book.wait([3], timeout=0.05)


def test_a_stores_counts_reach_its_result_whichever_comes_first():
    book = JobBook()
    book.begin(1)
    book.begin(2)
    book.store_counts(1, 3, 1)  # the submit's answer first
    book.finish(1, True)
    book.finish(2, True)
    book.store_counts(2, 5, 0)  # the end first
    results = book.wait([1, 2], timeout=0)
    assert (results[1].already_stored, results[1].not_stored) == (3, 1)
    assert (results[2].already_stored, results[2].not_stored) == (5, 0)
    book.store_counts(2, 9, 9)  # handed over already: nobody reads it, nothing kept
    assert book.take_finished() == []


def test_fail_all_ends_every_job_in_flight_once():
    book = JobBook()
    for job_id in (1, 2):
        book.begin(job_id)
    book.fail_all("kvdepotd went away")
    results = book.take_finished()
    assert sorted((r.job_id, r.ok, r.error) for r in results) == [(1, False, "kvdepotd went away"),
                                                                   (2, False, "kvdepotd went away")]
    book.finish(2, True)  # ended already: a late JobDone changes nothing
    assert book.take_finished() == []


def test_a_jobs_end_hook_runs_once_and_decides_its_result():
    book = JobBook()
    calls = []

    def on_end(ok, error):
        calls.append(ok)
        return False, "the copy out of the staging memory failed"

    book.begin(7, on_end)
    book.finish(7, True)
    book.finish(7, True)
    book.fail_all("kvdepotd went away")
    assert calls == [True]
    assert [(r.job_id, r.ok, r.error) for r in book.take_finished()] == [
        (7, False, "the copy out of the staging memory failed")
    ]


def changed(engine_id: int, ready=(), storing=(), dropped=()) -> pb.BlocksChanged:
    return pb.BlocksChanged(engine_id=engine_id, ready=ready, storing=storing, dropped=dropped)


def test_the_copy_follows_the_daemons_changes_and_answers_lookups():
    copies = EngineCopies()
    engine = EngineHandle(pb.NamespaceSpec(model="m"), track_removed=True)
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    copies.attached("s1")
    # The registration's snapshot may come before its answer.
    copies.note("s1", changed(7, ready=[a], storing=[b]))
    copies.registered(engine, "s1", 7, "m:...")
    assert engine.lookup([a, b, c], 0) == (1, True)
    copies.note("s1", changed(7, ready=[b], storing=[c]))
    assert engine.lookup([a, b, c, d], 0) == (2, True)
    assert engine.lookup([a, b, c, d], 1) == (1, True)
    copies.note("s1", changed(7, dropped=[a, c]))
    assert engine.lookup([a, b], 0) == (0, False)
    assert copies.take_removed(engine) == [a] and copies.take_removed(engine) == []
    # The session ends: everything it knew is gone, and said so.
    copies.forget_all([engine])
    assert engine.engine_id is None and engine.lookup([b], 0) == (0, False)
    assert copies.take_removed(engine) == [b]


def test_changes_for_registrations_that_never_answer_are_bounded():
    copies = EngineCopies()
    for engine_id in range(100):
        copies.note("s1", changed(engine_id, ready=[bytes(32)]))
    assert len(copies._early) == MAX_EARLY_ENGINES


def test_an_answer_of_an_ended_session_registers_nothing_and_ids_are_not_misrouted():
    copies = EngineCopies()
    mine, other = EngineHandle(pb.NamespaceSpec(model="m")), EngineHandle(pb.NamespaceSpec(model="n"))
    copies.attached("s1")
    copies.registered(mine, "s1", 1, "m")
    copies.forget_all([mine, other])
    # The daemon restarted: engine ids start again, and a late answer of s1 comes in.
    copies.attached("s2")
    copies.registered(mine, "s1", 1, "m")
    assert mine.engine_id is None
    copies.registered(other, "s2", 1, "n")
    copies.note("s2", changed(1, ready=[bytes(32)]))
    assert other.ready == {bytes(32)} and mine.ready == set()
