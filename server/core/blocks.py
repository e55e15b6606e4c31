"""A block of the index: one key of one namespace, a shard per TP rank."""

from __future__ import annotations

import enum

from kvdepot.server.core.namespaces import Namespace


class BlockState(enum.Enum):
    """A block's state as engines' copies of their namespace follow it."""

    STORING = "storing"
    READY = "ready"
    DROPPED = "dropped"
    # Gone from DRAM, whole in a tier below it.
    LOWER = "lower"


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
