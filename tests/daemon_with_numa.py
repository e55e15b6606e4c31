"""kvdepotd on a simulated NUMA machine: sysfs is read from the fake tree at
$KVDEPOT_TEST_SYSFS (numa.SYSFS_ROOT), and a shared-memory worker registered
with the device name "numaN" stores as if its memory were on node N (a GPU
worker's node comes from its GPU's PCI device; a CPU worker has none). No
setting of the real daemon reaches this."""

import os
import re
import sys

from kvdepot.server.daemon import main
from kvdepot.server.host import numa
from kvdepot.server.transports.shared_memory import SharedMemoryTransport

numa.SYSFS_ROOT = os.environ["KVDEPOT_TEST_SYSFS"]
_open_worker = SharedMemoryTransport.open_worker


def _open_worker_on_its_node(self, worker, spec):
    _open_worker(self, worker, spec)
    match = re.fullmatch(r"numa(\d+)", worker.device)
    worker.node = int(match.group(1)) if match else None


SharedMemoryTransport.open_worker = _open_worker_on_its_node
sys.exit(main.main())
