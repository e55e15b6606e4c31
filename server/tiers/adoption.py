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

import numpy as np

from kvdepot.server.host.pool import HostPool
from kvdepot.server.host.shard_record import ShardRecord, unpack_columns
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
    row: int = -1  # its row of Adoption._singles, for a block of one shard

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
        # Candidates of several shards (TP, or a key stored twice), as objects.
        self.waiting: list[Candidate] = []
        # Blocks of one shard stored once, most of a pool, as columns until their chunk comes up
        # (_candidates): an object each would cost a start seconds at hundreds of thousands.
        self._singles = None  # shard_record.Columns
        self._identities: dict[bytes, tuple] = {}
        self._signatures: dict[bytes, dict] = {}
        self.left = 0  # candidates still waiting, after take_up
        # The waiting candidates by each chunk not up yet that holds one of their shards,
        # and the single-shard ones' rows of _singles by their chunk.
        self._by_chunk: dict[int, list[Candidate]] = {}
        self._singles_by_chunk: dict[int, np.ndarray] = {}
        # Those of chunks that came up, until their check is back on the loop (settle_chunk),
        # and which of _singles' rows a clear dropped meanwhile.
        self._checking: dict[int, np.ndarray] = {}
        self._dropped_rows = np.zeros(0, dtype=bool)
        self.discarded: dict[str, int] = {}
        self.generation = 0

    def _discard(self, into: dict[str, int], reason: str, count: int = 1) -> None:
        if count:
            into[reason] = into.get(reason, 0) + count

    def find(self, warn) -> None:
        """Reads every record: the candidates wait, every other record is counted."""
        why = self.catalog.load()
        if why:
            warn(f"{why}: the pool's blocks cannot be named and are discarded")
        pool, catalog = self.pool, self.catalog
        columns, reasons = unpack_columns(pool.records)
        for reason, count in reasons.items():
            self._discard(self.discarded, reason, count)
        digests, which = np.unique(columns.ns, return_inverse=True)
        known = {ns: catalog.identity(ns) for ns in digests.tolist()}
        identities = list(known.values())  # in the order of digests
        torn = (columns.length == 0) | (columns.length > pool.largest_shard)
        unknown = np.array([i is None for i in identities], dtype=bool)[which].reshape(-1) & ~torn
        self._discard(self.discarded, "torn", int(torn.sum()))
        self._discard(self.discarded, "unknown_namespace", int(unknown.sum()))
        columns = columns.take(~(torn | unknown))
        # A run must sit where the pool's extents put runs of its span.
        spans = pool.spans(columns.length)
        misplaced = pool.slots.fits(dict(zip(columns.slot.tolist(), spans.tolist(), strict=True)))
        self._identities = {ns: identity for ns, identity in known.items() if identity is not None}
        self._signatures = {ns: catalog.signatures(ns) for ns in self._identities}
        # Most blocks are one rank's, stored once: those stay columns. A key's first 8 bytes with
        # its namespace's tell them apart (keys are hashes); any other, or two alike, go one by one.
        mark = columns.key.view(np.uint8).reshape(-1, 32)[:, :8].copy().view("<u8").reshape(-1)
        mark ^= columns.ns.view(np.uint8).reshape(-1, 16)[:, :8].copy().view("<u8").reshape(-1)
        _, first, counts = np.unique(mark, return_index=True, return_counts=True)
        alone = np.zeros(len(columns), dtype=bool)
        alone[first[counts == 1]] = True
        one_rank = np.array([i is not None and i[6] == 1 for i in identities], dtype=bool)[which].reshape(-1)
        alone &= (columns.tp_size == 1) & one_rank[~(torn | unknown)]
        if misplaced:
            alone &= ~np.isin(columns.slot, np.fromiter(misplaced, dtype=np.int64, count=len(misplaced)))
        self._singles = columns.take(alone)
        if len(self._singles):
            self.generation = int(self._singles.generation.max())
        self._group(columns.take(~alone).records(), misplaced)

    def _group(self, found: list[tuple[int, ShardRecord]], misplaced: dict[int, str]) -> None:
        """The records that are not a lone single-rank block's, grouped by key into candidates."""
        parts: dict[tuple[bytes, bytes], list[tuple[int, ShardRecord]]] = {}
        for slot, record in found:
            parts.setdefault((record.ns, record.key), []).append((slot, record))
        for (digest, key), shards in parts.items():
            if misplaced and any(slot in misplaced for slot, _ in shards):
                bad = sum(slot in misplaced for slot, _ in shards)
                self._discard(self.discarded, "misplaced", bad)
                if len(shards) > bad:
                    self._discard(self.discarded, "incomplete", len(shards) - bad)
                continue
            identity = self._identities[digest]
            tp_size = identity[6]
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
            self.waiting.append(Candidate(identity, self._signatures[digest], key,
                                          [by_rank[r] for r in range(tp_size)], generation, digest))

    def _candidates(self, rows: np.ndarray) -> list[Candidate]:
        """Candidate objects of the single-shard blocks at `rows` of _singles."""
        singles = self._singles.take(rows)
        identities, signatures = self._identities, self._signatures
        return [Candidate(identities[record.ns], signatures[record.ns], record.key, [(slot, record)],
                          record.generation, record.ns, row=row)
                for row, (slot, record) in zip(np.asarray(rows).tolist(), singles.records(), strict=True)]

    def close(self) -> None:
        self.late_checks.shutdown(wait=True)
        self._hashing.shutdown(wait=True)

    def held_runs(self) -> dict[int, int]:
        """The waiting candidates' runs, {first slot: span}."""
        held = {slot: self.pool.span(r.length) for c in self.waiting for slot, r in c.shards}
        if self._singles_by_chunk:
            rows = np.concatenate(list(self._singles_by_chunk.values()))
            spans = self.pool.spans(self._singles.length[rows])
            held.update(zip(self._singles.slot[rows].tolist(), spans.tolist(), strict=True))
        return held

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
        self._dropped_rows = np.zeros(len(self._singles), dtype=bool)
        # A single shard's run lies in one chunk (chunks are whole runs of slots: host/pool.py).
        chunks = self._singles.slot * self.pool.slot_bytes // self.pool.registration_bytes
        order = np.argsort(chunks, kind="stable")
        bounds = np.flatnonzero(np.diff(chunks[order])) + 1
        for rows in np.split(order, bounds) if len(order) else ():
            chunk = int(chunks[rows[0]])
            if self.pool.is_online(int(self._singles.slot[rows[0]])):
                up += self._candidates(rows)
            else:
                self._singles_by_chunk[chunk] = rows
        self.left = len(waiting) + sum(len(rows) for rows in self._singles_by_chunk.values())
        return up

    def drop(self, digest: bytes | None) -> list[Candidate]:
        """The candidates of namespace `digest` (every one for None) still
        waiting or being checked: marked dropped, they never come back."""
        for chunk, rows in list(self._singles_by_chunk.items()):
            mine = self._of_namespace(rows, digest)
            if mine.any():  # as objects, to be dropped with the others
                gone = self._candidates(rows[mine])
                for candidate in gone:
                    candidate.missing = 1
                self.waiting += gone
                self._by_chunk.setdefault(chunk, []).extend(gone)
                if mine.all():
                    del self._singles_by_chunk[chunk]
                else:
                    self._singles_by_chunk[chunk] = rows[~mine]
        checked_gone = []
        for rows in self._checking.values():  # their check is under way
            mine = self._of_namespace(rows, digest) & ~self._dropped_rows[rows]
            if mine.any():
                self._dropped_rows[rows[mine]] = True
                checked_gone += self._candidates(rows[mine])
        gone = [c for c in self.waiting if not c.settled and (digest is None or c.digest == digest)]
        gone += checked_gone
        for candidate in gone:
            candidate.dropped = True
            if candidate.missing:
                self.left -= 1
        self.waiting = [c for c in self.waiting if not (c.settled or c.dropped)]
        return gone

    def _of_namespace(self, rows: np.ndarray, digest: bytes | None) -> np.ndarray:
        """Which of _singles' `rows` are namespace `digest`'s (all for None)."""
        if digest is None:
            return np.ones(len(rows), dtype=bool)
        return self._singles.ns[rows] == np.void(digest)

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
        rows = self._singles_by_chunk.pop(chunk, None)
        if rows is not None:  # made objects on the checking thread (check_chunk), not here on the loop
            self._checking[chunk] = rows
            self.left -= len(rows)
        return up

    def checking(self, chunk: int) -> bool:
        """Whether blocks of one shard of `chunk` are to be checked (check_chunk)."""
        return chunk in self._checking

    def check_chunk(self, up: list[Candidate], chunk: int) -> tuple[list[Candidate], Checked]:
        """On a thread: `up` and the chunk's blocks of one shard, made candidates, and their check."""
        rows = self._checking.get(chunk)
        every = up + (self._candidates(rows) if rows is not None else [])
        return every, self.check(every)

    def settle_chunk(self, chunk: int, every: list[Candidate]) -> None:
        """On the loop, once `chunk`'s check is back: those a clear dropped
        meanwhile are marked, and the others wait (drop looks there) until
        they are settled."""
        if self._checking.pop(chunk, None) is None:
            return
        singles = [c for c in every if c.row >= 0]
        for candidate in singles:
            candidate.dropped = bool(self._dropped_rows[candidate.row])
        self.waiting += [c for c in singles if not c.dropped]

    def check(self, candidates: list[Candidate]) -> Checked:
        """Hashes the candidates' shards on threads: those whose every shard
        holds are the blocks, oldest first."""
        started = time.monotonic()
        result = Checked()
        shards = [shard for c in candidates for shard in c.shards]
        pool = self.pool

        def hash_all(part: list[tuple[int, ShardRecord]]) -> list[int]:
            # The GPU-sealed shards (the native lane's) in one call, the CPU-sealed in another.
            hashes = [0] * len(part)
            for gpu in (True, False):
                which = [i for i, (_, record) in enumerate(part) if record.gpu_hashed == gpu]
                if which:
                    at = pool.shard_hashes([part[i][0] for i in which], [part[i][1].length for i in which], gpu)
                    for i, h in zip(which, at.tolist(), strict=True):
                        hashes[i] = h
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
