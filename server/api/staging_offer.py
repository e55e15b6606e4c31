"""A staging offer: a job socket connection whose first frame, instead of a
hello, offers a worker's staging memory. The memory comes as a file
descriptor (SCM_RIGHTS) with the one byte the client sends once it reads
staging_ready, which asyncio's streams cannot carry: the connection stops
its stream, and the byte is read here from a duplicate of its socket."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

from kvdepot.errors import FailedPrecondition, InvalidArgument, KVDepotError
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.server.api.answers import job_frame, job_refused
from kvdepot.server.host.peer import receive_descriptors

# The descriptor's byte follows staging_ready by a round trip: polled at this
# interval at first, doubling up to the last.
_FIRST_POLL_S = 0.0005
_LAST_POLL_S = 0.05


class StagingOffer:
    """Waits for one offer's descriptor, gives it to `take` (which returns the
    staging id, or raises why not), answers and closes the connection. The
    connection's hello deadline ends the wait."""

    def __init__(self, transport: asyncio.Transport, request_id: int, take: Callable[[int], int], events,
                 broken: Callable[[str], None]):
        self._transport = transport
        self._request_id = request_id
        self._take = take
        self._events = events
        self._broken = broken  # closes the connection, saying why
        self._timer: asyncio.TimerHandle | None = None
        # Nothing more is read through the stream: the next byte carries the
        # descriptor. It is read from a duplicate of the socket, polled from
        # timers: watching the duplicate with the loop (add_reader) would
        # leave an epoll registration behind for a descriptor then closed.
        transport.pause_reading()
        sock = transport.get_extra_info("socket")
        self._socket: socket.socket | None = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(sock.fileno()))
        self._socket.setblocking(False)
        transport.write(job_frame(pb.JobReply(request_id=request_id, staging_ready=pb.StagingReady())))
        self._poll(_FIRST_POLL_S)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _poll(self, delay: float) -> None:
        self._timer = None
        if self._socket is None:
            return
        try:
            data, descriptors, truncated = receive_descriptors(self._socket)
        except (BlockingIOError, InterruptedError):
            self._timer = asyncio.get_running_loop().call_later(delay, self._poll, min(delay * 2, _LAST_POLL_S))
            return
        except OSError as e:
            self.stop()
            self._broken(f"a staging offer whose connection failed ({e})")
            return
        self.stop()
        try:
            if not data:
                raise FailedPrecondition("the connection ended before the staging descriptor came")
            if len(descriptors) != 1 or truncated:
                raise InvalidArgument("a staging offer's byte must carry exactly one descriptor")
            taken = pb.StagingTaken(staging_id=self._take(descriptors.pop()))
            reply = job_frame(pb.JobReply(request_id=self._request_id, staging_taken=taken))
        except KVDepotError as e:
            reply = job_refused(self._request_id, e)
        except Exception as e:
            self._events.warning("failed staging", "taking a staging memory failed", exc_info=True)
            reply = job_refused(self._request_id, RuntimeError(f"taking the staging memory failed: {e}"))
        finally:
            for fd in descriptors:
                os.close(fd)
        if not self._transport.is_closing():
            self._transport.write(reply)
            self._transport.close()
