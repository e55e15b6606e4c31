"""kvdepotd in a process that may open few files ($KVDEPOT_TEST_NOFILE, soft
and hard): as under a tight LimitNOFILE. Run by the tests instead of
`-m kvdepot.server`."""

import os
import resource
import sys

from kvdepot.server.daemon import main

limit = int(os.environ["KVDEPOT_TEST_NOFILE"])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
sys.exit(main.main())
