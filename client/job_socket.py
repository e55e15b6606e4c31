"""The client's end of the daemon's job socket (proto: "job socket").

Frames go out from whichever thread submits. Replies are read by one thread
at a time: a reader thread of the connection's, or a thread waiting for its
jobs (`lead`), which then reads them itself instead of waiting for the reader
thread to hand them over: a thread wake-up less between a job's end and its
waiter. The connection closing under either is reported once, by the reader thread.
`hand_over` gives the daemon a worker's staging memory on a connection of its own.
"""

from __future__ import annotations

import array
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from kvdepot.client.daemon_identity import check_peer, trusted_uids
from kvdepot.defaults import JOB_FRAME_HEADER, MAX_JOB_FRAME_BYTES
from kvdepot.proto import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot.client")

# How much one read takes from the socket, and how many reads one look at it
# makes before the reader looks at its claim or its jobs again.
READ_BYTES = 1 << 16
READS_PER_PUMP = 8
# How long a waiting thread that reads the socket sleeps at most before it
# looks again at its jobs, which other threads can end too (a cancel, the
# session lost).
LEAD_POLL_S = 0.01


class JobSocketRefused(OSError):
    """The daemon did not take the hello (or a staging hand-over); `code`: the
    status number of its JobRefused, where it gave one."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class JobSocket:
    """Connects and says hello; raises OSError (JobSocketRefused when the daemon
    answers no) within `timeout` seconds, which also bounds every later write;
    UntrustedDaemon, before anything is sent, when the peer's uid is not in `trusted`."""

    def __init__(
        self,
        path: str,
        session_id: str,
        on_reply: Callable[[pb.JobReply], None],
        on_lost: Callable[[str], None],
        timeout: float,
        trusted: frozenset[int] | None = None,
    ):
        self._on_reply = on_reply
        self._on_lost = on_lost
        self._closed = False
        self._send_lock = threading.Lock()
        # Bytes read and not yet a whole reply; only the thread that holds _turn touches them.
        self._buffer = bytearray()
        self._chunk = bytearray(READ_BYTES)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            check_peer(self._sock, path, trusted or trusted_uids())
            self.send(pb.JobFrame(hello=pb.JobSocketHello(session_id=session_id, quiet_submits=True)))
            answer = _read_reply(self._sock, self._buffer, self._chunk)
            if answer is None or not answer.HasField("ready"):
                why = answer.refused.message if answer is not None and answer.HasField("refused") else "no answer"
                raise JobSocketRefused(f"the daemon refused the job socket's hello: {why}")
            # A daemon that answers every submit (older ones) says so by leaving it false.
            self.quiet = answer.ready.quiet_submits
            # From here reads wait in poll for as long as nothing comes, and a
            # write that cannot go out within `timeout` (a daemon that stopped
            # reading) fails.
            self._sock.settimeout(None)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))
            self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except BaseException:
            self._sock.close()
            raise
        # Whoever reads the socket holds _turn. A waiting thread that wants to
        # read claims it (_claimed, under _state) and wakes the reader thread,
        # which stands aside until the claim ends. _ended: why the connection
        # ended, once it has.
        self._turn = threading.Lock()
        self._state = threading.Condition()
        self._claimed = False
        self._ended: str | None = None
        self._fd = self._sock.fileno()
        self._idle_poll = select.poll()
        self._idle_poll.register(self._fd, select.POLLIN)
        self._idle_poll.register(self._wake, select.POLLIN)
        self._lead_poll = select.poll()
        self._lead_poll.register(self._fd, select.POLLIN)
        self._thread = threading.Thread(target=self._read, name="kvdepot-jobs", daemon=True)
        self._thread.start()

    def send(self, frame: pb.JobFrame) -> None:
        """Raises OSError when the connection is gone or the daemon does not read."""
        data = frame.SerializeToString()
        with self._send_lock:
            self._sock.sendall(JOB_FRAME_HEADER.pack(len(data)) + data)

    def close(self, timeout: float = 5.0) -> None:
        """Shuts the connection and waits for the reader: once this returns, no
        reply of this connection reaches `on_reply` any more."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def lead(self, done: Callable[[], bool], deadline: float | None) -> None:
        """Reads replies on this thread until `done()` is true, the connection
        ends or time.monotonic() passes `deadline`; returns at once when
        another waiting thread reads already (its replies reach this one's
        jobs as well). `done` is called without any lock of this socket's."""
        with self._state:
            if self._claimed or self._ended is not None or self._closed:
                return
            self._claimed = True
        try:
            os.eventfd_write(self._wake, 1)
            if not self._turn.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
                return
            try:
                while self._ended is None and not done():
                    wait = LEAD_POLL_S if deadline is None else min(LEAD_POLL_S, deadline - time.monotonic())
                    if wait <= 0:
                        return
                    self._pump(self._lead_poll, wait)
            finally:
                self._turn.release()
        finally:
            with self._state:
                self._claimed = False
                self._state.notify_all()

    def _read(self) -> None:
        try:
            with self._turn:
                self._dispatch()  # what came with the hello's answer
            while True:
                with self._state:
                    self._state.wait_for(lambda: not self._claimed)
                    if self._ended is not None:
                        break
                with self._turn:
                    while not self._claimed and self._ended is None:
                        self._pump(self._idle_poll, None)
        except Exception:
            log.exception("kvdepot job socket reader failed")
            self._end("the job socket's reader failed")
        finally:
            with self._state:
                if self._ended is None:
                    self._ended = "the job socket's reader failed"
                # No claim starts from here (lead), and none reads a closed socket.
                self._state.wait_for(lambda: not self._claimed)
            self._sock.close()
            os.close(self._wake)
            if not self._closed:
                self._on_lost(self._ended)

    def _pump(self, poller, wait: float | None) -> None:
        """Waits up to `wait` seconds (None: for as long as it takes) for
        replies or a wake-up, and hands over every whole reply that came. Only
        the thread that holds _turn calls it."""
        try:
            ready = poller.poll(None if wait is None else wait * 1000)
            for fd, _ in ready:
                if fd == self._wake:
                    os.eventfd_read(self._wake)
            if not any(fd == self._fd for fd, _ in ready):
                return
            for _ in range(READS_PER_PUMP):
                try:
                    n = self._sock.recv_into(self._chunk, READ_BYTES, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                except InterruptedError:
                    continue
                if n == 0:
                    self._end("the daemon closed the job socket")
                    return
                self._buffer += memoryview(self._chunk)[:n]
                self._dispatch()  # the buffer holds at most a frame and a read
                if n < READ_BYTES:
                    return
        except (OSError, ValueError) as e:
            self._end(f"the job socket failed: {e}")
        except Exception:
            log.exception("kvdepot job socket reader failed")
            self._end("the job socket's reader failed")

    def _dispatch(self) -> None:
        """Hands over the whole replies in the buffer. Raises ValueError for a bad frame."""
        buffer, start = self._buffer, 0
        try:
            while (reply := _take_one(buffer, start)) is not None:
                start, reply = reply
                self._on_reply(reply)
        finally:
            del buffer[:start]

    def _end(self, reason: str) -> None:
        with self._state:
            if self._ended is None:
                self._ended = reason
            self._state.notify_all()


def hand_over(path: str, session_id: str, fd: int, timeout: float, trusted: frozenset[int] | None = None) -> int:
    """Hands the daemon a descriptor of the worker's staging memory; returns
    its staging id. Raises OSError when the daemon cannot be reached, and
    JobSocketRefused (with the daemon's reason) when it does not take it, and
    UntrustedDaemon, before the memory is offered, when the peer is not trusted."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        check_peer(sock, path, trusted or trusted_uids())
        data = pb.JobFrame(staging=pb.StagingOffer(session_id=session_id)).SerializeToString()
        sock.sendall(JOB_FRAME_HEADER.pack(len(data)) + data)
        buffer, chunk = bytearray(), bytearray(READ_BYTES)
        try:
            answer = _read_reply(sock, buffer, chunk)
            if answer is not None and answer.HasField("staging_ready"):
                # The byte the daemon reads itself, with the descriptor attached.
                sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                answer = _read_reply(sock, buffer, chunk)
        except ValueError as e:
            raise JobSocketRefused(str(e)) from None
    if answer is None or not answer.HasField("staging_taken"):
        refused = answer is not None and answer.HasField("refused")
        why = answer.refused.message if refused else "no answer"
        raise JobSocketRefused(f"the daemon did not take the worker's staging memory: {why}",
                               answer.refused.code if refused else None)
    return answer.staging_taken.staging_id


def _read_reply(sock: socket.socket, buffer: bytearray, chunk: bytearray) -> pb.JobReply | None:
    """The next reply, read in the socket's blocking way (within its timeout);
    None when the connection ended. Raises ValueError for a bad frame."""
    while (taken := _take_one(buffer, 0)) is None:
        n = sock.recv_into(chunk, len(chunk))
        if n == 0:
            return None
        buffer += memoryview(chunk)[:n]
    end, reply = taken
    del buffer[:end]
    return reply


def _take_one(buffer: bytearray, start: int) -> tuple[int, pb.JobReply] | None:
    """(where the next reply ends, the reply) of the reply at `start`; None
    while it is not whole. Raises ValueError for a bad frame."""
    end = start + JOB_FRAME_HEADER.size
    if len(buffer) < end:
        return None
    (length,) = JOB_FRAME_HEADER.unpack_from(buffer, start)
    if length > MAX_JOB_FRAME_BYTES:
        raise ValueError(f"the daemon sent a frame of {length} bytes")
    if len(buffer) < end + length:
        return None
    reply = pb.JobReply()
    try:
        reply.ParseFromString(buffer[end : end + length])
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(f"the daemon sent a frame that is not a JobReply: {e}") from None
    return end + length, reply


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))
