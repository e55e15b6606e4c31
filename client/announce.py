"""What this process says about each daemon's availability: once per process.

An engine process often holds several clients of one daemon (vLLM's scheduler
side, and its worker in an in-process engine, or several KV-cache groups): one
daemon outage must read as one warning and one "reconnected", not one per
client. Clients of the same target share this record; each line is said by
whichever notices first.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvdepot.client")

_lock = threading.Lock()
# Target -> the daemon instance this process last said it was attached to,
# or None after saying it is not available.
_said: dict[str, str | None] = {}


def attached(target: str, instance: str) -> None:
    with _lock:
        before = _said.get(target, "")
        if before == instance:
            return
        _said[target] = instance
    if before is None:
        log.warning("reconnected to kvdepotd on %s (instance %s)", target, instance)
    else:
        log.info("attached to kvdepotd on %s (instance %s)", target, instance)


def unavailable(target: str, reason: str) -> None:
    with _lock:
        if target in _said and _said[target] is None:
            return
        _said[target] = None
    log.warning("kvdepotd on %s is not available (%s); offloading is off until it returns", target, reason)
