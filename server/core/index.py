"""The block index: which keys are stored where, who pins them, what to evict.

A block is one key of one namespace; each TP rank stores its own shard of it in
a slot of its own. A block becomes *ready* (visible to lookups and loads) only
when every rank's shard is committed; until then it is *incomplete*, and a
failed shard store frees that shard without ever exposing the block. A block
that a job pins (a store writing it, a load reading it) is never evicted.

A block enters the eviction order when its first shard is committed, ready or
not: an incomplete block is as old as its first shard, so the other ranks'
stores of the same keys, which follow at once, never evict it first.

The counts derived from the blocks (slots and ready blocks per namespace,
slots held and being stored per scope, the pinned blocks) change in `_count`
and `_pin`/`_unpin` alone; with checking on (KVDEPOT_CHECK_INDEX=1, as the
tests run) every mutation ends by recomputing them from the blocks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvdepot.errors import FailedPrecondition
from kvdepot.server.core import index_check, room
from kvdepot.server.core.blocks import PROMOTION, Block, BlockState
from kvdepot.server.core.namespaces import Namespace, Namespaces, gone_from_dram, kept_namespace
from kvdepot.server.core.requests import LookupStatus
from kvdepot.server.core.shares import ScopedEviction
from kvdepot.server.core.tiers import KeptBlock, TierStack


@dataclass(frozen=True)
class LookupResult:
    status: LookupStatus
    ready: int
    loading: int
    storing: int


@dataclass(frozen=True)
class StoreReservation:
    # (position in the request, block) for each shard the job must write.
    writes: list[tuple[int, Block]]
    already_stored: int
    not_stored: int


Changed = Callable[[Namespace, bytes, BlockState], None]


class BlockIndex:
    def __init__(
        self,
        pool,
        evictions: ScopedEviction,
        namespaces: Namespaces,
        on_evict: Callable[[Block], None] = lambda block: None,
        on_change: Changed = lambda ns, key, state: None,
        send_changes: Callable[[], None] = lambda: None,
        tiers: TierStack | None = None,
        check: bool | None = None,
    ):
        self.pool = pool
        self.evictions = evictions
        self.namespaces = namespaces
        self._on_evict = on_evict
        # Told whenever a key's state as Lookup reports it changes; `send_changes`
        # sends what was told to engines (for changes no call is there to send).
        self._on_change = on_change
        self._send_changes = send_changes
        self._blocks: dict[tuple[int, bytes], Block] = {}
        self._pinned: set[Block] = set()
        # Slots of stores in flight, by scope: at most its share of the pool, so
        # that stores a tenant never completes cannot take every free slot.
        self._storing: dict[str, int] = {}
        # Slots held (ready, incomplete or being stored), by scope, for the shares.
        self._held: dict[str, int] = {}
        self._no_room = room.NoRoom()  # (scope, span) that found no room just now
        # What sits under the DRAM blocks: told of commits, asked on misses.
        self.tiers = tiers or TierStack()
        self.tiers.attach(self)
        if check if check is not None else os.environ.get("KVDEPOT_CHECK_INDEX") == "1":
            index_check.check_after_mutations(self)

    def _changed(self, block: Block, state: BlockState) -> None:
        self._on_change(block.ns, block.key, state)

    # ------------------------------------------------------------ counts

    def _count(self, ns: Namespace, held: int = 0, storing: int = 0, ready: int = 0) -> None:
        """The one place the derived counts change."""
        scope = ns.scope
        if held:
            ns.used_slots += held
            self._held[scope] = self._held.get(scope, 0) + held
        if storing:
            self._storing[scope] = self._storing.get(scope, 0) + storing
        if ready:
            ns.ready_blocks += ready

    def _pin(self, block: Block) -> None:
        block.pins += 1
        self._pinned.add(block)

    def _unpin(self, block: Block) -> None:
        block.pins -= 1
        if block.pins == 0:
            self._pinned.discard(block)

    def verify(self) -> None:
        """Recomputes every derived count from the blocks; IndexInconsistent if one differs."""
        index_check.verify(self, self._blocks.values(), self._held, self._storing, self._pinned)

    # ------------------------------------------------------------ queries

    def lookup(self, ns: Namespace, keys: list[bytes], note_gone: bool = True) -> LookupResult:
        """The ready prefix of `keys`; then the blocks after it that are being
        stored or promoted (NOT_YET: ask again when they are ready). A block
        that only a lower tier holds starts its promotion here."""
        ready = loading = storing = 0
        for key in keys:
            block = self._blocks.get((ns.id, key))
            if block is None or not block.ready:
                break
            ready += 1
            loading += block.loading > 0
        for key in keys[ready:]:
            block = self._blocks.get((ns.id, key))
            if block is None:
                if self.tiers.promote(ns, key):
                    storing += 1
                    continue
                if note_gone and self.tiers.on and not self.tiers.holds(ns, key):
                    # An engine's copy may still list it below DRAM (lower):
                    # it is gone, and the copy should say so. (One a tier
                    # holds but cannot promote now, at its limit of
                    # promotions or with every slot pinned, stays lower.)
                    self._on_change(ns, key, BlockState.DROPPED)
                break
            if block.ready or not block.writers:
                break
            storing += 1
        status = LookupStatus.NOT_YET if storing else LookupStatus.READY
        return LookupResult(status, ready, loading, storing)

    @property
    def pinned_slots(self) -> int:
        return sum(self.pool.span_at(slot) for b in self._pinned for slot in b.held_slots())

    def blocks_of(self, ns: Namespace | None) -> list[Block]:
        return [b for b in self._blocks.values() if ns is None or b.ns is ns]

    def snapshot(self, ns: Namespace) -> tuple[list[bytes], list[bytes], set[bytes]]:
        """`ns`'s ready keys, keys being stored, and every key DRAM holds (a
        registration's snapshot)."""
        blocks = self.blocks_of(ns)
        ready = [b.key for b in blocks if b.ready]
        storing = [b.key for b in blocks if not b.ready and b.writers]
        return ready, storing, {b.key for b in blocks}

    # ------------------------------------------------------------ for the tiers (core/tiers.py TierHost)

    def hold(self, block: Block) -> None:
        self._pin(block)

    def let_go(self, block: Block) -> None:
        self._unpin(block)

    def holds(self, block: Block) -> bool:
        return self._blocks.get(block.index_key) is block

    def reserve_promotion(self, ns: Namespace, key: bytes, lengths: tuple) -> Block | None:
        """A new block whose every rank a lower tier will write, its slots
        taken and pinned; None when no slot can be had (every one pinned)."""
        spans = [self.pool.span(length) for length in lengths]
        if self._storing_room(ns.scope) < sum(spans):  # a tenant's share, as for its stores
            return None
        index_key = (ns.id, key)
        ns.note_block_bytes(max(lengths, default=0))
        block = Block(ns, key)
        block.lengths = lengths
        for rank in range(ns.tp_size):
            self._pin(block)  # before making room, so that eviction cannot take it
            slot = self._allocate_slot(index_key, ns.scope, span=spans[rank])
            if slot is None:
                taken = sum(spans[:rank])
                for held in block.held_slots():
                    self.pool.release(held)
                self._count(ns, held=-taken, storing=-taken)
                for _ in range(rank + 1):
                    self._unpin(block)
                return None
            block.slots[rank] = slot
            block.writers[rank] = PROMOTION
            self._count(ns, held=spans[rank], storing=spans[rank])
        block.promoted = True
        self._blocks[index_key] = block
        self._changed(block, BlockState.STORING)
        return block

    def finish_promotion(self, block: Block, ok: bool) -> None:
        for rank in range(block.ns.tp_size):
            self._finish_shard(block, rank, ok)
        self._send_changes()

    def share(self, scope: str, active: int) -> float:
        return self.evictions.part(scope, active)

    def victims(self, incoming: str, used: dict[str, int], total: int) -> list[str]:
        return self.evictions.victims(incoming, used, total)

    def lower_gone(self, gone: set[tuple[bytes, bytes]]) -> None:
        for ns, key in gone_from_dram(gone, self.namespaces, lambda ns, key: (ns.id, key) in self._blocks):
            self._on_change(ns, key, BlockState.DROPPED)
        self._send_changes()

    def free_kept(self, slots: list[int], waited: bool = True) -> None:
        self.pool.slots.no_longer_waiting(sum(map(self.pool.span_at, slots)) if waited else 0)
        for slot in slots:
            self.pool.release(slot)

    def restore(self, kept: Sequence[KeptBlock], waited: bool = False) -> list[tuple[KeptBlock, Exception]]:
        """Kept blocks, ready, their slots taken, oldest first (a refused one frees its slots); `waited`
        (held until now): older than any block stored since the start, in at the eviction order's old end."""
        refused = []
        known: dict = {}
        for block_kept in reversed(kept) if waited else kept:
            slots = sum(map(self.pool.span_at, block_kept.slots))
            self.pool.slots.no_longer_waiting(slots if waited else 0)
            try:
                ns = kept_namespace(self.namespaces, block_kept, known)
                if (ns.id, block_kept.key) in self._blocks:
                    raise KeyError("stored anew while its chunk came up")
            except Exception as e:
                self.free_kept(block_kept.slots, waited=False)
                refused.append((block_kept, e))
                continue
            block = Block(ns, block_kept.key)
            block.slots = list(block_kept.slots)
            block.lengths = block_kept.lengths
            block.committed = set(range(ns.tp_size))
            block.ready = True
            self._blocks[block.index_key] = block
            self._count(ns, held=slots, ready=1)
            policy = self.evictions.of(ns.scope)
            (policy.insert_oldest if waited else policy.insert)(block.index_key)
            self._changed(block, BlockState.READY)
        self._send_changes()  # the engines' copies hear of them (a late adoption has no call to end)
        return refused

    # ------------------------------------------------------------ stores

    def reserve_store(
        self, ns: Namespace, rank: int, keys: list[bytes], job_id: int, node: int | None = None, span: int = 1
    ) -> StoreReservation:
        """Runs of `span` slots for the shards `keys` still need, on NUMA `node` first (the worker's)."""
        writes: list[tuple[int, Block]] = []
        already = 0
        # Runs once per block of every store, mostly evicting: names bound once.
        blocks, touch, ns_id = self._blocks, self.evictions.of(ns.scope).touch, ns.id
        room = self._storing_room(ns.scope)
        for position, key in enumerate(keys):
            index_key = (ns_id, key)
            block = blocks.get(index_key)
            if block is not None and (block.ready or rank in block.committed or rank in block.writers):
                already += 1
                if block.ready:
                    touch(index_key)
                continue
            if room < span:
                return StoreReservation(writes, already, len(keys) - position)
            created = block is None
            if created:
                block = Block(ns, key)
            # Pinned before making room, so that eviction cannot take it.
            self._pin(block)
            slot = self._allocate_slot(index_key, ns.scope, node, span)
            if slot is None:
                self._unpin(block)
                return StoreReservation(writes, already, len(keys) - position)
            room -= span
            if created:
                blocks[index_key] = block
            block.slots[rank] = slot
            starts_storing = not block.writers
            block.writers[rank] = job_id
            if starts_storing:
                self._changed(block, BlockState.STORING)
            self._count(ns, held=span, storing=span)
            writes.append((position, block))
        return StoreReservation(writes, already, 0)

    def finish_stores(self, blocks: list[Block], rank: int, ok: bool, length: int) -> None:
        """Ends a store job's shards (of `length` bytes each) and hands the
        committed ones to the tiers below."""
        for block in blocks:
            self._finish_shard(block, rank, ok)
        if ok and blocks:
            self.tiers.committed(blocks[0].ns, rank, blocks, length)

    def _finish_shard(self, block: Block, rank: int, ok: bool) -> None:
        """Ends one shard's store. A failed shard is dropped from the block, and
        its slot goes back to the pool."""
        del block.writers[rank]
        self._unpin(block)
        self._count(block.ns, storing=-self.pool.span_at(block.slots[rank]))
        if not ok:
            if not block.writers:
                self._changed(block, BlockState.DROPPED)
            self._drop_shard(block, rank)
            return
        if not block.committed:
            self.evictions.of(block.ns.scope).insert(block.index_key)
        block.committed.add(rank)
        if len(block.committed) == block.ns.tp_size:
            block.ready = True
            self._count(block.ns, ready=1)
            self._changed(block, BlockState.READY)
        elif not block.writers:
            self._changed(block, BlockState.DROPPED)  # waits for other ranks, no store in flight

    def _drop_shard(self, block: Block, rank: int) -> None:
        slot = block.slots[rank]
        block.slots[rank] = None
        if slot is not None:
            self._count(block.ns, held=-self.pool.span_at(slot))
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
                    self._changed(block, BlockState.DROPPED)
                raise FailedPrecondition(
                    f"key {position} of {len(keys)} was kept with {kept} bytes for rank {rank}, and this "
                    f"worker's blocks have {block_bytes}: the namespace's layout changed since it was stored"
                )
            blocks.append(block)
        for block in blocks:
            self._pin(block)
            block.loading += 1
        return blocks

    def take_promoted(self, blocks: list[Block]) -> int:
        """How many of `blocks` a lower tier brought up and no load has read
        yet: the hits that tier served."""
        count = 0
        for block in blocks:
            if block.promoted:
                block.promoted = False
                count += 1
        return count

    def finish_loads(self, blocks: list[Block]) -> None:
        for block in blocks:
            block.loading -= 1
            self._unpin(block)
            self.evictions.of(block.ns.scope).touch(block.index_key)

    # ------------------------------------------------------------ room

    def _allocate_slot(self, incoming: tuple[int, bytes], scope: str, node: int | None = None,
                       span: int = 1) -> int | None:
        quota = self.evictions.quotas.get(scope)

        def at_quota() -> bool:
            return quota is not None and self._held.get(scope, 0) + span > quota

        slot = None if at_quota() else self.pool.allocate(node, span)
        # A full pool (the steady state), or a scope at its quota: each block evicts, of the
        # scope shares.py names; room.py when the oldest there frees no run of this span.
        while slot is None:
            order = self.evictions.order(scope, self._slots_by_scope)
            for victim_scope in order:
                own = victim_scope == scope
                oldest = self.evictions.of(victim_scope).oldest(self._evictable, incoming if own else None)
                if oldest is not None:
                    break
            else:
                return None
            going = [self._blocks[oldest]]
            if not at_quota() and not self.pool.slots.frees_run(going[0].slots, span):
                if self._no_room.recent(scope, span):
                    return None
                orders = [self.evictions.of(s).ordered(incoming if s == scope else None) for s in order]
                going = room.room_for(span, going[0], self._blocks, self.pool.slots, orders, {scope, *order})
                if going is None:
                    self._no_room.note(scope, span)
                    return None
            for victim in going:
                self.evictions.of(victim.ns.scope).evict(victim.index_key)
                self._drop(victim)
                self._on_evict(victim)
                lower = victim.ready and self.tiers.holds(victim.ns, victim.key)
                self._changed(victim, BlockState.LOWER if lower else BlockState.DROPPED)
            if not at_quota():  # else the scope evicts its own until its quota has room
                slot = self.pool.allocate(node, span)
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
        """Takes an unpinned block out, whatever its shards; the caller has
        taken it out of the eviction order."""
        held = 0
        for rank, slot in enumerate(block.slots):
            if slot is not None:
                held += self.pool.span_at(slot)
                self.pool.release(slot)
                block.slots[rank] = None
        self._count(block.ns, held=-held, ready=-int(block.ready))
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
            self._changed(block, BlockState.DROPPED)
            cleared += 1
        self.tiers.clear(ns)
        return cleared, pinned


