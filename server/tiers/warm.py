"""The pool kept across daemon restarts: sealing records, and adopting them.

Every committed shard gets a record in the pool file (record.py) once its
bytes are hashed, which background threads do after the job has ended, so the
store path only pays for handing the work over. A daemon that starts on the
same address adopts the file: each sealed record whose own hash, namespace and
data hash hold comes back as a ready block, oldest first in the eviction
order; everything else (a store that never committed, a record not yet sealed
when the daemon died, a torn record, bytes that changed) is discarded and
counted, never served.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import mmap
import os
import time

from kvdepot.kept_pools import catalog_of as catalog_path
from kvdepot.kept_pools import read_header
from kvdepot.pool_parts import present_parts, why_parts_unusable
from kvdepot.server.core.requests import NamespaceSpec
from kvdepot.server.core.tiers import KeptBlock, Tier, TierStats
from kvdepot.server.host.pool import HostPool
from kvdepot.server.host.pool_folder import huge_page_bytes, pool_file_bytes
from kvdepot.server.host.shard_record import FORMAT_VERSION, RECORD_BYTES, ShardRecord, data_hash, pack
from kvdepot.server.tiers.adoption import Adoption, Checked
from kvdepot.server.tiers.catalog import IDENTITY_FIELDS, Catalog
from kvdepot.thread_names import name_os_thread

log = logging.getLogger("kvdepot.tiers")

# Shards committed within this long are hashed as one batch (one hand-over
# to the thread and back): a restart loses at most this much more.
SEAL_BATCH_SECONDS = 0.002
# Shards waiting to be sealed, at most (beyond the pool's slots): past it a
# store's shards are not sealed (not kept across a restart), so that stores
# outrunning the hashing cannot grow the backlog without bound.
MAX_UNSEALED = 1 << 16
# Kept blocks brought back in one go as their chunk comes up, between which
# the loop answers calls: a few ms of work each.
RESTORE_PART = 512


def pick_pool_file(directory: str, prefix: str, slot_bytes: int, pool_bytes: int,
                   fresh: bool) -> tuple[str, int] | None:
    """The pool file this daemon adopts (its name without .pool) and its
    slot size, or None to start empty. A kept pool of the asked size is
    adopted with the slot size it has (--slot-size is a hint for a new pool:
    a block takes as many slots as it needs, so an earlier daemon's slots,
    2 MiB before blocks of any size, still serve). Files of earlier daemons on
    this address that it does not adopt are removed: each holds its size in
    RAM. The log says why."""
    candidates = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith(prefix) and name.endswith(".pool")):
            continue
        path = os.path.join(directory, name)
        header, reason = read_header(path)
        if header is not None and not reason:
            page = huge_page_bytes(directory) or mmap.PAGESIZE
            kept_slot = header["slot_bytes"]
            num_slots = pool_bytes // kept_slot if kept_slot > 0 else 0
            reason = (_incompatible(header, num_slots, pool_file_bytes(num_slots, kept_slot, page))
                      or why_parts_unusable(path, header["layout"]))
        if fresh and not reason:
            reason = "--fresh was given"
        if reason:
            _remove(path, reason)
        else:
            candidates.append((header["mtime"], name, header["slot_bytes"]))
    if not candidates:
        return None
    candidates.sort()
    for _, name, _ in candidates[:-1]:
        _remove(os.path.join(directory, name), "a newer pool file of this address is adopted instead")
    _, name, kept_slot = candidates[-1]
    if kept_slot != slot_bytes:
        log.info("the kept pool %s has slots of %d bytes (--slot-size asks for %d for a new pool): "
                 "adopted with its own", name, kept_slot, slot_bytes)
    return name[: -len(".pool")], kept_slot


def _incompatible(header: dict, num_slots: int, file_bytes: int) -> str:
    if header["format"] != FORMAT_VERSION:
        return f"it is of record format {header['format']}, this daemon writes {FORMAT_VERSION}"
    if header["num_slots"] != num_slots:
        return (f"it has {header['num_slots']} slots of {header['slot_bytes']} bytes, --pool-size asks for "
                f"{num_slots} of those")
    if header["file_size"] != file_bytes:
        return f"it has {header['file_size']} bytes where this folder's pages make {file_bytes} (huge pages changed?)"
    return ""


def _remove(path: str, reason: str) -> None:
    log.warning("not adopting the pool %s: %s; removing it", path, reason)
    for victim in (*present_parts(path), path, catalog_path(path)):  # as kept_pools.discard
        try:
            os.unlink(victim)
        except FileNotFoundError:
            pass
        except OSError as e:  # another user's file in a shared folder
            log.warning("cannot remove %s: %s", victim, e.strerror)


class WarmPool(Tier):
    """Seals committed shards into the pool's records, and adopts them.

    The pool kept across restarts is DRAM itself: it holds no block DRAM does
    not, and its counters are DRAM's."""

    name = "dram"
    below_dram = False

    def __init__(self, pool: HostPool, loop=None, threads: int = 0, progress=lambda text: None):
        self.pool = pool
        self.catalog = Catalog(catalog_path(pool.path))
        if not pool.adopted:
            self.catalog.claim()
        self._loop = loop
        # Hashing threads for adoption (0: one a core, at most 16), and who shows its progress.
        self._adopt_threads = threads
        self._progress = progress
        self.adopted_blocks = 0
        self.adopted_shards = 0
        self.adopted_slots = 0
        self.adopt_discarded: dict[str, int] = {}
        # Kept blocks waiting for their chunks to come up, and their checks under way.
        self._adoption: Adoption | None = None
        self._finishing: Adoption | None = None  # its last checks under way, once none waits
        self._late: list[asyncio.Future] = []
        self._restoring = asyncio.Lock()  # one late chunk's blocks back at a time
        self._closed = False
        # One thread: a batch at a time, so that hashing takes at most a
        # core and its memory bandwidth from the copies.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvdepot-seal", initializer=name_os_thread
        )
        self._noted: dict[tuple[int, int], bytes] = {}
        # The native lane, where it seals committed shards (hand_sealing_over).
        self._sealer = None
        self._pending: list = []
        self._flush_scheduled = False
        self.generation = 0
        self.sealed = 0
        self.skipped = 0
        # Shards committed and not sealed yet (pending or being hashed).
        self.unsealed = 0

    # ------------------------------------------------------------ sealing

    def hand_sealing_over(self, sealer) -> bool:
        self._sealer = sealer
        return True

    def note(self, ns, rank: int | None) -> None:
        if self._sealer is not None:  # the lane seals: the catalog must name what it seals first
            self._digest(ns, rank)

    def _digest(self, ns, rank: int | None) -> bytes:
        """The namespace's digest, its identity (and `rank`'s signature, once
        fixed) written to the catalog first."""
        digest = self._noted.get((ns.id, rank))
        if digest is None:
            signature = ns.rank_signatures.get(rank) if rank is not None else None
            digest = self.catalog.note(ns.identity, {rank: signature} if signature is not None else {})
            if signature is not None:  # else noted again once a worker of the rank has fixed it
                self._noted[(ns.id, rank)] = digest
        return digest

    def demote(self, ns, rank: int, blocks, length: int) -> None:
        """Seals the rank `rank` shards of `ns`'s `blocks` once their bytes are
        hashed. Runs on the event loop, and costs it an append a shard: the
        hashing and packing happen on a thread, in batches a few ms apart.
        Where the native lane seals, it has done so already."""
        if self._sealer is not None:
            return
        digest = self._digest(ns, rank)
        epochs, pending = self.pool.epochs, self._pending
        if self.unsealed + len(blocks) > max(self.pool.num_slots, MAX_UNSEALED):
            # Stores outrun the hashing (which does about 20 GB/s): these are
            # not kept across a restart, rather than the backlog growing.
            self.skipped += len(blocks)
            return
        for block in blocks:
            slot = block.slots[rank]
            self.generation += 1
            record = ShardRecord(digest, block.key, rank, ns.tp_size, length, 0, self.generation)
            pending.append((slot, epochs[slot], record))
        self.unsealed += len(blocks)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_later(SEAL_BATCH_SECONDS, self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._pending = self._pending, []
        if batch:
            future = self._threads.submit(self._hash, batch)
            future.add_done_callback(lambda f: self._loop.call_soon_threadsafe(self._write, f, len(batch)))

    def _hash(self, batch) -> list[tuple[int, int, bytes]]:
        view, epochs = self.pool.slot_view, self.pool.epochs
        # A slot already handed out again is skipped (its record would not be
        # written); the check on the loop, in _write, is the one that counts.
        return [
            (slot, epoch, pack(record._replace(data_hash=data_hash(view(slot, record.length)))))
            for slot, epoch, record in batch
            if epochs[slot] == epoch
        ]

    def _write(self, future, count: int) -> None:
        self.unsealed -= count
        if future.cancelled() or future.exception() is not None:
            if not future.cancelled():
                log.warning("sealing records failed: %s", future.exception())
            return
        records, epochs = self.pool.records, self.pool.epochs
        for slot, epoch, packed in future.result():
            # The slot was released or handed out again while its bytes were
            # hashed: the hash may be of other bytes.
            if epochs[slot] == epoch:
                records[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES] = packed
                self.sealed += 1

    async def flush(self, timeout: float = 10.0) -> None:
        """Waits for the records being sealed, so that a daemon that stops
        leaves every committed shard adoptable."""
        deadline = time.monotonic() + timeout
        while self._unsealed() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def _unsealed(self) -> int:
        return self.unsealed if self._sealer is None else self._sealer.unsealed

    async def close(self) -> None:
        # Checks of kept blocks under way read the pool: they end before it
        # goes, and no other starts (their blocks stay for the next daemon).
        self._closed = True
        me = asyncio.current_task()
        await asyncio.gather(*[t for t in self._late if t is not me], return_exceptions=True)
        if self._adoption is not None:
            self._adoption.close()
        await self.flush()  # every committed shard sealed, for the next daemon
        self._threads.shutdown(wait=True, cancel_futures=False)

    def stats(self) -> TierStats:
        discarded = dict(self.adopt_discarded)
        sealed, skipped = (self.sealed, self.skipped) if self._sealer is None else (
            self._sealer.sealed, self._sealer.not_sealed)
        if skipped:
            discarded["not_sealed"] = skipped
        return TierStats(self.name, written_shards=sealed, recovered_shards=self.adopted_shards,
                         write_errors=self.catalog.write_errors, discarded=discarded)

    def recover(self) -> None:
        """Adopts the kept pool's blocks, if the pool file was kept: those in
        chunks that are up now, the others as their chunks come up (pool_grew)."""
        if not self.pool.adopted:
            return
        self._progress(f"adopting the blocks of {self.pool.path}")
        adoption = Adoption(self.pool, self.catalog, self._adopt_threads)
        adoption.find(log.warning)
        self.catalog.claim()  # what it named, or where nothing was, this user's file from now on
        self.generation = adoption.generation
        self.adopt_discarded = dict(adoption.discarded)
        checked = adoption.check(adoption.take_up())
        self.pool.hold(adoption.held_runs())
        # The found blocks' runs and those held are taken, every other slot up is freed.
        self.pool.keep_only(adoption.runs(checked.blocks) | self.pool.held)
        checked.bad_slots = []  # freed by keep_only
        self._restore(checked)
        if self._sealer is not None:
            self._sealer.set_generation(self.generation)
        self._adoption = adoption if adoption.left else None
        if not adoption.left:
            adoption.close()
        waiting = f"; {adoption.left} more wait for their part of the pool to come up" * bool(adoption.left)
        log.info(
            "adopted %d block(s) (%d slots) from the kept pool in %.2f s%s; shards discarded: %s",
            self.adopted_blocks, self.adopted_slots, checked.seconds, waiting, self._discarded_text(),
        )

    def _restore(self, checked: Checked, waited: bool = False) -> None:
        """Checked blocks back to DRAM; the slots of those that failed freed.
        `waited`: their slots were held for adoption (HostPool.hold)."""
        for reason, n in checked.discarded.items():
            self.adopt_discarded[reason] = self.adopt_discarded.get(reason, 0) + n
        if checked.bad_slots:
            self.host.free_kept(checked.bad_slots)
        specs: dict[tuple, tuple[NamespaceSpec, str]] = {}  # one per namespace, not per block
        kept = []
        for c in checked.blocks:
            if c.identity not in specs:
                fields = dict(zip(IDENTITY_FIELDS, c.identity))
                scope = fields.pop("scope")
                specs[c.identity] = NamespaceSpec(**fields), scope
            spec, scope = specs[c.identity]
            kept.append(KeptBlock(spec, scope, c.signatures, c.key, c.slots, c.lengths))
        refused = self.host.restore(kept, waited)
        for block, error in refused:  # a limit lowered since, a spec no longer valid, a key stored anew
            reason = "stored_anew" if isinstance(error, KeyError) else "namespace_refused"
            self.adopt_discarded[reason] = self.adopt_discarded.get(reason, 0) + len(block.slots)
            log.warning("an adopted block of %s is discarded: %s", getattr(block.spec, "model", "?"), error)
        self.adopted_blocks += len(kept) - len(refused)
        self.adopted_shards += sum(len(b.slots) for b in kept) - sum(len(b.slots) for b, _ in refused)
        span = self.pool.span
        self.adopted_slots += (sum(span(n) for b in kept for n in b.lengths)
                               - sum(span(n) for b, _ in refused for n in b.lengths))

    def _discarded_text(self) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in sorted(self.adopt_discarded.items())) or "none"

    def pool_grew(self, first: int, count: int) -> None:
        """A chunk of the pool came up: the kept blocks it completes are
        checked on threads and come back (on the loop)."""
        adoption = self._adoption
        if adoption is None or self._closed:
            return
        chunk = self.pool.chunk_of(first)
        up = adoption.chunk_up(chunk)
        self._finish_if_none_waits(adoption)
        if up or adoption.checking(chunk):
            self._late.append(asyncio.ensure_future(self._adopt_late(adoption, up, chunk)))

    def _finish_if_none_waits(self, adoption: Adoption) -> None:
        if adoption is self._adoption and not adoption.left:
            self._adoption, self._finishing = None, adoption
            self._late.append(asyncio.ensure_future(self._close_when_done(adoption)))

    async def _close_when_done(self, adoption: Adoption) -> None:
        """After the last chunk's candidates: their checks end, then the hashing threads."""
        me = asyncio.current_task()
        await asyncio.gather(*[t for t in self._late if t is not me and not t.done()], return_exceptions=True)
        adoption.close()
        self._finishing = None
        if not self._closed:
            log.info("adopted %d block(s) (%d slots) from the kept pool, the last as their part of the pool came "
                     "up; shards discarded: %s", self.adopted_blocks, self.adopted_slots, self._discarded_text())

    async def _adopt_late(self, adoption: Adoption, up: list, chunk: int) -> None:
        came_up = time.monotonic()
        try:
            up, checked = await self._loop.run_in_executor(adoption.late_checks, adoption.check_chunk, up, chunk)
        except Exception:  # its blocks stay held, their records for the next daemon
            log.exception("checking kept blocks as the pool came up failed")
            return
        adoption.settle_chunk(chunk, up)
        # One chunk's blocks at a time: several chunks' parts in turn would
        # each take the loop between two steps of a call.
        async with self._restoring:
            if self._closed:
                return  # held: the next daemon adopts them
            try:
                done = await self._restore_late(up, checked)
            except Exception:  # (the gathers that wait for this task would swallow it)
                log.exception("bringing %d checked kept block(s) back as the pool came up failed: their slots "
                              "stay taken until the next start", len(checked.blocks))
                return
            finally:
                for candidate in up:
                    candidate.settled = True
            if done:
                self.pool.let_go_held([slot for c in up for slot in c.slots])
            log.debug("chunk %d: %d kept block(s) checked in %.3f s, back %.3f s after the chunk came up",
                      chunk, len(up), checked.seconds, time.monotonic() - came_up)

    async def _restore_late(self, up: list, checked: Checked) -> bool:
        """The checked blocks back in parts, the loop free between them: a chunk
        of a large pool holds hundreds of thousands of small blocks, and calls
        would wait seconds. False when the daemon closed meanwhile (the rest
        held: the next daemon adopts them)."""
        # Cleared during the check: clear() freed their slots already.
        gone = {slot for c in up if c.dropped for slot in c.slots}
        self._restore(Checked(bad_slots=[slot for slot in checked.bad_slots if slot not in gone],
                              discarded=checked.discarded), waited=True)
        blocks = checked.blocks
        # The newest part first: each goes in at the eviction order's old end.
        for first in reversed(range(0, len(blocks), RESTORE_PART)):
            part = [c for c in blocks[first : first + RESTORE_PART] if not c.dropped]  # cleared meanwhile
            self._restore(Checked(blocks=part), waited=True)
            for candidate in part:
                candidate.settled = True
            self.pool.let_go_held([slot for c in part for slot in c.slots])
            await asyncio.sleep(0)
            if self._closed:
                return False
        return True

    def clear(self, ns) -> None:
        """Kept blocks of `ns` (every namespace's when None) still waiting for
        their chunk, or being checked, never come back: their records go now
        (a restart before their chunk comes up must not bring them back), and
        their slots are freed, now where they are up, else as they come up."""
        adoption = self._adoption or self._finishing
        if adoption is None or self._closed:
            return
        gone = adoption.drop(None if ns is None else ns.digest)
        if not gone:
            return
        slots = [slot for c in gone for slot in c.slots]
        for slot in slots:
            self.pool.records[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES] = bytes(RECORD_BYTES)
        self.pool.let_go_held(slots)
        up = [slot for slot in slots if self.pool.is_online(slot)]
        if up:
            self.host.free_kept(up)
        self.adopt_discarded["cleared"] = self.adopt_discarded.get("cleared", 0) + len(slots)
        self._finish_if_none_waits(adoption)  # every one left was cleared

