"""Lookups that never block the caller: a grpc.aio channel on an event loop of its own.

vLLM's scheduler asks about every new request and must not wait for the
daemon. One thread runs the loop; any number of lookups are in flight on it at
once, and each needs the GIL only briefly when its answer arrives, so a busy
scheduler thread cannot starve them the way a pool of blocking calls is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Sequence

import grpc

from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc


class AsyncLookups:
    def __init__(self, target: str, metadata: tuple, timeout: float):
        self._target = target
        self._metadata = metadata
        self._timeout = timeout
        self._stub: pb_grpc.KVDepotStub | None = None
        self._channel: grpc.aio.Channel | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvdepot-lookups", daemon=True)
        self._thread.start()

    def submit(self, session_id: str, engine_id: int, keys: Sequence[bytes]) -> concurrent.futures.Future:
        """A future of the LookupResponse; it raises grpc.aio.AioRpcError when the daemon could not answer."""
        request = pb.LookupRequest(session_id=session_id, engine_id=engine_id, keys=keys)
        return asyncio.run_coroutine_threadsafe(self._lookup(request), self._loop)

    async def _lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self._target)
            self._stub = pb_grpc.KVDepotStub(self._channel)
        return await self._stub.Lookup(request, timeout=self._timeout, metadata=self._metadata)

    async def _close_channel(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    def close(self) -> None:
        if not self._loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close_channel(), self._loop).result(timeout=5)
        except Exception:  # closing anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
