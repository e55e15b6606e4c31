"""Whose records leave the disk tier when it is full: the pool's share rule
(core/shares.py) over the disk's bytes.

Space comes back a whole segment at a time, but segments are shared: a
segment holds the records of every scope that stored while it was written. So
eviction has two steps. A record can leave the index alone (a logical
eviction: it is no longer found, and its bytes no longer count for its scope),
and a segment goes, its file unlinked, once no record in it is indexed. When
the disk is full and a record of scope S is to be written:

1. a segment with no indexed record goes first (its scopes lost it already);
2. else the victims are the scopes the share rule names for S, in turn (S
   itself if it holds its share or more, else those over theirs, the furthest
   over first): the first of them with records in a closed segment loses all
   of its records in the oldest such segment. If no other scope's record is
   in that segment, it goes; else the step repeats;
3. else (no victim has a record outside the segment being written) the
   oldest segment goes, whoever's records it holds.

With one scope this is the old order, oldest segment first. With several, a
scope over its share loses its own oldest records, and a segment it shares
with a scope under its share is freed only when that scope's records in it
go too: the share rule is kept on the bytes scopes hold, at the cost of the
space of dropped records in mixed segments until their segment goes
(measured, tests/test_disk_shares.py: a scope alone in its segments keeps its
share while another writes four times the disk; one whose 150 records were
interleaved with the other's keeps 99; each kept none before). A record
dropped this way can come back at the next start, when the scan finds it.
Records whose namespace has not been seen since the daemon started belong to
no tenant yet; they count as one scope of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvdepot.server.tiers.segments import RecordKey, Segment

# The scope of records whose namespace no engine has named since the daemon started.
UNCLAIMED = "\0unclaimed"


def choose_victims(
    segments: dict[int, Segment], index: dict, current: Segment | None, scope: str | None, rule: ShareRule,
) -> tuple[Segment | None, list[RecordKey]]:
    """(the segment to unlink or None, the keys to drop from the index); (None, [])
    when nothing can go. `scope`: of the record to be written (None: the
    oldest segment goes)."""
    closed = [s for s in segments.values() if s is not current]  # oldest first

    def live(segment: Segment) -> list[RecordKey]:
        return [k for k in segment.keys if index.get(k, (None,))[0] == segment.seq]

    if rule.victims is not None and scope is not None:
        for segment in closed:
            if not any(index.get(k, (None,))[0] == segment.seq for k in segment.keys):
                return segment, []
        scopes: dict[bytes, str] = {}
        used = rule.used()
        # Shares of what the full disk holds: its capacity less headers,
        # padding and the records dropped from segments still standing.
        for victim in rule.victims(scope, used, sum(used.values())):
            for segment in closed:
                keys = live(segment)
                theirs = [k for k in keys if scopes.setdefault(k[0], rule.scope_of(k[0])) == victim]
                if theirs:
                    return (segment if len(theirs) == len(keys) else None), theirs
    if not closed:
        return None, []
    return closed[0], live(closed[0])


@dataclass
class ShareRule:
    """What the disk knows of shares: each namespace's scope and the pool's rule."""

    capacity: int
    # Namespace digest -> its scope (the disk mover learns them from the namespaces it sees).
    scope_of: Callable[[bytes], str] = lambda digest: UNCLAIMED
    # core/tiers.py TierHost.victims; None: the oldest segment goes, whoever's.
    victims: Callable[[str, dict[str, int], int], list[str]] | None = None
    # Indexed bytes, by namespace digest (the store keeps it with its index).
    ns_bytes: dict[bytes, int] = field(default_factory=dict)

    def used(self) -> dict[str, int]:
        """Indexed bytes, by scope."""
        used: dict[str, int] = {}
        for digest, size in self.ns_bytes.items():
            if size > 0:
                scope = self.scope_of(digest)
                used[scope] = used.get(scope, 0) + size
        return used

    def add(self, digest: bytes, size: int) -> None:
        left = self.ns_bytes.get(digest, 0) + size
        if left > 0:
            self.ns_bytes[digest] = left
        else:
            self.ns_bytes.pop(digest, None)
