"""kvdepotd whose shared-memory workers' registrations wait as GPU workers'
do while the CUDA transport comes up after the daemon serves (daemon/main.py
add_cuda_transport): until the file $KVDEPOT_TEST_TRANSPORT_GATE is gone;
with $KVDEPOT_TEST_TRANSPORT_FAILS set, the transport then never comes up
and that is the reason. The transport itself is there from the start, since
a shared-memory worker hands its staging memory over before it registers.
So that the waiting can be tried without a GPU. No setting of the real
daemon reaches this."""

import asyncio
import os
import sys

from kvdepot.server.daemon import main, startup
from kvdepot.server.transports.shared_memory import SharedMemoryTransport

GATE = os.environ["KVDEPOT_TEST_TRANSPORT_GATE"]
FAILS = os.environ.get("KVDEPOT_TEST_TRANSPORT_FAILS", "")
_start_housekeeping = startup.start_housekeeping
_add_transports = main.add_transports
KIND = SharedMemoryTransport.handle_kind


def _transport_coming(depot, pool) -> None:
    _add_transports(depot, pool)
    depot.transport_coming(KIND)

    async def later():
        while os.path.exists(GATE):
            await asyncio.sleep(0.01)
        transport = depot.transports.pop(KIND)
        if FAILS:
            depot.transport_failed(KIND, FAILS)
        else:
            depot.add_transport(transport)

    def housekeeping_and_later(stack, depot_):
        _start_housekeeping(stack, depot_)
        startup.start_task(stack, later())

    startup.start_housekeeping = housekeeping_and_later


main.add_transports = _transport_coming
sys.exit(main.main())
