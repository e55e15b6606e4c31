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
from dataclasses import dataclass, field

from kvdepot.kept_pools import catalog_of as catalog_path
from kvdepot.kept_pools import read_header
from kvdepot.server.core.requests import NamespaceSpec
from kvdepot.server.core.tiers import KeptBlock, Tier, TierStats
from kvdepot.server.host.pool import HostPool, huge_page_bytes, pool_file_bytes
from kvdepot.server.host.shard_record import (
    FORMAT_VERSION,
    RECORD_BYTES,
    ShardRecord,
    data_hash,
    hash_of,
    pack,
    unpack,
)
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


def pick_pool_file(directory: str, prefix: str, slot_bytes: int, num_slots: int, fresh: bool) -> str | None:
    """The pool file this daemon adopts (its name without .pool), or None to
    start empty. Files of earlier daemons on this address that it does not
    adopt are removed: each holds its size in RAM. The log says why."""
    candidates = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith(prefix) and name.endswith(".pool")):
            continue
        path = os.path.join(directory, name)
        header, reason = read_header(path)
        if header is not None and not reason:
            page = huge_page_bytes(directory) or mmap.PAGESIZE
            reason = _incompatible(header, slot_bytes, num_slots, pool_file_bytes(num_slots, slot_bytes, page))
        if fresh and not reason:
            reason = "--fresh was given"
        if reason:
            _remove(path, reason)
        else:
            candidates.append((header["mtime"], name))
    if not candidates:
        return None
    candidates.sort()
    for _, name in candidates[:-1]:
        _remove(os.path.join(directory, name), "a newer pool file of this address is adopted instead")
    return candidates[-1][1][: -len(".pool")]


def _incompatible(header: dict, slot_bytes: int, num_slots: int, file_bytes: int) -> str:
    if header["format"] != FORMAT_VERSION:
        return f"it is of record format {header['format']}, this daemon writes {FORMAT_VERSION}"
    if header["slot_bytes"] != slot_bytes:
        return f"its slots have {header['slot_bytes']} bytes, --slot-size asks for {slot_bytes}"
    if header["num_slots"] != num_slots:
        return f"it has {header['num_slots']} slots, --pool-size asks for {num_slots}"
    if header["file_size"] != file_bytes:
        return f"it has {header['file_size']} bytes where this folder's pages make {file_bytes} (huge pages changed?)"
    return ""


def _remove(path: str, reason: str) -> None:
    log.warning("not adopting the pool %s: %s; removing it", path, reason)
    for victim in (path, catalog_path(path)):
        try:
            os.unlink(victim)
        except FileNotFoundError:
            pass
        except OSError as e:  # another user's file in a shared folder
            log.warning("cannot remove %s: %s", victim, e.strerror)


@dataclass
class Adopted:
    """What adoption found: blocks to restore and the records it discarded."""

    # (namespace identity, rank signatures, key, slots by rank, generation, lengths by rank)
    blocks: list[tuple[tuple, dict, bytes, list[int], int, tuple]] = field(default_factory=list)
    discarded: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def discard(self, reason: str, count: int = 1) -> None:
        self.discarded[reason] = self.discarded.get(reason, 0) + count


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
        self.adopt_discarded: dict[str, int] = {}
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
        """Adopts the kept pool's blocks, if the pool file was kept."""
        if not self.pool.adopted:
            return
        self._progress(f"adopting the blocks of {self.pool.path}")
        found = self.adopt(self._adopt_threads)
        self.catalog.claim()  # what it named, or where nothing was, this user's file from now on
        # The found blocks' slots are taken, every other one freed.
        self.pool.keep_only({slot for block in found.blocks for slot in block[3]})
        kept = []
        for identity, signatures, key, slots, _, lengths in found.blocks:
            fields = dict(zip(IDENTITY_FIELDS, identity))
            scope = fields.pop("scope")
            kept.append(KeptBlock(NamespaceSpec(**fields), scope, signatures, key, slots, lengths))
        refused = self.host.restore(kept)
        for block, error in refused:  # a limit lowered since, or a spec no longer valid
            found.discard("namespace_refused", len(block.slots))
            log.warning("an adopted block of %s is discarded: %s", getattr(block.spec, "model", "?"), error)
        if self._sealer is not None:
            self._sealer.set_generation(self.generation)
        self.adopted_blocks = len(kept) - len(refused)
        self.adopted_shards = self.pool.used_slots
        self.adopt_discarded = dict(found.discarded)
        discarded = ", ".join(f"{n} {reason}" for reason, n in sorted(found.discarded.items())) or "none"
        log.info(
            "adopted %d block(s) (%d slots) from the kept pool in %.2f s; shards discarded: %s",
            self.adopted_blocks, self.adopted_shards, found.seconds, discarded,
        )

    # ------------------------------------------------------------ adoption

    def adopt(self, threads: int = 0) -> Adopted:
        """The blocks whose every shard's record holds, from an adopted pool."""
        started = time.monotonic()
        found = Adopted()
        why = self.catalog.load()
        if why:
            log.warning("%s: the pool's blocks cannot be named and are discarded", why)
        pool, catalog = self.pool, self.catalog
        shards: list[tuple[int, ShardRecord]] = []
        for slot in range(pool.num_slots):
            record, reason = unpack(pool.records[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES])
            if record is None:
                if reason != "empty":
                    found.discard(reason)
                continue
            if record.length > pool.slot_bytes:
                found.discard("torn")
            elif catalog.identity(record.ns) is None:
                found.discard("unknown_namespace")
            else:
                shards.append((slot, record))
        hashes = self._hash_all(shards, threads)
        blocks: dict[tuple[bytes, bytes], list] = {}
        for (slot, record), hashed in zip(shards, hashes):
            if hashed != record.data_hash:
                found.discard("data_hash")
                continue
            blocks.setdefault((record.ns, record.key), []).append((slot, record))
        for (digest, key), parts in blocks.items():
            identity = catalog.identity(digest)
            tp_size = identity[6]
            by_rank = {r.rank: (slot, r.length) for slot, r in parts if r.tp_size == tp_size}
            if len(by_rank) != tp_size or len(parts) != tp_size:
                found.discard("incomplete", len(parts))
                continue
            generation = max(r.generation for _, r in parts)
            self.generation = max(self.generation, generation)
            slots = [by_rank[r][0] for r in range(tp_size)]
            lengths = tuple(by_rank[r][1] for r in range(tp_size))
            found.blocks.append((identity, catalog.signatures(digest), key, slots, generation, lengths))
        found.blocks.sort(key=lambda b: b[4])
        found.seconds = time.monotonic() - started
        return found

    def _hash_all(self, shards: list[tuple[int, ShardRecord]], threads: int) -> list[int]:
        view = self.pool.slot_view
        workers = threads or min(16, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as executor:
            return list(executor.map(lambda s: hash_of(s[1], view(s[0], s[1].length)), shards, chunksize=64))
