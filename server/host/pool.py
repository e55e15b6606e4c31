"""The host pool: shared memory, carved into fixed-size slots.

With CUDA the pool is registered as pinned memory so that the GPU copies to
and from it by DMA. Faulting in and pinning hundreds of GB is slow, so the
daemon serves once the first chunks are up and the rest follow
(host/bring_up.py); a slot is handed out only once its chunk is up.

The memory is a file in a tmpfs (or several, striped: kvdepot/pool_parts.py,
mapped as one range by host/pool_map.py), which outlives the daemon, so that
the next one can adopt its blocks (tiers/warm.py). After the slots come one
record per slot (host/shard_record.py) and, in the last page, a header that
says how the range is laid out:

    [slot 0 | slot 1 | ... | record 0 | record 1 | ... | padding | header]
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from kvdepot.kept_pools import HEADER_BYTES, catalog_of, pack_header, read_header
from kvdepot.keys import KEY_VERSION
from kvdepot.pool_parts import MAX_PARTS, Layout, striped
from kvdepot.server.host import numa, shard_hash, shard_record
from kvdepot.server.host.bring_up import (
    POPULATE_CHUNK_BYTES,
    BringUp,
    BringUpError,
    PinError,
    amount,
    interleaved,
    pinning,
)
from kvdepot.server.host.carving import NodeSlots
from kvdepot.server.host.free_runs import FreeRuns
from kvdepot.server.host.pool_folder import (
    PoolError,
    _free_bytes,
    _pin_hint,
    check_memory,
    huge_page_bytes,
    pool_file_bytes,
)
from kvdepot.server.host.pool_map import PoolFiles
from kvdepot.server.host.shard_record import FORMAT_VERSION, RECORD_BYTES, newest_generation

log = logging.getLogger("kvdepot.pool")


_EMPTY_RECORD = bytes(RECORD_BYTES)
# The part of the pool that holds runs of one span at a time (free_runs.py),
# and so the most bytes one shard may have. Each span in use leaves at most
# one extent partly empty, and each extent a tail shorter than a span: a
# 128th of the pool keeps both under about 3% for a dozen block sizes up to
# tens of MiB (bench/pool_capacity.py --simulate); at least 64 MiB (a 16th of
# a smaller pool) so that big blocks fit a small pool, at most 1 GiB.
EXTENT_BYTES = 1 << 30


# A pool of this size or more is kept in this many files, striped by this
# many bytes, by default: page faults into one tmpfs file queue on its locks
# (kvdepot/pool_parts.py, docs/benchmarks.md).
STRIPED_FROM = 4 << 30
STRIPED_FILES = 16
STRIPE_BYTES = 64 << 20


def extent_bytes(pool_bytes: int) -> int:
    return min(EXTENT_BYTES, max(pool_bytes // 128, min(64 << 20, pool_bytes // 16)))


class HostPool:
    def __init__(
        self,
        *,
        size: int,
        slot_bytes: int,
        directory: str,
        name: str,
        pin: str = "auto",
        threads: int = 0,
        pin_chunk_bytes: int = 1 << 30,
        progress: Callable[[str], None] | None = None,
        adopt: bool = False,
        address: str = "",
        lock_path: str = "",
        placement: numa.Placement | None = None,
        files: int = 0,
    ):
        """A new pool file `name`.pool in `directory`; with `adopt`, the one
        already there (read_header must have accepted it for this layout).
        Its header names `address` and the `lock_path` its daemon holds, so
        that a kept pool shows whose it is and whether a daemon serves it.
        With a `placement` of NUMA nodes, the slots are carved over them; a
        new pool is kept in `files` files (_layout)."""
        self.address = address
        self.lock_path = lock_path
        self.slot_bytes = slot_bytes
        # Pinned in registrations of whole slots, so that no slot straddles two.
        self.registration_bytes = max(1, pin_chunk_bytes // slot_bytes) * slot_bytes
        self.num_slots = size // slot_bytes
        self.size = self.num_slots * slot_bytes
        self.huge_pages = huge_page_bytes(directory)
        # A hugetlbfs file is a whole number of huge pages.
        self._file_size = pool_file_bytes(self.num_slots, slot_bytes, self.huge_pages or mmap.PAGESIZE)
        self.path = os.path.join(directory, f"{name}.pool")
        self.adopted = adopt
        self.pinned = False
        self._progress = progress or log.info
        self._threads = threads or min(16, os.cpu_count() or 1)
        self.placement = placement or numa.Placement()
        # Before anything sized by the pool is made: a size given in error is refused at once.
        if not adopt:
            if self._file_size > _free_bytes(directory):
                what = "huge pages free (HugePages_Free in /proc/meminfo)" if self.huge_pages else "free"
                raise PoolError(
                    f"the pool ({self._file_size / 2**30:.2f} GiB) does not fit in {directory} "
                    f"({_free_bytes(directory) / 2**30:.2f} GiB {what}): lower --pool-size, or give a --pool-dir "
                    "with room"
                )
            check_memory(directory, self._file_size)
        try:
            self.slots = FreeRuns(self.num_slots, self.placement.nodes, self.registration_bytes // slot_bytes,
                                  max(1, extent_bytes(size) // slot_bytes))
        except ValueError as e:
            raise PoolError(f"{e}: raise --pool-size or list fewer nodes in --numa") from None
        # {node: whether the kernel took the placement of its range}.
        self.bound: dict[int, bool] = {}
        # Bumped whenever a slot is released: a record sealed for an older use
        # of the slot is not written (tiers/warm.py).
        self.epochs = [0] * self.num_slots
        # Runs ({first slot: span}) of kept blocks whose chunks are not all up
        # yet (tiers/adoption.py): taken as their chunk comes up, not freed
        # (hold, let_go_held).
        self.held: dict[int, int] = {}
        self._held_order: list[int] = []  # held's slots, sorted (add_online)
        try:
            pinner = pinning(pin)
        except PinError as e:
            raise PoolError(str(e)) from None
        self.layout = self._layout(files, adopt)
        # The daemon's user alone: the pool holds every tenant's KV, and a
        # process that maps it could read or overwrite any of it.
        # Checked again on the descriptors: a name in /dev/shm can change hands
        # between read_header and here.
        try:
            self._files = PoolFiles(self.path, self.layout, create=not adopt)
        except OSError as e:
            raise PoolError(f"cannot {'open' if adopt else 'make'} the pool's files: {e}") from None
        try:
            self.buffer = self._files.buffer
            self._base = self._files.base
            self._place()
            page = self.huge_pages or mmap.PAGESIZE
            self._up = BringUp(self._files, directory, self._threads,
                               max(1, POPULATE_CHUNK_BYTES // page) * page, pinner, _pin_hint(directory))
            # The records and the header: adoption reads them, seals write them.
            tail = self.size // page * page
            self._up.wait(self._up.fault(tail, self._file_size - tail))
            self.records = memoryview(self.buffer)[self.size : self.size + self.num_slots * RECORD_BYTES]
            self._write_header(kept_at=0.0)  # served again, if adopted
            self._bring_up_first(required=(pin == "on"))
        except BaseException:
            if hasattr(self, "_up"):
                self._up.close()
            self._files.close(remove=not adopt)
            raise

    def _layout(self, files: int, adopt: bool) -> Layout:
        """The files the pool is kept in: a kept pool's, from its header;
        else `files` of them (0: STRIPED_FILES for a pool of STRIPED_FROM or
        more), striped, but one on huge pages (their faults are few)."""
        if adopt:
            header, why = read_header(self.path)
            if header is None or header["file_size"] != self._file_size:
                raise PoolError(f"the kept pool {self.path} cannot be adopted: {why or 'its size changed'}")
            return header["layout"]
        if files < 0 or files > MAX_PARTS:
            raise PoolError(f"pool_files must be 0 (automatic) to {MAX_PARTS}, not {files}")
        if not files:
            files = STRIPED_FILES if self._file_size >= STRIPED_FROM else 1
        if self.huge_pages or files == 1:
            return Layout(self._file_size)
        page = mmap.PAGESIZE
        stripe = min(STRIPE_BYTES, max(page, self._file_size // files // page * page))
        return striped(self._file_size, files, stripe)

    def _write_header(self, kept_at: float) -> None:
        header = pack_header(FORMAT_VERSION, KEY_VERSION, self.slot_bytes, self.num_slots, self._file_size,
                             self.address, self.lock_path, kept_at, self.layout)
        at = self._file_size - HEADER_BYTES
        self.buffer[at : at + len(header)] = header

    # ------------------------------------------------------------ start-up

    def _place(self) -> None:
        """Each node's range of slots goes on its node: asked before the
        pages are faulted in (a kept pool's pages stay where they are)."""
        if self.slots.carved:
            ranges = [(r.node, r.first * self.slot_bytes, r.count * self.slot_bytes) for r in self.slots.ranges]
            self.bound = numa.bind_ranges(self._base, ranges, self.huge_pages or mmap.PAGESIZE)

    def _chunks(self) -> list[tuple[int, int]]:
        """The pool's chunks as (first slot, slots): one CUDA registration each."""
        per = self.registration_bytes // self.slot_bytes
        return [(first, min(per, self.num_slots - first)) for first in range(0, self.num_slots, per)]

    def _bring_up_first(self, required: bool) -> None:
        """Faults in and pins the chunks the daemon serves with (the first of
        each NUMA range), now; the others follow in bring_up_rest, those
        holding a kept block's record first, the newest blocks' first."""
        chunks = self._chunks()
        first = sorted({r.first // chunks[0][1] for r in self.slots.ranges})
        rest = [i for i in interleaved(chunks, self.slots.ranges) if i not in set(first)]
        if self.adopted:
            newest = {i: self._newest(*chunks[i]) for i in rest}
            kept = sorted((i for i in rest if newest[i] >= 0), key=lambda i: (-newest[i], i))
            rest = kept + [i for i in rest if newest[i] < 0]
        self._rest = rest
        started = time.monotonic()
        wanted = [self._byte_range(chunks[i]) for i in first]
        self._progress(self._up_so_far(0))
        try:
            self._up.bring(wanted, lambda i: None)
        except PinError as e:
            self._up.unregister()
            if required:
                raise PoolError(str(e)) from None
            log.warning("pinning the pool failed; continuing unpinned: %s", e)
            self._up.pinning = None
            self._up.bring(wanted, lambda i: None)
        except BringUpError as e:
            raise PoolError(str(e)) from None
        self.pinned = self._up.pinning is not None
        self._chunk_up = bytearray(len(chunks))
        for i in first:
            self._chunk_up[i] = 1
        self.slots.set_online(chunks[i] for i in first)
        self._progress(self._up_so_far(sum(chunks[i][1] for i in first) * self.slot_bytes))
        self._bring_started = started

    def _up_so_far(self, nbytes: int) -> str:
        unit, scale = ("GiB", 2**30) if self.size >= 2**30 else ("MiB", 2**20)
        return (f"bringing the pool up: {nbytes / scale:.1f} of {self.size / scale:.1f} {unit} "
                f"({100 * nbytes / self.size:.0f}%)")

    def _newest(self, first: int, count: int) -> int:
        """The highest generation a record of these slots claims: 0 where
        none is sealed, -1 where every record is empty. Chunks holding the
        newest kept blocks come up first, as the ones engines most likely ask
        for again. Not checked yet: a torn record can only move its chunk in
        the order."""
        return newest_generation(self.records[first * RECORD_BYTES : (first + count) * RECORD_BYTES])

    def _byte_range(self, chunk: tuple[int, int]) -> tuple[int, int]:
        return chunk[0] * self.slot_bytes, chunk[1] * self.slot_bytes

    def bring_up_rest(self, online: Callable[[int, int], None], failed: Callable[[str], None] = lambda e: None) -> None:
        """Brings the remaining chunks up on a thread; `online(first, count)`
        (called on that thread) as each one's slots may be handed out, and
        `failed(error)` if a chunk cannot come up (the rest stay down)."""
        chunks = self._chunks()
        rest = [chunks[i] for i in self._rest]
        total = sum(count for _, count in rest)
        done = [0]
        last = [time.monotonic()]

        def up(i: int) -> None:
            online(*rest[i])
            done[0] += rest[i][1]
            now = time.monotonic()
            if now - last[0] >= 1.0 and done[0] < total:
                last[0] = now
                # The log only: systemd's status says the daemon serves.
                log.info("%s", self._up_so_far((self.num_slots - total + done[0]) * self.slot_bytes))

        def finished(error: str) -> None:
            seconds = time.monotonic() - self._bring_started
            what = "faulted in and pinned" if self.pinned else "faulted in"
            shown = (self.num_slots - total + done[0]) * self.slot_bytes
            if error:
                log.error("the pool serves %s of %s: %s", amount(shown), amount(self.size), error)
                failed(error)
            elif done[0] < total:  # stop_bringing_up: the daemon stops
                log.info("stopped bringing the pool up with %s of %s up", amount(shown), amount(self.size))
            else:
                log.info("pool up: all %s %s %.2f s after it was opened (%.2f s waiting on page faults, "
                         "%.2f s pinning)", amount(self.size), what, seconds, self._up.fault_seconds,
                         self._up.pin_seconds)

        if not rest:
            finished("")
            return
        self._up.start([self._byte_range(c) for c in rest], up, finished)

    @property
    def bring_up_error(self) -> str:
        """Why part of the pool did not come up ('' while it comes up, or once all has)."""
        return self._up.error

    def stop_bringing_up(self) -> None:
        self._up.stop()

    @property
    def base_address(self) -> int:
        """Address of slot 0; with CUDA, also valid on the GPUs (mapped, UVA)."""
        return self._base

    # ------------------------------------------------------------ slots

    @property
    def online_slots(self) -> int:
        """Slots that are up (host/bring_up.py): the others are not handed out yet."""
        return self.slots.online

    @property
    def used_slots(self) -> int:
        return self.slots.online - self.slots.free

    def span(self, nbytes: int) -> int:
        """The slots a shard of `nbytes` takes."""
        return max(1, -(-nbytes // self.slot_bytes))

    def spans(self, lengths: np.ndarray) -> np.ndarray:
        """span of each of `lengths`, at once (int64)."""
        return np.maximum(1, -(-lengths.astype(np.int64) // self.slot_bytes))

    @property
    def largest_shard(self) -> int:
        """The most bytes one shard may have: an extent's."""
        return self.slots.max_span * self.slot_bytes

    def span_at(self, slot: int) -> int:
        """The slots of the run that starts at `slot`."""
        return self.slots.span_at(slot)

    def run_bytes(self, slot: int) -> int:
        """Bytes of the run that starts at `slot`: what its shard may have."""
        return self.slots.span_at(slot) * self.slot_bytes

    def allocate(self, node: int | None = None, span: int = 1) -> int | None:
        """The first slot of a free run of `span`, of NUMA `node`'s range
        while it has one (free_runs.py)."""
        # A free slot's record is empty (a new file is zeros, release clears
        # it, keep_only clears the rest after adoption): a restart while new
        # bytes arrive finds an empty slot, never an old record over them.
        return self.slots.allocate(node, span)

    def release(self, slot: int) -> None:
        # A block dropped (evicted, cleared) must not come back at a restart,
        # nor a seal still on its way write its record (tiers/warm.py).
        self.records[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES] = _EMPTY_RECORD
        self.epochs[slot] += 1
        self.slots.release(slot, self.slots.span_at(slot))

    def slot_view(self, slot: int, length: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self.buffer)[start : start + length]

    def shard_hashes(self, slots: list[int], lengths: list[int], gpu_hashed: bool) -> np.ndarray:
        """The hash of the first `lengths[i]` bytes of each run at `slots[i]`, at once: the GPU's
        (shard_hash.gpu_hash) or xxh3 (shard_record.data_hash), as the records say they were sealed."""
        offsets = np.array(slots, dtype=np.uint64) * np.uint64(self.slot_bytes)
        at = shard_hash.gpu_hash_at if gpu_hashed else shard_record.data_hash_at
        return at(self.buffer, offsets, np.array(lengths, dtype=np.uint64))

    def add_online(self, first: int, count: int) -> None:
        """Slots [first, first + count) are up: free to hand out (the loop's
        thread), but those `held` for kept blocks (tiers/warm.py), whose
        records stay."""
        self._chunk_up[self.chunk_of(first)] = 1
        # By the sorted slots: a large pool holds hundreds of thousands of kept runs, and a pass
        # over all of them a chunk would hold the loop for a second.
        order = self._held_order
        held = {slot: self.held[slot] for slot in order[bisect.bisect_left(order, first) :
                                                          bisect.bisect_left(order, first + count)]
                if slot in self.held}
        self._clear_records(self.slots.add_online(first, count, held))

    def hold(self, runs: dict[int, int]) -> None:
        """Kept blocks' runs ({first slot: span}) to take, not free, as their chunks come up
        (keep_only and add_online count those up as waiting in the slots)."""
        self.held = dict(runs)
        self._held_order = sorted(self.held)

    def let_go_held(self, slots) -> None:
        """Held slots whose blocks were adopted or discarded (the index
        counted them out as it took or freed them)."""
        for slot in slots:
            self.held.pop(slot, None)

    def chunk_of(self, slot: int) -> int:
        return slot * self.slot_bytes // self.registration_bytes

    def is_online(self, slot: int) -> bool:
        return bool(self._chunk_up[self.chunk_of(slot)])

    def keep_only(self, used: dict[int, int]) -> None:
        """After adoption: the runs `used` ({first slot: span}) hold blocks;
        every other online slot is free and its record cleared."""
        waiting = sum(span for slot, span in self.held.items() if self.is_online(slot))
        self._clear_records(self.slots.keep_only(used, waiting))

    def _clear_records(self, ranges) -> None:
        for first, count in ranges:
            self.records[first * RECORD_BYTES : (first + count) * RECORD_BYTES] = bytes(count * RECORD_BYTES)

    def numa_nodes(self) -> list[NodeSlots]:
        """Each node's range, use and GPUs; a pool not carved is one entry."""
        p = self.placement
        if not self.slots.carved:
            node = p.detected[0] if len(p.detected) == 1 else -1
            return [NodeSlots(node, 0, self.num_slots, self.used_slots, False, p.all_gpus())]
        return [
            NodeSlots(r.node, r.first, r.count, self.slots.online_in(i) - self.slots.free_in(i),
                      self.bound.get(r.node, False),
                      p.gpus.get(r.node, ()))
            for i, r in enumerate(self.slots.ranges)
        ]

    def numa_gpus_elsewhere(self) -> tuple[str, ...]:
        """When carved: the GPUs on no node of the pool (left out of --numa, or
        of no node in sysfs), which numa_nodes() does not list."""
        if not self.slots.carved:
            return ()
        carved = {r.node for r in self.slots.ranges}
        return tuple(sorted(g for node, gpus in self.placement.gpus.items() if node not in carved for g in gpus))

    def close(self, discard: bool = False) -> None:
        """Unmaps the pool; the file stays for the next daemon unless `discard`."""
        self._up.close()  # its thread touches the mapping
        if not discard and not self.buffer.closed:
            self._write_header(kept_at=time.time())
        if self._up.pinning is not None:
            self._up.unregister()
        try:
            self.records.release()
            self.buffer.close()
        except BufferError:
            # A view of the buffer is still alive (CUDA registration); the
            # mapping goes with the process.
            pass
        self._files.close(remove=discard)
        if discard:
            # The warm tier's catalog of the pool's namespaces, made beside it
            # (a file of another user's at its name is not ours to remove).
            with contextlib.suppress(OSError):
                os.unlink(catalog_of(self.path))
