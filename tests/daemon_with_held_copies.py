"""kvdepotd whose shared-memory copies can be held, so that a test can keep
jobs in flight (to drain, to pin blocks, to kill a client mid-job) for as
long as it needs: copies in the daemon otherwise take microseconds. A job's
copy waits while the file `hold-all` or `hold-JOBID` exists in the folder
$KVDEPOT_TEST_COPY_GATE (conftest.py's start_held_daemon makes and removes
them). No setting of the real daemon reaches this.

With the native lane, `hold-events` in the same folder keeps the daemon's
Python side from taking what the lane did: the lane goes on running and
answering jobs, and its changes reach the engines' copies together once the
file is gone, as when the event loop is slow to get to them."""

import os
import sys
import time

from kvdepot.server.daemon import main
from kvdepot.server.native import lane as native_lane
from kvdepot.server.native.depot import NativeDepot
from kvdepot.server.transports import shared_memory
from kvdepot.server.transports.shared_memory import SharedMemoryTransport

GATE = os.environ["KVDEPOT_TEST_COPY_GATE"]
_copy = SharedMemoryTransport._copy


def _wait(job_id: int) -> int:
    while os.path.exists(os.path.join(GATE, "hold-all")) or os.path.exists(os.path.join(GATE, f"hold-{job_id}")):
        time.sleep(0.01)
    return 0


def _held_copy(self, job, staging):
    _wait(job.id)
    _copy(self, job, staging)


# The Python lane: its copy waits.
SharedMemoryTransport._copy = _held_copy
# A held copy keeps its thread: enough threads that the others still run, and
# none copied on the event loop, which a held copy would stop.
shared_memory.COPY_THREADS = 64
shared_memory.INLINE_BYTES = 0

# The native lane: the same, through its hook for launchers like this one
# (its copy threads look for the same files themselves).
_open = native_lane.Lane.__init__


def _held_lane(self, lib, *args, **kwargs):
    _open(self, lib, *args, **kwargs)
    lib.kvd_test_hold_copies(self._h, GATE.encode())


native_lane.Lane.__init__ = _held_lane

_after_call = NativeDepot._after_call


def _held_events(self):
    while os.path.exists(os.path.join(GATE, "hold-events")):
        time.sleep(0.01)
    _after_call(self)


NativeDepot._after_call = _held_events
sys.exit(main.main())
