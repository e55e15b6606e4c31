"""Which ready block to drop when the pool is full: LRU or ARC.

A policy only orders keys; the index tells it which keys may go (a block pinned
by an in-flight job never does) and frees their slots. `oldest` names the key
the policy would give up and `evict` lets one go, so that the index can look
before it evicts (a block of another size may free nothing a store can use).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

Key = Hashable
Evictable = Callable[[Key], bool]


class LRUPolicy:
    name = "lru"

    def __init__(self, capacity: int):
        self._order: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def insert_oldest(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key, last=False)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def oldest(self, evictable: Evictable, incoming: Key | None = None) -> Key | None:
        return _first(self._order, evictable)

    def ordered(self, incoming: Key | None = None) -> Iterator[Key]:
        """Every key, the one `oldest` would name first; nothing moves."""
        return iter(self._order)

    def evict(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Evictable, incoming: Key | None = None) -> Key | None:
        key = self.oldest(evictable, incoming)
        if key is not None:
            self.evict(key)
        return key


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    T1 holds keys used once recently, T2 keys used at least twice; B1 and B2
    remember keys recently evicted from each. A hit in B1 means T1 was too
    small, a hit in B2 that T2 was: the target size `p` of T1 moves with them.
    Capacity counts blocks.
    """

    name = "arc"

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def insert(self, key: Key) -> None:
        c = self.capacity
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        while len(self.t1) + len(self.b1) > c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c and self.b2:
            self.b2.popitem(last=False)

    def insert_oldest(self, key: Key) -> None:
        """A key this cache has not seen used (no ghost counts), older than every other."""
        self.t1[key] = None
        self.t1.move_to_end(key, last=False)

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.pop(key, None)

    def _lists(self, incoming: Key | None) -> list[OrderedDict]:
        from_t1_first = bool(self.t1) and (
            len(self.t1) > self.p or (incoming in self.b2 and len(self.t1) == int(self.p))
        )
        return [self.t1, self.t2] if from_t1_first else [self.t2, self.t1]

    def oldest(self, evictable: Evictable, incoming: Key | None = None) -> Key | None:
        for live in self._lists(incoming):
            key = _first(live, evictable)
            if key is not None:
                return key
        return None

    def ordered(self, incoming: Key | None = None) -> Iterator[Key]:
        """Every key, the one `oldest` would name first; nothing moves."""
        return itertools.chain(*self._lists(incoming))

    def evict(self, key: Key) -> None:
        """Out of T1 or T2, remembered in the ghost list beside it."""
        for live, ghost in ((self.t1, self.b1), (self.t2, self.b2)):
            if key in live:
                del live[key]
                ghost[key] = None

    def victim(self, evictable: Evictable, incoming: Key | None = None) -> Key | None:
        key = self.oldest(evictable, incoming)
        if key is not None:
            self.evict(key)
        return key


def _first(keys: OrderedDict, evictable: Evictable) -> Key | None:
    """The oldest evictable key, left in place.

    Pinned keys passed over move to the recent end, as if used now: they are in
    use, by a job in flight. Left in place, a load of old blocks would make
    every eviction until it ends walk past all of them again, quadratic in the
    blocks pinned.
    """
    passed = []
    found = None
    for key in keys:
        if evictable(key):
            found = key
            break
        passed.append(key)
    for key in passed:
        keys.move_to_end(key)
    return found


def make_policy(name: str, capacity: int):
    policies = {"lru": LRUPolicy, "arc": ARCPolicy}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(policies)}")
    return policies[name](capacity)
