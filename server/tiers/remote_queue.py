"""The remote tier's shards waiting to be published: a queue per scope, the
scopes taking turns, each bounded by its share; and the shards published
already, so that each goes out once.
"""

from __future__ import annotations

import collections

# Shards waiting, at most (every scope), and a scope's least room.
MAX_QUEUED = 4096
MIN_ROOM = 16
# Shards published (or queued) once, not queued again while remembered here.
MAX_PUBLISHED = 1 << 18


class PublishQueue:
    def __init__(self, share):
        self._share = share  # TierHost.share: (scope, active scopes) -> part of 1
        self._queues: dict[str, collections.deque] = {}
        self._published: collections.OrderedDict = collections.OrderedDict()
        self.queued = 0

    def offer(self, scope: str, shard: tuple, item) -> bool | None:
        """Queues `item` (the shard `shard` = (digest, key, rank)): True; None when
        it went out (or is queued) already; False when the scope's queue is full."""
        if shard in self._published:
            return None
        queue = self._queues.get(scope)
        if queue is None:
            queue = self._queues[scope] = collections.deque()
        room = max(MIN_ROOM, int(MAX_QUEUED * self._share(scope, len(self._queues))))
        if len(queue) >= room or self.queued >= MAX_QUEUED:
            if not queue:
                del self._queues[scope]
            return False
        self._published[shard] = None
        while len(self._published) > MAX_PUBLISHED:
            self._published.popitem(last=False)
        queue.append(item)
        self.queued += 1
        return True

    def unmark(self, shard: tuple) -> None:
        """`shard` did not go out: a later commit of it may publish it."""
        self._published.pop(shard, None)

    def next(self):
        """The next item, the scopes taking turns; None when none waits."""
        for scope in list(self._queues):
            queue = self._queues.pop(scope)
            if queue:
                item = queue.popleft()
                self.queued -= 1
                if queue:
                    self._queues[scope] = queue  # to the back: the next scope goes first
                return item
        return None

    def forget(self, digest: bytes | None) -> None:
        """A clear: shards of the namespace `digest` (every one: None) may go out again."""
        for shard in [s for s in self._published if digest is None or s[0] == digest]:
            del self._published[shard]
