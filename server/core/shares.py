"""Each tenant's share of the pool: one eviction order per scope (a tenant, or
its sharing group), and which scope gives up a slot when the pool is full.

Without this one tenant's big store evicted everyone. Now, when the pool is
full and a scope stores a block:
- a scope's share is its quota (the configuration's `quota`), or else an equal
  part of the pool among the scopes that hold blocks;
- a scope at or over its share evicts its own blocks only: if none can go (its
  own job pins them), its block is not stored;
- a scope under its share takes the slot from the scopes over theirs, the
  furthest over first.
With one scope (every engine of one user, the common case) the storing scope is
always at its share, and eviction is the policy's plain order. A pool with free
slots evicts nobody: shares matter only when the pool is full. The index also
holds each scope's stores in flight to its share (index.py, _storing_room).
Within a scope, the policy (LRU or ARC) picks the block. The tiers below the
pool keep the same rule for their own room (`victims` over their bytes, `part`
for what they do at once), through the tiers' interface (core/tiers.py TierHost).
"""

from __future__ import annotations

from collections.abc import Callable

from kvdepot.server.core.eviction import make_policy


class ScopedEviction:
    def __init__(self, policy: str, capacity: int, quotas: dict[str, int] | None = None):
        make_policy(policy, capacity)  # an unknown name fails here, at start
        self.name = policy
        self.capacity = capacity
        # Scope -> the most slots it may hold.
        self.quotas = dict(quotas or {})
        self._policies: dict[str, object] = {}

    def of(self, scope: str):
        policy = self._policies.get(scope)
        if policy is None:
            policy = make_policy(self.name, self.quotas.get(scope, self.capacity))
            self._policies[scope] = policy
        return policy

    def size(self) -> int:
        """Blocks in every scope's eviction order."""
        return sum(len(policy) for policy in self._policies.values())

    def share(self, scope: str, active: int) -> float:
        return self.quotas.get(scope, self.capacity / max(1, active))

    def part(self, scope: str, active: int) -> float:
        """The share as a part of the whole: the same rule for any tier (its bytes, its promotions)."""
        return self.share(scope, active) / self.capacity

    def order(self, incoming: str, used: Callable[[], dict[str, int]]) -> list[str]:
        """The scopes to evict from, in turn, for a block of `incoming` in a full pool."""
        return self.victims(incoming, used(), self.capacity)

    def victims(self, incoming: str, used: dict[str, int], total: int) -> list[str]:
        """The scopes to take room from, in turn, for `incoming` in a full store of
        `total` units (slots, bytes) of which each scope holds `used`."""
        if len(used) == 1 and incoming in used:
            return [incoming]  # one scope holds it all (the common case): it gives up its own
        used = dict(used)
        used.setdefault(incoming, 0)
        active = len([s for s, n in used.items() if n > 0 or s == incoming])
        share = {s: self.part(s, active) * total for s in used}
        if used[incoming] >= share[incoming]:
            return [incoming]
        # Under its share: the room comes from those over theirs, most over first.
        over = sorted(used, key=lambda s: used[s] - share[s], reverse=True)
        return [s for s in over if used[s] > share[s]] or over
