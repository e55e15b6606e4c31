"""The CUDA transport's threads: per GPU and direction a copy stream whose jobs
a thread reports as they end, and the gate that holds stores until their
worker's compute has finished.

Both hand their results to the event loop (call_soon_threadsafe): the depot's
state is touched on the loop's thread only.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time

import torch

from kvdepot import jobtrace
from kvdepot.server.transports import cuda_calls
from kvdepot.thread_names import name_os_thread

# Staging buffers per direction and GPU: two let the copy engine move one chunk
# while the kernel fills (or drains) the other; a third gained nothing
# (docs/benchmarks.md).
STAGING_BUFFERS = 2


# Entries (int64) of each direction's ring of job block ids and fence readbacks:
# far more than the jobs of one direction in flight ever hold; a job that finds
# no room takes tensors of its own instead.
RING_ENTRIES = 1 << 16


class Spans:
    """Runs of consecutive entries of a ring of `entries`, handed out in order
    and given back (mostly) in order, as jobs of one stream end."""

    def __init__(self, entries: int):
        self._entries = entries
        self._head = 0
        # (start, end) of each run in use, oldest first.
        self._taken: collections.deque = collections.deque()

    def take(self, count: int) -> tuple[int, int] | None:
        """`count` (at least 1) consecutive entries, or None when there is no room."""
        size = self._entries
        head = self._head
        if not self._taken:
            head = 0
        else:
            oldest = self._taken[0][0]
            if head > oldest:  # in use: [oldest, head)
                if head + count > size:
                    head = 0
                    if count > oldest:
                        return None
            elif head + count > oldest:  # wrapped; free: [head, oldest)
                return None
        if head + count > size:
            return None
        span = (head, head + count)
        self._head = span[1]
        self._taken.append(span)
        return span

    def give_back(self, span: tuple[int, int]) -> None:
        if self._taken and self._taken[0] is span:
            self._taken.popleft()
        else:
            self._taken.remove(span)

    def __len__(self) -> int:
        return len(self._taken)


class IdRing(Spans):
    """Pinned host entries mirrored on the GPU, taken by jobs in order and
    given back as they end: a job's block ids are written to the host side and
    copied up with one transfer, and a store's fence is read back into an
    entry, with no tensor made per job. The spans are the event loop's; the
    completion thread reads a fence's entry before its job is given back."""

    def __init__(self, device: int, entries: int = RING_ENTRIES):
        super().__init__(entries)
        self.host_tensor = torch.empty(entries, dtype=torch.int64, pin_memory=True)
        self.gpu = torch.empty(entries, dtype=torch.int64, device=device)
        self.host = self.host_tensor.numpy()
        self.host_address = self.host_tensor.data_ptr()
        self.gpu_address = self.gpu.data_ptr()


# A load alone ends with a last chunk of this share of a full one: the kernel
# scatters the rest while the copy engine moves it, so all that is left after
# the bus is the scatter of a small chunk. A scatter runs about 14 times as fast
# as PCIe, so an eighth keeps the kernel ahead. (A store's small first chunk
# would let the copy engine start sooner, but only after a second kernel launch
# on the CPU, which here takes longer than the gather it would hide; the native
# lane, whose launch is cheaper and whose stores are also hashed on the GPU,
# starts a store alone whose first chunk would hold 16 MiB or more with one:
# cuda_staging.cpp.)
TAIL_CHUNK_SHARE = 8


def staging_chunks(blocks: int, rows: int, small_tail: bool) -> list[tuple[int, int]]:
    """(first, count) of a job's staging chunks of up to `rows` blocks. Behind
    other jobs a load's scatter overlaps the next job's copies anyway, so only
    a load alone (small_tail) gets a small last chunk."""
    tail = max(1, min(blocks, rows) // TAIL_CHUNK_SHARE) if small_tail and blocks > 1 else 0
    sizes = []
    left = blocks - tail
    while left:
        sizes.append(min(rows, left))
        left -= sizes[-1]
    if tail:
        sizes.append(tail)
    chunks, first = [], 0
    for size in sizes:
        chunks.append((first, size))
        first += size
    return chunks


class CopyStream:
    """One direction of one GPU: its streams, its staging ring, and the thread
    that reports its jobs as they finish, in order.

    `stream` runs the copy engine's transfers; in "dma" mode `kernels` runs the
    gather/scatter kernels beside it. A job's last operation (a store's last
    transfer, a load's last scatter) decides on which of the two it ends; the
    jobs of one direction end in order on that stream.
    """

    def __init__(self, device: int, name: str, loop: asyncio.AbstractEventLoop, on_done, staging_shape,
                 ring_entries: int = RING_ENTRIES, thread: bool = True):
        """thread: False where the native lane waits for the stream's jobs itself."""
        self.stream = torch.cuda.Stream(device=device)
        self.kernels = torch.cuda.Stream(device=device) if staging_shape else None
        # Each buffer holds rows of one pool slot; only this direction uses them.
        self.buffers = (
            [torch.empty(staging_shape, dtype=torch.uint8, device=device) for _ in range(STAGING_BUFFERS)]
            if staging_shape
            else []
        )
        # Per buffer: recorded when a chunk is in it (`filled`) and when the chunk
        # has left it (`drained`). Re-recorded chunk after chunk: a wait holds on
        # to the record it was enqueued after, so no event is made per chunk.
        self.filled = [torch.cuda.Event() for _ in self.buffers]
        self.drained = [torch.cuda.Event() for _ in self.buffers]
        self.used = [False] * len(self.buffers)
        self.next_buffer = 0
        # Row i of a buffer holds the i-th block of a chunk: made once, not per chunk.
        self.positions = torch.arange(staging_shape[0], dtype=torch.int64, device=device) if staging_shape else None
        self.buffer_addresses = [buffer.data_ptr() for buffer in self.buffers]
        self.ring = IdRing(device, ring_entries)
        self.handle = self.stream.cuda_stream
        self.kernels_handle = self.kernels.cuda_stream if self.kernels is not None else 0
        self.filled_handles = [cuda_calls.event_handle(e) for e in self.filled]
        self.drained_handles = [cuda_calls.event_handle(e) for e in self.drained]
        # Events that mark a job's end, by whether the thread sleeps (True) or
        # spins waiting for them: reused once their job is reported.
        self._spare_events = {True: collections.deque(), False: collections.deque()}
        self._loop = loop
        self._on_done = on_done
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        # Jobs tracked (counted by the event loop's thread) and ended (counted by
        # the completion thread): one writer each, so no update is lost.
        self._tracked = 0
        self._ended = 0
        self._thread = threading.Thread(target=self._run, name=f"kvdepot-{name}-{device}", daemon=True)
        if thread:
            self._thread.start()

    @property
    def rows(self) -> int:
        return self.buffers[0].shape[0]

    def synchronize(self) -> None:
        self.stream.synchronize()
        if self.kernels is not None:
            self.kernels.synchronize()

    @property
    def idle(self) -> bool:
        """No job of this direction is queued or running."""
        return self._tracked == self._ended

    def end_event(self, blocking: bool) -> tuple[torch.cuda.Event, int, bool]:
        """An event to record at a job's end: (event, its handle, blocking)."""
        spare = self._spare_events[blocking]
        if spare:
            return spare.pop()
        event = torch.cuda.Event(blocking=blocking)
        return event, cuda_calls.event_handle(event), blocking

    def track(self, event, job, keep_alive, fence=None) -> None:
        """Reports `job` once `event` (an end_event) has completed. keep_alive:
        what the GPU still reads until then. fence: (array, index, expected
        sequence number) of a store: array[index] holds the fence the worker's
        compute wrote, read back after the copy."""
        self._tracked += 1
        self._pending.put((event, job, keep_alive, fence))

    def _run(self) -> None:
        name_os_thread()
        # Jobs that end together are handed to the event loop together: one
        # wake-up of the loop, however many.
        carry = None
        while True:
            item = carry if carry is not None else self._pending.get()
            carry = None
            if item is None:
                return
            ended = [self._wait(item)]
            while True:
                try:
                    item = self._pending.get_nowait()
                except queue.Empty:
                    break
                if item is None or not _done(item[0][1]):
                    carry = item
                    break
                ended.append(self._wait(item))
            self._ended += len(ended)
            self._loop.call_soon_threadsafe(self._on_done, ended)

    def _wait(self, item) -> tuple:
        end, job, _, fence = item
        try:
            cuda_calls.synchronize(end[1])
            if job.trace is not None:
                job.trace["gpu_done"] = jobtrace.now()
            ok, error = True, ""
            if fence is not None and int(fence[0][fence[1]]) < fence[2]:
                # The event fired but the worker never wrote its fence: it died
                # before its compute ended, and the blocks hold no valid data.
                ok, error = False, "the worker's compute did not finish (the worker died?)"
        except RuntimeError as e:  # a failed copy (e.g. an illegal address) poisons the context
            ok, error = False, f"copy failed on the GPU: {e}"
        else:
            self._spare_events[end[2]].append(end)
        return job, ok, error

    def stop(self) -> None:
        if self._thread.is_alive():
            self._pending.put(None)


def _done(event: int) -> bool:
    try:
        return cuda_calls.query(event)
    except RuntimeError:  # _wait reports it
        return True


class ComputeGate:
    """Holds stores until their worker's compute event has completed.

    The daemon waits for a worker's event on the host, not with
    cudaStreamWaitEvent on its shared store stream: the event of a worker
    killed mid-compute never completes, and a stream waiting on it would stall
    the stores of every engine on that GPU. A store whose session ends while it
    waits here is dropped before anything was queued on the GPU.
    """

    # A store is asked at once, then every POLL_SECONDS for its first
    # FAST_SECONDS (a store submitted just after its compute), then every
    # quarter of the time it has waited, at most every SLOW_SECONDS: a store
    # waiting out a forward pass is asked a few dozen times, not every 40 us,
    # and seen at most a quarter of its wait, and 1 ms, late. Nor is it asked
    # before 3/4 of the shortest wait of the last RECENT stores that were not
    # done at once, since forward passes are alike. A store's wait is taken as
    # the time to its last ask that found it not done (a lower bound: the
    # gate's own lateness is not in it), so one store shorter than the others
    # puts the next ones back on the schedule above.
    POLL_SECONDS, FAST_SECONDS, SLOW_SECONDS = 40e-6, 500e-6, 1e-3
    RECENT = 16

    def __init__(self, loop: asyncio.AbstractEventLoop, on_open, on_failed):
        self._loop = loop
        self._on_open = on_open
        self._on_failed = on_failed
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._recent: collections.deque = collections.deque(maxlen=self.RECENT)  # the gate thread's
        self._thread = threading.Thread(target=self._run, name="kvdepot-gate", daemon=True)
        self._thread.start()

    def hold(self, job, event: torch.cuda.Event) -> None:
        self._new.put((job, event))

    def stop(self) -> None:
        """Its thread ends (within a second); stores still held are left as they are."""
        self._new.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(1.0)

    @classmethod
    def next_ask(cls, since: float, now: float, shortest: float = 0.0) -> float:
        waited = now - since
        step = cls.POLL_SECONDS if waited < cls.FAST_SECONDS else min(cls.SLOW_SECONDS, waited / 4)
        return max(now + step, since + shortest * 0.75)

    def _run(self) -> None:
        name_os_thread()
        # [job, event, when it came, when it is asked next, when an ask last found it not done (None:
        # never)], in the order they came
        waiting: list = []
        while True:
            timeout = None if not waiting else min(w[3] for w in waiting) - time.monotonic()
            try:
                item = self._new.get(timeout=timeout) if timeout is None or timeout > 0 else self._new.get_nowait()
                if item is None:
                    return
                now = time.monotonic()
                waiting.append([*item, now, now, None])  # asked at once: it may be done already
                continue  # take everything queued before polling
            except queue.Empty:
                pass
            waiting = self._sweep(waiting, time.monotonic(), False)

    def _sweep(self, waiting: list, now: float, everyone: bool) -> list:
        """Asks the stores due (every store where `everyone`); returns those still waiting.

        A store due that ended has every store asked: stores leave in the
        order they came. Newest first: a worker's later store seen done means
        its earlier ones, asked after it, are done too (their compute came
        first), where asked before it they may have ended in between."""
        ended, still, waited = [], [], []  # ended: (callback, its arguments), newest first
        shortest = min(self._recent, default=0.0)
        for entry in reversed(waiting):
            job, event, since, ask, not_done_at = entry
            if job.session.ended:
                ended.append((self._on_failed, (job, "the client went away before its compute finished")))
                continue
            if ask > now and not everyone:
                still.append(entry)
                continue
            try:
                completed = event.query()
            except RuntimeError as e:  # one bad event must not stop every other store
                ended.append((self._on_failed, (job, f"waiting for the worker's compute failed: {e}")))
                continue
            if completed:
                ended.append((self._on_open, (job,)))
                # A wait is learned only from a store asked on its schedule:
                # one asked early (another store ended) was done at some time unknown.
                if not_done_at is not None and ask <= now:
                    waited.append(not_done_at - since)
            else:
                still.append([job, event, since, self.next_ask(since, now, shortest), now])
        if not everyone and any(callback is self._on_open for callback, _ in ended):
            return self._sweep(waiting, now, True)
        self._recent.extend(waited)
        for callback, arguments in reversed(ended):
            self._loop.call_soon_threadsafe(callback, *arguments)
        return still[::-1]


def completed(event: torch.cuda.Event) -> bool:
    try:
        return event.query()
    except RuntimeError:  # the gate reports it as the job's failure
        return False
