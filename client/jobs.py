"""Job bookkeeping: which jobs are in flight, their results, and who waits for them.

Results arrive on other threads (the session's stream, the job socket's
reader, gRPC's callbacks); callers collect them with `wait` (some jobs, e.g. a
preemption flush) or `take_finished` (everything else, once a step). All state
is under one lock, the condition's, and nothing is called while holding it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Reads the ends of jobs on the calling thread until the first callable says
# they are all in, or time.monotonic() passes the deadline (JobSocket.lead).
Lead = Callable[[Callable[[], bool], float | None], None]


@dataclass
class JobResult:
    job_id: int
    ok: bool
    error: str = ""
    # Stores: keys left out because they were stored (or being stored) already,
    # and keys not stored because every slot was pinned by jobs in flight.
    already_stored: int = 0
    not_stored: int = 0


class JobBook:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._pending: set[int] = set()
        # What runs when a job ends, before its result is filed: (ok, error)
        # -> (ok, error). Taken out (so that it runs once) when the job ends.
        self._on_end: dict[int, Callable[[bool, str], tuple[bool, str]]] = {}
        # Finished jobs not yet handed over, in the order they finished.
        self._results: OrderedDict[int, JobResult] = OrderedDict()
        # Job ids a wait() is blocked on: take_finished() leaves them to it.
        self._awaited: dict[int, int] = {}
        # Jobs whose on_end runs now: still in flight, and ended only once.
        self._ending: set[int] = set()
        # A store's counts from its submit's answer, until its result exists.
        self._store_counts: dict[int, tuple[int, int]] = {}
        # Jobs cancelled here that the daemon may still be running: what runs
        # when the daemon's own end comes (cancel).
        self._after_daemon: dict[int, Callable[[], None]] = {}

    def begin(self, job_id: int, on_end: Callable[[bool, str], tuple[bool, str]] | None = None) -> bool:
        """Tracks a new job. False when the id is in flight already: the job
        that has the id must not be disturbed."""
        with self._changed:
            if job_id in self._pending or job_id in self._after_daemon:
                return False
            self._pending.add(job_id)
            self._results.pop(job_id, None)
            if on_end is not None:
                self._on_end[job_id] = on_end
            return True

    def finish(self, job_id: int, ok: bool, error: str = "") -> None:
        """Files a job's result, once: a later finish of the same job is ignored
        (but for a cancelled job's, which runs what cancel left for it)."""
        with self._changed:
            if job_id not in self._pending or job_id in self._ending:
                # Ended already; a cancelled job's daemon end runs what cancel left.
                after = self._after_daemon.pop(job_id, None) if job_id not in self._pending else None
                if after is None:
                    return
                on_end = None
            else:
                after, on_end = None, self._on_end.pop(job_id, None)
                if on_end is None:
                    self._file(job_id, ok, error)
                    return
                self._ending.add(job_id)
        if after is not None:
            after()
            return
        try:
            ok, error = on_end(ok, error)
        except Exception as e:  # a caller's step must never see it
            ok, error = False, f"the job's end failed in this process: {e}"
        with self._changed:
            self._ending.discard(job_id)
            self._file(job_id, ok, error)

    def _file(self, job_id: int, ok: bool, error: str) -> None:
        self._pending.discard(job_id)
        already, not_stored = self._store_counts.pop(job_id, (0, 0))
        self._results[job_id] = JobResult(job_id, ok, error, already, not_stored)
        self._changed.notify_all()

    def cancel(self, job_id: int, reason: str, after_daemon: Callable[[], None]) -> None:
        """Ends a job in flight, failed with `reason`, without its daemon's end;
        `after_daemon` runs when that end comes (the daemon may still be
        copying). Its id is not taken again until then."""
        with self._changed:
            if job_id not in self._pending or job_id in self._ending:
                return
            self._after_daemon[job_id] = after_daemon
        self.finish(job_id, False, reason)

    def wait_idle(self, timeout: float | None) -> bool:
        """Waits until no job is in flight; False if some still are after `timeout`."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending, timeout)

    def fail_all(self, error: str) -> None:
        with self._changed:
            pending = list(self._pending)
        for job_id in pending:
            self.finish(job_id, False, error)

    def store_counts(self, job_id: int, already_stored: int, not_stored: int) -> None:
        with self._changed:
            result = self._results.get(job_id)
            if result is not None:  # the job's end came first
                result.already_stored, result.not_stored = already_stored, not_stored
            elif job_id in self._pending:
                self._store_counts[job_id] = (already_stored, not_stored)
            # else its result was handed over already: nobody would read the counts

    def wait(
        self, job_ids: Iterable[int], timeout: float | None = None, lead: Lead | None = None
    ) -> dict[int, JobResult]:
        """Waits for the jobs to finish and hands over their results. `lead`
        (the job socket's) reads their ends on this thread while it waits."""
        job_ids = list(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        results = self._results
        with self._changed:
            unknown = [j for j in job_ids if j not in self._pending and j not in results]
            if unknown:
                raise KeyError(f"no job {unknown[0]} was submitted, or its result was taken already")
            for j in job_ids:
                self._awaited[j] = self._awaited.get(j, 0) + 1
            done = all(j in results for j in job_ids)
        try:
            if lead is not None and not done:
                # Read without the lock: a membership test of a dict is atomic.
                lead(lambda: all(j in results for j in job_ids), deadline)
            with self._changed:
                left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._changed.wait_for(lambda: all(j in results for j in job_ids), left_s):
                    left = [j for j in job_ids if j not in results]
                    raise TimeoutError(f"{len(left)} job(s) still in flight after {timeout} s: {left[:8]}")
                return {j: results.pop(j) for j in job_ids}
        finally:
            with self._changed:
                for j in job_ids:
                    self._awaited[j] -= 1
                    if not self._awaited[j]:
                        del self._awaited[j]

    def take_finished(self) -> list[JobResult]:
        """Results of every job finished since the last call (and not taken by a wait)."""
        with self._changed:
            taken = [r for j, r in self._results.items() if j not in self._awaited]
            for result in taken:
                del self._results[result.job_id]
            return taken
