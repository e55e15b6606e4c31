"""What the daemon counts: per daemon, namespace and client, busy time per
direction, and finished jobs' durations. Plain numbers, kept on the event
loop's thread; the API wing and the metrics read them through Depot.report."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field, fields, replace

from kvdepot.server.core.requests import JobKind

COUNTER_MAX = (1 << 64) - 1
# Upper bounds (seconds) of the job-duration histogram's buckets. Submit to
# completion: a CUDA job of a few blocks takes about a millisecond, a large one
# or a shared-memory job on a busy CPU much longer.
DURATION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# Why a job failed, as few kinds as an operator acts on differently: its
# session ended while it ran (exit, crash, broken stream), or the daemon's own
# copy failed or could not start.
FAILURE_REASONS = ("client_gone", "transport")


def saturating_add(value: int, delta: int) -> int:
    """A counter that stops at the largest uint64 instead of breaking GetStats."""
    return min(value + delta, COUNTER_MAX)


@dataclass
class Counters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    evicted_blocks: int = 0
    failed_jobs: int = 0
    disk_hit_blocks: int = 0

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, saturating_add(getattr(self, f.name), getattr(other, f.name)))

    def copy(self) -> Counters:
        return replace(self)


class BusyClock:
    """Time during which at least one job of one direction was in flight.

    Bytes over this time is the rate the transport achieved, not diluted by
    idle periods between requests.
    """

    def __init__(self) -> None:
        self._in_flight = 0
        self._since = 0.0
        self._total = 0.0

    def start(self) -> None:
        if self._in_flight == 0:
            self._since = time.monotonic()
        self._in_flight += 1

    def stop(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._total += time.monotonic() - self._since

    @property
    def seconds(self) -> float:
        if self._in_flight:
            return self._total + time.monotonic() - self._since
        return self._total


@dataclass
class JobTimes:
    """Durations of finished jobs and failures by reason."""

    # Per kind: count per bucket (not cumulative; the last is +Inf), and the sum.
    buckets: dict[JobKind, list[int]] = field(
        default_factory=lambda: {k: [0] * (len(DURATION_BUCKETS) + 1) for k in JobKind}
    )
    seconds: dict[JobKind, float] = field(default_factory=lambda: dict.fromkeys(JobKind, 0.0))
    failures: dict[tuple[JobKind, str], int] = field(default_factory=dict)

    def finished(self, kind: JobKind, ok: bool, elapsed: float, client_gone: bool) -> None:
        if ok:
            self.buckets[kind][bisect.bisect_left(DURATION_BUCKETS, elapsed)] += 1
            self.seconds[kind] += elapsed
            return
        reason = FAILURE_REASONS[0] if client_gone else FAILURE_REASONS[1]
        self.failures[kind, reason] = self.failures.get((kind, reason), 0) + 1

    def copy(self) -> JobTimes:
        return JobTimes({k: list(v) for k, v in self.buckets.items()}, dict(self.seconds), dict(self.failures))
