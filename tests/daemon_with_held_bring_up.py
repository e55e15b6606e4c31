"""kvdepotd whose pool comes up behind its start only while the file
$KVDEPOT_TEST_BRING_UP_GATE does not exist: the first chunk comes up as ever,
then each later chunk waits at the gate, so that a test can act while part
of the pool is still down (in a real daemon a small pool is up in
milliseconds). No setting of the real daemon reaches this."""

import os
import sys
import threading
import time

from kvdepot.server.daemon import main
from kvdepot.server.host.bring_up import BringUp

GATE = os.environ["KVDEPOT_TEST_BRING_UP_GATE"]
_register = BringUp.register


def _held_register(self, offset: int, length: int) -> None:
    if threading.current_thread().name == "kvdepot-bringup":
        while os.path.exists(GATE) and not self._stop.is_set():
            time.sleep(0.01)
    _register(self, offset, length)


BringUp.register = _held_register
sys.exit(main.main())
