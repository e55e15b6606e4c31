"""Slots held back from reuse while a client that may still write them lives.

A store whose worker copies itself (the shared-memory transport) and whose
session ended mid-job may still be written by that worker: its process could
be alive with a broken stream. Its slots go back to the pool only once the
process has exited, or after QUARANTINE_MAX_SECONDS. The pid is the one the
kernel reported for the session's job socket, never the client's word.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvdepot.server.pool import HostPool

QUARANTINE_MAX_SECONDS = 60.0


def process_gone(pid: int) -> bool:
    """True when `pid` has exited (a zombie has no memory left to write with).
    A pid of 0 is a writer the kernel could not name to this daemon (another
    PID namespace, or TCP): it is never known to be gone, so its slots wait
    the whole QUARANTINE_MAX_SECONDS."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    # The state letter follows the parenthesised command name.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


@dataclass
class _Entry:
    pid: int
    slots: list[int]
    since: float = field(default_factory=time.monotonic)


class Quarantine:
    def __init__(self, pool: HostPool):
        self._pool = pool
        self._entries: list[_Entry] = []

    def hold(self, pid: int, slots: list[int]) -> None:
        if slots:
            self._entries.append(_Entry(pid, slots))

    @property
    def slots(self) -> int:
        return sum(len(e.slots) for e in self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def release(self, now: float | None = None) -> int:
        """Returns the slots whose writer is gone (or waited out) to the pool."""
        now = time.monotonic() if now is None else now
        released = 0
        keep = []
        for entry in self._entries:
            if process_gone(entry.pid) or now - entry.since > QUARANTINE_MAX_SECONDS:
                for slot in entry.slots:
                    self._pool.release(slot)
                released += len(entry.slots)
            else:
                keep.append(entry)
        self._entries = keep
        return released
