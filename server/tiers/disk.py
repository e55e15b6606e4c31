"""The disk tier: moves shards between the pool and the segment store
(disk_store.py), off the event loop.

Demotion is write-behind: every shard committed to the pool is queued for the
disk at once, in commit order, and a writer thread writes the queue in large
batches while the shards' blocks are pinned. So a block is usually on disk
long before DRAM evicts it, and an eviction burst never waits on the disk; a
block evicted before its turn (the disk slower than the stores) is not
written, and neither is one the disk already holds.

Promotion starts at a lookup that finds blocks only on disk: the index takes
their slots and answers NOT_YET, reader threads fill the slots and check each
record's hash, and the blocks turn ready (or, if any rank's read fails, are
dropped: a miss and a recompute, never an error). A block is promoted once
however many lookups ask: the second finds it being stored.

Shares: the pool's rule holds here too. The store picks whose records go
when the disk is full (disk_shares.py) by the scopes this mover tells it of
(a namespace's digest -> its scope), and a scope promotes at most its share
of `max_promotions` at once, among the scopes with blocks on disk.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time

from kvdepot.server.core.tiers import Tier, TierStats
from kvdepot.server.host.shard_record import ShardRecord, data_hash
from kvdepot.server.tiers.disk_shares import UNCLAIMED
from kvdepot.thread_names import name_os_thread

log = logging.getLogger("kvdepot.tiers")

# Bytes the writer gathers into one disk write (and pins meanwhile).
DEMOTE_BATCH_BYTES = 64 << 20
READ_THREADS = 4


class DiskMover(Tier):
    name = "disk"

    def __init__(self, disk, pool, loop: asyncio.AbstractEventLoop, max_promotions: int):
        self.disk = disk
        self.pool = pool
        self._loop = loop
        self._writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvdepot-demote", initializer=name_os_thread
        )
        self._readers = concurrent.futures.ThreadPoolExecutor(
            READ_THREADS, thread_name_prefix="kvdepot-promote", initializer=name_os_thread
        )
        # (block, rank, length) in commit order; bounded by the pool's slots,
        # the most that can wait (an older entry's block has left DRAM).
        self._queue: collections.deque = collections.deque(maxlen=pool.num_slots)
        self._writing = False
        # Slots being filled from disk at once, at most; a scope's share of them
        # (the pool's rule, among the scopes that hold blocks here) at most.
        self.max_promotions = max_promotions
        self.closing = False
        self.promoting = 0
        self._promoting: dict[str, int] = {}
        self.promotions = 0
        self.failed_promotions = 0
        self.demoted_shards = 0
        self.not_demoted = 0
        self.read_shards = 0
        disk.on_evict = lambda keys: loop.call_soon_threadsafe(self._disk_evicted, keys)
        # What the disk holds, by namespace digest and key: a mask of the
        # ranks held. Kept on the loop, so that lookups and registrations ask
        # it (per namespace) instead of the disk's whole index under its lock.
        self._held: dict[bytes, dict[bytes, int]] = {}
        # Namespace digest -> scope, of the namespaces seen since the start; the
        # disk's writer reads it (a dict read is atomic) to keep the shares.
        self._scopes: dict[bytes, str] = {}
        disk.shares.scope_of = lambda digest: self._scopes.get(digest, UNCLAIMED)

    def attach(self, host) -> None:
        super().attach(host)
        self.disk.shares.victims = host.victims

    def _seen(self, ns) -> None:
        self._scopes[ns.digest] = ns.scope

    def recover(self) -> None:
        # Records larger than the pool's largest run (a smaller pool since)
        # are left out: they can never be promoted.
        for digest, key, rank in self.disk.keys():
            record = self.disk.record((digest, key, rank))
            if record is not None and record.length <= self.pool.largest_shard:
                self._add(digest, key, rank)

    def _add(self, digest: bytes, key: bytes, rank: int) -> None:
        keys = self._held.setdefault(digest, {})
        keys[key] = keys.get(key, 0) | 1 << rank

    def _remove(self, digest: bytes, key: bytes, rank: int | None = None) -> None:
        keys = self._held.get(digest)
        if keys is None or key not in keys:
            return
        mask = 0 if rank is None else keys[key] & ~(1 << rank)
        if mask:
            keys[key] = mask
        else:
            del keys[key]
            if not keys:
                del self._held[digest]

    def holds(self, ns, key: bytes) -> bool:
        return self._held.get(ns.digest, {}).get(key, 0) == (1 << ns.tp_size) - 1

    def keys_of(self, ns, exclude: set) -> list[bytes]:
        if ns.digest in self._held:
            self._seen(ns)  # a registration: the namespace's records are its scope's now
        whole = (1 << ns.tp_size) - 1
        return [k for k, mask in self._held.get(ns.digest, {}).items() if mask == whole and k not in exclude]

    def clear(self, ns) -> None:
        digests = list(self._held) if ns is None else [ns.digest]
        gone = []
        for digest in digests:
            for key, mask in self._held.get(digest, {}).items():
                gone.extend((digest, key, rank) for rank in range(mask.bit_length()) if mask >> rank & 1)
        # On the writer's thread, after any write in flight: it syncs and
        # rewrites a file. The keys are out of _held now, so none is promoted.
        forgetting = self._writer.submit(self.disk.forget, None if ns is None else ns.digest)
        forgetting.add_done_callback(_log_failure("recording a clear of the disk tier"))
        self._disk_evicted(gone)

    def _disk_evicted(self, keys) -> None:
        """Blocks gone from the disk with their segment: engines that saw them
        there (lower) must not wait for them."""
        for digest, key, rank in keys:
            self._remove(digest, key, rank)
        self.host.lower_gone({(digest, key) for digest, key, _ in keys})

    # ------------------------------------------------------------ demotion

    def demote(self, ns, rank: int, blocks, length: int) -> None:
        self._seen(ns)
        for block in blocks:
            self._queue.append((block, rank, length))
        if not self._writing:
            self._write_next()

    def _write_next(self) -> None:
        if self.closing:
            self._writing = False
            return
        batch, held, size = [], [], 0
        host, disk = self.host, self.disk
        while self._queue and size < DEMOTE_BATCH_BYTES:
            block, rank, length = self._queue.popleft()
            key = (block.ns.digest, block.key, rank)
            if not host.holds(block) or disk.contains(key):
                self.not_demoted += not host.holds(block)
                continue
            # Pinned first, then checked and read: the native lane's thread may
            # evict the block between two calls, and a gone block's hold pins
            # nothing, so only a block still held after its hold is written.
            host.hold(block)
            slot = block.slots[rank]
            if not host.holds(block) or slot is None or rank not in block.committed:
                host.let_go(block)
                self.not_demoted += 1
                continue
            held.append(block)
            batch.append((key, block.ns.tp_size, slot, length))
            size += length
        if not batch:
            self._writing = False
            return
        self._writing = True
        future = self._writer.submit(self._write, batch)
        future.add_done_callback(lambda f: self._loop.call_soon_threadsafe(self._written, f, held))

    def _write(self, batch) -> list:
        view = self.pool.slot_view
        items = []
        for (digest, key, rank), tp_size, slot, length in batch:
            data = view(slot, length)
            items.append((ShardRecord(digest, key, rank, tp_size, length, data_hash(data)), data))
        return self.disk.write(items)

    def _written(self, future, held: list) -> None:
        for block in held:
            self.host.let_go(block)
        if future.cancelled():
            self._writing = False
            return
        if future.exception() is not None:
            log.warning("writing blocks to disk failed: %s", future.exception())
        else:
            written = future.result()
            self.demoted_shards += len(written)
            for digest, key, rank in written:
                self._add(digest, key, rank)
        self._write_next()

    # ------------------------------------------------------------ promotion

    def promotable(self, ns, key: bytes) -> tuple | None:
        if self.closing or self.promoting + ns.tp_size > self.max_promotions or not self.holds(ns, key):
            return None
        self._seen(ns)
        if not self._promotion_room(ns):
            return None
        records = [self.disk.record((ns.digest, key, rank)) for rank in range(ns.tp_size)]
        if any(r is None or r.length > self.pool.largest_shard for r in records):
            return None
        return tuple(r.length for r in records)

    def _promotion_room(self, ns) -> bool:
        """Whether `ns`'s scope may start one more promotion: at least one at a
        time, and at most its share of the slots in flight among the scopes
        that hold blocks on disk or promote."""
        taking = self._promoting.get(ns.scope, 0)
        if not taking:
            return True
        active = {self._scopes.get(digest, UNCLAIMED) for digest in self._held}
        active.update(self._promoting)
        active.add(ns.scope)
        share = self.max_promotions * self.host.share(ns.scope, len(active))
        return taking + ns.tp_size <= share

    def promote(self, ns, key: bytes, slots: list[int], done) -> None:
        self.promoting += ns.tp_size
        self._promoting[ns.scope] = self._promoting.get(ns.scope, 0) + ns.tp_size
        future = self._readers.submit(self._read, ns.digest, key, slots)
        future.add_done_callback(lambda f: self._loop.call_soon_threadsafe(self._read_done, f, ns, key, done))

    def _read(self, digest: bytes, key: bytes, slots: list[int]) -> bool:
        # Into each shard's run: the record's length, checked against it, never more.
        view, run = self.pool.slot_view, self.pool.run_bytes
        return all(self.disk.read((digest, key, rank), view(slot, run(slot))) for rank, slot in enumerate(slots))

    def _read_done(self, future, ns, key: bytes, done) -> None:
        self.promoting -= ns.tp_size
        left = self._promoting.pop(ns.scope, 0) - ns.tp_size
        if left > 0:
            self._promoting[ns.scope] = left
        error = future.exception() if not future.cancelled() else "cancelled at shutdown"
        ok = error is None and future.result()
        if not ok:
            self._remove(ns.digest, key)  # the disk dropped what it could not read
            self.failed_promotions += 1
            if error is not None:
                log.warning("promoting a block from disk failed: %s", error)
        else:
            self.promotions += 1
            self.read_shards += ns.tp_size
        done(ok)

    async def close(self, timeout: float = 30.0) -> None:
        """Stops taking work, lets the write and promotions in flight end (their
        pins released, on the loop), then closes the disk."""
        self.closing = True
        self._queue.clear()
        deadline = time.monotonic() + timeout
        while (self._writing or self.promoting) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.disk.close()

    def stats(self) -> TierStats:
        c = self.disk.counters
        discarded = {
            reason: count
            for reason, count in (("torn", c.scan.torn), ("format", c.scan.format), ("corrupt", c.corrupt),
                                  ("segments_skipped", c.scan.segments_skipped), ("read_errors", c.read_errors))
            if count
        }
        if self.not_demoted:
            discarded["evicted_before_written"] = self.not_demoted
        return TierStats(
            name=self.name,
            shards=c.records,
            bytes=c.bytes_used,
            capacity_bytes=self.disk.capacity,
            written_shards=self.demoted_shards,
            written_bytes=c.bytes_written,
            read_shards=self.read_shards,
            read_bytes=c.bytes_read,
            promotions=self.promotions,
            failed_promotions=self.failed_promotions,
            evicted_shards=c.records_evicted,
            recovered_shards=c.scan.records,
            direct_io=bool(self.disk.direct),
            write_errors=c.write_errors,
            discarded=discarded,
        )


def _log_failure(what: str):
    def done(future) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.error("%s failed: %s", what, future.exception())

    return done

