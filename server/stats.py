"""Counters kept for the whole daemon, each namespace and each client."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from kvdepot.proto import kvdepot_pb2 as pb


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

    def to_proto(self, store_seconds: float = 0.0, load_seconds: float = 0.0) -> pb.Counters:
        msg = pb.Counters(**{f.name: getattr(self, f.name) for f in fields(self)})
        if store_seconds > 0:
            msg.store_gbps = self.stored_bytes / store_seconds / 1e9
        if load_seconds > 0:
            msg.load_gbps = self.loaded_bytes / load_seconds / 1e9
        return msg


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
