"""A thread waiting for its jobs reads their ends off the job socket itself
(client/job_socket.py, JobSocket.lead) while the connection's reader thread
stands aside. Whoever reads, every job's end reaches whoever waits for it,
and a wait ends when its jobs end any other way: tried against the real
daemon with jobs held in flight."""

from __future__ import annotations

import threading
import time

import torch
from conftest import wait_until
from kvcache import attach_worker, prompt_keys


def _wait_in_thread(client, job_ids, timeout=30.0):
    box = {}

    def run():
        try:
            box["results"] = client.wait(job_ids, timeout)
        except Exception as e:  # the test reads it
            box["error"] = e
        box["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _waiting_for_a_held_store(start_held_daemon, client_factory, seed: int):
    """(daemon, client, the thread waiting for store job 1, its box): the job held in the daemon."""
    daemon = start_held_daemon()
    client = client_factory(daemon)
    worker, _, _ = attach_worker(client, seed=seed)
    daemon.hold(1)
    client.submit_store(worker, 1, prompt_keys(1, prompt=seed), [0])
    thread, box = _wait_in_thread(client, [1], timeout=60)
    time.sleep(0.3)  # waiting, and reading the socket
    return daemon, client, thread, box


def test_threads_waiting_at_once_each_get_their_jobs_ends_and_the_reader_takes_over_after(
    start_held_daemon, client_factory
):
    daemon = start_held_daemon()
    client = client_factory(daemon)
    worker, _, tensors = attach_worker(client, seed=21)
    keys = prompt_keys(6, prompt=1)
    for job in range(1, 7):
        daemon.hold(job)
        client.submit_store(worker, job, [keys[job - 1]], [job - 1])
    waits = [_wait_in_thread(client, [job]) for job in range(1, 5)]
    both = _wait_in_thread(client, [5, 6])
    time.sleep(0.3)  # every thread waits; one of them reads the socket
    for job in (4, 2, 6, 3, 1, 5):  # in another order than the waits began
        daemon.release(job)
        time.sleep(0.05)
    for job, (thread, box) in enumerate(waits, start=1):
        thread.join(10)
        assert box["results"][job].ok, box
    both[0].join(10)
    assert both[1]["results"][5].ok and both[1]["results"][6].ok, both[1]
    # Nobody waits now: the connection's reader thread files what ends.
    load = client.submit_load(worker, 7, keys, [10, 11, 12, 13, 14, 15])
    wait_until(lambda: any(r.job_id == load and r.ok for r in client.take_finished()), what="the load's end")
    for tensor in tensors:
        assert torch.equal(tensor[:, 10:16], tensor[:, 0:6])


def test_a_wait_ends_when_another_thread_cancels_its_job(start_held_daemon, client_factory):
    daemon, client, thread, box = _waiting_for_a_held_store(start_held_daemon, client_factory, seed=22)
    cancelled = time.monotonic()
    client.cancel(1, "the engine stopped waiting")
    thread.join(10)
    assert not box["results"][1].ok and "stopped waiting" in box["results"][1].error
    assert box["at"] - cancelled < 2, "the waiting thread did not see its job end"
    daemon.release(1)


def test_a_wait_ends_when_the_daemon_dies_under_it(start_held_daemon, client_factory):
    daemon, _, thread, box = _waiting_for_a_held_store(start_held_daemon, client_factory, seed=23)
    killed = time.monotonic()
    daemon.kill()
    thread.join(15)
    assert "results" in box, box
    assert not box["results"][1].ok
    assert box["at"] - killed < 10


def test_a_wait_that_times_out_leaves_the_job_to_a_later_wait(start_held_daemon, client_factory):
    daemon = start_held_daemon()
    client = client_factory(daemon)
    worker, _, _ = attach_worker(client, seed=24)
    daemon.hold(1)
    client.submit_store(worker, 1, prompt_keys(1, prompt=4), [0])
    began = time.monotonic()
    try:
        client.wait([1], 0.3)
    except TimeoutError:
        pass
    else:
        raise AssertionError("a held job ended")
    assert time.monotonic() - began < 2
    daemon.release(1)
    assert client.wait([1], 10)[1].ok
