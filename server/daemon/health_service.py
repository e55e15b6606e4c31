"""grpc.health.v1 as the daemon serves it: the standard servicer, answering
only for the names the daemon sets, with a bound on the Watch streams open.

The stock servicer answers a Watch of any name, however long, with
SERVICE_UNKNOWN and keeps the stream and its request for as long as the
client leaves it open; nothing ties such a stream to a session, so without
these checks one connection could make the daemon hold gigabytes.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2

# Kubernetes probes and grpc_health_probe call Check; a Watch is an operator's
# tool, and this many at once is more than any node runs.
MAX_WATCHES = 64


class HealthService(health.aio.HealthServicer):
    def __init__(self, names: tuple[str, ...], max_watches: int = MAX_WATCHES):
        super().__init__()
        self.names = frozenset(names)
        self.max_watches = max_watches
        self.watches = 0

    async def _known(self, request, context) -> None:
        if request.service not in self.names:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"this daemon reports the health of {sorted(self.names)} only",
            )

    async def Check(self, request: health_pb2.HealthCheckRequest, context):
        await self._known(request, context)
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context):
        await self._known(request, context)
        if self.watches >= self.max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.watches} health Watch streams are open, the most the daemon keeps; use Check",
            )
        self.watches += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watches -= 1
