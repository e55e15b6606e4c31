"""One native lane: the library's handle, and its calls in Python's terms.

The lane serves the job connections and the copies' ends on a thread of its
own; each call here takes its lock (ctypes lets the GIL go meanwhile). What
it says (its events) waits in a buffer, and its events_fd() turns readable
when there is some. A call that the lane refuses raises the typed error of
its status code, with the lane's message.
"""

from __future__ import annotations

import ctypes
import os

from kvdepot.defaults import KEY_BYTES
from kvdepot.errors import from_status, status_code
from kvdepot.server.core.counters import DURATION_BUCKETS, Counters, JobTimes
from kvdepot.server.core.requests import JobKind, JobRequest
from kvdepot.server.native import binding
from kvdepot.server.native.binding import Event, LaneConfig, Range

_U32, _U64, _I64 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64
SHM, CUDA = 1, 2
# Ranks are bits of a mask in the lane (src/lane.h MAX_TP).
MAX_TP = 64
# Index.Next (src/index.h).
LOOKUP_END, LOOKUP_ABSENT, LOOKUP_STORING, LOOKUP_STOP = 0, 1, 2, 3
# Index.Which.
READY, STORING, ALL = 0, 1, 2


def _runs(runs: dict[int, int]):
    """Runs ({first slot: span}) as the lane takes them: two arrays."""
    return (_I64 * len(runs))(*runs.keys()), (_I64 * len(runs))(*runs.values())


def _counters(values) -> Counters:
    return Counters(*[int(v) for v in values])


class Lane:
    def __init__(self, lib: ctypes.CDLL, pool, *, arc: bool, tracing: bool, max_unread: int,
                 max_frame_bytes_per_uid: int, check: bool = False):
        self._lib = lib
        self.check = check
        ranges = [Range(-1 if r.node is None else r.node, r.first, r.count) for r in pool.slots.ranges]
        self._ranges = (Range * len(ranges))(*ranges)
        config = LaneConfig(
            pool_base=pool.base_address, slot_bytes=pool.slot_bytes, num_slots=pool.num_slots,
            records_base=pool.base_address + pool.size, arc=int(arc), tracing=int(tracing), check=int(check),
            n_ranges=len(ranges), ranges=self._ranges,
            seed=int.from_bytes(os.urandom(8), "little"), max_unread=max_unread,
            chunk_slots=pool.slots.chunk_slots, extent_slots=pool.slots.extent_slots,
            max_frame_bytes_per_uid=max_frame_bytes_per_uid,
        )
        error = ctypes.create_string_buffer(512)
        handle = lib.kvd_open(ctypes.byref(config), error, len(error))
        if not handle:
            raise OSError(f"the native lane cannot open: {error.value.decode(errors='replace')}")
        self._h = handle
        self._counts = (_I64 * len(binding.COUNTS))()
        self._cuda = False
        self._out = (_U32 * 4)()

    def close(self) -> None:
        if self._h:
            self._lib.kvd_close(self._h)
            self._h = None

    def events_fd(self) -> int:
        return self._lib.kvd_events_fd(self._h)

    def _refused(self, code: int):
        return from_status(status_code(code), self._lib.kvd_error(self._h).decode(errors="replace"))

    def verify(self) -> str:
        return self._lib.kvd_verify(self._h).decode()

    # ------------------------------------------------------------ events

    def take_events(self) -> list[Event]:
        data = binding.c_u8p()
        size = self._lib.kvd_take_events(self._h, ctypes.byref(data))
        return list(binding.events(ctypes.string_at(data, size))) if size else []

    # ------------------------------------------------------------ scopes, namespaces, sessions, workers

    def scope(self, name: str, quota: int | None) -> int:
        return self._lib.kvd_scope(self._h, name.encode(), -1 if quota is None else quota)

    def add_namespace(self, ns_id: int, scope: int, tp_size: int, name: str, digest: bytes) -> None:
        self._lib.kvd_ns_add(self._h, ns_id, scope, tp_size, name.encode(), digest)

    def follow(self, ns_id: int, followed: bool) -> None:
        self._lib.kvd_ns_follow(self._h, ns_id, int(followed))

    def remove_namespace(self, ns_id: int) -> None:
        self._lib.kvd_ns_remove(self._h, ns_id)

    def namespace_counts(self, ns_id: int) -> tuple[int, int, Counters]:
        counts, counters = (_I64 * 2)(), (_U64 * 10)()
        if self._lib.kvd_ns_counts(self._h, ns_id, counts, counters):
            return 0, 0, Counters()
        return counts[0], counts[1], _counters(counters)

    def count(self, ns_id: int, session: int, **deltas: int) -> None:
        names = [f.name for f in Counters.__dataclass_fields__.values()]
        for name, delta in deltas.items():
            self._lib.kvd_ns_count(self._h, ns_id, session, names.index(name), delta)

    def add_session(self, handle: int, number: int, session_id: str, max_jobs: int) -> None:
        self._lib.kvd_session_add(self._h, handle, number, session_id.encode(), max_jobs)

    def end_session(self, handle: int) -> None:
        self._lib.kvd_session_end(self._h, handle)

    def session_counts(self, handle: int) -> tuple[int, int, Counters]:
        counts, counters = (_U64 * 2)(), (_U64 * 10)()
        if self._lib.kvd_session_info(self._h, handle, counts, counters):
            return 0, 0, Counters()
        return counts[0], counts[1], _counters(counters)

    def add_worker(self, session: int, worker_id: int, ns_id: int, rank: int, num_blocks: int, block_bytes: int,
                   node: int | None, transport: int, staging: int = 0, staging_bytes: int = 0) -> None:
        code = self._lib.kvd_worker_add(self._h, session, worker_id, ns_id, rank, num_blocks, block_bytes,
                                        -1 if node is None else node, transport, staging, staging_bytes)
        if code:
            raise self._refused(code)

    def cuda_device(self, device) -> None:
        """The CUDA transport (from the entry points torch loaded) and one GPU of it (a LaneDevice)."""
        if not self._cuda:
            api = binding.CudaApi(**{field: device.api[name] for field, name in binding.CUDA_ENTRY_POINTS})
            self._lib.kvd_cuda_init(self._h, ctypes.byref(api))
            self._cuda = True
        if not self._lib.kvd_cuda_has_device(self._h, device.index):
            config = binding.device_config(device)
            self._lib.kvd_cuda_device(self._h, ctypes.byref(config))

    def cuda_worker(self, session: int, worker_id: int, lane_worker) -> None:
        table = (_U64 * 4)(*lane_worker.table)
        code = self._lib.kvd_cuda_worker(self._h, session, worker_id, lane_worker.device.index, table,
                                         lane_worker.pages_per_block, lane_worker.max_page_bytes, lane_worker.fence)
        if code:
            raise self._refused(code)

    # ------------------------------------------------------------ jobs

    def add_connection(self, session: int, fd: int, peer: str, uid: int, first: bytes, leftover: bytes,
                       quiet: bool) -> int:
        return self._lib.kvd_conn_add(self._h, session, fd, peer.encode(errors="replace"), uid & 0xFFFFFFFF, first,
                                      len(first), leftover, len(leftover), int(quiet))

    def submit(self, session: int, request: JobRequest) -> tuple[int, int]:
        keys = list(request.keys)
        lengths = (_U64 * len(keys))(*[len(k) for k in keys])
        ids = (_U32 * len(request.block_ids))(*[b & 0xFFFFFFFF for b in request.block_ids])
        answer = (_U32 * 2)()
        code = self._lib.kvd_submit(
            self._h, session, int(request.kind is JobKind.LOAD), request.worker_id & 0xFFFFFFFF, request.job_id,
            b"".join(keys), lengths, len(keys), ids, len(ids), request.compute_event, len(request.compute_event),
            request.compute_seq, answer)
        if code:
            raise self._refused(code)
        return answer[0], answer[1]

    def demote(self, on: bool) -> None:
        """Whether committed shards go to Python too (a tier below DRAM takes them)."""
        self._lib.kvd_set_demote(self._h, int(on))

    def set_draining(self, draining: bool) -> None:
        self._lib.kvd_set_draining(self._h, int(draining))

    # ------------------------------------------------------------ the index

    def lookup(self, ns_id: int, keys: bytes, n: int, start: int, count_ready: bool) -> tuple[int, list[int]]:
        next_kind = self._lib.kvd_lookup(self._h, ns_id, keys, n, start, int(count_ready), self._out)
        return next_kind, list(self._out)

    def contains(self, ns_id: int, key: bytes) -> bool:
        return bool(self._lib.kvd_contains(self._h, ns_id, key))

    def keys_of(self, ns_id: int, which: int) -> list[bytes]:
        data = binding.c_u8p()
        n = self._lib.kvd_keys_of(self._h, ns_id, which, ctypes.byref(data))
        raw = ctypes.string_at(data, 32 * n) if n else b""
        return [raw[i : i + 32] for i in range(0, len(raw), 32)]

    def clear(self, ns_id: int | None) -> tuple[int, int]:
        out = (_U64 * 2)()
        self._lib.kvd_clear(self._h, -1 if ns_id is None else ns_id, out)
        return out[0], out[1]

    def restore_many(self, ns_id: int, tp: int, keys: list[bytes], slots: list[int], lengths: list[int],
                     waited: bool = False) -> list[bool]:
        """Kept blocks of one namespace back in the index, ready, in order:
        `slots` and `lengths` hold each block's `tp` ranks in turn. Whether
        each went in (not when the index holds its key already: its slots are
        freed). `waited`: their slots were held for adoption, and are counted out."""
        count = len(keys)
        blob = b"".join(keys)
        if len(blob) != count * KEY_BYTES or len(slots) != count * tp or len(lengths) != count * tp:
            raise ValueError(f"{count} blocks of {tp} ranks need {count * tp} slots and lengths and "
                             f"{KEY_BYTES}-byte keys")
        restored = (ctypes.c_uint8 * count)()
        self._lib.kvd_restore_many(self._h, ns_id, count, tp, blob, (_I64 * len(slots))(*slots),
                                   (_U64 * len(lengths))(*lengths), waited, restored)
        return [bool(x) for x in restored]

    def release_slots(self, slots: list[int], waited: bool = False) -> None:
        self._lib.kvd_release_slots(self._h, (_I64 * len(slots))(*slots), len(slots), waited)

    def keep_only(self, used: dict[int, int], kept_waiting: int = 0) -> None:
        """`used`: runs, {first slot: span}."""
        firsts, spans = _runs(used)
        self._lib.kvd_keep_only(self._h, firsts, spans, len(used), kept_waiting)

    def span_at(self, slot: int) -> int:
        return self._lib.kvd_span_at(self._h, slot)

    def reserve_promotion(self, ns_id: int, tp_size: int, key: bytes, lengths: tuple) -> tuple[int, list[int]]:
        slots = (_I64 * tp_size)()
        handle = self._lib.kvd_reserve_promotion(self._h, ns_id, key, (_U64 * tp_size)(*lengths), slots)
        return handle, list(slots)

    def finish_promotion(self, handle: int, ok: bool) -> None:
        self._lib.kvd_finish_promotion(self._h, handle, int(ok))

    def holds(self, handle: int) -> bool:
        return bool(self._lib.kvd_holds(self._h, handle))

    def hold(self, handle: int) -> None:
        self._lib.kvd_hold(self._h, handle)

    def let_go(self, handle: int) -> None:
        self._lib.kvd_let_go(self._h, handle)

    def block_rank(self, handle: int, rank: int) -> tuple[int, bool] | None:
        """(slot, committed) of a block's rank; None once the block is gone."""
        out, key = (_I64 * 4)(), ctypes.create_string_buffer(32)
        if not self._lib.kvd_block_info(self._h, handle, rank, out, key):
            return None
        return out[0], bool(out[1])

    # ------------------------------------------------------------ counts

    def counts(self) -> dict[str, int]:
        self._lib.kvd_counts(self._h, self._counts)
        return dict(zip(binding.COUNTS, self._counts))

    def jobs_in_flight(self) -> int:
        return self.counts()["jobs_in_flight"]

    def free_in(self, index: int) -> int:
        return self._lib.kvd_free_in(self._h, index)

    def set_online(self, ranges: list[tuple[int, int]]) -> None:
        firsts, counts = [r[0] for r in ranges], [r[1] for r in ranges]
        self._lib.kvd_set_online(self._h, (_I64 * len(ranges))(*firsts), (_I64 * len(ranges))(*counts), len(ranges))

    def add_online(self, first: int, count: int, held: dict[int, int]) -> int:
        """`held`: kept blocks' runs, {first slot: span}; returns the slots that came online."""
        firsts, spans = _runs(held)
        return self._lib.kvd_add_online(self._h, first, count, firsts, spans, len(held))

    def online_in(self, index: int) -> int:
        return self._lib.kvd_online_in(self._h, index)

    def totals(self) -> Counters:
        out = (_U64 * 10)()
        self._lib.kvd_totals(self._h, out)
        return _counters(out)

    def job_times(self) -> JobTimes:
        n = len(DURATION_BUCKETS) + 1
        buckets, seconds, failures = (_U64 * (2 * n))(), (ctypes.c_double * 2)(), (_U64 * 4)()
        self._lib.kvd_job_times(self._h, buckets, seconds, failures)
        kinds = (JobKind.STORE, JobKind.LOAD)
        times = JobTimes()
        for k, kind in enumerate(kinds):
            times.buckets[kind] = [int(b) for b in buckets[k * n : (k + 1) * n]]
            times.seconds[kind] = seconds[k]
            for r, reason in enumerate(("client_gone", "transport")):
                if failures[2 * k + r]:
                    times.failures[kind, reason] = int(failures[2 * k + r])
        return times

    def set_generation(self, generation: int) -> None:
        self._lib.kvd_set_generation(self._h, generation)

