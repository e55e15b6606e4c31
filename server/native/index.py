"""The block index when the native lane holds it: what the depot's control
plane and the tiers ask of it (core/index.py BlockIndex's methods other than a
job's), answered by the lane.

The tiers see blocks as `NativeBlock`s, views of a block by its handle: the
fields they read are asked of the lane, and a handle whose block has left the
index answers that it is gone (the lane reuses entries with a new generation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvdepot.server.core.blocks import BlockState
from kvdepot.server.core.index import LookupResult
from kvdepot.server.core.namespaces import Namespace, Namespaces, gone_from_dram, kept_namespace
from kvdepot.server.core.requests import LookupStatus
from kvdepot.server.core.shares import ScopedEviction
from kvdepot.server.core.tiers import KeptBlock, TierStack
from kvdepot.server.native import lane as lanes
from kvdepot.server.native.lane import Lane


class NativeBlock:
    """A block of the lane's index, as a tier reads it."""

    __slots__ = ("_lane", "handle", "ns", "key", "lengths")

    def __init__(self, lane: Lane, handle: int, key: bytes, ns: Namespace, lengths: tuple | None = None):
        self._lane = lane
        self.handle = handle
        self.ns = ns
        self.key = key
        self.lengths = lengths

    @property
    def slots(self) -> list[int | None]:
        ranks = [self._lane.block_rank(self.handle, rank) for rank in range(self.ns.tp_size)]
        return [r[0] if r is not None and r[0] >= 0 else None for r in ranks]

    @property
    def committed(self) -> set[int]:
        ranks = [self._lane.block_rank(self.handle, rank) for rank in range(self.ns.tp_size)]
        return {rank for rank, r in enumerate(ranks) if r is not None and r[1]}


class NativeIndex:
    def __init__(self, lane: Lane, namespaces: Namespaces, evictions: ScopedEviction, note: Callable,
                 send_changes: Callable[[], None], after_call: Callable[[], None], tiers: TierStack | None):
        self.lane = lane
        self.namespaces = namespaces
        self.evictions = evictions
        self._note = note
        self._send_changes = send_changes
        # Reads what the lane said during a call (its events).
        self._after_call = after_call
        self.tiers = tiers or TierStack()
        self.tiers.attach(self)

    # ------------------------------------------------------------ lookups and snapshots

    def lookup(self, ns: Namespace, keys: list[bytes], note_gone: bool = True) -> LookupResult:
        """index.py BlockIndex.lookup, the tiers' part here: a block absent from
        DRAM that a tier holds starts its promotion."""
        blob, n = b"".join(keys), len(keys)
        kind, (ready, loading, storing, at) = self.lane.lookup(ns.id, blob, n, 0, True)
        while kind == lanes.LOOKUP_ABSENT:
            key = keys[at]
            if self.tiers.promote(ns, key):
                kind, (_, _, more, at) = self.lane.lookup(ns.id, blob, n, at + 1, False)
                storing += 1 + more
                continue
            if note_gone and self.tiers.on and not self.tiers.holds(ns, key):
                # An engine's copy may still list it below DRAM: it is gone.
                self._note(ns, key, BlockState.DROPPED)
            break
        self._after_call()
        status = LookupStatus.NOT_YET if storing else LookupStatus.READY
        return LookupResult(status, ready, loading, storing)

    def snapshot(self, ns: Namespace) -> tuple[list[bytes], list[bytes], set[bytes]]:
        """`ns`'s ready keys, keys being stored, and every key DRAM holds."""
        return (self.lane.keys_of(ns.id, lanes.READY), self.lane.keys_of(ns.id, lanes.STORING),
                set(self.lane.keys_of(ns.id, lanes.ALL)))

    def clear(self, ns: Namespace | None) -> tuple[int, int]:
        counts = self.lane.clear(None if ns is None else ns.id)
        self._after_call()
        self.tiers.clear(ns)
        return counts

    @property
    def pinned_slots(self) -> int:
        return self.lane.counts()["pinned_slots"]

    def verify(self) -> str:
        return self.lane.verify()

    # ------------------------------------------------------------ for the tiers (core/tiers.py TierHost)

    def hold(self, block: NativeBlock) -> None:
        self.lane.hold(block.handle)

    def let_go(self, block: NativeBlock) -> None:
        self.lane.let_go(block.handle)

    def holds(self, block: NativeBlock) -> bool:
        return self.lane.holds(block.handle)

    def reserve_promotion(self, ns: Namespace, key: bytes, lengths: tuple) -> NativeBlock | None:
        ns.note_block_bytes(max(lengths, default=0))
        handle, _ = self.lane.reserve_promotion(ns.id, ns.tp_size, key, lengths)
        self._after_call()
        return NativeBlock(self.lane, handle, key, ns, tuple(lengths)) if handle else None

    def finish_promotion(self, block: NativeBlock, ok: bool) -> None:
        self.lane.finish_promotion(block.handle, ok)
        self._after_call()
        self._send_changes()

    def share(self, scope: str, active: int) -> float:
        return self.evictions.part(scope, active)

    def victims(self, incoming: str, used: dict[str, int], total: int) -> list[str]:
        return self.evictions.victims(incoming, used, total)

    def lower_gone(self, gone: set[tuple[bytes, bytes]]) -> None:
        for ns, key in gone_from_dram(gone, self.namespaces, lambda ns, key: self.lane.contains(ns.id, key)):
            self._note(ns, key, BlockState.DROPPED)
        self._send_changes()

    def free_kept(self, slots: list[int]) -> None:
        self.lane.release_slots(list(slots), waited=True)

    def restore(self, kept: Sequence[KeptBlock], waited: bool = False) -> list[tuple[KeptBlock, Exception]]:
        """As core/index.py's; the slots of blocks it refuses go back to the lane.
        Each run of blocks of one namespace goes to the lane in one call."""
        refused = []
        known: dict = {}
        run: list[KeptBlock] = []
        run_ns: tuple[int, int] | None = None

        def flush() -> None:
            if not run:
                return
            ns_id, tp = run_ns
            went = self.lane.restore_many(ns_id, tp, [b.key for b in run], [s for b in run for s in b.slots],
                                          [n for b in run for n in b.lengths], waited)
            refused.extend((b, KeyError("stored anew while its chunk came up")) for b, ok in zip(run, went) if not ok)
            run.clear()

        # Late (waited): each goes in at the old end, the newest first (core/index.py says why).
        for block_kept in reversed(kept) if waited else kept:
            try:
                ns = kept_namespace(self.namespaces, block_kept, known)
            except Exception as e:
                self.lane.release_slots(list(block_kept.slots), waited)
                refused.append((block_kept, e))
                continue
            if run_ns != (ns.id, len(block_kept.slots)):
                flush()
                run_ns = (ns.id, len(block_kept.slots))
            run.append(block_kept)
        flush()
        self._after_call()
        self._send_changes()
        return refused
