"""tests/daemon_with_held_bring_up.py whose first late restore (a kept block
adopted as its chunk came up) raises, as a bug there would."""

import os
import sys

from kvdepot.server.tiers import warm

_restore = warm.WarmPool._restore
failed = []


def _failing_restore(self, checked, waited=False):
    if waited and not failed:
        failed.append(1)
        raise RuntimeError("injected failure in a late restore")
    return _restore(self, checked, waited)


warm.WarmPool._restore = _failing_restore
sys.argv[0] = os.path.join(os.path.dirname(__file__), "daemon_with_held_bring_up.py")
exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"))
