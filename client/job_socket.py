"""The client's end of the daemon's job socket (proto: "job socket").

Frames go out from whichever thread submits; one reader thread hands every
JobReply to the client. The connection closing under it is reported once.
`hand_over` gives the daemon a worker's staging memory on a connection of its own.
"""

from __future__ import annotations

import array
import logging
import socket
import struct
import threading
from collections.abc import Callable

from kvdepot.client.daemon_identity import check_peer, trusted_uids
from kvdepot.defaults import JOB_FRAME_HEADER, MAX_JOB_FRAME_BYTES
from kvdepot.proto import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot.client")


class JobSocketRefused(OSError):
    """The daemon did not take the hello: this session cannot use the job socket."""


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
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            check_peer(self._sock, path, trusted or trusted_uids())
            self.send(pb.JobFrame(hello=pb.JobSocketHello(session_id=session_id, quiet_submits=True)))
            self._reader = self._sock.makefile("rb", buffering=1 << 16)
            answer = self._read_reply()
            if answer is None or not answer.HasField("ready"):
                why = answer.refused.message if answer is not None and answer.HasField("refused") else "no answer"
                raise JobSocketRefused(f"the daemon refused the job socket's hello: {why}")
            # A daemon that answers every submit (older ones) says so by leaving it false.
            self.quiet = answer.ready.quiet_submits
            # From here reads block for as long as nothing comes, and a write that
            # cannot go out within `timeout` (a daemon that stopped reading) fails.
            self._sock.settimeout(None)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))
        except BaseException:
            self._sock.close()
            raise
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

    def _read_reply(self) -> pb.JobReply | None:
        return _read_one(self._reader)

    def _read(self) -> None:
        reason = "the daemon closed the job socket"
        try:
            while (reply := self._read_reply()) is not None:
                self._on_reply(reply)
        except (OSError, ValueError) as e:
            reason = f"the job socket failed: {e}"
        except Exception:
            log.exception("kvdepot job socket reader failed")
            reason = "the job socket's reader failed"
        finally:
            self._reader.close()
            self._sock.close()
            if not self._closed:
                self._on_lost(reason)


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
        with sock.makefile("rb") as reader:
            try:
                answer = _read_one(reader)
                if answer is not None and answer.HasField("staging_ready"):
                    # The byte the daemon reads itself, with the descriptor attached.
                    sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                    answer = _read_one(reader)
            except ValueError as e:
                raise JobSocketRefused(str(e)) from None
    if answer is None or not answer.HasField("staging_taken"):
        why = answer.refused.message if answer is not None and answer.HasField("refused") else "no answer"
        raise JobSocketRefused(f"the daemon did not take the worker's staging memory: {why}")
    return answer.staging_taken.staging_id


def _read_one(reader) -> pb.JobReply | None:
    """The next reply; None when the connection ended. Raises ValueError for a bad frame."""
    header = reader.read(JOB_FRAME_HEADER.size)
    if len(header) < JOB_FRAME_HEADER.size:
        return None
    (length,) = JOB_FRAME_HEADER.unpack(header)
    if length > MAX_JOB_FRAME_BYTES:
        raise ValueError(f"the daemon sent a frame of {length} bytes")
    data = reader.read(length)
    if len(data) < length:
        return None
    reply = pb.JobReply()
    reply.ParseFromString(data)
    return reply


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))
