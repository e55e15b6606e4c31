"""kvdepotd whose CUDA stores do not wait for the compute that wrote their
blocks: only to show that the ordering test can fail. No setting of the real
daemon reaches this; the test injects it here."""

import sys

from kvdepot.server.daemon import main
from kvdepot.server.transports.cuda import CudaTransport

CudaTransport.wait_for_compute = False
sys.exit(main.main())
