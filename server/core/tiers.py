"""The tiers below DRAM, and the stack the block index keeps them in.

DRAM (the pinned pool, whose blocks the index holds) is the only tier a GPU
copy touches. A tier below it implements `Tier`:

- `attach(host)`: once, before anything else; `host` is the block index
  (`TierHost`), through which a tier pins the DRAM shards it reads and tells
  what it no longer holds.
- `recover()`: at start, what the tier kept across the daemon's restart
  (the kept pool gives its blocks back to DRAM through `host.restore`).
- `holds`, `keys_of`: look up.
- `may_find`, `find`: a tier that learns what it holds only by asking (the
  remote tier) is asked, off the index, before a lookup that misses.
- `demote`: accept shards DRAM has just committed; DRAM keeps them, and the
  tier copies them in its own time, pinning them meanwhile.
- `promotable`, `promote`: bring a block it holds into slots DRAM gives it,
  reporting the end through `done(ok)`; a failure is a miss, never an error.
- `clear`: drop a namespace's blocks (`kvdepot clear`).
- `stats`: typed counters; `close`: end what is in flight, at exit.

The stack calls every tier the same way, top to bottom: a new tier is one
more entry in its list, and neither the index nor the depot changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

# Keys below DRAM an engine's registration snapshot lists, at most (8 MiB of
# keys): half of what a session may have queued by default.
MAX_LOWER_KEYS = 1 << 18


@dataclass(frozen=True)
class TierStats:
    """A tier's counters (proto: TierStats, which documents each)."""

    name: str
    shards: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    written_shards: int = 0
    written_bytes: int = 0
    read_shards: int = 0
    read_bytes: int = 0
    promotions: int = 0
    failed_promotions: int = 0
    evicted_shards: int = 0
    recovered_shards: int = 0
    direct_io: bool = False
    write_errors: int = 0
    # Shards the tier would not serve, by reason.
    discarded: dict[str, int] = field(default_factory=dict)
    # The remote tier: blocks asked for that the store did not hold whole,
    # shards not published (queue full, store failing), the breaker's state,
    # and the time from fetch to check of promoted blocks (a histogram: the
    # counts at or below each bound, then above every bound, and their sum).
    misses: int = 0
    dropped_writes: int = 0
    circuit: str = ""
    fetch_bounds: tuple = ()
    fetch_counts: tuple = ()
    fetch_seconds: float = 0.0

    def merged(self, other: TierStats) -> TierStats:
        """This tier's counters with `other`'s added (two views of one tier)."""
        sums = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name not in ("name", "direct_io", "discarded", "circuit", "fetch_bounds", "fetch_counts")
        }
        discarded = dict(self.discarded)
        for reason, count in other.discarded.items():
            discarded[reason] = discarded.get(reason, 0) + count
        return replace(self, **sums, direct_io=self.direct_io or other.direct_io, discarded=discarded,
                       circuit=self.circuit or other.circuit, fetch_bounds=self.fetch_bounds or other.fetch_bounds,
                       fetch_counts=self.fetch_counts or other.fetch_counts)


@dataclass(frozen=True)
class KeptBlock:
    """A ready block a tier kept in the pool's own slots across a restart."""

    spec: object  # requests.NamespaceSpec
    scope: str
    # The layout signature of each rank, as its first worker fixed it.
    signatures: dict
    key: bytes
    slots: list[int]
    lengths: tuple


class TierHost(Protocol):
    """What a tier may ask of DRAM (the block index implements it)."""

    def hold(self, block) -> None:
        """Keeps `block`'s slots from eviction while the tier reads them."""

    def let_go(self, block) -> None: ...

    def holds(self, block) -> bool:
        """Whether `block` is still DRAM's (not evicted, not cleared)."""

    def reserve_promotion(self, ns, key: bytes, lengths: tuple) -> object | None:
        """A new block whose every rank a tier will write, slots taken and pinned."""

    def finish_promotion(self, block, ok: bool) -> None: ...

    def lower_gone(self, gone: set[tuple[bytes, bytes]]) -> None:
        """(namespace digest, key) pairs the tier no longer holds."""

    def restore(self, kept: Sequence[KeptBlock], waited: bool = False) -> list[tuple[KeptBlock, Exception]]:
        """Blocks kept in the pool's slots (which the pool counts as used)
        come back as ready, oldest first; returns those refused, their slots
        freed. `waited`: their slots were held for adoption (HostPool.hold)."""

    def free_kept(self, slots: list[int]) -> None:
        """Slots held for kept blocks that did not check out: freed, their records cleared."""

    # The pool's share rule (core/shares.py), for a tier's own room: pure, so
    # a tier may ask from its own threads.

    def share(self, scope: str, active: int) -> float:
        """The part (of 1) of any tier that `scope` may hold while `active` scopes hold some."""

    def victims(self, incoming: str, used: dict[str, int], total: int) -> list[str]:
        """The scopes to take room from, in turn, for `incoming` in a full tier of
        `total` units of which each scope holds `used`."""


class Tier(ABC):
    # As stats and metrics name it.
    name: str = ""
    # Whether the tier can hold blocks DRAM has let go (the kept pool cannot:
    # it is DRAM's own slots).
    below_dram: bool = True

    def attach(self, host: TierHost) -> None:
        self.host = host

    def recover(self) -> None:
        """At start: take up what the tier kept."""

    def pool_grew(self, first: int, count: int) -> None:
        """Slots [first, first + count) of the pool came up (host/bring_up.py), with what they kept."""

    def holds(self, ns, key: bytes) -> bool:
        """Whether the tier holds every rank of `ns`'s block `key`."""
        return False

    def keys_of(self, ns, exclude: set) -> list[bytes]:
        """`ns`'s keys the tier holds whole, but for those in `exclude`, newest last."""
        return []

    @abstractmethod
    def demote(self, ns, rank: int, blocks: Sequence, length: int) -> None:
        """DRAM committed the rank `rank` shards (`length` bytes) of `blocks`."""

    def may_find(self, ns) -> bool:
        """Whether `find` may learn of `ns`'s blocks (a tier that does not
        know its blocks until it asks: the remote tier)."""
        return False

    async def find(self, ns, keys: list[bytes]) -> int:
        """Asks what the tier holds of the run `keys` (DRAM's misses, in order);
        how many leading keys it holds, as now known."""
        return 0

    def promotable(self, ns, key: bytes) -> tuple | None:
        """Each rank's bytes, if the tier can promote `ns`'s block `key` now; else None."""
        return None

    def note(self, ns, rank: int | None) -> None:
        """A namespace whose shards DRAM may commit (with `rank`, once a worker
        of that rank fixed its layout): a tier that names namespaces in its
        records learns them now."""

    def hand_sealing_over(self, sealer) -> bool:
        """A tier that seals DRAM's committed shards itself (the kept pool) lets
        `sealer` (the native lane) seal them instead, as the index commits them;
        True if it did."""
        return False

    def promote(self, ns, key: bytes, slots: list[int], done: Callable[[bool], None]) -> None:
        """Fills `slots` (one a rank) with the block; calls `done(ok)` on the event loop."""
        raise NotImplementedError(f"the {self.name} tier promotes nothing")

    def clear(self, ns) -> None:
        """`kvdepot clear`: `ns`'s blocks (every namespace's when None) go."""

    @abstractmethod
    def stats(self) -> TierStats: ...

    async def close(self) -> None:
        """The daemon exits: end (or wait for) what is in flight."""


class TierStack:
    """The tiers under DRAM, top first, as the block index sees them."""

    def __init__(self, tiers: Sequence[Tier] = ()):
        self.tiers = list(tiers)
        self._host: TierHost | None = None

    def attach(self, host: TierHost) -> None:
        self._host = host
        for tier in self.tiers:
            tier.attach(host)

    def recover(self) -> None:
        for tier in self.tiers:
            tier.recover()

    def pool_grew(self, first: int, count: int) -> None:
        for tier in self.tiers:
            tier.pool_grew(first, count)

    @property
    def on(self) -> bool:
        """Whether a tier can hold blocks that DRAM does not."""
        return any(tier.below_dram for tier in self.tiers)

    def holds(self, ns, key: bytes) -> bool:
        return any(tier.holds(ns, key) for tier in self.tiers)

    def lower_keys(self, ns, exclude: set) -> list[bytes]:
        """`ns`'s keys that a tier holds whole but DRAM (`exclude`) does not."""
        keys: dict[bytes, None] = {}
        for tier in self.tiers:
            keys.update(dict.fromkeys(tier.keys_of(ns, exclude)))
        return list(keys)[-MAX_LOWER_KEYS:]

    def may_find(self, ns) -> bool:
        return any(tier.may_find(ns) for tier in self.tiers)

    async def find(self, ns, keys: list[bytes]) -> bool:
        """Asks the tiers that must (may_find) about `keys`; whether one now
        knows it holds the first."""
        for tier in self.tiers:
            if tier.may_find(ns) and await tier.find(ns, keys):
                return True
        return False

    def committed(self, ns, rank: int, blocks: Sequence, length: int) -> None:
        for tier in self.tiers:
            tier.demote(ns, rank, blocks, length)

    def note(self, ns, rank: int | None) -> None:
        for tier in self.tiers:
            tier.note(ns, rank)

    def hand_sealing_over(self, sealer) -> bool:
        return any([tier.hand_sealing_over(sealer) for tier in self.tiers])

    def promote(self, ns, key: bytes) -> bool:
        """Starts bringing `ns`'s block `key` into DRAM from the highest tier
        that can; False if none can now."""
        for tier in self.tiers:
            lengths = tier.promotable(ns, key)
            if lengths is None:
                continue
            block = self._host.reserve_promotion(ns, key, lengths)
            if block is None:
                return False
            tier.promote(ns, key, list(block.slots), lambda ok, block=block, tier=tier: self._promoted(tier, block, ok))
            return True
        return False

    def _promoted(self, source: Tier, block, ok: bool) -> None:
        self._host.finish_promotion(block, ok)
        if ok:  # in DRAM again: every other tier may keep it
            for tier in self.tiers:
                if tier is not source:
                    for rank, length in enumerate(block.lengths):
                        tier.demote(block.ns, rank, [block], length)

    def clear(self, ns) -> None:
        for tier in self.tiers:
            tier.clear(ns)

    def stats(self, dram: TierStats) -> list[TierStats]:
        """Every tier's counters, DRAM's first; a tier that keeps DRAM itself
        (the pool kept across restarts) adds its counters to DRAM's row."""
        rows = [dram]
        for tier in self.tiers:
            tier_stats = tier.stats()
            if tier_stats.name == dram.name:
                rows[0] = rows[0].merged(tier_stats)
            else:
                rows.append(tier_stats)
        return rows

    async def close(self) -> None:
        """Bottom first: a promotion that ends while a lower tier closes is
        still demoted into the tiers above it."""
        for tier in reversed(self.tiers):
            await tier.close()
