"""The client's end of the daemon's job socket (proto: "job socket").

Frames go out from whichever thread submits; one reader thread hands every
JobReply to the client. Either side closing the connection is reported once.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable

from kvdepot.proto import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot.client")

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 64 << 20


class JobSocket:
    def __init__(
        self,
        path: str,
        session_id: str,
        on_reply: Callable[[pb.JobReply], None],
        on_lost: Callable[[str], None],
    ):
        self._on_reply = on_reply
        self._on_lost = on_lost
        self._closed = False
        self._send_lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
            self.send(pb.JobFrame(hello=pb.JobSocketHello(session_id=session_id)))
        except OSError:
            self._sock.close()
            raise
        self._reader = self._sock.makefile("rb", buffering=1 << 16)
        self._thread = threading.Thread(target=self._read, name="kvdepot-jobs", daemon=True)
        self._thread.start()

    def send(self, frame: pb.JobFrame) -> None:
        """Raises OSError when the connection is gone."""
        data = frame.SerializeToString()
        with self._send_lock:
            self._sock.sendall(_LENGTH.pack(len(data)) + data)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read(self) -> None:
        reason = "the daemon closed the job socket"
        try:
            while True:
                header = self._reader.read(_LENGTH.size)
                if len(header) < _LENGTH.size:
                    break
                (length,) = _LENGTH.unpack(header)
                if length > MAX_FRAME_BYTES:
                    reason = f"the daemon sent a frame of {length} bytes"
                    break
                data = self._reader.read(length)
                if len(data) < length:
                    break
                reply = pb.JobReply()
                reply.ParseFromString(data)
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
