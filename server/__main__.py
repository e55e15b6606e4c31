import sys

from kvdepot.server.main import main

sys.exit(main())
