"""Where a session's notifications go, and the block changes each call makes.

A session's JobDone go to its job socket connection once it has one, else to
its Attach stream; everything else (BlocksChanged) goes to the Attach stream.
The changes one call makes to the block index are collected while it runs and
sent once it is done: one BlocksChanged per engine of each namespace that
changed, so an engine's copy of its namespace's keys follows the daemon's.

What waits for the Attach stream is bounded: a client that stops reading it
(stopped, hung, or on purpose) while other engines store in its namespaces
would otherwise make the daemon hold every change for it. Past the bound the
session is ended (the API's Attach stream), since a copy of the keys that missed changes is
wrong anyway; the client attaches again and gets a fresh snapshot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvdepot.errors import KVDepotError, ResourceExhausted
from kvdepot.server.core.blocks import BlockState

if TYPE_CHECKING:
    from kvdepot.server.core.namespaces import Namespace
    from kvdepot.server.core.sessions import Session

# Keys per BlocksChanged notice of a registration snapshot (1 MiB of keys).
SNAPSHOT_CHUNK_KEYS = 32768


@dataclass(frozen=True)
class JobDone:
    job_id: int
    ok: bool
    error: str = ""
    # A store's counts (requests.py Submitted), for a client that asked them of its JobDone.
    already_stored: int = 0
    not_stored: int = 0


@dataclass(frozen=True)
class BlocksChanged:
    """Keys of one engine's namespace whose state changed (proto: BlocksChanged)."""

    engine_id: int
    ready: tuple[bytes, ...] = ()
    storing: tuple[bytes, ...] = ()
    dropped: tuple[bytes, ...] = ()
    lower: tuple[bytes, ...] = ()
    were_ready: tuple[bytes, ...] = ()


Notice = JobDone | BlocksChanged


class JobChannel(Protocol):
    """A session's own way back for JobDone (the API's job socket connection)."""

    @property
    def open(self) -> bool: ...

    def send_done(self, done: JobDone) -> None: ...

    def hold_writes(self) -> None:
        """Holds what is sent from now on, to go out together at write_held."""

    def write_held(self) -> None: ...

    def close(self) -> None: ...


class Outbox:
    """One session's notifications."""

    def __init__(self) -> None:
        # Read by the session's Attach stream with `next`; None once the
        # session has fallen too far behind.
        self.stream: asyncio.Queue[Notice | None] = asyncio.Queue()
        # The session's job socket connection, once it has one.
        self.job_channel: JobChannel | None = None
        self.queued_keys = 0
        # Unbounded until the Attach stream that reads it sets a bound.
        self._max_keys: int | None = None
        self._on_overflow = None
        # Why the session is being ended, once it has fallen too far behind.
        self.overflowed: str | None = None
        # The error the Attach stream ends with.
        self.end_error: type[KVDepotError] = ResourceExhausted

    def bound(self, max_keys: int, on_overflow) -> None:
        """Past `max_keys` keys waiting, everything queued is dropped and
        `on_overflow(reason)` is called soon (not inside the call that overflowed,
        which may be iterating over the sessions)."""
        self._max_keys = max_keys
        self._on_overflow = on_overflow

    async def next(self) -> Notice | None:
        """The next notification; None once the session has fallen too far behind."""
        notification = await self.stream.get()
        if notification is not None:
            self.queued_keys -= _keys_of(notification)
        return notification

    def _put(self, notification: Notice) -> None:
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

    def end(self, reason: str, error: type[KVDepotError] = ResourceExhausted) -> None:
        """The daemon ends the session: its Attach stream ends with `error` and
        `reason` once it reads this far; what was queued goes now, not when the
        stream is read (maybe never)."""
        self.overflowed, self.end_error = reason, error
        while not self.stream.empty():
            self.stream.get_nowait()
        self.stream.put_nowait(None)
        self.queued_keys = 0

    def has_job_channel(self) -> bool:
        return self.job_channel is not None and self.job_channel.open

    def job_done(self, job_id: int, ok: bool, error: str, already_stored: int = 0, not_stored: int = 0) -> None:
        done = JobDone(job_id, ok, error, already_stored, not_stored)
        channel = self.job_channel
        if channel is not None and channel.open:
            channel.send_done(done)
        else:
            self._put(done)

    def blocks_changed(self, engine_id: int, ready=(), storing=(), dropped=(), lower=(), were_ready=()) -> None:
        if self.overflowed is not None:
            return
        self._put(BlocksChanged(engine_id, tuple(ready), tuple(storing), tuple(dropped), tuple(lower),
                                tuple(were_ready)))

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
        # Namespace id -> {key: latest state}.
        self._changes: dict[int, dict[bytes, BlockState]] = {}
        # Namespace id -> keys that were ready in this batch and then changed
        # again: the latest state alone would hide that they were ready.
        self._left_ready: dict[int, set[bytes]] = {}

    def note(self, ns: Namespace, key: bytes, state: BlockState) -> None:
        states = self._changes.setdefault(ns.id, {})
        if state is not BlockState.READY and states.get(key) is BlockState.READY:
            self._left_ready.setdefault(ns.id, set()).add(key)
        states[key] = state

    def send(self) -> None:
        if not self._changes:
            return
        changes, self._changes = self._changes, {}
        left_ready, self._left_ready = self._left_ready, {}
        # One pass over the engines; a namespace's lists are made once, and
        # only for a namespace some engine keeps a copy of.
        messages: dict[int, dict[str, list[bytes]]] = {}
        for session in _live(self._sessions.values()):
            for engine_id, ns in session.engines.items():
                states = changes.get(ns.id)
                if not states:
                    continue
                lists = messages.get(ns.id)
                if lists is None:
                    lists = messages[ns.id] = {name: [] for name in _STATE_NAMES}
                    for key, state in states.items():
                        lists[state.value].append(key)
                    left = left_ready.get(ns.id)
                    lists["were_ready"] = [k for k in left if states[k] is not BlockState.READY] if left else []
                session.outbox.blocks_changed(engine_id, **lists)


_STATE_NAMES = tuple(state.value for state in BlockState)


def _keys_of(notification: Notice) -> int:
    """What a notice counts for against the bound: its keys, a JobDone one."""
    if isinstance(notification, BlocksChanged):
        n = notification
        return max(1, len(n.ready) + len(n.storing) + len(n.dropped) + len(n.lower) + len(n.were_ready))
    return 1


def _live(sessions: Iterable[Session]) -> Iterable[Session]:
    return (s for s in sessions if not s.ended)
