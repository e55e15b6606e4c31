"""The native lane's CUDA path without a GPU: its real code (server/native/src/
cuda*.cpp) driven through the lane's C functions, over a stand-in for the CUDA
runtime (tests/fake_cuda/fake_cuda.cpp: host memory, every operation at
once, the copy kernel on the CPU). What it shows is the lane's bookkeeping:
bytes land where the block ids and slots say, in chunks smaller than a job,
with jobs waiting for room in a small id ring, stores held until their
compute is done, a worker that died before its compute fails its store, a bad
event handle is refused; and what a GPU would have to finish before each copy
or kernel (the fake logs the streams' order and event waits). `pytest -m cuda`
runs the same path on a GPU."""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import time

import pytest
import torch

from kvdepot.server.core.requests import JobKind, JobRequest
from kvdepot.server.core.transport import LaneDevice, LaneKernel, LaneStream, LaneWorker
from kvdepot.server.host import shard_hash
from kvdepot.server.host.pool import HostPool
from kvdepot.server.host.shard_record import RECORD_BYTES, unpack
from kvdepot.server.native import binding, build
from kvdepot.server.native.binding import EventType
from kvdepot.server.native.lane import Lane

FAKE = os.path.join(os.path.dirname(__file__), "fake_cuda", "fake_cuda.cpp")
GATHER, SCATTER, HASH_BLOCKS, HASH_ROWS = 0x1000, 0x2000, 0x3000, 0x4000
SLOT = 4096
LAYERS, PAGE = 4, 1024  # a block: four pages of 1 KiB
BLOCKS = 64
ROWS = 4  # staging rows: a job of more than 4 blocks takes several chunks
RING = 64  # ring entries: a few jobs in flight fill it
SESSION, WORKER, NS = 1, 10, 1

if build.compiler() is None:
    pytest.skip("no C++ compiler here: the native lane cannot be built", allow_module_level=True)


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    path = tmp_path_factory.mktemp("fake") / "fake_cuda.so"
    subprocess.run([build.compiler(), "-std=c++17", "-O1", "-fPIC", "-shared", FAKE, "-o", str(path)], check=True)
    return ctypes.CDLL(str(path))


class Rig:
    """A lane with one fake GPU, one worker of it, and what its memory holds."""

    def __init__(self, fake, tmp_path, page: int = PAGE, rows: int = ROWS, gpu: int = 0):
        self.fake = fake
        self.gpu = gpu
        self.rows = rows
        self.pool = HostPool(size=256 * SLOT, slot_bytes=SLOT, directory=str(tmp_path), name="p", pin="off")
        self.lane = Lane(binding.load(build.build(quiet=True)), self.pool, arc=False, tracing=False,
                         max_unread=1 << 20,
                         max_frame_bytes_per_uid=256 << 20, check=True)
        self.lane.add_namespace(NS, self.lane.scope("t", None), 1, "ns", bytes(16))
        self.lane.add_session(SESSION, SESSION, "s" * 32, 4096)
        self.keep = []  # host memory the "GPU" uses, alive while the lane is
        self.staging: dict[int, list[tuple[int, int]]] = {}  # each direction's buffers: [start, end)
        self.cache = [self._memory(torch.randint(0, 256, (BLOCKS, page), dtype=torch.uint8)) for _ in range(LAYERS)]
        table = [self._ints([t.data_ptr() for t in self.cache]), self._ints([page] * LAYERS),
                 self._ints([k * page for k in range(LAYERS)]), self._ints([page] * LAYERS)]
        self.fence = self._ints([0])
        device = LaneDevice(gpu, True, 16384, 0, self.pool.registration_bytes // SLOT, self._stream(GATHER),
                            self._stream(SCATTER), self._api())
        self.lane.cuda_device(device)
        self.lane.add_worker(SESSION, WORKER, NS, 0, BLOCKS, LAYERS * page, None, 2)
        self.lane.cuda_worker(SESSION, WORKER, LaneWorker(2, device=device, table=tuple(t.data_ptr() for t in table),
                                                          pages_per_block=LAYERS, max_page_bytes=page,
                                                          fence=self.fence.data_ptr()))
        self.done: dict[int, tuple[bool, str]] = {}
        self.seq = 0

    def _memory(self, tensor: torch.Tensor) -> torch.Tensor:
        self.keep.append(tensor)
        return tensor

    def _ints(self, values) -> torch.Tensor:
        return self._memory(torch.tensor(values, dtype=torch.int64))

    def _stream(self, function: int) -> LaneStream:
        buffers = [self._memory(torch.zeros(self.rows * SLOT, dtype=torch.uint8)) for _ in range(2)]
        host, gpu = self._ints([0] * RING), self._ints([0] * RING)
        hashes = {}
        if function == GATHER:  # a store's rows are hashed "on the GPU"
            keys = self._memory(torch.from_numpy(shard_hash.keys().reshape(-1).copy()))
            scratch = [self._ints([0] * self.rows * (SLOT // 4096)) for _ in buffers]
            hashes = dict(hash_blocks=LaneKernel(HASH_BLOCKS, 128, 0, (8, 8, 8, 8, 8, 4)),
                          hash_rows=LaneKernel(HASH_ROWS, 32, 0, (8, 8, 4, 8)), hash_keys=keys.data_ptr(),
                          hash_scratch=tuple(t.data_ptr() for t in scratch))
        self.staging[function] = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]
        # Each direction its own streams and buffer events, as on a GPU.
        copies, kernels, events = (0x11, 0x12, 0x21) if function == GATHER else (0x13, 0x14, 0x25)
        for stream in (copies, kernels):
            self.fake.fake_stream_device(ctypes.c_void_p(stream), self.gpu)
        return LaneStream(copies, kernels, tuple(b.data_ptr() for b in buffers), self.rows, (events, events + 1),
                          (events + 2, events + 3), host.data_ptr(), gpu.data_ptr(), RING,
                          self._ints(list(range(self.rows))).data_ptr(),
                          LaneKernel(function, 128, 0, (8,) * 8 + (4,) * 3, programs=4), **hashes)

    def _api(self) -> dict[str, int]:
        names = dict((field, name) for field, name in binding.CUDA_ENTRY_POINTS)
        return {names[field]: ctypes.cast(getattr(self.fake, f"fake_{field}"), ctypes.c_void_p).value
                for field, _ in binding.CUDA_ENTRY_POINTS}

    def records(self) -> dict[bytes, tuple]:
        """The sealed records in the pool, by key: (record, the slot's bytes)."""
        found = {}
        for slot in range(self.pool.num_slots):
            record, _ = unpack(self.pool.records[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES])
            if record is not None:
                found[record.key] = (record, bytes(self.pool.slot_view(slot, record.length)))
        return found

    def block(self, block_id: int) -> bytes:
        return b"".join(bytes(t[block_id].numpy()) for t in self.cache)

    def store(self, job: int, keys, block_ids, event: bytes = b"E" * 64, computed: bool = True) -> None:
        self.seq += 1
        if computed:
            self.fence[0] = self.seq  # what the worker's stream writes after its compute
        self.lane.submit(SESSION, JobRequest(JobKind.STORE, WORKER, job, keys, block_ids, event, self.seq))

    def load(self, job: int, keys, block_ids) -> None:
        self.lane.submit(SESSION, JobRequest(JobKind.LOAD, WORKER, job, keys, block_ids))

    def wait(self, jobs, timeout: float = 10.0) -> dict[int, tuple[bool, str]]:
        deadline = time.monotonic() + timeout
        while not all(j in self.done for j in jobs):
            assert time.monotonic() < deadline, f"jobs {[j for j in jobs if j not in self.done]} did not end"
            for event in self.lane.take_events():
                if event.type is EventType.JOB_DONE:
                    _, job, ok, _, _ = binding.JOB_DONE.unpack_from(event.payload)
                    self.done[job] = (bool(ok), event.payload[binding.JOB_DONE.size :].decode())
            time.sleep(0.002)
        assert self.lane.verify() == ""
        return {j: self.done.pop(j) for j in jobs}

    def ended_in_order(self, count: int, timeout: float = 5.0) -> list[tuple[int, bool]]:
        """(job, ok) of the next `count` jobs to end, in the order the lane reported them."""
        order = []
        deadline = time.monotonic() + timeout
        while len(order) < count and time.monotonic() < deadline:
            for event in self.lane.take_events():
                if event.type is EventType.JOB_DONE:
                    _, job, ok, _, _ = binding.JOB_DONE.unpack_from(event.payload)
                    order.append((job, bool(ok)))
            time.sleep(0.001)
        return order

    def ops(self) -> list[Op]:
        """The copies and kernels queued since the log was cleared, in order."""
        found = []
        for i in range(self.fake.fake_ops()):
            op = Op()
            self.fake.fake_op(i, ctypes.byref(op))
            found.append(op)
        return found

    def close(self) -> None:
        self.lane.close()
        self.pool.close(discard=True)


class Op(ctypes.Structure):
    """tests/fake_cuda/fake_cuda.cpp's Op."""

    _fields_ = [("kind", ctypes.c_char), ("stream", ctypes.c_uint64), ("seq", ctypes.c_uint64),
                ("function", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("src", ctypes.c_uint64),
                ("bytes", ctypes.c_uint64), ("buffer", ctypes.c_uint64)]


@pytest.fixture
def rig(fake, tmp_path):
    fake.fake_set_compute_done(1)
    fake.fake_set_release_on_ask(0)
    rig = Rig(fake, tmp_path)
    yield rig
    rig.close()


def keys(n: int, first: int) -> list[bytes]:
    return [(first + i).to_bytes(32, "little") for i in range(n)]


@pytest.mark.parametrize("blocks", [1, 3, 4, 5, 9, 23])
def test_stored_blocks_load_back_byte_for_byte(rig, blocks):
    ks = keys(blocks, 100)
    sources = list(range(0, 2 * blocks, 2))  # not consecutive: runs of slots and rows differ
    rig.store(1, ks, sources)
    assert rig.wait([1]) == {1: (True, "")}
    targets = [BLOCKS - 1 - 2 * i for i in range(blocks)]  # odd ids, the sources even
    rig.load(2, ks, targets)
    assert rig.wait([2]) == {2: (True, "")}
    assert [rig.block(t) for t in targets] == [rig.block(s) for s in sources]
    assert rig.fake.fake_launches() > 0


def test_jobs_beyond_the_rings_room_wait_their_turn_and_all_land(rig):
    # Five jobs of 20 blocks (21 ring entries each) in a ring of 64 entries.
    jobs = {}
    for j in range(5):
        ks = keys(20, 1000 + 100 * j)
        rig.store(10 + j, ks, [(j * 7 + i) % 40 for i in range(20)])
        jobs[10 + j] = ks
    assert all(ok for ok, _ in rig.wait(list(jobs)).values())
    for j, ks in jobs.items():
        rig.load(100 + j, ks, list(range(40, 60)))
        assert rig.wait([100 + j]) == {100 + j: (True, "")}
        assert [rig.block(40 + i) for i in range(20)] == [rig.block(((j - 10) * 7 + i) % 40) for i in range(20)]


def test_jobs_end_once_each_whether_the_loop_or_a_copy_thread_finishes_them(rig):
    """A stream's completion thread that finds the lane thread asleep and the
    lane's lock free finishes the jobs it saw end (and starts those that waited
    for room in the ring); one that finds the lock held, by the loop's round or
    by a Python call, leaves them to the loop.
    With jobs in flight beyond the ring's room and a Python thread taking the
    lock over and over, every job ends once, the index stays consistent (the
    rig's lane checks it after each round) and the blocks load back as stored."""
    stop = threading.Event()
    problems = []

    def hold_the_lock() -> None:
        while not stop.is_set():
            if problem := rig.lane.verify():
                problems.append(problem)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    try:
        stored = {}
        for j in range(24):  # 24 jobs of 5 blocks: 6 ring entries each, 64 in the ring
            ks = keys(5, 10_000 + 100 * j)
            rig.store(j, ks, [(3 * j + i) % 32 for i in range(5)])
            stored[j] = ks
        ended = rig.ended_in_order(len(stored), timeout=10)
        for j, ks in stored.items():
            rig.load(100 + j, ks, list(range(32 + 5 * (j % 6), 37 + 5 * (j % 6))))
        ended += rig.ended_in_order(len(stored), timeout=10)
    finally:
        stop.set()
        holder.join(10)
    assert problems == []
    assert sorted(ended) == sorted((j, True) for j in [*stored, *(100 + j for j in stored)])
    assert rig.ended_in_order(1, timeout=0.2) == []  # none told twice
    for j in range(18, 24):  # the last load into each group of target blocks
        targets = range(32 + 5 * (j % 6), 37 + 5 * (j % 6))
        assert [rig.block(t) for t in targets] == [rig.block((3 * j + i) % 32) for i in range(5)]


def test_a_store_let_through_the_gate_starts_while_copy_threads_finish_other_jobs(rig, fake):
    """The gate hands a store whose compute is done to the lane and wakes it;
    a copy thread finishing its own jobs at that moment takes the same wake-up,
    and must then start the store itself: nothing else may come to wake the
    lane again."""
    stored = keys(2, 5000)
    rig.store(1, stored, [0, 1])
    assert rig.wait([1]) == {1: (True, "")}
    job = 10_000
    for i in range(1500):
        fake.fake_set_compute_done(0)
        rig.store(100 + i, keys(1, 70_000 + i), [2 + i % 20])
        time.sleep(0.001)
        loads = []
        for n in range(24):  # loads ending on the copy thread around the gate's hand-over
            if n == 8:
                fake.fake_set_compute_done(1)
            rig.load(job, stored, [60, 61])
            loads.append(job)
            job += 1
        assert rig.wait([100 + i, *loads], timeout=3)[100 + i] == (True, "")


def test_a_store_waits_at_the_gate_until_its_compute_is_done(rig, fake):
    fake.fake_set_compute_done(0)
    rig.store(1, keys(3, 500), [1, 2, 3])
    time.sleep(0.2)
    assert 1 not in rig.done and not [e for e in rig.lane.take_events() if e.type is EventType.JOB_DONE]
    fake.fake_set_compute_done(1)
    assert rig.wait([1]) == {1: (True, "")}


def test_a_store_waiting_through_a_long_compute_is_not_asked_every_20_microseconds(rig, fake):
    # In serving a store waits for a whole forward pass. The gate asks often
    # only in a store's first half millisecond, then every quarter of its wait
    # (at most every 1 ms): about 520 asks in these 0.5 s, where asking every
    # 20 us made 25,000 (fewer on a slow machine, but thousands).
    fake.fake_set_compute_done(0)
    before = fake.fake_compute_queries()
    rig.store(1, keys(3, 700), [1, 2, 3])
    time.sleep(0.5)
    asked = fake.fake_compute_queries() - before
    fake.fake_set_compute_done(1)
    released = time.monotonic()
    assert rig.wait([1]) == {1: (True, "")}
    assert time.monotonic() - released < 0.5
    assert 20 < asked < 1000


def test_stores_whose_computes_take_alike_are_not_asked_before_most_of_it_has_passed(rig, fake):
    # Stores that each wait 30 ms for their compute, as a worker's stores wait
    # for its forward passes: once the gate has seen a few, a store is first
    # asked again at 3/4 of the shortest recent wait, about 10 asks each; on
    # the schedule alone (every 40 us, then every quarter of its wait, at most
    # every 1 ms) each would be asked several dozen times.
    asks = []
    for i in range(10):
        fake.fake_set_compute_done(0)
        before = fake.fake_compute_queries()
        rig.store(i + 1, keys(1, 900 + i), [i])
        time.sleep(0.03)
        asks.append(fake.fake_compute_queries() - before)
        fake.fake_set_compute_done(1)
        assert rig.wait([i + 1]) == {i + 1: (True, "")}
    assert max(asks[-4:]) <= 22, asks
    # A store asked early, because another store came done, was done at some
    # time unknown: it teaches no wait, and the next store is still asked a
    # few times, not as if waits were short.
    fake.fake_set_compute_done(0)
    rig.store(11, keys(1, 911), [11])
    time.sleep(0.01)
    fake.fake_set_compute_done(1)
    rig.store(12, keys(1, 912), [12], event=b"D" * 64)
    assert rig.wait([11, 12]) == {11: (True, ""), 12: (True, "")}
    fake.fake_set_compute_done(0)
    before = fake.fake_compute_queries()
    rig.store(13, keys(1, 913), [13])
    time.sleep(0.03)
    asked = fake.fake_compute_queries() - before
    fake.fake_set_compute_done(1)
    assert rig.wait([13]) == {13: (True, "")}
    assert asked <= 22, asked
    # Shorter computes after them: the first is seen late by at most 3/4 of
    # the shortest recent wait; it puts the next ones back on the schedule,
    # where they are seen a few ms late at most.
    late = []
    for i in range(3):
        fake.fake_set_compute_done(0)
        rig.store(20 + i, keys(1, 950 + i), [20 + i])
        time.sleep(0.002)
        fake.fake_set_compute_done(1)
        released = time.monotonic()
        assert rig.wait([20 + i]) == {20 + i: (True, "")}
        late.append(time.monotonic() - released)
    assert late[0] < 0.2 and max(late[1:]) < 0.012, late


def test_a_workers_later_store_does_not_leave_the_gate_before_its_earlier_one(rig, fake):
    # Stores 1 and 2 of a worker wait for their computes, asked every
    # millisecond by now. Store 3, another's, comes done: every waiting store
    # is asked. Both computes end between the asks of stores 1 and 2 (the
    # fake: store 2's event, asked after store 3's, releases both). Asked
    # oldest first, store 2 would be seen done and store 1 not, and 2 would
    # leave first; asked newest first, 1 is asked after 2 and is done too.
    fake.fake_set_compute_done(0)
    rig.store(1, keys(1, 820), [1])
    rig.store(2, keys(1, 821), [2], event=b"R" * 64)
    time.sleep(0.05)
    fake.fake_set_release_on_ask(1)
    rig.store(3, keys(1, 822), [3], event=b"D" * 64)
    assert rig.ended_in_order(3) == [(1, True), (2, True), (3, True)]
    assert rig.lane.verify() == ""


def test_stores_leave_the_gate_in_the_order_they_came(rig, fake):
    # Store 1 has waited long enough to be asked only every millisecond; store
    # 2 comes with its compute done. Store 1's compute came first, so it is
    # done too: both leave at once, 1 first.
    fake.fake_set_compute_done(0)
    rig.store(1, keys(2, 800), [1, 2])
    time.sleep(0.05)
    asked = fake.fake_compute_queries()
    while fake.fake_compute_queries() == asked:  # just asked: its next ask is a millisecond away
        time.sleep(0.0001)
    fake.fake_set_compute_done(1)
    rig.store(2, keys(2, 810), [3, 4])
    assert rig.ended_in_order(2) == [(1, True), (2, True)]
    assert rig.lane.verify() == ""


def test_stores_at_the_gate_of_a_client_that_went_away_fail_and_free_their_slots(rig, fake):
    # The worker was killed mid-compute: its stores never pass the gate, no
    # copy of theirs is queued, and their slots are free again.
    fake.fake_set_compute_done(0)
    rig.store(1, keys(2, 1500), [1, 2])
    rig.store(2, keys(2, 1510), [3, 4])
    time.sleep(0.01)
    assert rig.lane.counts()["used_slots"] == 4
    fake.fake_clear_ops()
    rig.lane.end_session(SESSION)
    deadline = time.monotonic() + 5
    while rig.lane.counts()["used_slots"] and time.monotonic() < deadline:
        time.sleep(0.002)
    fake.fake_set_compute_done(1)
    time.sleep(0.01)
    assert rig.lane.counts()["used_slots"] == 0 and not rig.ops()
    assert rig.lane.verify() == ""


def test_a_store_whose_worker_never_wrote_its_fence_fails(rig):
    rig.store(1, keys(2, 600), [4, 5], computed=False)
    ok, error = rig.wait([1])[1]
    assert not ok and "compute did not finish" in error
    # Nothing was committed: loading its keys is refused.
    with pytest.raises(Exception, match="not stored"):
        rig.load(2, keys(2, 600), [6, 7])


def test_a_bad_event_handle_is_refused_before_anything_is_reserved(rig):
    with pytest.raises(Exception, match="cannot open the store's cuda_event_handle"):
        rig.store(1, keys(1, 700), [1], event=b"X" * 64)
    with pytest.raises(Exception, match="64-byte IPC handle"):
        rig.store(2, keys(1, 701), [1], event=b"short")
    assert rig.lane.counts()["used_slots"] == 0


def test_a_stores_records_are_sealed_with_the_hash_the_gpu_took(rig):
    """A CUDA store's records carry the hash its GPU computed of the rows it
    gathered (host/shard_hash.py's), written as the store commits: the slot's
    bytes hash to it, and no CPU thread hashed them."""
    ks = keys(5, 800)
    rig.store(1, ks, [3, 9, 10, 11, 40])
    assert rig.wait([1]) == {1: (True, "")}
    records = rig.records()
    assert set(records) == set(ks)
    for record, data in records.values():
        assert record.gpu_hashed and record.length == LAYERS * PAGE
        assert record.data_hash == shard_hash.gpu_hash(data)
    assert rig.lane.counts()["sealed"] == 5 and rig.lane.counts()["unsealed"] == 0


@pytest.mark.parametrize("rows", [3, 8, 64])
def test_blocks_of_several_slots_land_in_their_runs_and_load_back(fake, tmp_path, rows):
    """A block of 2.5 slots takes a run of 3 slots in the pool and 3 rows of a
    staging buffer (a chunk of `rows` rows holds rows // 3 blocks): its bytes
    sit contiguous from its run's first slot, its record is sealed with the
    hash of those bytes, and it loads back byte for byte."""
    fake.fake_set_compute_done(1)
    page = 5 * SLOT // 2 // LAYERS  # a block: 2.5 slots
    rig = Rig(fake, tmp_path, page=page, rows=rows)
    try:
        ks = keys(11, 900)
        sources = [3, 9, 10, 11, 12, 13, 20, 21, 30, 35, 36]  # the targets (53 and up) apart
        rig.store(1, ks, sources)
        assert rig.wait([1]) == {1: (True, "")}
        assert rig.lane.counts()["used_slots"] == 3 * len(ks)
        records = rig.records()
        assert set(records) == set(ks)
        for k, source in zip(ks, sources):
            record, data = records[k]
            assert record.length == LAYERS * page and data == rig.block(source)
            assert record.data_hash == shard_hash.gpu_hash(data)
        targets = [BLOCKS - 1 - i for i in range(len(ks))]
        rig.load(2, ks, targets)
        assert rig.wait([2]) == {2: (True, "")}
        assert [rig.block(t) for t in targets] == [rig.block(s) for s in sources]
    finally:
        rig.close()


def test_a_block_larger_than_the_staging_buffers_is_refused(fake, tmp_path):
    with pytest.raises(Exception, match="does not fit the GPU's staging buffers"):
        Rig(fake, tmp_path, page=5 * SLOT // 2 // LAYERS, rows=2)


def test_staging_buffers_pass_between_streams_without_holding_up_the_next_chunk(rig, fake):
    """A job bigger than a staging buffer goes through both buffers in turn,
    its kernels on one stream and its transfers on the other. On a GPU each
    write of a buffer must come after the other stream's last use of it, and
    each read after its last write (else a gather overwrites rows still being
    copied out), and nothing more: a chunk's gather must not wait for the
    transfers of the chunk before it, which use the other buffer, or the copy
    engine idles while every gather runs. A store's hash reads its rows beside
    the transfer, which reads them too: the transfer must not wait for it, but
    the job's end must (the stream's thread reads the hashes then), and so must
    the next write of the buffer, a small store's gather on the copy stream
    included. The same for loads: a chunk's transfers must not wait for the
    scatter before. What comes before what is read from the streams' order and
    the event waits the lane queued (the fake's vector clocks)."""
    fake.fake_clear_ops()
    stored = [keys(12, 1100), keys(12, 1200)]  # three chunks of four blocks each
    rig.store(1, stored[0], list(range(0, 24, 2)))
    rig.store(2, stored[1], list(range(1, 24, 2)))
    # One chunk each, on the copy stream alone: the second takes the buffer of store 2's last chunk.
    rig.store(5, keys(2, 1300), [24, 25])
    rig.store(6, keys(2, 1400), [26, 27])
    assert rig.wait([1, 2, 5, 6]) == {1: (True, ""), 2: (True, ""), 5: (True, ""), 6: (True, "")}
    rig.load(3, stored[0], list(range(24, 36)))
    rig.load(4, stored[1], list(range(36, 48)))
    assert rig.wait([3, 4]) == {3: (True, ""), 4: (True, "")}
    ops = rig.ops()

    def touches(op, start: int, end: int) -> bool:
        if op.kind == b"k":
            return start <= op.buffer < end
        return any(start <= a < end for a in (op.dst, op.src))

    def writes(op, start: int, end: int) -> bool:
        if op.kind == b"k":
            return op.function == GATHER
        return start <= op.dst < end

    for function, direction in ((GATHER, "store"), (SCATTER, "load")):
        for start, end in rig.staging[function]:
            users = [i for i, op in enumerate(ops) if touches(op, start, end)]
            assert len(users) >= 6, f"the {direction}s used a buffer only {len(users)} times"
            for a, i in enumerate(users):
                for j in users[a + 1 :]:
                    if writes(ops[i], start, end) or writes(ops[j], start, end):
                        assert ops[i].stream == ops[j].stream or fake.fake_before(i, j), (
                            f"{direction}: op {j} uses a staging buffer without waiting for op {i}")

    def chunks(kernel: int, staging):
        """(the chunk's kernel, its transfers) for each chunk, in order: a store's
        transfers follow its gather, a load's come before its scatter."""
        kernels = [i for i, op in enumerate(ops) if op.kind == b"k" and op.function == kernel]
        transfers = {k: [] for k in kernels}
        for i, op in enumerate(ops):
            if op.kind == b"c" and any(s <= a < e for s, e in staging for a in (op.dst, op.src)):
                chunk = max(k for k in kernels if k < i) if kernel == GATHER else min(k for k in kernels if k > i)
                transfers[chunk].append(i)
        return [(k, transfers[k]) for k in kernels]

    stores = chunks(GATHER, rig.staging[GATHER])
    loads = chunks(SCATTER, rig.staging[SCATTER])
    # (A load alone ends with a smaller chunk: six or seven.)
    assert len(stores) == 8 and len(loads) >= 6 and all(t for _, t in stores + loads)
    for (gather, transfers), (next_gather, _) in zip(stores[:6], stores[1:6]):
        assert all(fake.fake_before(gather, t) for t in transfers)  # a chunk's rows are gathered before they go
        assert not any(fake.fake_before(t, next_gather) for t in transfers), "a gather waited for the chunk before"
    hashes = [i for i, op in enumerate(ops) if op.kind == b"k" and op.function == HASH_BLOCKS]
    fences = [i for i, op in enumerate(ops) if op.kind == b"c" and op.src == rig.fence.data_ptr()]
    assert len(hashes) == 8 and len(fences) == 4
    for gather, transfers in stores[:6]:
        hashed = min(h for h in hashes if h > gather)
        assert not any(fake.fake_before(hashed, t) for t in transfers), "a transfer waited for its chunk's hash"
    for h in hashes:
        assert fake.fake_before(h, min(f for f in fences if f > h)), "a store ended before its rows were hashed"
    for (scatter, transfers), (_, next_transfers) in zip(loads, loads[1:]):
        assert all(fake.fake_before(t, scatter) for t in transfers)  # a chunk's rows arrive before they scatter
        assert not any(fake.fake_before(scatter, t) for t in next_transfers), "transfers waited for the scatter before"


def test_jobs_on_a_second_gpu_queued_from_several_threads_each_run_on_that_gpu(fake, tmp_path):
    """CUDA's current device is per thread. Jobs reach the lane from the lane's
    own thread (the job socket) and from the daemon's Python threads (gRPC
    submits), and the GPU's streams take work only from a thread whose current
    device is theirs: each thread must be set to the job's GPU, not only the
    first one that queued a job there."""
    fake.fake_set_compute_done(1)
    fake.fake_set_release_on_ask(0)
    rig = Rig(fake, tmp_path, gpu=1)
    try:
        results = {}

        def submit(job: int) -> None:
            rig.store(job, keys(2, 100 * job), [2 * job, 2 * job + 1])
            results.update(rig.wait([job]))

        submit(1)  # this thread
        for job in (2, 3):
            thread = threading.Thread(target=submit, args=(job,))
            thread.start()
            thread.join(10)
        assert results == {1: (True, ""), 2: (True, ""), 3: (True, "")}
        rig.load(4, keys(2, 300), [40, 41])
        assert rig.wait([4]) == {4: (True, "")}
        assert [rig.block(i) for i in (40, 41)] == [rig.block(i) for i in (6, 7)]
    finally:
        rig.close()


@pytest.mark.parametrize("big", [12, 8])  # its last scatter in one buffer, then in the other
def test_a_small_load_after_a_big_one_lands_after_it(rig, fake, big):
    """Two loads into the same GPU blocks land in the order they were
    submitted: the block ends up holding the second's data. A load of a
    buffer's share or less runs on the copy stream alone, where a big load's
    scatters run on the kernel stream, chunk by chunk through both buffers;
    the small load's scatter must come after every scatter of the big one,
    not only after the last that used the buffer it takes."""
    first, second = keys(big, 1300), keys(3, 1400)
    rig.store(1, first, list(range(0, big)))
    rig.store(2, second, list(range(12, 15)))
    assert rig.wait([1, 2]) == {1: (True, ""), 2: (True, "")}
    expected = [rig.block(i) for i in range(12, 15)]
    fake.fake_clear_ops()
    rig.load(3, first, list(range(24, 24 + big)))
    rig.load(4, second, list(range(21 + big, 24 + big)))  # the big load's last blocks
    assert rig.wait([3, 4]) == {3: (True, ""), 4: (True, "")}
    assert [rig.block(i) for i in range(21 + big, 24 + big)] == expected
    ops = rig.ops()
    scatters = [i for i, op in enumerate(ops) if op.kind == b"k" and op.function == SCATTER]
    big, small = scatters[:-1], scatters[-1]
    assert len(big) >= 3 and len({ops[i].stream for i in big}) == 1 and ops[small].stream != ops[big[0]].stream
    late = [i for i in big if not fake.fake_before(i, small)]
    assert not late, f"the small load's scatter (op {small}) may land before the big load's ops {late}"
