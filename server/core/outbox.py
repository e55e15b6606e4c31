"""Where a session's notifications go, and the block changes each call makes.

A session's JobDone go to its job socket connection once it has one, else to
its Attach stream; everything else (BlocksChanged) goes to the Attach stream.
The changes one call makes to the block index are collected while it runs and
sent once it is done: one BlocksChanged per engine of each namespace that
changed, so an engine's copy of its namespace's keys follows the daemon's.

What waits for the Attach stream is bounded: a client that stops reading it
(stopped, hung, or on purpose) while other engines store in its namespaces
would otherwise make the daemon hold every change for it. Past the bound the
session is ended (service.py), since a copy of the keys that missed changes is
wrong anyway; the client attaches again and gets a fresh snapshot.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Iterable

from kvdepot.errors import ResourceExhausted
from kvdepot.proto import kvdepot_pb2 as pb

if TYPE_CHECKING:
    from kvdepot.server.core.sessions import Session
    from kvdepot.server.core.index import Block

# Keys per BlocksChanged message of a registration snapshot (1 MiB of keys).
SNAPSHOT_CHUNK_KEYS = 32768


class Outbox:
    """One session's notifications."""

    def __init__(self) -> None:
        # Read by the session's Attach stream (service.py) with `next`; None
        # once the session has fallen too far behind.
        self.stream: asyncio.Queue[pb.Notification | None] = asyncio.Queue()
        # The session's job socket connection (job_socket.py), once it has one.
        self.job_channel = None
        self.queued_keys = 0
        # Unbounded until the Attach stream that reads it sets a bound.
        self._max_keys: int | None = None
        self._on_overflow = None
        # Why the session is being ended, once it has fallen too far behind.
        self.overflowed: str | None = None
        # The status the Attach stream ends with (a KVDepotError's code).
        self.end_code = ResourceExhausted.code

    def bound(self, max_keys: int, on_overflow) -> None:
        """Past `max_keys` keys waiting, everything queued is dropped and
        `on_overflow(reason)` is called soon (not inside the call that overflowed,
        which may be iterating over the sessions)."""
        self._max_keys = max_keys
        self._on_overflow = on_overflow

    async def next(self) -> pb.Notification | None:
        """The next notification; None once the session has fallen too far behind."""
        notification = await self.stream.get()
        if notification is not None:
            self.queued_keys -= _keys_of(notification)
        return notification

    def _put(self, notification: pb.Notification) -> None:
        if self.overflowed is not None:
            return
        self.queued_keys += _keys_of(notification)
        if self._max_keys is None or self.queued_keys <= self._max_keys:
            self.stream.put_nowait(notification)
            return
        self.end(
            f"its Attach stream left more than {self._max_keys} keys of notifications unread "
            "(--max-queued-notification-keys raises the limit)"
        )
        asyncio.get_running_loop().call_soon(self._on_overflow, self.overflowed)

    def end(self, reason: str, code=ResourceExhausted.code) -> None:
        """The daemon ends the session: its Attach stream ends with `code` and
        `reason` once it reads this far; what was queued goes now, not when the
        stream is read (maybe never)."""
        self.overflowed, self.end_code = reason, code
        while not self.stream.empty():
            self.stream.get_nowait()
        self.stream.put_nowait(None)
        self.queued_keys = 0

    def has_job_channel(self) -> bool:
        return self.job_channel is not None and self.job_channel.open

    def job_done(self, job_id: int, ok: bool, error: str) -> None:
        done = pb.JobDone(job_id=job_id, ok=ok, error=error)
        channel = self.job_channel
        if channel is not None and channel.open:
            channel.send_done(done)
        else:
            self._put(pb.Notification(job_done=done))

    def blocks_changed(self, engine_id: int, ready=(), storing=(), dropped=(), lower=()) -> None:
        if self.overflowed is not None:
            return
        changed = pb.BlocksChanged(engine_id=engine_id, ready=ready, storing=storing, dropped=dropped, lower=lower)
        self._put(pb.Notification(blocks_changed=changed))

    def snapshot(self, engine_id: int, ready: list[bytes], storing: list[bytes], lower: list[bytes] = ()) -> None:
        """Every ready, storing and lower-tier key of a namespace, for an engine that has just registered."""
        for start in range(0, max(len(ready), len(storing), len(lower)), SNAPSHOT_CHUNK_KEYS):
            end = start + SNAPSHOT_CHUNK_KEYS
            self.blocks_changed(
                engine_id, ready=ready[start:end], storing=storing[start:end], lower=lower[start:end]
            )

    def close(self) -> None:
        if self.job_channel is not None:
            self.job_channel.close()


class ChangeFeed:
    """Block changes of the call being handled, for every engine of their namespaces."""

    def __init__(self, sessions: dict[str, Session]):
        self._sessions = sessions
        # Namespace id -> {key: latest state} ("ready", "storing", "dropped" or "lower").
        self._changes: dict[int, dict[bytes, str]] = {}

    def note(self, block: Block, state: str) -> None:
        self._changes.setdefault(block.ns.id, {})[block.key] = state

    def note_key(self, ns, key: bytes, state: str) -> None:
        self._changes.setdefault(ns.id, {})[key] = state

    def send(self) -> None:
        if not self._changes:
            return
        changes, self._changes = self._changes, {}
        messages = {}
        for ns_id, states in changes.items():
            lists: dict[str, list[bytes]] = {"ready": [], "storing": [], "dropped": [], "lower": []}
            for key, state in states.items():
                lists[state].append(key)
            messages[ns_id] = lists
        for session in _live(self._sessions.values()):
            for engine_id, ns in session.engines.items():
                lists = messages.get(ns.id)
                if lists:
                    session.outbox.blocks_changed(engine_id, **lists)


def _keys_of(notification: pb.Notification) -> int:
    """What a notification counts for against the bound: its keys, a JobDone one."""
    if notification.HasField("blocks_changed"):
        changed = notification.blocks_changed
        return max(1, len(changed.ready) + len(changed.storing) + len(changed.dropped) + len(changed.lower))
    return 1


def _live(sessions: Iterable[Session]) -> Iterable[Session]:
    return (s for s in sessions if not s.ended)
