import sys

from kvdepot.server.daemon.main import main

sys.exit(main())
