"""A circuit breaker for a store that may be down or slow.

Closed: calls go through. After `failures` failures in a row it opens: calls
are skipped (the tier is a miss, its publishes are dropped) for a cool-down
that doubles on each failed retry up to `max_cooldown_s`. Then one call is let
through (half open): its success closes the breaker, its failure opens it
again; a trial that never reports back (its caller made no call after all)
is replaced by another after `trial_s`. Each change of state is one log line,
not one per request.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("kvdepot.tiers")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    def __init__(self, what: str, failures: int = 3, cooldown_s: float = 1.0, max_cooldown_s: float = 30.0,
                 trial_s: float = 5.0, clock=time.monotonic):
        self.what = what
        self._threshold = failures
        self._base = cooldown_s
        self._max = max_cooldown_s
        self._clock = clock
        self._failures = 0
        self._cooldown = cooldown_s
        self._opened_at = 0.0
        self._trying = False
        self._trial_s = trial_s
        self._trial_at = 0.0
        self.state = CLOSED
        self.opened = 0

    def allows(self) -> bool:
        """Whether a call may go to the store now (in half open: the one trial call)."""
        if self.state == CLOSED:
            return True
        now = self._clock()
        if self.state == OPEN and now - self._opened_at >= self._cooldown:
            self.state, self._trying = HALF_OPEN, False
        if self.state == HALF_OPEN and (not self._trying or now - self._trial_at >= self._trial_s):
            self._trying, self._trial_at = True, now
            return True
        return False

    def skipping(self) -> bool:
        """Whether the store is being skipped now (open, its cool-down not over)."""
        return self.state == OPEN and self._clock() - self._opened_at < self._cooldown

    def succeeded(self) -> None:
        if self.state != CLOSED:
            log.warning("%s answers again: the remote tier is back on", self.what)
        self.state, self._failures, self._cooldown, self._trying = CLOSED, 0, self._base, False

    def failed(self, error: BaseException | str) -> None:
        self._failures += 1
        if self.state == HALF_OPEN:
            self._cooldown = min(self._max, self._cooldown * 2)
            self._open()
        elif self.state == CLOSED and self._failures >= self._threshold:
            log.warning("%s is failing (%s): the remote tier is skipped, retried in %.0f s",
                        self.what, _describe(error), self._cooldown)
            self._open()

    def _open(self) -> None:
        self.state, self._opened_at, self._trying = OPEN, self._clock(), False
        self.opened += 1


def _describe(error: BaseException | str) -> str:
    if isinstance(error, str):
        return error
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
