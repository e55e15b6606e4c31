"""The Python lane's per-job path: a job is checked, its blocks are reserved
in the index (pinned), its transport starts it, and, when its copies end, its
client is told first, then its blocks are committed (or rolled back),
unpinned and counted. Only the daemon writes the pool: no job's end waits on
a client.

The depot (depot.py) takes this as its own; the native lane is its compiled
twin (server/native/src/jobs.cpp), with the same rules and errors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvdepot import jobtrace
from kvdepot.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from kvdepot.server.core.requests import JobKind, JobRequest
from kvdepot.server.core.sessions import RECENT_JOB_IDS, Job, Session, Worker

log = logging.getLogger("kvdepot.depot")


@dataclass(frozen=True)
class Submitted:
    """A store's answer: keys left out as already stored (or being stored by
    another job), and keys not stored because every slot is pinned."""

    already_stored: int = 0
    not_stored: int = 0


class JobPath:
    """The depot's jobs (its state is the depot's: sessions, index, transports,
    counters); every method runs on the event loop's thread."""

    def submit(self, session_id: str, request: JobRequest, received_ns: int = 0) -> Submitted:
        """Starts a store or load job. `received_ns`: when the request was
        read, for jobtrace (0 where nobody traces)."""
        session, worker, keys, state = self._check_job(session_id, request)
        block_ids = request.block_ids
        if request.kind is JobKind.STORE:
            reservation = self.index.reserve_store(worker.ns, worker.rank, keys, request.job_id, worker.node,
                                                   self.index.pool.span(worker.layout.block_bytes))
            writes = reservation.writes
            blocks = [block for _, block in writes]
            block_ids = [block_ids[position] for position, _ in writes]
            answer = Submitted(reservation.already_stored, reservation.not_stored)
        else:
            if len(set(block_ids)) != len(block_ids):
                raise InvalidArgument("a load writes each block id once; the request repeats some")
            blocks = self.index.reserve_load(worker.ns, keys, worker.rank, worker.layout.block_bytes)
            from_disk = self.index.take_promoted(blocks)
            if from_disk:
                self._count(session, worker.ns, disk_hit_blocks=from_disk)
            answer = Submitted()
        slots = [block.slots[worker.rank] for block in blocks]
        job = Job(request.job_id, request.kind, session, worker, blocks, list(block_ids), slots, transport_state=state,
                  already_stored=answer.already_stored, not_stored=answer.not_stored)
        self._begin(job, received_ns)
        self.changes.send()
        if answer.not_stored:
            log.warning(
                "store job %d of session %d: %d block(s) not stored, every slot is pinned",
                job.id, session.number, answer.not_stored,
            )
        return answer

    def _check_job(self, session_id: str, request: JobRequest) -> tuple[Session, Worker, list[bytes], object]:
        """Checks a store or load request before anything is reserved."""
        if self.draining:
            raise Unavailable("the daemon is shutting down and takes no new jobs")
        session = self.session(session_id)
        worker = session.workers.get(request.worker_id)
        if worker is None:
            raise NotFound(f"unknown worker {request.worker_id} in this session: register it first")
        if request.job_id in session.jobs or request.job_id in session.recent_job_id_set:
            raise AlreadyExists(f"job id {request.job_id} is already used by this session")
        self.limits.room_for_job(session)
        keys = request.checked_keys(self.pool.num_slots, worker.layout.num_blocks)
        state = worker.transport.prepare_job(worker, request)
        return session, worker, keys, state

    def _begin(self, job: Job, received_ns: int) -> None:
        if jobtrace.ON:
            job.trace = {"received": received_ns, "begin": jobtrace.now()}
        job.submitted = time.monotonic()
        job.session.jobs[job.id] = job
        (self.store_clock if job.kind is JobKind.STORE else self.load_clock).start()
        self._jobs_in_flight += 1
        self._idle.clear()
        try:
            job.worker.transport.start(job)
        except Exception as e:  # a job that cannot start must not stay in flight forever
            log.exception("%s job %d could not start", job.kind.value, job.id)
            self.finish_job(job, False, f"the daemon could not start the job: {e}")

    def finish_job(self, job: Job, ok: bool, error: str = "") -> None:
        """Commits or rolls back a job whose copies have ended, and tells its client."""
        if self._tell(job, ok, error):
            self._settle(job, ok, error)

    def finish_jobs(self, ended: list[tuple[Job, bool, str]]) -> None:
        """finish_job of jobs whose copies ended together: every client is told
        first, in one write a connection, and the bookkeeping follows."""
        channels = []
        for job, _, _ in ended:
            channel = job.session.outbox.job_channel
            if channel is not None and channel not in channels:
                channel.hold_writes()
                channels.append(channel)
        told = [(job, ok, error) for job, ok, error in ended if self._tell(job, ok, error)]
        for channel in channels:
            channel.write_held()
        for job, ok, error in told:
            self._settle(job, ok, error)

    def _tell(self, job: Job, ok: bool, error: str) -> bool:
        """Tells the client that its job ended; False for a job ended already."""
        session = job.session
        if session.jobs.pop(job.id, None) is None:
            return False
        if job.trace is not None:
            job.trace["finish"] = jobtrace.now()
        # The client is told first, since it waits on this: nothing it sends next
        # is handled before the bookkeeping below has run (one event loop).
        if not session.ended:
            session.outbox.job_done(job.id, ok, error, job.already_stored, job.not_stored)
        if job.trace is not None:
            job.trace["done_sent"] = jobtrace.now()
        return True

    def _settle(self, job: Job, ok: bool, error: str) -> None:
        """Commits or rolls back the blocks of a job its client was told of."""
        session, worker = job.session, job.worker
        if len(session.recent_job_ids) == RECENT_JOB_IDS:
            session.recent_job_id_set.discard(session.recent_job_ids[0])
        session.recent_job_ids.append(job.id)
        session.recent_job_id_set.add(job.id)
        n, nbytes = len(job.blocks), len(job.blocks) * worker.layout.block_bytes
        if job.kind is JobKind.STORE:
            self.index.finish_stores(job.blocks, worker.rank, ok, worker.layout.block_bytes)
            if ok:
                self._count(session, worker.ns, stored_blocks=n, stored_bytes=nbytes)
            self.store_clock.stop()
        else:
            self.index.finish_loads(job.blocks)
            if ok:
                self._count(session, worker.ns, loaded_blocks=n, loaded_bytes=nbytes)
            self.load_clock.stop()
        self.job_times.finished(job.kind, ok, time.monotonic() - job.submitted, session.ended)
        if not ok:
            self._count(session, worker.ns, failed_jobs=1)
            log.warning("%s job %d of session %d failed: %s", job.kind.value, job.id, session.number, error)
        self._jobs_in_flight -= 1
        if self._jobs_in_flight == 0:
            self._idle.set()
        self.changes.send()
        if job.trace is not None:
            job.trace["committed"] = jobtrace.now()
            jobtrace.write_job(session.id, job.id, job.kind.value, len(job.blocks), job.trace)

