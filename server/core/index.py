"""The block index: which keys are stored where, who pins them, what to evict.

A block is one key of one namespace; each TP rank stores its own shard of it in
a slot of its own. A block becomes *ready* (visible to lookups and loads) only
when every rank's shard is committed; until then it is *incomplete*, and a
failed shard store frees that shard without ever exposing the block. A block
that a job pins (a store writing it, a load reading it) is never evicted.

A block enters the eviction order when its first shard is committed, ready or
not: an incomplete block is as old as its first shard, so the other ranks'
stores of the same keys, which follow at once, never evict it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvdepot.errors import FailedPrecondition
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.server.core.namespaces import Namespace
from kvdepot.server.host.pool import HostPool
from kvdepot.server.core.shares import ScopedEviction
from kvdepot.server.core.tiers import TierStack


class Block:
    __slots__ = ("ns", "key", "slots", "committed", "writers", "pins", "loading", "ready", "promoted", "lengths")

    def __init__(self, ns: Namespace, key: bytes):
        self.ns = ns
        self.key = key
        self.slots: list[int | None] = [None] * ns.tp_size
        self.committed: set[int] = set()
        self.writers: dict[int, int] = {}  # rank -> job id writing that shard
        self.pins = 0
        self.loading = 0
        self.ready = False
        # Brought up from a lower tier and not looked up since: its next hit
        # counts as that tier's.
        self.promoted = False
        # Each rank's bytes, for a block a tier gave back (kept pool, disk):
        # a load checks them against its worker's layout, which the namespace
        # no longer knows once it was freed or the daemon restarted.
        self.lengths: tuple | None = None

    @property
    def index_key(self) -> tuple[int, bytes]:
        return (self.ns.id, self.key)

    def held_slots(self) -> list[int]:
        return [s for s in self.slots if s is not None]


# The writer of every rank of a block being promoted from a lower tier.
PROMOTION = -1


@dataclass
class LookupResult:
    status: int
    ready: int
    loading: int
    storing: int


@dataclass
class StoreReservation:
    # (position in the request, block) for each shard the job must write.
    writes: list[tuple[int, Block]]
    already_stored: int
    not_stored: int


class BlockIndex:
    def __init__(
        self,
        pool: HostPool,
        evictions: ScopedEviction,
        on_evict: Callable[[Block], None],
        on_change: Callable[[Block, str], None] = lambda block, state: None,
        tiers=None,
        on_change_key: Callable[[Namespace, bytes, str], None] = lambda ns, key, state: None,
    ):
        self.pool = pool
        # What sits under the DRAM blocks (server/tiers): told of commits.
        self.tiers = tiers or TierStack()
        self.tiers.attach(self)
        self.evictions = evictions
        self._on_evict = on_evict
        # Told "storing", "ready" or "dropped" whenever a block's state as
        # Lookup reports it changes.
        self._on_change = on_change
        self._on_change_key = on_change_key
        self._blocks: dict[tuple[int, bytes], Block] = {}
        self._pinned: set[Block] = set()
        # Slots of stores in flight, by scope: at most its share of the pool, so
        # that stores a tenant never completes cannot take every free slot.
        self._storing: dict[str, int] = {}
        # Slots held (ready, incomplete or being stored), by scope, for the shares.
        self._held: dict[str, int] = {}

    # ------------------------------------------------------------ queries

    def lookup(self, ns: Namespace, keys: list[bytes]) -> LookupResult:
        """The ready prefix of `keys`; then the blocks after it that are being
        stored or promoted (NOT_YET: ask again when they are ready). A block
        that only a lower tier holds starts its promotion here."""
        ready = loading = storing = 0
        position = 0
        for position, key in enumerate(keys):
            block = self._blocks.get((ns.id, key))
            if block is None or not block.ready:
                break
            ready += 1
            loading += block.loading > 0
        else:
            position = len(keys)
        for key in keys[position:]:
            block = self._blocks.get((ns.id, key))
            if block is None:
                if self.tiers.promote(ns, key):
                    storing += 1
                    continue
                if self.tiers.on and not self.tiers.holds(ns, key):
                    # An engine's copy may still list it on disk (lower):
                    # it is gone, and the copy should say so. (One the disk
                    # holds but cannot promote now, at its limit of
                    # promotions or with every slot pinned, stays lower.)
                    self._on_change_key(ns, key, "dropped")
                break
            if block.ready or not block.writers:
                break
            storing += 1
        status = pb.LookupResponse.NOT_YET if storing else pb.LookupResponse.READY
        return LookupResult(status, ready, loading, storing)

    @property
    def pinned_slots(self) -> int:
        return sum(len(b.held_slots()) for b in self._pinned)

    def blocks_of(self, ns: Namespace | None) -> list[Block]:
        return [b for b in self._blocks.values() if ns is None or b.ns is ns]

    # ------------------------------------------------------------ pins

    def _pin(self, block: Block) -> None:
        block.pins += 1
        self._pinned.add(block)

    def _unpin(self, block: Block) -> None:
        block.pins -= 1
        if block.pins == 0:
            self._pinned.discard(block)

    def hold(self, block: Block) -> None:
        """Keeps `block` (and its slots) from eviction while a tier reads it."""
        self._pin(block)

    def let_go(self, block: Block) -> None:
        self._unpin(block)

    def holds(self, block: Block) -> bool:
        """Whether `block` is still the index's (not evicted, not cleared)."""
        return self._blocks.get(block.index_key) is block

    # ------------------------------------------------------------ stores

    def reserve_promotion(self, ns: Namespace, key: bytes, lengths: tuple) -> Block | None:
        """A new block whose every rank a lower tier will write, its slots
        taken and pinned; None when no slot can be had (every one pinned)."""
        if self._storing_room(ns.scope) < ns.tp_size:  # a tenant's share, as for its stores
            return None
        index_key = (ns.id, key)
        block = Block(ns, key)
        block.lengths = lengths
        self._pin(block)
        for rank in range(ns.tp_size):
            slot = self._allocate_slot(index_key, ns.scope)
            if slot is None:
                for taken in block.held_slots():
                    self.pool.release(taken)
                    ns.used_slots -= 1
                    self._held[ns.scope] -= 1
                    self._storing[ns.scope] -= 1
                self._unpin(block)
                return None
            block.slots[rank] = slot
            block.writers[rank] = PROMOTION
            ns.used_slots += 1
            self._held[ns.scope] = self._held.get(ns.scope, 0) + 1
            self._storing[ns.scope] = self._storing.get(ns.scope, 0) + 1
        # Pinned once a rank: finish_store unpins each.
        for _ in range(ns.tp_size - 1):
            self._pin(block)
        block.promoted = True
        self._blocks[index_key] = block
        self._on_change(block, "storing")
        return block

    def reserve_store(self, ns: Namespace, rank: int, keys: list[bytes], job_id: int) -> StoreReservation:
        writes: list[tuple[int, Block]] = []
        already = 0
        # Runs once per block of every store, mostly evicting: names bound once.
        blocks, touch, on_change, ns_id = self._blocks, self.evictions.of(ns.scope).touch, self._on_change, ns.id
        room = self._storing_room(ns.scope)
        for position, key in enumerate(keys):
            index_key = (ns_id, key)
            block = blocks.get(index_key)
            if block is not None and (block.ready or rank in block.committed or rank in block.writers):
                already += 1
                if block.ready:
                    touch(index_key)
                continue
            if room <= 0:
                return StoreReservation(writes, already, len(keys) - position)
            created = block is None
            if created:
                block = Block(ns, key)
            # Pinned before making room, so that eviction cannot take it.
            self._pin(block)
            slot = self._allocate_slot(index_key, ns.scope)
            if slot is None:
                self._unpin(block)
                return StoreReservation(writes, already, len(keys) - position)
            room -= 1
            self._storing[ns.scope] = self._storing.get(ns.scope, 0) + 1
            if created:
                blocks[index_key] = block
            block.slots[rank] = slot
            starts_storing = not block.writers
            block.writers[rank] = job_id
            if starts_storing:
                on_change(block, "storing")
            ns.used_slots += 1
            self._held[ns.scope] = self._held.get(ns.scope, 0) + 1
            writes.append((position, block))
        return StoreReservation(writes, already, 0)

    def finish_stores(self, blocks: list[Block], rank: int, ok: bool, length: int) -> None:
        """Ends a store job's shards (of `length` bytes each) and hands the
        committed ones to the tiers below."""
        for block in blocks:
            self.finish_store(block, rank, ok)
        if ok and blocks:
            self.tiers.committed(blocks[0].ns, rank, blocks, length)

    def restore(self, ns: Namespace, key: bytes, slots: list[int], lengths: tuple) -> None:
        """A ready block adopted from the kept pool, its slots already taken
        (tiers/warm.py); restored oldest first, so the eviction order holds."""
        block = Block(ns, key)
        block.slots = list(slots)
        block.lengths = lengths
        block.committed = set(range(ns.tp_size))
        block.ready = True
        self._blocks[block.index_key] = block
        ns.used_slots += len(slots)
        ns.ready_blocks += 1
        self._held[ns.scope] = self._held.get(ns.scope, 0) + len(slots)
        self.evictions.of(ns.scope).insert(block.index_key)

    def finish_store(self, block: Block, rank: int, ok: bool) -> None:
        """Ends one shard's store. A failed shard is dropped from the block, and
        its slot goes back to the pool."""
        del block.writers[rank]
        self._unpin(block)
        self._storing[block.ns.scope] -= 1
        if not ok:
            if not block.writers:
                self._on_change(block, "dropped")
            self._drop_shard(block, rank)
            return
        if not block.committed:
            self.evictions.of(block.ns.scope).insert(block.index_key)
        block.committed.add(rank)
        if len(block.committed) == block.ns.tp_size:
            block.ready = True
            block.ns.ready_blocks += 1
            self._on_change(block, "ready")
        elif not block.writers:
            self._on_change(block, "dropped")  # waits for other ranks, no store in flight

    def _drop_shard(self, block: Block, rank: int) -> None:
        slot = block.slots[rank]
        block.slots[rank] = None
        if slot is not None:
            block.ns.used_slots -= 1
            self._held[block.ns.scope] -= 1
            self.pool.release(slot)
        if not block.held_slots() and not block.writers and block.pins == 0:
            del self._blocks[block.index_key]
            self.evictions.of(block.ns.scope).remove(block.index_key)

    # ------------------------------------------------------------ loads

    def reserve_load(self, ns: Namespace, keys: list[bytes], rank: int, block_bytes: int) -> list[Block]:
        blocks = []
        for position, key in enumerate(keys):
            block = self._blocks.get((ns.id, key))
            if block is None or not block.ready:
                raise FailedPrecondition(
                    f"key {position} of {len(keys)} ({key.hex()[:16]}...) is not stored in "
                    f"namespace {ns.name} (never stored, still being stored, or evicted); "
                    "look it up again"
                )
            if block.lengths is not None and block.lengths[rank] != block_bytes:
                kept = block.lengths[rank]
                if block.pins == 0:  # no worker of this layout can use it: it goes
                    self.evictions.of(ns.scope).remove(block.index_key)
                    self._drop(block)
                    self._on_change(block, "dropped")
                raise FailedPrecondition(
                    f"key {position} of {len(keys)} was kept with {kept} bytes for rank {rank}, and this "
                    f"worker's blocks have {block_bytes}: the namespace's layout changed since it was stored"
                )
            blocks.append(block)
        for block in blocks:
            self._pin(block)
            block.loading += 1
        return blocks

    def lower_gone(self, namespaces, gone: set[tuple[bytes, bytes]]) -> None:
        """(namespace digest, key) pairs a lower tier no longer holds: those
        not in DRAM are dropped for the engines that saw them there."""
        keys: dict[bytes, list[bytes]] = {}
        for digest, key in gone:
            keys.setdefault(digest, []).append(key)
        for ns in namespaces:
            for key in keys.get(ns.digest, ()):
                if (ns.id, key) not in self._blocks:
                    self._on_change_key(ns, key, "dropped")

    def take_promoted(self, blocks: list[Block]) -> int:
        """How many of `blocks` a lower tier brought up and no load has read
        yet: the hits that tier served."""
        count = 0
        for block in blocks:
            if block.promoted:
                block.promoted = False
                count += 1
        return count

    def finish_load(self, block: Block) -> None:
        block.loading -= 1
        self._unpin(block)
        self.evictions.of(block.ns.scope).touch(block.index_key)

    # ------------------------------------------------------------ room

    def _allocate_slot(self, incoming: tuple[int, bytes], scope: str) -> int | None:
        quota = self.evictions.quotas.get(scope)
        at_quota = quota is not None and self._slots_by_scope().get(scope, 0) >= quota
        slot = None if at_quota else self.pool.allocate()
        if slot is not None:
            return slot
        # A full pool (the steady state), or a scope at its quota: each new
        # block evicts one, of the scope that shares.py says gives up a slot.
        evictable = self._evictable
        while slot is None:
            for victim_scope in self.evictions.order(scope, self._slots_by_scope):
                own = victim_scope == scope
                victim_key = self.evictions.of(victim_scope).victim(evictable, incoming if own else None)
                if victim_key is not None:
                    break
            else:
                return None
            victim = self._blocks[victim_key]
            self._drop(victim)
            self._on_evict(victim)
            self._on_change(victim, "lower" if victim.ready and self.tiers.holds(victim.ns, victim.key) else "dropped")
            slot = self.pool.allocate()
        return slot

    def _storing_room(self, scope: str) -> int:
        """Slots `scope` may still take for stores in flight."""
        used = self._slots_by_scope()
        used.setdefault(scope, 0)
        active = len([s for s, n in used.items() if n > 0 or s == scope])
        return int(self.evictions.share(scope, active)) - self._storing.get(scope, 0)

    def _slots_by_scope(self) -> dict[str, int]:
        # A copy: the caller may add the storing scope to it.
        return dict(self._held)

    def _evictable(self, index_key: tuple[int, bytes]) -> bool:
        return self._blocks[index_key].pins == 0

    def _drop(self, block: Block) -> None:
        for rank, slot in enumerate(block.slots):
            if slot is not None:
                self.pool.release(slot)
                block.ns.used_slots -= 1
                self._held[block.ns.scope] -= 1
                block.slots[rank] = None
        if block.ready:
            block.ns.ready_blocks -= 1
        del self._blocks[block.index_key]

    def clear(self, ns: Namespace | None) -> tuple[int, int]:
        """Drops every unpinned block of `ns` (all when None): (dropped, kept pinned)."""
        cleared = pinned = 0
        for block in self.blocks_of(ns):
            if block.pins:
                pinned += 1
                continue
            self.evictions.of(block.ns.scope).remove(block.index_key)
            self._drop(block)
            self._on_change(block, "dropped")
            cleared += 1
        self.tiers.clear(ns)
        return cleared, pinned
