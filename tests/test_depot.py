"""The depot on its own: no daemon, no sockets, no protobuf, and a transport
written for these tests.

The in-process transport keeps each worker's memory as a tensor here and
copies a job's bytes when the test lets it, so the tests can hold jobs in
flight and end them, or their sessions, whenever they like.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kvdepot import errors
from kvdepot.client.tensors import tensor_layout, tensor_spec
from kvdepot.keys import KEY_VERSION, block_keys
from kvdepot.server.core.depot import Depot
from kvdepot.server.core.outbox import BlocksChanged, JobDone
from kvdepot.server.core.requests import JobKind, JobRequest, LookupStatus, NamespaceSpec, TensorSpec, WorkerSpec
from kvdepot.server.core.tenants import Identity
from kvdepot.server.core.transport import Transport
from kvdepot.server.host.pool import HostPool

SLOT = 4096

# The depot takes identities as the job socket proves them; one tenant here.
ADMIN = Identity("t", "t", admin=True, uid=0, gid=0)


def identity(pid: int) -> Identity:
    return Identity("t", "t", admin=True, uid=0, gid=0, pid=pid)

BLOCK_BYTES = 1024
NUM_BLOCKS = 64


class InProcessTransport(Transport):
    """Serves workers that register shared-memory handles; copies in this process."""

    name = "in-process (tests)"
    handle_kind = "shared_memory"

    def __init__(self, finish, pool: HostPool):
        self._finish = finish
        self._slots = torch.frombuffer(pool.buffer, dtype=torch.uint8, count=pool.size).view(
            pool.num_slots, pool.slot_bytes
        )
        self.memory: dict[str, torch.Tensor] = {}
        self.hold = False
        self.held: list = []
        self.closed: list[int] = []

    def open_worker(self, worker, request) -> None:
        if worker.device not in self.memory:
            raise errors.InvalidArgument(f"no memory {worker.device}")

    def close_worker(self, worker) -> None:
        self.closed.append(worker.id)

    def start(self, job) -> None:
        if self.hold:
            self.held.append(job)
        else:
            self.run(job)

    def run(self, job, ok: bool = True) -> None:
        if ok:
            memory = self.memory[job.worker.device]
            for block_id, slot in zip(job.block_ids, job.slots):
                if job.kind is JobKind.STORE:
                    self._slots[slot, :BLOCK_BYTES] = memory[block_id]
                else:
                    memory[block_id] = self._slots[slot, :BLOCK_BYTES]
        self._finish(job, ok, "" if ok else "the test failed it")

    def release(self, ok: bool = True) -> None:
        held, self.held = self.held, []
        for job in held:
            self.run(job, ok)

    def abandon(self, job) -> None:
        if job in self.held:
            self.held.remove(job)
            self._finish(job, False, "the client went away during the job")


@pytest.fixture
def depot(tmp_path):
    pool = HostPool(size=16 * SLOT, slot_bytes=SLOT, directory=str(tmp_path), name="depot-test", pin="off")
    depot = Depot(pool, "lru", "test-instance", "test")
    transport = InProcessTransport(depot.finish_job, pool)
    depot.add_transport(transport)
    yield depot, transport
    pool.close()


def namespace(tp_size: int = 1) -> NamespaceSpec:
    return NamespaceSpec(model="m", block_size=16, tp_size=tp_size, key_version=KEY_VERSION)


def worker(depot, transport, session, device: str, rank: int = 0, tp_size: int = 1):
    memory = torch.randint(0, 256, (NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
    transport.memory[device] = memory
    wire = tensor_spec(tensor_layout(memory, 0, "kv"))
    tensor = TensorSpec(wire.name, wire.dtype, tuple(wire.shape), tuple(wire.strides), wire.byte_offset,
                        wire.storage_bytes, wire.block_dim, wire.page_bytes)
    spec = WorkerSpec(namespace(tp_size), rank, device, (tensor,), transport="shared_memory", handles=(None,))
    return depot.register_worker(session.id, spec), memory


def attached_worker(depot, transport):
    """A session with one worker, for the tests that need nothing else."""
    session = depot.attach("c", identity(os.getpid()))
    return session, worker(depot, transport, session, "mem0")[0]


def keys(n: int, prompt: int) -> list[bytes]:
    return block_keys([prompt] * (16 * n), 16)


def store(depot, session, w, job_id: int, ks, block_ids):
    return depot.submit(session.id, JobRequest(JobKind.STORE, w.id, job_id, ks, block_ids))


def load(depot, session, w, job_id: int, ks, block_ids):
    return depot.submit(session.id, JobRequest(JobKind.LOAD, w.id, job_id, ks, block_ids))


def notifications(session) -> list:
    out = []
    while not session.outbox.stream.empty():
        out.append(session.outbox.stream.get_nowait())
    return out


def test_a_store_then_a_load_moves_the_exact_bytes_and_tells_the_client(depot):
    depot, transport = depot
    session = depot.attach("c", identity(os.getpid()))
    w, memory = worker(depot, transport, session, "mem0")
    engine_id, _ = depot.register_engine(session.id, namespace())
    ks = keys(4, prompt=1)
    store(depot, session, w, 1, ks, [0, 1, 2, 3])
    assert depot.lookup(session.id, engine_id, ks).ready == 4
    load(depot, session, w, 2, ks, [10, 11, 12, 13])
    assert torch.equal(memory[10:14], memory[0:4])
    done = [n for n in notifications(session) if isinstance(n, JobDone)]
    assert [(d.job_id, d.ok) for d in done] == [(1, True), (2, True)]
    stats = depot.report(ADMIN)
    assert stats.pinned_slots == 0 and stats.used_slots == 4
    assert (stats.totals.stored_blocks, stats.totals.loaded_blocks) == (4, 4)


def test_a_store_is_invisible_until_it_commits_and_a_failed_one_never_shows(depot):
    depot, transport = depot
    session, w = attached_worker(depot, transport)
    engine_id, _ = depot.register_engine(session.id, namespace())
    notifications(session)
    transport.hold = True
    ks = keys(3, prompt=2)
    store(depot, session, w, 1, ks, [0, 1, 2])
    answer = depot.lookup(session.id, engine_id, ks)
    assert answer.status is LookupStatus.NOT_YET and answer.ready == 0 and answer.storing == 3
    with pytest.raises(errors.FailedPrecondition, match="not stored"):
        load(depot, session, w, 2, ks, [5, 6, 7])
    assert depot.report(ADMIN).pinned_slots == 3
    transport.release(ok=False)
    assert depot.lookup(session.id, engine_id, ks).ready == 0
    stats = depot.report(ADMIN)
    assert stats.used_slots == 0 and stats.pinned_slots == 0 and stats.totals.failed_jobs == 1
    # The engine's copy of the namespace followed: storing, then dropped.
    changed = [n for n in notifications(session) if isinstance(n, BlocksChanged)]
    assert [set(c.storing) for c in changed if c.storing] == [set(ks)]
    assert [set(c.dropped) for c in changed if c.dropped] == [set(ks)]


def test_pinned_blocks_are_never_evicted(depot):
    depot, transport = depot
    session = depot.attach("c", identity(os.getpid()))
    w, memory = worker(depot, transport, session, "mem0")
    engine_id, _ = depot.register_engine(session.id, namespace())
    old = keys(16, prompt=3)
    store(depot, session, w, 1, old, list(range(16)))  # the pool's 16 slots
    transport.hold = True
    load(depot, session, w, 2, old[:2], [40, 41])  # pins the two oldest
    new = keys(16, prompt=4)
    response = store(depot, session, w, 3, new, list(range(16, 32)))
    # Only 14 slots can be taken from unpinned blocks.
    assert response.already_stored == 0 and response.not_stored == 2
    transport.release()
    assert depot.lookup(session.id, engine_id, old[:2]).ready == 2
    assert depot.lookup(session.id, engine_id, old[2:3]).ready == 0
    assert torch.equal(memory[40:42], memory[0:2])
    assert depot.report(ADMIN).totals.evicted_blocks == 14


def test_a_block_is_served_only_once_every_tp_rank_stored_its_shard(depot):
    depot, transport = depot
    a = depot.attach("rank0", identity(os.getpid()))
    b = depot.attach("rank1", identity(os.getpid()))
    w0, m0 = worker(depot, transport, a, "gpu0", rank=0, tp_size=2)
    w1, m1 = worker(depot, transport, b, "gpu1", rank=1, tp_size=2)
    engine_id, _ = depot.register_engine(a.id, namespace(tp_size=2))
    ks = keys(2, prompt=5)
    store(depot, a, w0, 1, ks, [0, 1])
    assert depot.lookup(a.id, engine_id, ks).ready == 0
    with pytest.raises(errors.FailedPrecondition):
        load(depot, b, w1, 2, ks, [5, 6])
    store(depot, b, w1, 3, ks, [2, 3])
    assert depot.lookup(a.id, engine_id, ks).ready == 2
    # Each rank loads its own shard.
    load(depot, a, w0, 4, ks, [8, 9])
    load(depot, b, w1, 5, ks, [8, 9])
    assert torch.equal(m0[8:10], m0[0:2]) and torch.equal(m1[8:10], m1[2:4])
    with pytest.raises(errors.InvalidArgument, match="rank 2 is outside tp_size 2"):
        worker(depot, transport, a, "gpu2", rank=2, tp_size=2)


def test_a_session_that_ends_mid_job_releases_everything_and_others_go_on(depot):
    depot, transport = depot
    gone = depot.attach("gone", identity(os.getpid()))
    stays = depot.attach("stays", identity(os.getpid()))
    w, _ = worker(depot, transport, gone, "mem0")
    other, _ = worker(depot, transport, stays, "mem1")
    engine_id, _ = depot.register_engine(stays.id, namespace())
    stored = keys(4, prompt=6)
    store(depot, stays, other, 1, stored, [0, 1, 2, 3])
    transport.hold = True
    store(depot, gone, w, 1, keys(4, prompt=7), [0, 1, 2, 3])
    load(depot, gone, w, 2, stored, [8, 9, 10, 11])
    assert depot.report(ADMIN).pinned_slots == 8
    depot.end_session(gone)
    stats = depot.report(ADMIN)
    assert stats.pinned_slots == 0 and stats.used_slots == 4 and stats.totals.failed_jobs == 2
    assert [c.client_name for c in stats.clients] == ["stays"] and stats.sessions_ended == 1
    assert transport.closed == [w.id]
    assert depot.jobs_in_flight == 0
    # The other session's blocks are there, and its jobs run.
    assert depot.lookup(stays.id, engine_id, stored).ready == 4
    transport.hold = False
    load(depot, stays, other, 2, stored, [20, 21, 22, 23])
    with pytest.raises(errors.NotFound, match="unknown session"):
        store(depot, gone, w, 3, stored, [0, 1, 2, 3])


def test_a_job_id_is_refused_while_in_flight_and_after_it_finished(depot):
    depot, transport = depot
    session, w = attached_worker(depot, transport)
    engine_id, _ = depot.register_engine(session.id, namespace())
    ks = keys(2, prompt=9)
    transport.hold = True
    store(depot, session, w, 1, ks, [0, 1])
    with pytest.raises(errors.AlreadyExists):
        store(depot, session, w, 1, ks, [0, 1])
    transport.release()
    assert depot.lookup(session.id, engine_id, ks).ready == 2
    assert [n.job_id for n in notifications(session) if isinstance(n, JobDone)] == [1]
    with pytest.raises(errors.AlreadyExists):
        store(depot, session, w, 1, ks, [0, 1])


def test_draining_refuses_new_jobs_and_waits_for_those_in_flight(depot):
    depot, transport = depot
    session, w = attached_worker(depot, transport)
    transport.hold = True
    store(depot, session, w, 1, keys(2, prompt=11), [0, 1])

    async def drain_while_the_job_runs():
        assert not await depot.drain(0.05)
        with pytest.raises(errors.Unavailable, match="shutting down"):
            store(depot, session, w, 2, keys(2, prompt=12), [2, 3])
        asyncio.get_running_loop().call_later(0.05, transport.release)
        return await depot.drain(5)

    assert asyncio.run(drain_while_the_job_runs())
    with pytest.raises(errors.Unavailable):
        depot.attach("late", identity(os.getpid()))


def test_a_miss_notifies_no_engine_when_no_tier_holds_what_dram_let_go(tmp_path):
    """The kept pool is DRAM's own slots: with it alone below DRAM (no disk),
    a lookup that misses has nothing to correct in any engine's copy, and
    sends nothing (each BlocksChanged counts against every session's queue)."""
    from kvdepot.server.core.tiers import TierStack
    from kvdepot.server.tiers.warm import WarmPool

    pool = HostPool(size=16 * SLOT, slot_bytes=SLOT, directory=str(tmp_path), name="miss-test", pin="off")
    try:
        depot = Depot(pool, "lru", "test-instance", "test", tiers=TierStack([WarmPool(pool)]))
        session = depot.attach("c", identity(os.getpid()))
        engine_id, _ = depot.register_engine(session.id, namespace())
        notifications(session)
        assert depot.lookup(session.id, engine_id, keys(4, prompt=9)).ready == 0
        assert notifications(session) == []
    finally:
        pool.close()
