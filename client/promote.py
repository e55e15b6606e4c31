"""Asks the daemon to bring blocks up from its lower tiers, off the caller's path.

An engine's copy of its namespace lists blocks the disk holds (`lower`). A
lookup answered from the copy that reaches one cannot load it yet: it says
"not yet" (the engine waits, as for blocks being stored) and hands the keys
here, where a thread makes the Lookup call that starts their promotion. The
copy then follows the blocks to storing and ready (or dropped), so the
engine's next lookup finds them. Each key is asked for once while it stays
lower.

A remote store's blocks are not in the copy: where the daemon shares a
namespace through one (`engine.remote`), a request's keys past the copy's
are asked for when the request arrives (`ask_ahead`), before its first
lookup; until the answer comes its lookups say "not yet", and the blocks the
store has are on their way into DRAM by then.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvdepot.errors import KVDepotError

log = logging.getLogger("kvdepot.client")

# Keys one call asks for: the daemon promotes a run of them in one lookup.
MAX_KEYS_PER_ASK = 1024
# Asks waiting for a thread; past this, later lookups ask again.
MAX_WAITING = 256
# Threads that make the calls: an ask the daemon answers only after its remote
# store does must not hold back the asks of other requests behind it.
ASKERS = 4


class Promoter:
    def __init__(self, lookup):
        self._lookup = lookup  # KVDepotClient.lookup
        self._queue: queue.Queue = queue.Queue(MAX_WAITING)
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()

    def ask(self, engine, keys) -> None:
        """Asks for the run of `keys` from the first, which the copy lists lower."""
        run = []
        for key in keys[:MAX_KEYS_PER_ASK]:
            if key in engine.asked:
                if run:
                    break
                continue
            if key not in engine.lower:
                break
            run.append(key)
        if not run:
            return
        engine.asked.update(run)  # before the thread may answer for them
        try:
            self._queue.put_nowait((engine, run))
        except queue.Full:
            engine.asked.difference_update(run)
            return
        self._ensure_thread()

    def ask_ahead(self, engine, keys) -> None:
        """Asks for the run of `keys` from the first the copy does not have
        ready: the keys the copy lists lower, or, on a namespace shared through
        a remote store, every one it is not getting already."""
        if engine.engine_id is None:
            return
        ready, storing, asked = engine.ready, engine.storing, engine.asked
        n = 0
        while n < len(keys) and keys[n] in ready:
            n += 1
        if not engine.remote:
            if n < len(keys) and keys[n] in engine.lower:
                self.ask(engine, keys[n:])
            return
        run = [k for k in keys[n : n + MAX_KEYS_PER_ASK] if k not in storing and k not in asked]
        if not run:
            return
        asked.update(run)
        try:
            self._queue.put_nowait((engine, run))
        except queue.Full:
            asked.difference_update(run)
            return
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        with self._start_lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < ASKERS:
                thread = threading.Thread(target=self._run, name="kvdepot-promote", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            engine, keys = item
            try:
                answer = self._lookup(engine, keys)
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one call
                if not isinstance(e, KVDepotError):
                    log.warning("asking the daemon for blocks below its DRAM failed", exc_info=True)
                engine.asked.difference_update(keys)
                continue
            # Keys past those ready or being promoted now were not started (not
            # held below DRAM, or the daemon at its limit of promotions): a
            # later lookup misses them or asks again. Those being promoted
            # leave `asked` as the copy learns where they are.
            engine.asked.difference_update(keys[: answer.ready_blocks])
            engine.asked.difference_update(keys[answer.ready_blocks + answer.storing_blocks :])

    def close(self) -> None:
        with self._start_lock:
            for thread in self._threads:
                if thread.is_alive():
                    try:
                        self._queue.put_nowait(None)
                    except queue.Full:
                        pass
