"""Adopting a kept pool's blocks as the chunks that hold them come up.

The records name the candidates: a block whose every rank's record unpacks,
names a namespace the catalog knows and agrees on the TP size. A candidate is
checked (each shard's bytes hashed against its record) once every chunk
holding one of its shards is up (host/bring_up.py): the daemon serves before
that, and its slots are held meanwhile (HostPool.held) so that nothing else
takes them. Only a candidate whose every shard checks out comes back; every
other record is discarded and counted, never served.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import time
from dataclasses import dataclass, field

from kvdepot.server.host.pool import HostPool
from kvdepot.server.host.shard_record import ShardRecord, hash_of, unpack_all
from kvdepot.server.tiers.catalog import Catalog


@dataclass
class Candidate:
    identity: tuple
    signatures: dict
    key: bytes
    # By rank: its slot and record.
    shards: list[tuple[int, ShardRecord]]
    generation: int
    digest: bytes = b""  # its namespace's (records' ns)
    # Chunks of the pool holding one of its shards that are not up yet.
    missing: int = 0
    # Cleared (kvdepot clear) while it waited: it never comes back.
    dropped: bool = False
    settled: bool = False  # restored or discarded after its check

    @functools.cached_property
    def slots(self) -> list[int]:
        return [slot for slot, _ in self.shards]

    @functools.cached_property
    def lengths(self) -> tuple[int, ...]:
        return tuple(record.length for _, record in self.shards)


@dataclass
class Checked:
    """Candidates that checked out (oldest first), and the slots of those that did not."""

    blocks: list[Candidate] = field(default_factory=list)
    bad_slots: list[int] = field(default_factory=list)
    discarded: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class Adoption:
    def __init__(self, pool: HostPool, catalog: Catalog, threads: int = 0):
        self.pool = pool
        self.catalog = catalog
        # One set of hashing threads for every check, at start and as chunks come up.
        self._threads = threads or min(16, os.cpu_count() or 1)
        self._hashing = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="kvdepot-adopt")
        # Late checks one at a time, in the order their chunks came up, each on every hashing
        # thread: overlapping, each would end when the last did.
        self.late_checks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvdepot-check")
        self.waiting: list[Candidate] = []
        self.left = 0  # candidates still waiting, after take_up
        # The waiting candidates by each chunk not up yet that holds one of their shards.
        self._by_chunk: dict[int, list[Candidate]] = {}
        self.discarded: dict[str, int] = {}
        self.generation = 0

    def _discard(self, into: dict[str, int], reason: str, count: int = 1) -> None:
        into[reason] = into.get(reason, 0) + count

    def find(self, warn) -> None:
        """Reads every record: the candidates wait, every other record is counted."""
        why = self.catalog.load()
        if why:
            warn(f"{why}: the pool's blocks cannot be named and are discarded")
        pool, catalog = self.pool, self.catalog
        found, reasons = unpack_all(pool.records)
        for reason, count in reasons.items():
            self._discard(self.discarded, reason, count)
        known = {ns: catalog.identity(ns) for ns in {record.ns for _, record in found}}
        largest = pool.largest_shard
        parts: dict[tuple[bytes, bytes], list[tuple[int, ShardRecord]]] = {}
        for slot, record in found:
            if not 0 < record.length <= largest:
                self._discard(self.discarded, "torn")
            elif known[record.ns] is None:
                self._discard(self.discarded, "unknown_namespace")
            else:
                parts.setdefault((record.ns, record.key), []).append((slot, record))
        # A run must sit where the pool's extents put runs of its span.
        span = pool.span
        misplaced = pool.slots.fits({slot: span(r.length) for shards in parts.values() for slot, r in shards})
        signatures = {ns: catalog.signatures(ns) for ns, identity in known.items() if identity is not None}
        for (digest, key), shards in parts.items():
            if misplaced and any(slot in misplaced for slot, _ in shards):
                bad = sum(slot in misplaced for slot, _ in shards)
                self._discard(self.discarded, "misplaced", bad)
                if len(shards) > bad:
                    self._discard(self.discarded, "incomplete", len(shards) - bad)
                continue
            identity = known[digest]
            tp_size = identity[6]
            if len(shards) == 1 == tp_size == shards[0][1].tp_size:  # most blocks: one rank, stored once
                generation = shards[0][1].generation
                self.generation = max(self.generation, generation)
                self.waiting.append(Candidate(identity, signatures[digest], key, shards, generation, digest))
                continue
            by_rank: dict[int, tuple[int, ShardRecord]] = {}
            for slot, r in sorted(shards, key=lambda s: s[1].generation):
                if r.tp_size == tp_size:
                    by_rank[r.rank] = (slot, r)  # the newest shard of each rank
            # A rank stored twice: a key stored anew while its kept copy waited
            # for its chunk (the daemon stopped before that chunk came up).
            superseded = sum(r.tp_size == tp_size for _, r in shards) - len(by_rank)
            if superseded:
                self._discard(self.discarded, "superseded", superseded)
            if len(by_rank) != tp_size or len(shards) - superseded != tp_size:
                self._discard(self.discarded, "incomplete", len(shards) - superseded)
                continue
            generation = max(r.generation for _, r in by_rank.values())
            self.generation = max(self.generation, generation)
            self.waiting.append(Candidate(identity, signatures[digest], key,
                                          [by_rank[r] for r in range(tp_size)], generation, digest))

    def close(self) -> None:
        self.late_checks.shutdown(wait=True)
        self._hashing.shutdown(wait=True)

    def held_runs(self) -> dict[int, int]:
        """The waiting candidates' runs, {first slot: span}."""
        return {slot: self.pool.span(r.length) for c in self.waiting for slot, r in c.shards}

    def runs(self, candidates) -> dict[int, int]:
        return {slot: self.pool.span(r.length) for c in candidates for slot, r in c.shards}

    def take_up(self) -> list[Candidate]:
        """The candidates whose every shard's chunk is up now; the others wait, by chunk."""
        up, waiting = [], []
        for candidate in self.waiting:
            chunks = {self.pool.chunk_of(slot) for slot in candidate.slots if not self.pool.is_online(slot)}
            candidate.missing = len(chunks)
            for chunk in chunks:
                self._by_chunk.setdefault(chunk, []).append(candidate)
            (waiting if chunks else up).append(candidate)
        # Kept until each is settled or dropped, also once being checked (drop looks here).
        self.waiting = waiting
        self.left = len(waiting)
        return up

    def drop(self, digest: bytes | None) -> list[Candidate]:
        """The candidates of namespace `digest` (every one for None) still
        waiting or being checked: marked dropped, they never come back."""
        gone = [c for c in self.waiting if not c.settled and (digest is None or c.digest == digest)]
        for candidate in gone:
            candidate.dropped = True
            if candidate.missing:
                self.left -= 1
        self.waiting = [c for c in self.waiting if not (c.settled or c.dropped)]
        return gone

    def chunk_up(self, chunk: int) -> list[Candidate]:
        """The waiting candidates that chunk `chunk` coming up completes."""
        up = []
        for candidate in self._by_chunk.pop(chunk, ()):
            if candidate.dropped:
                continue
            candidate.missing -= 1
            if not candidate.missing:
                up.append(candidate)
        self.left -= len(up)
        return up

    def check(self, candidates: list[Candidate]) -> Checked:
        """Hashes the candidates' shards on threads: those whose every shard
        holds are the blocks, oldest first."""
        started = time.monotonic()
        result = Checked()
        shards = [shard for c in candidates for shard in c.shards]
        pool = self.pool

        def hash_all(part: list[tuple[int, ShardRecord]]) -> list[int]:
            # The GPU-sealed shards (the native lane's) in one call, any other one by one.
            gpu = [i for i, (_, record) in enumerate(part) if record.gpu_hashed]
            hashes = [0] * len(part)
            if gpu:
                at = pool.gpu_hashes([part[i][0] for i in gpu], [part[i][1].length for i in gpu])
                for i, h in zip(gpu, at.tolist(), strict=True):
                    hashes[i] = h
            if len(gpu) < len(part):
                for i, (slot, record) in enumerate(part):
                    if not record.gpu_hashed:
                        hashes[i] = hash_of(record, pool.slot_view(slot, record.length))
            return hashes

        # A few parts a thread, not a task a shard: a future costs more than hashing a small shard.
        step = max(16, -(-len(shards) // (4 * self._threads)))
        parts = [shards[i : i + step] for i in range(0, len(shards), step)]
        hashes = iter([h for hashed in self._hashing.map(hash_all, parts) for h in hashed])
        for candidate in candidates:
            bad = sum(next(hashes) != record.data_hash for _, record in candidate.shards)
            if bad:
                self._discard(result.discarded, "data_hash", bad)
                if len(candidate.shards) > bad:
                    self._discard(result.discarded, "incomplete", len(candidate.shards) - bad)
                result.bad_slots += candidate.slots
            else:
                result.blocks.append(candidate)
        result.blocks.sort(key=lambda c: c.generation)
        result.seconds = time.monotonic() - started
        return result
