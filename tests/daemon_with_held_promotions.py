"""kvdepotd whose reads from the disk tier can be held, so that a test can
keep promotions in flight for as long as it needs: a read otherwise takes
microseconds. A promotion's read waits while the file `hold` exists in the
folder $KVDEPOT_TEST_PROMOTION_GATE. No setting of the real daemon reaches this."""

import os
import sys
import time

from kvdepot.server.daemon import main
from kvdepot.server.tiers.disk import DiskMover

GATE = os.path.join(os.environ["KVDEPOT_TEST_PROMOTION_GATE"], "hold")
_read = DiskMover._read


def _held_read(self, digest, key, slots):
    while os.path.exists(GATE):
        time.sleep(0.01)
    return _read(self, digest, key, slots)


DiskMover._read = _held_read
sys.exit(main.main())
