"""An engine's copy of its namespace's keys, kept by the daemon's BlocksChanged.

The daemon sends every ready and storing key of the namespace when the engine
registers, then the changes of every call that made some; lookups are
answered from the copy without a call (`KVDepotClient.cached_lookup`). The
copy lags the daemon by a notification: a block it calls ready may be gone by
the time it is loaded, and that load then fails.

The copies are written under EngineCopies' lock (by the session's thread,
and by a thread that registers an engine); lookups read them without it: a
membership test of a set is atomic in CPython, and a lookup that sees a copy
mid-update may count a few keys of that update and not others, which a copy
between two notifications could say as well.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdepot.proto import kvdepot_pb2 as pb

# Engines whose BlocksChanged may arrive before their RegisterEngine answer.
MAX_EARLY_ENGINES = 16


@dataclass(eq=False)
class EngineHandle:
    namespace: pb.NamespaceSpec
    engine_id: int | None = None
    namespace_name: str = ""
    ready: set = field(default_factory=set)
    storing: set = field(default_factory=set)
    # Held by the daemon's disk tier only (promote.py), and the keys this
    # client has asked the daemon to bring up (from its disk, or to look for
    # in its remote store) whose answer has not come yet.
    lower: set = field(default_factory=set)
    asked: set = field(default_factory=set)
    # Whether the daemon shares the namespace through a remote store: keys
    # the copy does not list are worth asking for (Promoter.ask_ahead).
    remote: bool = False
    # Keys that were ready and are gone (evicted, cleared, daemon lost) since
    # the last take_removed(), whether or not the copy saw them ready; kept
    # only when asked for (track_removed), so that nobody's list grows
    # without a reader.
    removed: list = field(default_factory=list)
    track_removed: bool = False

    @property
    def registered(self) -> bool:
        return self.engine_id is not None

    def lookup(self, keys: Sequence[bytes], start: int) -> tuple[int, bool]:
        """(leading ready keys from `start`, whether the next one is being
        stored, is on the daemon's disk or is being asked for: worth waiting for)."""
        ready = self.ready
        n, end = start, len(keys)
        while n < end and keys[n] in ready:
            n += 1
        return n - start, n < end and (keys[n] in self.storing or keys[n] in self.lower or keys[n] in self.asked)

    def _apply(self, message: pb.BlocksChanged) -> None:
        ready, storing, lower, asked = self.ready, self.storing, self.lower, self.asked
        for key in message.were_ready:
            # Ready and gone again between two messages: gone all the same
            # for whoever announced them stored, whether or not the copy saw them.
            ready.discard(key)
            if self.track_removed:
                self.removed.append(key)
        for key in message.storing:
            storing.add(key)
            lower.discard(key)
            asked.discard(key)
        for key in message.ready:
            storing.discard(key)
            lower.discard(key)
            asked.discard(key)
            ready.add(key)
        for key in message.lower:
            storing.discard(key)
            asked.discard(key)  # on disk anew: worth asking for again
            lower.add(key)
            self._unready(key)
        for key in message.dropped:
            storing.discard(key)
            lower.discard(key)
            asked.discard(key)
            self._unready(key)

    def _unready(self, key: bytes) -> None:
        if key in self.ready:
            self.ready.remove(key)
            if self.track_removed:
                self.removed.append(key)


class EngineCopies:
    """The engines of one client, and the changes that came before their registration's answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[int, EngineHandle] = {}
        # The session whose engine ids _engines holds.
        self._session_id: str | None = None
        # BlocksChanged for an engine whose RegisterEngine answer is still on
        # its way, by (session, engine id).
        self._early: dict[tuple[str, int], list] = {}

    def note(self, session_id: str, message: pb.BlocksChanged) -> None:
        with self._lock:
            engine = self._engines.get(message.engine_id)
            if engine is not None:
                engine._apply(message)
                return
            early = (session_id, message.engine_id)
            if len(self._early) >= MAX_EARLY_ENGINES and early not in self._early:
                # A registration whose answer never came: its notes have no reader.
                self._early.pop(next(iter(self._early)))
            self._early.setdefault(early, []).append(message)

    def attached(self, session_id: str) -> None:
        with self._lock:
            self._session_id = session_id

    def registered(
        self, engine: EngineHandle, session_id: str, engine_id: int, namespace_name: str, remote: bool = False
    ) -> None:
        with self._lock:
            if session_id != self._session_id:
                return  # the answer of a session that has ended: registered again with the next
            if engine.engine_id is not None:
                self._engines.pop(engine.engine_id, None)
            engine.engine_id = engine_id
            engine.namespace_name = namespace_name
            engine.remote = remote
            self._engines[engine_id] = engine
            # The namespace's snapshot may have come in before the answer.
            for message in self._early.pop((session_id, engine_id), []):
                engine._apply(message)

    def forget_all(self, engines: list[EngineHandle]) -> None:
        """The session ended: the daemon's blocks are unknown until it sends them again."""
        with self._lock:
            self._session_id = None
            self._engines.clear()
            self._early.clear()
            for engine in engines:
                engine.engine_id = None
                if engine.track_removed:
                    engine.removed.extend(engine.ready)
                engine.ready, engine.storing, engine.lower, engine.asked = set(), set(), set(), set()

    def take_removed(self, engine: EngineHandle) -> list[bytes]:
        with self._lock:
            removed, engine.removed = engine.removed, []
            return removed
